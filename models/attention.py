"""Causal grouped-query self-attention with RoPE (Llama), Megatron tensor parallel.

q/k/v are column-parallel (heads / kv_heads sharded), the output projection row-parallel; the
attention core itself is local to each head shard. Shape letters as in `layers.py`.

Packed documents: `segments` = (positions_BxL, mask_Bx1xLxL) from `segment_info`; the mask keeps
attention inside each document (block-diagonal, and causal through `is_causal`). XLA applies it
in its softmax; jax.nn.dot_product_attention's cuDNN path (jax 0.10/0.11) takes no segment ids
(cuDNN's packed-offset layout is private API), so there the mask becomes a B x 1 x L x L bias.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from meshrun_models.context import allgather_attention, ring_attention
from meshrun_models.layers import (
    Lead,
    dtype_of,
    fp8_slot,
    normal_param,
    ones_param,
    rms_norm,
    rope,
    rope_freqs,
    segment_positions,
    softmax_to,
    yarn_scales,
    zeros_param,
)

from meshrun.config import ModelConfig
from meshrun.parallel import fp8
from meshrun.parallel.collective_matmul import ag_matmul, matmul_rs
from meshrun.parallel.context import local_index, sequence_split, zigzag_index
from meshrun.parallel.sharding import CONTEXT, constrain


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, lead: Lead, *, rngs: nnx.Rngs):
        if getattr(cfg, "attention", "gqa") == "mla":
            self._mla(cfg, lead, rngs)
            return
        d, h, k, dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q = normal_param(rngs.params(), (d, h, dh), ("embed", "heads", "head_dim"), lead, cfg)
        self.k = normal_param(rngs.params(), (d, k, dh), ("embed", "kv_heads", "head_dim"), lead, cfg)
        self.v = normal_param(rngs.params(), (d, k, dh), ("embed", "kv_heads", "head_dim"), lead, cfg)
        self.o = normal_param(rngs.params(), (h, dh, d), ("heads", "head_dim", "embed"), lead, cfg)
        if cfg.qkv_bias:  # Qwen2
            self.q_bias = zeros_param((h, dh), ("heads", "head_dim"), lead, cfg)
            self.k_bias = zeros_param((k, dh), ("kv_heads", "head_dim"), lead, cfg)
            self.v_bias = zeros_param((k, dh), ("kv_heads", "head_dim"), lead, cfg)
        if getattr(cfg, "qk_norm", False):  # Qwen3: one head_dim scale each, shared by the heads
            self.q_norm = ones_param((dh,), ("norm",), lead, cfg)
            self.k_norm = ones_param((dh,), ("norm",), lead, cfg)

    def _mla(self, cfg: ModelConfig, lead: Lead, rngs: nnx.Rngs) -> None:
        """Multi-head latent attention's weights. A latent dimension is named 'embed' (its rows are
        split like a d_model row under ZeRO-3 and replicated over 'tensor'); heads split over 'tensor'."""
        d, h, dq, r = cfg.d_model, cfg.n_heads, cfg.qk_head_dim, cfg.kv_lora_rank
        heads = ("embed", "heads", "head_dim")
        if cfg.q_lora_rank:
            self.q_down = normal_param(rngs.params(), (d, cfg.q_lora_rank), ("embed", None), lead, cfg)
            self.q_norm = ones_param((cfg.q_lora_rank,), ("norm",), lead, cfg)
            self.q_up = normal_param(rngs.params(), (cfg.q_lora_rank, h, dq), heads, lead, cfg)
        else:
            self.q = normal_param(rngs.params(), (d, h, dq), heads, lead, cfg)
        self.kv_down = normal_param(rngs.params(), (d, r + cfg.qk_rope_head_dim), ("embed", None), lead, cfg)
        self.kv_norm = ones_param((r,), ("norm",), lead, cfg)
        kv_up = (r, h, cfg.qk_nope_head_dim + cfg.v_head_dim)
        self.kv_up = normal_param(rngs.params(), kv_up, heads, lead, cfg)
        self.o = normal_param(rngs.params(), (h, cfg.v_head_dim, d), ("heads", "head_dim", "embed"), lead, cfg)


def _impl(name: str) -> str | None:
    """'cudnn' (flash attention) needs a GPU; elsewhere jax picks (XLA), so GPU configs run on CPU unchanged."""
    if name == "cudnn" and jax.default_backend() != "gpu":
        return None
    return name


def attention_core(q_BxLxKxGxDh, k_BxSxKxDh, v_BxSxKxDh, mask_Bx1xLxS=None, window=None) -> jax.Array:
    """Causal grouped-query attention on XLA (CPU, or GPU without flash): float32 scores and softmax,
    probabilities in the compute dtype (named `probs`: the s x s tensor `remat=none` keeps, as
    Megatron does), the same arithmetic as jax.nn.dot_product_attention's XLA path. `window`
    (left, 0): a query attends to keys at most `left` positions back. Returns B x L x K x G x Dh."""
    dt = q_BxLxKxGxDh.dtype
    scale = q_BxLxKxGxDh.shape[-1] ** -0.5
    prec = jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if dt == jnp.bfloat16 else None
    s_BxKxGxLxS = jnp.einsum(
        "blkgd,bskd->bkgls", q_BxLxKxGxDh, k_BxSxKxDh, precision=prec, preferred_element_type=jnp.float32
    )
    s_BxKxGxLxS = s_BxKxGxLxS * jnp.float32(scale)
    length, keys = s_BxKxGxLxS.shape[-2:]
    qi, ki = jnp.arange(length)[:, None], jnp.arange(keys)[None, :]
    keep = qi >= ki
    if window is not None:
        keep = keep & (qi - ki <= window[0])
    keep = keep[None, None, None]
    if mask_Bx1xLxS is not None:
        keep = keep & mask_Bx1xLxS[:, :, None]
    s_BxKxGxLxS = jnp.where(keep, s_BxKxGxLxS, jnp.float32(-0.7 * jnp.finfo(jnp.float32).max))
    p_BxKxGxLxS = checkpoint_name(softmax_to(s_BxKxGxLxS, dt), "probs")
    return jnp.einsum("bkgls,bskd->blkgd", p_BxKxGxLxS, v_BxSxKxDh)


class ContextChunk(NamedTuple):
    """This device's chunk of a sequence split over the `context` mesh axis: RoPE positions of its
    tokens (global; restarting per packed document) and their segment ids (None: plain rows)."""

    positions_BxL: jax.Array
    segment_ids_BxL: jax.Array | None


def segment_info(segment_ids_BxL: jax.Array | None, cfg: ModelConfig | None = None, length: int | None = None):
    """Once per batch, outside the layer scan: (positions_BxL, same-document mask_Bx1xLxL) of
    packed rows, or None for plain rows; under context parallelism a `ContextChunk` (the local
    chunk's global positions; packed rows' positions come from the segment ids all-gathered over
    'context', int32 per token)."""
    split = sequence_split(cfg.context_parallel == "ring") if cfg is not None else None
    if split is not None:
        zigzag, c = cfg.context_parallel == "ring", split.c
        index_L = local_index(length, CONTEXT, zigzag)
        if segment_ids_BxL is None:
            return ContextChunk(jnp.broadcast_to(index_L[None], (1, length)), None)
        laid_BxS = jax.lax.all_gather(segment_ids_BxL, CONTEXT, axis=1, tiled=True)
        natural_BxS = laid_BxS if not zigzag else laid_BxS[:, np.argsort(zigzag_index(length * c, c))]
        return ContextChunk(jnp.take(segment_positions(natural_BxS), index_L, axis=1), segment_ids_BxL)
    if segment_ids_BxL is None:
        return None
    same = segment_ids_BxL[:, None, :, None] == segment_ids_BxL[:, None, None, :]
    return segment_positions(segment_ids_BxL), same


def context_attention(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, chunk: ContextChunk, cfg: ModelConfig, window):
    """Attention of this chunk's queries over the whole sequence: K/V all-gathered over 'context'
    (allgather) or passed around its ring (ring). Returns B x L x H x Dh."""
    b, length, h, dh = q_BxLxHxDh.shape
    n_kv = k_BxLxKxDh.shape[2]
    q = q_BxLxHxDh.reshape(b, length, n_kv, h // n_kv, dh)
    left = None if window is None else window[0]
    if cfg.context_parallel == "ring":
        o = ring_attention(q, k_BxLxKxDh, v_BxLxKxDh, chunk.segment_ids_BxL, axis=CONTEXT, window=left, zigzag=True)
    else:
        o = allgather_attention(q, k_BxLxKxDh, v_BxLxKxDh, chunk.segment_ids_BxL, axis=CONTEXT, window=left)
    return o.reshape(b, length, h, dh)


def attention(
    p: Mapping[str, jax.Array],
    h_BxLxD: jax.Array,
    cfg: ModelConfig,
    segments=None,
    *,
    rotary: bool = True,
    bias: bool | None = None,
    f8: Mapping | None = None,
    ring: int = 0,
) -> jax.Array:
    """Self-attention on normed input (full length). Returns the row-parallel output before the
    residual-stream constraint (the caller's constraint makes it an all-reduce or reduce-scatter).
    `rotary=False`: no RoPE (a family with learned absolute positions); `bias`: q/k/v biases
    (default cfg.qkv_bias). The output projection's bias, if any, is the caller's. `f8`: the block's
    fp8 state (`layers.fp8_state`): the q/k/v and output GEMMs run in fp8 under cfg.fp8. `ring` = t > 0
    (model.tp_comm_overlap, `collective_matmul.ring_degree`): h comes split over the sequence and the
    q/k/v and output GEMMs run as rings over the t tensor shards; the output comes back split too."""
    if getattr(cfg, "attention", "gqa") == "mla":  # tensor rings are refused with it (the config)
        return mla_attention(p, h_BxLxD, cfg, segments, f8)
    dt = dtype_of(cfg.dtype)
    recipe = cfg.fp8
    gemm = lambda spec, x, w, slot: fp8.einsum(spec, x, w, recipe, f8, fp8_slot(cfg, slot), block=cfg.fp8_block)
    qkv = _qkv(p, h_BxLxD, cfg, gemm, bias, ring)
    o_BxLxHxDh = _attend(p, qkv, cfg, segments, rotary)
    if ring:
        return matmul_rs("blhk,hkd->bld", o_BxLxHxDh, p["o"].astype(dt), 0, ring)
    return gemm("blhk,hkd->bld", o_BxLxHxDh, p["o"], "attn_out")


def _qkv(p: Mapping[str, jax.Array], h_BxLxD: jax.Array, cfg: ModelConfig, gemm, bias, ring: int) -> jax.Array:
    """The q/k/v projection in Megatron's fused GQA layout, B x L x K x (G+2) x Dh (biases added)."""
    dt = dtype_of(cfg.dtype)
    recipe = cfg.fp8
    n_kv, g, dh = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    # Megatron's fused GQA layout [D, K, G+2, Dh] built on the fly: query head n = kv*G + g uses kv
    # head kv (jax.nn.dot_product_attention's grouping), so sharding K shards all three alike and
    # one einsum gives one input-gradient all-reduce in backward instead of three.
    wq_DxKxGxDh = p["q"].reshape(cfg.d_model, n_kv, g, dh)
    w = jnp.concatenate([wq_DxKxGxDh, p["k"][:, :, None], p["v"][:, :, None]], axis=2)
    if ring:  # fp8 is refused with tp_comm_overlap (the config)
        qkv = ag_matmul("bld,dkgh->blkgh", h_BxLxD, w.astype(dt), 1, ring)
    else:
        qkv = gemm("bld,dkgh->blkgh", h_BxLxD, w if recipe != "none" else w.astype(dt), "qkv")
    if cfg.qkv_bias if bias is None else bias:
        b_q = p["q_bias"].reshape(n_kv, g, dh)
        qkv = qkv + jnp.concatenate([b_q, p["k_bias"][:, None], p["v_bias"][:, None]], axis=1).astype(dt)
    return checkpoint_name(constrain(qkv, ("batch", None, "kv_heads", None, "head_dim")), "qkv")


def _attend(p: Mapping[str, jax.Array], qkv: jax.Array, cfg: ModelConfig, segments, rotary: bool) -> jax.Array:
    """Causal attention of the fused q/k/v (model.qk_norm, then RoPE if `rotary`): B x L x H x Dh."""
    g, dh = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    b, length = qkv.shape[:2]
    q_BxLxHxDh = qkv[:, :, :, :g].reshape(b, length, cfg.n_heads, dh)
    k_BxLxKxDh, v_BxLxKxDh = qkv[:, :, :, g], qkv[:, :, :, g + 1]
    pos_BxL = _positions(segments)
    if getattr(cfg, "qk_norm", False):  # per head, before RoPE (Qwen3)
        q_BxLxHxDh = rms_norm(q_BxLxHxDh, p["q_norm"], cfg.norm_eps)
        k_BxLxKxDh = rms_norm(k_BxLxKxDh, p["k_norm"], cfg.norm_eps)
    if rotary:
        freq, a = rope_freqs(cfg), yarn_scales(cfg)[0]
        q_BxLxHxDh, k_BxLxKxDh = rope(q_BxLxHxDh, freq, pos_BxL, a), rope(k_BxLxKxDh, freq, pos_BxL, a)
    return _core(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, cfg, segments, "kv_heads")


def _positions(segments):
    """RoPE positions: the context chunk's, the packed rows', or None (0..L-1)."""
    if isinstance(segments, ContextChunk):
        return segments.positions_BxL
    return segments[0] if segments is not None else None


def _core(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, cfg: ModelConfig, segments, kv_name: str) -> jax.Array:
    """Causal attention of roped q/k and v (K heads, H = K G queries): B x L x H x Dh."""
    b, length, h, dh = q_BxLxHxDh.shape
    n_kv = k_BxLxKxDh.shape[2]
    chunk = segments if isinstance(segments, ContextChunk) else None
    mask = None if chunk or segments is None else segments[1]
    softmax_factor = yarn_scales(cfg)[1]
    if softmax_factor != 1.0:  # YaRN's softmax scale correction (DeepSeek-V3), folded into q for every kernel
        q_BxLxHxDh = (q_BxLxHxDh.astype(jnp.float32) * jnp.float32(softmax_factor)).astype(q_BxLxHxDh.dtype)
    q_BxLxHxDh = checkpoint_name(constrain(q_BxLxHxDh, ("batch", None, "heads", "head_dim")), "q_rot")
    k_BxLxKxDh = checkpoint_name(constrain(k_BxLxKxDh, ("batch", None, kv_name, "head_dim")), "k_rot")
    v_BxLxKxDh = checkpoint_name(constrain(v_BxLxKxDh, ("batch", None, kv_name, "head_dim")), "v")
    window = (cfg.sliding_window - 1, 0) if cfg.sliding_window else None
    impl = _impl(cfg.attention_impl)
    # remat=none keeps the softmax output (2 bytes per score, as Megatron): `attention_core` names it.
    # Otherwise jax's kernel: flash attention (cudnn) or XLA's, recomputed in the backward (selective
    # and full; measured: XLA:CPU kept one more copy of q, k, v per layer with `attention_core` there).
    if chunk is not None:  # the sequence is split over 'context': attention crosses the axis
        o_BxLxHxDh = context_attention(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, chunk, cfg, window)
    elif impl == "cudnn" or cfg.remat != "none":
        o_BxLxHxDh = jax.nn.dot_product_attention(
            q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, mask=mask, is_causal=True, local_window_size=window, implementation=impl
        )
    else:
        q = q_BxLxHxDh.reshape(b, length, n_kv, h // n_kv, dh)
        o_BxLxHxDh = attention_core(q, k_BxLxKxDh, v_BxLxKxDh, mask, window).reshape(b, length, h, dh)
    return checkpoint_name(constrain(o_BxLxHxDh, ("batch", None, "heads", "head_dim")), "attn_out")


# ---------------------------------------------------------------- multi-head latent attention


def mla_attention(p: Mapping[str, jax.Array], h_BxLxD: jax.Array, cfg: ModelConfig, segments=None, f8=None):
    """DeepSeek-V2/V3's multi-head latent attention on normed input (full length); the row-parallel
    output before the residual-stream constraint, as `attention`. The down-projections and the latent
    norms are replicated over 'tensor' (their input gradient is all-reduced there, as a column-parallel
    layer's), the up-projections and the output are split by heads. Per head: q = [q_nope, rope(q_pe)],
    k = [k_nope, rope(k_pe)] with one k_pe shared by every head, softmax scale 1/sqrt(nope + rope) (YaRN's
    factors aside, `yarn_scales`).
    v is zero-padded to the q/k head size so that every attention kernel (jax's, the context-parallel
    all-gather and ring) runs unchanged: the padded output columns are exact zeros, dropped after.
    `f8`: the block's fp8 state: the five projections (`layers.FP8_MLA_SLOTS`, the output) run in fp8
    under cfg.fp8, the latent norms and the attention core in the compute dtype; blockwise's tiles lie in
    one head (q_up, kv_up: its dims; the output: its v dims), a partial last tile zero-padded."""
    block = cfg.fp8_block
    gemm = lambda spec, x, name, slot: fp8.einsum(spec, x, p[name], cfg.fp8, f8, fp8_slot(cfg, slot), block=block)
    n, dr, dv, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    latent = ("batch", None, None)
    if cfg.q_lora_rank:
        cq_BxLxR = constrain(gemm("bld,dr->blr", h_BxLxD, "q_down", "q_down"), latent)
        cq_BxLxR = rms_norm(cq_BxLxR, p["q_norm"], cfg.norm_eps)
        q_BxLxHxDq = gemm("blr,rhk->blhk", cq_BxLxR, "q_up", "q_up")
    else:
        q_BxLxHxDq = gemm("bld,dhk->blhk", h_BxLxD, "q", "q_up")
    q_BxLxHxDq = checkpoint_name(constrain(q_BxLxHxDq, ("batch", None, "heads", "head_dim")), "qkv")
    ckv_BxLxR = constrain(gemm("bld,dr->blr", h_BxLxD, "kv_down", "kv_down"), latent)
    c_BxLxR = rms_norm(ckv_BxLxR[..., :r], p["kv_norm"], cfg.norm_eps)
    kv_BxLxHxE = gemm("blr,rhk->blhk", c_BxLxR, "kv_up", "kv_up")
    kv_BxLxHxE = checkpoint_name(constrain(kv_BxLxHxE, ("batch", None, "heads", "head_dim")), "qkv")
    pos_BxL, freq, a = _positions(segments), rope_freqs(cfg, dr), yarn_scales(cfg)[0]
    q_pe = rope(q_BxLxHxDq[..., n:], freq, pos_BxL, a)
    k_pe_BxLx1xDr = rope(ckv_BxLxR[:, :, None, r:], freq, pos_BxL, a)
    b, length, heads = q_BxLxHxDq.shape[:3]
    q_BxLxHxDq = jnp.concatenate([q_BxLxHxDq[..., :n], q_pe], axis=-1)
    k_pe = jnp.broadcast_to(k_pe_BxLx1xDr, (b, length, heads, dr))
    k_BxLxHxDq = jnp.concatenate([kv_BxLxHxE[..., :n], k_pe], axis=-1)
    v_BxLxHxDq = jnp.pad(kv_BxLxHxE[..., n:], ((0, 0), (0, 0), (0, 0), (0, n + dr - dv)))
    o_BxLxHxDq = _core(q_BxLxHxDq, k_BxLxHxDq, v_BxLxHxDq, cfg, segments, "heads")
    return gemm("blhk,hkd->bld", o_BxLxHxDq[..., :dv], "o", "attn_out")
