"""Cost model of one training step: parameters, FLOPs, per-device memory, time (compute + comm + bubble).

Letters: B global batch (sequences), b micro-batch size, s sequence length, h d_model, L layers,
V vocab, a heads, t/p/d/e tensor/pipe/data/expert degrees, m micro-batches, v virtual stages.
Sources: Narayanan et al. 2021 (Megatron PTD-P, FLOPs eq. 3, schedules), Korthikanti et al. 2022
(activation memory, sequence parallelism, selective recompute), Rajbhandari et al. 2020 (ZeRO).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshrun.config import ModelConfig
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
class Plan:
    """One parallel layout. Dense layers' data-parallel group is data x expert (EP folded into DP)."""

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
        # PP does not multiply the batch: B = b x m x DP (DESIGN section 6).
        return self.micro_batch_size * self.microbatches * self.data * self.expert

    def with_(self, **kw) -> Plan:
        return replace(self, **kw)


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


# ----------------------------------------------------------------------------- parameters


def attn_params(m: ModelConfig) -> int:
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    return m.d_model * q + 2 * m.d_model * kv + q * m.d_model  # Wq, Wk, Wv, Wo (GQA: fewer kv heads)


def mlp_params(m: ModelConfig) -> int:
    return (3 if m.mlp == "swiglu" else 2) * m.d_model * m.d_ff  # swiglu: gate, up, down; gelu: up, down


def n_moe_layers(m: ModelConfig) -> int:
    return m.n_layers // m.moe_every if m.is_moe else 0


def layer_params(m: ModelConfig, moe: bool = False) -> int:
    """One transformer layer: attention + MLP (or E experts + router) + 2 norms. GPT-3: 12h^2 + 2h."""
    ffn = m.n_experts * mlp_params(m) + m.d_model * m.n_experts if moe else mlp_params(m)
    return attn_params(m) + ffn + 2 * m.d_model


def param_counts(m: ModelConfig) -> dict[str, int]:
    n_moe = n_moe_layers(m)
    dense_layers = (m.n_layers - n_moe) * layer_params(m) + n_moe * (
        layer_params(m, True) - m.n_experts * mlp_params(m)
    )
    experts = n_moe * m.n_experts * mlp_params(m)
    emb = m.vocab * m.d_model
    head = 0 if m.tie_embeddings else m.vocab * m.d_model
    total = dense_layers + experts + emb + head + m.d_model
    return {"layers": dense_layers, "experts": experts, "embedding": emb, "head": head, "total": total}


# ----------------------------------------------------------------------------- FLOPs


def _matmul_active(m: ModelConfig, moe: bool) -> int:
    """Matmul params a token passes through in one layer (MoE: top_k experts + router)."""
    return attn_params(m) + (m.top_k * mlp_params(m) + m.d_model * m.n_experts if moe else mlp_params(m))


def layer_fwd_flops(m: ModelConfig, tokens: float, s: int, moe: bool = False, capacity: float = 1.0) -> float:
    """2 FLOPs per matmul param per token + attention scores QK^T and A.V (4 s^2 a d_head per sequence,
    counted in full as Megatron does, not halved for causal masking)."""
    mat = _matmul_active(m, moe)
    if moe:
        mat += (capacity - 1.0) * m.top_k * mlp_params(m)  # capacity padding is executed too
    return 2.0 * tokens * mat + 4.0 * tokens * s * m.n_heads * m.head_dim


def attn_core_fwd_flops(m: ModelConfig, tokens: float, s: int) -> float:
    return 4.0 * tokens * s * m.n_heads * m.head_dim


def model_flops(m: ModelConfig, batch: float, s: int) -> float:
    """Model FLOPs per step (no recompute): 3 x forward. For GPT (gelu, ffn 4h, MHA) this is exactly
    Megatron's 72 B s L h^2 (1 + s/(6h) + V/(12 L h))."""
    tok = batch * s
    n_moe = n_moe_layers(m)
    fwd = (m.n_layers - n_moe) * layer_fwd_flops(m, tok, s) + n_moe * layer_fwd_flops(m, tok, s, True)
    return 3.0 * (fwd + 2.0 * tok * m.d_model * m.vocab)


