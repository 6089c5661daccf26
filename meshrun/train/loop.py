"""The training loop: data -> jitted step -> metrics -> orbax checkpoints, resumable and preemptible."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

from meshrun.analysis.flops import model_flops
from meshrun.analysis.trace import format_report, report_of_trace
from meshrun.checkpoint.params import check_params, restore_params
from meshrun.checkpoint.state import CheckpointDamaged, Checkpointer, PreemptionFlag, check_run_dir_writable
from meshrun.checkpoint.store import newest_complete, scan
from meshrun.config import PipelineConfig, RunConfig, to_dict
from meshrun.data.datasets import global_batch_arrays, make_dataset
from meshrun.errors import CheckpointError, ConfigError, DistributedError, TrainingError
from meshrun.parallel.sharding import DP_AXES
from meshrun.runtime.mesh import build_mesh
from meshrun.runtime.runlock import RunLock, note_takeover
from meshrun.train.evaluate import evaluate, make_eval_step
from meshrun.train.metrics import MetricsLogger, peak_flops, profile_trace, startup_lines
from meshrun.train.step import TrainStep, lr_schedule, make_train_step

__all__ = ["TrainingError", "checkpoint_meta", "prepare", "run"]  # TrainingError: kept importable from here


def checkpoint_meta(cfg: RunConfig) -> dict[str, Any]:
    """What a checkpoint must agree on to be restored: the model (layouts are free to differ); also
    where its parameters came from (`meshrun export-hf` finds the Hugging Face config there)."""
    data = {"kind": cfg.data.kind, "path": os.path.abspath(cfg.data.path) if cfg.data.path else ""}
    return {"model": to_dict(cfg.model), "init_params": cfg.checkpoint.init_params, "data": data}


def warn(msg: str) -> None:
    if jax.process_index() == 0:
        print(f"meshrun: warning: {msg}", file=sys.stderr, flush=True)


def say(msg: str, quiet: bool = False) -> None:
    """An informational line on stderr from process 0 (start-up block, lifecycle); none with --quiet."""
    if not quiet and jax.process_index() == 0:
        print(msg, file=sys.stderr, flush=True)


CONFIG_FILE = "config.yaml"


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


# Fields a resume routinely changes (a run dir moved or copied, more steps): not worth a warning.
RESUME_FREE = frozenset({"train.run_dir", "train.steps"})


def config_diff(old: dict, new: dict) -> list[str]:
    """`section.key old -> new` for every resolved field that differs between two config dicts
    (RESUME_FREE left out)."""
    a, b = _flat(old), _flat(new)
    keys = sorted((a.keys() | b.keys()) - RESUME_FREE)
    return [f"{k} {a.get(k)!r} -> {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


def read_config(run_dir: str) -> dict | None:
    """The config.yaml a previous run left in `run_dir` (a dict), None when there is none or it is unreadable."""
    old = None
    with contextlib.suppress(Exception):
        old = yaml.safe_load((Path(run_dir) / CONFIG_FILE).read_text())
    return old if isinstance(old, dict) else None


def write_config(cfg: RunConfig) -> None:
    """RUN_DIR/config.yaml: the resolved config, the one a rerun should use (atomic: a temp file
    renamed over it). Process 0 only."""
    if jax.process_index() != 0:
        return
    path = Path(cfg.train.run_dir) / CONFIG_FILE
    tmp = path.with_name(f".{CONFIG_FILE}.{os.getpid()}.tmp")
    try:
        tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        os.replace(tmp, path)
    except OSError as e:  # a full disk: no half-written temp file left, the message names the file
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror, str(path)) from None


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
    (`build_plan`, inside make_train_step, which builds no arrays), the data. Returns (mesh, train_step, ds)."""
    mesh = build_mesh(cfg.mesh, devices=devices)
    for msg in config_warnings(cfg, mesh):
        warn(msg)
    train_step = make_train_step(cfg, mesh)
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch,
                      vocab_used=cfg.model.vocab_used)  # fmt: skip
    if cfg.train.eval_every and ds.val is None:
        raise ConfigError(
            "train.eval_every",
            cfg.train.eval_every,
            "hold out documents with data.kind=prepared and data.val_fraction > 0, or set train.eval_every=0",
            "there is no validation split",
        )
    if cfg.checkpoint.init_params:
        check_params(cfg.checkpoint.init_params, train_step.abstract_state.params)
    return mesh, train_step, ds


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


