"""meshrun: data x pipeline x tensor (+ expert) parallel training in JAX.

Importing `meshrun` does not import jax (so the CLI can set up simulated devices first); the mesh
and sharding helpers load on first use.
"""

from meshrun.config import MeshConfig, ModelConfig, RunConfig, load_config
from meshrun.errors import ConfigError

__version__ = "0.1.0"

_LAZY = {
    "build_mesh": "meshrun.mesh",
    "describe": "meshrun.mesh",
    "describe_dict": "meshrun.mesh",
    "axis_groups": "meshrun.mesh",
    "param_rules": "meshrun.sharding",
    "compute_rules": "meshrun.sharding",
    "logical_to_spec": "meshrun.sharding",
    "tree_shardings": "meshrun.sharding",
    "use_rules": "meshrun.sharding",
    "constrain": "meshrun.sharding",
}

__all__ = ["ConfigError", "MeshConfig", "ModelConfig", "RunConfig", "load_config", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'meshrun' has no attribute {name!r}")
