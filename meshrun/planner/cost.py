"""Cost model of one training step: per-device memory, time (compute + comm + bubble) of a layout.

Letters: B global batch (sequences), b micro-batch size, s sequence length, h d_model, L layers,
V vocab, a heads, t/p/d/e tensor/pipe/data/expert degrees, m micro-batches, v virtual stages.
Sources: Narayanan et al. 2021 (Megatron PTD-P, FLOPs eq. 3, schedules), Korthikanti et al. 2022
(activation memory, sequence parallelism, selective recompute), Rajbhandari et al. 2020 (ZeRO).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshrun.config import ModelConfig
from meshrun.flops import attn_core_fwd_flops, layer_fwd_flops, layer_params, moe_routed, param_counts
from meshrun.planner.hardware import COMM_LATENCY_S, Cluster

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# Achievable fraction of peak for the transformer's GEMM work (incl. attention, norms and kernel
# overheads folded in). Fitted by `search.fit_efficiency()` to Megatron-LM's measured PTD-P runs
# (Narayanan et al. 2021, Table 1, the rows with TP=8 and PP>1: 39.1B, 76.1B, 145.6B, 310.1B, 529.6B,
# 1008B); tests/test_planner.py checks that this constant equals the fit.
GEMM_EFFICIENCY = 0.607
# Overlapped communication is not free: NCCL kernels take SMs and HBM bandwidth from the GEMMs they
# run beside. This fraction of the hidden communication time is still charged to the step.
OVERLAP_COST = 0.25


@dataclass(frozen=True)
class Layout:
    """One candidate parallel layout. Dense layers' data-parallel group is data x expert (EP folded
    into DP)."""

    tensor: int = 1
    pipe: int = 1
    data: int = 1
    expert: int = 1
    virtual: int = 1
    microbatches: int = 1
    micro_batch_size: int = 1
    zero: int = 0
    remat: str = "full"  # none | selective | full
    sequence_parallel: bool = False
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved (virtual > 1)

    @property
    def n_devices(self) -> int:
        return self.tensor * self.pipe * self.data * self.expert

    @property
    def global_batch(self) -> int:
        # Pipeline stages share each micro-batch, so PP does not multiply the batch: B = b x m x DP.
        return self.micro_batch_size * self.microbatches * self.data * self.expert


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each model state, and per activation element."""

    param: float
    grad: float
    opt: float  # Adam m and v in fp32, plus an fp32 master copy when the params are 16-bit
    act: float


def precision_of(model: ModelConfig) -> Precision:
    """bf16 params -> 2 + 2 + 12 = 16 B/param (Megatron mixed precision, ZeRO paper's K=12);
    fp32 params (the tiny CPU configs, or JAX fp32 params + bf16 compute) -> 4 + 4 + 8 = 16 B/param."""
    pb = DTYPE_BYTES[model.param_dtype]
    return Precision(param=pb, grad=pb, opt=8 + (4 if pb < 4 else 0), act=DTYPE_BYTES[model.dtype])


# ----------------------------------------------------------------------------- memory


def zero_divisors(zero: int, dp: int) -> tuple[int, int, int]:
    """How many ways ZeRO stage `zero` splits (params, grads, optimizer states) over `dp` ranks."""
    return {0: (1, 1, 1), 1: (1, 1, dp), 2: (1, dp, dp), 3: (dp, dp, dp)}[zero]


def layer_activation_bytes(
    m: ModelConfig, b: int, s: int, t: int, *, sp: bool, remat: str, act: float, dropout: bool, flash: bool, moe=False
) -> float:
    """Bytes one layer keeps for its backward, per micro-batch (Korthikanti 2022, section 4).
    GPT-3 (a=2 bytes, dropout): sbh(34 + 5as/h); TP: sbh(10 + 24/t + 5as/(ht)); TP+SP: sbh/t (34 + 5as/h);
    selective drops 5as/h. Generalised to GQA, swiglu, MoE and no-dropout models by counting tensors."""
    sbh = s * b * m.d_model
    mask = 1.0 if dropout else 0.0
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    # Replicated across TP without SP: LN1 input, QKV input, LN2 input, MLP input (+ 2 dropout masks).
    repl = 4 * act * sbh + 2 * mask * sbh
    # Split by TP: Q, K, V; out-proj input; MLP intermediates (gelu: fc1 out + gelu out; swiglu: gate, up, prod).
    mlp_elems = (3 if m.mlp == "swiglu" else 2) * s * b * m.d_ff
    mlp = act * mlp_elems
    if moe:  # routed copies of the tokens (top_k x capacity), router logits, dispatch + combine buffers
        routed = m.top_k * m.capacity_factor
        mlp = act * mlp_elems * routed + 4 * s * b * m.n_experts + 2 * act * sbh * routed
    split = act * s * b * (q + 2 * kv) + act * s * b * q + mlp
    if flash:  # flash attention keeps only the log-sum-exp (fp32), never the s x s scores
        core = 4.0 * b * m.n_heads * s
    else:  # softmax output (+ dropout mask and dropout output)
        core = b * m.n_heads * s * s * (act + (mask + act if dropout else 0.0))
    if remat == "selective":
        core = 0.0 if not flash else core
    return (repl + split + core) / t if sp else repl + (split + core) / t


