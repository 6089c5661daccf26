"""Activation bytes one transformer layer keeps for its backward, per micro-batch and device:
Megatron-LM's count (Korthikanti et al. 2022, section 4) and meshrun's own, which the remat
policies of `meshrun_models` are built to match (`meshrun explain`'s `saved_bytes_per_layer`
measures it on compiled programs; tests/test_memory.py asserts the two agree)."""

from __future__ import annotations

from meshrun.analysis.flops import qkv_widths
from meshrun.config import ModelConfig
from meshrun.planner.constants import MOE_DROPLESS_IMBALANCE

# Context parallelism (`context` = c > 1): every per-token tensor holds the local s/c tokens of each
# sequence; only attention sees the whole sequence. allgather: the local queries score against all s
# gathered keys ((s/c) x s scores per head on XLA's attention) and the gathered K/V is a tensor of its
# own (`context_kv_bytes`); ring: K/V blocks of s/c tokens travel around the ring, each scored with
# an online softmax (flash-style), so no s x s (or (s/c) x s) tensor is kept.


def context_kv_bytes(m: ModelConfig, b: int, s: int, t: int, c: int, *, act: float) -> float:
    """Bytes of one layer's gathered K and V under the all-gather kind: 2·s·b·kv_heads·head_dim/t
    elements (the whole sequence's keys and values of the device's kv heads). A ring block (the K/V of
    s/c tokens) is this divided by c."""
    return 0.0 if c <= 1 else 2.0 * act * s * b * qkv_widths(m)[1] / t


def context_working_bytes(
    m: ModelConfig, b: int, s: int, t: int, c: int, kind: str, *, remat: str, act: float, flash: bool
) -> float:
    """Bytes context parallelism adds for the ONE layer whose backward runs (not kept per layer):
    allgather: the gathered K/V, rebuilt for the backward when the attention is recomputed (selective;
    under full remat it is part of the rebuilt layer's `layer_activation_bytes`, under none it is
    kept per layer); ring: the K/V block being scored and the one arriving, and in the backward the
    dK/dV block travelling with them (4 blocks), plus on XLA's attention the (s/c) x (s/c) scores and
    probabilities of the block being scored."""
    if c <= 1:
        return 0.0
    if kind == "ring":
        block = context_kv_bytes(m, b, s, t, c, act=act) / c
        scores = 0.0 if flash else 2.0 * act * b * m.n_heads / t * (s / c) ** 2
        return 4 * block + scores
    return context_kv_bytes(m, b, s, t, c, act=act) if remat not in ("none", "full") else 0.0


def _kv_len(s: int, c: int, kind: str, flash: bool) -> float | None:
    """Keys each local query's kept score row spans: s (all-gathered) on XLA's attention; None when no
    score matrix is kept (flash attention, or the ring's online softmax over blocks)."""
    return None if flash or (c > 1 and kind == "ring") else float(s)


def _mlp_kept(m: ModelConfig, b: int, s: float, act: float, moe: bool) -> float:
    """The MLP intermediates one layer keeps for its backward, per micro-batch of s local tokens, before
    the TP split (gelu: fc1 out + gelu out; swiglu: gate, up, prod); MoE: those of the routed copies of
    the tokens (top_k x capacity, experts of width moe_d_ff), the router logits, the dispatch and combine
    buffers, and the shared experts' MLP on every token."""
    mlp_elems = (3 if m.mlp == "swiglu" else 2) * s * b * m.d_ff
    if not moe:
        return act * mlp_elems
    # Megatron's dropless MoE keeps the routed rows it received (top_k per token, the busiest rank's share)
    routed = m.top_k * (MOE_DROPLESS_IMBALANCE if m.moe_dispatch == "dropless" else m.capacity_factor)
    sbh = s * b * m.d_model
    mlp_elems = (3 if m.mlp == "swiglu" else 2) * s * b * m.expert_d_ff  # routed experts of width moe_d_ff
    mlp = act * mlp_elems * routed + 4 * s * b * m.n_experts + 2 * act * sbh * routed
    return mlp + act * mlp_elems * m.n_shared_experts  # the shared experts' MLP, on every token


