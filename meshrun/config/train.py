"""`train:`: the run's length, batch, ZeRO stage, logging, evaluation and the watchdog."""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshrun.config.base import MAX_DIM, MAX_STEPS, _bounded, _choice
from meshrun.errors import ConfigError

GRAD_REDUCE_DTYPES = ("float32", "bfloat16")
ZERO3_GATHERS = ("auto", "layer", "step")  # train.zero3_gather
ZERO2_REDUCES = ("auto", "microbatch", "step")  # train.zero2_reduce
LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow")  # train.loggers (meshrun.train.loggers)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 20  # optimizer steps of the whole run (a resume continues up to it)
    global_batch: int = 16  # sequences per step, over all devices and microbatches
    seq_len: int = 64  # tokens per sequence
    zero: int = 0  # ZeRO stage 0..3
    # ZeRO-3's weight gathers: layer (FSDP: each layer's weights all-gathered inside the layer scan just
    # before use, gathered again in the backward, its gradient reduce-scattered as the backward makes it)
    # | step (every weight gathered once before the loop, kept through the step) | auto (layer where the
    # gathered weights would take more than 1 GiB per device, else step). docs/memory.md
    zero3_gather: str = "auto"
    # ZeRO-2's gradient reduction: microbatch (each layer's gradient reduce-scattered as the backward makes
    # it, every microbatch, into float32 sums that are themselves sharded: 1/DP of the bytes) | step (full
    # float32 sums, one reduce-scatter per step: fewer bytes on the wire, more memory) | auto (microbatch
    # where the layers' float32 sums would take more than 1 GiB per device, else step). docs/memory.md
    zero2_reduce: str = "auto"
    seed: int = 0  # parameter initialisation seed
    log_every: int = 1  # progress line + metrics.jsonl row every k steps (first and last step always)
    # where each metrics row goes besides RUN_DIR/metrics.jsonl (always written): tensorboard (RUN_DIR/tb),
    # wandb (offline in RUN_DIR/wandb unless WANDB_MODE), mlflow (RUN_DIR/mlruns unless MLFLOW_TRACKING_URI)
    loggers: tuple[str, ...] = ("jsonl",)
    eval_every: int = 0  # val_loss on the held-out documents every k steps and at the end (0: never)
    eval_batches: int = 4  # global batches per evaluation (the same ones every time)
    run_dir: str = "runs/default"  # one run: config.yaml, metrics.jsonl, checkpoints/, logs; a rerun resumes
    profile: bool = False  # trace steps with jax.profiler into RUN_DIR/profile and print the profile report
    # dtype of the one data-parallel gradient reduction per step (all-reduce / ZeRO reduce-scatter);
    # gradients accumulate in float32 either way and are cast back before the optimizer
    grad_reduce_dtype: str = "float32"
    # seconds without a finished step before the watchdog ends this process with exit 7 (a hang;
    # RUN_DIR/logs/hang-<process>.txt); 0: auto, max(600, 10 x the median step); -1: off
    step_timeout: float = 0.0
    compile_allowance: float = 1800.0  # seconds added to step_timeout while compiling, evaluating or saving
    # name a process whose host-side time per step exceeds the others' by more than this fraction of
    # the step time (checked every log_every steps, 2+ processes); 0: off
    straggler_threshold: float = 0.2

    def __post_init__(self):
        if not (self.step_timeout >= 0 or self.step_timeout == -1) or not math.isfinite(self.step_timeout):
            raise ConfigError("train.step_timeout", self.step_timeout, "use seconds > 0, 0 (auto) or -1 (off)")
        for f in ("compile_allowance", "straggler_threshold"):
            if not (getattr(self, f) >= 0 and math.isfinite(getattr(self, f))):
                raise ConfigError(f"train.{f}", getattr(self, f), "use a number >= 0")
        for f in ("steps", "log_every", "eval_batches"):
            _bounded(f"train.{f}", getattr(self, f), 1, MAX_STEPS)
        for f in ("global_batch", "seq_len"):
            _bounded(f"train.{f}", getattr(self, f), 1, MAX_DIM)
        if self.eval_every < 0:
            raise ConfigError("train.eval_every", self.eval_every, "use 0 (no evaluation) or a positive step count")
        _bounded("train.seed", self.seed, 0, 2**32 - 1)
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError("train.zero", self.zero, "use a ZeRO stage 0, 1, 2 or 3")
        _choice("train.grad_reduce_dtype", self.grad_reduce_dtype, GRAD_REDUCE_DTYPES)
        _choice("train.zero3_gather", self.zero3_gather, ZERO3_GATHERS)
        if self.zero3_gather != "auto" and self.zero != 3:
            raise ConfigError("train.zero3_gather", self.zero3_gather, "set train.zero=3 with it, or leave it auto",
                              f"chooses ZeRO-3's weight gathers (train.zero={self.zero})")  # fmt: skip
        _choice("train.zero2_reduce", self.zero2_reduce, ZERO2_REDUCES)
        if self.zero2_reduce != "auto" and self.zero != 2:
            raise ConfigError("train.zero2_reduce", self.zero2_reduce, "set train.zero=2 with it, or leave it auto",
                              f"chooses ZeRO-2's gradient reduction (train.zero={self.zero})")  # fmt: skip
        if isinstance(self.loggers, str):  # train.loggers=wandb: a list of one
            object.__setattr__(self, "loggers", (self.loggers,))
        for name in self.loggers:
            _choice("train.loggers", name, LOGGERS)
