"""`meshrun explain CONFIG [section.key=value ...] [--json]`: compile the train step, never run it.

The step is lowered with abstract state and a ShapeDtypeStruct batch on simulated CPU devices of the
config's mesh and compiled; the planner's prediction is printed beside what XLA reports:
* memory per device: the predicted parts (`planner.step_model.predict_memory_jax`) vs
  `compiled.memory_analysis()` (total = argument + temp + output - alias), split by where it rests
  (device, pinned host memory, NVMe files; a streamed tier's bytes come from the tier itself);
* collectives per step: bytes per mesh axis and counts by op (`meshrun.analysis.hlo`), each multiplied
  by the trip counts of the loops around it; `static` counts each once.

Meshes of more than MAX_SIMULATED devices are not compiled (the prediction is printed alone with a
note); shrink the mesh with overrides, e.g. `mesh.data=1 mesh.pipe=2 model.n_layers=4`. On CPU the
compiled step uses the CPU kernels, so memory of GPU templates is indicative only.
"""

from __future__ import annotations

import glob
import tempfile
from collections import defaultdict
from dataclasses import replace
from types import SimpleNamespace

from meshrun.config import AXES
from meshrun.errors import ConfigError
from meshrun.planner import cost, search, step_model
from meshrun.planner.cost import layout_of
from meshrun.planner.hardware import parse_cluster
from meshrun.runtime.devices import needed_devices

MAX_SIMULATED = 64  # largest mesh compiled on simulated CPU devices


# ----------------------------------------------------------------------------- prediction


def planner_layout(cfg, mesh_shape: dict[str, int]):
    """The planner's Layout of the config on a mesh of `mesh_shape` (`planner.cost.layout_of`)."""
    return layout_of(cfg, mesh_shape)


def unpredicted(family: str) -> str:
    """Why a family's step has compiled figures only."""
    return (
        f"predicted columns empty: the planner's formulas are for transformer layers, and model.family={family} "
        "sets predictable = False"
    )


def check_cluster(cfg, cluster_text: str) -> None:
    """A step time is predicted for transformer families only (`predictable`), and for model.fp8 on a
    GPU with fp8 GEMMs only (as `meshrun plan --fp8`)."""
    if not cfg.model.predictable:
        what = f"model.family={cfg.model.family} has no predicted step time (predictable = False)"
        raise ConfigError("--cluster", cluster_text, "leave it out for this family", what)
    gpu = parse_cluster(cluster_text).gpu
    if cfg.model.fp8 != "none" and not gpu.fp8_flops:
        raise ConfigError("--cluster", cluster_text, "use an H100/H200/GH200/B200 cluster, or leave model.fp8 out",
                          f"{gpu.name} has no fp8 GEMMs to cost model.fp8={cfg.model.fp8} on")  # fmt: skip


def step_time(cfg, mesh_shape: dict[str, int], cluster_text: str) -> float:
    """The planner's step time of this config on `cluster_text`, memory levers included
    (remat=offload: selective's compute + host traffic; remat_every: full's compute)."""
    check_cluster(cfg, cluster_text)
    lay = planner_layout(cfg, mesh_shape)
    lay = replace(lay, remat={"offload": "selective"}.get(lay.remat, lay.remat))
    tier = {"host": ("optimizer",), "nvme": ("nvme",)}.get(cfg.offload.optimizer, ())
    levers = tier + ("activations",) * (cfg.model.remat == "offload")
    cluster = parse_cluster(cluster_text)
    return search.predict_step_time(cfg.model, lay, cluster, cfg.train.global_batch, cfg.train.seq_len, levers)


