"""Training metrics: tokens/s, TFLOP/s per device, MFU; metrics.jsonl, the `train.loggers` (TensorBoard,
Weights & Biases, MLflow: `meshrun.train.loggers`) and the progress bar.

MFU (PaLM, Chowdhery et al. 2022, appendix B) = model FLOPs per step / (step time x peak x devices).
Model FLOPs (`Family.model_flops`: the family's `flops_per_token`, else `meshrun.analysis.flops.model_flops`
for transformer families) count the useful math only: no activation recomputation, no MoE capacity
padding; a family with neither gets no TFLOP/s and no MFU. Peaks come from the GPU catalogue
(`meshrun.planner.hardware`).
"""

from __future__ import annotations

import collections
import json
import math
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax

from meshrun.planner.hardware import peak_flops_of_kind
from meshrun.train.loggers import open_loggers


def peak_flops(device: Any = None) -> float | None:
    """Dense bf16 peak of `device` (a jax Device or a device_kind string); None when unknown (CPU)."""
    device = jax.devices()[0] if device is None else device
    kind = device if isinstance(device, str) else getattr(device, "device_kind", "")
    return peak_flops_of_kind(kind)


def throughput(
    step_time_s: float, *, flops_per_step: float | None, tokens_per_step: int, n_devices: int, peak: float | None = None
) -> dict[str, float]:
    """tokens/s; TFLOP/s per device when the step's FLOPs are known, and MFU when the per-device `peak`
    FLOP/s is known too."""
    out = {"tokens_per_s": tokens_per_step / step_time_s}
    if flops_per_step is not None:  # a family that declares no FLOPs: no TFLOP/s, no MFU
        out["tflops_per_device"] = flops_per_step / step_time_s / n_devices / 1e12
        if peak:
            out["mfu"] = flops_per_step / (step_time_s * peak * n_devices)
    return out


def memory_in_use() -> dict[str, int]:
    """{"memory_in_use": bytes} of the first local device where the backend reports it (GPU/TPU; not XLA:CPU)."""
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without memory stats
        return {}
    return {"memory_in_use": int(stats["bytes_in_use"])} if "bytes_in_use" in stats else {}


class MetricRows:
    """What is in a metrics.jsonl row: the step's metrics (with step_cpu_s, the process's CPU seconds
    in the step) plus lr, step time,
    tokens/s, TFLOP/s per device and MFU (when the family's FLOPs and the device's peak are known),
    the pipeline bubble and device memory."""

    def __init__(self, cfg: Any, n_devices: int, bubble: float, lr: Callable[[int], float], family: Any):
        t = cfg.train
        self.n_devices, self.bubble, self.lr = n_devices, bubble, lr
        self.tokens = t.global_batch * t.seq_len
        self.flops = family.model_flops(cfg.model, t.global_batch, t.seq_len)
        self.peak = peak_flops(jax.devices()[0])

    def row(self, metrics: dict, step: int, dt: float) -> dict:
        """The row of 0-based `step` that took `dt` seconds."""
        speed = throughput(
            dt, flops_per_step=self.flops, tokens_per_step=self.tokens, n_devices=self.n_devices, peak=self.peak
        )
        return {
            **metrics,
            "lr": float(self.lr(step)),
            "step_time_s": dt,
            **speed,
            "bubble_fraction": self.bubble,
            **memory_in_use(),
        }


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


def _row_parts(row: dict, mean: float | None) -> list[str]:
    """The progress line's fields of a row; tokens/s smoothed by the `mean` step time."""
    st, parts = row.get("step_time_s"), []
    f = lambda k: isinstance(row.get(k), float)  # noqa: E731
    if f("loss"):
        parts.append(f"loss {row['loss']:.4f}")
    if f("val_loss"):
        parts.append(f"val_loss {row['val_loss']:.4f}")
    if f("tokens_per_s"):  # smoothed: tokens per step / the mean step time
        parts.append(f"{row['tokens_per_s'] * (st / mean if mean and f('step_time_s') else 1):,.0f} tok/s")
    if f("step_time_s"):
        parts.append(f"{1000 * st:.0f} ms/step")
    if f("lr"):
        parts.append(f"lr {row['lr']:.2e}")
    if f("grad_norm"):
        parts.append(f"gnorm {row['grad_norm']:.3f}")
    if f("mfu"):
        parts.append(f"MFU {100 * row['mfu']:.1f}%")
    if isinstance(row.get("memory_in_use"), (int, float)):
        parts.append(f"mem {row['memory_in_use'] / 2**30:.2f} GiB")
    if isinstance(row.get("dropped_tokens"), (int, float)):
        parts.append(f"dropped {row['dropped_tokens']:.0f}")
    if f("moe_aux_loss"):
        parts.append(f"aux {row['moe_aux_loss']:.4f}")
    return parts


class MetricsLogger:
    """One JSON line per `log` in run_dir/metrics.jsonl, a progress line on stderr, and the same row to
    each of `loggers` (`meshrun.train.loggers`: tensorboard, wandb, mlflow), which get `config` once.
    Only process 0 writes anything."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        total_steps: int,
        quiet: bool = False,
        stream=None,
        loggers: tuple[str, ...] = (),
        config: dict[str, Any] | None = None,
    ):
        self.total_steps, self.quiet = total_steps, quiet
        self.stream = stream if stream is not None else sys.stderr
        self.active = jax.process_index() == 0
        self._file = self.path = None
        self._sinks: list[Any] = []
        self._t0 = self._step0 = None
        self._bar_open = False
        self._recent: collections.deque = collections.deque(maxlen=10)
        if not self.active:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self._sinks = open_loggers(tuple(loggers), run_dir, config)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.active:
            return
        now = time.monotonic()
        if self._t0 is None:
            self._t0, self._step0 = now, step
        row = {"step": int(step), **{k: _scalar(v) for k, v in metrics.items()}, "time": time.time()}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        for sink in self._sinks:
            sink.log(int(step), row)
        if not self.quiet:
            self._progress(step, row, now)

    def _progress(self, step: int, row: dict, now: float) -> None:
        """loss, smoothed tokens/s (mean over the last logged steps), step time, lr, grad norm, MFU,
        MoE counters, and an ETA from the smoothed step time (stable: no compile or eval time in it)."""
        st = row.get("step_time_s")
        if isinstance(st, float) and st > 0:
            self._recent.append(st)
        mean = sum(self._recent) / len(self._recent) if self._recent else None
        parts = [f"step {step}/{self.total_steps}", *_row_parts(row, mean)]
        done = step - self._step0
        eta = (
            mean * (self.total_steps - step)
            if mean
            else (now - self._t0) / done * (self.total_steps - step)
            if done > 0
            else None
        )
        parts.append(f"ETA {_fmt_time(eta)}" if eta is not None else "ETA --")
        self._write("  ".join(parts), step)

    def _write(self, line: str, step: int) -> None:
        """A progress bar on a terminal, else one line per row."""
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
        for sink in self._sinks:
            sink.close()
        self._sinks = []

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
