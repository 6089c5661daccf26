"""The llama family's config: the shared `ModelConfig` plus Llama's own fields (SwiGLU or GELU MLP,
RoPE and its scaling, q/k/v biases (Qwen2), a sliding window (Mistral), MoE (Mixtral)).

Plain Python (no jax): `meshrun plan` and config loading read it without starting jax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from meshrun.config import MAX_DIM, ModelConfig, bounded, choice
from meshrun.errors import ConfigError


@dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    """Llama, Mistral, Qwen2 and Mixtral shapes. MoE when n_experts > 0."""

    family: str = "llama"  # Llama, Mistral, Qwen2, Mixtral shapes
    mlp: str = "swiglu"  # swiglu (Llama: 3 matrices) | gelu (GPT-3: 2 matrices, d_ff = 4*d_model)
    tie_embeddings: bool = False  # the output head reuses the embedding matrix
    rope_theta: float = 10000.0  # RoPE base frequency
    # RoPE frequency scaling: none | llama3 (Llama 3.1: low frequencies / factor, smooth band between)
    rope_scaling: str = "none"
    rope_scaling_factor: float = 8.0  # rope_scaling=llama3: the factor low frequencies are divided by
    rope_low_freq_factor: float = 1.0  # rope_scaling=llama3: wavelengths above original_max/low are scaled
    rope_high_freq_factor: float = 4.0  # rope_scaling=llama3: wavelengths below original_max/high are kept
    rope_original_max_seq_len: int = 8192  # rope_scaling=llama3: the context length the model was trained at
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    sliding_window: int = 0  # > 0: a token attends to itself and the sliding_window - 1 tokens before (Mistral)
    n_experts: int = 0  # 0: dense model
    top_k: int = 2  # experts each token is routed to
    capacity_factor: float = 1.25  # moe_dispatch=capacity only
    moe_dispatch: str = "capacity"  # capacity (GShard buffers, drops past capacity) | dropless (grouped matmul)
    moe_every: int = 1  # with n_experts > 0: every k-th layer is MoE (k=2: every other layer)
    aux_loss_coef: float = 0.01  # weight of the Switch load-balancing loss
    z_loss_coef: float = 0.001  # weight of the router z-loss

    context_attention: ClassVar[bool] = True  # all-gather and ring attention over 'context'
    tp_rings: ClassVar[bool] = True  # model.tp_comm_overlap (its attention and dense MLP)
    fp8_gemms: ClassVar[bool] = True  # model.fp8 (its q/k/v, attention output and dense MLP)

    def __post_init__(self):
        super().__post_init__()
        if self.head_dim % 2:  # RoPE rotates pairs of head dimensions
            raise ConfigError("model.head_dim", self.head_dim, "use an even head_dim (RoPE rotates pairs)")
        if not self.rope_theta > 0:
            raise ConfigError("model.rope_theta", self.rope_theta, "use a positive number")
        for f in ("aux_loss_coef", "z_loss_coef"):
            if not getattr(self, f) >= 0:
                raise ConfigError(f"model.{f}", getattr(self, f), "use a number >= 0")
        for f in ("n_experts", "sliding_window", "rope_original_max_seq_len"):
            bounded(f"model.{f}", getattr(self, f), 0, MAX_DIM)
        choice("model.mlp", self.mlp, ("swiglu", "gelu"))
        choice("model.moe_dispatch", self.moe_dispatch, ("capacity", "dropless"))
        choice("model.rope_scaling", self.rope_scaling, ("none", "llama3"))
        if self.rope_scaling == "llama3" and not (
            self.rope_scaling_factor > 0 and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor
        ):
            raise ConfigError(
                "model.rope_low_freq_factor",
                self.rope_low_freq_factor,
                "use 0 < rope_low_freq_factor < rope_high_freq_factor and a positive rope_scaling_factor",
            )
        if self.n_experts:
            if not 1 <= self.top_k <= self.n_experts:
                raise ConfigError("model.top_k", self.top_k, f"use 1 <= top_k <= n_experts={self.n_experts}")
            if self.moe_every < 1 or self.n_layers % self.moe_every:
                raise ConfigError("model.moe_every", self.moe_every, f"use a divisor of model.n_layers={self.n_layers}")
            if self.capacity_factor <= 0:
                raise ConfigError("model.capacity_factor", self.capacity_factor, "use a positive factor")


CONFIG = LlamaConfig
