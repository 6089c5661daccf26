"""Seconds of one training step of a layout: per-layer kernels (`kernels.py`), TP/PP/EP/DP/ZeRO
communication per framework, the pipeline bubble and the optimizer; the slowest stage sets the pace.

Frameworks (`--framework`): the same model trained two ways.
* meshrun: gradients accumulated in float32 over the micro-batches and reduced once per step after
  the loop in `train.grad_reduce_dtype` (ZeRO-0 all-reduce; ZeRO-1/2 reduce-scatter + all-gather;
  ZeRO-3 gathers before the loop); pipeline sends b s h per micro-batch (/ t with sequence parallelism).
* megatron (PTD-P, Narayanan et al. 2021): fp32 gradients all-reduced after the flush; ZeRO-1 is the
  distributed optimizer; ZeRO-2/3 as in DeepSpeed (reduce-scatter every micro-batch); pipeline sends
  split over the TP ranks (b s h / t).

Context parallelism (layout.context = c): per-token kernels run on s/c tokens; attention adds each
layer's K/V exchange over the context group (`context_seconds`); gradients reduce over data x expert
x context.
"""

from __future__ import annotations

import functools

from meshrun.analysis.flops import dropless_exchange, moe_routed, param_counts
from meshrun.config import ModelConfig
from meshrun.optim import registry as optimizers
from meshrun.pipeline import schedules
from meshrun.pipeline.layer_balance import split_layers
from meshrun.planner import kernels, step_model
from meshrun.planner.activations import context_kv_bytes
from meshrun.planner.constants import CALIBRATION as CALIBRATION
from meshrun.planner.constants import MOE_DROPLESS_IMBALANCE, calibration_for
from meshrun.planner.constants import OVERLAP_COST as OVERLAP_COST
from meshrun.planner.cost import Layout, Precision, precision_of
from meshrun.planner.hardware import GPU, Cluster
from meshrun.planner.kernels import Calibration
from meshrun.planner.step_model import pipe_payload

FRAMEWORKS = ("meshrun", "megatron")
# The kernel calibration (CALIBRATION: the A100's, fitted on Megatron-LM's PTD-P Table 1; a GPU's own
# where fitted: `constants.calibration_for`) and its overlap charge (`Cluster.overlap_for`: under Megatron's
# semantics the GPU's `Calibration.overlap`, under meshrun's OVERLAP_COST): constants.py, with their sources.


def gpu_calibration(gpu: GPU) -> Calibration:
    """The kernel calibration of `gpu`: a cluster profile's (`cluster_profile.py`), else the catalogue's."""
    return gpu.calibration or calibration_for(gpu.name)


def layer_compute_seconds(model: ModelConfig, layout: Layout, s: int, gpu: GPU, cal: Calibration, **kw) -> float:
    """Forward + backward (+ recompute, by the layout's remat) of one layer and one micro-batch on one
    device of `layout` (MoE layers weighted by their share of the layers)."""
    remat = layout.remat

    def one(moe: bool) -> float:
        k = kernels.layer_seconds(model, layout, s, gpu, cal, moe=moe, **kw)
        fwd = k["gemm_fwd"] + k["attn_fwd"] + k["mem_fwd"]
        redo = fwd if remat == "full" else (k["attn_fwd"] if remat == "selective" else 0.0)
        return fwd + redo + k["gemm_bwd"] + k["attn_bwd"] + k["mem_bwd"]

    frac = model.n_moe_layers / model.n_layers
    return (1 - frac) * one(False) + (frac * one(True) if frac else 0.0)


def stage_seconds(
    model: ModelConfig,
    layout: Layout,
    s: int,
    gpu: GPU,
    cal: Calibration | None = None,
    *,
    cluster: Cluster | None = None,
    dropout: bool = False,
    te: bool = False,
) -> tuple[float, float, float]:
    """(one layer, embedding, head + cross-entropy): seconds per micro-batch of the layout's
    micro-batch size on one device of `layout`, forward + backward (its remat, tensor, sequence and
    expert parallelism), TP all-reduces included when `cluster` is given (context parallelism: the
    local s/c tokens; its K/V exchange is `context_seconds`). `te`: Megatron's semantics (Transformer
    Engine's linears and userbuffers: `kernels.layer_seconds`, `tp_fp8_share`)."""
    t, c = layout.tensor, layout.context
    # only what the costs read: the search re-costs the same micro-batch, TP and remat for many layouts
    sp = layout.sequence_parallel and t > 1
    key = Layout(tensor=t, micro_batch_size=layout.micro_batch_size, remat=layout.remat, expert=layout.expert,
                 sequence_parallel=sp, context=c, context_kind=layout.context_kind if c > 1 else "allgather",
                 tp_comm_overlap=sp and layout.tp_comm_overlap, tp_comm_fp8_rs=layout.tp_comm_fp8_rs)  # fmt: skip
    return _stage_seconds(model, key, s, gpu, cal, cluster, dropout, te)


