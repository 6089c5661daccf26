"""The start-up block a run prints before compiling: model, mesh, batch, schedule, layer split, FLOPs
and the planner's predicted memory per device.

`meshrun train` hands `startup_lines` to `meshrun.train.loop.run`, which prints it once the run's
checks passed.
"""

from __future__ import annotations

import math
from typing import Any

import jax

from meshrun.analysis.flops import param_counts


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
        src = "host memory, train.offload_params" if t.offload_params else f"train.zero3_gather={t.zero3_gather}"
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
    """The start-up block printed before compiling: model, mesh, batch, schedule, layer split, FLOPs and
    the planner's predicted memory per device."""
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
        f"mesh      {shape} = {mesh.size} devices on {d['hosts']} host(s){racks}; ZeRO {t.zero}{zero_variant(plan)}",
        f"batch     {t.global_batch} sequences x {t.seq_len} tokens = {t.global_batch * t.seq_len:,} tokens/step",
    ]
    if plan.split is not None:
        sched = pc.schedule + (f" (virtual {pc.virtual})" if pc.virtual > 1 else "")
        lines.append(f"pipeline  {pc.microbatches} microbatches, {sched}, bubble {100 * plan.bubble:.1f}%")
        costed = f", costed on {plan.balance_on[0]} ({plan.balance_on[1]})" if plan.balance_on else ""
        lines.append(f"layers    per stage {list(plan.split.counts)} (pipeline.balance={pc.balance}{costed})")
    elif pc.microbatches > 1:
        lines.append(f"accum     {pc.microbatches} microbatches per step (no pipeline)")
    if plan.context > 1:
        how = "zigzag chunks, K/V around a ring" if m.context_parallel == "ring" else "K/V all-gathered"
        lines.append(f"context   {plan.context} devices per sequence, {t.seq_len // plan.context} tokens each ({how})")
    lines += flops_lines(plan.family, m, t.global_batch * t.seq_len, t.seq_len)
    return [*lines, _memory_line(cfg, plan)]


def _memory_line(cfg: Any, plan: Any) -> str:
    """The planner's predicted memory per device (`planner.step_model.predict_memory_jax` on
    `plan.layout`), and where it rests when part of it is off the device."""
    from meshrun.planner import predict_memory_jax
    from meshrun.train.plan import streams_update

    m, t = cfg.model, cfg.train
    if not m.predictable:
        return f"memory    not predicted: the planner's formulas are for transformer layers ({plan.family.name})"
    try:
        mem = predict_memory_jax(m, plan.layout, seq_len=t.seq_len, offload_optimizer=t.offload_optimizer,
                                 streamed=streams_update(plan.cfg))  # fmt: skip
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
