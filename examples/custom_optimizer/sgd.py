"""SGD with momentum as a meshrun optimizer, using only meshrun's public API and optax.

    m <- momentum * m + g        p <- p - lr * m

`lr` follows the run's schedule (optimizer.lr, warmup_steps, min_lr_ratio, decay_steps);
`momentum` is this optimizer's own key, optimizer.momentum (`SgdConfig`). meshrun wraps it as it
wraps its own optimizers: global-norm clipping (optimizer.grad_clip), the moments in
optimizer.state_dtype, a float32 master copy of params stored below float32. Each element's update
reads only that element and the step count (`elementwise=True`), so the offload tiers may update
the state chunk by chunk.

PYTHONPATH=examples meshrun train configs/tiny_cpu.yaml optimizer.name=custom_optimizer.sgd:SGD optimizer.momentum=0.8
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from meshrun import ConfigError, OptimizerConfig, OptimizerSpec


@dataclass(frozen=True)
class SgdConfig(OptimizerConfig):
    """The `optimizer:` section with this optimizer: the shared keys and its own."""

    name: str = "custom_optimizer.sgd:SGD"
    momentum: float = 0.9  # m <- momentum * m + g

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.momentum < 1:
            raise ConfigError("optimizer.momentum", self.momentum, "use a number in [0, 1)")


class SgdState(NamedTuple):
    count: jax.Array  # steps taken: the schedule's input
    momentum: Any  # one params-shaped tree: meshrun shards and offloads it like the params


def sgd(opt: SgdConfig, schedule: optax.Schedule, param_names: Any = None) -> optax.GradientTransformation:
    """`opt`: the run's `optimizer:` section; `schedule`: step -> learning rate; `param_names`: the
    model's logical axis names per parameter (for optimizers that treat weight matrices apart)."""
    del param_names

    def init(params):
        return SgdState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.zeros_like, params))

    def update(grads, state, params=None):
        del params
        m = jax.tree.map(lambda g, t: g + opt.momentum * t, grads, state.momentum)
        lr = schedule(state.count)
        return jax.tree.map(lambda t: -lr * t, m), SgdState(state.count + 1, m)

    return optax.GradientTransformation(init, update)


# moments: state tensors per parameter element (the planner's memory model reads them)
SGD = OptimizerSpec("sgd", build=sgd, moments=1, moments_other=1, elementwise=True, config=SgdConfig)