@functools.lru_cache(maxsize=4096)
def _stage_seconds(
    model: ModelConfig, layout: Layout, s: int, gpu: GPU, cal: Calibration | None, cluster: Cluster | None,
    dropout: bool, te: bool = False,
) -> tuple[float, float, float]:  # fmt: skip
    """`stage_seconds` of a layout holding only what the costs read (cached)."""
    cal = cal or gpu_calibration(gpu)
    act = precision_of(model).act
    b, t, context = layout.micro_batch_size, layout.tensor, layout.context
    layer = layer_compute_seconds(model, layout, s, gpu, cal, dropout=dropout, act=act,
                                  flash=model.attention_impl == "cudnn", te=te)  # fmt: skip
    tok = b * (s / context if context > 1 else s)
    first = kernels.embed_seconds(model, tok, t, gpu, cal, act)
    last = kernels.head_seconds(model, tok, t, gpu, cal, act)
    if cluster is not None and t > 1:
        ar = cluster.allreduce_seconds(act * tok * model.d_model, t)
        layer += tp_layer_seconds(model, layout, ar, te)
        layer -= tp_overlap_hidden(model, layout, s, cluster, cal, dropout, te)
        first += ar  # vocab-parallel embedding output
        last += ar  # the head's input gradient
    return layer, first, last


def tp_fp8_share(model: ModelConfig, layout: Layout, te: bool) -> float:
    """A dense layer's TP collective bytes as a share of their bf16 bytes. Transformer Engine's fp8 with
    tp_comm_overlap (`te`): its userbuffers all-gather fp8, 1 byte (TE's initialize_ub: all-gather
    buffers are fp8 under an fp8 recipe, reduce-scatters opt in with fp8_buf): the 2 forward all-gathers
    of the layer input and the 2 backward ones of the output gradient, 4 of the layer's 8 all-gathers
    and reduce-scatters; with `layout.tp_comm_fp8_rs` the 2 forward reduce-scatters too."""
    if not (te and model.fp8 != "none" and layout.tp_comm_overlap and layout.sequence_parallel):
        return 1.0
    fp8 = 4 + 2 * layout.tp_comm_fp8_rs
    return (fp8 / 2 + (8 - fp8)) / 8


def tp_layer_seconds(model: ModelConfig, layout: Layout, ar: float, te: bool) -> float:
    """TP collective seconds of one layer and micro-batch before the rings' overlap, `ar` one all-reduce
    of the b s/c h activation: 2 forward (attention out, MLP out) + 2 backward (+ 2 recomputed under full
    remat) at `tp_fp8_share` of their bytes. An MoE layer's expert block moves its routed rows, in bf16
    (`routed_rows`: Megatron-Core's dispatcher all-gathers them over TP after the all-to-all and
    reduce-scatters them before the combine; meshrun all-reduces the routed copies)."""
    n, share = 4 + 2 * (layout.remat == "full"), tp_fp8_share(model, layout, te)
    frac = model.n_moe_layers / model.n_layers
    rows = routed_rows(model, layout.expert, "megatron" if te else "meshrun") if frac else 0.0
    return n * ar * ((1 - frac) * share + frac * (share + rows) / 2)


def routed_rows(model: ModelConfig, expert: int, framework: str) -> float:
    """Rows per token an MoE layer's experts run on: `flops.moe_routed` (capacity routing: the padded
    buffers; meshrun's dropless: the worst case a device may receive); Megatron's dropless dispatch
    sends the routed rows, top_k per token x MOE_DROPLESS_IMBALANCE on the busiest rank."""
    if framework == "megatron" and model.moe_dispatch == "dropless":
        return model.top_k * MOE_DROPLESS_IMBALANCE
    return moe_routed(model, expert)


