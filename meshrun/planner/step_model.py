"""Memory and collective model of meshrun's OWN compiled step (what `meshrun explain` compares with
XLA's `memory_analysis()` and HLO on simulated devices), beside the Megatron-style model in cost.py.

It counts what the jitted JAX step really holds (fp32 or mixed-precision params, gradient
accumulator and fresh gradients, Adam m/v, the residuals JAX saves per layer, the pipeline
executor's residual slots, one microbatch's logits) and the bytes each mesh axis moves per step.
Some per-layer counts were read off the tiny configs' buffer assignments; they say so where used.
"""

from __future__ import annotations

import functools

from meshrun.analysis.flops import moe_routed, param_counts
from meshrun.config import ModelConfig
from meshrun.pipeline import schedules
from meshrun.planner.cost import precision_of, zero_divisors


def jax_layer_residual_bytes(m: ModelConfig, b: int, s: int, t: int, *, act: float, flash: bool, moe=False) -> float:
    """Bytes JAX autodiff keeps for one layer's backward in meshrun's model (no remat), per micro-batch
    and device: counted with `jax.ad_checkpoint.print_saved_residuals` on `meshrun_models.apply_layers`
    (and seen as the [L, ...] stacked buffers in XLA's buffer assignment). More than Korthikanti's
    Megatron count, because JAX saves every elementwise intermediate it differentiates through:
    6 b·s·h (layer input, two RMSNorm products, residual mid-point), q + 4 kv (roped q, k, v and the
    fused k/v) split over TP, 6 b·s·d_ff (gate/up pair, silu/gelu intermediates and product, for
    swiglu and tanh-gelu alike), 2 b·a·s² (scores and probabilities; flash keeps the fp32 lse and out).
    MoE FFN: the 6 d_ff tensors (split over TP) for the k·cf routed copies of each token, 7 h-wide
    routed buffers (dispatch/combine einsums and both all_to_alls' inputs and outputs, replicated
    over TP: 7 under EP x TP in XLA's buffer assignment of tiny_moe_cpu, 2 on one device), plus the
    fp32 dispatch/combine tensors [b, s, E, C] with E·C = cf·k·s."""
    sb, h = s * b, m.d_model
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    core = 4.0 * b * m.n_heads * s * 2 if flash else 2.0 * act * b * m.n_heads * s * s
    attn = act * sb * (q + 4 * kv) + core
    if moe:
        routed = m.top_k * m.capacity_factor
        ffn = act * sb * routed * 6 * m.d_ff + 2 * 4.0 * sb * routed * s
        attn += 7 * act * sb * routed * h * t  # not split over TP (divided by t below)
    else:
        ffn = act * sb * 6 * m.d_ff
    return 6 * act * sb * h + (attn + ffn) / t


def saved_name_bytes(m: ModelConfig, b: int, s: int, t: int, *, act: float) -> float:
    """Bytes per layer of the activations `selective` keeps and `offload` moves to host
    (layers.SAVED_NAMES): fused qkv, attention output, mid-block residual, MLP hidden (gate+up)."""
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    ff = (2 if m.mlp == "swiglu" else 1) * m.d_ff
    resid = m.d_model / (t if m.sequence_parallel else 1)
    return act * s * b * ((q + 2 * kv + q + ff) / t + resid)


def pipeline_slots_formula(schedule: str, p: int, m: int, v: int) -> int:
    """Closed form of `_pipeline_slots` (checked against the lockstep tables in tests/test_planner.py):
    GPipe m; 1F1B min(m, 2p - 1); interleaved min(m v, (v + 1) p - 1); zb-h1 2 min(m, p) (its per-op
    timeline holds min(m, p) microbatches from F to W, each with its residuals and, after B, the
    stash W reads: modelled as a second activation set)."""
    if schedule == "gpipe":
        return m
    if schedule == "zb-h1":
        return 2 * min(m, p)
    if schedule == "interleaved" and v > 1:
        return min(m * v, (v + 1) * p - 1)
    return min(m, 2 * p - 1)


