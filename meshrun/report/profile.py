"""Trace a few train steps with `jax.profiler` and report per pipeline stage (`meshrun.analysis.trace`):
`meshrun profile`, and `train.profile=true` inside a run."""

from __future__ import annotations

import json
from pathlib import Path

import jax

from meshrun.analysis.profiler import trace_options
from meshrun.analysis.trace import device_intervals, draw_timeline, load_trace, report_of_trace
from meshrun.data.datasets import global_batch_arrays
from meshrun.errors import MATPLOTLIB_FIX
from meshrun.parallel.sharding import batch_spec
from meshrun.train.prepare import prepare
from meshrun.train.restore import initial_params


def profile(cfg, steps: int, out: str | Path, timeline: bool = True) -> dict:
    """Compile, run one step, trace `steps` steps into `out`; the report (see `report_of_trace`).
    `timeline`: also draw out/timeline.png (one traced step per device by phase, `draw_timeline`):
    rep["timeline_png"] is its path, or None with rep["timeline_note"] saying why not."""
    mesh, train_step, ds = prepare(cfg)
    init = cfg.checkpoint.init_params
    state = train_step.init_from(initial_params(cfg, train_step, True)) if init else train_step.init()
    batch = lambda s: global_batch_arrays(ds, s, mesh, batch_spec(mesh, tokens=False))
    compiled = train_step.step.lower(state, *batch(0)).compile()
    state, metrics = compiled(state, *batch(0))
    jax.block_until_ready(metrics)
    Path(out).mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(out), create_perfetto_trace=True, profiler_options=trace_options()):
        for s in range(1, steps + 1):
            state, metrics = compiled(state, *batch(s))
            jax.block_until_ready(metrics)
    text = compiled.as_text()
    rep = report_of_trace(out, text, cfg, mesh, steps, train_step.plan.stage_bubbles)
    if timeline:
        png = Path(out) / "timeline.png"
        sched = f"{cfg.pipeline.schedule}, {cfg.pipeline.microbatches} microbatches" if mesh.shape["pipe"] > 1 else ""
        shape = " x ".join(f"{a}{n}" for a, n in mesh.shape.items() if n > 1) or "1 device"
        try:
            title = f"one traced step: {cfg.model.family} on {shape}" + (f", {sched}" if sched else "")
            draw_timeline(device_intervals(load_trace(out), text, mesh), mesh, png, title)
            rep["timeline_png"] = str(png)
        except ImportError:
            rep["timeline_png"], rep["timeline_note"] = None, f"matplotlib is not installed: {MATPLOTLIB_FIX}"
        except OSError as e:
            rep["timeline_png"], rep["timeline_note"] = None, f"cannot write {png} ({e.strerror or e})"
        Path(out, "profile.json").write_text(json.dumps(rep, indent=1) + "\n")  # with the picture's path
    return rep
