"""Memory and collective model of meshrun's OWN compiled step (what `meshrun explain` compares with
XLA's `memory_analysis()` and HLO on simulated devices), beside the Megatron-style model in cost.py.

It counts what the jitted JAX step really holds (fp32 or mixed-precision params, gradient
accumulator and fresh gradients, Adam m/v, the residuals JAX saves per layer, the pipeline
executor's residual slots, one microbatch's logits) and the bytes each mesh axis moves per step.
Some per-layer counts were read off the tiny configs' buffer assignments; they say so where used.
"""

from __future__ import annotations

import functools

from meshrun import config
from meshrun.analysis.flops import dropless_exchange, moe_routed, param_counts
from meshrun.config import ModelConfig
from meshrun.errors import ConfigError
from meshrun.optim import registry as optimizers
from meshrun.pipeline import registry, schedules
from meshrun.planner.activations import (
    autodiff_bytes,
    context_kv_bytes,
    context_working_bytes,
    meshrun_layer_bytes,
    saved_name_bytes,
    stash_bytes,
)
from meshrun.planner.layout import Layout, precision_of, zero_divisors


def pipeline_slots_formula(schedule: str, p: int, m: int, v: int, executor: str = "lockstep") -> int:
    """Closed form of `_pipeline_slots`: the schedule's registry entry's (checked against the tables in
    tests/test_planner.py)."""
    sched = registry.get(schedule)
    return sched.slots(p, m, v, sched.executor(executor))


def stash_slots_formula(schedule: str, p: int, m: int) -> int:
    """B's stash slots on the per-op executor: the schedule's registry entry's."""
    return registry.get(schedule).stash(p, m)


@functools.lru_cache(maxsize=256)
def _pipeline_slots(schedule: str, p: int, m: int, v: int, executor: str = "lockstep") -> int:
    """Residual buffer slots of meshrun's lockstep executor: max in-flight (mb, chunk) pairs of any stage.
    Large tables (the planner's search over big clusters) and the per-op executor use the entry's closed
    form instead of building them."""
    sched = registry.get(schedule)
    if p * m * v > 256 or sched.executor(executor) == "per_op":
        return pipeline_slots_formula(schedule, p, m, v, executor)
    try:
        lock = schedules.lockstep(sched.table(p, m, v, "lockstep"))
    except ConfigError:  # a layout the executor rejects (e.g. 1F1B with m < p): every micro-batch in flight
        return m * v
    return max(schedules.max_in_flight(lock, s) for s in range(p))


def predict_memory_jax(
    model: ModelConfig,
    layout: Layout,
    *,
    seq_len: int | None = None,
    offload_optimizer: bool | str = False,
    layers: float | None = None,
    streamed: bool | None = None,
    in_flight: int = 2,
) -> dict[str, float]:
    """Per-device bytes of meshrun's own compiled train step (`memory_analysis()`'s argument + temp), part
    by part, where JAX differs from Megatron's accounting (`predict_memory`): every pipeline stage holds
    the embedding and head; optimizer state per its registry entry plus the update's float32
    temporaries; activations per `activations.meshrun_layer_bytes` (the executor's residual slots with a
    pipeline); fp32 logits; the backward's working set (`backward_working_bytes`); offload.params'
    update outputs (`_update_out_bytes`), live through the backward. The total is the
    arguments plus the larger of the backward's peak and the reduction and update's (the sums beside
    the update's temporaries). `offload_optimizer`: False/True/"host"/"nvme"; `streamed` (default: the
    nvme tier) keeps the stored params on the device. `in_flight`: the layers ZeRO-3 per layer holds
    gathered at once (the weight in use and the next layer's gather; 1 on XLA:CPU, whose collectives are
    synchronous). `device` / `host` / `nvme` split the total by where it rests between steps."""
    frac = (model.n_layers / layout.pipe if layers is None else layers) / model.n_layers
    s = seq_len or model.max_seq_len
    st = _state_bytes(model, layout, frac, in_flight)
    acts, host_acts = _activation_bytes(model, layout, s, frac)
    logits = _logits_bytes(model, layout, s)
    host_state, nvme = _offloaded_state(model, st, offload_optimizer, streamed, layout.offload_params)
    working = backward_working_bytes(model, layout, s)
    # the step peaks in a layer's backward (gathered weights, fresh gradients, activations, the backward's
    # working set; without a pipeline the logits are freed once the loss's backward is done, while a
    # pipeline's tick runs the loss beside other chunks' backward) or in the reduction and update after
    # the loop (the gradient sums beside the reduced gradient and the update's float32 temporaries),
    # not in both: the backward's buffers are freed first
    apart = min(logits, working) if layout.pipe == 1 else 0.0
    backward = st["params"] - st["stored"] + st["grads"] - st["sums"] + acts + logits + working - apart
    backward += st["update_out"]
    freed = apart + min(st["opt"] - st["moments"], backward)
    return _jax_memory_parts(st, acts, host_acts, logits, host_state, nvme, freed, working)


