"""Parameter and FLOP counts of the decoder-only transformer (pure Python, no JAX).

One home for the counts the planner's cost model and the training metrics (MFU) both use.
Letters: B global batch (sequences), s sequence length, h d_model, L layers, V vocab, a heads.
FLOPs: 2 per multiply-add; the backward costs twice the forward (Kaplan et al. 2020; PaLM,
Chowdhery et al. 2022, appendix B). For GPT (gelu, d_ff = 4h, full MHA) the model FLOPs equal
Megatron-LM's 72 B s L h^2 (1 + s/(6h) + V/(12 L h)) (Narayanan et al. 2021, section 5.1).
"""

from __future__ import annotations

import functools

from meshrun.config import ModelConfig

# ----------------------------------------------------------------------------- parameters


def is_mla(m: ModelConfig) -> bool:
    """model.attention=mla (DeepSeek-V2/V3's multi-head latent attention; the llama family's option)."""
    return getattr(m, "attention", "gqa") == "mla"


def attn_params(m: ModelConfig) -> int:
    """The attention's matmul weights: Wq, Wk, Wv, Wo (GQA: fewer kv heads); MLA: the query (or its
    down and up projections), the K/V down projection (latent + shared RoPE key), its up projection
    (per-head k_nope and v) and Wo."""
    if is_mla(m):
        h, dq, r = m.n_heads, m.qk_nope_head_dim + m.qk_rope_head_dim, m.kv_lora_rank
        q = m.q_lora_rank * (m.d_model + h * dq) if m.q_lora_rank else m.d_model * h * dq
        kv = m.d_model * (r + m.qk_rope_head_dim) + r * h * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + h * m.v_head_dim * m.d_model
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    return m.d_model * q + 2 * m.d_model * kv + q * m.d_model  # Wq, Wk, Wv, Wo (GQA: fewer kv heads)


def qkv_widths(m: ModelConfig) -> tuple[int, int]:
    """(q, kv): elements per token of the queries and of the keys (= of the values) the attention
    kernels see: GQA a d_head and kv_heads d_head; MLA a (nope + rope) both (every head has its own
    k, and meshrun zero-pads v to the q/k head size, `attention.mla_attention`)."""
    if is_mla(m):
        w = m.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        return w, w
    return m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim


def norm_params(m: ModelConfig) -> int:
    """One layer's norm scales: the two d_model ones, and MLA's latent norms or Qwen3's q/k head norms."""
    qk = 2 * m.head_dim if getattr(m, "qk_norm", False) else 0
    return 2 * m.d_model + (m.kv_lora_rank + m.q_lora_rank if is_mla(m) else qk)


def attn_core_width(m: ModelConfig) -> int:
    """Multiply-adds per (query, key) pair in the attention core, QK^T and A.V together: 2 a d_head;
    MLA: a (qk_nope + qk_rope + v) (the kernels here also run A.V over v's zero padding, not counted)."""
    if is_mla(m):
        return m.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
    return 2 * m.n_heads * m.head_dim


def mlp_params(m: ModelConfig) -> int:
    return (3 if m.mlp == "swiglu" else 2) * m.d_model * m.d_ff  # swiglu: gate, up, down; gelu: up, down


def expert_params(m: ModelConfig) -> int:
    """One routed expert: an MLP of width expert_d_ff (model.moe_d_ff, or d_ff)."""
    return (3 if m.mlp == "swiglu" else 2) * m.d_model * m.expert_d_ff


def shared_params(m: ModelConfig) -> int:
    """An MoE layer's shared experts (one MLP of width n_shared_experts * expert_d_ff)."""
    return m.n_shared_experts * expert_params(m)


def layer_params(m: ModelConfig, moe: bool = False) -> int:
    """One transformer layer: attention + MLP (or E experts + router + shared experts) + 2 norms.
    GPT-3: 12h^2 + 2h."""
    ffn = m.n_experts * expert_params(m) + m.d_model * m.n_experts + shared_params(m) if moe else mlp_params(m)
    return attn_params(m) + ffn + norm_params(m)


def param_counts(m: ModelConfig) -> dict[str, int]:
    """Parameters of the layers (dense part), the experts, the embedding, the head, and the total."""
    return dict(_param_counts(m))  # a copy: callers may change theirs


@functools.lru_cache(maxsize=64)
def _param_counts(m: ModelConfig) -> dict[str, int]:
    n_moe = m.n_moe_layers
    dense_layers = (m.n_layers - n_moe) * layer_params(m) + n_moe * (
        layer_params(m, True) - m.n_experts * expert_params(m)
    )
    experts = n_moe * m.n_experts * expert_params(m)
    emb = m.vocab * m.d_model
    head = 0 if m.tie_embeddings else m.vocab * m.d_model
    total = dense_layers + experts + emb + head + m.d_model
    return {"layers": dense_layers, "experts": experts, "embedding": emb, "head": head, "total": total}


