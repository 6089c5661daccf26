"""The training loop: data -> jitted step -> metrics -> orbax checkpoints, resumable and preemptible."""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from meshrun.checkpoint import Checkpointer, PreemptionFlag, check_run_dir_writable
from meshrun.config import RunConfig, to_dict
from meshrun.data import global_batch_arrays, make_dataset
from meshrun.flops import model_flops
from meshrun.mesh import build_mesh
from meshrun.metrics import MetricsLogger, peak_flops
from meshrun.sharding import DP_AXES
from meshrun.train import make_train_step


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. a NaN/Inf loss); the last good checkpoint is left intact."""


def checkpoint_meta(cfg: RunConfig) -> dict[str, Any]:
    """What a checkpoint must agree on to be restored: the model (layouts are free to differ)."""
    return {"model": to_dict(cfg.model)}


def run(
    cfg: RunConfig, *, devices: list | None = None, quiet: bool = False, stop_after: int | None = None
) -> dict[str, Any]:
    """Train `cfg.train.steps` steps (resuming from the newest complete checkpoint in run_dir).
    `stop_after`: stop (without the final save) once this many steps ran in this call (tests)."""
    t = cfg.train
    check_run_dir_writable(t.run_dir)
    mesh = build_mesh(cfg.mesh, devices=devices)
    fns = make_train_step(cfg, mesh)
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=t.seq_len, global_batch=t.global_batch)
    ckpt = Checkpointer(t.run_dir, cfg.checkpoint, meta=checkpoint_meta(cfg))
    start = ckpt.latest_step() if cfg.checkpoint.resume else None
    state = fns.to_run(ckpt.restore(start, fns.abstract_state)) if start is not None else fns.init()
    start = start or 0
    if start >= t.steps:
        print(
            f"meshrun: {t.run_dir} already holds a checkpoint at step {start} >= train.steps={t.steps}; "
            "nothing to train (raise train.steps or use a new train.run_dir)",
            file=sys.stderr,
        )

    flops = model_flops(cfg.model, t.global_batch, t.seq_len)
    peak = peak_flops(jax.devices()[0])
    bubble = _bubble(cfg, mesh)
    logger = MetricsLogger(t.run_dir, total_steps=t.steps, quiet=quiet)
    flag = PreemptionFlag()
    first_loss = loss = None
    timed_s, timed_steps, ran = 0.0, 0, 0
    try:
        with _maybe_profile(t):
            for step in range(start, t.steps):
                tokens, labels = global_batch_arrays(ds, step, mesh, P(DP_AXES))
                t0 = time.perf_counter()
                state, metrics = fns.step(state, tokens, labels)
                metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
                dt = time.perf_counter() - t0
                loss = metrics["loss"]
                if not math.isfinite(loss):
                    raise TrainingError(
                        f"loss is {loss} at step {step + 1}; stopped without saving. The last good checkpoint "
                        f"(step {ckpt.latest_step()}) in {t.run_dir} is intact; lower train.lr or check the data"
                    )
                first_loss = loss if first_loss is None else first_loss
                ran += 1
                if ran > 1:  # the first step includes compilation
                    timed_s, timed_steps = timed_s + dt, timed_steps + 1
                tps = t.global_batch * t.seq_len / dt
                tflops = flops / dt / mesh.size / 1e12
                logger.log(
                    step + 1,
                    {
                        **metrics,
                        "lr": _lr(cfg, step),
                        "step_time_s": dt,
                        "tokens_per_s": tps,
                        "tflops_per_device": tflops,
                        "bubble_fraction": bubble,
                        **({"mfu": tflops * 1e12 / peak} if peak else {}),
                    },
                )
                if stop_after is not None and ran >= stop_after:
                    ckpt.wait()
                    break
                stop = flag.should_stop()  # agreed by all processes, so they save and leave at the same step
                if stop or ckpt.should_save(step + 1):  # every checkpoint.every steps, or now
                    ckpt.save(step + 1, fns.to_model(state), force=stop)
                if stop:
                    break
            else:
                ckpt.save(t.steps, fns.to_model(state), force=True)
        ckpt.wait()
    finally:
        ckpt.close()
        logger.close()
        flag.close()
    tps = t.global_batch * t.seq_len * timed_steps / timed_s if timed_s else 0.0
    return {
        "step": start + ran,
        "loss": loss,
        "first_loss": first_loss,
        "tokens_per_s": tps,
        "run_dir": t.run_dir,
        "preempted": flag.is_set(),
    }


def _lr(cfg: RunConfig, step: int) -> float:
    from meshrun.train import lr_schedule

    return float(lr_schedule(cfg)(step))


def _bubble(cfg: RunConfig, mesh) -> float:
    p = mesh.shape["pipe"]
    if p == 1:
        return 0.0
    from meshrun.pipeline.schedules import bubble_fraction, build

    pc = cfg.pipeline
    return bubble_fraction(build(pc.schedule, p, pc.microbatches, pc.virtual))


def _maybe_profile(t):
    import contextlib

    if not t.profile:
        return contextlib.nullcontext()
    from meshrun.metrics import profile_trace

    return profile_trace(t.run_dir, True)
