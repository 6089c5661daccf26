"""`optimizer:`: the optimizer, its learning-rate schedule, clipping and state dtype."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from meshrun.config.base import MAX_STEPS, _bounded, _choice
from meshrun.errors import ConfigError

OPTIMIZER_STATE_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer (`name`), its learning-rate schedule (linear warmup from 0 to lr, cosine decay to
    min_lr_ratio·lr at decay_steps or train.steps) and global-norm clipping. `state_dtype`: the dtype of
    its moments (the float32 master copy stays float32). An optimizer with options of its own has a
    subclass (its registry entry's `config`); a key the chosen optimizer does not have is refused."""

    # adamw | muon (meshrun/optim/registry.py), or your own optimizer as package.module:SPEC (docs/optimizers.md)
    name: str = "adamw"
    lr: float = 3e-3  # peak learning rate (linear warmup, then cosine decay)
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 2  # steps of linear warmup from 0
    weight_decay: float = 0.01  # decoupled weight decay (AdamW; muon: on every parameter too)
    beta1: float = 0.9  # Adam first-moment decay (muon: of its Adam part, the non-matrix parameters)
    beta2: float = 0.95  # Adam second-moment decay
    eps: float = 1e-8  # Adam epsilon (muon: also the Newton-Schulz normalization's)
    grad_clip: float = 1.0  # clip the global gradient norm to this (0: off)
    state_dtype: str = "float32"  # dtype of the moments: float32 | bfloat16 (the fp32 master stays fp32)
    decay_steps: int = 0  # the cosine reaches min_lr_ratio·lr at this step (0: train.steps), then stays

    def __post_init__(self):
        if _lookup is not None and type(self) is not (cls := _lookup(self.name)):  # unknown names: ConfigError
            raise TypeError(f"optimizer.name={self.name} takes {cls.__name__} (optimizer_class(name)), not "
                            f"{type(self).__name__}")  # fmt: skip
        _bounded("optimizer.decay_steps", self.decay_steps, 0, MAX_STEPS)
        if not self.lr > 0:
            raise ConfigError("optimizer.lr", self.lr, "use a positive learning rate")
        if self.warmup_steps < 0:
            raise ConfigError("optimizer.warmup_steps", self.warmup_steps, "use 0 (no warmup) or a positive step count")
        for f in ("beta1", "beta2", "min_lr_ratio"):
            if not 0 <= getattr(self, f) <= 1:
                raise ConfigError(f"optimizer.{f}", getattr(self, f), "use a number in [0, 1]")
        for f in ("weight_decay", "grad_clip"):
            if not getattr(self, f) >= 0:
                raise ConfigError(f"optimizer.{f}", getattr(self, f), "use a number >= 0 (0: off)")
        if not self.eps > 0:
            raise ConfigError("optimizer.eps", self.eps, "use a small positive number, e.g. 1e-8")
        _choice("optimizer.state_dtype", self.state_dtype, OPTIMIZER_STATE_DTYPES)


# Options an optimizer's own class holds now, once every optimizer's: {key: (owner, the old default)}.
# An old config.yaml (every run wrote them) loads under another optimizer when it states the default.
OWN_KEYS = {"optimizer.momentum": ("muon", 0.95), "optimizer.ns_steps": ("muon", 5)}

# The config class of an `optimizer.name` (its registry entry's, or the user's `package.module:SPEC`'s),
# installed by `meshrun.optim.registry` when imported (the `meshrun` package imports it first).
_lookup: Callable[[str], type[OptimizerConfig]] | None = None


def use_optimizer_classes(lookup: Callable[[str], type[OptimizerConfig]]) -> None:
    global _lookup
    _lookup = lookup


def optimizer_class(name: str) -> type[OptimizerConfig]:
    """The config class of optimizer `name`; ConfigError for an unknown one (or one that does not import)."""
    if _lookup is None:
        raise RuntimeError("no optimizers registered: import meshrun.optim.registry")
    return _lookup(name)