def active_params(m: ModelConfig) -> int:
    """Parameters one token passes through: everything but the routed experts it is not sent to
    (top_k of n_experts per MoE layer; DeepSeek-V3: 37B of 671B)."""
    c = _param_counts(m)
    return c["total"] - c["experts"] + m.n_moe_layers * m.top_k * expert_params(m)


# ----------------------------------------------------------------------------- FLOPs


def _matmul_active(m: ModelConfig, moe: bool) -> int:
    """Matmul params a token passes through in one layer (MoE: top_k experts + router + shared experts)."""
    if not moe:
        return attn_params(m) + mlp_params(m)
    return attn_params(m) + m.top_k * expert_params(m) + m.d_model * m.n_experts + shared_params(m)


def moe_routed(m: ModelConfig, expert: int = 1) -> float:
    """Rows per token that an MoE layer's expert FFN runs on (and capacity routing's all_to_all moves):
    top_k x capacity_factor with capacity routing (buffers padded to capacity); dropless: top_k, and
    with expert parallelism ep x min(top_k, E/ep), the worst case a device's experts may receive."""
    if m.moe_dispatch != "dropless":
        return m.top_k * m.capacity_factor
    return float(m.top_k if expert <= 1 else expert * min(m.top_k, m.n_experts // expert))


def dropless_exchange(m: ModelConfig, expert: int, act_bytes: float) -> tuple[float, float]:
    """Bytes per token, as multiples of one d_model activation of `act_bytes` per element, of the two
    collectives of models/dropless.py's expert exchange (ep > 1), each forward and again transposed
    backward: the all-gather of the group's tokens with their gates and expert ids in float32 (ep rows
    of d_model + 2 top_k; its reduce-scatter one row) and the reduce-scatter of the gated sums in the
    activation dtype (one row; its all-gather ep rows). Returns (gathered, scattered) per token."""
    packed = (m.d_model + 2 * m.top_k) / m.d_model * 4.0 / act_bytes
    return expert * packed, packed


def layer_fwd_flops(m: ModelConfig, tokens: float, s: int, moe: bool = False, capacity: float = 1.0) -> float:
    """2 FLOPs per matmul param per token + attention scores QK^T and A.V (4 s^2 a d_head per sequence,
    counted in full as Megatron does, not halved for causal masking)."""
    mat = _matmul_active(m, moe)
    if moe:
        mat += (capacity - 1.0) * m.top_k * expert_params(m)  # capacity padding is executed too
    return 2.0 * tokens * mat + attn_core_fwd_flops(m, tokens, s)


def attn_core_fwd_flops(m: ModelConfig, tokens: float, s: int) -> float:
    if is_mla(m):
        return 2.0 * tokens * s * attn_core_width(m)
    return 4.0 * tokens * s * m.n_heads * m.head_dim


def _fwd_layers_flops(m: ModelConfig, tokens: float, s: int) -> float:
    n_moe = m.n_moe_layers
    return (m.n_layers - n_moe) * layer_fwd_flops(m, tokens, s) + n_moe * layer_fwd_flops(m, tokens, s, True)


@functools.lru_cache(maxsize=256)  # the planner's search asks per layout
def model_flops(m: ModelConfig, batch: float, s: int, *, causal_skip: bool = False) -> float:
    """Model FLOPs per step: 3 x forward, no recomputation, no MoE capacity padding (the useful math
    MFU counts). Embedding lookups and norms are not GEMMs. `causal_skip=True` halves the attention
    scores, for kernels that skip fully masked blocks (flash attention): for GPT that is
    72 B s L h^2 (1 + s/(12h) + V/(12 L h))."""
    tok = batch * s
    fwd = _fwd_layers_flops(m, tok, s)
    if causal_skip:
        fwd -= m.n_layers * attn_core_fwd_flops(m, tok, s) / 2
    return 3.0 * (fwd + 2.0 * tok * m.d_model * m.vocab)


@functools.lru_cache(maxsize=256)
def hardware_flops(m: ModelConfig, batch: float, s: int, remat: str) -> float:
    """Model FLOPs + recomputation, as Megatron reports TFLOP/s. Full remat: 96 B s L h^2
    (1 + s/(6h) + V/(16 L h)) (Narayanan 2021 eq. 3); selective recomputes the attention core only."""
    tok = batch * s
    extra = 0.0
    if remat == "full":
        extra = _fwd_layers_flops(m, tok, s)
    elif remat == "selective":
        extra = m.n_layers * attn_core_fwd_flops(m, tok, s)
    return model_flops(m, batch, s) + extra
