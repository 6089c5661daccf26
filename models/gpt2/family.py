"""The gpt2 family's `FAMILY`: `meshrun_models.gpt2.model` behind `Family`."""

from __future__ import annotations

import functools

from meshrun_models.gpt2 import hf, model
from meshrun_models.gpt2.config import Gpt2Config
from meshrun_models.layers import arrays
from meshrun_models.transformer import validate_model_for_mesh

from meshrun.family.contract import Family, ModelFns
from meshrun.parallel.sharding import state_names


@functools.cache
def model_fns(cfg: Gpt2Config) -> ModelFns:
    return ModelFns(
        embed=lambda prm, tok: model.embed(prm, tok, cfg),
        apply_layers=lambda lp, x: model.apply_layers(lp, x, cfg),
        head_loss=lambda prm, x, lab: model.head_loss(prm, x, lab, cfg),
        param_names=state_names(model.abstract_params(cfg)),
        sequence_parallel=cfg.sequence_parallel,
        segments=False,
        context=cfg.context_attention,
    )


FAMILY = Family(
    name="gpt2",
    config=Gpt2Config,
    model_fns=model_fns,
    init_params=lambda cfg, seed: arrays(model.init_params(cfg, seed)),
    abstract_params=model.abstract_params,
    check_mesh=validate_model_for_mesh,
    hf=hf,
)
