"""The whole run's config: one section per component, and the rules that cross sections."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from meshrun.config.checkpoint import CheckpointConfig
from meshrun.config.data import DataConfig
from meshrun.config.mesh import MeshConfig
from meshrun.config.model import ModelConfig, default_model
from meshrun.config.offload import OffloadConfig, fp8_tier_refusal
from meshrun.config.optimizer import OptimizerConfig
from meshrun.config.pipeline import PipelineConfig
from meshrun.config.train import TrainConfig
from meshrun.errors import ConfigError


@dataclass(frozen=True)
class RunConfig:
    mesh: MeshConfig = field(default_factory=MeshConfig)
    model: ModelConfig = field(default_factory=default_model)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self):
        self.offload.check_run(self.train.zero)
        if why := fp8_tier_refusal(self.model.fp8, self.offload.optimizer):
            fix = "use offload.optimizer=host (its update carries it) or model.fp8=tensorwise"
            raise ConfigError("offload.optimizer", self.offload.optimizer, fix, why)
        if self.model.fp8 == "blockwise" and self.mesh.context > 1:
            _check_blockwise_context(self.model, self.mesh.context, self.train.seq_len)
        if self.train.zero3_gather == "step" and self.offload.params:
            raise ConfigError("train.zero3_gather", "step", "leave it auto (or layer) with offload.params",
                              "offload.params fetches each layer inside the layer scan")  # fmt: skip
        if self.mesh.zero_group and self.train.zero == 0:
            raise ConfigError("mesh.zero_group", self.mesh.zero_group, "set train.zero to 1, 2 or 3 with it, or "
                              "leave it 0", "groups shard ZeRO state, and train.zero=0 has none")  # fmt: skip


def _check_blockwise_context(model: ModelConfig, context: int, seq_len: int) -> None:
    """Blockwise's weight gradient tiles b tokens of a sequence: exact under a context split when each
    shard's contiguous chunks (L/c, or L/2c in the ring's zigzag) are whole tiles of b. (The experts'
    token tiles are their buffers' or rows' on each shard, whatever the split.)"""
    chunk = seq_len // (context * (2 if model.context_parallel == "ring" else 1))
    if chunk % model.fp8_block:
        fix = f"use a model.fp8_block that divides {chunk} (e.g. {math.gcd(chunk, model.fp8_block)}), or mesh.context=1"
        why = f"the weight gradient's {model.fp8_block}-token tiles would span the context shards' {chunk}-token chunks"
        raise ConfigError("mesh.context", context, fix, why)


# Keys that moved to another section: an old YAML fails with one line naming the new key.
MOVED_KEYS = {f"train.{k}": f"optimizer.{k}" for k in
              ("lr", "min_lr_ratio", "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip")}  # fmt: skip
MOVED_KEYS["train.adam_eps"] = "optimizer.eps"
MOVED_KEYS.update({f"train.offload_{k}": f"offload.{k}" for k in
                   ("optimizer", "dir", "budget_mb", "update", "update_on", "params", "grads")})  # fmt: skip