def inflight_microbatches(schedule: str, p: int, m: int, v: int, stage: int) -> float:
    """Micro-batches whose activations stage `stage` holds at its peak, in units of its layers.
    GPipe: all m. 1F1B: p - stage (p on the first stage). Interleaved (Korthikanti 2022, 4.2.3):
    the first stage holds p (1 + (p-1)/(p v)) micro-batches' worth."""
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    n = float(min(p - stage, m))
    if schedule == "interleaved" and stage == 0:
        n *= 1.0 + (p - 1) / (p * v)
    return n


def _layer_activations(
    model: ModelConfig, b: int, s: int, t: int, *, remat: str, sp: bool, act: float, dropout: bool, flash: bool
) -> tuple[float, float]:
    """(bytes each layer keeps per micro-batch, bytes of the one layer being recomputed). Full remat
    keeps each layer's input and rebuilds one layer at a time in the backward."""
    kw = dict(sp=sp, act=act, dropout=dropout, flash=flash)
    n_moe = model.n_moe_layers
    moe_frac = n_moe / model.n_layers
    dense_act = layer_activation_bytes(model, b, s, t, remat=remat, **kw)
    moe_act = layer_activation_bytes(model, b, s, t, remat=remat, moe=True, **kw) if n_moe else 0.0
    per_layer = (1 - moe_frac) * dense_act + moe_frac * moe_act
    if remat != "full":
        return per_layer, 0.0
    kept = act * s * b * model.d_model / (t if sp else 1)
    working = layer_activation_bytes(model, b, s, t, remat="none", **kw)
    if n_moe:
        working = max(working, layer_activation_bytes(model, b, s, t, remat="none", moe=True, **kw))
    return kept, working


def _stage_params(counts: dict[str, int], h: int, p: int, t: int, expert: int, stage: int) -> tuple[float, float]:
    """(dense, expert) parameters on one device of pipeline stage `stage`, before ZeRO sharding. The
    last stage holds the output head (a copy of the tied embedding when it lives on another stage)
    and the final norm."""
    dense = counts["layers"] / p / t
    if stage == 0:
        dense += counts["embedding"] / t
    if stage == p - 1:
        dense += (counts["head"] or (counts["embedding"] if p > 1 else 0)) / t + h
    return dense, counts["experts"] / p / (t * expert)


def predict_memory(
    model: ModelConfig,
    *,
    tensor: int = 1,
    pipe: int = 1,
    data: int = 1,
    expert: int = 1,
    microbatches: int = 1,
    micro_batch_size: int = 1,
    seq_len: int | None = None,
    zero: int = 0,
    remat: str | None = None,
    sequence_parallel: bool | None = None,
    schedule: str = "1f1b",
    virtual: int = 1,
    param_bytes: float | None = None,
    grad_bytes: float | None = None,
    opt_bytes: float | None = None,
    act_bytes: float | None = None,
    dropout: bool = False,
    flash: bool | None = None,
    accum_copy: bool = False,
) -> dict[str, float]:
    """Per-device bytes on the fullest pipeline stage: params, grads, optimizer, activations, logits, total.
    Byte sizes default to `precision_of(model)` (from model.param_dtype / model.dtype); remat,
    sequence_parallel and flash (attention_impl == 'cudnn') default to the model config.
    accum_copy: with m > 1, one more full-size gradient per device (JAX accumulating each micro-batch's
    fresh gradient pytree into a carry, where Megatron accumulates in place)."""
    prec = precision_of(model)
    pb = prec.param if param_bytes is None else param_bytes
    gb = prec.grad if grad_bytes is None else grad_bytes
    ob = prec.opt if opt_bytes is None else opt_bytes
    ab = prec.act if act_bytes is None else act_bytes
    remat = model.remat if remat is None else remat
    sp = (model.sequence_parallel if sequence_parallel is None else sequence_parallel) and tensor > 1
    flash = model.attention_impl == "cudnn" if flash is None else flash
    s = seq_len or model.max_seq_len
    t, p, b, h = tensor, pipe, micro_batch_size, model.d_model
    if schedule == "interleaved" and virtual == 1:
        schedule = "1f1b"
    counts = param_counts(model)
    kept, working = _layer_activations(model, b, s, t, remat=remat, sp=sp, act=ab, dropout=dropout, flash=flash)
    dense_div, expert_div = zero_divisors(zero, data * expert), zero_divisors(zero, data)

    best: dict[str, float] | None = None
    for stage in sorted({0, p - 1}):
        dense, experts = _stage_params(counts, h, p, t, expert, stage)
        params, grads, opt = (
            nbytes * (dense / dd + experts / ed) for nbytes, dd, ed in zip((pb, gb, ob), dense_div, expert_div)
        )
        if accum_copy and microbatches > 1:
            grads += gb * (dense + experts)
        if zero == 3:  # gathered weights of the layer in use and the prefetched next one
            params += 2 * pb * (layer_params(model, model.is_moe) / t)
        n_in = inflight_microbatches(schedule, p, microbatches, virtual, stage)
        acts = model.n_layers / p * kept * n_in + working
        if stage == 0:  # embedding output (+ dropout mask) of each in-flight micro-batch
            acts += n_in * s * b * h * (ab + (1 if dropout else 0)) / (t if sp else 1)
        logits = 0.0
        if stage == p - 1:  # logits in the compute dtype + fp32 log-softmax for the loss, vocab-parallel
            logits = s * b * model.vocab / t * (ab + 4) + ab * s * b * h
        total = params + grads + opt + acts + logits
        part = {
            "params": params,
            "grads": grads,
            "optimizer": opt,
            "activations": acts,
            "logits": logits,
            "total": total,
            "stage": stage,
            "params_per_device": dense + experts,
        }
        if best is None or total > best["total"]:
            best = part
    return best


