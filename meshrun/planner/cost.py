"""Per-device memory of a layout, per pipeline stage and framework, with the GPU runtime overheads
(the step time is in `timing.py`).

Letters: B global batch (sequences), b micro-batch size, s sequence length, h d_model, L layers,
V vocab, a heads, t/p/d/e/c tensor/pipe/data/expert/context degrees, m micro-batches, v virtual stages.
Sources: Narayanan et al. 2021 (Megatron PTD-P, FLOPs eq. 3, schedules), Korthikanti et al. 2022
(activation memory, sequence parallelism, selective recompute), Rajbhandari et al. 2020 (ZeRO).
"""

from __future__ import annotations

from dataclasses import replace

from meshrun.analysis.flops import layer_params, param_counts
from meshrun.config import ModelConfig
from meshrun.pipeline import registry
from meshrun.planner.activations import context_kv_bytes as context_kv_bytes
from meshrun.planner.activations import context_working_bytes
from meshrun.planner.activations import layer_activation_bytes as layer_activation_bytes
from meshrun.planner.constants import COMM_BUFFER_BYTES as COMM_BUFFER_BYTES
from meshrun.planner.constants import CUDA_CONTEXT_BYTES as CUDA_CONTEXT_BYTES
from meshrun.planner.constants import FRAGMENTATION as FRAGMENTATION
from meshrun.planner.layout import DTYPE_BYTES as DTYPE_BYTES
from meshrun.planner.layout import Layout as Layout
from meshrun.planner.layout import Precision as Precision
from meshrun.planner.layout import layout_of as layout_of
from meshrun.planner.layout import model_layout as model_layout
from meshrun.planner.layout import precision_of, zero_divisors
from meshrun.planner.step_model import predict_memory_jax

MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "logits", "overheads", "total")

# Runtime memory besides the model's tensors, charged on GPU plans (`overhead_bytes`): CUDA_CONTEXT_BYTES,
# COMM_BUFFER_BYTES (NCCL communicator buffers), FRAGMENTATION of the transient bytes (constants.py).


# ----------------------------------------------------------------------------- memory


def inflight_microbatches(schedule: str, p: int, m: int, v: int, stage: int) -> float:
    """Micro-batches whose activations stage `stage` holds at its peak, in units of its layers: the
    schedule's registry entry's `held` (1F1B: p - stage; interleaved, Korthikanti 2022 4.2.3: the
    first stage holds p (1 + (p-1)/(p v)) micro-batches' worth)."""
    if p == 1:
        return 1.0
    return registry.get(schedule).held(p, m, v, stage)


def _layer_activations(
    model: ModelConfig, b: int, s: int, t: int, *, remat: str, sp: bool, act: float, dropout: bool, flash: bool,
    context: int = 1, kind: str = "allgather", fp8_inputs: bool = False,
) -> tuple[float, float]:  # fmt: skip
    """(bytes each layer keeps per micro-batch, bytes of the one layer being recomputed). Full remat
    keeps each layer's input and rebuilds one layer at a time in the backward. Context parallelism:
    the local s/c tokens, plus the K/V exchange's working set (`context_working_bytes`)."""
    kw = dict(sp=sp, act=act, dropout=dropout, flash=flash, context=context, kind=kind, fp8_inputs=fp8_inputs)
    n_moe = model.n_moe_layers
    moe_frac = n_moe / model.n_layers
    dense_act = layer_activation_bytes(model, b, s, t, remat=remat, **kw)
    moe_act = layer_activation_bytes(model, b, s, t, remat=remat, moe=True, **kw) if n_moe else 0.0
    per_layer = (1 - moe_frac) * dense_act + moe_frac * moe_act
    cp_working = context_working_bytes(model, b, s, t, context, kind, remat=remat, act=act, flash=flash)
    if remat != "full":
        return per_layer, cp_working
    kept = act * s / context * b * model.d_model / (t if sp else 1)
    working = layer_activation_bytes(model, b, s, t, remat="none", **kw)
    if n_moe:
        working = max(working, layer_activation_bytes(model, b, s, t, remat="none", moe=True, **kw))
    return kept, working + cp_working