def backward_working_bytes(model: ModelConfig, lay: Layout, s: int) -> float:
    """The transients of a layer's backward at its peak, the MLP's input projection (gate/up pair, or
    fc1), beyond the sums, the saved activations and `_state_bytes`' fresh gradients and gathered
    layers (read off the tiny configs' buffer assignments): with the stacked weights (the step
    variants) the pair's weights sliced out of the stack and the transposed copy its input-gradient
    dot reads, and the two zero-padded cotangents of its halves; ZeRO-2 per microbatch (each layer's
    weights fetched whole) the cotangents; ZeRO-3 per layer, which gathers each weight where it is
    used, the gathered pair, its transposed copy and three cotangents (the halves' and their join),
    in place of a whole gathered layer and its fresh gradient; offload.params, the same fetch from
    host memory, as ZeRO-3 per layer."""
    pb, ab = precision_of(model).param, precision_of(model).act
    ff = (2 if model.mlp == "swiglu" else 1) * model.d_ff / lay.tensor  # the pair's width on the device
    sl = s / lay.context if lay.context > 1 else s
    pair = pb * model.d_model * ff
    cotangent = ab * lay.micro_batch_size * sl * ff
    if not layerwise(model, lay):
        return 2 * pair + 2 * cotangent
    return 2 * pair + 3 * cotangent if lay.zero == 3 else 2 * cotangent


def _offloaded_state(
    model: ModelConfig, st: dict, offload_optimizer: bool | str, streamed: bool | None, params: bool = False
) -> tuple[float, float]:
    """(host, nvme) bytes of `_state_bytes`' state that rest off the device between steps
    (`predict_memory_jax`'s offload_optimizer and streamed; `params`: offload.params, the stored
    parameters in host memory)."""
    tier = ("host" if offload_optimizer else "none") if isinstance(offload_optimizer, bool) else offload_optimizer
    streamed = tier == "nvme" if streamed is None else streamed
    host_state = nvme = 0.0
    if tier == "host":
        host_state = st["moments"] + (st["stored"] if model.param_dtype != model.dtype and not streamed else 0.0)
    elif tier == "nvme":
        nvme = st["moments"]
    if params and not (tier == "host" and model.param_dtype != model.dtype and not streamed):
        host_state += st["stored"]
    return host_state, nvme


def _jax_memory_parts(
    st: dict, acts: float, host_acts: float, logits: float, host_state: float, nvme: float, freed: float = 0.0,
    working: float = 0.0,
) -> dict:  # fmt: skip
    """`predict_memory_jax`'s dict from its parts: the total (less `freed`, bytes never live beside the
    rest), the step's arguments and temporaries, and where the total rests between steps."""
    total = st["params"] + st["grads"] + st["opt"] + st["update_out"] + acts + logits + working + host_acts - freed
    state = st["stored"] + st["moments"]  # the step's arguments
    host = host_state + host_acts
    return {
        "device": total - host - nvme,
        "host": host,
        "nvme": nvme,
        "params": st["params"],
        "grads": st["grads"],
        "optimizer": st["opt"] + st["update_out"],
        "activations": acts,
        "logits": logits,
        "working": working,
        "total": total,
        "argument": state,
        "temp": total - state,
        "stage": 0,
        "params_per_device": st["dense"] + st["experts"],
        # what the optimizer tiers move (`planner/tiers.py`): the update's view of one device
        "stored": st["stored"],
        "opt_state": st["moments"],
        "opt_elems": st["opt_elems"],
        "grads_update": st["grads_update"],
    }


def grad_final(schedule: str, p: int, m: int, v: int, executor: str) -> tuple[int, tuple[int, ...]]:
    """(ticks, per chunk the last tick adding to its gradient sums) of the timeline `executor` plays
    (p >= 2): the schedule's closed form, or read off its table (`schedules.grad_final_ticks`)."""
    sched = registry.get(schedule)
    sched.check(p, m, v)
    ex, chunks = sched.executor(executor), sched.chunks_of(v)
    if sched.grad_final is not None:
        return sched.grad_final(p, m, chunks, ex)
    table = sched.timeline(p, m, chunks, ex)
    table = schedules.lockstep(table) if ex == "lockstep" else table
    return len(table), schedules.grad_final_ticks(table, chunks)


@functools.lru_cache(maxsize=256)
def _cuts(schedule: str, p: int, m: int, v: int, executor: str) -> tuple[int, int, float]:
    try:
        ticks, final = grad_final(schedule, p, m, v, executor)
    except ConfigError:  # a layout the schedule rejects (reported by the pipeline's rules): nothing overlapped
        return 0, 0, 0.0
    cuts = schedules.grad_cuts(final, ticks)
    if not cuts:
        return ticks, ticks, 0.0
    return ticks, cuts[0][0], sum(len(cs) for _, cs in cuts) / len(final)