def predict(cfg, mesh_shape: dict[str, int], program=None, offload=None, in_flight: int = 2) -> dict:
    """Planner side: memory of meshrun's step (and Megatron's accounting for reference), collectives.
    `program`: the step's tick program (its permutes per step) when there is a pipeline; `offload`: the
    plan's `Placement` (None: made from `cfg`); `in_flight`: gathered layers at once under ZeRO-3 per
    layer (1 for the XLA:CPU compile, whose collectives are synchronous). Empty for a family whose
    config class is not `predictable` (the formulas are for transformer layers)."""
    if not cfg.model.predictable:
        return {"memory": {}, "collectives": {}, "counts": {}}
    lay, s = planner_layout(cfg, mesh_shape), cfg.train.seq_len
    if offload is None:  # the plan's placement, made by the one rule that makes it
        from meshrun.offload.registry import placement

        offload = placement(cfg)
    mem = step_model.predict_memory_jax(cfg.model, lay, seq_len=s, offload_optimizer=cfg.offload.optimizer,
                                        streamed=offload.streams, in_flight=in_flight)  # fmt: skip
    megatron = cost.predict_memory(cfg.model, lay, seq_len=s, framework="megatron")
    permutes = program.permute_counts() if program is not None else None  # the executor's phases: ticks that send
    comm = step_model.predict_collective_bytes(cfg.model, lay, seq_len=s, permutes=permutes)  # lay: its reduce dtype
    keys = ("params", "grads", "optimizer", "activations", "logits", "working", "argument", "temp", "total", "device",
            "host", "nvme")  # fmt: skip
    return {
        "memory": {k: int(mem[k]) for k in keys} | {"megatron_total": int(megatron["total"])},
        "collectives": {k: int(v) for k, v in comm["bytes"].items()},
        "counts": {k: int(v) for k, v in comm["count"].items()},
    }


# ----------------------------------------------------------------------------- compiled step


def compiled_collectives(hlo_text: str, mesh_shape: dict[str, int]) -> dict:
    """Per-step and static collective bytes per axis and counts by op, from compiled HLO text."""
    from meshrun.analysis import hlo

    per_axis, static_axis = defaultdict(int), defaultdict(int)
    per_op, static_op = defaultdict(int), defaultdict(int)
    colls = hlo.collectives(hlo_text, mesh_shape)
    for c in colls:
        static_op[c.op] += 1
        per_op[c.op] += c.per_step
        for a in c.axes:  # wire bytes: a 16-bit reduction counts 16 bits even where XLA:CPU widened it
            static_axis[a] += c.wire_bytes
            per_axis[a] += c.per_step * c.wire_bytes
    return {"bytes": dict(per_axis), "counts": dict(per_op), "static_bytes": dict(static_axis),
            "static_counts": dict(static_op), "data_parallel": buckets(colls)}  # fmt: skip


def buckets(colls) -> list[dict]:
    """The data-parallel collectives of the step as XLA combined them (its gradient buckets), largest
    first: op, axes, arrays, bytes as the program moves them (16-bit reductions at 16 bits), the
    dtype the program asks for, runs per step."""
    from meshrun.analysis import hlo

    out = []
    for c in hlo.data_parallel(colls):
        dts = sorted({"bf16" if c.promoted and t == "f32" and d else t for t, d in zip(c.dtypes, c.dims, strict=True)})
        out.append({"op": c.op, "axes": list(c.axes), "arrays": c.parts, "bytes": c.wire_bytes,
                    "dtype": "+".join(dts), "per_step": c.per_step})  # fmt: skip
    return sorted(out, key=lambda b: -b["bytes"])


def compile_step(cfg, dump_to: str | None = None, tier: dict | None = None):
    """Lower + compile the jitted train step with abstract arguments. Returns (compiled, mesh, plan).
    `dump_to`: a directory for XLA's text dumps of the step (buffer assignment, live ranges). `tier`:
    filled with the streamed tier's bytes per device where they rest ({"host": .., "nvme": ..}; empty
    without one): its state is no argument of the compiled program (the device part)."""
    import jax
    import jax.numpy as jnp

    from meshrun.runtime.devices import cpu_devices
    from meshrun.runtime.mesh import build_mesh
    from meshrun.train.step import make_train_step

    mesh = build_mesh(cfg.mesh, devices=cpu_devices(needed_devices(cfg)))
    train_step = make_train_step(cfg, mesh)
    shape = (cfg.train.global_batch, cfg.train.seq_len)
    tokens = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=train_step.batch_sharding)
    n_batch = 3 if cfg.data.pack_documents else 2  # tokens, labels[, segment_ids]
    lowered = train_step.step.lower(train_step.abstract_run, *(tokens,) * n_batch)
    if tier is not None and train_step.tier is not None:
        tier.update(train_step.tier.bytes_per_device())
    options = {}
    if dump_to is not None:
        options = {"xla_dump_to": dump_to, "xla_dump_hlo_as_text": True, "xla_dump_hlo_module_re": ".*train_step.*"}
    return lowered.compile(compiler_options=options or None), mesh, train_step.plan


