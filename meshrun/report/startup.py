"""The start-up block a run prints before compiling: model, mesh, ZeRO, batch, schedule, layer split,
dtypes and fp8, optimizer and its schedule, FLOPs, the planner's predicted memory per device, each
offload tier and where it rests, and the checkpoint policy: everything that decides the run.

`meshrun train` hands `startup_lines` to `meshrun.train.loop.run`, which prints it once the run's
checks passed.
"""

from __future__ import annotations

import math
from typing import Any

import jax

from meshrun.analysis.flops import param_counts
from meshrun.parallel.sharding import GRAD_AXES, REPLICA


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def flops_lines(family: Any, m: Any, tokens: int, seq_len: int) -> list[str]:
    """The start-up block's FLOPs line for a family that is not costed by the transformer formula: its
    own count, or why TFLOP/s and MFU are not reported. Transformer families print none."""
    if family.flops_per_token is not None:
        per_token = family.model_flops(m, 1, seq_len) / seq_len
        why = f"{family.name}'s flops_per_token"
        return [f"flops     {per_token * tokens / 1e9:.3g} GFLOP per step ({per_token:,.0f} per token, {why})"]
    if not m.predictable:
        return [f"flops     n/a: family {family.name} declares no flops (no TFLOP/s, MFU n/a)"]
    return []


def zero_variant(plan: Any) -> str:
    """' (...)': how ZeRO-2 / ZeRO-3 run in this step (train.zero2_reduce / train.zero3_gather resolved)."""
    t = plan.cfg.train
    if getattr(plan, "zero3_gather", None) == "layer":
        src = "from host memory, offload.params" if plan.cfg.offload.params else f"train.zero3_gather={t.zero3_gather}"
        return f" (weights gathered per layer inside the layer scan, gradients reduce-scattered per layer; {src})"
    if getattr(plan, "zero3_gather", None) == "step":
        return f" (weights gathered once per step; train.zero3_gather={t.zero3_gather})"
    if getattr(plan, "zero2_reduce", None) == "microbatch":
        how = "gradients reduce-scattered per layer and microbatch into sharded sums"
        return f" ({how}; train.zero2_reduce={t.zero2_reduce})"
    if getattr(plan, "zero2_reduce", None) == "step":
        return f" (gradient sums whole, reduce-scattered once per step; train.zero2_reduce={t.zero2_reduce})"
    return ""


def startup_lines(cfg: Any, mesh: Any, plan: Any) -> list[str]:
    """The start-up block printed before compiling (see the module docstring); one line per topic."""
    from meshrun.runtime.mesh import describe_dict

    m, t, pc = cfg.model, cfg.train, cfg.pipeline
    if plan.abstract_params is not None:  # the family's own parameters
        n = sum(math.prod(a.shape) for a in jax.tree.leaves(plan.abstract_params))
    else:  # a mesh given as a shape only (explain's prediction): the transformer formula
        n = param_counts(m)["total"]
    d = describe_dict(mesh)
    shape = " x ".join(f"{a}{d['shape'][a]}" for a in d["axes"] if d["shape"][a] > 1) or "1 device"
    racks = f" in {d['racks']} racks" if d["racks"] > 1 else ""
    experts = f", {m.n_experts} experts, top-{m.top_k}" if m.n_experts else ""
    lines = [
        f"model     {plan.family.name}: {n / 1e6:.2f}M params ({m.n_layers} layers, d_model {m.d_model}{experts})",
        f"mesh      {shape} = {mesh.size} devices on {d['hosts']} host(s){racks}",
        _zero_line(cfg, plan),
        f"batch     {t.global_batch} sequences x {t.seq_len} tokens = {t.global_batch * t.seq_len:,} tokens/step",
    ]
    if plan.split is not None:
        sched = pc.schedule + (f" (virtual {pc.virtual})" if pc.virtual > 1 else "")
        lines.append(f"pipeline  {pc.microbatches} microbatches, {sched}, bubble {100 * plan.bubble:.1f}%")
        costed = f", costed on {plan.balance_on[0]} ({plan.balance_on[1]})" if plan.balance_on else ""
        lines.append(f"layers    {_layers_per_device(plan.split)} (pipeline.balance={pc.balance}{costed})")
    elif pc.microbatches > 1:
        lines.append(f"accum     {pc.microbatches} microbatches per step (no pipeline)")
    if plan.context > 1:
        how = "zigzag chunks, K/V around a ring" if m.context_parallel == "ring" else "K/V all-gathered"
        lines.append(f"context   {plan.context} devices per sequence, {t.seq_len // plan.context} tokens each ({how})")
    lines += [_dtypes_line(cfg), *_fp8_lines(cfg), _optimizer_line(cfg)]
    lines += flops_lines(plan.family, m, t.global_batch * t.seq_len, t.seq_len)
    lines += [_memory_line(cfg, plan), *_offload_lines(cfg, plan), _saves_line(cfg)]
    return lines


def _zero_line(cfg: Any, plan: Any) -> str:
    """ZeRO: the stage, what it shards and over how many data-parallel ranks (the gradient group); with HSDP
    the group it is sharded over and the replicas of it."""
    stage = cfg.train.zero
    ranks = math.prod(plan.mesh_shape.get(a, 1) for a in GRAD_AXES)
    if stage == 0:
        whole = "params, gradients and optimizer state whole"
        return f"zero      stage 0: {whole} on each of {ranks} data-parallel rank(s)"
    what = ("optimizer state", "optimizer state and gradients", "params, gradients and optimizer state")[stage - 1]
    if (replicas := plan.mesh_shape.get(REPLICA, 1)) > 1:  # HSDP (mesh.zero_group)
        hybrid = f"; hybrid: sharded over {ranks // replicas}, replicated over {replicas} (mesh.zero_group)"
        return f"zero      stage {stage}: {what} sharded over groups of the {ranks} data-parallel ranks{hybrid}" \
            f"{zero_variant(plan)}"  # fmt: skip
    return f"zero      stage {stage}: {what} sharded over {ranks} data-parallel rank(s){zero_variant(plan)}"