@functools.lru_cache(maxsize=256)
def _pipeline_slots(schedule: str, p: int, m: int, v: int) -> int:
    """Residual buffer slots of meshrun's lockstep executor: max in-flight (mb, chunk) pairs of any stage.
    Large tables (the planner's search over big clusters) use the closed form instead of building them."""
    from meshrun.errors import ConfigError

    if p * m * v > 256 or schedule == "zb-h1":
        return pipeline_slots_formula(schedule, p, m, v)
    try:
        lock = schedules.lockstep(schedules.build(schedule, p, m, v))
    except ConfigError:  # a layout the executor rejects (e.g. 1F1B with m < p): every micro-batch in flight
        return m * v
    return max(schedules.max_in_flight(lock, s) for s in range(p))


def predict_memory_jax(
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
    schedule: str = "1f1b",
    virtual: int = 1,
    offload_optimizer: bool = False,
    remat: str | None = None,
    sequence_parallel: bool | None = None,
    layers: float | None = None,
) -> dict[str, float]:
    """Per-device bytes of meshrun's own compiled train step (what `memory_analysis()` reports as
    argument + temp), part by part. Differs from `predict_memory` (Megatron's accounting) where JAX does:
    * SPMD: every pipeline stage holds the embedding, head and final norm (replicated over 'pipe').
    * grads: the microbatch-loop carry plus the fresh microbatch gradient (2x when m > 1).
    * optimizer: Adam m and v in the param dtype, plus one param-sized temporary of the update
      (clipped gradients / updates; params, m and v are donated and updated in place).
    * activations: `jax_layer_residual_bytes` per layer; without a pipeline one micro-batch's worth
      (the loop runs value_and_grad per micro-batch); with one, the executor's fixed residual buffer
      of `slots + 1` chunks (+1 trash slot) plus the chunk being produced or consumed; plus the
      loop-invariant causal-mask residual (f32 + bool [b, a, s, s]) of each layer of a unit.
    * logits: a micro-batch's fp32 logits, exp and masked copy plus the bool label mask, vocab-parallel.
    Remat (checked on CPU only without it, as the tiny configs run): full keeps each layer's input
    (b·s·h, /t with sequence parallelism) plus one layer's residuals while its backward runs;
    selective drops the s x s attention core. remat and sequence_parallel default to the model's;
    `layers` is the layers of a stage (default n_layers / pipe). Memory levers: remat_every=k keeps
    every k-th input and rebuilds k layers at once; remat=offload keeps the unit input on the device
    and the selective names in host memory; offload_optimizer moves Adam m, v (and fp32 master weights
    under a lower compute dtype) to host. `device` / `host` split the total (as on a GPU: XLA:CPU
    elides in-step transfers)."""
    prec = precision_of(model)
    remat = model.remat if remat is None else remat
    sp = model.sequence_parallel if sequence_parallel is None else sequence_parallel
    frac = (model.n_layers / pipe if layers is None else layers) / model.n_layers
    pb, ab = prec.param, prec.act
    s = seq_len or model.max_seq_len
    t, p, b, h = tensor, pipe, micro_batch_size, model.d_model
    v = virtual if schedule == "interleaved" else 1
    flash = model.attention_impl == "cudnn"
    counts = param_counts(model)
    n_moe = model.n_moe_layers
    norms = 2 * h * model.n_layers  # RMSNorm scales are replicated over TP
    dense = (counts["layers"] - norms) * frac / t + norms * frac + (counts["embedding"] + counts["head"]) / t + h
    experts = counts["experts"] * frac / (t * expert)
    dense_dp, expert_dp = data * expert, data
    shard, eshard = zero_divisors(zero, dense_dp), zero_divisors(zero, expert_dp)
    params = stored = pb * (dense / shard[0] + experts / eshard[0])
    grads = pb * (dense / shard[1] + experts / eshard[1])
    if microbatches > 1:  # the loop's accumulator: float32 whatever the param dtype (zero.accum_zeros)
        grads += max(pb, 4) * (dense + experts)
    opt = 2 * pb * (dense / shard[2] + experts / eshard[2]) + pb * (dense + experts)
    if zero == 3:  # all weights gathered before the loop (`train.gather_params`)
        params += pb * (dense + experts)

    moe_frac = n_moe / model.n_layers
    dense_res = jax_layer_residual_bytes(model, b, s, t, act=ab, flash=flash)
    moe_res = jax_layer_residual_bytes(model, b, s, t, act=ab, flash=flash, moe=True) if n_moe else 0.0
    per_layer = (1 - moe_frac) * dense_res + moe_frac * moe_res
    working, host_acts = 0.0, 0.0
    layer_in = ab * s * b * h / (t if sp else 1)
    if remat == "full":  # keep each unit's input; the backward rebuilds one layer at a time
        k = model.remat_every  # k > 1: one input per group of k; the backward rebuilds a whole group
        per_layer, working = layer_in / k, k * max(dense_res, moe_res)
    elif remat == "offload":  # the unit input stays; the selective names go to host memory
        per_layer, host_acts = layer_in, saved_name_bytes(model, b, s, t, act=ab)
    elif remat == "selective" and not flash:  # the s x s attention core is recomputed
        per_layer -= 2.0 * ab * b * model.n_heads * s * s / t
    stage_layers = model.n_layers * frac
    if p > 1:
        chunk = stage_layers / v
        slots = _pipeline_slots(schedule, p, microbatches, v)
        acts = (slots + 2) * chunk * per_layer + working
        host_acts *= (slots + 1) * chunk
    else:
        acts = stage_layers * per_layer + working
        host_acts *= stage_layers
    if not flash and remat == "none":
        unit = model.moe_every if model.is_moe else 1
        acts += unit * b * model.n_heads * s * s / t * (ab + 1)
    logits = s * b * model.vocab / t * (ab + 4 + 4 + 1)
    total = params + grads + opt + acts + logits + host_acts
    moments = 2 * pb * (dense / shard[2] + experts / eshard[2])
    state = stored + moments  # the step's arguments
    host_state = 0.0
    if offload_optimizer:
        host_state = moments + (stored if model.param_dtype != model.dtype else 0.0)
    host = host_state + host_acts
    return {
        "device": total - host,
        "host": host,
        "params": params,
        "grads": grads,
        "optimizer": opt,
        "activations": acts,
        "logits": logits,
        "total": total,
        "argument": state,
        "temp": total - state,
        "stage": 0,
        "params_per_device": dense + experts,
    }


