"""The gpt2 family (GPT-2 shapes): `meshrun_models.gpt2.model` behind `Family`."""

from __future__ import annotations

import dataclasses
import functools

from meshrun_models.gpt2 import hf, model
from meshrun_models.layers import arrays
from meshrun_models.transformer import validate_model_for_mesh

from meshrun.config import ModelConfig
from meshrun.errors import ConfigError
from meshrun.family.contract import Family, ModelFns
from meshrun.parallel.sharding import state_names

# ModelConfig fields GPT-2 has no use for: set to anything but their default they are refused rather
# than silently ignored. (`mlp`, `tie_embeddings` and `qkv_bias` are not among them: GPT-2 fixes them
# (gelu, tied, biases) and each of their two values is either the default or what GPT-2 does; the
# planner's estimates read `mlp` and `tie_embeddings`, so a gpt2 config states gelu and true.)
UNUSED = (
    "rope_theta", "rope_scaling", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
    "rope_original_max_seq_len", "sliding_window", "n_experts", "top_k", "capacity_factor", "moe_dispatch",
    "moe_every", "aux_loss_coef", "z_loss_coef",
)  # fmt: skip
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}


def check_config(cfg: ModelConfig) -> None:
    """ConfigError for a model field GPT-2 does not use, or for grouped-query attention."""
    for name in UNUSED:
        value = getattr(cfg, name)
        if value != _DEFAULTS[name]:
            raise ConfigError(f"model.{name}", value, "remove it", "not used by model.family=gpt2")
    if cfg.n_kv_heads != cfg.n_heads:
        raise ConfigError(
            "model.n_kv_heads", cfg.n_kv_heads, f"set it to model.n_heads={cfg.n_heads}",
            "model.family=gpt2 is multi-head attention (no grouped-query attention)",
        )  # fmt: skip


@functools.cache
def model_fns(cfg: ModelConfig) -> ModelFns:
    return ModelFns(
        embed=lambda prm, tok: model.embed(prm, tok, cfg),
        apply_layers=lambda lp, x: model.apply_layers(lp, x, cfg),
        head_loss=lambda prm, x, lab: model.head_loss(prm, x, lab, cfg),
        param_names=state_names(model.abstract_params(cfg)),
        sequence_parallel=cfg.sequence_parallel,
        segments=False,
    )


FAMILY = Family(
    name="gpt2",
    model_fns=model_fns,
    init_params=lambda cfg, seed: arrays(model.init_params(cfg, seed)),
    abstract_params=model.abstract_params,
    check_mesh=validate_model_for_mesh,
    check_config=check_config,
    hf=hf,
)