def layer_activation_bytes(
    m: ModelConfig, b: int, s: int, t: int, *, sp: bool, remat: str, act: float, dropout: bool, flash: bool, moe=False,
    context: int = 1, kind: str = "allgather", fp8_inputs: bool = False,
) -> float:  # fmt: skip
    """Bytes one layer keeps for its backward, per micro-batch (Korthikanti 2022, section 4).
    `fp8_inputs` (Megatron with Transformer Engine's fp8): each fp8 GEMM keeps its input in fp8 for the
    weight gradient (one byte: the QKV and MLP inputs, the out-projection input, the MLP's second GEMM
    input), the other tensors in the compute dtype.
    GPT-3 (a=2 bytes, dropout): sbh(34 + 5as/h); TP: sbh(10 + 24/t + 5as/(ht)); TP+SP: sbh/t (34 + 5as/h);
    selective drops 5as/h. Generalised to GQA, swiglu, MoE and no-dropout models by counting tensors.
    Context parallelism (c = `context`): s -> s/c in every term; the score term is (s/c) x s per head
    for the all-gather kind (so the whole count falls as 1/c) and the ring keeps none (flash-style
    blocks: the log-sum-exp of its s/c queries); under remat=none the all-gather kind also keeps the
    layer's gathered K/V (`context_kv_bytes`)."""
    kv_len = _kv_len(s, context, kind, flash)
    # the gathered K/V of all TP ranks (split by t below with the other attention tensors)
    gathered = context_kv_bytes(m, b, s, 1, context, act=act) if kind != "ring" and remat == "none" else 0.0
    s = s / context if context > 1 else s
    sbh = s * b * m.d_model
    mask = 1.0 if dropout else 0.0
    q, kv = qkv_widths(m)
    # Replicated across TP without SP: LN1 input, QKV input, LN2 input, MLP input (+ 2 dropout masks).
    repl = 4 * act * sbh + 2 * mask * sbh
    # Split by TP: Q, K, V; out-proj input; MLP intermediates (`_mlp_kept`).
    split = act * s * b * (q + 2 * kv) + act * s * b * q + _mlp_kept(m, b, s, act, moe)
    if kv_len is None:  # flash attention keeps only the log-sum-exp (fp32), never the s x s scores
        core = 4.0 * b * m.n_heads * s
    elif remat == "selective":  # recomputed in the backward (selective drops the 5as/h term)
        core = 0.0
    else:  # softmax output (+ dropout mask and dropout output)
        core = b * m.n_heads * s * kv_len * (act + (mask + act if dropout else 0.0))
    split += gathered
    if fp8_inputs and act > 1:  # QKV and MLP-in inputs (replicated), out-proj and MLP-out inputs (split)
        repl -= (act - 1) * 2 * sbh
        split -= (act - 1) * s * b * (q + (0 if moe else m.d_ff))
    return (repl + split + core) / t if sp else repl + (split + core) / t


def meshrun_layer_bytes(
    m: ModelConfig, b: int, s: int, t: int, *, sp: bool, remat: str, act: float, flash: bool, moe: bool = False,
    context: int = 1, kind: str = "allgather",
) -> float:  # fmt: skip
    """Bytes meshrun's compiled step keeps per layer (the unit's input, kept by the layer scan, included):
    * none (dense): Megatron's no-recompute set without dropout (`layers.KEPT_NAMES`): equal to
      `layer_activation_bytes(..., dropout=False)` on XLA's attention; on flash attention the kernel's
      log-sum-exp is not kept (its forward is rerun in the backward).
    * selective (and the device part of nothing else): the unit input plus `saved_name_bytes`; RoPE,
      the norms and the attention core are recomputed, so it is below Megatron's selective count.
    * MoE layers keep everything JAX saves (`autodiff_bytes`; selective less the s x s core): the
      MoE block carries no names yet, and its routing and all_to_alls are not recomputed under none.
    Sequence parallelism splits the unit input and the mid-block residual over 'tensor'. Context
    parallelism: the local s/c tokens (`layer_activation_bytes`)."""
    cp = dict(context=context, kind=kind)
    kv_len = _kv_len(s, context, kind, flash)
    sl = s / context if context > 1 else s
    if moe:  # selective: the s x s core is recomputed
        core = 0.0 if remat == "none" or kv_len is None else 2.0 * act * b * m.n_heads * sl * kv_len / t
        return autodiff_bytes(m, b, s, t, act=act, flash=flash, moe=True, **cp) - core
    if remat == "none":
        full = layer_activation_bytes(m, b, s, t, sp=sp, remat="none", act=act, dropout=False, flash=flash, **cp)
        return full - (4.0 * b * m.n_heads * sl / t if flash else 0.0)
    layer_in = act * sl * b * m.d_model / (t if sp else 1)
    return layer_in + saved_name_bytes(m, b, sl, t, act=act, sp=sp)


