"""Trace a few train steps with `jax.profiler` and report per pipeline stage (`meshrun.analysis.trace`)."""

from __future__ import annotations

from pathlib import Path

import jax
from jax.sharding import PartitionSpec as P

from meshrun.analysis.trace import report_of_trace
from meshrun.checkpoint.params import restore_params
from meshrun.data.datasets import global_batch_arrays
from meshrun.parallel.sharding import DP_AXES
from meshrun.train.loop import prepare
from meshrun.train.metrics import trace_options


def profile(cfg, steps: int, out: str | Path) -> dict:
    """Compile, run one step, trace `steps` steps into `out`; the report (see `report_of_trace`)."""
    mesh, train_step, ds = prepare(cfg)
    init = cfg.checkpoint.init_params
    state = train_step.init_from(restore_params(init, train_step.abstract_state.params)) if init else train_step.init()
    batch = lambda s: global_batch_arrays(ds, s, mesh, P(DP_AXES))
    compiled = train_step.step.lower(state, *batch(0)).compile()
    state, metrics = compiled(state, *batch(0))
    jax.block_until_ready(metrics)
    Path(out).mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(out), create_perfetto_trace=True, profiler_options=trace_options()):
        for s in range(1, steps + 1):
            state, metrics = compiled(state, *batch(s))
            jax.block_until_ready(metrics)
    return report_of_trace(out, compiled.as_text(), cfg, mesh, steps, train_step.plan.stage_bubbles)