def overlap_cut(lay: Layout) -> tuple[int, int, float]:
    """pipeline.overlap_grad_reduce of `lay`: (ticks of the timeline its executor plays, the first grad
    cut, the share of the stage's layers whose gradients are final there or at a later cut before the
    end); (0, 0, 0.0) when off or nothing is final early (`schedules.grad_cuts`)."""
    if not lay.overlap_grad_reduce or lay.pipe == 1 or lay.chunks == 1:
        return 0, 0, 0.0
    return _cuts(lay.schedule, lay.pipe, lay.microbatches, lay.virtual, lay.run_executor)


_STATE_MEMO: list = [None, {}]  # the model `_state_bytes` keeps results for, and its dict


def _state_bytes(model: ModelConfig, lay: Layout, frac: float, in_flight: int = 2) -> dict[str, float]:
    """`_state_bytes_of`, kept per (frozen) model by the layout fields it reads (`precision_of`'s,
    `layerwise`'s and `overlap_cut`'s included): the search asks it for layouts differing elsewhere."""
    if _STATE_MEMO[0] is not model:
        _STATE_MEMO[:] = [model, {}]
    key = (frac, in_flight, lay.tensor, lay.pipe, lay.data, lay.zero_group, lay.expert, lay.context, lay.virtual,
           lay.microbatches, lay.zero, lay.schedule, lay.executor, lay.optimizer, lay.state_dtype,
           lay.grad_reduce_dtype, lay.offload_params, lay.overlap_grad_reduce, lay.zero3_gather,
           lay.zero2_reduce)  # fmt: skip
    out = _STATE_MEMO[1].get(key)
    if out is None:
        out = _STATE_MEMO[1][key] = _state_bytes_of(model, lay, frac, in_flight)
    return dict(out)


def _state_bytes_of(model: ModelConfig, lay: Layout, frac: float, in_flight: int = 2) -> dict[str, float]:
    """Params (as stored, and as the step holds them; `in_flight` gathered layers per layer),
    grads (+ the accumulator), optimizer (moments + the update temporary) on one device holding
    `frac` of the layers; the element counts too."""
    pb = precision_of(model).param
    h = model.d_model
    counts = param_counts(model)
    norms = 2 * h * model.n_layers  # RMSNorm scales are replicated over TP
    t = lay.tensor
    dense = (counts["layers"] - norms) * frac / t + norms * frac + (counts["embedding"] + counts["head"]) / t + h
    experts = counts["experts"] * frac / (t * lay.expert)
    shard = zero_divisors(lay.zero, lay.zero_data * lay.expert * lay.context)  # HSDP: over the group only
    eshard = zero_divisors(lay.zero, lay.zero_data * lay.context)
    nrm = norms * frac + h  # norm scales: no `embed` dimension, so ZeRO leaves them whole (parallel/sharding.py)
    params = stored = pb * ((dense - nrm) / shard[0] + nrm + experts / eshard[0])
    grads, sums = _grad_bytes(model, lay, frac, counts, dense, experts, shard, eshard)
    # the optimizer state (the registry entry's moments + the fp32 master under bf16 params) and its
    # update's float32 temporaries, all where ZeRO puts the optimizer state (the update is computed
    # on the shard the moments live on); hidden-layer weight matrices apart from the other parameters
    prec, temps = precision_of(model, layout=lay), optimizers.get(lay.optimizer).update_temps
    edges = (counts["embedding"] + counts["head"]) / t
    rest = nrm + edges / shard[2]
    matrices = (dense - nrm - edges) / shard[2] + experts / eshard[2]
    moments = prec.opt * matrices + prec.opt_rest * rest
    opt = moments + 4 * (temps * matrices + rest)
    if lay.zero == 3 and layerwise(model, lay):  # FSDP: the embedding and head gathered before the loop, the
        # layers inside it: the weight in use (`backward_working_bytes`) and (in_flight 2) the next layer's
        # gather in flight
        norms_all = 2 * h * model.n_layers
        one_layer = (
            (counts["layers"] - norms_all) / t + norms_all + counts["experts"] / (t * lay.expert)
        ) / model.n_layers
        params += pb * ((counts["embedding"] + counts["head"]) / t + h + (in_flight - 1) * one_layer)
    elif lay.zero == 3:  # all weights gathered before the loop (`ZeroShardings.gather`)
        params += pb * (dense + experts)
    # the update's elements (the optimizer's ZeRO shard) and its gradients there: the reduced float32
    # sums with micro-batches (in the param dtype without), one shard from ZeRO-1 on (reduce-scatter)
    opt_elems = (dense - nrm) / shard[2] + nrm + experts / eshard[2]
    grads_update = (max(pb, 4) if lay.microbatches > 1 else pb) * opt_elems
    return {"params": params, "stored": stored, "grads": grads, "sums": sums, "opt": opt, "moments": moments,
            "dense": dense, "experts": experts, "opt_elems": opt_elems, "grads_update": grads_update,
            "update_out": _update_out_bytes(model, lay, counts, shard, eshard)}  # fmt: skip


