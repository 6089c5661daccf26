"""The training loop: data -> jitted step -> metrics -> orbax checkpoints, resumable and preemptible."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from meshrun.analysis.flops import model_flops
from meshrun.checkpoint.params import check_params, restore_params
from meshrun.checkpoint.state import CheckpointDamaged, Checkpointer, PreemptionFlag, check_run_dir_writable
from meshrun.checkpoint.store import newest_complete, scan
from meshrun.config import PipelineConfig, RunConfig, to_dict
from meshrun.data.datasets import global_batch_arrays, make_dataset
from meshrun.errors import CheckpointError, ConfigError, DistributedError, TrainingError
from meshrun.parallel.sharding import DP_AXES
from meshrun.runtime.mesh import build_mesh
from meshrun.runtime.runlock import RunLock, note_takeover
from meshrun.train.metrics import MetricsLogger, peak_flops
from meshrun.train.step import make_train_step

__all__ = ["TrainingError", "checkpoint_meta", "prepare", "run"]  # TrainingError: kept importable from here


def checkpoint_meta(cfg: RunConfig) -> dict[str, Any]:
    """What a checkpoint must agree on to be restored: the model (layouts are free to differ); also
    where its parameters came from (`meshrun export-hf` finds the Hugging Face config there)."""
    return {"model": to_dict(cfg.model), "init_params": cfg.checkpoint.init_params}


def warn(msg: str) -> None:
    if jax.process_index() == 0:
        print(f"meshrun: warning: {msg}", file=sys.stderr, flush=True)


def config_warnings(cfg: RunConfig, mesh) -> list[str]:
    """Settings that are valid but have no effect on this mesh. `pipeline.schedule`/`virtual` (and the
    layer split: `layers_per_stage`, `balance`) with
    mesh.pipe = 1 warn rather than fail: the same config file is often run with `mesh.pipe=1` to
    debug, and they take effect again as soon as pipe > 1 (`pipeline.microbatches` still counts:
    gradient accumulation)."""
    out = []
    if mesh.shape["pipe"] == 1:
        default = PipelineConfig()
        keys = ("schedule", "virtual", "layers_per_stage", "balance")
        keys = [k for k in keys if getattr(cfg.pipeline, k) != getattr(default, k)]
        if keys:
            given = ", ".join(f"pipeline.{k}={getattr(cfg.pipeline, k)}" for k in keys)
            out.append(f"{given} ignored: mesh.pipe is 1 (no pipeline); set mesh.pipe > 1 to use it, or drop it")
    return out


def prepare(cfg: RunConfig, devices: list | None = None):
    """Everything that can be checked before a file is written: the mesh, the cross-component checks
    (`train.validate`, inside make_train_step, which builds no arrays), the data. Returns (mesh, fns, ds)."""
    mesh = build_mesh(cfg.mesh, devices=devices)
    for msg in config_warnings(cfg, mesh):
        warn(msg)
    fns = make_train_step(cfg, mesh)
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch)
    if cfg.train.eval_every and ds.val is None:
        raise ConfigError(
            "train.eval_every",
            cfg.train.eval_every,
            "hold out documents with data.kind=prepared and data.val_fraction > 0, or set train.eval_every=0",
            "there is no validation split",
        )
    if cfg.checkpoint.init_params:
        check_params(cfg.checkpoint.init_params, fns.abstract_state.params)
    return mesh, fns, ds


def check_checkpoints(cfg: RunConfig) -> list[int]:
    """Read-only checks of RUN_DIR/checkpoints against the config; returns the steps to try, oldest
    first (complete ones, and STEP/ directories whose metadata looks damaged: restoring them fails and
    moves them aside, so that a new save of that step is not skipped). checkpoint.resume=false with
    checkpoints there, a newest step past train.steps, or only moved-aside damaged checkpoints
    (resume=true) -> an error before anything is written or trained."""
    t, run_dir = cfg.train, cfg.train.run_dir
    entries = scan(run_dir)
    complete = sorted({e.step for e in entries if e.name.isdigit() and e.status != "partial"})
    if entries and not cfg.checkpoint.resume:
        listed = ", ".join(f"{e.step} ({e.status})" for e in entries[:5]) + (" ..." if len(entries) > 5 else "")
        raise ConfigError(
            "checkpoint.resume",
            False,
            f"use a new train.run_dir, delete {Path(run_dir) / 'checkpoints'}, or set checkpoint.resume=true",
            f"{run_dir} already holds checkpoints (steps {listed}); a fresh run there would mix with them",
        )
    if not cfg.checkpoint.resume:
        return []
    if complete and complete[-1] > t.steps:
        raise ConfigError(
            "train.steps",
            t.steps,
            f"set train.steps >= {complete[-1]} to continue that run, or use a new train.run_dir",
            f"{run_dir} holds a checkpoint at step {complete[-1]}, past train.steps",
        )
    damaged = [e for e in entries if e.status == "damaged"]
    if damaged and not complete:
        raise CheckpointError(
            f"no intact checkpoint in {Path(run_dir) / 'checkpoints'} (damaged: "
            f"{', '.join(e.name for e in damaged)}); move them out of the way to start over, or use a new "
            "train.run_dir (`meshrun checkpoints RUN_DIR` lists them)"
        )
    return complete


def restore_newest_intact(ckpt: Checkpointer, fns, steps: list[int]) -> tuple[Any, int | None]:
    """(state, step) from the newest checkpoint of `steps` that restores; each one that fails is
    reported in one line and moved aside. None of them -> CheckpointError. No steps -> (None, None)."""
    tried = []
    for step in reversed(steps):
        try:
            state, err = fns.to_run(ckpt.restore(step, fns.abstract_state)), None
        except CheckpointDamaged as e:
            state, err = None, e
        if _agree(err is None):
            return state, step
        moved = ckpt.move_aside(step)
        tried.append(moved.name)
        why = err.why if err is not None else "another process could not restore it"
        older = "trying the next older one" if step != steps[0] else "no older checkpoint left"
        warn(f"checkpoint step {step} is damaged ({why}); moved it aside to {moved}; {older}")
    if tried:
        raise CheckpointError(
            f"no intact checkpoint in {ckpt.directory}: every one failed to restore and was moved aside "
            f"({', '.join(tried)}); use a new train.run_dir, or move them out of the way to start over"
        )
    return None, None


def _agree(ok: bool) -> bool:
    """True when every process says ok (one process: `ok`)."""
    if jax.process_count() == 1:
        return ok
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.process_allgather(np.array([ok], np.int32))).all())


def _take_lock(run_dir: str) -> RunLock | None:
    """Process 0 locks the run dir (the other processes share it); all processes learn the outcome."""
    lock, err = None, None
    if jax.process_index() == 0:
        try:
            lock = RunLock(run_dir).acquire()
        except ConfigError as e:
            err = e
    if not _agree(err is None):
        if err is not None:
            raise err
        raise ConfigError("train.run_dir", run_dir, "see process 0's message", "process 0 could not lock it")
    if lock is not None:
        note_takeover(lock)
    return lock


def _should_log(cfg: RunConfig, step: int, ran: int, last: bool) -> bool:
    """train.log_every=k: the first step of this call, every k-th step, and the last one (the run's
    end, a preemption or `stop_after`). NaN/Inf stops the run without a row."""
    return ran == 1 or last or step % cfg.train.log_every == 0


def run(
    cfg: RunConfig, *, devices: list | None = None, quiet: bool = False, stop_after: int | None = None
) -> dict[str, Any]:
    """Train `cfg.train.steps` steps (resuming from the newest intact checkpoint in run_dir).
    `stop_after`: stop (without the final save) once this many steps ran in this call (tests).

    Order: everything checkable first (mesh, config, data, existing checkpoints) and nothing is
    written until it passed; then the run-dir lock, the checkpointer, the metrics file."""
    t = cfg.train
    # SIGTERM from here on (start-up, compilation, restore) stops the run at the first step boundary.
    flag = PreemptionFlag()
    closers: list = [flag.close]
    ckpt = None
    try:
        mesh, fns, ds = prepare(cfg, devices)
        check_run_dir_writable(t.run_dir)
        lock = _take_lock(t.run_dir)
        if lock is not None:
            closers.append(lock.release)  # released last, after the final save is on disk
        steps = check_checkpoints(cfg)
        ckpt = Checkpointer(t.run_dir, cfg.checkpoint, meta=checkpoint_meta(cfg))
        closers.insert(0, ckpt.close)
        state, start = restore_newest_intact(ckpt, fns, steps) if steps else (None, None)
        if state is None and cfg.checkpoint.init_params:  # param-only start: fresh optimizer, step 0
            state = fns.init_from(restore_params(cfg.checkpoint.init_params, fns.abstract_state.params))
        state = state if state is not None else fns.init()
        start = start or 0
        if start >= t.steps:
            warn(f"{t.run_dir} already holds the final checkpoint (step {start} = train.steps); nothing to train")
        result = _train(cfg, mesh, fns, ds, ckpt, state, start, quiet, stop_after, closers, flag)
    except BaseException as e:
        lost = lost_peer(e)
        if lost is not None:  # the job is over: a save or a barrier would wait for the dead process
            _close_all([c for c in closers if ckpt is None or c != ckpt.close], quiet=True)
            raise DistributedError(f"{lost}; {_resume_hint(t.run_dir)}") from e
        _close_all(closers, quiet=True)  # a failure while closing must not hide the one that got us here
        raise
    _close_all(closers, quiet=False)
    return result


# What a collective or the coordination service says when another process of the job is gone.
_PEER_GONE = ("Gloo", "NCCL", "Connection reset", "Connection closed", "Socket closed", "heartbeat",
              "coordination service", "UNAVAILABLE", "DEADLINE_EXCEEDED")  # fmt: skip


def lost_peer(e: BaseException) -> str | None:
    """A one-line description when `e` (raised in a multi-process job) says another process is gone:
    a collective failed (gloo: 'Connection reset by peer') or the coordination service lost a task.
    None otherwise (single process, or any other error)."""
    if isinstance(e, (ConfigError, KeyboardInterrupt)):
        return None
    if not jax.distributed.is_initialized() or jax.process_count() == 1:
        return None
    text = str(e)
    if not any(k in text for k in _PEER_GONE):
        return None
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)
    return (
        f"process {jax.process_index()} of {jax.process_count()}: lost contact with another process "
        f"({type(e).__name__}: {first[:200]}); it probably died: see the launcher's report and that process's log"
    )


def _resume_hint(run_dir: str) -> str:
    newest = newest_complete(run_dir)
    newest = f"newest: step {newest.step}" if newest else "none written yet"
    return (
        f"checkpoints already in {run_dir} are intact ({newest}); rerun to resume, or launch with "
        "MAX_RESTARTS=K to restart automatically"
    )


def _close_all(closers: list, quiet: bool) -> None:
    """Call every closer (the lock last); re-raise the first failure unless `quiet`."""
    first = None
    for close in closers:
        try:
            close()
        except Exception as e:  # noqa: BLE001
            first = first or e
    if first is not None and not quiet:
        raise first


def _train(cfg, mesh, fns, ds, ckpt, state, start, quiet, stop_after, closers, flag) -> dict[str, Any]:
    t = cfg.train
    flops = model_flops(cfg.model, t.global_batch, t.seq_len)
    peak = peak_flops(jax.devices()[0])
    bubble = _bubble(cfg, mesh)
    logger = MetricsLogger(t.run_dir, total_steps=t.steps, quiet=quiet)
    closers.insert(0, logger.close)
    first_loss = loss = val_loss = None
    timed_s, timed_steps, ran = 0.0, 0, 0
    eval_step = None
    if t.eval_every:
        from meshrun.train.evaluate import evaluate, make_eval_step

        eval_step = make_eval_step(cfg, mesh, fns)
    with _maybe_profile(t):
        for step in range(start, t.steps):
            batch = global_batch_arrays(ds, step, mesh, P(DP_AXES))  # tokens, labels[, segment_ids]
            t0 = time.perf_counter()
            state, metrics = fns.step(state, *batch)
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
            stop = flag.should_stop()  # agreed by all processes, so they save and leave at the same step
            cut = stop_after is not None and ran >= stop_after
            last = stop or cut or step + 1 == t.steps
            if eval_step is not None and ((step + 1) % t.eval_every == 0 or last):
                metrics |= evaluate(eval_step, state.params, ds.val, t.eval_batches, mesh)
                val_loss = metrics["val_loss"]
            if _should_log(cfg, step + 1, ran, last=last) or "val_loss" in metrics:
                tflops = flops / dt / mesh.size / 1e12
                logger.log(
                    step + 1,
                    {
                        **metrics,
                        "lr": _lr(cfg, step),
                        "step_time_s": dt,
                        "tokens_per_s": t.global_batch * t.seq_len / dt,
                        "tflops_per_device": tflops,
                        "bubble_fraction": bubble,
                        **({"mfu": tflops * 1e12 / peak} if peak else {}),
                    },
                )
            if cut:
                break
            if stop or ckpt.should_save(step + 1):  # every checkpoint.every steps, or now
                ckpt.save(step + 1, fns.to_model(state), force=stop)
            if stop:
                break
        else:
            ckpt.save(t.steps, fns.to_model(state), force=True)
    ckpt.wait()
    if t.profile and ran:
        _profile_report(cfg, mesh, fns, state, batch, ran)
    tps = t.global_batch * t.seq_len * timed_steps / timed_s if timed_s else 0.0
    return {
        "step": start + ran,
        "loss": loss,
        "first_loss": first_loss,
        "tokens_per_s": tps,
        "run_dir": t.run_dir,
        "preempted": flag.is_set(),
        **({"val_loss": val_loss} if val_loss is not None else {}),
    }


def _lr(cfg: RunConfig, step: int) -> float:
    from meshrun.train.step import lr_schedule

    return float(lr_schedule(cfg)(step))


def _bubble(cfg: RunConfig, mesh) -> float:
    p = mesh.shape["pipe"]
    if p == 1:
        return 0.0
    from meshrun.pipeline.schedules import bubble_fraction, build

    pc = cfg.pipeline
    return bubble_fraction(build(pc.schedule, p, pc.microbatches, pc.virtual))


def _profile_report(cfg: RunConfig, mesh, fns, state, batch, ran: int) -> None:
    """train.profile=true: the `meshrun profile` report of the traced steps, on stderr and in
    RUN_DIR/profile/profile.json. Best effort: a failure is a warning, never the run's end."""
    if jax.process_index() != 0:
        return
    from meshrun.analysis.trace import format_report, report_of_trace

    try:
        text = fns.step.lower(state, *batch).compile().as_text()  # the step's cached executable
        rep = report_of_trace(Path(cfg.train.run_dir) / "profile", text, cfg, mesh, ran)
        print(format_report(rep, "train.profile"), file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001
        warn(f"train.profile: no bubble report ({type(e).__name__}: {e})")


def _maybe_profile(t):
    import contextlib

    if not t.profile:
        return contextlib.nullcontext()
    from meshrun.train.metrics import profile_trace

    return profile_trace(t.run_dir, True)
