"""jax.profiler with meshrun's settings: `profile_trace(run_dir, enabled)` traces into run_dir/profile.

The Perfetto file it writes is what `meshrun.analysis.trace` reads (`meshrun profile`, `train.profile`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import jax


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