# ----------------------------------------------------------------------------- time


def _ring_allreduce(nbytes: float, n: int, bw: float) -> float:
    return 0.0 if n <= 1 else COMM_LATENCY_S + 2 * (n - 1) / n * nbytes / bw


def _ring_gather(nbytes: float, n: int, bw: float) -> float:
    """All-gather or reduce-scatter of a tensor of `nbytes` (full size) over n ranks."""
    return 0.0 if n <= 1 else COMM_LATENCY_S + (n - 1) / n * nbytes / bw


def _exposed(comm: float, window: float) -> float:
    """Part of `comm` that shows in the step when it runs beside `window` seconds of compute."""
    hidden = min(comm, window)
    return comm - hidden + OVERLAP_COST * hidden


def _microbatch_compute(
    model: ModelConfig, layout: Layout, cluster: Cluster, s: int, efficiency: float
) -> tuple[float, float]:
    """(seconds of one micro-batch on the last stage: its layers + the logits, per device; the
    backward's share of that time, which the data-parallel sync can hide behind)."""
    p, tok = layout.pipe, layout.micro_batch_size * s
    L_s, moe_s = model.n_layers / p, model.n_moe_layers / p
    f_dense = layer_fwd_flops(model, tok, s)
    padding = 1.0 if model.moe_dispatch == "dropless" else model.capacity_factor  # grouped GEMM: no padding
    f_moe = layer_fwd_flops(model, tok, s, True, padding) if model.n_moe_layers else 0.0
    fwd = (L_s - moe_s) * f_dense + moe_s * f_moe
    recompute = 0.0
    if layout.remat == "full":
        recompute = fwd
    elif layout.remat == "selective":
        recompute = L_s * attn_core_fwd_flops(model, tok, s)
    stage_flops = 3 * fwd + recompute + 3 * 2.0 * tok * model.d_model * model.vocab
    t_mb = stage_flops / layout.tensor / (cluster.gpu.peak_flops * efficiency)
    return t_mb, 2 * fwd / (3 * fwd + recompute)


def _microbatch_comm(
    model: ModelConfig, layout: Layout, cluster: Cluster, s: int, prec: Precision
) -> tuple[float, float, float]:
    """Seconds of (tensor, pipe, expert) communication per micro-batch on one device."""
    t, p, d, e, v = layout.tensor, layout.pipe, layout.data, layout.expert, layout.virtual
    tok, h, full = layout.micro_batch_size * s, model.d_model, layout.remat == "full"
    # Tensor parallel: 2 all-reduces forward + 2 backward per layer (+2 when the forward is recomputed),
    # each of b s h activations; with SP the all-gather + reduce-scatter pair moves the same bytes.
    act_bytes = prec.act * tok * h
    t_tp = model.n_layers / p * (4 + 2 * full) * _ring_allreduce(act_bytes, t, cluster.group_bw(t))
    # Pipeline p2p: activations forward and gradients backward per micro-batch and virtual chunk,
    # split over the TP ranks (Megatron's scatter/gather optimisation). Neighbours are t*e*d apart.
    t_pp = 0.0
    if p > 1:
        t_pp = 2 * v * (COMM_LATENCY_S + act_bytes / t / cluster.group_bw(2 * t * e * d))
    # Expert all-to-all: dispatch + combine, forward and backward (+ recompute).
    t_ep = 0.0
    if model.n_moe_layers and e > 1:
        a2a = prec.act * tok * moe_routed(model, e) * h / (t if layout.sequence_parallel else 1)
        t_ep = model.n_moe_layers / p * (4 + 2 * full) * (COMM_LATENCY_S + a2a * (e - 1) / e / cluster.group_bw(e * t))
    return t_tp, t_pp, t_ep