def _update_out_bytes(model: ModelConfig, lay: Layout, counts: dict, shard, eshard) -> float:
    """offload.params: the stacked outputs of the streamed update's scan over the layers
    (`offload/layer_update.py`), each layer's new params and optimizer moments, ZeRO shards of every
    layer of the model (whole over the layer axis, under a pipeline too). XLA allocates them before
    the step's loops, so they are live through the backward; 0 for the in-memory update."""
    if not lay.offload_params:
        return 0.0
    prec, pb = precision_of(model, layout=lay), precision_of(model).param
    norms = 2 * model.d_model * model.n_layers
    experts = counts["experts"] / (lay.tensor * lay.expert) / eshard[2]
    matrices = (counts["layers"] - norms) / lay.tensor / shard[2] + experts
    return (pb + prec.opt) * matrices + (pb + prec.opt_rest) * norms


def _grad_bytes(
    model: ModelConfig, lay: Layout, frac: float, counts: dict, dense: float, experts: float, shard, eshard
) -> tuple[float, float]:
    """(all, the sums) of the gradient bytes on one device: the fresh gradients, the float32 sums (the
    accumulator; without micro-batches the whole gradient itself), and under overlap_grad_reduce the
    chunks' reduced sums and a drain tick's rows. The sums are what the reduction after the loop reads."""
    pb = precision_of(model).param
    h = model.d_model
    norms = 2 * h * model.n_layers
    t = lay.tensor
    # Fresh gradients are whole on every device: with the gradient reduced once per step (reduce-scatter
    # from ZeRO-1 on) after the loop, ZeRO-2 holds what ZeRO-1 holds; per layer (`layerwise`) each
    # layer's gradient is reduce-scattered into 1/dp float32 sums as the backward makes it.
    fresh, sums = 0.0, pb * (dense + experts)
    one_layer = ((counts["layers"] - norms) / t + norms + counts["experts"] / (t * lay.expert)) / model.n_layers
    other = (counts["embedding"] + counts["head"]) / t + h
    per_layer = layerwise(model, lay)
    if lay.microbatches > 1 or per_layer:
        # the backward's layer loop adds each layer's weight gradients into the float32 sums in place
        # (`bw_split.vjp_into` / `run_w`; per layer: the fetch's backward hands each layer's reduced
        # gradient to them): fresh gradients are one layer's and the embedding/head's (ZeRO-3 per layer:
        # none beside the gathered weights at its peak, `backward_working_bytes`)
        fresh = 0.0 if per_layer and lay.zero == 3 and not lay.offload_params else pb * (other + one_layer)
    if per_layer:  # ZeRO-2 per microbatch / ZeRO-3 per layer: the layers' float32 sums are 1/DP shards (norm
        # scales whole); the embedding's and head's too (`ZeroShardings.rest_fetch`), the final norm's whole
        layer_w = dense - other
        n = (layer_w - norms * frac) / shard[1] + norms * frac + experts / eshard[1]
        sums = 4 * (n + (other - h) / shard[1] + h)
    elif lay.microbatches > 1:  # the loop's accumulator: float32 whatever the param dtype (zero.accum_zeros)
        sums = max(pb, 4) * (dense + experts)
    if overlap_cut(lay)[2]:
        sums += max(pb, 4) * _overlap_sum_elems(model, lay, frac, counts, dense, experts, shard, eshard)
    return fresh + sums, sums