def restore_newest_intact(ckpt: Checkpointer, train_step: TrainStep, steps: list[int]) -> tuple[Any, int | None]:
    """(state, step) from the newest checkpoint of `steps` that restores; each one that fails is
    reported in one line and moved aside. None of them -> CheckpointError. No steps -> (None, None)."""
    tried = []
    for step in reversed(steps):
        try:
            state, err = train_step.to_run(ckpt.restore(step, train_step.abstract_state)), None
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
        mesh, train_step, ds = prepare(cfg, devices)
        check_run_dir_writable(t.run_dir)
        lock = _take_lock(t.run_dir)
        if lock is not None:
            closers.append(lock.release)  # released last, after the final save is on disk
        steps = check_checkpoints(cfg)
        for line in startup_lines(cfg, mesh, train_step.plan):
            say(line, quiet)
        old = read_config(t.run_dir)
        if steps and old is not None and (diff := config_diff(old, to_dict(cfg))):
            warn(f"resuming with a config that differs from {Path(t.run_dir) / CONFIG_FILE}: " + "; ".join(diff))
        ckpt = Checkpointer(t.run_dir, cfg.checkpoint, meta=checkpoint_meta(cfg))
        closers.insert(0, ckpt.close)
        state, start = _initial_state(cfg, ckpt, train_step, steps, quiet)
        write_config(cfg)  # once the run dir's state was accepted: a refused rerun leaves the old one
        result = _train(Run(cfg, mesh, train_step, ds, ckpt, state, start, quiet, stop_after, closers, flag))
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


def _initial_state(
    cfg: RunConfig, ckpt: Checkpointer, train_step: TrainStep, steps: list[int], quiet: bool = False
) -> tuple[Any, int]:
    """(state, first step): the newest intact checkpoint, else checkpoint.init_params with a fresh
    optimizer at step 0, else a fresh init. Says which on stderr."""
    state, start = restore_newest_intact(ckpt, train_step, steps) if steps else (None, None)
    if state is not None:
        say(f"resumed from step {start} ({Path(ckpt.directory) / str(start)})", quiet)
    if state is None and cfg.checkpoint.init_params:  # param-only start: fresh optimizer, step 0
        state = train_step.init_from(restore_params(cfg.checkpoint.init_params, train_step.abstract_state.params))
        say(f"starting from parameters in {cfg.checkpoint.init_params}", quiet)
    state = state if state is not None else train_step.init()
    start = start or 0
    if start >= cfg.train.steps:
        warn(f"{cfg.train.run_dir} already holds the final checkpoint (step {start} = train.steps); nothing to train")
    return state, start


@dataclass
class Run:
    """One call of `run`: the config, the built step and data, the checkpointer, the state the loop
    advances, and how it stops (`stop_after` steps in this call, or the preemption `flag`)."""

    cfg: RunConfig
    mesh: Any
    train_step: TrainStep
    ds: Any
    ckpt: Checkpointer
    state: Any
    start: int
    quiet: bool
    stop_after: int | None
    closers: list
    flag: PreemptionFlag
    compiled: Any = None  # the step's executable, compiled ahead of step 1 (None: call the jitted step)
    saving: list = field(default_factory=list)  # [(step, start time)] of saves not reported yet


@dataclass
class Tally:
    """What the loop has seen so far in this call."""

    first_loss: float | None = None
    loss: float | None = None
    val_loss: float | None = None
    timed_s: float = 0.0  # step seconds after the first (compiling) step
    timed_steps: int = 0
    ran: int = 0