def _layers_per_device(split: Any) -> str:
    """Layers per pipeline device; with 2+ chunks per device (interleaved, zb-v) each device's chunks too."""
    chunks = [[split.counts[split.k(c, s)] for c in range(split.v)] for s in range(split.p)]
    per = f"per device {[sum(c) for c in chunks]}"
    return per if split.v == 1 else per + f" in chunks {' '.join('+'.join(map(str, c)) for c in chunks)}"


def _dtypes_line(cfg: Any) -> str:
    """Compute, parameter and gradient-reduction dtypes."""
    m = cfg.model
    master = " (float32 master)" if m.param_dtype != "float32" else ""
    reduce = cfg.train.grad_reduce_dtype
    return f"dtypes    compute {m.dtype}, params {m.param_dtype}{master}, gradient reduction {reduce}"


def _fp8_lines(cfg: Any) -> list[str]:
    """The fp8 recipe, when the family has fp8 GEMMs and it is on."""
    m = cfg.model
    fp8 = m.fp8
    if fp8 == "none":
        return []
    how = f", amax history {m.fp8_amax_history} steps" if fp8 == "delayed" else ""
    ends = f"; first and last layers in {m.dtype}" if m.fp8_first_last_bf16 else ""
    return [f"fp8       {fp8} scaling{how}{ends}"]


def _optimizer_line(cfg: Any) -> str:
    """The optimizer, its learning-rate schedule and the dtype of its state."""
    from meshrun.optim.optimizer import decay_horizon

    o = cfg.optimizer
    end = max(decay_horizon(cfg), o.warmup_steps + 1)  # as lr_schedule: the cosine ends after the warmup
    clip = f", grad clip {o.grad_clip:g}" if o.grad_clip else ""
    return (f"optimizer {o.name}, lr {o.lr:.2e}, warmup {o.warmup_steps} steps, cosine to {o.lr * o.min_lr_ratio:.2e} "
            f"at step {end}; weight decay {o.weight_decay:g}{clip}; state {o.state_dtype}")  # fmt: skip


def _offload_lines(cfg: Any, plan: Any) -> list[str]:
    """Each offload tier in use and where it rests (none: everything on the devices), as the step's plan
    places it (`plan.offload`)."""
    o, m = cfg.offload, cfg.model
    parts = []
    if o.optimizer != "none":
        what = "optimizer state" + (" + float32 master" if m.param_dtype != "float32" else "")
        where = f"NVMe files in {o.dir}" if o.optimizer == "nvme" else "host memory"
        if plan.offload.streams:
            on = {"in_place": "in place", "host": "on the host"}.get(plan.offload.update_on, "on the device")
            how = f"update streamed through {o.budget_mb:g} MiB of host buffers, {on}"
        else:
            how = "whole-shard update on the device"
        parts.append(f"{what} in {where} ({how})")
    if o.params:
        grads = f"NVMe files in {o.dir}" if o.grads == "nvme" else "host memory"
        parts.append(f"params in host memory, fetched layer by layer; their gradients in {grads}")
    if m.remat == "offload":
        parts.append("saved activations in host memory (model.remat=offload)")
    return [f"offload   {'; '.join(parts)}"] if parts else []


def _saves_line(cfg: Any) -> str:
    """The checkpoint policy: how often, how many kept, in the background or not, the local tier."""
    c = cfg.checkpoint
    when = f"every {c.every} steps and at the end" if c.every else "at the end"
    line = f"saves     {when}, newest {c.keep} kept, {'async' if c.async_save else 'blocking'}"
    if c.local_every:
        line += f"; local every {c.local_every} steps, newest {c.local_keep} kept"
    return line + ("" if c.resume else "; checkpoint.resume=false")


def _memory_line(cfg: Any, plan: Any) -> str:
    """The planner's predicted memory per device (`planner.step_model.predict_memory_jax` on
    `plan.layout`), and where it rests when part of it is off the device."""
    from meshrun.planner import predict_memory_jax

    m, t = cfg.model, cfg.train
    if not m.predictable:
        return f"memory    not predicted: the planner's formulas are for transformer layers ({plan.family.name})"
    try:
        mem = predict_memory_jax(m, plan.layout, seq_len=t.seq_len, offload_optimizer=cfg.offload.optimizer,
                                 streamed=plan.offload.streams)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - the block is informative; a planner gap must not stop a run
        return f"memory    no prediction ({type(e).__name__})"
    where = ""
    if mem["host"] or mem["nvme"]:  # where it rests: the state off the device
        where = f"; device {_gib(mem['device'])}, host memory {_gib(mem['host'])}" + (
            f", NVMe files {_gib(mem['nvme'])}" if mem["nvme"] else "")  # fmt: skip
    return (
        f"memory    predicted {_gib(mem['total'])} per device (params {_gib(mem['params'])}, optimizer "
        f"{_gib(mem['optimizer'])}, activations {_gib(mem['activations'])}){where}"
    )
