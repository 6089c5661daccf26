"""meshrun: data x pipeline x tensor (+ expert) parallel training in JAX.

Importing `meshrun` does not import jax (so the CLI can set up simulated devices first); the mesh
and sharding helpers load on first use.
"""

import importlib

from meshrun.config import MeshConfig, ModelConfig, OptimizerConfig, PipelineConfig, RunConfig, load_config
from meshrun.errors import ConfigError
from meshrun.family import registry as _registry  # noqa: F401  (gives meshrun.config the family classes)
from meshrun.optim.registry import OptimizerSpec  # (also gives meshrun.config the optimizer lookup)

__version__ = "0.1.0"

_LAZY = {
    "build_mesh": "meshrun.runtime.mesh",
    "describe": "meshrun.runtime.mesh",
    "describe_dict": "meshrun.runtime.mesh",
    "axis_groups": "meshrun.runtime.mesh",
    "param_rules": "meshrun.parallel.sharding",
    "compute_rules": "meshrun.parallel.sharding",
    "logical_to_spec": "meshrun.parallel.sharding",
    "tree_shardings": "meshrun.parallel.sharding",
    "use_rules": "meshrun.parallel.sharding",
    "state_names": "meshrun.parallel.sharding",
    "ModelFns": "meshrun.family.contract",
    "Family": "meshrun.family.contract",
    "Pipeline": "meshrun.pipeline.executor",
    "PipelineSpec": "meshrun.pipeline.spec",
    "pipeline_spec": "meshrun.pipeline.spec",
    "constrain": "meshrun.parallel.sharding",
}

__all__ = [
    "ConfigError", "MeshConfig", "ModelConfig", "OptimizerConfig", "OptimizerSpec", "PipelineConfig", "RunConfig",
    "load_config", *_LAZY,
]  # fmt: skip


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'meshrun' has no attribute {name!r}")