def tp_overlap_hidden(
    model: ModelConfig, layout: Layout, s: int, cluster: Cluster, cal: Calibration, dropout: bool = False,
    te: bool = False,
) -> float:  # fmt: skip
    """Seconds per layer and micro-batch of the TP collectives that model.tp_comm_overlap takes off
    the step (Megatron-Core: --tp-comm-overlap; both need sequence parallelism). Each all-gather and
    reduce-scatter of a layer (the 2 + 2 forward, 2 + 2 backward and, under full remat, 2 + 2
    recomputed ones that `_stage_seconds` charges as all-reduces) runs as t - 1 ring steps of one
    sequence chunk, each beside the matmul of one chunk (its share of the layer's forward or backward
    GEMM time, / 4 collectives, / t chunks). Of the t - 1 steps the first's transfer has no matmul
    before it: t - 2 are hidden, each up to its chunk's matmul, charged `Cluster.overlap_for` (NCCL takes SMs
    from the GEMMs it runs beside). MoE layers: only their attention's collectives (half) ring."""
    t, c, b = layout.tensor, layout.context, layout.micro_batch_size
    if not (layout.tp_comm_overlap and layout.sequence_parallel and t > 2):
        return 0.0
    act = precision_of(model).act
    tok = b * (s / c if c > 1 else s)
    # one all-gather / reduce-scatter (fp8 userbuffers: `tp_fp8_share`)
    half = cluster.allreduce_seconds(act * tok * model.d_model, t, half=True) * tp_fp8_share(model, layout, te)
    step = half / (t - 1)
    k = kernels.layer_seconds(model, layout, s, cluster.gpu, cal, moe=False, dropout=dropout, act=act,
                              flash=model.attention_impl == "cudnn", te=te)  # fmt: skip
    kept = 1 - cluster.overlap_for("megatron" if te else "meshrun")
    hidden = lambda gemm: 4 * (t - 2) * min(step, gemm / 4 / t) * kept
    total = hidden(k["gemm_fwd"]) * (2 if layout.remat == "full" else 1) + hidden(k["gemm_bwd"])
    return total * (1 - model.n_moe_layers / model.n_layers / 2)


def context_seconds(
    model: ModelConfig, layout: Layout, cluster: Cluster, s: int, cal: Calibration, act: float, dropout: bool = False,
    framework: str = "meshrun",
) -> float:  # fmt: skip
    """Exposed seconds of one layer's K/V exchange over 'context', per micro-batch (0 when c = 1).
    K/V of the whole sequence on one device: G = 2 s b kv_heads head_dim / t x bytes (`context_kv_bytes`).
    * allgather: forward all-gather of K and V ((c-1)/c G received per device), backward reduce-scatter
      of dK, dV (same bytes), and one more all-gather in the backward (meshrun keeps the local K/V,
      not the gathered, under every remat policy); not overlapped (Llama 3: small next to the
      attention with GQA).
    * ring: c - 1 steps per pass, each sending a K/V block of s/c tokens (G/c; the backward also the
      dK/dV block, and one more step to bring it home: float32 in meshrun's ring, the compute dtype in
      Transformer Engine's, whose p2p buffers hold K/V and dK/dV in K/V's dtype) to the next rank while the current
      block is scored; a step lasts max(block compute,
      block transfer), so only the transfer's excess over the block's attention compute is exposed,
      plus `Cluster.overlap_for` of the hidden part (NCCL takes SMs from the kernels it runs beside).
    Bandwidth: the c ranks are t apart (tensor innermost, then context): NVLink while t c fits in a
    node, else the inter-node link (`Cluster.allreduce_seconds` / `group_bw`)."""
    c, t, b = layout.context, layout.tensor, layout.micro_batch_size
    if c <= 1:
        return 0.0
    gathered = context_kv_bytes(model, b, s, t, c, act=act)
    redo = layout.remat in ("full", "selective", "offload")
    if layout.context_kind != "ring":
        ag = cluster.allreduce_seconds(gathered, c, t, half=True)  # (c-1)/c G at the group's bandwidth
        return 3 * ag  # gather, re-gather in the backward, reduce-scatter
    flash = model.attention_impl == "cudnn"
    f, bwd = kernels.attention_core_seconds(
        model, b, s, t, cluster.gpu, cal, flash=flash, dropout=dropout, act=act, context=c, kind="ring"
    )
    bw, charge = cluster.group_bw(t * c), cluster.overlap_for(framework)

    def steps(nbytes: float, block_compute: float) -> float:
        xfer = cluster.latency_s + nbytes / bw
        return (c - 1) * (max(xfer, block_compute) - block_compute + charge * min(xfer, block_compute))

    dkv = gathered / c * (act if framework == "megatron" else 4.0) / act  # dK/dV blocks (meshrun: float32)
    home = cluster.latency_s + dkv / bw  # the last dK/dV step, after the ring: nothing to hide it behind
    # a recomputed forward ring (remat) scores its blocks beside the backward ring's, sharing its sends
    return steps(gathered / c, f / c) + steps(gathered / c + dkv, (bwd + redo * f) / c) + home