def _train(r: Run) -> dict[str, Any]:
    """Steps start..train.steps: step, check the loss, evaluate, log, checkpoint; stop early on
    preemption or `stop_after`."""
    t = r.cfg.train
    logger = MetricsLogger(t.run_dir, total_steps=t.steps, quiet=r.quiet)
    r.closers.insert(0, logger.close)
    log_row = _row_fn(r)
    eval_step = make_eval_step(r.train_step, r.mesh) if t.eval_every else None
    tally, batch = Tally(), None
    if r.start < t.steps:
        r.compiled = _compile(r, global_batch_arrays(r.ds, r.start, r.mesh, P(DP_AXES)))
    with _maybe_profile(t):
        for step in range(r.start, t.steps):
            batch = global_batch_arrays(r.ds, step, r.mesh, P(DP_AXES))  # tokens, labels[, segment_ids]
            metrics, dt = _step(r, tally, step, batch)
            stop = r.flag.should_stop()  # agreed by all processes, so they save and leave at the same step
            cut = r.stop_after is not None and tally.ran >= r.stop_after
            last = stop or cut or step + 1 == t.steps
            if eval_step is not None and ((step + 1) % t.eval_every == 0 or last):
                metrics |= evaluate(eval_step, r.state.params, r.ds.val, t.eval_batches, r.mesh)
                tally.val_loss = metrics["val_loss"]
            if _should_log(r.cfg, step + 1, tally.ran, last=last) or "val_loss" in metrics:
                logger.log(step + 1, log_row(metrics, step, dt))
                if jax.process_index() and not r.quiet:  # other ranks: their progress in their own log
                    print(f"step {step + 1}/{t.steps}  loss {metrics['loss']:.4f}  {1000 * dt:.0f} ms/step  "
                          f"(process {jax.process_index()})", file=sys.stderr, flush=True)  # fmt: skip
            _report_saved(r)
            if cut:
                break
            if stop or r.ckpt.should_save(step + 1):  # every checkpoint.every steps, or now
                _save(r, step + 1, force=stop)
            if stop:
                break
        else:
            _save(r, t.steps, force=True)
    r.ckpt.wait()
    _report_saved(r)
    if t.profile and tally.ran:
        _profile_report(r, batch, tally.ran)
    return _result(r, tally)


def _step(r: Run, tally: Tally, step: int, batch) -> tuple[dict[str, float], float]:
    """One train step on `batch`: advances r.state and the tally; (metrics, seconds). A NaN/Inf loss
    stops the run without saving."""
    t0 = time.perf_counter()
    r.state, metrics = _call_step(r, batch)
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    dt = time.perf_counter() - t0
    loss = metrics["loss"]
    if not math.isfinite(loss):
        raise TrainingError(
            f"loss is {loss} at step {step + 1}; stopped without saving. The last good checkpoint "
            f"(step {r.ckpt.latest_step()}) in {r.cfg.train.run_dir} is intact; lower train.lr or check the data"
        )
    tally.loss = loss
    tally.first_loss = loss if tally.first_loss is None else tally.first_loss
    tally.ran += 1
    if tally.ran > 1:  # the first step includes compilation
        tally.timed_s, tally.timed_steps = tally.timed_s + dt, tally.timed_steps + 1
    return metrics, dt


def _compile(r: Run, batch) -> Any:
    """Compile the step ahead of step 1 so that step 1's time (and throughput) excludes compilation;
    None (the jitted step compiles on its first call) if ahead-of-time compilation fails."""
    say("compiling ...", r.quiet)
    t0 = time.perf_counter()
    try:
        compiled = r.train_step.step.lower(r.state, *batch).compile()
    except Exception as e:  # noqa: BLE001 - the jitted call below reports a real error itself
        warn(f"ahead-of-time compilation failed ({type(e).__name__}); compiling at step 1")
        return None
    say(f"compiled in {time.perf_counter() - t0:.1f} s", r.quiet)
    return compiled


def _call_step(r: Run, batch):
    if r.compiled is not None:
        try:
            return r.compiled(r.state, *batch)
        except (TypeError, ValueError):  # arguments the executable was not compiled for (shardings)
            r.compiled = None
    return r.train_step.step(r.state, *batch)


