"""The llama family's `FAMILY`: `meshrun_models.transformer` behind `Family`."""

from meshrun_models import transformer
from meshrun_models.api import model_fns
from meshrun_models.layers import arrays
from meshrun_models.llama import hf
from meshrun_models.llama.config import LlamaConfig

from meshrun.family.contract import Family

FAMILY = Family(
    name="llama",
    config=LlamaConfig,
    model_fns=model_fns,
    init_params=lambda cfg, seed: arrays(transformer.init_params(cfg, seed)[1]),
    abstract_params=transformer.abstract_params,
    check_mesh=transformer.validate_model_for_mesh,
    hf=hf,
)
