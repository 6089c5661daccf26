"""The training loop: data -> jitted step -> side jobs (hooks) -> orbax checkpoints, resumable and preemptible.

`run` checks everything first (`prepare`, the run dir, its checkpoints: `restore`), then takes the
run-dir lock (`runtime.processes`), restores and trains. Each step runs the side jobs due then
(`side_jobs.SideJobs.hooks`: checks, evaluation, metric rows, saves).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from meshrun.checkpoint.local import LocalTier, check_local_dir
from meshrun.checkpoint.state import Checkpointer, PreemptionFlag, check_run_dir_writable
from meshrun.config import RunConfig, to_dict
from meshrun.data.datasets import global_batch_arrays
from meshrun.errors import ConfigError, DistributedError, TrainingError
from meshrun.parallel.sharding import batch_spec
from meshrun.runtime.faults import Faults
from meshrun.runtime.processes import agree, lost_peer, say, take_lock, warn
from meshrun.runtime.watchdog import Watchdog
from meshrun.train.config_file import warn_config_differs, write_config
from meshrun.train.hooks import StepInfo
from meshrun.train.metrics import MetricsLogger
from meshrun.train.plan import StepPlan
from meshrun.train.prepare import Prepared, prepare
from meshrun.train.restore import (
    check_checkpoints,
    check_same_model,
    checkpoint_meta,
    initial_state,
    resume_hint,
    run_first_loss,
)
from meshrun.train.saves import Saves
from meshrun.train.side_jobs import SideJobs, profile_report, trace
from meshrun.train.step import TrainStep

__all__ = ["TrainingError", "checkpoint_meta", "prepare", "run"]  # kept importable from here


Startup = Callable[[RunConfig, Any, StepPlan], list[str]]  # (config, mesh, plan) -> the start-up block's lines


def run(
    cfg: RunConfig,
    *,
    devices: list | None = None,
    quiet: bool = False,
    stop_after: int | None = None,
    startup: Startup | None = None,
) -> dict[str, Any]:
    """Train `cfg.train.steps` steps (resuming from the newest intact checkpoint in run_dir).
    `stop_after`: stop (without the final save) once this many steps ran in this call (tests).
    `startup`: the start-up block to print once the checks passed (`meshrun.report.startup.startup_lines`).

    Order: everything checkable first (mesh, config, data, existing checkpoints) and nothing is
    written until it passed; then the run-dir lock, the checkpointer, the metrics file."""
    t = cfg.train
    # SIGTERM from here on (start-up, compilation, restore) stops the run at the first step boundary.
    flag = PreemptionFlag()
    closers: list = [flag.close]
    ckpt = None
    try:
        faults = Faults.from_env(jax.process_index())
        built = prepare(cfg, devices)
        _check_and_lock(cfg, closers)
        steps = check_checkpoints(cfg)
        ckpt = Checkpointer(t.run_dir, cfg.checkpoint, meta=checkpoint_meta(cfg))
        closers.insert(0, ckpt.close)
        tier = _local_tier(cfg, closers)
        _start_up(cfg, built, ckpt, steps, startup, quiet)
        dog = _watchdog(cfg, built, closers)
        dog.phase("restore", 0)
        state, start = initial_state(cfg, ckpt, built.train_step, steps, quiet, tier)
        write_config(cfg)  # once the run dir's state was accepted: a refused rerun leaves the old one
        stepper = Stepper(built.train_step, state, dog, faults)
        result = _train(cfg, built, stepper, Saves(ckpt, quiet, tier), Bounds(start, stop_after, flag), quiet)
    except BaseException as e:
        _close_after(e, closers, ckpt, t.run_dir)
        raise
    _close_all(closers, quiet=False)
    return result


def _check_and_lock(cfg: RunConfig, closers: list) -> None:
    """The last checks before anything is written (every process's local checkpoint dir, the run dir
    writable), then the run-dir lock (`runtime.processes.take_lock`)."""
    check_local_tier(cfg)
    check_run_dir_writable(cfg.train.run_dir)
    lock = take_lock(cfg.train.run_dir)
    if lock is not None:
        closers.append(lock.release)  # released last, after the final save is on disk


def _start_up(
    cfg: RunConfig, built: Prepared, ckpt: Checkpointer, steps: list[int], startup: Startup | None, quiet: bool
) -> None:
    """The run dir's checkpoints hold this model (refused before the start-up block, alone), the
    start-up block, and a warning where the config differs from the run dir's."""
    check_same_model(ckpt, built.train_step, steps)
    for line in startup(cfg, built.mesh, built.train_step.plan) if startup is not None else []:
        say(line, quiet)
    warn_config_differs(cfg, steps)