def _save(r: Run, step: int, force: bool) -> None:
    _report_saved(r)  # orbax finishes the previous async save before it starts this one
    t0 = time.perf_counter()
    if r.ckpt.save(step, r.train_step.to_model(r.state), force=force):
        r.saving.append((step, t0))


def _report_saved(r: Run) -> None:
    """`saved checkpoint N (size, seconds)` for the saves that finished (process 0)."""
    done = [(s, t0) for s, t0 in r.saving if (Path(r.ckpt.directory) / str(s)).is_dir()]
    for s, t0 in done:
        r.saving.remove((s, t0))
        path = Path(r.ckpt.directory) / str(s)
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        say(f"saved checkpoint {s} ({size / 2**20:.1f} MiB, {time.perf_counter() - t0:.1f} s) in {path}", r.quiet)


def _row_fn(r: Run):
    """(metrics, step, seconds) -> the metrics row: the step's metrics plus lr, throughput, bubble, MFU."""
    t = r.cfg.train
    flops = model_flops(r.cfg.model, t.global_batch, t.seq_len)
    peak = peak_flops(jax.devices()[0])
    bubble = r.train_step.plan.bubble

    def row(metrics: dict, step: int, dt: float) -> dict:
        tflops = flops / dt / r.mesh.size / 1e12
        return {
            **metrics,
            "lr": _lr(r.cfg, step),
            "step_time_s": dt,
            "tokens_per_s": t.global_batch * t.seq_len / dt,
            "tflops_per_device": tflops,
            "bubble_fraction": bubble,
            **({"mfu": tflops * 1e12 / peak} if peak else {}),
            **_memory_in_use(),
        }

    return row


def _run_first_loss(run_dir: str, default: float | None) -> float | None:
    """A resumed run's first loss: step 1's row of RUN_DIR/metrics.jsonl (the run's, not this attempt's;
    what a supervised job's final JSON reports), else `default`."""
    with contextlib.suppress(OSError, ValueError):
        for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            if row.get("step") == 1 and isinstance(row.get("loss"), float):
                return row["loss"]
    return default


def _memory_in_use() -> dict[str, int]:
    """{"memory_in_use": bytes} of the first local device where the backend reports it (GPU/TPU; not XLA:CPU)."""
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without memory stats
        return {}
    return {"memory_in_use": int(stats["bytes_in_use"])} if "bytes_in_use" in stats else {}


def _result(r: Run, tally: Tally) -> dict[str, Any]:
    t = r.cfg.train
    tps = t.global_batch * t.seq_len * tally.timed_steps / tally.timed_s if tally.timed_s else 0.0
    return {
        "step": r.start + tally.ran,
        "loss": tally.loss,
        "first_loss": _run_first_loss(t.run_dir, tally.first_loss) if r.start else tally.first_loss,
        "tokens_per_s": tps,
        "run_dir": t.run_dir,
        "preempted": r.flag.is_set(),
        **({"val_loss": tally.val_loss} if tally.val_loss is not None else {}),
    }


def _lr(cfg: RunConfig, step: int) -> float:
    return float(lr_schedule(cfg)(step))


def _profile_report(r: Run, batch, ran: int) -> None:
    """train.profile=true: the `meshrun profile` report of the traced steps, on stderr and in
    RUN_DIR/profile/profile.json. Best effort: a failure is a warning, never the run's end."""
    if jax.process_index() != 0:
        return
    try:
        text = r.train_step.step.lower(r.state, *batch).compile().as_text()  # the step's cached executable
        predicted = r.train_step.plan.stage_bubbles
        rep = report_of_trace(Path(r.cfg.train.run_dir) / "profile", text, r.cfg, r.mesh, ran, predicted)
        print(format_report(rep, "train.profile"), file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001
        warn(f"train.profile: no bubble report ({type(e).__name__}: {e})")


def _maybe_profile(t):
    if not t.profile:
        return contextlib.nullcontext()
    return profile_trace(t.run_dir, True)
