"""`optimizer:`: the optimizer, its learning-rate schedule, clipping and state dtype."""

from __future__ import annotations

from dataclasses import dataclass

from meshrun.config.base import MAX_STEPS, _bounded, _choice
from meshrun.errors import ConfigError

OPTIMIZER_STATE_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer (`name`: an entry of meshrun/optim/registry.py), its learning-rate schedule
    (linear warmup from 0 to lr, cosine decay to min_lr_ratio·lr at decay_steps or train.steps) and
    global-norm clipping. `state_dtype`: the dtype of its moments (the float32 master copy stays float32)."""

    name: str = "adamw"  # an entry of meshrun/optim/registry.py: adamw | muon
    lr: float = 3e-3  # peak learning rate (linear warmup, then cosine decay)
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 2  # steps of linear warmup from 0
    weight_decay: float = 0.01  # decoupled weight decay (AdamW; muon: on every parameter too)
    beta1: float = 0.9  # Adam first-moment decay (muon: of its Adam part, the non-matrix parameters)
    beta2: float = 0.95  # Adam second-moment decay
    eps: float = 1e-8  # Adam epsilon (muon: also the Newton-Schulz normalization's)
    grad_clip: float = 1.0  # clip the global gradient norm to this (0: off)
    momentum: float = 0.95  # muon: momentum of the orthogonalized weight matrices
    ns_steps: int = 5  # muon: Newton-Schulz iterations
    state_dtype: str = "float32"  # dtype of the moments: float32 | bfloat16 (the fp32 master stays fp32)
    decay_steps: int = 0  # the cosine reaches min_lr_ratio·lr at this step (0: train.steps), then stays

    def __post_init__(self):
        _bounded("optimizer.decay_steps", self.decay_steps, 0, MAX_STEPS)
        if not self.lr > 0:
            raise ConfigError("optimizer.lr", self.lr, "use a positive learning rate")
        if self.warmup_steps < 0:
            raise ConfigError("optimizer.warmup_steps", self.warmup_steps, "use 0 (no warmup) or a positive step count")
        for f in ("beta1", "beta2", "min_lr_ratio", "momentum"):
            if not 0 <= getattr(self, f) <= 1:
                raise ConfigError(f"optimizer.{f}", getattr(self, f), "use a number in [0, 1]")
        for f in ("weight_decay", "grad_clip"):
            if not getattr(self, f) >= 0:
                raise ConfigError(f"optimizer.{f}", getattr(self, f), "use a number >= 0 (0: off)")
        if not self.eps > 0:
            raise ConfigError("optimizer.eps", self.eps, "use a small positive number, e.g. 1e-8")
        _bounded("optimizer.ns_steps", self.ns_steps, 1, 100)
        _choice("optimizer.state_dtype", self.state_dtype, OPTIMIZER_STATE_DTYPES)
