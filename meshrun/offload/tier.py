"""The protocol every state tier follows (`StateTier`) and the one place a TrainStep takes a tier
(`with_tier`).

A tier holds part of the run state (optimizer state, and with offload.params the layers') outside
the step's own arrays. The TrainStep built in memory stays the reference: `with_tier(ts, tier)`
swaps its init, step, relayouts and checkpoint hooks for the tier's, so the loop, the evaluation
and checkpoints use a tiered step as they use any other. `registry.build_tier` picks the tier.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol


class StateTier(Protocol):
    """A tier of one TrainStep `ts`: its run state is `ts`'s with part of the state held by the tier."""

    def init(self, params: Any = None) -> Any:
        """The run state at step 0: `ts.init()`'s, or `ts.init_from(params)`'s (model-order params)."""

    def absorb(self, state: Any) -> Any:
        """A whole in-memory run state -> the tier's run state (the tier takes its part)."""

    def whole(self, state: Any) -> Any:
        """The tier's run state -> the whole in-memory run state (its part read back)."""

    def step(self, state: Any, *batch: Any, device_part: Any = None) -> tuple[Any, dict]:
        """One train step: `(state, metrics)`; `device_part`: a compiled device part to run instead."""

    def lower_device_part(self, state: Any, *batch: Any) -> Any:
        """The lowering of the step's jitted device part (its compiled memory and HLO are the step's)."""

    def save_view(self, state: Any) -> Any:
        """The run state as a checkpoint saves it (model order; the tier's part as streamed leaves)."""

    def restore(self, ckpt: Any, step: int) -> Any:
        """Checkpoint `step` of `ckpt` into the tier's run state."""

    def bytes_per_device(self) -> dict[str, float]:
        """Where the tier's bytes rest, per device: {"host": ..., "nvme": ...}."""


def with_tier(ts: Any, tier: StateTier) -> Any:
    """The TrainStep `ts` (built in memory) with part of its state in `tier`."""
    return dataclasses.replace(
        ts,
        step=TierStep(tier),
        init=lambda: tier.init(),
        init_from=lambda prm: tier.init(prm),
        to_run=lambda st: tier.absorb(ts.to_run(st)),
        to_model=lambda st: ts.to_model(tier.whole(st)),
        to_save=tier.save_view,
        restore=tier.restore,
        tier=tier,
    )


class TierStep:
    """The step a loop calls: `(state, *batch) -> (state, metrics)`; `lower(...).compile()` compiles
    the device part ahead of time (the loop's step-1 timing), as for a jitted step."""

    def __init__(self, tier: StateTier, device_part: Any = None):
        self.tier, self.device_part = tier, device_part

    def __call__(self, state, *batch):
        return self.tier.step(state, *batch, device_part=self.device_part)

    def lower(self, state, *batch):
        return LoweredTierStep(self.tier, self.tier.lower_device_part(state, *batch))


class LoweredTierStep:
    """The device part's lowering; `compile` gives a step that runs its executable (other attributes:
    the lowering's, e.g. `as_text`)."""

    def __init__(self, tier: StateTier, lowered: Any):
        self.tier, self.lowered = tier, lowered

    def compile(self, **kwargs):
        return CompiledTierStep(self.tier, self.lowered.compile(**kwargs))

    def __getattr__(self, name: str):
        return getattr(self.lowered, name)


class CompiledTierStep(TierStep):
    """A step over the compiled device part; `memory_analysis`, `as_text`, ...: the device part's."""

    def __getattr__(self, name: str):
        return getattr(self.device_part, name)
