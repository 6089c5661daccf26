"""The llama family's config: the shared `ModelConfig` plus Llama's own fields (SwiGLU or GELU MLP,
RoPE and its scaling, q/k/v biases (Qwen2), a sliding window (Mistral), MoE (Mixtral)).

Plain Python (no jax): `meshrun plan` and config loading read it without starting jax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from meshrun.config import MAX_DIM, ModelConfig, bounded, choice
from meshrun.errors import ConfigError

MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    """Llama, Mistral, Qwen2 and Mixtral shapes. MoE when n_experts > 0."""

    family: str = "llama"  # Llama, Mistral, Qwen2, Mixtral shapes
    mlp: str = "swiglu"  # swiglu (Llama: 3 matrices) | gelu (GPT-3: 2 matrices, d_ff = 4*d_model)
    tie_embeddings: bool = False  # the output head reuses the embedding matrix
    rope_theta: float = 10000.0  # RoPE base frequency
    # RoPE frequency scaling: none | llama3 (Llama 3.1: low frequencies / factor, smooth band between) |
    # yarn (YaRN: Qwen, DeepSeek-V3; low frequencies / factor, a linear ramp between beta_fast and beta_slow)
    rope_scaling: str = "none"
    rope_scaling_factor: float = 8.0  # llama3 | yarn: the factor low frequencies are divided by
    rope_low_freq_factor: float = 1.0  # rope_scaling=llama3: wavelengths above original_max/low are scaled
    rope_high_freq_factor: float = 4.0  # rope_scaling=llama3: wavelengths below original_max/high are kept
    rope_original_max_seq_len: int = 8192  # llama3 | yarn: the context length the model was trained at
    rope_beta_fast: float = 32.0  # yarn: dims turning more than beta_fast times in original_max are kept
    rope_beta_slow: float = 1.0  # yarn: dims turning fewer than beta_slow times are divided by the factor
    rope_attention_factor: float = 0.0  # yarn: RoPE's cos and sin are multiplied by it (0: 0.1 ln(factor) + 1)
    # yarn: > 0: the softmax scale is multiplied by (0.1 rope_mscale_all_dim ln(factor) + 1)^2 (DeepSeek-V3)
    rope_mscale_all_dim: float = 0.0
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm of each q and k head (a head_dim scale each) before RoPE (Qwen3)
    sliding_window: int = 0  # > 0: a token attends to itself and the sliding_window - 1 tokens before (Mistral)
    n_experts: int = 0  # 0: dense model
    top_k: int = 2  # experts each token is routed to
    capacity_factor: float = 1.25  # moe_dispatch=capacity only
    moe_dispatch: str = "capacity"  # capacity (GShard buffers, drops past capacity) | dropless (grouped matmul)
    moe_every: int = 1  # with n_experts > 0: every k-th layer is MoE (k=2: every other layer)
    moe_d_ff: int = 0  # one routed expert's hidden size (0: d_ff; Qwen3-MoE and DeepSeek-V3 use narrower ones)
    n_shared_experts: int = 0  # experts every token passes through (one MLP of width n_shared_experts * moe_d_ff)
    first_dense_layers: int = 0  # the first k layers are dense (width d_ff), the MoE units follow
    router_score: str = "softmax"  # softmax (Mixtral, Qwen3-MoE) | sigmoid (DeepSeek-V3) expert scores
    router_norm_topk: bool = True  # top_k > 1: the k chosen scores are renormalised to sum 1
    routed_scaling: float = 1.0  # the routed experts' output is multiplied by this (DeepSeek-V3: 2.5)
    # aux_loss: balanced by the loss below only | bias: a per-expert bias added to the scores for the
    # choice only (not the gates), moved by bias_rate after each step towards the mean load
    # (DeepSeek-V3's auxiliary-loss-free balancing); aux_loss_coef still weighs the per-sequence loss
    balance: str = "aux_loss"
    bias_rate: float = 0.001  # balance=bias: step of the bias update (bias += rate * sign(mean load - load))
    # > 1: the experts form this many groups (e.g. the expert-parallel ranks or a multiple) and a token's
    # top_k experts lie in its route_group_limit best groups (device-limited routing)
    route_groups: int = 0
    route_group_limit: int = 0  # with route_groups: the groups a token may use (1..route_groups)
    # gqa: grouped-query attention (n_kv_heads, head_dim) | mla: DeepSeek-V2/V3's multi-head latent attention
    # (the fields below; n_kv_heads and head_dim are unused): K/V from a normed latent of kv_lora_rank,
    # q from one of q_lora_rank (0: a full projection), q/k heads of qk_nope + qk_rope dims (the RoPE
    # part of k shared by every head), v heads of v_head_dim
    attention: str = "gqa"
    q_lora_rank: int = 0  # mla: rank of the normed query latent (0: no query compression)
    kv_lora_rank: int = 0  # mla: rank of the normed key/value latent (DeepSeek-V3: 512)
    qk_nope_head_dim: int = 0  # mla: per-head q/k dims without RoPE (DeepSeek-V3: 128)
    qk_rope_head_dim: int = 0  # mla: q/k dims with RoPE, even; k's are one head shared by all (DeepSeek-V3: 64)
    v_head_dim: int = 0  # mla: per-head value dims, at most qk_nope_head_dim + qk_rope_head_dim (DeepSeek-V3: 128)
    aux_loss_coef: float = 0.01  # weight of the load-balancing loss (per sequence: Switch's = DeepSeek's sequence-wise)
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
        for f in ("aux_loss_coef", "z_loss_coef", "bias_rate"):
            if not getattr(self, f) >= 0:
                raise ConfigError(f"model.{f}", getattr(self, f), "use a number >= 0")
        for f in ("n_experts", "sliding_window", "rope_original_max_seq_len"):
            bounded(f"model.{f}", getattr(self, f), 0, MAX_DIM)
        choice("model.mlp", self.mlp, ("swiglu", "gelu"))
        choice("model.moe_dispatch", self.moe_dispatch, ("capacity", "dropless"))
        choice("model.router_score", self.router_score, ("softmax", "sigmoid"))
        choice("model.balance", self.balance, ("aux_loss", "bias"))
        if not isinstance(self.router_norm_topk, bool):
            raise ConfigError("model.router_norm_topk", self.router_norm_topk, "use true or false")
        if not self.routed_scaling > 0:
            raise ConfigError("model.routed_scaling", self.routed_scaling, "use a positive factor, e.g. 1.0")
        self._check_moe_shapes()
        self._check_mla()
        self._check_fp8_block()
        self._check_rope()
        if self.n_experts:
            if not 1 <= self.top_k <= self.n_experts:
                raise ConfigError("model.top_k", self.top_k, f"use 1 <= top_k <= n_experts={self.n_experts}")
            n_moe = self.n_layers - self.first_dense_layers  # layers in MoE units
            if self.moe_every < 1 or n_moe % self.moe_every:
                what = f"model.n_layers - model.first_dense_layers={n_moe}" if self.first_dense_layers else \
                    f"model.n_layers={self.n_layers}"  # fmt: skip
                raise ConfigError("model.moe_every", self.moe_every, f"use a divisor of {what}")
            if self.capacity_factor <= 0:
                raise ConfigError("model.capacity_factor", self.capacity_factor, "use a positive factor")

    def _check_rope(self) -> None:
        """model.rope_scaling and its parameters (llama3, yarn)."""
        choice("model.rope_scaling", self.rope_scaling, ("none", "llama3", "yarn"))
        if self.rope_scaling == "llama3" and not (
            self.rope_scaling_factor > 0 and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor
        ):
            raise ConfigError(
                "model.rope_low_freq_factor",
                self.rope_low_freq_factor,
                "use 0 < rope_low_freq_factor < rope_high_freq_factor and a positive rope_scaling_factor",
            )
        if self.rope_scaling != "yarn":
            return
        for f in ("rope_scaling_factor", "rope_beta_slow", "rope_original_max_seq_len"):
            if not getattr(self, f) > 0:
                raise ConfigError(f"model.{f}", getattr(self, f), "use a positive number with rope_scaling=yarn")
        if not self.rope_beta_fast >= self.rope_beta_slow:
            raise ConfigError(
                "model.rope_beta_fast", self.rope_beta_fast, f"use at least rope_beta_slow={self.rope_beta_slow}"
            )
        for f in ("rope_attention_factor", "rope_mscale_all_dim"):
            if not getattr(self, f) >= 0:
                raise ConfigError(f"model.{f}", getattr(self, f), "use a number >= 0 (0: unset)")

    def yarn_scales(self) -> tuple[float, float]:
        """rope_scaling=yarn's (factor on RoPE's cos and sin, factor on the softmax scale), as transformers'
        `_compute_yarn_parameters` and DeepseekV3Attention; (1.0, 1.0) otherwise."""
        if self.rope_scaling != "yarn":
            return 1.0, 1.0
        f, ma = self.rope_scaling_factor, self.rope_mscale_all_dim
        m = lambda x: 1.0 if f <= 1 else 0.1 * x * math.log(f) + 1.0
        return self.rope_attention_factor or m(1.0), m(ma) ** 2 if ma else 1.0

    @property
    def qk_head_dim(self) -> int:
        """One query/key head's size: qk_nope_head_dim + qk_rope_head_dim (mla), or head_dim."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    def _check_mla(self) -> None:
        """model.attention=mla's ranks and head dims (DeepSeek-V2/V3), and model.qk_norm."""
        if not isinstance(self.qk_norm, bool):
            raise ConfigError("model.qk_norm", self.qk_norm, "use true or false")
        choice("model.attention", self.attention, ("gqa", "mla"))
        for f in MLA_FIELDS:
            bounded(f"model.{f}", getattr(self, f), 0, MAX_DIM)
        if self.attention != "mla":
            for f in MLA_FIELDS:
                if getattr(self, f):
                    raise ConfigError(f"model.{f}", getattr(self, f), "set model.attention=mla with it, or use 0")
            return
        for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, f) < 1:
                raise ConfigError(f"model.{f}", getattr(self, f), "use a positive size with model.attention=mla")
        if self.qk_rope_head_dim % 2:  # RoPE rotates pairs of dimensions
            raise ConfigError("model.qk_rope_head_dim", self.qk_rope_head_dim, "use an even size (RoPE rotates pairs)")
        if self.v_head_dim > self.qk_head_dim:  # v is zero-padded to the q/k head size for the attention kernels
            raise ConfigError(
                "model.v_head_dim", self.v_head_dim,
                f"use at most qk_nope_head_dim + qk_rope_head_dim = {self.qk_head_dim} with model.attention=mla",
            )  # fmt: skip
        for f, off in (("qkv_bias", False), ("qk_norm", False), ("tp_comm_overlap", False)):
            if getattr(self, f) != off:
                raise ConfigError(
                    f"model.{f}", getattr(self, f), f"use {f}={str(off).lower()} with model.attention=mla",
                    "multi-head latent attention has no such variant here",
                )  # fmt: skip

    def _check_fp8_block(self) -> None:
        """fp8=blockwise: fp8_block (or a smaller dim, one tile) tiles every covered GEMM's dims. MLA's
        ranks and head dims may end in a partial tile, zero-padded (DeepSeek-V3's scale grids round up:
        its kv_down has 576 rows, its q heads 192 dims); none of them is split over 'tensor'."""
        if self.fp8 != "blockwise":
            return
        b, dims = self.fp8_block, [("d_model", self.d_model), ("d_ff", self.d_ff)]
        if self.attention != "mla":
            dims.append(("head_dim", self.head_dim))
        if self.n_experts:
            shared = self.n_shared_experts * self.expert_d_ff
            dims += [("moe_d_ff", self.expert_d_ff), ("n_shared_experts * moe_d_ff", shared)]
        for name, dim in dims:
            if dim and dim % min(b, dim):
                raise ConfigError(
                    "model.fp8_block", b, f"use a block that divides {name}={dim} (e.g. {math.gcd(b, dim)}), "
                    "or model.fp8=tensorwise", f"model.{name}={dim} is neither smaller than it nor a multiple of it",
                )  # fmt: skip

    def _check_moe_shapes(self) -> None:
        """The fine-grained / shared / routing fields (Qwen3-MoE, DeepSeek-V3)."""
        for f in ("moe_d_ff", "n_shared_experts", "first_dense_layers", "route_groups", "route_group_limit"):
            bounded(f"model.{f}", getattr(self, f), 0, MAX_DIM)
        if not self.n_experts:
            for f, default in (("n_shared_experts", 0), ("moe_d_ff", 0), ("first_dense_layers", 0),
                               ("route_groups", 0), ("balance", "aux_loss"), ("router_score", "softmax")):  # fmt: skip
                if getattr(self, f) != default:
                    raise ConfigError(
                        f"model.{f}", getattr(self, f), f"set model.n_experts > 0 (routed experts), or {f}={default}",
                        "a dense model has no routed experts",
                    )  # fmt: skip
            return
        if self.first_dense_layers >= self.n_layers:
            raise ConfigError(
                "model.first_dense_layers", self.first_dense_layers,
                f"use fewer than model.n_layers={self.n_layers} (at least one MoE layer), or n_experts=0",
            )  # fmt: skip
        g, m = self.route_groups, self.route_group_limit
        if g > 1:
            if self.n_experts % g:
                raise ConfigError(
                    "model.route_groups", g, f"use a divisor of model.n_experts={self.n_experts}, or 0 (no groups)"
                )
            if not 1 <= m <= g:
                raise ConfigError("model.route_group_limit", m, f"use 1..model.route_groups={g}")
            if m * (self.n_experts // g) < self.top_k:
                raise ConfigError(
                    "model.route_group_limit", m,
                    f"allow at least {-(-self.top_k // (self.n_experts // g))} groups of {self.n_experts // g} "
                    f"experts for top_k={self.top_k}",
                )  # fmt: skip
        elif m:
            raise ConfigError("model.route_group_limit", m, "set model.route_groups > 1 with it, or use 0")


CONFIG = LlamaConfig