def hardware_flops(m: ModelConfig, batch: float, s: int, remat: str) -> float:
    """Model FLOPs + recomputation, as Megatron reports TFLOP/s. Full remat: 96 B s L h^2
    (1 + s/(6h) + V/(16 L h)) (Narayanan 2021 eq. 3); selective recomputes the attention core only."""
    tok = batch * s
    n_moe = n_moe_layers(m)
    extra = 0.0
    if remat == "full":
        extra = (m.n_layers - n_moe) * layer_fwd_flops(m, tok, s) + n_moe * layer_fwd_flops(m, tok, s, True)
    elif remat == "selective":
        extra = m.n_layers * attn_core_fwd_flops(m, tok, s)
    return model_flops(m, batch, s) + extra


# ----------------------------------------------------------------------------- memory


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
    sp = model.sequence_parallel if sequence_parallel is None else sequence_parallel
    flash = model.attention_impl == "cudnn" if flash is None else flash
    s = seq_len or model.max_seq_len
    t, p, b, h = tensor, pipe, micro_batch_size, model.d_model
    if schedule == "interleaved" and virtual == 1:
        schedule = "1f1b"
    counts = param_counts(model)
    n_moe = n_moe_layers(model)
    stage_layers = model.n_layers / p
    moe_frac = n_moe / model.n_layers
    dense_dp, expert_dp = data * expert, data

    kw = dict(sp=sp and t > 1, act=ab, dropout=dropout, flash=flash)
    dense_act = layer_activation_bytes(model, b, s, t, remat=remat, **kw)
    moe_act = layer_activation_bytes(model, b, s, t, remat=remat, moe=True, **kw) if n_moe else 0.0
    per_layer = (1 - moe_frac) * dense_act + moe_frac * moe_act
    if remat == "full":  # keep each layer's input; recompute one layer at a time in the backward
        kept = ab * s * b * h / (t if sp and t > 1 else 1)
        working = layer_activation_bytes(model, b, s, t, remat="none", **kw)
        if n_moe:
            working = max(working, layer_activation_bytes(model, b, s, t, remat="none", moe=True, **kw))
    else:
        kept, working = per_layer, 0.0

    best: dict[str, float] | None = None
    for stage in sorted({0, p - 1}):
        first, last = stage == 0, stage == p - 1
        dense = counts["layers"] / p / t
        if first:
            dense += counts["embedding"] / t
        if last:  # output head (a copy of the tied embedding when it lives on another stage) + final norm
            dense += (counts["head"] or (counts["embedding"] if p > 1 else 0)) / t + h
        experts = counts["experts"] / p / (t * expert)
        shard = {0: (1, 1, 1), 1: (1, 1, dense_dp), 2: (1, dense_dp, dense_dp), 3: (dense_dp,) * 3}[zero]
        eshard = {0: (1, 1, 1), 1: (1, 1, expert_dp), 2: (1, expert_dp, expert_dp), 3: (expert_dp,) * 3}[zero]
        params = pb * (dense / shard[0] + experts / eshard[0])
        grads = gb * (dense / shard[1] + experts / eshard[1])
        if accum_copy and microbatches > 1:
            grads += gb * (dense + experts)
        opt = ob * (dense / shard[2] + experts / eshard[2])
        if zero == 3:  # gathered weights of the layer in use and the prefetched next one
            params += 2 * pb * (layer_params(model, n_moe > 0) / t)
        n_in = inflight_microbatches(schedule, p, microbatches, virtual, stage)
        acts = stage_layers * kept * n_in + working
        if first:  # embedding output (+ dropout mask) of each in-flight micro-batch
            acts += n_in * s * b * h * (ab + (1 if dropout else 0)) / (t if sp and t > 1 else 1)
        logits = 0.0
        if last:  # logits in the compute dtype + fp32 log-softmax for the loss, vocab-parallel
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