def _local_tier(cfg: RunConfig, closers: list) -> LocalTier | None:
    """The local checkpoint tier when checkpoint.local_every is set; closed before the checkpointer."""
    if not cfg.checkpoint.local_every:
        return None
    tier = LocalTier(cfg.checkpoint, cfg.train.run_dir, checkpoint_meta(cfg))
    closers.insert(0, tier.close)
    return tier


def _close_after(e: BaseException, closers: list, ckpt: Checkpointer | None, run_dir: str) -> None:
    """Close everything after the failure `e` (quietly: a failure while closing must not hide it); a
    lost peer becomes a DistributedError that says how to resume."""
    lost = lost_peer(e)
    if lost is not None:  # the job is over: a save or a barrier would wait for the dead process
        _close_all([c for c in closers if ckpt is None or c != ckpt.close], quiet=True)
        raise DistributedError(f"{lost}; {resume_hint(run_dir)}") from e
    _close_all(closers, quiet=True)


def check_local_tier(cfg: RunConfig) -> None:
    """Every process checks its own checkpoint.local_dir; all of them fail when one does."""
    err = None
    try:
        check_local_dir(cfg.checkpoint, jax.process_index())
    except ConfigError as e:
        err = e
    if not agree(err is None):
        if err is not None:
            raise err
        raise ConfigError("checkpoint.local_dir", cfg.checkpoint.local_dir, "see the other processes' messages",
                          "another process cannot write it")  # fmt: skip


def _watchdog(cfg: RunConfig, built: Prepared, closers: list) -> Watchdog:
    """The step watchdog of this process, closed first; its hang record names the mesh axes the step
    spans."""
    t, mesh = cfg.train, {a: n for a, n in built.mesh.shape.items() if n > 1}
    dog = Watchdog(t.run_dir, timeout_s=t.step_timeout, compile_allowance_s=t.compile_allowance,
                   process=jax.process_index(), processes=jax.process_count(), known={"mesh": mesh})  # fmt: skip
    closers.insert(0, dog.close)
    return dog


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


class Stepper:
    """The state the loop advances and the executable that advances it: the step compiled ahead of
    step 1 (so that step 1's time excludes compilation), else the jitted step. Tells the watchdog
    each phase; runs the fault-injection hooks (`runtime.faults`)."""

    def __init__(self, train_step: TrainStep, state: Any, dog: Watchdog, faults: Faults):
        self.train_step, self.state, self.dog, self.faults = train_step, state, dog, faults
        self.compiled: Any = None
        self.ready = False  # a first step ran: until then peers may still be compiling (compile_allowance)

    def compile(self, batch, step: int, quiet: bool) -> None:
        """Compile ahead of 1-based `step`; where that fails, the jitted step compiles on its first call."""
        self.dog.phase("compile", step)
        self.faults.before_compile()
        say("compiling ...", quiet)
        t0 = time.perf_counter()
        try:
            self.compiled = self.train_step.step.lower(self.state, *batch).compile()
        except Exception as e:  # noqa: BLE001 - the jitted call reports a real error itself
            warn(f"ahead-of-time compilation failed ({type(e).__name__}); compiling at step 1")
            return
        say(f"compiled in {time.perf_counter() - t0:.1f} s", quiet)

    def __call__(self, batch, step: int) -> tuple[dict[str, float], float]:
        """1-based `step` on `batch`, advancing the state: (metrics as floats plus step_cpu_s, the
        process's CPU seconds in the call over all its threads; seconds in the call)."""
        self.dog.phase("step" if self.ready else "first step", step)
        self.faults.before_step(step)
        t0, c0 = time.perf_counter(), time.process_time()
        self.state, metrics = self._call(batch)
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        dt = time.perf_counter() - t0
        metrics["step_cpu_s"] = time.process_time() - c0
        self.dog.step_done(step, dt)
        self.ready = True
        return metrics, dt

    def _call(self, batch):
        if self.compiled is not None:
            try:
                return self.compiled(self.state, *batch)
            except (TypeError, ValueError):  # arguments the executable was not compiled for (shardings)
                self.compiled = None
        return self.train_step.step(self.state, *batch)


