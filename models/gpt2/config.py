"""The gpt2 family's config: the shared `ModelConfig` and nothing more. GPT-2 fixes what Llama lets
users choose (a GELU MLP, tied embeddings, q/k/v biases, multi-head attention, learned positions), so
a field such as `model.mlp` or `model.rope_theta` is refused naming gpt2.

Plain Python (no jax): `meshrun plan` and config loading read it without starting jax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from meshrun.config import ModelConfig
from meshrun.errors import ConfigError


@dataclass(frozen=True)
class Gpt2Config(ModelConfig):
    """GPT-2 shapes: LayerNorm, learned positions, GELU MLP, biases, tied embeddings, MHA."""

    family: str = "gpt2"  # GPT-2 shapes
    n_kv_heads: int = 4  # = n_heads: multi-head attention

    # what GPT-2 always does (the shared attention and the planner read them)
    mlp: ClassVar[str] = "gelu"
    tie_embeddings: ClassVar[bool] = True
    qkv_bias: ClassVar[bool] = True
    sliding_window: ClassVar[int] = 0

    def __post_init__(self):
        super().__post_init__()
        if self.n_kv_heads != self.n_heads:
            raise ConfigError(
                "model.n_kv_heads", self.n_kv_heads, f"set it to model.n_heads={self.n_heads}",
                "model.family=gpt2 is multi-head attention (no grouped-query attention)",
            )  # fmt: skip


CONFIG = Gpt2Config
