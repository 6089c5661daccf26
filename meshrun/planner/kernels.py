"""Seconds of the kernels of one transformer layer, the embedding and the head on one GPU.

* GEMMs: a roofline with wave quantisation: TILE_M x TILE_N output tiles, one per SM at a time, each
  wave as long as one tile's FLOPs at the SM's share of peak x `Calibration.gemm` (or its bytes at
  HBM bandwidth when longer). Small or ragged per-device shapes lose efficiency.
* Memory-bound kernels (norms, bias/activation/dropout/residual, softmax, cross-entropy, embedding):
  bytes read + written at HBM bandwidth x `Calibration.hbm`. Byte counts per token are listed below.
* Attention core: without flash, QK^T and A.V are batched GEMMs and the softmax reads and writes the
  s x s scores; flash attention (attention_impl=cudnn) runs its FLOPs at FLASH_EFFICIENCY.

`Calibration` (gemm, hbm) is fitted on Megatron-LM's PTD-P Table 1 by `calibrate.fit_calibration`
(leave-one-out errors in docs/benchmarks.md and tests/test_planner.py).
"""

from __future__ import annotations

import math

from meshrun.analysis.flops import is_mla, qkv_widths
from meshrun.config import ModelConfig
from meshrun.planner.constants import FLASH_EFFICIENCY as FLASH_EFFICIENCY
from meshrun.planner.constants import MOE_DROPLESS_IMBALANCE, Calibration
from meshrun.planner.hardware import COMM_LATENCY_S, GPU
from meshrun.planner.layout import Layout

# The bf16 tile cuBLAS picks for large GEMMs on A100/H100 (CUTLASS's default 256 x 128 threadblock).
TILE_M, TILE_N = 256, 128
__all__ = ["Calibration", "FLASH_EFFICIENCY"]  # constants.py: their sources


def gemm_seconds(
    m: float, n: float, k: float, gpu: GPU, cal: Calibration, batch: float = 1, *, fp8: bool = False
) -> float:
    """One (batched) GEMM: max(compute in whole waves of tiles, bytes of A, B, C in bf16 at HBM speed).
    fp8: at the fp8 peak, A and B one byte each."""
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return 0.0
    peak, operand, eff = (gpu.fp8_flops, 1.0, cal.fp8_gemm) if fp8 else (gpu.peak_flops, 2.0, cal.gemm)
    if gpu.tiles:
        waves = math.ceil(math.ceil(m / TILE_M) * math.ceil(n / TILE_N) * batch / gpu.sms)
        compute = waves * 2.0 * TILE_M * TILE_N * k / (peak / gpu.sms * eff)
    else:  # a CPU: no waves of tiles
        compute = 2.0 * m * n * k * batch / (peak * eff)
    memory = batch * (operand * (m * k + k * n) + 2.0 * m * n) / (gpu.hbm_bw * cal.hbm)
    return max(compute, memory)


def linear_seconds(
    tokens: float, k: float, n: float, gpu: GPU, cal: Calibration, batch: float = 1, *, fp8: bool = False
) -> tuple:
    """(forward, backward) of y = x W with x [tokens, k], W [k, n]: backward is dX = dY W^T and dW = x^T dY."""
    fwd = gemm_seconds(tokens, n, k, gpu, cal, batch, fp8=fp8)
    bwd = gemm_seconds(tokens, k, n, gpu, cal, batch, fp8=fp8) + gemm_seconds(k, n, tokens, gpu, cal, batch, fp8=fp8)
    return fwd, bwd


def fp8_overhead_bytes(
    tokens: float, k: float, n: float, act: float, weight: bool = True, recipe: str = ""
) -> tuple[float, float]:
    """(forward, backward) bytes of one fp8 GEMM's casts: amax and cast of x and W forward (read in the
    compute dtype, write one byte; W read in bf16), of dY backward. `weight=False`: W is cast once per
    step, not per micro-batch (Transformer Engine caches it over a step's micro-batches:
    is_first_microbatch; with fp8_params the optimizer writes it as fp8). blockwise (DeepSeek-V3) adds a
    float32 scale per 128 values of x and dY and per 128x128 block of W, and the weight gradient's
    re-cast of x (one byte in, one out) and of dY in 128x1 tiles."""
    fwd, bwd = tokens * k * (act + 1) + (k * n * 3.0 if weight else 0.0), tokens * n * (act + 1)
    if recipe == "blockwise":
        fwd += 4.0 * (tokens * k / 128 + k * n / 128**2)
        bwd = 2 * bwd + tokens * k * 2.0 + 4.0 * (2 * tokens * n + tokens * k) / 128
    return fwd, bwd


def hbm_seconds(nbytes: float, gpu: GPU, cal: Calibration) -> float:
    return nbytes / (gpu.hbm_bw * cal.hbm)


