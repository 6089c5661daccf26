"""Training metrics: tokens/s, TFLOP/s per device, MFU; JSONL + TensorBoard + progress bar.

MFU (PaLM, Chowdhery et al. 2022, appendix B) = model FLOPs per step / (step time x peak x devices).
Model FLOPs (`meshrun.analysis.flops.model_flops`) count the useful math only: no activation recomputation,
no MoE capacity padding. Peaks come from the GPU catalogue (`meshrun.planner.hardware`).
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

from meshrun.planner.hardware import peak_flops_of_kind


def peak_flops(device: Any = None) -> float | None:
    """Dense bf16 peak of `device` (a jax Device or a device_kind string); None when unknown (CPU)."""
    device = jax.devices()[0] if device is None else device
    kind = device if isinstance(device, str) else getattr(device, "device_kind", "")
    return peak_flops_of_kind(kind)


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
        if isinstance(row.get("val_loss"), float):
            parts.append(f"val_loss {row['val_loss']:.4f}")
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


def trace_options() -> jax.profiler.ProfileOptions:
    """meshrun's profiler settings: no Python function events (compiling a step alone fills the
    trace's 1M-event cap with them, crowding out the device ops `meshrun.analysis.trace` reads)."""
    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 0
    return opts


@contextlib.contextmanager
def profile_trace(run_dir: str | Path, enabled: bool) -> Iterator[Path | None]:
    """jax.profiler.trace into run_dir/profile when enabled (open it with TensorBoard or Perfetto; the
    Perfetto file is what `meshrun.analysis.trace` reads)."""
    if not enabled:
        yield None
        return
    out = Path(run_dir) / "profile"
    out.mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(out), create_perfetto_trace=True, profiler_options=trace_options()):
        yield out
