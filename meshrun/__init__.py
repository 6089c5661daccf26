"""meshrun: data x pipeline x tensor (+ expert) parallel training in JAX."""

from meshrun.config import MeshConfig, ModelConfig, RunConfig, load_config
from meshrun.errors import ConfigError

__all__ = ["ConfigError", "MeshConfig", "ModelConfig", "RunConfig", "load_config"]
__version__ = "0.1.0"