def attention_core_seconds(
    model: ModelConfig, b: int, s: int, t: int, gpu: GPU, cal: Calibration, *, flash: bool, dropout: bool, act: float,
    context: int = 1, kind: str = "allgather",
) -> tuple[float, float]:  # fmt: skip
    """(forward, backward) of softmax(Q K^T) V for the a/t heads of one device. Context parallelism
    (c > 1): the device's s/c queries against the s keys. Flash attention skips masked blocks: the
    ring's zigzag layout gives every device s/2 visible keys per query on average (the causal half,
    split evenly); the all-gather kind keeps contiguous shards, and the slowest device (the last
    shard) sees s (2c - 1) / (2c) keys per query. XLA's attention computes the full (s/c) x s scores
    either way (the ring in c blocks of (s/c) x (s/c))."""
    heads, d = model.n_heads / t, qkv_widths(model)[0] / model.n_heads
    q_len = s / context if context > 1 else s
    if flash:  # causal: fully masked blocks are skipped, half the 4 b s^2 a d FLOPs
        share = 1.0 if context <= 1 or kind == "ring" else (2 * context - 1) / context  # the slowest shard's
        fwd = 2.0 * b * heads * q_len * s * d * share / (gpu.peak_flops * cal.flash)
        return fwd, 2.5 * fwd
    bh = b * heads
    qk_f, qk_b = linear_seconds(q_len, d, s, gpu, cal, bh)  # scores = Q K^T
    av_f, av_b = linear_seconds(q_len, s, d, gpu, cal, bh)  # out = P V
    # Fused scale-mask-softmax: read scores, write probs (fwd); read probs and their grad, write the
    # grad (bwd). Dropout on the probs writes a byte mask and a copy, read again backward.
    elems = bh * q_len * s
    f_bytes = elems * (2 * act + (1 + act if dropout else 0))
    b_bytes = elems * (3 * act + (1 + act if dropout else 0))
    return qk_f + av_f + hbm_seconds(f_bytes, gpu, cal), qk_b + av_b + hbm_seconds(b_bytes, gpu, cal)


def mla_gemms(model: ModelConfig, t: int) -> list[tuple[float, float]]:
    """(K, N) of multi-head latent attention's GEMMs per token on one of t tensor ranks: the query's
    down and up projections (or its full one), the K/V down projection (replicated over t) and up
    projection (heads / t), and the output projection."""
    h, heads = model.d_model, model.n_heads / t
    dq, r, dr = model.qk_nope_head_dim + model.qk_rope_head_dim, model.kv_lora_rank, model.qk_rope_head_dim
    qr = model.q_lora_rank
    q = [(h, qr), (qr, heads * dq)] if qr else [(h, heads * dq)]
    return [*q, (h, r + dr), (r, heads * (model.qk_nope_head_dim + model.v_head_dim)), (heads * model.v_head_dim, h)]


def elementwise_bytes(model: ModelConfig, tokens: float, t: int, *, sp: bool, dropout: bool, act: float) -> float:
    """Forward bytes of a layer's memory-bound kernels (the backward moves about twice as many):
    two norms (read x, write y: 2h each), two bias + dropout + residual adds (read 2h, write h, a byte
    mask when dropout), the MLP activation (read + write d_ff/t; swiglu reads two). Norms and residual
    adds run on the full hidden state on every TP rank unless sequence parallelism splits them."""
    h, ff = model.d_model, model.d_ff / t
    hidden = 2 * 2 * act * h + 2 * (3 * act * h + (h if dropout else 0))
    mlp = act * ff * (3 if model.mlp == "swiglu" else 2)
    return tokens * (hidden / (t if sp else 1) + mlp)