@dataclass(frozen=True)
class Bounds:
    """Where this call of `run` starts, and what stops it before train.steps: `stop_after` steps run
    in this call (tests), or the preemption `flag` (SIGTERM), agreed by all processes."""

    start: int
    stop_after: int | None
    flag: PreemptionFlag

    def decide(self, info: StepInfo, steps: int) -> StepInfo:
        """Whether `info`'s step is this call's last: preemption (agreed by all processes, so that they
        save and leave at the same step), `stop_after`, or the run's end at `steps`."""
        info.stop = self.flag.should_stop()
        info.cut = self.stop_after is not None and info.ran >= self.stop_after
        info.last = info.stop or info.cut or info.step == steps
        return info


@dataclass
class Tally:
    """What the loop has seen so far in this call."""

    first_loss: float | None = None
    loss: float | None = None
    val_loss: float | None = None
    timed_s: float = 0.0  # step seconds after the first (compiling) step
    timed_steps: int = 0
    ran: int = 0

    def add(self, loss: float, dt: float) -> int:
        """Count a step; returns how many ran."""
        self.loss = loss
        self.first_loss = loss if self.first_loss is None else self.first_loss
        self.ran += 1
        if self.ran > 1:  # the first step includes compilation
            self.timed_s, self.timed_steps = self.timed_s + dt, self.timed_steps + 1
        return self.ran


def _train(cfg: RunConfig, built: Prepared, stepper: Stepper, saves: Saves, b: Bounds, quiet: bool) -> dict[str, Any]:
    """Steps start..train.steps: batch, step, then the side jobs due (`SideJobs.hooks`); stop early on
    preemption or `stop_after`."""
    t, mesh, ts = cfg.train, built.mesh, built.train_step
    batch_of = lambda step: global_batch_arrays(built.ds, step, mesh, batch_spec(mesh, tokens=False))  # noqa: E731
    tally, batch = Tally(), None
    config = to_dict(cfg)  # logged once by each of train.loggers
    with MetricsLogger(t.run_dir, total_steps=t.steps, quiet=quiet, loggers=t.loggers, config=config) as logger:
        jobs = SideJobs(cfg, built, stepper, saves, tally, logger, quiet)
        hooks = jobs.hooks()
        if b.start < t.steps:
            stepper.compile(batch_of(b.start), b.start + 1, quiet)
        with trace(cfg):
            for step in range(b.start + 1, t.steps + 1):
                t0 = time.perf_counter()
                batch = batch_of(step - 1)  # tokens, labels[, segment_ids]
                metrics, dt = stepper(batch, step)
                host_s = time.perf_counter() - t0 - dt  # the batch and the previous step's hooks
                info = b.decide(StepInfo(step, metrics, dt, host_s, tally.add(metrics["loss"], dt)), t.steps)
                hooks.run(info)
                if info.stop or info.cut:
                    break
            else:
                jobs.save_final()
        jobs.finish(b.start + tally.ran)
    stepper.dog.close()
    if t.profile and tally.ran:
        profile_report(cfg, mesh, ts, stepper.state, batch, tally.ran)
    return _result(cfg, tally, b)


def _result(cfg: RunConfig, tally: Tally, b: Bounds) -> dict[str, Any]:
    t = cfg.train
    tps = t.global_batch * t.seq_len * tally.timed_steps / tally.timed_s if tally.timed_s else 0.0
    return {
        "step": b.start + tally.ran,
        "loss": tally.loss,
        "first_loss": run_first_loss(t.run_dir, tally.first_loss) if b.start else tally.first_loss,
        "tokens_per_s": tps,
        "run_dir": t.run_dir,
        "preempted": b.flag.is_set(),
        **({"val_loss": tally.val_loss} if tally.val_loss is not None else {}),
    }
