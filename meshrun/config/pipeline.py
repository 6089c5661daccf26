"""`pipeline:`: the schedule, microbatches and stage split (the schedules' own rules live in
`meshrun.pipeline.registry`)."""

from __future__ import annotations

from dataclasses import dataclass

from meshrun.config.base import MAX_DIM, MAX_MICROBATCHES, _bounded, _choice
from meshrun.errors import ConfigError


@dataclass(frozen=True)
class PipelineConfig:
    schedule: str = "1f1b"  # a schedule of the registry (docs/pipeline.md lists them; `meshrun schedule --help`)
    microbatches: int = 1  # m: number of microbatches per step (>= 4*pipe recommended)
    virtual: int = 1  # v: virtual chunks per stage (schedules whose chunk count is free)
    # Stacked layers (MoE: layer groups) per virtual stage k = chunk*pipe + stage, in model order;
    # empty: split by `balance` ('even': equal counts; 'auto': the planner's cost model).
    layers_per_stage: tuple[int, ...] = ()
    balance: str = "even"  # even | auto
    # How ticks run: 'lockstep' (one forward and one backward per stage per tick; 1F1B holds
    # min(m, 2p-1) microbatches' residuals on every stage), 'per_op' (one op per stage per tick, the
    # schedule's own timeline with each backward split into B and W: 1F1B holds p - s on stage s,
    # Megatron's), 'auto' (the schedule's registry entry decides). The schedule's entry says which
    # executors play it (`pipeline.registry.check_config`, run by the step plan: config sits below it).
    executor: str = "auto"  # auto | lockstep | per_op
    # Reduce each chunk's gradients over the data-parallel axes as soon as its last backward op ran
    # (ZeRO >= 1: its reduce-scatter), beside the rest of the tick loop, instead of all after it
    # (Megatron's --overlap-grad-reduce). Schedules with 2+ chunks per stage (zb-v, interleaved).
    overlap_grad_reduce: bool = False

    def __post_init__(self):
        if not self.schedule or not isinstance(self.schedule, str):
            fix = "name a schedule (`meshrun schedule --help` lists them)"
            raise ConfigError("pipeline.schedule", self.schedule, fix)
        _choice("pipeline.executor", self.executor, ("auto", "lockstep", "per_op"))
        _bounded("pipeline.microbatches", self.microbatches, 1, MAX_MICROBATCHES)
        _bounded("pipeline.virtual", self.virtual, 1, MAX_DIM)
        _choice("pipeline.balance", self.balance, ("even", "auto"))
        if not isinstance(self.overlap_grad_reduce, bool):
            raise ConfigError("pipeline.overlap_grad_reduce", self.overlap_grad_reduce, "use true or false")
        if any(n < 1 for n in self.layers_per_stage):
            raise ConfigError(
                "pipeline.layers_per_stage",
                list(self.layers_per_stage),
                "give every stage at least one layer (use fewer stages, or pipeline.balance=auto)",
                "empty stage",
            )
        if self.layers_per_stage and self.balance != "even":
            raise ConfigError(
                "pipeline.balance",
                self.balance,
                "set either pipeline.layers_per_stage or pipeline.balance=auto, not both",
            )