def _overlap_sum_elems(
    model: ModelConfig, lay: Layout, frac: float, counts: dict, dense: float, experts: float, shard, eshard
) -> float:
    """Gradient elements on one device that overlap_grad_reduce adds: the chunks' reduced sums (ZeRO >= 1:
    their shards; the final chunks' filled in the loop, `StageRun.drain`) beside the array they are joined
    into (`executor._join_chunks`; norm scales are never scattered), and the rows a drain tick reduces."""
    t, h = lay.tensor, model.d_model
    norms = 2 * h * model.n_layers
    reduced = (counts["layers"] - norms) * frac / t / shard[2] + norms * frac + experts / eshard[2]
    ticks, cut, _ = overlap_cut(lay)
    lc = -(-model.n_layers // (lay.pipe * lay.chunks))
    rows = (
        schedules.drain(lc, ticks - cut)[0]
        * (dense + experts - (counts["embedding"] + counts["head"]) / t - h)
        / (lc * lay.chunks)
    )
    return reduced + rows


def layerwise(model: ModelConfig, lay: Layout) -> bool:
    """Whether the step gathers and reduces the layers inside the layer scan: ZeRO-3 per layer (FSDP,
    `train.zero3_gather`) or ZeRO-2 per microbatch (`train.zero2_reduce`), with auto resolved by the
    step's own rules (`config.zero3_per_layer`, `config.zero2_per_microbatch`) on this layout's bytes."""
    if lay.zero not in (2, 3) or lay.offload_params:
        return lay.offload_params
    split = lay.tensor * lay.pipe
    counts = param_counts(model)
    if lay.zero == 3:
        refused = config.zero3_layer_refusals(lay.overlap_grad_reduce)
        gathered = precision_of(model).param * counts["total"] / split
        return config.zero3_per_layer(lay.zero3_gather, 3, False, gathered, bool(refused))
    refused = config.zero2_layer_refusals(lay.overlap_grad_reduce)
    return config.zero2_per_microbatch(lay.zero2_reduce, 2, 4 * (counts["layers"] + counts["experts"]) / split,
                                       bool(refused))  # fmt: skip


def _activation_bytes(model: ModelConfig, lay: Layout, s: int, frac: float) -> tuple[float, float]:
    """(device, host) bytes of the activations kept for the backward on one device: per layer by remat
    mode, times the layers of a stage (pipelined: the executor's residual slots of a chunk)."""
    per_layer, working, host_acts, layer_in = _layer_activation_parts(model, lay, s)
    stage_layers = model.n_layers * frac
    if lay.pipe > 1:
        acts, held = _pipelined_activations(model, lay, s, stage_layers / lay.chunks, (per_layer, working, layer_in))
        host_acts *= held
    else:
        acts = stage_layers * per_layer + working
        host_acts *= stage_layers
    return acts + _moe_mask_bytes(model, lay, s), host_acts


def _moe_mask_bytes(model: ModelConfig, lay: Layout, s: int) -> float:
    """The causal mask, a residual of the unnamed MoE unit without flash attention and remat: (s/c) x s
    under context parallelism, none under ring attention."""
    c, kind = lay.context, lay.context_kind
    if model.attention_impl == "cudnn" or lay.remat != "none" or not model.is_moe or (c > 1 and kind == "ring"):
        return 0.0
    ab, b, sl = precision_of(model).act, lay.micro_batch_size, s / c if c > 1 else s
    return model.moe_every * b * model.n_heads * sl * s / lay.tensor * (ab + 1)


def _layer_activation_parts(model: ModelConfig, lay: Layout, s: int) -> tuple[float, float, float, float]:
    """Per layer by remat mode: (device bytes kept for the backward, the backward's working bytes (once
    per device), host bytes kept (remat=offload), the bytes of the layer's input)."""
    ab = precision_of(model).act
    t, b, h = lay.tensor, lay.micro_batch_size, model.d_model
    remat, sp = lay.remat, lay.sequence_parallel
    flash = model.attention_impl == "cudnn"
    moe_frac = model.n_moe_layers / model.n_layers
    c, kind = lay.context, lay.context_kind
    cp = dict(context=c, kind=kind)
    kw = dict(sp=sp, act=ab, flash=flash, **cp)
    res = lambda mode: (
        (1 - moe_frac) * meshrun_layer_bytes(model, b, s, t, remat=mode, **kw)
        + (moe_frac * meshrun_layer_bytes(model, b, s, t, remat=mode, moe=True, **kw) if model.n_moe_layers else 0.0)
    )
    per_layer = res("selective" if remat == "selective" else "none")
    working = context_working_bytes(model, b, s, t, c, kind, remat=remat, act=ab, flash=flash)
    host_acts = 0.0
    sl = s / c if c > 1 else s  # the local tokens of each sequence
    layer_in = ab * sl * b * h / (t if sp else 1)
    if remat == "full":  # keep each unit's input; the backward rebuilds one unit (a group of k) at a time
        k = model.remat_every
        rebuilt = autodiff_bytes(model, b, s, t, act=ab, flash=flash, moe=model.n_moe_layers > 0, **cp)
        per_layer, working = layer_in / k, k * rebuilt + working
    elif remat == "offload":  # the unit input stays; the selective names go to host memory
        per_layer, host_acts = layer_in, saved_name_bytes(model, b, sl, t, act=ab)
    return per_layer, working, host_acts, layer_in


def _pipelined_activations(model: ModelConfig, lay: Layout, s: int, chunk: float, parts) -> tuple[float, float]:
    """(device bytes, layers' worth of host activations) of a pipeline stage's activations: the
    executor's residual slots of a chunk of `chunk` layers. parts: `_layer_activation_parts`' per-layer
    bytes, working bytes and layer input bytes."""
    per_layer, working, layer_in = parts
    ab, t, b, p, v = precision_of(model).act, lay.tensor, lay.micro_batch_size, lay.pipe, lay.chunks
    sl = s / lay.context if lay.context > 1 else s  # the local tokens of each sequence
    executor = lay.run_executor
    slots = _pipeline_slots(lay.schedule, p, lay.microbatches, v, executor)
    # + the chunk in flight: a lockstep tick that runs a forward and a backward (1F1B, interleaved)
    # holds one being produced and one being consumed; GPipe's phases and the per-op ticks one
    both = lay.sched.lockstep_fb and executor == "lockstep"
    acts = (slots + 1 + both) * chunk * per_layer + working
    if executor == "per_op":  # each slot's output gradient waits for its W; B's stash until W
        stash = stash_bytes(model, b, sl, t, act=ab, sp=lay.sequence_parallel, remat=lay.remat)
        n_stash = stash_slots_formula(lay.schedule, p, lay.microbatches)
        acts += slots * layer_in + n_stash * chunk * stash
    return acts, (slots + 1) * chunk


def _logits_bytes(model: ModelConfig, lay: Layout, s: int) -> float:
    """A micro-batch's fp32 logits, exp and masked copy plus the bool label mask, vocab-parallel, of
    the local s/c tokens."""
    ab = precision_of(model).act
    s = s / lay.context if lay.context > 1 else s
    return s * lay.micro_batch_size * model.vocab / lay.tensor * (ab + 4 + 4 + 1)


# ----------------------------------------------------------------------------- collective bytes


def predict_collective_bytes(
    model: ModelConfig,
    layout: Layout,
    *,
    seq_len: int | None = None,
    permutes: tuple[int, int] | None = None,  # (collective-permutes, activations moved) per step
) -> dict[str, dict[str, float]]:
    """Per-step collective bytes on one device of meshrun's step, as `meshrun.analysis.hlo` counts them
    (result bytes; an op over several axes counts for each): {'bytes': {axis: B}, 'count': {op: n}}.
    TP: per layer b·s·h all-reduced after attention and after the MLP forward, and for each input
    gradient backward, plus the vocab-parallel embedding and head (MoE FFNs: the k·cf routed copies).
    EP: dispatch + combine all_to_all of the routed copies per forward and backward of an MoE layer.
    Pipelined, the lockstep executor runs a chunk's forward (backward) on every tick that has one,
    masked ticks included. Pipe: one ppermute of b·s·h per sending tick and direction (`permutes`:
    `TickProgram.permute_counts()`; default every lockstep tick both ways, an upper bound) and the
    embedding/head gradients' all-reduce. DP, once per step after the loop: ZeRO-0 all-reduces,
    ZeRO-1/2 reduce-scatter and all-gather the params, ZeRO-3 gathers before the loop; gradients in
    float32 or `layout.grad_reduce_dtype`. Context (c > 1; not yet checked against compiled HLO):
    per layer the all-gather kind gathers K/V forward and reduce-scatters dK/dV backward; the ring
    moves c - 1 K/V blocks forward and c - 1 K/V plus dK/dV blocks backward by collective-permute."""
    prec = precision_of(model)
    s = seq_len or model.max_seq_len
    c = layout.context
    act = prec.act * layout.micro_batch_size * (s / c if c > 1 else s) * model.d_model
    f_ticks, b_ticks, permutes = _pass_ticks(layout, permutes)
    tally = _Tally()
    _model_parallel(tally, model, layout, act, f_ticks, b_ticks)
    _context_parallel(tally, model, layout, s, f_ticks, b_ticks)
    _gradient_sync(tally, model, layout, act, permutes, (f_ticks, b_ticks))
    if layout.zero >= 2 and layerwise(model, layout):
        _layer_sync(tally, model, layout, f_ticks, b_ticks)
    return {"bytes": tally.out, "count": tally.count}


class _Tally:
    """Bytes per axis and ops per kind, as `meshrun.analysis.hlo` counts them."""

    def __init__(self):
        self.out: dict[str, float] = {}
        self.count: dict[str, float] = {}

    def add(self, op: str, axes: tuple[str, ...], nbytes: float, n: float = 1.0) -> None:
        if nbytes <= 0 or n <= 0:
            return
        for a in axes:
            self.out[a] = self.out.get(a, 0.0) + n * nbytes
        self.count[op] = self.count.get(op, 0.0) + n


def pipe_payload(act: float, lay: Layout) -> float:
    """Bytes one device sends per activation (or gradient) over 'pipe', of a b s h activation of `act`
    bytes: the residual stream as the device holds it, its 1/t sequence slice under sequence
    parallelism (tests/test_explain.py checks the compiled collective-permutes' operands)."""
    return act / lay.tensor if lay.sequence_parallel and lay.tensor > 1 else act


def _pass_ticks(lay: Layout, permutes):
    """(ticks that run a forward, ticks that run a backward, (permutes, activations moved)) of one
    (chunk of a) stage per step; without a pipeline every micro-batch is one forward and one backward."""
    p, m, v, sched = lay.pipe, lay.microbatches, lay.chunks, lay.sched
    f_ticks = b_ticks = m
    if p > 1 and "lockstep" not in sched.executors:  # per-op ticks: each holds an F and a B branch
        f_ticks = b_ticks = len(sched.table(p, m, v))  # (W's weight gradients need no collective)
        permutes = permutes or (f_ticks, f_ticks)
    elif p > 1:
        lock = schedules.lockstep(sched.table(p, m, v, "lockstep"))
        f_ticks = sum(any(c.fwd for c in row) for row in lock)
        b_ticks = sum(any(c.bwd for c in row) for row in lock)
        if permutes is None:
            permutes = (len(lock), len(lock))
    return f_ticks, b_ticks, permutes


def _model_parallel(tally: _Tally, model: ModelConfig, lay: Layout, act: float, f_ticks, b_ticks) -> None:
    """TP all-reduces per forward/backward of a layer (+ embedding and head), EP all-to-alls of MoE layers."""
    t, p, e = lay.tensor, lay.pipe, lay.expert
    v = lay.chunks
    layers = model.n_layers / (p * v)  # one forward or backward
    moe_layers = model.n_moe_layers / (p * v)
    routed = act * moe_routed(model, e)
    if t > 1:
        per_pass = 2 * layers - moe_layers
        tally.add("all-reduce", ("tensor",), act, f_ticks * (per_pass + 2) + b_ticks * per_pass)
        tally.add("all-reduce", ("tensor",), routed, (f_ticks + b_ticks) * moe_layers)
    if e > 1 and moe_layers and model.moe_dispatch == "dropless":
        # all-gather the group's tokens (float32, with gates and ids), reduce-scatter the gated sums;
        # backward: each transposed (reduce-scatter of the gathered rows' gradients, all-gather of dy)
        gathered, packed = dropless_exchange(model, e, precision_of(model).act)
        tally.add("all-gather", ("expert",), act * gathered, f_ticks * moe_layers)
        tally.add("reduce-scatter", ("expert",), act, f_ticks * moe_layers)
        tally.add("reduce-scatter", ("expert",), act * packed, b_ticks * moe_layers)
        tally.add("all-gather", ("expert",), act * e, b_ticks * moe_layers)
    elif e > 1 and moe_layers:
        tally.add("all-to-all", ("expert",), routed, 2 * (f_ticks + b_ticks) * moe_layers)


def _context_parallel(tally: _Tally, model: ModelConfig, lay: Layout, s: int, f_ticks, b_ticks) -> None:
    """The K/V exchange of every layer over 'context' (see `predict_collective_bytes`)."""
    c = lay.context
    if c <= 1:
        return
    p = lay.pipe
    v = lay.chunks
    layers = model.n_layers / (p * v)
    gathered = context_kv_bytes(model, lay.micro_batch_size, s, lay.tensor, c, act=precision_of(model).act)
    if lay.context_kind == "ring":
        block = gathered / c
        act = precision_of(model).act
        # K/V blocks: c - 1 in the forward, c - 1 in the backward ring (a recomputed forward ring sends
        # the same blocks to the same ranks: XLA shares those permutes, measured at every remat);
        # dK/dV (float32) travel with them and take one more step home
        tally.add("collective-permute", ("context",), block, (c - 1) * layers * (f_ticks + b_ticks))
        tally.add("collective-permute", ("context",), block * 4 / act, c * layers * b_ticks)
    else:
        # the gathered K/V is in no remat policy's saved set: the backward always gathers it again
        tally.add("all-gather", ("context",), gathered, layers * (f_ticks + b_ticks))
        tally.add("reduce-scatter", ("context",), gathered / c, layers * b_ticks)


def _gradient_sync(tally: _Tally, model: ModelConfig, lay: Layout, act: float, permutes, ticks) -> None:
    """Pipe: activation permutes and the embedding/head gradient all-reduce (per layer: of their 1/DP
    sums, `_edge_sync`; `ticks`: a stage's forward and backward ticks); DP: the once-per-step
    gradient reduction (ZeRO-0 all-reduce, else reduce-scatter + all-gather of the params). The
    gradients are summed in float32 (`zero.accum_zeros`, 16-bit params too) and reduced in
    `lay.grad_reduce_dtype`; counts below are elements. HSDP (`lay.zero_group`): the reduce-scatter and
    all-gather run inside the ZeRO group, and the scattered shards are all-reduced across the replicas."""
    t, p, e, data, h, c = lay.tensor, lay.pipe, lay.expert, lay.zero_data, model.d_model, lay.context
    counts = param_counts(model)
    prec = precision_of(model, layout=lay)
    ab, rb, pb = 4, prec.reduce, prec.param  # float32 sums, the reduction's dtype, the params'
    norms = 2 * h * model.n_layers
    layer_n = (counts["layers"] - norms) / p / t + norms / p
    edge_n = (counts["embedding"] + counts["head"]) / t + h
    expert_n = counts["experts"] / p / (t * e)
    dense_axes = tuple(a for a, k in (("data", data), ("expert", e), ("context", c)) if k > 1)
    across = ("replica",) if lay.replicas > 1 else ()  # HSDP: the ZeRO group's shards all-reduced across it
    per_layer = lay.zero >= 2 and layerwise(model, lay)
    if p > 1:
        ops, moved = permutes
        tally.add("collective-permute", ("pipe",), pipe_payload(act, lay) * moved / ops, ops)
        if per_layer:  # the 1/DP sums reduced in the ticks (`_edge_sync`), the final norm's whole
            tally.add("all-reduce", ("pipe",), ab * ((edge_n - h) / (data * e * c) + h))
        elif rb == ab:  # one all-reduce over pipe and the DP axes
            tally.add("all-reduce", ("pipe", *across, *dense_axes), ab * edge_n)
            edge_n = 0.0
        else:  # summed over pipe in float32, then reduced over DP with the other gradients
            tally.add("all-reduce", ("pipe",), ab * edge_n)
    if per_layer:  # layers reduced in the scan (`_layer_sync`); ZeRO-2 gathers them
        if lay.zero == 2 and data * e * c > 1:
            tally.add("all-gather", dense_axes, pb * layer_n)
        layer_n, expert_n = 0.0, 0.0
        if data * e * c > 1:  # the other entries' too, every microbatch
            _edge_sync(tally, model, lay, (rb, pb), dense_axes, across, ticks)
            edge_n = 0.0
    groups = [(layer_n + edge_n, dense_axes, data * e * c)]
    if expert_n:
        groups.append((expert_n, tuple(a for a, k in (("data", data), ("context", c)) if k > 1), data * c))
    for n, axes, dp in groups:
        if lay.zero == 0 or dp == 1:  # whole gradients (HSDP with one-rank groups: all-reduced across them)
            if axes or across:
                tally.add("all-reduce", (*across, *axes), rb * n)
        else:
            tally.add("reduce-scatter", axes, rb * n / dp)
            tally.add("all-gather", axes, pb * n)
            if across:
                tally.add("all-reduce", across, rb * n / dp)


def _edge_sync(tally: _Tally, model: ModelConfig, lay: Layout, dtypes: tuple[float, float], axes: tuple,
               across: tuple, ticks: tuple) -> None:  # fmt: skip
    """Per layer: the embedding's and head's gradients reduce-scattered every microbatch in the
    reduction's dtype (`dtypes`: its bytes and the params'; the shards all-reduced across HSDP
    replicas), the final norm's all-reduced; their params all-gathered once per step (ZeRO-2 after
    the update, ZeRO-3 before the loop). Without a pipeline one backward a microbatch reduces them;
    in the pipeline the head's vjp (with the norm's; a tied matrix: the embedding) on each tick that
    runs a forward, the embedding's on each that runs a backward (`ticks`), as the tick loop's conds."""
    rb, pb = dtypes
    t, h, dp = lay.tensor, model.d_model, lay.zero_data * lay.expert * lay.context
    counts = param_counts(model)
    emb, head = counts["embedding"] / t, counts["head"] / t
    parts = [(head or emb, ticks[0]), (emb, ticks[1])] if lay.pipe > 1 else [(emb + head, ticks[0])]
    for n, k in parts:
        tally.add("reduce-scatter", axes, rb * n / dp, k)
        if across:
            tally.add("all-reduce", across, rb * n / dp, k)
    tally.add("all-reduce", (*across, *axes), rb * h, ticks[0])
    tally.add("all-gather", axes, pb * (emb + head + h))


def _layer_sync(tally: _Tally, model: ModelConfig, lay: Layout, f_ticks: float, b_ticks: float) -> None:
    """ZeRO-3 per layer / ZeRO-2 per microbatch (`layer_fetch`): each layer's weight matrices, as the
    device's tensor shard holds them, all-gathered in its forward and again in its backward (ZeRO-3),
    its gradient reduce-scattered there (result: 1/DP of it), its norm scales' gradient (ZeRO leaves
    them whole) all-reduced; in `lay.grad_reduce_dtype`."""
    t, e, data, c, h = lay.tensor, lay.expert, lay.zero_data, lay.context, model.d_model
    counts, prec = param_counts(model), precision_of(model, layout=lay)
    per_tick = model.n_layers / (lay.pipe * lay.chunks)  # layers of one forward or backward
    norms = 2 * h
    dense = ((counts["layers"] - norms * model.n_layers) / t, ("data", "expert", "context"), data * e * c)
    experts = (counts["experts"] / (t * e), ("data", "context"), data * c)
    for n, names, dp in (dense, experts):
        axes = tuple(a for a in names if {"data": data, "expert": e, "context": c}[a] > 1)
        if dp <= 1 or n <= 0:
            continue
        one = n / model.n_layers
        if lay.zero == 3:
            tally.add("all-gather", axes, prec.param * one, per_tick * (f_ticks + b_ticks))
        tally.add("reduce-scatter", axes, prec.reduce * one / dp, per_tick * b_ticks)
    dense_axes = tuple(a for a, k in (("data", data), ("expert", e), ("context", c)) if k > 1)
    if dense_axes:
        tally.add("all-reduce", dense_axes, prec.reduce * norms, per_tick * b_ticks)
