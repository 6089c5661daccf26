"""Training metrics: model FLOPs, tokens/s, TFLOP/s per device, MFU; JSONL + TensorBoard + progress bar.

MFU (PaLM, Chowdhery et al. 2022, appendix B) = model FLOPs per step / (step time x peak x devices).
Model FLOPs count the useful math only: no activation recomputation, no MoE capacity padding.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax

from meshrun.config import ModelConfig

# Dense bf16 tensor-core peak FLOP/s by device-kind substring; the first match wins (specific first).
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): 1,979 TFLOP/s bf16 with sparsity -> 989 dense.
    ("H200", 989e12),
    # NVIDIA H100 Tensor Core GPU datasheet: PCIe 1,513 TFLOP/s bf16 with sparsity -> 756 dense.
    ("H100 PCIe", 756e12),
    # NVIDIA H100 datasheet (SXM5): 1,979 TFLOP/s bf16 with sparsity -> 989 dense.
    ("H100", 989e12),
    # NVIDIA A100 Tensor Core GPU datasheet (40/80 GB, SXM and PCIe): 312 TFLOP/s bf16 dense.
    ("A100", 312e12),
)


def peak_flops(device: Any = None) -> float | None:
    """Dense bf16 peak of `device` (a jax Device or a device_kind string); None when unknown (CPU)."""
    device = jax.devices()[0] if device is None else device
    kind = device if isinstance(device, str) else getattr(device, "device_kind", "")
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in kind.lower():
            return flops
    return None


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """Weights in the matmuls one token passes through: attention (GQA-aware), MLP (MoE: the top_k
    activated experts + the router), and the logit projection. Embedding lookups and norms are not GEMMs."""
    d, q, kv = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    attn = d * q + 2 * d * kv + q * d  # Wq, Wk, Wv, Wo
    mlp = (3 if cfg.mlp == "swiglu" else 2) * d * cfg.d_ff  # swiglu: gate, up, down; gelu: up, down
    n_moe = cfg.n_layers // cfg.moe_every if cfg.is_moe else 0
    moe = cfg.top_k * mlp + d * cfg.n_experts
    return cfg.n_layers * attn + (cfg.n_layers - n_moe) * mlp + n_moe * moe + d * cfg.vocab


def model_flops_per_step(cfg: ModelConfig, global_batch: int, seq_len: int, *, causal_skip: bool = False) -> float:
    """Training FLOPs per step, forward + backward (backward = 2 x forward), no recomputation:

        6 * matmul_params_per_token * B * s  +  12 * L * s^2 * (n_heads * head_dim) * B

    The first term is 2 FLOPs per multiply-add x 3 (fwd + bwd) per weight per token (Kaplan 2020; PaLM
    appendix B). The second is the attention scores QK^T and A.V, 2 GEMMs of 2 s^2 h FLOPs each per
    sequence and layer, x3 for the backward (PaLM appendix B: 12 L H Q T per token). For GPT (gelu,
    d_ff = 4h, full MHA, untied or tied logits) this equals Megatron-LM's (Narayanan et al. 2021, sec. 5.1)
    72 B s L h^2 (1 + s/(6h) + V/(12 L h)) exactly. `causal_skip=True` halves the attention term, for
    kernels that skip fully masked blocks (flash attention): then it is 72 B s L h^2 (1 + s/(12h) + V/(12 L h)).
    """
    tokens = global_batch * seq_len
    attn = 12.0 * cfg.n_layers * seq_len**2 * cfg.n_heads * cfg.head_dim * global_batch
    return 6.0 * matmul_params_per_token(cfg) * tokens + (attn / 2 if causal_skip else attn)


def throughput(
    step_time_s: float, *, flops_per_step: float, tokens_per_step: int, n_devices: int, peak: float | None = None
) -> dict[str, float]:
    """tokens/s, TFLOP/s per device, and MFU (only when the per-device `peak` FLOP/s is known)."""
    out = {
        "tokens_per_s": tokens_per_step / step_time_s,
        "tflops_per_device": flops_per_step / step_time_s / n_devices / 1e12,
    }
    if peak:
        out["mfu"] = flops_per_step / (step_time_s * peak * n_devices)
    return out


def _fmt_time(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _scalar(v: Any) -> Any:
    """JSON-able value: jax/numpy scalars -> float/int; strings and bools kept."""
    if isinstance(v, (str, bool, int)) or v is None:
        return v
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return f if math.isfinite(f) else str(f)  # JSON has no nan/inf; keep them readable


class MetricsLogger:
    """One JSON line per `log` in run_dir/metrics.jsonl, a progress line on stderr, TensorBoard events
    (run_dir/tb) when tensorboardX is installed. Only process 0 writes anything."""

    def __init__(self, run_dir: str | Path, *, total_steps: int, quiet: bool = False, stream=None):
        self.total_steps, self.quiet = total_steps, quiet
        self.stream = stream if stream is not None else sys.stderr
        self.active = jax.process_index() == 0
        self._file = self._tb = self.path = None
        self._t0 = self._step0 = None
        self._bar_open = False
        if not self.active:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        try:
            from tensorboardX import SummaryWriter  # optional dependency

            self._tb = SummaryWriter(str(run_dir / "tb"))
        except ImportError:
            pass

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.active:
            return
        now = time.monotonic()
        if self._t0 is None:
            self._t0, self._step0 = now, step
        row = {"step": int(step), **{k: _scalar(v) for k, v in metrics.items()}, "time": time.time()}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, int(step))
        if not self.quiet:
            self._progress(step, row, now)

    def _progress(self, step: int, row: dict, now: float) -> None:
        done = step - self._step0
        eta = (now - self._t0) / done * (self.total_steps - step) if done > 0 else None
        parts = [f"step {step}/{self.total_steps}"]
        if isinstance(row.get("loss"), float):
            parts.append(f"loss {row['loss']:.4f}")
        if isinstance(row.get("tokens_per_s"), float):
            parts.append(f"{row['tokens_per_s']:,.0f} tok/s")
        if isinstance(row.get("mfu"), float):
            parts.append(f"MFU {100 * row['mfu']:.1f}%")
        parts.append(f"ETA {_fmt_time(eta)}" if eta is not None else "ETA --")
        line = "  ".join(parts)
        if self.stream.isatty():
            width = 30
            filled = int(width * min(step, self.total_steps) / max(self.total_steps, 1))
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {line}\x1b[K")
            self._bar_open = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar_open:
            self.stream.write("\n")
            self.stream.flush()
            self._bar_open = False
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def profile_trace(run_dir: str | Path, enabled: bool) -> Iterator[Path | None]:
    """jax.profiler.trace into run_dir/profile when enabled (open it with TensorBoard or Perfetto)."""
    if not enabled:
        yield None
        return
    out = Path(run_dir) / "profile"
    out.mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(out)):
        yield out