def layers_per_stage(n_layers: int, p: int, v: int, costs: tuple[float, float, float],
                     placement: str = "loop") -> tuple[int, ...]:  # fmt: skip
    """Layers on each of the p stages: even when p*v divides n_layers, else `split_layers` over the p*v
    chunks (stage i holds chunks i, i+p, ...; in a V i and 2p-1-i; the first chunk has the embedding,
    the last the head)."""
    if n_layers % (p * v) == 0:
        return (n_layers // p,) * p
    if n_layers < p * v:  # not a valid layout (a hard rule says so); cost it as if the layers could split
        return (n_layers / p,) * p
    layer, first, last = costs
    chunks = split_layers(n_layers, p * v, layer_cost=layer, first_cost=first, last_cost=last)
    if placement == "v":
        return tuple(chunks[i] + chunks[2 * p - 1 - i] for i in range(p))
    return tuple(sum(chunks[i::p]) for i in range(p))


def _stage_times(split: tuple[int, ...], costs: tuple[float, float, float], placement: str = "loop") -> list[float]:
    """Seconds per microbatch of each stage: its layers, the embedding on the first stage and the head
    on the stage of the last chunk (in a V the first stage too)."""
    layer, first, last = costs
    out = [n * layer for n in split]
    out[0] += first
    out[0 if placement == "v" else -1] += last
    return out


_MEMO: list = [None, None, {}]  # the (model, cluster) pair `_memo_for` keeps results for, and its dict


def _memo_for(model: ModelConfig, cluster: Cluster) -> dict:
    """A dict of pure results for this (frozen) model and cluster: a new one when either changes."""
    if _MEMO[0] is not model or _MEMO[1] is not cluster:
        _MEMO[:] = [model, cluster, {}]
    return _MEMO[2]


def _dp_comm(model: ModelConfig, layout: Layout, cluster: Cluster, prec: Precision, framework: str) -> tuple:
    """`_dp_comm_of`, kept per model and cluster by the layout fields it reads (`step_model.layerwise`'s
    included): the search asks it for many layouts that differ only elsewhere."""
    lay = layout
    key = (prec, framework, lay.tensor, lay.data, lay.zero_group, lay.expert, lay.pipe, lay.zero, lay.context,
           lay.offload_params, lay.overlap_grad_reduce, lay.zero3_gather, lay.zero2_reduce)  # fmt: skip
    memo = _memo_for(model, cluster)
    out = memo.get(key)
    if out is None:
        out = memo[key] = _dp_comm_of(model, layout, cluster, prec, framework)
    return out


def _dp_comm_of(model: ModelConfig, layout: Layout, cluster: Cluster, prec: Precision, framework: str) -> tuple:
    """(seconds per micro-batch, seconds once per step, of those the params' all-gathers) of
    data-parallel / ZeRO traffic of one device of the first stage (the one holding the embedding).
    Gradients travel at `prec.reduce` bytes, params at `prec.param`. Dense params reduce over data x
    expert x context ranks (TP inner: stride t), expert params over data x context ranks (stride t e
    without context; with it the context ranks, t apart, are the inner part of the group). HSDP
    (`layout.zero_group`): the reduce-scatter and all-gather run inside the ZeRO group (`zero_data` data
    ranks: NVLink when it is one node's GPUs) and the scattered shards are all-reduced across the
    `replicas` groups, t x group apart (the inter-node network), as often as the reduce-scatter."""
    t, d, e, p, zero, c = layout.tensor, layout.zero_data, layout.expert, layout.pipe, layout.zero, layout.context
    r, across = layout.replicas, t * e * c * layout.zero_data  # replica groups and the stride between them
    counts = param_counts(model)
    dense = (counts["layers"] / p + counts["embedding"]) / t
    experts = counts["experts"] / p / (t * e)
    per_mb = per_step = gathers = 0.0
    # meshrun's ZeRO-2 per microbatch / ZeRO-3 per layer: DeepSpeed's traffic (the layer scan's gathers
    # and reduce-scatters, each microbatch; ZeRO-3 gathers a layer again in the backward)
    layered = framework == "meshrun" and zero >= 2 and step_model.layerwise(model, layout)
    for n, dp, stride in ((dense, d * e * c, t), (experts, d * c, t if c > 1 else t * e)):
        if dp * r <= 1 or n <= 0:
            continue
        grads, params = n * prec.reduce, n * prec.param
        # whole gradients all-reduced (HSDP with groups of one rank: across the replicas)
        ar = cluster.allreduce_seconds(grads, dp, stride) if dp > 1 else cluster.allreduce_seconds(grads, r, across)
        rs = cluster.allreduce_seconds(grads, dp, stride, half=True) + cluster.allreduce_seconds(grads / dp, r, across)
        ag = cluster.allreduce_seconds(params, dp, stride, half=True)
        if zero == 0 or dp == 1:
            per_step += ar
        elif (framework == "meshrun" and not layered) or zero == 1:
            per_step, gathers = per_step + rs + ag, gathers + ag
        else:  # DeepSpeed ZeRO-2/3 (meshrun's per-layer variants): reduce-scatter each micro-batch's gradients
            per_mb += rs + (2 * ag if zero == 3 else 0.0)
            per_step += ag if zero == 2 else 0.0
    return per_mb, per_step, gathers


def _optimizer_seconds(model: ModelConfig, layout: Layout, gpu: GPU, prec: Precision) -> float:
    """The update is memory bound (read params, grads, optimizer state; write params and state back)
    plus the registry entry's weight-matrix FLOPs (muon's Newton-Schulz), float32 matmuls at the
    TF32 rate (half the bf16 peak)."""
    counts = param_counts(model)
    norms = 2 * model.d_model * model.n_layers
    matrices = (counts["layers"] - norms + counts["experts"] / layout.expert) / layout.pipe / layout.tensor
    rest = norms / layout.pipe / layout.tensor + counts["embedding"] / layout.tensor
    if layout.zero >= 1:  # the update runs on the ZeRO shard (HSDP: of the group's)
        matrices /= layout.zero_data * layout.expert * layout.context
        rest /= layout.zero_data * layout.expert * layout.context
    moved = (matrices + rest) * (2 * prec.param + prec.grad) + 2 * (matrices * prec.opt + rest * prec.opt_rest)
    flops = matrices * optimizers.get(layout.optimizer).matrix_update_flops(model.d_model)
    return moved / gpu.hbm_bw + flops / (gpu.peak_flops / 2)


# predict_time's parts that every microbatch pays (seconds per step: m x one microbatch's)
MICROBATCH_PARTS = ("compute", "tensor_comm", "context_comm", "pipe_comm", "expert_comm", "zero_comm")


def predict_time(
    model: ModelConfig, layout: Layout, cluster: Cluster, seq_len: int, *, calibration: Calibration | None = None,
    precision: Precision | None = None, framework: str = "meshrun", dropout: float = 0.0,
) -> dict[str, float]:  # fmt: skip
    """Seconds per step by part: compute (slowest stage), tensor/context/pipe/expert comm, exposed ZeRO
    and DP gradient sync, pipeline bubble (none on a GPU with `shared_cores`), optimizer update, plus the
    layer split."""
    cal = calibration or gpu_calibration(cluster.gpu)
    prec = precision or precision_of(model, framework, layout)
    m, s, gpu = layout.microbatches, seq_len, cluster.gpu
    split, times, slow, (t_mb, t_tp, t_cp, t_pp, t_ep, t_zero), (zero_mb, t_dp, t_gather) = _microbatch_parts(
        model, layout, cluster, s, cal, prec, dropout, framework
    )
    t_opt = _optimizer_seconds(model, layout, gpu, prec)
    per_mb = t_mb + t_tp + t_cp + t_pp + t_ep + t_zero
    bubble_slots, bubble_fraction = _bubble(layout)
    if gpu.shared_cores:  # simulated devices of one host: the other stages' work fills the idle ticks
        bubble_slots = 0.0
    loop, t_dp_full = (m + bubble_slots) * per_mb, t_dp
    t_dp, hidden = _exposed_reduce(model, layout, t_dp, t_gather, loop, framework, cluster.overlap_for(framework))
    off, flush = _megatron_overlaps(model, layout, cluster, s, cal, (t_gather, t_mb, bubble_slots * per_mb), framework)
    t_dp -= off
    total = loop + t_dp + t_opt + flush
    hid = tp_overlap_hidden(model, layout, s, cluster, cal, dropout > 0, framework == "megatron")
    return {
        **{k: m * v for k, v in zip(MICROBATCH_PARTS, (t_mb, t_tp, t_cp, t_pp, t_ep, t_zero), strict=True)},
        "bubble": bubble_slots * per_mb + flush,
        "dp_sync": t_dp,
        "optimizer": t_opt,
        "total": total,
        "dp_sync_full": t_dp_full + m * zero_mb,
        # model.tp_comm_overlap: TP collective seconds the rings hide (net of the overlap charge), slowest stage
        "tp_hidden": m * split[slow] * hid,
        "dp_hidden": hidden,  # reduction seconds run beside the last ticks (modeled; `_overlapped_reduce`)
        "dp_gather": t_gather,  # the params' all-gathers in dp_sync (meshrun ZeRO >= 1)
        "bubble_fraction": bubble_fraction,
        "overlap_cost": cluster.overlap_for(framework),  # the share of hidden communication charged
        "split": split,
        "stage_seconds": times,
    }


def _megatron_overlaps(model: ModelConfig, layout: Layout, cluster: Cluster, s: int, cal: Calibration,
                       parts: tuple[float, float, float], framework: str) -> tuple[float, float]:  # fmt: skip
    """(seconds of the params' all-gathers that overlap_param_gather hides, net of the overlap charge; seconds
    the deferred output-layer weight gradients add after the loop) under Megatron's semantics. parts:
    (the all-gathers' seconds, the slowest stage's compute per micro-batch, the bubble's seconds).
    The next step's first forwards hide the gathers bucket by bucket: the forward (a third of a
    micro-batch's compute) of min(m, p) micro-batches, the pipeline's warm-up. The deferred weight
    gradients (`deferred_wgrad`) run in the flush, where the last stage idles for the bubble."""
    if framework != "megatron":
        return 0.0, 0.0
    gather, t_mb, bubble = parts
    hidden = min(gather, min(layout.microbatches, layout.pipe) * t_mb / 3) if layout.overlap_param_gather else 0.0
    deferred = deferred_wgrad(model, layout, s, cluster.gpu, cal, framework) * layout.microbatches
    return hidden * (1 - cluster.overlap_for(framework)), max(0.0, deferred - bubble)


def deferred_wgrad(model: ModelConfig, layout: Layout, s: int, gpu: GPU, cal: Calibration, framework: str) -> float:
    """Seconds per micro-batch (averaged over the step's) of the output layer's weight-gradient GEMM that
    `layout.wgrad_deferral` moves out of the last stage's micro-batches into the pipeline flush
    (Megatron-Core's defer_embedding_wgrad_compute: "hide pipeline flush latency"); 0 without a pipeline."""
    if framework != "megatron" or not layout.wgrad_deferral or layout.pipe == 1:
        return 0.0
    tok = layout.micro_batch_size * (s / layout.context if layout.context > 1 else s)
    w = kernels.gemm_seconds(model.d_model, model.vocab / layout.tensor, tok, gpu, cal)
    return w * min(layout.wgrad_deferral, layout.microbatches) / layout.microbatches


def _exposed_reduce(model: ModelConfig, layout: Layout, t_dp: float, t_gather: float, loop: float, framework: str,
                    overlap_cost: float = OVERLAP_COST):  # fmt: skip
    """(exposed data-parallel seconds, seconds hidden beside the last ticks) under overlap_grad_reduce:
    `moved` seconds of the reduction go into the last ticks (`sent`: with meshrun's re-sent layers),
    `hidden` of them beside the ticks (charged `overlap_cost`), the rest still exposed."""
    moved, sent, hidden = _overlapped_reduce(model, layout, t_dp - t_gather, loop, framework)
    return t_dp - moved + (sent - hidden) + overlap_cost * hidden, hidden


def _microbatch_parts(
    model: ModelConfig,
    layout: Layout,
    cluster: Cluster,
    s: int,
    cal: Calibration,
    prec: Precision,
    dropout: float,
    framework: str,
) -> tuple[list[int], list[float], int, tuple[float, ...], tuple]:
    """(split, each stage's seconds, the slowest stage, one microbatch's seconds on it by part: compute,
    tensor, context, pipe, expert and exposed ZeRO comm; `_dp_comm`'s data-parallel seconds)."""
    b, c = layout.micro_batch_size, layout.context
    split, times, slow, cp_layer, busy = _split_stages(model, layout, cluster, s, cal, prec, dropout > 0, framework)
    t_cp = split[slow] * cp_layer
    t_mb, t_tp = busy, times[slow] - busy - t_cp
    act = prec.act * b * (s / c if c > 1 else s) * model.d_model
    t_pp = _pipe_seconds(layout, cluster, act, framework)
    t_ep = _expert_seconds(model, layout, cluster, act, split[slow], framework)
    dp = _dp_comm(model, layout, cluster, prec, framework)
    hidden = min(dp[0], t_mb)  # ZeRO-2/3 per-micro-batch traffic overlaps that micro-batch's compute
    # charged as meshrun's under both semantics: no published run of the H100 fit used ZeRO-2/3
    t_zero = dp[0] - hidden + cluster.overlap_for("meshrun") * hidden
    return split, times, slow, (t_mb, t_tp, t_cp, t_pp, t_ep, t_zero), dp


def _split_stages(
    model: ModelConfig, layout: Layout, cluster: Cluster, s: int, cal: Calibration, prec: Precision, dropout: bool,
    framework: str = "meshrun",
) -> tuple[list[int], list[float], int, float, float]:  # fmt: skip
    """The layer split balanced on each layer's compute + tensor + context seconds: (split, each stage's
    seconds, the slowest stage, one layer's context-comm seconds, the slowest stage's compute alone).
    Megatron's Transformer Engine casts each weight to fp8 once per step (`kernels.layer_seconds`)."""
    p, te = layout.pipe, framework == "megatron"
    compute = stage_seconds(model, layout, s, cluster.gpu, cal, dropout=dropout, te=te)
    full = stage_seconds(model, layout, s, cluster.gpu, cal, cluster=cluster, dropout=dropout, te=te)
    cp_layer = context_seconds(model, layout, cluster, s, cal, prec.act, dropout, framework)
    dw = deferred_wgrad(model, layout, s, cluster.gpu, cal, framework)  # off the last stage's micro-batches
    compute, with_cp = (*compute[:2], compute[2] - dw), (full[0] + cp_layer, full[1], full[2] - dw)
    v, placement = layout.chunks if p > 1 else layout.virtual, layout.sched.placement
    split = layers_per_stage(model.n_layers, p, v, with_cp, placement)
    times, busy = _stage_times(split, with_cp, placement), _stage_times(split, compute, placement)
    slow = max(range(p), key=times.__getitem__)
    return split, times, slow, cp_layer, busy[slow]


def _overlapped_reduce(
    model: ModelConfig, layout: Layout, reduce_s: float, loop_s: float, framework: str
) -> tuple[float, float, float]:  # fmt: skip
    """(seconds of the data-parallel gradient reduction that overlap_grad_reduce moves into the
    pipeline's last ticks, the seconds it sends there (`_resent`: meshrun's drain re-sends layers), the
    seconds of those the ticks hide) for `reduce_s` (all-reduce, or the
    reduce-scatter half of ZeRO's sync). meshrun: pipeline.overlap_grad_reduce; Megatron:
    --overlap-grad-reduce, which launches each model chunk's reduction once its last backward is done.
    Structural only, unmeasured on a GPU: the chunks whose gradients are final at the first grad cut
    (`step_model.overlap_cut`) move their share of the layer gradients' bytes (by layer count; the
    embedding and head still reduce after the loop). Ticks are loop_s / ticks long; Megatron's
    buckets may use every tick after the cut, meshrun reduces a chunk ceil(Lc / n) layers per tick
    over the first ceil(Lc / k) of the n ticks after the cut (`StageRun.segments`), each tick hiding
    at most its length. Megatron's DeepSpeed-style ZeRO-2/3 already reduce per micro-batch."""
    ticks, cut, early = step_model.overlap_cut(layout)
    if not early or reduce_s <= 0 or (framework == "megatron" and layout.zero >= 2):
        return 0.0, 0.0, 0.0
    counts = param_counts(model)
    p, t = layout.pipe, layout.tensor
    layers = counts["layers"] / p / t + counts["experts"] / p / (t * layout.expert)
    moved = early * layers / (layers + counts["embedding"] / t)
    used = _drain(model, layout, ticks - cut)[1]
    window = (ticks - cut if framework == "megatron" else used) * loop_s / ticks
    sent = _resent(model, layout, framework) * moved * reduce_s
    return moved * reduce_s, sent, min(sent, window)


def overlap_ticks(model: ModelConfig, layout: Layout, framework: str = "meshrun") -> tuple[int, int, int]:
    """(ticks the first cut's reduction runs beside, ticks after that cut, ticks) of overlap_grad_reduce."""
    ticks, cut, early = step_model.overlap_cut(layout)
    if not early:
        return 0, 0, ticks
    used = ticks - cut if framework == "megatron" else _drain(model, layout, ticks - cut)[1]
    return used, ticks - cut, ticks


def _drain(model: ModelConfig, layout: Layout, n: int) -> tuple[int, int]:
    """(layers per tick, ticks) meshrun drains a final chunk of Lc layers in over the n ticks after its cut."""
    return schedules.drain(-(-model.n_layers // (layout.pipe * layout.chunks)), n)


def _resent(model: ModelConfig, layout: Layout, framework: str) -> float:
    """The bytes meshrun's drain moves over the chunk's (`_drain`: k ceil(Lc/k) layer reductions, the
    last tick's k rounding up with the last layer again); 1 for Megatron's buckets."""
    ticks, cut, early = step_model.overlap_cut(layout)
    if framework == "megatron" or not early:
        return 1.0
    lc = -(-model.n_layers // (layout.pipe * layout.chunks))
    k, used = _drain(model, layout, ticks - cut)
    return k * used / lc


def _pipe_seconds(layout: Layout, cluster: Cluster, act: float, framework: str) -> float:
    """Per micro-batch: activations forward and gradients backward over 'pipe', per chunk. Megatron
    splits each send over the TP ranks (scatter/gather); meshrun sends what a device holds of the
    residual stream: all of it, or its 1/t sequence slice under sequence parallelism (the compiled
    collective-permute's operand, `step_model.pipe_payload`)."""
    t, p, v = layout.tensor, layout.pipe, layout.chunks
    if p == 1:
        return 0.0
    sent = act / t if framework == "megatron" else pipe_payload(act, layout)
    return 2 * v * (cluster.latency_s + sent / cluster.group_bw(2 * t * layout.expert * layout.data * layout.context))


def a2a_rows(model: ModelConfig, expert: int, framework: str = "meshrun") -> float:
    """Rows per token one expert collective moves: `routed_rows`; meshrun's dropless exchange (ep > 1)
    all-gathers the group's tokens and reduce-scatters the gated sums, ep rows each on the wire side
    (`flops.dropless_exchange`; the gathered rows in float32 with gates and ids), which group-limited
    routing does not shrink. Under Megatron's dropless dispatch with device-limited routing (route_groups > 1,
    limit M) a token's copies reach at most M groups, and a dispatch that sends a token once per group
    it reaches (forwarded to its experts inside the group) moves min(top_k, M) / top_k of them
    (DeepSeek-V3 report, 2.1.2 and 3.2.2: at most 4 nodes per token)."""
    if framework != "megatron" and model.moe_dispatch == "dropless" and expert > 1:
        gathered, _ = dropless_exchange(model, expert, precision_of(model).act)
        return (gathered + expert) / 2  # all-gathers and reduce-scatters alternate
    rows = routed_rows(model, expert, framework)
    limit = getattr(model, "route_group_limit", 0) if getattr(model, "route_groups", 0) > 1 else 0
    if framework != "megatron" or model.moe_dispatch != "dropless" or not limit:
        return rows
    return rows * min(model.top_k, limit) / model.top_k


def _expert_seconds(model: ModelConfig, layout: Layout, cluster: Cluster, act: float, stage_layers: float,
                    framework: str = "meshrun") -> float:  # fmt: skip
    """Per micro-batch: dispatch + combine all-to-all of the stage's MoE layers, forward and backward
    (+ recompute), not overlapped (Megatron-Core's all-to-all dispatcher of these releases runs it
    between the attention and the experts), of `a2a_rows` per token."""
    t, e = layout.tensor, layout.expert
    n_moe = model.n_moe_layers * stage_layers / model.n_layers
    if not (n_moe and e > 1):
        return 0.0
    a2a = act * a2a_rows(model, e, framework) / (t if layout.sequence_parallel and t > 1 else 1)
    one = cluster.latency_s + a2a * (e - 1) / e / cluster.group_bw(e * t * layout.context)
    return n_moe * (4 + 2 * (layout.remat == "full")) * one


def _bubble(layout: Layout) -> tuple[float, float]:
    """(idle micro-batch slots, bubble fraction) of the schedule on its executor: its registry
    entry's `idle` (1F1B and interleaved: (p - 1) / v slots; with the backward split into B and W and
    F = B = W less, the W's filling idle ticks), checked against the tables in tests/test_planner.py."""
    p, m, sched = layout.pipe, layout.microbatches, layout.sched
    idle = sched.idle(p, m, max(layout.virtual, 1), layout.run_executor)
    return idle, idle / (m + idle)
