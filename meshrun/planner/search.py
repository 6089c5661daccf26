"""Rules, evaluation of one layout and search over layouts (the calibration is in `calibrate.py`).

Each rule is reported as a string with the number behind it. Hard rules (divisibility, memory, TP
across nodes) remove a layout from the search; soft ones (bubble from m < 4p, DP sync longer than
compute) are reported but the layout still ranks by time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from meshrun.analysis import flops
from meshrun.config import ModelConfig, zero2_layer_refusals, zero3_layer_refusals
from meshrun.errors import ConfigError
from meshrun.pipeline import registry
from meshrun.planner import cost, offload, timing
from meshrun.planner.cost import MEMORY_PARTS, Layout
from meshrun.planner.hardware import GB, Cluster
from meshrun.planner.kernels import Calibration
from meshrun.planner.layout import CONTEXT_KINDS, replaced

# remat modes the layout search tries (not offload: a memory lever, `offload.propose`)
SEARCHED_REMATS = ("none", "selective", "full")
MAX_MICRO_BATCH = 16
# Context parallelism is searched down to this many tokens of each sequence per device: below it the
# per-device attention blocks are too small to hide a ring step behind and the all-gathered K/V is a
# large share of the attention's input (Megatron-Core and Llama 3 use CP for sequences of 16K-128K+,
# with 8K+ tokens per rank). So `--seq-len` < 2 x 4096 never gets a CP layout.
MIN_CONTEXT_TOKENS = 4096
# Context degrees tried: powers of two up to this (Llama 3 405B: CP 16 at 128K tokens).
MAX_CONTEXT = 32


@dataclass
class Result:
    layout: Layout
    memory: dict
    time: dict
    tflops_per_device: float
    mfu: float
    violations: list[str] = field(default_factory=list)
    hard: bool = False  # a hard rule is broken: the layout cannot run as given

    @property
    def step_time(self) -> float:
        return self.time["total"]

    def to_dict(self) -> dict:
        out = asdict(self.layout)
        out.update(
            memory_gb=round(self.memory["total"] / GB, 3),
            host_memory_gb=round(self.memory.get("host", 0.0) / GB, 3),
            step_time_s=round(self.step_time, 4),
            tflops_per_device=round(self.tflops_per_device, 2),
            mfu=round(self.mfu, 4),
            bubble_fraction=round(self.time["bubble_fraction"], 4),
            violations=list(self.violations),
            memory_parts_gb={k: round(self.memory[k] / GB, 3) for k in MEMORY_PARTS},
            memory_stage=self.memory["stage"],
            memory_stages_gb={
                name: {k: round(part[k] / GB, 3) for k in MEMORY_PARTS} for name, part in self.memory["stages"].items()
            },
            layers_per_stage=list(self.time["split"]),
            params_per_device=int(self.memory["params_per_device"]),
            time_parts_s={
                k: round(v, 4) for k, v in self.time.items() if isinstance(v, float) and k != "bubble_fraction"
            },
        )
        return out


def context_violations(layout: Layout, seq_len: int | None) -> list[str]:
    """A context degree or kind the step cannot run: the sequence must split into c equal shards
    (all-gather) or 2c equal chunks (ring's zigzag layout); the kind must be one of CONTEXT_KINDS."""
    c, kind, out = layout.context, layout.context_kind, []
    if kind not in CONTEXT_KINDS:
        out.append(f"context_kind={kind!r} is not one of {list(CONTEXT_KINDS)}")
    need = 2 * c if kind == "ring" else c
    if c > 1 and seq_len is not None and seq_len % need:
        what = "2 x context (ring's zigzag chunks)" if kind == "ring" else "context"
        out.append(f"seq_len={seq_len} is not divisible by {what}={need}")
    return out


def _model_violations(model: ModelConfig, layout: Layout) -> list[str]:
    """Degrees the model's shape cannot split over: heads, kv heads and d_ff over tensor, layers over
    the pipeline's chunks, experts over expert, and context parallelism without context attention."""
    t, p, e, v = layout.tensor, layout.pipe, layout.expert, layout.virtual
    out = []
    if layout.context > 1 and not model.context_attention:
        out.append(f"context={layout.context}: model.family={model.family} has no context-parallel attention")
    kv = model.n_heads if flops.is_mla(model) else model.n_kv_heads  # MLA: every head has its k and v
    for name, n in (("n_heads", model.n_heads), ("n_kv_heads", kv), ("d_ff", model.d_ff)):
        if n % t:
            out.append(f"model.{name}={n} is not divisible by tensor={t}")
    if model.n_layers < p * v:
        out.append(f"model.n_layers={model.n_layers} < pipe*virtual={p * v}: a stage chunk would have no layer")
    if e > 1 and not model.is_moe:
        out.append(f"expert={e} > 1 on a dense model (n_experts=0)")
    elif model.is_moe and model.n_experts % e:
        out.append(f"model.n_experts={model.n_experts} is not divisible by expert={e}")
    return out


def structural_violations(
    model: ModelConfig, layout: Layout, cluster: Cluster, global_batch: int, seq_len: int | None = None
) -> list[str]:
    """Degrees that don't divide heads, kv heads, layers, experts, devices, the global batch or (context
    parallelism) the sequence."""
    t, p, e, v = layout.tensor, layout.pipe, layout.expert, layout.virtual
    out = context_violations(layout, seq_len) + _model_violations(model, layout)
    if layout.n_devices != cluster.n_devices:
        what = "tensor*pipe*data*expert" + ("*context" if layout.context > 1 else "")
        out.append(f"{what} = {layout.n_devices} != {cluster.n_devices} devices of {cluster}")
    if layout.global_batch != global_batch:
        out.append(
            f"global batch {global_batch} != micro_batch_size*microbatches*data*expert = "
            f"{layout.micro_batch_size}*{layout.microbatches}*{layout.data}*{e} = {layout.global_batch}"
        )
    if v > 1 and p == 1:
        out.append(f"virtual={v} needs pipe > 1")
    if p > 1 and layout.context > 1 and layout.context_kind == "ring" and layout.run_executor != "lockstep":
        out.append(f"context={layout.context} ring in a pipeline runs on the lockstep executor only "
                   f"({layout.schedule} on {layout.run_executor}; train refuses it)")  # fmt: skip
    if layout.sched.m_multiple_of_p and layout.microbatches % p:
        out.append(f"microbatches={layout.microbatches} is not divisible by pipe={p} ({layout.sched.title} needs it)")
    if t > cluster.gpus_per_node:
        g = cluster.gpu
        out.append(
            f"tensor={t} > {cluster.gpus_per_node} GPUs per node: tensor all-reduces would cross nodes at "
            f"{g.nic_bw / GB:.0f} GB/s per GPU instead of NVLink {g.nvlink_uni_bw / GB:.0f} GB/s"
        )
    return out


def evaluate(
    model: ModelConfig,
    layout: Layout,
    cluster: Cluster,
    global_batch: int,
    seq_len: int,
    *,
    calibration: Calibration | None = None,
    framework: str = "meshrun",
    dropout: float = 0.0,
) -> Result:
    """Memory, time, throughput and rule violations of one layout under `framework` (meshrun | megatron)."""
    hard = structural_violations(model, layout, cluster, global_batch, seq_len)
    tm = timing.predict_time(
        model, layout, cluster, seq_len, calibration=calibration, framework=framework, dropout=dropout
    )
    mem = cost.predict_memory(
        model, layout, seq_len=seq_len, framework=framework, dropout=dropout > 0, split=tm["split"], overheads=True
    )
    hard += _memory_violations(mem, layout, cluster)
    soft = _soft_violations(layout, cluster, tm)
    levers = layout.offload_params or layout.offload_optimizer != "none"
    if levers and framework != "meshrun":
        hard.append("offload_params / offload_optimizer: costed for meshrun's step only (--framework meshrun)")
    speed = _throughput(model, layout, cluster, global_batch, seq_len, tm["total"])
    r = Result(layout=layout, memory=mem, time=tm, **speed, violations=hard + soft, hard=bool(hard))
    if not levers or framework != "meshrun":
        return r
    out = offload.apply(r, model, cluster, seq_len)  # the levers' memory and time; their misfits are hard
    return replace(out, hard=out.hard or any(not v.startswith("memory ") for v in hard))


def _memory_violations(mem: dict, layout: Layout, cluster: Cluster) -> list[str]:
    """`evaluate`'s memory violation: the fullest stage's total over the device's usable memory."""
    if not mem["total"] > cluster.usable_memory:
        return []
    where = f" on stage {mem['stage']}" if layout.pipe > 1 else ""
    return [f"memory {mem['total'] / GB:.1f} GB{where} > {cluster.usable_memory / GB:.1f} GB of {cluster.gpu.name}"]


def _throughput(
    model: ModelConfig, layout: Layout, cluster: Cluster, global_batch: int, seq_len: int, step: float
) -> dict[str, float]:
    """`Result`'s tflops_per_device (hardware FLOPs, recompute included) and mfu (model FLOPs over the
    cluster's peak) of a step of `step` seconds."""
    n = cluster.n_devices
    hw = flops.hardware_flops(model, global_batch, seq_len, layout.remat)
    mf = flops.model_flops(model, global_batch, seq_len)
    return {"tflops_per_device": hw / (step * n) / 1e12, "mfu": mf / (step * cluster.gpu.peak_flops * n)}


def _soft_violations(layout: Layout, cluster: Cluster, tm: dict) -> list[str]:
    """What makes a layout slow without making it invalid: a deep bubble, a data-parallel sync longer
    than compute, a context exchange over the inter-node network."""
    soft = []
    m, p = layout.microbatches, layout.pipe
    v = layout.virtual
    if p > 1 and v * m < 4 * p:  # interleaving divides the bubble by v (Narayanan 2021, 2.2.2)
        what = f"microbatches={m}" + (f" x virtual={v}" if v > 1 else "")
        soft.append(f"{what} < 4*pipe={4 * p}: pipeline bubble {tm['bubble_fraction']:.1%}")
    if tm["dp_sync_full"] > tm["compute"]:
        soft.append(f"data-parallel gradient sync {tm['dp_sync_full']:.3g} s > compute {tm['compute']:.3g} s")
    tc = layout.tensor * layout.context
    if layout.context > 1 and tc > cluster.gpus_per_node:
        soft.append(
            f"tensor*context={tc} > {cluster.gpus_per_node} GPUs per node: the K/V exchange "
            f"({tm['context_comm']:.3g} s exposed) runs over the inter-node network"
        )
    return soft


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def context_degrees(
    cluster: Cluster, t: int, seq_len: int | None, max_context: int = MAX_CONTEXT
) -> list[tuple[int, str]]:
    """(context degree, kind) pairs to try beside tensor=t: (1, allgather) always; with `seq_len`, powers of
    two c >= 2 (up to `max_context` and the devices left beside t) leaving at least MIN_CONTEXT_TOKENS per
    device, each kind whose split divides the sequence (ring: 2c chunks). t x c beyond a node is allowed:
    costed on the inter-node link and reported (`evaluate`'s soft rule)."""
    out = [(1, "allgather")]
    if seq_len is None:
        return out
    n = cluster.n_devices
    c = 2
    while c <= max_context and t * c <= n and seq_len // c >= MIN_CONTEXT_TOKENS:
        for kind in CONTEXT_KINDS:
            if seq_len % (2 * c if kind == "ring" else c) == 0:
                out.append((c, kind))
        c *= 2
    return out


def candidates(
    model: ModelConfig, cluster: Cluster, global_batch: int, seq_len: int | None = None, max_context: int = MAX_CONTEXT,
    framework: str = "meshrun",
):  # fmt: skip
    """Layouts that use every device, keep TP inside a node and divide heads, layers, experts, batch.
    With `seq_len`, context-parallel layouts too (`context_degrees`); without it, c = 1 only. The
    schedules are the registry's searched ones (`framework='megatron'`: those Megatron-LM runs)."""
    n, gpn, L = cluster.n_devices, cluster.gpus_per_node, model.n_layers
    # Any pipe degree that divides the devices works: layers that do not divide split unevenly.
    kv = model.n_heads if flops.is_mla(model) else model.n_kv_heads
    tensors = [t for t in _divisors(gpn) if model.n_heads % t == 0 and kv % t == 0]
    tensors = [t for t in tensors if model.d_ff % t == 0]
    experts = _divisors(model.n_experts) if model.is_moe else [1]
    max_context = max_context if model.context_attention else 1  # what `train` accepts for the family
    for t in tensors:
        for e in experts:
            for c, kind in context_degrees(cluster, t, seq_len, max_context):
                yield from _layouts(model, n, L, global_batch, t, e, c, kind, framework, gpn)


def _layouts(model: ModelConfig, n: int, L: int, global_batch: int, t: int, e: int, c: int, kind: str,
             framework: str = "meshrun", gpn: int = 0):  # fmt: skip
    """The layouts of `candidates` with tensor t, expert e and context c (kind); under meshrun, each ZeRO-3
    layout also as HSDP with one node's data ranks as its ZeRO group (`gpn` GPUs per node), where the
    data-parallel degree spans more than a node (FSDP's weight gathers then stay on NVLink)."""
    node = gpn // (t * e * c) if framework == "meshrun" and gpn % (t * e * c) == 0 else 0
    if n % (t * e * c):
        return
    for p in (k for k in _divisors(n // (t * e * c)) if k <= L):
        d = n // (t * e * c * p)
        per_rank, rem = divmod(global_batch, d * e)
        if rem:
            continue
        for b in (k for k in _divisors(per_rank) if k <= MAX_MICRO_BATCH):
            m = per_rank // b
            for name, v in _schedules(p, m, L, framework):
                for zero in range(4) if d * e * c > 1 else (0,):
                    hsdp = zero == 3 and 1 < node < d and d % node == 0
                    for group in (0, node) if hsdp else (0,):
                        for remat in SEARCHED_REMATS:
                            for sp in (False, True) if t > 1 else (False,):
                                yield Layout(t, p, d, e, v, m, b, zero, remat, sp, name, context=c,
                                             context_kind=kind, zero_group=group)  # fmt: skip


def _schedules(p: int, m: int, L: int, framework: str = "meshrun"):
    """(schedule, virtual) pairs the search tries on p stages with m microbatches of L layers: each
    searched registry entry with its own chunk count, or (a free count) 2, 4 or 8 chunks per stage
    where the layers and the microbatches divide evenly. A schedule of its own several chunks per stage
    needs a pipeline, a layer per chunk (an uneven split is fine) and the microbatches its rules ask for."""
    for name, sched in registry.SCHEDULES.items():
        if not sched.searched or (framework == "megatron" and not sched.megatron):
            continue
        if sched.chunks is not None:
            if sched.chunks == 1 or (p > 1 and L >= p * sched.chunks and not (sched.m_at_least_p and m < p)):
                yield name, sched.chunks
            continue
        for v in (2, 4, 8):
            if p > 1 and L % (p * v) == 0 and not (sched.m_multiple_of_p and m % p):
                yield name, v


def search(
    model: ModelConfig,
    cluster: Cluster,
    global_batch: int,
    seq_len: int,
    *,
    top: int = 5,
    name: str = "model",
    max_context: int = MAX_CONTEXT,
    optimizer: str = "adamw",
    state_dtype: str = "float32",
    grad_reduce_dtype: str = "float32",
    **kw,
) -> list[Result]:
    """The `top` fastest layouts that fit in memory, best first (kw: `evaluate`'s framework, dropout,
    calibration). Context parallelism up to `max_context` (1: none) where the sequence is long enough
    (`context_degrees`). Every layout runs `optimizer` with its moments in `state_dtype` and reduces
    its gradients over data parallelism in `grad_reduce_dtype`. Raises ConfigError when none fits."""
    opt = dict(optimizer=optimizer, state_dtype=state_dtype, grad_reduce_dtype=grad_reduce_dtype)
    bases: list[tuple[Layout, Result | None]] = []  # each candidate, with its own result when costed and hard
    fitting, smallest, n_seen = _cost_candidates(model, cluster, global_batch, seq_len, max_context, opt, kw, bases)
    if not n_seen:
        raise ConfigError(
            "--global-batch",
            global_batch,
            f"use a multiple of the data-parallel degrees possible on {cluster.n_devices} devices "
            f"(e.g. {cluster.n_devices})",
            "no layout divides the global batch",
        )
    if not fitting:
        return _offloaded_or_refused(model, cluster, global_batch, seq_len, top, name, bases, kw, smallest)
    fitting.sort(key=lambda r: (r.step_time, r.memory["total"]))
    return fitting[:top]


def _cost_candidates(
    model: ModelConfig, cluster: Cluster, global_batch: int, seq_len: int, max_context: int, opt: dict, kw: dict,
    bases: list,
) -> tuple[list[Result], Result | None, int]:  # fmt: skip
    """Every candidate layout, run with `opt`'s optimizer settings, costed on its best executor:
    (the results that fit, the smallest of those that do not (None if none), how many layouts).
    Appends each candidate to `bases` with `evaluate`'s result of it as it is, if costed and hard."""
    fitting, smallest, n_seen = [], None, 0
    for layout in candidates(model, cluster, global_batch, seq_len, max_context, kw.get("framework", "meshrun")):
        layout = _with(layout, **opt)
        n_seen += 1
        memo = {}
        r = _best_executor(model, layout, cluster, global_batch, seq_len, kw, memo)
        bases.append((layout, memo.get("base")))
        if r.hard:
            if smallest is None or r.memory["total"] < smallest.memory["total"]:
                smallest = r
            continue
        fitting.append(r)
    return fitting, smallest, n_seen


def _offloaded_or_refused(
    model,
    cluster: Cluster,
    global_batch: int,
    seq_len: int,
    top: int,
    name: str,
    bases: list,
    kw,
    smallest: Result,
) -> list[Result]:
    """Where no layout fits on the devices alone: the offloading proposals, else a ConfigError that
    names the smallest layout's memory and what would make it fit."""
    fw = kw.get("framework", "meshrun")
    memory_only = _memory_only(model, cluster, global_batch, seq_len, bases, kw)
    offloaded = offload.propose(memory_only, model, cluster, seq_len, top, fw)
    if offloaded:
        return offloaded
    p = smallest.layout
    why = offload.blocker(memory_only, model, cluster, seq_len) if memory_only and fw == "meshrun" else ""
    raise ConfigError(
        "--model",
        name,
        f"it needs at least {smallest.memory['total'] / GB:.1f} GB per device (tensor={p.tensor} pipe={p.pipe} "
        f"data={p.data}{_context_text(p)} zero={p.zero} remat={p.remat}) but {cluster.gpu.name} offers "
        f"{cluster.usable_memory / GB:.1f} GB usable; " + (why or "use more GPUs or GPUs with more memory"),
        f"fits on no layout of {cluster}",
    )


def _with(lay: Layout, **fields) -> Layout:
    """`replace` where a field changes, else `lay` itself (the search builds tens of thousands)."""
    return lay if all(getattr(lay, k) == v for k, v in fields.items()) else replaced(lay, **fields)


def _best_executor(model, layout: Layout, cluster: Cluster, global_batch: int, seq_len: int, kw,
                   memo: dict | None = None) -> Result:  # fmt: skip
    """The layout on whichever of its variants (`_variants`: executor, overlaps, ZeRO-2/3 variant) fits
    and is faster, ties to the smaller. `memo`: gets "base", the result of `layout` itself where it is
    one of the variants and does not fit."""
    best = None
    for fields in _variants(model, layout, kw.get("framework", "meshrun")):
        lay = _with(layout, **fields)
        r = evaluate(model, lay, cluster, global_batch, seq_len, **kw)
        if memo is not None and r.hard and (lay is layout or lay == layout):
            memo["base"] = r
        if best is None or _better(r, best):
            best = r
    return best


def _variants(model, layout: Layout, framework: str):
    """The fields `_best_executor` tries on `layout`: each executor of its schedule (lockstep 1F1B holds
    min(m, 2p - 1) microbatches, the per-op executor p (+ one B's stash) with a smaller bubble; Megatron's
    accounting has one), pipeline.overlap_grad_reduce off and on where some chunk's gradients are final
    before the last tick (its early sums cost memory in meshrun's step), model.tp_comm_overlap
    (`_tp_overlaps`) and ZeRO-2/3's variants (`zero_variants`)."""
    executors = layout.sched.executors
    if layout.pipe == 1 or framework != "meshrun":
        executors = executors[:1]
    for ex in executors:
        for ov in (False, True) if layout.chunks > 1 else (False,):
            for tp in _tp_overlaps(model, _with(layout, executor=ex), framework):
                for zv in zero_variants(layout, ov, framework):
                    yield dict(executor=ex, overlap_grad_reduce=ov, tp_comm_overlap=tp, **zv)


def zero_variants(layout: Layout, overlap_grad_reduce: bool, framework: str = "meshrun") -> list[dict]:
    """meshrun's ZeRO-2 / ZeRO-3 variants the search costs on `layout`, each named (never `auto`, so the
    plan runs what was costed): ZeRO-3 gathered per layer (FSDP) and once per step, ZeRO-2 reduced per
    microbatch and once per step; the per-layer one only where `train` runs it beside
    `overlap_grad_reduce` (`config.zero`). Other stages, offload.params (its own fetch) and Megatron's
    semantics: the layout as it is."""
    if framework != "meshrun" or layout.offload_params or layout.zero not in (2, 3):
        return [{}]
    if layout.zero == 3:
        field, per_layer, refused = "zero3_gather", "layer", zero3_layer_refusals(overlap_grad_reduce)
    else:
        field, per_layer, refused = "zero2_reduce", "microbatch", zero2_layer_refusals(overlap_grad_reduce)
    return [{field: v} for v in ((per_layer, "step") if not refused else ("step",))]


def _better(r: Result, best: Result) -> bool:
    """A fitting variant before one that fits nowhere; among fitting ones the faster, among the others
    the smaller (the figure the "fits on no layout" error quotes is the least any variant needs); equal
    times: the smaller."""
    if r.hard != best.hard:
        return best.hard
    if r.hard:
        return r.memory["total"] < best.memory["total"]
    return (r.step_time, r.memory["total"]) < (best.step_time, best.memory["total"])


def _tp_overlaps(model, layout: Layout, framework: str) -> tuple[bool, ...]:
    """model.tp_comm_overlap off, and on where it runs: sequence parallelism over t > 2 (t = 2 hides
    nothing: `timing.tp_overlap_hidden`); meshrun's where `tp_overlap_refusal` allows them.
    Megatron-Core's --tp-comm-overlap: any schedule (the published PTD-P runs had none:
    `--evaluate ...,tp_comm_overlap=false`)."""
    if not (layout.sequence_parallel and layout.tensor > 2 and model.predictable):
        return (False,)
    if framework == "meshrun" and tp_overlap_refusal(model, layout) is not None:
        return (False,)
    return (False, True)


def tp_overlap_refusal(model, layout: Layout) -> tuple[str, str] | None:
    """(fix, why) when `train` refuses model.tp_comm_overlap on `layout`, else None: the model config's
    own rules (a family with rings, sequence parallelism, no fp8), and in a pipeline the lockstep
    executor over an even layer split (`train.plan.check_ring_pipeline`). The search and `plan
    --evaluate` both ask it."""
    refused = _model_refusal(model, layout.sequence_parallel)
    if refused is not None:
        return refused
    if layout.pipe > 1 and layout.run_executor != "lockstep":
        why = f"meshrun's rings run on the lockstep executor only ({layout.schedule} on {layout.run_executor})"
        return "use a schedule on the lockstep executor with it", why
    if layout.pipe > 1 and model.n_units % (layout.pipe * layout.chunks):
        return ("use pipe*virtual dividing the layers, or leave it out",
                f"needs the same layer count on every stage chunk ({model.n_units} layers over "
                f"pipe*virtual={layout.pipe * layout.chunks})")  # fmt: skip
    return None


_MODEL_REFUSALS: dict = {}  # (id(model), sequence_parallel) -> (model, refusal): the last models asked


def _model_refusal(model, sequence_parallel: bool) -> tuple[str, str] | None:
    """`tp_overlap_refusal`'s model config rules: (fix, why) when the (frozen) model config refuses
    tp_comm_overlap with `sequence_parallel`, else None; kept per model, as the search asks it per layout."""
    key = (id(model), sequence_parallel)
    hit = _MODEL_REFUSALS.get(key)
    if hit is not None and hit[0] is model:
        return hit[1]
    try:
        replace(model, tp_comm_overlap=True, sequence_parallel=sequence_parallel)
        out = None
    except ConfigError as e:
        out = e.fix, e.what or "invalid value"
    if len(_MODEL_REFUSALS) >= 64:
        _MODEL_REFUSALS.clear()
    _MODEL_REFUSALS[key] = (model, out)
    return out


def _context_text(lay: Layout) -> str:
    return f" context={lay.context} ({lay.context_kind})" if lay.context > 1 else ""


def _memory_only(model, cluster, global_batch, seq_len, bases: list, kw) -> list[Result]:
    """Nothing fits in device memory: the layouts that break the memory rule only (offload candidates).
    `bases`: (candidate, its result or None) from `_cost_candidates`; a result there is not costed again."""
    rs = (r or evaluate(model, lay, cluster, global_batch, seq_len, **kw) for lay, r in bases)
    return [r for r in rs if r.hard and not structural_violations(model, r.layout, cluster, global_batch, seq_len)]


def predict_step_time(model: ModelConfig, layout, cluster: Cluster, global_batch: int, seq_len: int,
                      levers: tuple[str, ...] = ()) -> float:  # fmt: skip
    """Seconds per step of a layout with the given levers on (remat=offload: pass layout.remat='selective').
    A layout with `offload_params` is costed by `evaluate` (its state's tier: `layout.offload_optimizer`)."""
    if layout.offload_params:
        return evaluate(model, layout, cluster, global_batch, seq_len).step_time
    r = evaluate(model, replace(layout, offload_optimizer="none"), cluster, global_batch, seq_len)
    return offload.with_offload(r, model, cluster, seq_len, levers)["time"] if levers else r.step_time
