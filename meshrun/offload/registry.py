"""Which tier a run uses, decided once from its config (`placement`, kept as `StepPlan.offload`),
and the tier that builds it (`build_tier`).

A new tier is a module with a class following `tier.StateTier` and a builder `(ts, cfg) -> tier`,
registered in `TIERS` under the name `placement` gives it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshrun.config import RunConfig, streamed_update_refusal, streams_host_update
from meshrun.errors import ConfigError
from meshrun.offload import optimizer_tier, param_tier
from meshrun.offload.tier import StateTier
from meshrun.optim import registry as optimizers

# tier name -> builder (TrainStep, RunConfig) -> StateTier; "none": the step's own arrays hold the state
TIERS: dict[str, Callable[[Any, RunConfig], StateTier]] = {
    "optimizer": optimizer_tier.build,  # optimizer state in host memory or NVMe files, streamed in chunks
    "params": param_tier.build,  # offload.params + nvme: the layers' state in NVMe files, a few layers at a time
}


@dataclass(frozen=True)
class Placement:
    """Where a run's state rests and how its update runs."""

    tier: str  # a key of TIERS, or "none" (on the device, or whole shards in pinned host memory)
    streams: bool  # the optimizer update streams chunk by chunk (tier != "none")
    update_on: str  # the optimizer tier's chunk update: in_place | device | host (auto: devices not known)
    pinned: tuple[str, ...]  # ZeroShardings parts in pinned host memory ("opt", "store")


def placement(cfg: RunConfig, devices: Any = None) -> Placement:
    """The run's placement; `devices` (the mesh's) resolve offload.update_on=auto."""
    t = cfg.offload
    streams = streams_update(cfg)
    tier = "none" if not streams else "params" if t.params else "optimizer"
    params = ("store",) if t.params else ()  # ZeRO-3 params streamed layer by layer
    if t.optimizer != "host" or streams:  # the tier's own store
        pinned = params
    else:
        pinned = ("opt", "store") if cfg.model.param_dtype != cfg.model.dtype or params else ("opt",)
    on = t.update_on if devices is None or tier != "optimizer" else update_on(t.update_on, devices)
    return Placement(tier, streams, on, pinned)


def streams_update(cfg: RunConfig) -> bool:
    """Whether the optimizer state rests outside the device and its update streams chunk by chunk:
    the nvme tier always; the host tier unless `offload.update` is whole, offload.params streams it
    layer by layer itself, or the optimizer cannot be streamed (auto then keeps the whole-shard
    update; streamed asked for it: a ConfigError)."""
    t = cfg.offload
    if t.optimizer != "host":
        return t.optimizer == "nvme"
    o = cfg.optimizer
    why = streamed_update_refusal(o.name, optimizers.get(o.name).elementwise, o.state_dtype,
                                  cfg.model.fp8)  # fmt: skip
    if why is not None and t.update != "whole" and not t.params:  # a streamed update asked for
        if t.update == "streamed":
            raise ConfigError("offload.update", "streamed", "use auto or whole", why)
        if t.update_on != "auto":
            raise ConfigError("offload.update_on", t.update_on, "leave it auto", why)
    return streams_host_update(t.update, t.params, why)


def update_on(asked: str, devices) -> str:
    """Where the chunk update runs (`offload.update_on`): in_place (auto on CPU devices: the
    device's memory is host memory, so the ring buffers are the device's arrays), device (the copy
    path: auto on other devices) or host (jax's CPU backend, `host_update.py`)."""
    if asked == "auto":
        return "in_place" if all(d.platform == "cpu" for d in devices) else "device"
    return asked


def build_tier(ts: Any, cfg: RunConfig) -> StateTier | None:
    """The tier of the TrainStep `ts` its plan names (None: the step keeps its whole state)."""
    kind = ts.plan.offload.tier
    return None if kind == "none" else TIERS[kind](ts, cfg)
