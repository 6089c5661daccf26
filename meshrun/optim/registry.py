"""The optimizers meshrun knows, by `optimizer.name`: the one place that names an optimizer.

Each `OptimizerSpec` declares what the rest of meshrun asks about, so nothing else assumes Adam:
`build` ("module:function" of its optax transformation, which `meshrun.optim.optimizer` wraps in
clipping, the state dtype and the master weights); `moments` / `moments_other`, its state tensors
per element of a hidden-layer weight matrix / of every other parameter, stored in
`optimizer.state_dtype` (`state_bytes`, read by the planner); `update_temps` and
`matrix_update_flops`, the update's float32 temporaries and FLOPs per matrix parameter (the
planner's memory and time); `elementwise`, whether each element's update depends only on that
element and global scalars, so a streamed offload tier can update any chunk (AdamW yes, Muon no).

Add a built-in optimizer as an entry of `OPTIMIZERS`; one outside meshrun needs none:
`optimizer.name: package.module:SPEC` names its `OptimizerSpec` (examples/custom_optimizer), and
`get(name)` finds either. Plain Python: the planner imports it without jax.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from meshrun import config
from meshrun.config import OptimizerConfig, bounded
from meshrun.config.user_code import import_object
from meshrun.errors import ConfigError

STATE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
MASTER_BYTES = 4  # the float32 master copy of params stored below float32


@dataclass(frozen=True)
class MuonConfig(OptimizerConfig):
    """Muon's options: the shared ones (its Adam part, on the non-matrix parameters, reads beta1,
    beta2 and eps) and its own."""

    name: str = "muon"
    momentum: float = 0.95  # momentum of the orthogonalized weight matrices
    ns_steps: int = 5  # Newton-Schulz iterations per update

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.momentum <= 1:
            raise ConfigError("optimizer.momentum", self.momentum, "use a number in [0, 1]")
        bounded("optimizer.ns_steps", self.ns_steps, 1, 100)


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer as meshrun uses it (see the module docstring)."""

    name: str
    # (OptimizerConfig, schedule, param_names) -> optax.GradientTransformation, or its "module:function"
    build: str | Callable
    moments: int  # state tensors per element of a hidden-layer weight matrix
    moments_other: int  # per element of every other parameter
    elementwise: bool
    update_temps: float = 1.0
    ns_iterations: int = 0  # Newton-Schulz iterations per update (muon: optimizer.ns_steps' default)
    config: type[OptimizerConfig] = OptimizerConfig  # the `optimizer:` section's class: its own options

    def matrix_update_flops(self, d_model: int) -> float:
        """FLOPs per weight-matrix parameter: a quintic Newton-Schulz iteration on an m x n matrix
        (m <= n) is 4 m^2 n + 2 m^3 FLOPs, at most 6 m per element; m taken as d_model."""
        return 6.0 * d_model * self.ns_iterations

    def state_bytes(self, state_dtype: str, master: bool, matrix: bool = True) -> float:
        """Optimizer-state bytes per parameter: the moments in `state_dtype`, plus the float32 master."""
        k = self.moments if matrix else self.moments_other
        return k * STATE_DTYPE_BYTES[state_dtype] + (MASTER_BYTES if master else 0)


OPTIMIZERS = {
    "adamw": OptimizerSpec("adamw", "meshrun.optim.optimizer:adamw", moments=2, moments_other=2, elementwise=True),
    # Newton-Schulz's temporaries (X X^T, its square, their product with X) live after the backward
    # has freed the activations: the compiled step's temp bytes equal adamw's (tiny_cpu, data4)
    "muon": OptimizerSpec(
        "muon",
        "meshrun.optim.optimizer:muon",
        moments=1,
        moments_other=2,
        elementwise=False,
        ns_iterations=5,
        config=MuonConfig,
    ),  # fmt: skip
}


def get(name: str, field: str = "optimizer.name") -> OptimizerSpec:
    """The optimizer registered as `name`, or a user's `package.module:SPEC`; a ConfigError naming
    `field` (the key or flag the name came from) for an unknown one."""
    if ":" in name:
        return _external(name, field)
    if name not in OPTIMIZERS:
        fix = f"use one of {', '.join(sorted(OPTIMIZERS))}, or your own as package.module:SPEC"
        raise ConfigError(field, name, fix, "unknown optimizer")
    return OPTIMIZERS[name]


@cache
def _external(name: str, field: str) -> OptimizerSpec:
    """`package.module:ATTR`: the OptimizerSpec ATTR of an importable module (the user's own optimizer)."""
    spec = import_object(field, name, "SPEC", "OptimizerSpec")
    if not isinstance(spec, OptimizerSpec):
        what = f"not an OptimizerSpec ({type(spec).__name__})"
        raise ConfigError(field, name, "point at a meshrun.OptimizerSpec", what)
    if not (isinstance(spec.config, type) and issubclass(spec.config, OptimizerConfig)):
        raise ConfigError(field, name, "make its config a subclass of meshrun.OptimizerConfig",
                          f"its config is {spec.config!r}")  # fmt: skip
    return spec


config.use_optimizer_classes(lambda name: get(name).config)
