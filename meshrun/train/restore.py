"""Where a run starts: the checks of RUN_DIR/checkpoints against the config, and the restore
(`initial_state`: the newest restorable local or persistent checkpoint, else checkpoint.init_params,
else a fresh init). `checkpoint_meta` is what a checkpoint must agree on to be restored.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from meshrun.checkpoint.local import LocalTier, LocalUnusable, agreed_steps
from meshrun.checkpoint.params import missing_params, restore_params
from meshrun.checkpoint.state import CheckpointDamaged, Checkpointer
from meshrun.checkpoint.store import newest_complete, scan
from meshrun.config import RunConfig, to_dict
from meshrun.errors import CheckpointError, ConfigError
from meshrun.family.fresh import seed_free
from meshrun.runtime.processes import agree, say, warn
from meshrun.train.step import TrainStep


def checkpoint_meta(cfg: RunConfig) -> dict[str, Any]:
    """What a checkpoint must agree on to be restored: the model and the optimizer's name (layouts and
    hyper-parameters are free to differ); also where its parameters came from (`meshrun export-hf`
    finds the Hugging Face config there)."""
    data = {"kind": cfg.data.kind, "path": os.path.abspath(cfg.data.path) if cfg.data.path else ""}
    return {"model": to_dict(cfg.model), "optimizer": {"name": cfg.optimizer.name},
            "init_params": cfg.checkpoint.init_params, "data": data}  # fmt: skip


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


def check_same_model(ckpt: Checkpointer, train_step: TrainStep, steps: list[int]) -> None:
    """ConfigError when the newest checkpoint was written for another model (its saved model config
    or array shapes differ). A checkpoint that cannot be read is left to the restore, which moves
    it aside."""
    if not steps:
        return
    try:
        ckpt.check_compatible(steps[-1], train_step.abstract_state)
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 - damaged: restore_newest_intact reports it
        return


def restore_newest_intact(ckpt: Checkpointer, train_step: TrainStep, steps: list[int]) -> tuple[Any, int | None]:
    """(state, step) from the newest checkpoint of `steps` that restores; each one that fails is
    reported in one line and moved aside. None of them -> CheckpointError. No steps -> (None, None)."""
    tried = []
    for step in reversed(steps):
        try:
            if train_step.restore is not None:  # the nvme tier: straight into its file
                state, err = train_step.restore(ckpt, step), None
            else:
                state, err = train_step.to_run(ckpt.restore(step, train_step.abstract_state)), None
        except CheckpointDamaged as e:
            state, err = None, e
        if agree(err is None):
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


def local_candidates(tier: LocalTier, newer_than: int | None, max_step: int) -> list[int]:
    """Local steps every process holds, newer than the persistent step `newer_than` and not past
    `max_step`, newest first. Warns when a newer local step is missing on some process (a lost node)."""
    common, each = agreed_steps([s for s in tier.steps() if s <= max_step])
    newest = max((s for row in each for s in row), default=None)
    if newest is not None and newest not in common and (newer_than is None or newest > newer_than):
        lacking = ", ".join(str(p) for p, row in enumerate(each) if newest not in row)
        warn(f"local checkpoint step {newest} is not on every process (missing on process {lacking}); "
             "using the newest step that is")  # fmt: skip
    return [s for s in reversed(common) if newer_than is None or s > newer_than]


def restore_local(tier: LocalTier, train_step: TrainStep, candidates: list[int]) -> tuple[Any, int | None]:
    """(state, step) from the newest of `candidates` that every process restores (each reads only its
    own files: no collective until all agree); (None, None) when none does. A streamed optimizer tier
    takes its state straight into its file (`train_step.restore`), as from the persistent tier."""
    for step in candidates:
        try:
            if train_step.restore is not None:
                state, err = train_step.restore(tier, step), None
            else:
                state, err = tier.restore(step, train_step.abstract_state), None
        except LocalUnusable as e:
            state, err = None, str(e)
        except Exception as e:  # noqa: BLE001 - any failure here must still reach the agreement below
            state, err = None, f"{type(e).__name__}: {str(e)[:200]}"
        if agree(err is None):
            return (state if train_step.restore is not None else train_step.to_run(state)), step
        why = err if err is not None else "another process could not restore it"
        warn(f"local checkpoint step {step} cannot be restored ({why}); trying an older step or the persistent ones")
    return None, None


def initial_state(
    cfg: RunConfig,
    ckpt: Checkpointer,
    train_step: TrainStep,
    steps: list[int],
    quiet: bool = False,
    tier: LocalTier | None = None,
) -> tuple[Any, int]:
    """(state, first step): the newest restorable checkpoint (a local step every process holds when
    it is newer than the persistent ones, else the newest intact persistent one), else
    checkpoint.init_params with a fresh optimizer at step 0, else a fresh init. Says which on stderr.
    Local steps newer than the one resumed from are deleted (another trajectory's, once it goes on)."""
    state, start = None, None
    if tier is not None and cfg.checkpoint.resume:
        state, start = restore_local(tier, train_step, local_candidates(tier, steps[-1] if steps else None,
                                                                        cfg.train.steps))  # fmt: skip
        if state is not None:
            say(f"resumed from step {start} (local checkpoint {tier.directory / str(start)})", quiet)
    if state is None and steps:
        state, start = restore_newest_intact(ckpt, train_step, steps)
        if state is not None:
            say(f"resumed from step {start} ({Path(ckpt.directory) / str(start)})", quiet)
    if tier is not None:
        tier.drop(lambda s: s <= (start or 0))
    if state is None and cfg.checkpoint.init_params:  # param-only start: fresh optimizer, step 0
        state = train_step.init_from(initial_params(cfg, train_step, quiet))
        say(f"starting from parameters in {cfg.checkpoint.init_params}", quiet)
    state = state if state is not None else train_step.init()
    start = start or 0
    if start >= cfg.train.steps:
        warn(f"{cfg.train.run_dir} already holds the final checkpoint (step {start} = train.steps); nothing to train")
    return state, start


def fresh_params(cfg: RunConfig, train_step: TrainStep) -> dict[str, Any]:
    """{key: array} of the parameters checkpoint.init_params lacks that the family's init makes
    without random numbers (fp8 scaling state: a Hugging Face import fine-tuned with model.fp8)."""
    target = train_step.abstract_state.params
    missing = missing_params(cfg.checkpoint.init_params, target)
    return seed_free(train_step.plan.family, cfg.model, missing, target) if missing else {}


def initial_params(cfg: RunConfig, train_step: TrainStep, quiet: bool = False) -> Any:
    """checkpoint.init_params's parameters in the run's layout, with `fresh_params` put in (one note)."""
    fresh = fresh_params(cfg, train_step)
    if fresh:
        names = ", ".join(sorted(fresh))
        say(f"note: checkpoint.init_params has no {names}: created fresh as the model's init makes them "
            "(they draw no random numbers)", quiet)  # fmt: skip
    return restore_params(cfg.checkpoint.init_params, train_step.abstract_state.params, fresh=fresh)


def resume_hint(run_dir: str) -> str:
    """What a user does after a lost peer: the checkpoints that are intact, and how to resume."""
    newest = newest_complete(run_dir)
    newest = f"newest: step {newest.step}" if newest else "none written yet"
    return (
        f"checkpoints already in {run_dir} are intact ({newest}); rerun to resume, or launch with "
        "MAX_RESTARTS=K to restart automatically"
    )


def run_first_loss(run_dir: str, default: float | None) -> float | None:
    """A resumed run's first loss: step 1's row of RUN_DIR/metrics.jsonl (the run's, not this attempt's;
    what a supervised job's final JSON reports), else `default`."""
    with contextlib.suppress(OSError, ValueError):
        for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            if row.get("step") == 1 and isinstance(row.get("loss"), float):
                return row["loss"]
    return default
