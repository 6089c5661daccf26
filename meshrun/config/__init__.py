"""Typed, frozen configs: one small dataclass per section, loaded from YAML + `section.key=value`.

Each component gets only its own section (layers get `ModelConfig`, the mesh builder `MeshConfig`);
each section's module holds its schema and its rules, `run` the rules across sections and `load` the
loading. Every error is a `ConfigError` naming the field, the value seen and the fix.
"""

from meshrun.config.base import (
    MAX_DEVICES,
    MAX_DIM,
    MAX_MICROBATCHES,
    MAX_SIMULATED_DEVICES,
    MAX_STEPS,
    bounded,
    check_device_count,
    choice,
)
from meshrun.config.checkpoint import CheckpointConfig
from meshrun.config.data import DataConfig
from meshrun.config.load import (
    from_dict,
    load_config,
    load_mesh,
    load_section,
    load_yaml,
    merge,
    model_from_dict,
    optimizer_from_dict,
    parse_overrides,
    saved_model,
    to_dict,
)
from meshrun.config.mesh import AXES, DEFAULT_ORDER, MeshConfig, check_zero_group, resolve_shape
from meshrun.config.model import (
    CONTEXT_KINDS,
    EXECUTION_FIELDS,
    FP8_FIELDS,
    FP8_RECIPES,
    MAX_AMAX_HISTORY,
    REMATS,
    ModelConfig,
    default_model,
    model_class,
    use_model_classes,
)
from meshrun.config.offload import (
    OFFLOAD_GRADS,
    OFFLOAD_TIERS,
    OFFLOAD_UPDATE_ON,
    OFFLOAD_UPDATES,
    OffloadConfig,
    fp8_tier_refusal,
    offload_params_refusals,
    streamed_update_refusal,
    streams_host_update,
)
from meshrun.config.optimizer import (
    OPTIMIZER_STATE_DTYPES,
    OptimizerConfig,
    optimizer_class,
    use_optimizer_classes,
)
from meshrun.config.pipeline import PipelineConfig
from meshrun.config.run import MOVED_KEYS, RunConfig
from meshrun.config.train import GRAD_REDUCE_DTYPES, ZERO2_REDUCES, ZERO3_GATHERS, TrainConfig
from meshrun.config.zero import (
    LAYER_GATHER_AUTO_BYTES,
    zero2_layer_refusals,
    zero2_per_microbatch,
    zero3_layer_refusals,
    zero3_per_layer,
)
from meshrun.errors import ConfigError

__all__ = [
    "AXES", "CONTEXT_KINDS", "DEFAULT_ORDER", "EXECUTION_FIELDS", "FP8_FIELDS", "FP8_RECIPES",
    "GRAD_REDUCE_DTYPES", "MAX_AMAX_HISTORY", "MAX_DEVICES", "MAX_DIM", "MAX_MICROBATCHES",
    "MAX_SIMULATED_DEVICES", "MAX_STEPS", "MOVED_KEYS",
    "OFFLOAD_GRADS", "OFFLOAD_TIERS", "OFFLOAD_UPDATES", "OFFLOAD_UPDATE_ON", "OPTIMIZER_STATE_DTYPES",
    "REMATS", "CheckpointConfig", "ConfigError", "DataConfig", "MeshConfig", "ModelConfig", "OffloadConfig",
    "OptimizerConfig", "PipelineConfig", "RunConfig", "TrainConfig", "bounded", "check_device_count",
    "check_zero_group", "choice", "default_model", "fp8_tier_refusal", "from_dict", "load_config", "load_mesh",
    "load_section", "load_yaml", "merge",
    "model_class", "model_from_dict", "offload_params_refusals", "optimizer_class", "optimizer_from_dict",
    "parse_overrides", "resolve_shape", "saved_model", "streamed_update_refusal", "streams_host_update", "to_dict",
    "use_model_classes", "use_optimizer_classes",
    "LAYER_GATHER_AUTO_BYTES", "ZERO2_REDUCES", "ZERO3_GATHERS", "zero2_layer_refusals", "zero2_per_microbatch",
    "zero3_layer_refusals", "zero3_per_layer",
]  # fmt: skip