def _stage_params(counts: dict[str, int], h: int, p: int, t: int, expert: int, stage: int, frac: float) -> tuple:
    """(dense, expert) parameters on one device of pipeline stage `stage` holding `frac` of the layers,
    before ZeRO sharding. The last stage holds the output head (a copy of the tied embedding when it
    lives on another stage) and the final norm."""
    dense = counts["layers"] * frac / t
    if stage == 0:
        dense += counts["embedding"] / t
    if stage == p - 1:
        dense += (counts["head"] or (counts["embedding"] if p > 1 else 0)) / t + h
    return dense, counts["experts"] * frac / (t * expert)


def overhead_bytes(transient: float, axes: dict[str, int]) -> dict[str, float]:
    """Runtime memory of a GPU process besides its tensors: CUDA context, one NCCL communicator per
    mesh axis of size > 1, allocator fragmentation of the transient (activation, logit) bytes."""
    return {
        "context": CUDA_CONTEXT_BYTES,
        "comm_buffers": COMM_BUFFER_BYTES * sum(1 for n in axes.values() if n > 1),
        "fragmentation": FRAGMENTATION * transient,
    }


def stage_names(p: int) -> dict[str, int]:
    """The stages a breakdown shows: first, middle, last (fewer when the pipeline is shorter)."""
    return (
        {"first": 0, "middle": p // 2, "last": p - 1} if p > 2 else ({"first": 0, "last": 1} if p == 2 else {"all": 0})
    )


def predict_memory(
    model: ModelConfig,
    layout: Layout,
    *,
    seq_len: int | None = None,
    framework: str = "meshrun",
    dropout: bool = False,
    flash: bool | None = None,
    split: tuple[int, ...] | None = None,
    overheads: bool = False,
) -> dict:
    """Per-device bytes on the fullest pipeline stage: params, grads, optimizer, activations, logits,
    overheads (when `overheads`: GPU runtime, see `overhead_bytes`), total; `stages` holds the same
    parts for the first, middle and last stage. framework='megatron' is Megatron-LM's accounting
    (Korthikanti 2022 activations, 1F1B in-flight micro-batches, fp32 grad buffers); 'meshrun' is
    meshrun's own compiled step (`step_model.predict_memory_jax`). remat and sequence_parallel are the
    layout's (`model_layout`: the model's unless given); flash defaults to attention_impl == 'cudnn';
    `split` is the layers per stage."""
    p, tensor = layout.pipe, layout.tensor
    split = split or (model.n_layers / p,) * p
    sp = layout.sequence_parallel and tensor > 1
    s = seq_len or model.max_seq_len
    stages = {}
    spmd = _spmd_stage(model, layout, s, sp, split) if framework == "meshrun" else None
    for name, stage in stage_names(p).items():
        if spmd is not None:
            part = dict(spmd)
        else:
            part = _megatron_stage(model, layout, stage, split[stage], seq_len=s, sp=sp, dropout=dropout, flash=flash)
        part["overheads"] = 0.0
        if overheads:
            _add_overheads(part, layout)
        part["stage"], part["layers"] = stage, split[stage]
        stages[name] = part
    best = dict(max(stages.values(), key=lambda d: d["total"]))
    best["stages"] = stages
    return best


def _add_overheads(part: dict, layout: Layout) -> None:
    """Adds the GPU runtime's overheads (`overhead_bytes`) to a stage's parts and total, in place."""
    axes = {
        "tensor": layout.tensor,
        "pipe": layout.pipe,
        "data": layout.data,
        "expert": layout.expert,
        "context": layout.context,
    }
    over = overhead_bytes(part["activations"] + part["logits"], axes)
    part |= {f"overhead_{k}": v for k, v in over.items()}
    part["overheads"] = sum(over.values())
    part["total"] += part["overheads"]


def _spmd_stage(model: ModelConfig, layout: Layout, s: int, sp: bool, split: tuple) -> dict:
    """meshrun's parts of every stage (`predict_memory_jax`): SPMD, every stage holds buffers of the
    largest stage's shape (and the embedding and head). sp: sequence parallelism in effect."""
    lay = layout if sp == layout.sequence_parallel else replace(layout, sequence_parallel=sp)
    return predict_memory_jax(model, lay, seq_len=s, layers=max(split))


def _megatron_stage(
    model: ModelConfig, layout: Layout, stage: int, layers: float, *, seq_len: int, sp: bool, dropout: bool,
    flash: bool | None,
) -> dict[str, float]:  # fmt: skip
    """Megatron-LM's bytes on one device of `stage` (holding `layers` layers) of `layout` (its remat;
    `sp`: sequence parallelism in effect). Context parallelism (Megatron-Core's cp): each device holds
    s/c tokens of every sequence; dense weights' gradients and ZeRO (distributed optimizer) shards
    span data x expert x context (dp x cp)."""
    prec = precision_of(model, "megatron", layout)
    ab = prec.act
    fp8 = model.fp8 != "none"  # Transformer Engine keeps the fp8 GEMMs' inputs in fp8
    flash = model.attention_impl == "cudnn" if flash is None else flash
    s, t, p, b, h = seq_len, layout.tensor, layout.pipe, layout.micro_batch_size, model.d_model
    context = layout.context
    kept, working = _layer_activations(
        model, b, s, t, remat=layout.remat, sp=sp, act=ab, dropout=dropout, flash=flash, context=context,
        kind=layout.context_kind, fp8_inputs=fp8,
    )  # fmt: skip
    s = s / context if context > 1 else s  # per-token tensors below: the local tokens
    params, grads, opt, per_device = _megatron_stage_state(model, layout, stage, layers, prec)
    n_in = inflight_microbatches(layout.schedule, p, layout.microbatches, layout.virtual, stage)
    acts = layers * kept * n_in + working
    if stage == 0:  # embedding output (+ dropout mask) of each in-flight micro-batch
        acts += n_in * s * b * h * (ab + (1 if dropout else 0)) / (t if sp else 1)
    logits = 0.0
    if stage == p - 1:  # logits in the compute dtype + fp32 log-softmax for the loss, vocab-parallel
        logits = s * b * model.vocab / t * (ab + 4) + ab * s * b * h
    return {
        "params": params,
        "grads": grads,
        "optimizer": opt,
        "activations": acts,
        "logits": logits,
        "total": params + grads + opt + acts + logits,
        "params_per_device": per_device,
    }


def _megatron_stage_state(model: ModelConfig, layout: Layout, stage: int, layers: float, prec) -> tuple[float, ...]:
    """(params, grads, optimizer) bytes on one device of `stage` (holding `layers` layers) under
    Megatron-LM's accounting (`prec`: its precisions), and the parameters the device holds. ZeRO
    (distributed optimizer) shards span data x expert x context for dense weights, data x context for
    experts; ZeRO-3 adds the gathered weights of the layer in use and the prefetched next one."""
    t, zero, expert, context = layout.tensor, layout.zero, layout.expert, layout.context
    dense_div = zero_divisors(zero, layout.data * expert * context)
    expert_div = zero_divisors(zero, layout.data * context)
    counts = param_counts(model)
    dense, experts = _stage_params(counts, model.d_model, layout.pipe, t, expert, stage, layers / model.n_layers)
    params, grads, opt = (
        nbytes * (dense / dd + experts / ed)
        for nbytes, dd, ed in zip((prec.param, prec.grad, prec.opt), dense_div, expert_div)
    )
    if zero == 3:  # gathered weights of the layer in use and the prefetched next one
        params += 2 * prec.param * (layer_params(model, model.is_moe) / t)
    return params, grads, opt, dense + experts
