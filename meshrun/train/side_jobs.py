"""The training loop's side jobs, registered as hooks in one place (`SideJobs.hooks`).

After each step, in this order: the loss check, the straggler record and check, evaluation, the
metrics row, the report of finished saves, the checkpoint save and the local checkpoint save.
The watchdog hears each job's phase (`hooks.Hooks`). `train.profile=true` traces the steps
(`trace`) and reports them at the end (`profile_report`).
"""

from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path
from typing import Any

import jax

from meshrun.analysis.profiler import profile_trace
from meshrun.analysis.trace import format_report, report_of_trace
from meshrun.config import RunConfig
from meshrun.errors import TrainingError
from meshrun.optim.optimizer import lr_schedule
from meshrun.runtime.processes import warn
from meshrun.runtime.stragglers import Stragglers
from meshrun.train.evaluate import evaluate, make_eval_step
from meshrun.train.hooks import Hooks, StepInfo
from meshrun.train.metrics import MetricRows, MetricsLogger
from meshrun.train.prepare import Prepared
from meshrun.train.saves import Saves


class SideJobs:
    """The side jobs of one call of the loop, over the state `stepper` advances."""

    def __init__(self, cfg: RunConfig, built: Prepared, stepper: Any, saves: Saves, tally: Any,
                 logger: MetricsLogger, quiet: bool):  # fmt: skip
        t, ts = cfg.train, built.train_step
        self.cfg, self.built, self.stepper, self.saves, self.tally = cfg, built, stepper, saves, tally
        self.logger, self.quiet = logger, quiet
        self.rows = MetricRows(cfg, built.mesh.size, ts.plan.bubble, lr_schedule(cfg), ts.plan.family)
        self.eval_step = make_eval_step(ts, built.mesh) if t.eval_every else None
        self.stragglers = Stragglers(t.straggler_threshold, t.log_every)

    def hooks(self) -> Hooks:
        """Every side job with when it is due."""
        t, c, ckpt = self.cfg.train, self.cfg.checkpoint, self.saves.ckpt
        hooks = Hooks(self.stepper.dog)
        hooks.add(self.check_loss)
        hooks.add(self.record_times, when=lambda i: i.ran > 1, every=0)  # the first step includes compilation
        hooks.add(self.check_stragglers, when=lambda i: self.stragglers.due(i.step), every=0,
                  phase="gather step times")  # fmt: skip
        if self.eval_step is not None:
            hooks.add(self.evaluate, every=t.eval_every, when=lambda i: i.last, phase="eval")
        # the first step of this call, every log_every-th step, the last one and any evaluated step
        hooks.add(self.log_row, every=t.log_every, when=lambda i: i.ran == 1 or i.last or "val_loss" in i.metrics)
        hooks.add(lambda i: self.saves.report())
        hooks.add(self.save, every=c.every, when=lambda i: i.stop, unless=lambda i: i.cut, phase="save")
        if self.saves.tier is not None:  # a step the persistent tier saves, and the run's last, are not saved here
            last = lambda i: i.cut or i.stop or ckpt.should_save(i.step) or i.step >= t.steps  # noqa: E731
            hooks.add(self.save_local, every=c.local_every, unless=last, phase="save")
        return hooks

    def check_loss(self, info: StepInfo) -> None:
        """A NaN/Inf loss stops the run without saving."""
        loss, run_dir = info.metrics["loss"], self.cfg.train.run_dir
        if not math.isfinite(loss):
            last = self.saves.ckpt.latest_step()
            kept = (
                f"The last good checkpoint (step {last}) in {run_dir} is intact"
                if last is not None
                else f"No checkpoint was saved in {run_dir} yet (checkpoint.every sets how often)"
            )
            raise TrainingError(f"loss is {loss} at step {info.step}; stopped without saving. {kept}; "
                                "lower optimizer.lr or check the data")  # fmt: skip

    def record_times(self, info: StepInfo) -> None:
        self.stragglers.add(info.step, info.host_s, info.dt)

    def check_stragglers(self, info: StepInfo) -> None:
        info.metrics |= self.stragglers.check(info.step)

    def evaluate(self, info: StepInfo) -> None:
        t, built = self.cfg.train, self.built
        info.metrics |= evaluate(self.eval_step, self.stepper.state.params, built.ds.val, t.eval_batches, built.mesh)
        self.tally.val_loss = info.metrics["val_loss"]

    def log_row(self, info: StepInfo) -> None:
        """The metrics.jsonl row; processes other than 0 print their progress in their own log."""
        self.logger.log(info.step, self.rows.row(info.metrics, info.step - 1, info.dt))
        if jax.process_index() and not self.quiet:
            line = f"step {info.step}/{self.cfg.train.steps}  loss {info.metrics['loss']:.4f}  "
            print(f"{line}{1000 * info.dt:.0f} ms/step  (process {jax.process_index()})", file=sys.stderr, flush=True)

    def model_state(self) -> Any:
        ts = self.built.train_step
        return (ts.to_save or ts.to_model)(self.stepper.state)

    def save(self, info: StepInfo) -> None:
        """Every checkpoint.every steps, or now (preemption)."""
        self.saves.save(info.step, self.model_state(), force=info.stop)

    def save_local(self, info: StepInfo) -> None:
        self.saves.save_local(info.step, self.model_state())

    def save_final(self) -> None:
        """The run's last step, saved for good."""
        self.stepper.dog.phase("save", self.cfg.train.steps)
        self.saves.save(self.cfg.train.steps, self.model_state(), force=True)

    def finish(self, step: int) -> None:
        """Wait for the saves still being written and report them."""
        self.stepper.dog.phase("save", step)
        self.saves.finish()


def trace(cfg: RunConfig):
    """train.profile=true: a context tracing the run's steps into RUN_DIR/profile (else a no-op)."""
    if not cfg.train.profile:
        return contextlib.nullcontext()
    return profile_trace(cfg.train.run_dir, True)


def profile_report(cfg: RunConfig, mesh, train_step, state, batch, ran: int) -> None:
    """train.profile=true: the `meshrun profile` report of the traced steps, on stderr and in
    RUN_DIR/profile/profile.json. Best effort: a failure is a warning, never the run's end."""
    if jax.process_index() != 0:
        return
    try:
        text = train_step.step.lower(state, *batch).compile().as_text()  # the step's cached executable
        predicted = train_step.plan.stage_bubbles
        rep = report_of_trace(Path(cfg.train.run_dir) / "profile", text, cfg, mesh, ran, predicted)
        print(format_report(rep, "train.profile"), file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001
        warn(f"train.profile: no bubble report ({type(e).__name__}: {e})")