def _device_params(model: ModelConfig, layout: Layout) -> tuple[float, float]:
    """(dense, expert) parameters of one device of the first stage, before ZeRO sharding."""
    counts = param_counts(model)
    dense = (counts["layers"] / layout.pipe + counts["embedding"]) / layout.tensor
    return dense, counts["experts"] / layout.pipe / (layout.tensor * layout.expert)


def _data_parallel_comm(model: ModelConfig, layout: Layout, cluster: Cluster, prec: Precision) -> tuple[float, float]:
    """(seconds per micro-batch, seconds once per step) of data-parallel traffic. Dense params reduce
    over data*expert ranks, expert params over data ranks. ZeRO-2/3 reduce-scatter gradients every
    micro-batch and ZeRO-3 gathers weights forward and backward; once per step, after the last
    backward, ZeRO-0 all-reduces the gradients, ZeRO-1 reduce-scatters them, and ZeRO-1/2 all-gather
    the updated params."""
    t, d, e, zero = layout.tensor, layout.data, layout.expert, layout.zero
    dense_dev, expert_dev = _device_params(model, layout)
    bw_dp = cluster.group_bw(t * e * d)
    per_mb = per_step = 0.0
    for n_par, dp in ((dense_dev, d * e), (expert_dev, d)):
        if zero >= 2:
            per_mb += _ring_gather(n_par * prec.grad, dp, bw_dp)  # full-size grads -> shard
        if zero == 3:
            per_mb += 2 * _ring_gather(n_par * prec.param, dp, bw_dp)
        if zero == 0:
            per_step += _ring_allreduce(n_par * prec.grad, dp, bw_dp)
        elif zero == 1:
            per_step += _ring_gather(n_par * prec.grad, dp, bw_dp) + _ring_gather(n_par * prec.param, dp, bw_dp)
        elif zero == 2:
            per_step += _ring_gather(n_par * prec.param, dp, bw_dp)
    return per_mb, per_step


def _optimizer_time(model: ModelConfig, layout: Layout, cluster: Cluster, prec: Precision) -> float:
    """Adam reads params, grads, m, v (+ master) and writes them back: memory bound."""
    dense_dev, expert_dev = _device_params(model, layout)
    d, e = layout.data, layout.expert
    n_opt = dense_dev / (d * e if layout.zero >= 1 else 1) + expert_dev / (d if layout.zero >= 1 else 1)
    return n_opt * (2 * prec.param + prec.grad + 2 * prec.opt) / cluster.gpu.hbm_bw


def predict_time(
    model: ModelConfig,
    layout: Layout,
    cluster: Cluster,
    seq_len: int,
    *,
    efficiency: float = GEMM_EFFICIENCY,
    precision: Precision | None = None,
) -> dict[str, float]:
    """Seconds per step, by part: compute, tensor/pipe/expert comm, exposed ZeRO and DP gradient sync,
    pipeline bubble, optimizer update. The slowest (last) stage sets the pace."""
    prec = precision or precision_of(model)
    p, v, m = layout.pipe, layout.virtual, layout.microbatches
    t_mb, bwd_frac = _microbatch_compute(model, layout, cluster, seq_len, efficiency)
    t_tp, t_pp, t_ep = _microbatch_comm(model, layout, cluster, seq_len, prec)
    t_zero_mb, t_dp = _data_parallel_comm(model, layout, cluster, prec)
    t_zero_exposed = _exposed(t_zero_mb, t_mb)  # prefetch / bucketing overlaps it with compute
    t_dp_exposed = _exposed(t_dp, bwd_frac * t_mb)  # overlaps the last micro-batch's backward only
    t_opt = _optimizer_time(model, layout, cluster, prec)

    per_mb = t_mb + t_tp + t_pp + t_ep + t_zero_exposed
    bubble_slots = (p - 1) / v
    total = (m + bubble_slots) * per_mb + t_dp_exposed + t_opt
    return {
        "compute": m * t_mb,
        "tensor_comm": m * t_tp,
        "pipe_comm": m * t_pp,
        "expert_comm": m * t_ep,
        "zero_comm": m * t_zero_exposed,
        "bubble": bubble_slots * per_mb,
        "dp_sync": t_dp_exposed,
        "optimizer": t_opt,
        "total": total,
        "dp_sync_full": t_dp + m * t_zero_mb,
        "bubble_fraction": (p - 1) / (v * m + p - 1),
    }