def layer_seconds(
    model: ModelConfig, layout: Layout, s: int, gpu: GPU, cal: Calibration, *, flash: bool = False,
    dropout: bool = False, act: float = 2.0, moe: bool = False, te: bool = False,
) -> dict[str, float]:  # fmt: skip
    """Seconds of one layer for one micro-batch of the layout's micro-batch size on one device of
    `layout` (its tensor, sequence, expert and context parallelism), by part: {'gemm_fwd', 'gemm_bwd',
    'attn_fwd', 'attn_bwd', 'mem_fwd', 'mem_bwd'}. Context parallelism: every per-token kernel runs on
    the local b s/c tokens (`attention_core_seconds` for the attention). Under model.fp8 every GEMM but
    the router's runs in fp8, the routed and shared experts' too (meshrun's model.fp8 and Megatron-Core's
    Transformer Engine linears alike); blockwise at the same GEMM rate. `te` (Megatron's semantics):
    each weight's fp8 cast is once per step (`fp8_overhead_bytes`)."""
    b, t, context = layout.micro_batch_size, layout.tensor, layout.context
    sp = layout.sequence_parallel and t > 1
    tok, h = b * (s / context if context > 1 else s), model.d_model
    q, kv = qkv_widths(model)
    up = (2 if model.mlp == "swiglu" else 1) * model.d_ff / t
    f8 = model.fp8 != "none"  # the dense GEMMs below: q/k/v, out, MLP in/out
    dense = (mla_gemms(model, t) if is_mla(model) else [(h, (q + 2 * kv) / t), (q / t, h)]) + (
        [] if moe else [(h, up), (model.d_ff / t, h)]
    )
    parts = [linear_seconds(tok, k_, n_, gpu, cal, fp8=f8) for k_, n_ in dense]
    cast = [fp8_overhead_bytes(tok, k_, n_, act, not te, model.fp8) for k_, n_ in dense] if f8 else []
    if moe:
        more, more_cast = expert_gemms(model, tok, t, layout.expert, gpu, cal, fp8=f8, act=act, te=te)
        parts, cast = parts + more, cast + more_cast
    attn = attention_core_seconds(model, b, s, t, gpu, cal, flash=flash, dropout=dropout, act=act, context=context,
                                  kind=layout.context_kind)  # fmt: skip
    mem = hbm_seconds(elementwise_bytes(model, tok, t, sp=sp, dropout=dropout, act=act), gpu, cal)
    # tensorwise fp8: one amax all-reduce (a scalar: latency) per covered GEMM forward (x) and backward
    # (dY); delayed scaling's amaxes ride the gradient reduction (a few KB per layer)
    amax = COMM_LATENCY_S * len(cast) if model.fp8 == "tensorwise" else 0.0
    return {
        "gemm_fwd": sum(f for f, _ in parts),
        "gemm_bwd": sum(bw for _, bw in parts),
        "attn_fwd": attn[0],
        "attn_bwd": attn[1],
        "mem_fwd": mem + hbm_seconds(sum(f for f, _ in cast), gpu, cal) + amax,
        "mem_bwd": 2 * mem + hbm_seconds(sum(bw for _, bw in cast), gpu, cal) + amax,
    }


def expert_gemms(
    model: ModelConfig, tok: float, t: int, expert: int, gpu: GPU, cal: Calibration, *, fp8: bool, act: float,
    te: bool = False,
) -> tuple[list[tuple], list[tuple]]:  # fmt: skip
    """An MoE layer's expert GEMMs and router on one device: ((forward, backward) seconds of each, the
    (forward, backward) fp8 cast bytes of the expert GEMMs when `fp8`). Each device runs n_experts/expert
    local experts (width moe_d_ff) over the k*cf routed copies of its `tok` tokens, and the shared experts
    over all of them. `te`: weights cast to fp8 once per step (`fp8_overhead_bytes`)."""
    h, ff, glu = model.d_model, model.expert_d_ff, (2 if model.mlp == "swiglu" else 1)
    local = model.n_experts / expert
    parts = []
    shared = model.n_shared_experts * ff / t  # the shared experts: one MLP on every token
    cast = []
    if shared:
        shapes = ((h, glu * shared), (shared, h))
        parts += [linear_seconds(tok, k_, n_, gpu, cal, fp8=fp8) for k_, n_ in shapes]
        cast += [fp8_overhead_bytes(tok, k_, n_, act, not te, model.fp8) for k_, n_ in shapes] if fp8 else []
    # grouped GEMM: the real rows (the busiest rank's); capacity routing: padded to capacity
    padding = MOE_DROPLESS_IMBALANCE if model.moe_dispatch == "dropless" else model.capacity_factor
    routed = tok * model.top_k * padding / local
    shapes = ((h, glu * ff / t), (ff / t, h))  # routed experts of width moe_d_ff
    parts += [linear_seconds(routed, k_, n_, gpu, cal, local, fp8=fp8) for k_, n_ in shapes]
    if fp8:
        cast += [
            tuple(local * x for x in fp8_overhead_bytes(routed, k_, n_, act, not te, model.fp8)) for k_, n_ in shapes
        ]
    parts.append(linear_seconds(tok, h, model.n_experts, gpu, cal))  # router
    return parts, cast


def head_seconds(model: ModelConfig, tokens: float, t: int, gpu: GPU, cal: Calibration, act: float = 2.0) -> float:
    """Forward + backward of the final norm, the vocab-parallel logits GEMM and the cross-entropy:
    the loss converts the logits to fp32, takes max, exp and sum, and writes the gradient back in the
    compute dtype (~24 bytes per logit element over forward and backward)."""
    fwd, bwd = linear_seconds(tokens, model.d_model, model.vocab / t, gpu, cal)
    ce = 24.0 * tokens * model.vocab / t
    norm = 3 * 2 * act * tokens * model.d_model
    return fwd + bwd + hbm_seconds(ce + norm, gpu, cal)


def embed_seconds(model: ModelConfig, tokens: float, t: int, gpu: GPU, cal: Calibration, act: float = 2.0) -> float:
    """Forward + backward of the embedding lookup (gather of b s h, then its scatter-add gradient)."""
    return hbm_seconds(4 * act * tokens * model.d_model, gpu, cal)