def predict_time(
    model: ModelConfig,
    plan: Plan,
    cluster: Cluster,
    seq_len: int,
    *,
    efficiency: float = GEMM_EFFICIENCY,
    precision: Precision | None = None,
) -> dict[str, float]:
    """Seconds per step, by part: compute, tensor/pipe/expert comm, exposed ZeRO and DP gradient sync,
    pipeline bubble, optimizer update. The slowest (last) stage sets the pace."""
    prec = precision or precision_of(model)
    t, p, d, e, v, m, b = (plan.tensor, plan.pipe, plan.data, plan.expert, plan.virtual,
                           plan.microbatches, plan.micro_batch_size)  # fmt: skip
    s, h, gpu = seq_len, model.d_model, cluster.gpu
    n_moe = n_moe_layers(model)
    L_s, moe_s = model.n_layers / p, n_moe / p
    dense_s = L_s - moe_s
    tok = b * s
    full = plan.remat == "full"

    # Compute of one micro-batch on the last stage (its layers + the logits), per device.
    f_dense = layer_fwd_flops(model, tok, s)
    f_moe = layer_fwd_flops(model, tok, s, True, model.capacity_factor) if n_moe else 0.0
    fwd = dense_s * f_dense + moe_s * f_moe
    recompute = fwd if full else (L_s * attn_core_fwd_flops(model, tok, s) if plan.remat == "selective" else 0.0)
    stage_flops = 3 * fwd + recompute + 3 * 2.0 * tok * h * model.vocab
    t_mb = stage_flops / t / (gpu.peak_flops * efficiency)
    bwd_frac = 2 * fwd / (3 * fwd + recompute)

    # Tensor parallel: 2 all-reduces forward + 2 backward per layer (+2 when the forward is recomputed),
    # each of b s h activations; with SP the all-gather + reduce-scatter pair moves the same bytes.
    act_bytes = prec.act * tok * h
    t_tp = L_s * (4 + 2 * full) * _ring_allreduce(act_bytes, t, cluster.group_bw(t))
    # Pipeline p2p: activations forward and gradients backward per micro-batch and virtual chunk,
    # split over the TP ranks (Megatron's scatter/gather optimisation). Neighbours are t*e*d apart.
    t_pp = 0.0
    if p > 1:
        t_pp = 2 * v * (COMM_LATENCY_S + act_bytes / t / cluster.group_bw(2 * t * e * d))
    # Expert all-to-all: dispatch + combine, forward and backward (+ recompute).
    t_ep = 0.0
    if n_moe and e > 1:
        a2a = prec.act * tok * model.top_k * model.capacity_factor * h / (t if plan.sequence_parallel else 1)
        t_ep = moe_s * (4 + 2 * full) * (COMM_LATENCY_S + a2a * (e - 1) / e / cluster.group_bw(e * t))

    # Data-parallel traffic. Dense params reduce over data*expert ranks, expert params over data ranks.
    counts = param_counts(model)
    dense_dev = (counts["layers"] / p + counts["embedding"]) / t
    expert_dev = counts["experts"] / p / (t * e)
    bw_dp = cluster.group_bw(t * e * d)
    groups = ((dense_dev, d * e), (expert_dev, d))
    t_zero_mb = 0.0  # ZeRO-2/3: gradients reduce-scattered every micro-batch; ZeRO-3 gathers weights fwd + bwd
    t_dp = 0.0  # once per step, after the last backward
    for n_par, dp in groups:
        if plan.zero >= 2:
            t_zero_mb += _ring_gather(n_par * prec.grad, dp, bw_dp)  # full-size grads -> shard
        if plan.zero == 3:
            t_zero_mb += 2 * _ring_gather(n_par * prec.param, dp, bw_dp)
        if plan.zero == 0:
            t_dp += _ring_allreduce(n_par * prec.grad, dp, bw_dp)
        elif plan.zero == 1:
            t_dp += _ring_gather(n_par * prec.grad, dp, bw_dp) + _ring_gather(n_par * prec.param, dp, bw_dp)
        elif plan.zero == 2:
            t_dp += _ring_gather(n_par * prec.param, dp, bw_dp)
    t_zero_exposed = _exposed(t_zero_mb, t_mb)  # prefetch / bucketing overlaps it with compute
    t_dp_exposed = _exposed(t_dp, bwd_frac * t_mb)  # overlaps the last micro-batch's backward only

    # Optimizer: read params, grads, m, v (+ master), write them back: memory bound.
    n_opt = dense_dev / (d * e if plan.zero >= 1 else 1) + expert_dev / (d if plan.zero >= 1 else 1)
    t_opt = n_opt * (2 * prec.param + prec.grad + 2 * prec.opt) / gpu.hbm_bw

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
