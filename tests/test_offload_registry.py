"""Where the state rests is decided once, from the config (`offload.registry.placement`, kept in the
step plan): which tier, whether the update streams, where its chunks are updated, and which ZeRO parts
rest in pinned host memory. Every registered tier follows the `StateTier` protocol."""

import inspect

import jax
import pytest

from meshrun.config import ConfigError, load_config
from meshrun.offload.optimizer_tier import OptimizerTier
from meshrun.offload.param_tier import ParamTier
from meshrun.offload.registry import TIERS, placement
from meshrun.offload.tier import StateTier

P3 = ["train.zero=3", "offload.params=true"]
CASES = {  # overrides -> (tier, streams, pinned)
    "device": ([], ("none", False, ())),
    "host-whole": (["offload.optimizer=host", "offload.update=whole"], ("none", False, ("opt",))),
    "host-whole-master": (
        ["offload.optimizer=host", "offload.update=whole", "model.dtype=bfloat16"],
        ("none", False, ("opt", "store")),
    ),  # fmt: skip
    "host-muon": (["offload.optimizer=host", "optimizer.name=muon"], ("none", False, ("opt",))),
    "host-streamed": (["offload.optimizer=host"], ("optimizer", True, ())),
    "nvme": (["offload.optimizer=nvme", "offload.dir=unused"], ("optimizer", True, ())),
    "params": (P3, ("none", False, ("store",))),
    "params-host": ([*P3, "offload.optimizer=host"], ("none", False, ("opt", "store"))),
    "params-nvme": ([*P3, "offload.optimizer=nvme", "offload.dir=unused"], ("params", True, ("store",))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_placement_names_the_tier(name):
    over, (tier, streams, pinned) = CASES[name]
    got = placement(load_config("configs/tiny_cpu.yaml", over))
    assert (got.tier, got.streams, got.pinned) == (tier, streams, pinned)
    assert got.tier == "none" or got.tier in TIERS


def test_update_on_is_resolved_with_the_devices():
    """auto: in place on CPU devices (their memory is host memory); an explicit choice is kept; the
    devices unknown (a mesh given as a shape), auto stays auto."""
    cpus = jax.devices("cpu")
    cfg = load_config("configs/tiny_cpu.yaml", ["offload.optimizer=nvme", "offload.dir=unused"])
    assert placement(cfg, cpus).update_on == "in_place" and placement(cfg).update_on == "auto"
    cfg = load_config(
        "configs/tiny_cpu.yaml", ["offload.optimizer=nvme", "offload.dir=unused", "offload.update_on=host"]
    )
    assert placement(cfg, cpus).update_on == "host"


def test_a_streamed_update_the_optimizer_cannot_take_is_refused():
    cfg = load_config("configs/tiny_cpu.yaml", ["offload.optimizer=host", "optimizer.name=muon",
                                                "offload.update=streamed"])  # fmt: skip
    with pytest.raises(ConfigError, match="offload.update"):
        placement(cfg)


@pytest.mark.parametrize("cls", [OptimizerTier, ParamTier])
def test_tiers_follow_the_protocol(cls):
    """Every method of `StateTier`, with the protocol's parameters."""
    for name, want in inspect.getmembers(StateTier, inspect.isfunction):
        if name.startswith("_"):
            continue
        got = getattr(cls, name, None)
        assert callable(got), f"{cls.__name__} has no {name}"
        assert list(inspect.signature(got).parameters) == list(inspect.signature(want).parameters), name