# ----------------------------------------------------------------------------- collective bytes


def predict_collective_bytes(
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
    schedule: str = "1f1b",
    virtual: int = 1,
    permutes: tuple[int, int] | None = None,  # (collective-permutes, activations moved) per step
    grad_reduce_bytes: float | None = None,  # bytes per element of the DP gradient reduction (train.grad_reduce_dtype)
) -> dict[str, dict[str, float]]:
    """Per-step collective bytes on one device of meshrun's step, as `meshrun.analysis.hlo` counts them
    (result bytes; an op over several axes counts for each): {'bytes': {axis: B}, 'count': {op: n}}.
    Per forward of a layer, TP all-reduces b·s·h once after attention and once after the MLP; per
    backward, once for each of their input gradients. The vocab-parallel embedding adds one per
    forward and the head's input gradient one more (b·s·h). In MoE layers the FFN's all-reduce runs
    on the k·cf routed copies (b·s·k·cf·h; see moe_routed). EP: dispatch + combine all_to_all of the routed copies
    per forward and per backward of an MoE layer. Without a pipeline every micro-batch runs one
    forward and one backward of all layers. With one, the lockstep executor runs one chunk's forward
    on every tick that has a forward and one chunk's backward on every tick that has a backward,
    idle (masked) ticks included, and the embedding and head conditionals on every forward tick
    (`meshrun.analysis.hlo` counts collectives in conditional branches as taken). Pipe: one ppermute of
    b·s·h per sending tick and direction (`permutes`: the executor's collective-permutes and the
    activations they move per step, `TickProgram.permute_counts()`; with two stages a tick that
    sends both ways is one swap; the default, every lockstep tick both ways, is an upper bound) and
    the all-reduce of the embedding/head gradients that every stage holds. DP, once per step after the loop: ZeRO-0
    all-reduces the gradients (dense over data x expert, experts over data); ZeRO-1/2
    reduce-scatter them and all-gather the updated params; ZeRO-3 all-gathers the params before the
    loop and reduce-scatters. With a narrower `grad_reduce_bytes` the DP reductions carry that many
    bytes per element, and the embedding/head gradients are first summed over 'pipe' in float32."""
    prec = precision_of(model)
    s = seq_len or model.max_seq_len
    t, p, e, m, b, h = tensor, pipe, expert, microbatches, micro_batch_size, model.d_model
    act = prec.act * b * s * h
    v = virtual if schedule == "interleaved" and p > 1 else 1
    f_ticks = b_ticks = m  # forwards and backwards of one (chunk of a) stage per step
    if p > 1 and schedule == "zb-h1":  # per-op ticks: each tick's switch holds an F and a B branch
        f_ticks = b_ticks = len(schedules.build(schedule, p, m))  # (W's weight gradients need no collective)
        permutes = permutes or (f_ticks, f_ticks)
    elif p > 1:
        lock = schedules.lockstep(schedules.build(schedule, p, m, v))
        f_ticks = sum(any(c.fwd for c in row) for row in lock)
        b_ticks = sum(any(c.bwd for c in row) for row in lock)
        if permutes is None:
            permutes = (len(lock), len(lock))
    layers = model.n_layers / (p * v)  # one forward or backward
    moe_layers = model.n_moe_layers / (p * v)
    out: dict[str, float] = {}
    count: dict[str, float] = {}

    def add(op: str, axes: tuple[str, ...], nbytes: float, n: float = 1.0) -> None:
        if nbytes <= 0 or n <= 0:
            return
        for a in axes:
            out[a] = out.get(a, 0.0) + n * nbytes
        count[op] = count.get(op, 0.0) + n

    routed = act * moe_routed(model, e)
    if t > 1:
        per_pass = 2 * layers - moe_layers
        add("all-reduce", ("tensor",), act, f_ticks * (per_pass + 2) + b_ticks * per_pass)
        add("all-reduce", ("tensor",), routed, (f_ticks + b_ticks) * moe_layers)
    if e > 1 and moe_layers:
        add("all-to-all", ("expert",), routed, 2 * (f_ticks + b_ticks) * moe_layers)
        if model.moe_dispatch == "dropless":  # per-expert row counts first: int32 [ep, E/ep], forward only
            add("all-to-all", ("expert",), 4.0 * model.n_experts, f_ticks * moe_layers)
    counts = param_counts(model)
    pb = prec.grad
    norms = 2 * h * model.n_layers
    layer_g = pb * ((counts["layers"] - norms) / p / t + norms / p)
    edge_g = pb * ((counts["embedding"] + counts["head"]) / t + h)
    expert_g = pb * counts["experts"] / p / (t * e)
    rb = pb if grad_reduce_bytes is None else grad_reduce_bytes
    dense_axes = tuple(a for a, k in (("data", data), ("expert", e)) if k > 1)
    if p > 1:
        ops, moved = permutes
        add("collective-permute", ("pipe",), act * moved / ops, ops)
        if rb == pb:  # one all-reduce over pipe and the DP axes
            add("all-reduce", ("pipe", *dense_axes), edge_g)
            edge_g = 0.0
        else:  # summed over pipe in float32, then reduced over DP with the other gradients
            add("all-reduce", ("pipe",), edge_g)
    groups = [(layer_g + edge_g, dense_axes, data * e)]
    if expert_g:
        groups.append((expert_g, ("data",) if data > 1 else (), data))
    for nbytes, axes, dp in groups:
        if not axes:
            continue
        if zero == 0:
            add("all-reduce", axes, nbytes * rb / pb)
        else:
            add("reduce-scatter", axes, nbytes / dp * rb / pb)
            add("all-gather", axes, nbytes)
    return {"bytes": out, "count": count}