def saved_name_bytes(m: ModelConfig, b: int, s: int, t: int, *, act: float, sp: bool | None = None) -> float:
    """Bytes per layer of the activations `selective` keeps and `offload` moves to host
    (layers.SAVED_NAMES): fused qkv, attention output, mid-block residual, MLP hidden (gate+up)."""
    sp = m.sequence_parallel if sp is None else sp
    q, kv = qkv_widths(m)
    ff = (2 if m.mlp == "swiglu" else 1) * m.d_ff
    resid = m.d_model / (t if sp else 1)
    return act * s * b * ((q + 2 * kv + q + ff) / t + resid)


def stash_bytes(m: ModelConfig, b: int, s: int, t: int, *, act: float, sp: bool, remat: str) -> float:
    """Bytes per layer of B's stash under a split backward (per-op executor: what W reads of B's work,
    `pipeline/bw_split.py`): the cotangents at each weight's use, i.e. the outputs of the fused qkv and
    MLP-in matmuls (column-parallel, / t), of the two row-parallel matmuls (whole hidden rows) and of
    the two norms (/ t under sequence parallelism), plus each norm's statistic. Under full remat B
    recomputes the layer, so the weights' inputs go into the stash too (the normed inputs, the
    attention output and the MLP activation). MoE expert weights are counted as a dense MLP."""
    q, kv = qkv_widths(m)
    ff_in = (2 if m.mlp == "swiglu" else 1) * m.d_ff
    h = m.d_model
    per_token = (q + 2 * kv + ff_in) / t + 2 * h + 2 * h / (t if sp else 1) + 2
    if remat == "full":
        per_token += 2 * h + (q + m.d_ff) / t
    return act * s * b * per_token


def autodiff_bytes(
    m: ModelConfig, b: int, s: int, t: int, *, act: float, flash: bool, moe: bool = False, context: int = 1,
    kind: str = "allgather",
) -> float:  # fmt: skip
    """A layer differentiated with no remat policy at all (an MoE layer; a layer rebuilt inside `full`
    remat's backward): every elementwise intermediate JAX differentiates through, counted with
    `print_saved_residuals` and XLA's buffer assignment of the tiny configs: 6 b·s·h (layer input,
    two norm products, residual mid-point), q + 4 kv split over TP, the s x s core (scores and
    probabilities; flash: fp32 lse and out), 6 b·s·d_ff (gate/up pair, activation intermediates and
    product). MoE FFN: the 6 d_ff tensors for the k·cf routed copies of each token, 7 h-wide routed
    buffers replicated over TP, and the fp32 dispatch/combine tensors [b, s, E, C] with E·C = cf·k·s.
    Context parallelism: s -> s/c (the score core (s/c) x s for the all-gather kind, none for the
    ring), plus the all-gather kind's gathered K/V."""
    kv_len = _kv_len(s, context, kind, flash)
    gathered = context_kv_bytes(m, b, s, 1, context, act=act) if kind != "ring" else 0.0  # split by t below
    s = s / context if context > 1 else s
    sb, h = s * b, m.d_model
    q, kv = qkv_widths(m)
    core = 4.0 * b * m.n_heads * s * 2 if kv_len is None else 2.0 * act * b * m.n_heads * s * kv_len
    attn = act * sb * (q + 4 * kv) + core + gathered
    if moe:
        routed = m.top_k * m.capacity_factor
        ffn = act * sb * (routed + m.n_shared_experts) * 6 * m.expert_d_ff + 2 * 4.0 * sb * routed * s
        attn += 7 * act * sb * routed * h * t  # not split over TP (divided by t below)
    else:
        ffn = act * sb * 6 * m.d_ff
    return 6 * act * sb * h + (attn + ffn) / t