def live_temp(cfg) -> dict[str, int]:
    """{extent, peak} of the compiled step's temp bytes (`analysis.memory.live_temp_peak`): the extent
    is `memory_analysis().temp`, the peak what is live at once, without the packing's holes."""
    with tempfile.TemporaryDirectory() as d:
        compile_step(cfg, dump_to=d)
        return _read_live(d, strict=True)


def _read_live(d: str, strict: bool = False) -> dict[str, int] | None:
    """`live_temp_peak` of the train step's dumps in `d`; None when they cannot be read (another XLA's
    dump format) unless `strict`."""
    from meshrun.analysis.memory import live_temp_peak

    try:
        read = lambda kind: open(max(glob.glob(f"{d}/*train_step*after_optimizations-{kind}.txt"), key=len)).read()
        return live_temp_peak(read("buffer-assignment"), read("live-range"))
    except ValueError:  # no such dump (max of nothing), or one this parser does not know
        if strict:
            raise
        return None


def saved_bytes_per_layer(cfg, depths: tuple[int, int] = (2, 4), measure: str = "peak") -> float:
    """Activation bytes one device keeps per layer and per sequence of a microbatch, from compiled
    programs: the double difference of the step's temp bytes over two depths and two microbatch
    sizes (1 and 2 rows per microbatch on a device), so the working set (it does not grow with depth)
    and the per-layer gradient and optimizer temporaries (they do not grow with the batch) cancel:
    [T(L2, 2) - T(L1, 2) - T(L2, 1) + T(L1, 1)] / (L2 - L1). Needs mesh.pipe = 1.
    measure: "peak", the bytes live at once (`live_temp`; what the program holds), or "extent",
    `memory_analysis().temp`, which adds the holes XLA's heap packing leaves (they change from one
    compile to the next by up to a working set, so the extent's difference is the noisier one).
    Run it with the compute dtype float32 on CPU: XLA:CPU computes bf16 dots in float32 and keeps a
    float32 copy of the saved bf16 activations that a GPU never makes."""
    if cfg.mesh.pipe != 1:
        raise ValueError("saved_bytes_per_layer needs mesh.pipe=1 (the pipeline holds several microbatches)")
    if measure not in ("peak", "extent"):
        raise ValueError(f"measure must be 'peak' or 'extent', got {measure!r}")
    mc = cfg.mesh
    dp = (mc.data if mc.data > 0 else needed_devices(cfg) // (mc.tensor * mc.expert)) * mc.expert
    temp = {}
    for n in depths:
        for b in (1, 2):  # rows per microbatch on one device
            gb = b * dp * cfg.pipeline.microbatches
            c = replace(cfg, model=replace(cfg.model, n_layers=n), train=replace(cfg.train, global_batch=gb))
            if measure == "peak":
                temp[n, b] = live_temp(c)["peak"]
            else:
                temp[n, b] = compile_step(c)[0].memory_analysis().temp_size_in_bytes
    l1, l2 = depths
    return (temp[l2, 2] - temp[l1, 2] - temp[l2, 1] + temp[l1, 1]) / (l2 - l1)


def _predicted_only(cfg, shape: dict[str, int], n: int) -> dict:
    """The report's prediction alone, for a mesh too large to compile on simulated devices."""
    from meshrun.train.plan import build_plan

    plan = build_plan(cfg, SimpleNamespace(shape=shape))  # what compiling would check: batch split, layer split
    pred = predict(cfg, shape, plan.program, plan.offload)
    note = (
        f"compiling needs the real device count ({n}); this host simulates at most {MAX_SIMULATED} CPU "
        "devices, so only the prediction is shown: shrink the mesh with overrides (e.g. mesh.data=1 "
        "mesh.pipe=2 model.n_layers=4) to compile a scaled-down layout"
    )
    return {"note": note, "memory": {"predicted": pred["memory"], "compiled": None},
            "collectives": {"predicted": pred["collectives"], "compiled": None},
            "counts": {"predicted": pred["counts"], "compiled": None}}  # fmt: skip


def _compiled_memory(compiled, live: dict | None, tier: dict) -> dict[str, int | None]:
    """The compiled step's memory per device (`memory_analysis()`), with where it rests: device, host
    (plus a streamed tier's store) and NVMe (a streamed tier's files)."""
    ma = compiled.memory_analysis()
    mem = {
        "argument": int(ma.argument_size_in_bytes),
        "temp": int(ma.temp_size_in_bytes),
        "temp_live": None if live is None else live["peak"],  # without the heap packing's holes
        "output": int(ma.output_size_in_bytes),
        "alias": int(ma.alias_size_in_bytes),
    }
    mem["total"] = mem["argument"] + mem["temp"] + mem["output"] - mem["alias"]
    from meshrun.analysis.memory import memory_spaces  # imports jax: only after the devices are set up

    spaces = memory_spaces(compiled)
    mem |= {"device": spaces["device"], "host": spaces["host"] + tier.get("host", 0), "nvme": tier.get("nvme", 0)}
    mem["total"] += mem["host"] - spaces["host"] + mem["nvme"]
    return mem


def explain(cfg) -> dict:
    """The report: {config, mesh, devices, compiled: bool, note, memory {predicted, compiled},
    collectives {predicted, compiled} (bytes per axis per step), counts {predicted, compiled}}."""
    n = needed_devices(cfg)
    shape = {a: getattr(cfg.mesh, a) for a in AXES}
    if 0 < (group := cfg.mesh.zero_group) < shape["data"]:  # HSDP: the data axis as the mesh builder splits it
        shape = {**shape, "replica": shape["data"] // group, "data": group}
    out = {"mesh": shape, "devices": n, "compiled": False, "note": "", "grad_reduce_dtype": cfg.train.grad_reduce_dtype}
    if not cfg.model.predictable:
        if n > MAX_SIMULATED:
            what = f"model.family={cfg.model.family} has no prediction to show without compiling"
            raise ConfigError("mesh", n, f"shrink the mesh to at most {MAX_SIMULATED} devices", what)
        out["note"] = unpredicted(cfg.model.family)
    elif n > MAX_SIMULATED:
        return out | _predicted_only(cfg, shape, n)
    with tempfile.TemporaryDirectory() as d:
        tier: dict = {}  # a streamed tier's state: outside the compiled program
        compiled, mesh, plan = compile_step(cfg, dump_to=d, tier=tier)
        live = _read_live(d)
    shape = dict(mesh.shape)
    pred = predict(cfg, shape, plan.program, plan.offload, in_flight=1)  # compiled for XLA:CPU
    mem = _compiled_memory(compiled, live, tier)
    comm = compiled_collectives(compiled.as_text(), shape)
    out |= {
        "mesh": shape,
        "compiled": True,
        "memory": {"predicted": pred["memory"], "compiled": mem},
        "collectives": {"predicted": pred["collectives"], "compiled": comm["bytes"],
                        "compiled_static": comm["static_bytes"]},
        "counts": {"predicted": pred["counts"], "compiled": comm["counts"], "compiled_static": comm["static_counts"]},
        "data_parallel": comm["data_parallel"],
    }  # fmt: skip
    return out


# ----------------------------------------------------------------------------- output


def _mb(x) -> str:
    return "-" if x is None else f"{x / 2**20:.3f}"


def format_report(rep: dict, title: str) -> str:
    """The report as text: memory per device, collectives per step, then the gradient buckets."""
    axes = ("replica", *AXES)  # HSDP's replica axis just outside the data axis
    shape = " x ".join(f"{a}={rep['mesh'][a]}" for a in axes if rep["mesh"].get(a, 1) != 1) or "1 device"
    lines = [f"{title}: mesh {shape} ({rep['devices']} devices)"]
    if rep["note"]:
        lines.append(f"note: {rep['note']}")
    lines += _memory_lines(rep) + _collective_lines(rep)
    if rep.get("data_parallel") is not None:
        lines += ["", *format_buckets(rep["data_parallel"], rep.get("grad_reduce_dtype", "float32"))]
    return "\n".join(lines)


def _memory_lines(rep: dict) -> list[str]:
    pm, cm = rep["memory"]["predicted"], rep["memory"]["compiled"] or {}
    lines = ["", f"{'memory per device (MiB)':<28}{'predicted':>12}{'compiled':>12}"]
    rows = [
        ("argument (params + opt)", pm.get("argument"), cm.get("argument")),
        ("temp (grads, acts, logits)", pm.get("temp"), cm.get("temp")),
        ("  live at once", None, cm.get("temp_live")),
        ("  params", pm.get("params"), None),
        ("  grads (+ accumulator)", pm.get("grads"), None),
        ("  optimizer (+ update tmp)", pm.get("optimizer"), None),
        ("  activations", pm.get("activations"), None),
        ("  logits", pm.get("logits"), None),
        ("  backward working set", pm.get("working"), None),
        ("output", None, cm.get("output")),
        ("alias (donated)", None, cm.get("alias")),
        ("total", pm.get("total"), cm.get("total")),
        ("  in device memory", pm.get("device"), cm.get("device")),
        ("  in host memory", pm.get("host"), cm.get("host")),
        ("  in NVMe files", pm.get("nvme"), cm.get("nvme")),
    ]
    for name, p, c in rows:
        lines.append(f"{name:<28}{_mb(p):>12}{_mb(c):>12}")
    if cm and pm:
        lines.append(f"{'predicted / compiled':<28}{pm['total'] / cm['total']:>12.2f}")
    if "step_time_s" in rep:
        st = rep["step_time_s"]
        lines.append(f"{'step time (s) on ' + st['cluster']:<28}{st['predicted']:>12.4g}")
    lines.append(f"{'(Megatron accounting)':<28}{_mb(pm.get('megatron_total')):>12}")
    return lines


def _collective_lines(rep: dict) -> list[str]:
    pm, lines = rep["memory"]["predicted"], []
    pc, cc = rep["collectives"]["predicted"], rep["collectives"]["compiled"] or {}
    zero = 0 if pm else None  # an unpredicted family: "-" rather than a predicted 0
    axes = [a for a in AXES if a in pc or a in cc]
    lines += ["", f"{'collectives per step (MiB)':<28}{'predicted':>12}{'compiled':>12}{'static':>12}"]
    static = rep["collectives"].get("compiled_static", {})
    for a in axes:
        c = cc.get(a, 0) if rep["compiled"] else None
        s = static.get(a, 0) if rep["compiled"] else None
        lines.append(f"{'  ' + a:<28}{_mb(pc.get(a, zero)):>12}{_mb(c):>12}{_mb(s):>12}")
    if not axes:
        lines.append("  (none: one device)")
    pn, cn = rep["counts"]["predicted"], rep["counts"]["compiled"] or {}
    sn = rep["counts"].get("compiled_static", {})
    lines += ["", f"{'collective ops per step':<28}{'predicted':>12}{'compiled':>12}{'static':>12}"]
    for op in sorted(set(pn) | set(cn)):
        c = cn.get(op, 0) if rep["compiled"] else "-"
        p = pn.get(op, 0) if pm else "-"
        lines.append(f"{'  ' + op:<28}{p:>12}{c:>12}{sn.get(op, 0) if rep['compiled'] else '-':>12}")
    lines.append(
        "\ncompiled per step = each HLO collective x the trip counts of its loops; static = each once. "
        "Predicted omits scalar all-reduces (loss, token counts)."
    )
    return lines


def format_buckets(dp: list[dict], grad_dtype: str) -> list[str]:
    """The data-parallel collectives (gradient buckets) of the compiled step, one line each."""
    runs = sum(b["per_step"] for b in dp)
    total = sum(b["bytes"] * b["per_step"] for b in dp)
    lines = [f"data-parallel collectives per step: {runs} ({_mb(total)} MiB; train.grad_reduce_dtype={grad_dtype})"]
    for b in dp[:12]:
        where = ",".join(b["axes"])
        lines.append(f"  {b['op']:<15}{where:<13} {b['dtype']:<10}{b['arrays']:>4} arrays{_mb(b['bytes']):>10} MiB"
                     + (f"  x{b['per_step']}" if b["per_step"] > 1 else ""))  # fmt: skip
    if len(dp) > 12:
        lines.append(f"  ... {len(dp) - 12} more")
    if any(b["dtype"].startswith("bf16") for b in dp):
        lines.append("  (bf16: XLA:CPU widens 16-bit reductions to f32 when it runs them; GPUs move 16 bits)")
    return lines
