"""A `jax.profiler` trace of training steps -> busy, collective and idle time per pipeline stage and the
measured bubble (`meshrun profile`, `train.profile`; docs/planning.md shows the report).

- busy: the union of a device's leaf compute ops (not the control ops `conditional`/`while`/`call`,
  whose events span the ops they run, and not collectives);
- collective time per mesh axis: the collectives' intervals outside busy time, matched to axes by
  instruction name in the compiled HLO (`hlo.collectives`); it includes waiting for a peer;
- idle: span - busy - collectives; measured bubble = (span - busy) / span, next to the schedule's
  prediction (`pipeline.schedules.stage_bubbles`).
Span: one traced execution of the step (events sharing a `run_id`), else the traced window divided by
the step count. Only this process's devices are traced; a trace cut at the profiler's 1M-event cap
loses its last (partial) step; devices come from `device_ordinal`, else a '/device:GPU:N' name.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from meshrun.analysis import hlo
from meshrun.errors import DataError

CONTROL = ("conditional", "while", "call")  # events that span the ops they run
EVENT_CAP = 1_000_000  # the profiler keeps at most this many events: a longer trace ends mid-step


# ----------------------------------------------------------------------------- the trace


def load_trace(directory: str | Path) -> list[dict]:
    """The events of the newest `perfetto_trace.json.gz` under `directory`."""
    found = sorted(Path(directory).rglob("perfetto_trace.json.gz"), key=lambda f: f.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {directory}")
    with gzip.open(found[-1], "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(iv) -> float:
    return sum(e - s for s, e in iv)


def _outside(iv, busy) -> float:
    """Length of the union of `iv` minus the (merged) intervals `busy`."""
    iv = _union(iv)
    inter, j = 0.0, 0
    for s, e in iv:
        while j < len(busy) and busy[j][1] <= s:
            j += 1
        k = j
        while k < len(busy) and busy[k][0] < e:
            inter += min(e, busy[k][1]) - max(s, busy[k][0])
            k += 1
    return _length(iv) - inter


def _local_ordinals(mesh) -> dict[int, dict[str, int]]:
    """Device ordinal in this process's trace -> its mesh coordinates {axis: index}."""
    pidx = min(getattr(d, "process_index", 0) for d in mesh.devices.flat)
    out = {}
    for idx in np.ndindex(mesh.devices.shape):
        d = mesh.devices[idx]
        if getattr(d, "process_index", 0) == pidx:
            hw = getattr(d, "local_hardware_id", None)
            out[int(d.id if hw is None else hw)] = dict(zip(mesh.axis_names, map(int, idx), strict=True))
    return out


def _device_events(events: list[dict], hlo_text: str, mesh) -> dict[str, list]:
    """Run id ('' when the events carry none) -> [(device, start s, end s, kind, op name)] of the
    module in `hlo_text`'s leaf ops; kind: 'compute' or the axes tuple of a collective."""
    head = re.match(r"HloModule\s+([\w.\-]+)", hlo_text)
    module = head.group(1) if head else None
    ops = hlo.opcodes(hlo_text)
    axes_of = {c.name: c.axes or ("none",) for c in hlo.collectives(hlo_text, dict(mesh.shape)) if c.name}
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    runs: dict[str, list] = defaultdict(list)  # run id -> [(device, start, end, kind)]
    for e in events:
        a = e.get("args") or {}
        if e.get("ph") != "X" or "hlo_op" not in a or (module and a.get("hlo_module", module) != module):
            continue
        dev = a.get("device_ordinal")
        if dev is None:
            m = re.search(r"/device:[A-Z]+:(\d+)", procs.get(e.get("pid"), ""))
            if not m:
                continue
            dev = m.group(1)
        name = a["hlo_op"]
        code, arg = ops.get(name, (name.rsplit(".", 1)[0], ""))
        if code in CONTROL:
            continue
        if code.endswith("-done"):  # an async collective's end: the axes of its start
            name = arg
        kind = axes_of.get(name, "compute")
        ts = float(e["ts"]) * 1e-6
        runs[str(a.get("run_id", ""))].append((int(dev), ts, ts + float(e.get("dur", 0)) * 1e-6, kind, a["hlo_op"]))
    if len(events) >= EVENT_CAP and "" not in runs and len(runs) > 1:  # the profiler cut the last step short
        del runs[max(runs, key=lambda r: min(e[1] for e in runs[r]))]
    return runs


def device_times(events: list[dict], hlo_text: str, mesh, steps: int | None = None) -> dict[int, dict]:
    """Per device ordinal, seconds over the traced steps of the module in `hlo_text`: span, busy,
    collective {axis: s} (and 'total'), idle, steps. `steps`: the step count when the events carry no
    run ids (the window is then split evenly)."""
    runs = _device_events(events, hlo_text, mesh)
    n = len(runs) if "" not in runs else max(steps or 1, 1)
    out: dict[int, dict] = {}
    for evs in runs.values():
        span = max(e[2] for e in evs) - min(e[1] for e in evs)
        per_dev: dict[int, list] = defaultdict(list)
        for ev in evs:
            per_dev[ev[0]].append(ev)
        for dev, dev_evs in per_dev.items():
            t = out.setdefault(dev, {"span": 0.0, "busy": 0.0, "collective": defaultdict(float), "steps": n})
            busy = _union([(s, e) for _, s, e, k, _ in dev_evs if k == "compute"])
            t["span"] += span
            t["busy"] += _length(busy)
            colls = [(s, e, k) for _, s, e, k, _ in dev_evs if k != "compute"]
            t["collective"]["total"] += _outside([(s, e) for s, e, _ in colls], busy)
            for ax in {a for *_, k in colls for a in k}:
                t["collective"][ax] += _outside([(s, e) for s, e, k in colls if ax in k], busy)
    for t in out.values():
        t["collective"] = dict(t["collective"])
        t["idle"] = max(t["span"] - t["busy"] - t["collective"].get("total", 0.0), 0.0)
    return out


# ----------------------------------------------------------------------------- timeline

PHASES = ("forward", "backward", "weight", "other")  # what a compute op does; plus "collective"
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
# The per-op executor's tick (`pipeline/per_op.py`): one cond per op, each under its name scope
# (`per_op.OP_SCOPES`: per_op_F, per_op_B, per_op_W).
_TICK_OP = re.compile(r"/per_op_([FBW])/")


def _phase(op_name: str, per_op: bool) -> str:
    if per_op and (m := _TICK_OP.search(op_name)):
        return {"F": "forward", "B": "backward", "W": "weight"}[m.group(1)]
    if "transpose(" in op_name:  # autodiff's backward pass (weight gradients included: one fused backward)
        return "backward"
    if "jvp(" in op_name:  # the forward pass of a vjp
        return "forward"
    return "other"  # the optimizer update, the loss's reduction, data movement outside the model


def op_phases(hlo_text: str) -> dict[str, str]:
    """Instruction name -> PHASES entry, from the op_name metadata jax writes into the HLO: under
    autodiff's `transpose(` -> backward, under `jvp(` -> forward; with the per-op executor (its
    tick's ops run under the name scopes per_op_F/B/W) the op of the tick decides: F, B (input
    gradient), W (weight gradients). An instruction without op_name (XLA's fusions) takes the phase of the first
    instruction with one in the computation it calls, else the most common one of its computation."""
    per_op = "/per_op_W/" in hlo_text
    comps = hlo.computations(hlo_text)
    named: dict[str, str | None] = {}  # instruction -> phase, None: no op_name
    calls: dict[str, str] = {}
    members: dict[str, list[str]] = {}
    for comp, body in comps.items():
        for line in body.splitlines():
            n = _INSTR.match(line)
            if not n:
                continue
            members.setdefault(comp, []).append(n.group(1))
            m = _OP_NAME.search(line)
            named[n.group(1)] = _phase(m.group(1), per_op) if m else None
            c = _CALLS.search(line)
            if c:
                calls[n.group(1)] = c.group(1)
    first = {c: next((named[i] for i in ms if named[i] is not None), None) for c, ms in members.items()}
    common = {}
    for c, ms in members.items():
        counts = defaultdict(int)
        for i in ms:
            if named[i] is not None:
                counts[named[i]] += 1
        common[c] = max(counts, key=counts.get) if counts else "other"
    out = {}
    for comp, ms in members.items():
        for i in ms:
            out[i] = named[i] or first.get(calls.get(i, ""), None) or common[comp]
    return out


def device_intervals(events: list[dict], hlo_text: str, mesh) -> dict[int, list[tuple[float, float, str]]]:
    """Per device ordinal, one traced step as [(start s, end s, what)] from the step's start, what in
    PHASES or 'collective' (its time outside the device's compute; includes waiting for a peer); the
    gaps are idle. The first traced execution of the step (its run id), else the whole window."""
    runs = _device_events(events, hlo_text, mesh)
    if not runs:
        return {}
    evs = runs[min(runs, key=lambda r: min(e[1] for e in runs[r]))] if "" not in runs else runs[""]
    t0 = min(e[1] for e in evs)
    phases = op_phases(hlo_text)
    out: dict[int, list[tuple[float, float, str]]] = {}
    for dev in sorted({e[0] for e in evs}):
        mine = [e for e in evs if e[0] == dev]
        rows = []
        for ph in PHASES:
            iv = [(s, e) for _, s, e, k, name in mine if k == "compute" and phases.get(name, "other") == ph]
            rows += [(s - t0, e - t0, ph) for s, e in _union(iv)]
        busy = _union([(s, e) for _, s, e, k, _ in mine if k == "compute"])
        for s, e in _minus(_union([(s, e) for _, s, e, k, _ in mine if k != "compute"]), busy):
            rows.append((s - t0, e - t0, "collective"))
        out[dev] = sorted(rows)
    return out


def _minus(iv: list[tuple[float, float]], busy: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The merged intervals `iv` with the merged intervals `busy` cut out."""
    out = []
    for s, e in iv:
        cur = s
        for bs, be in busy:
            if be <= cur or bs >= e:
                continue
            if bs > cur:
                out.append((cur, bs))
            cur = max(cur, be)
        if cur < e:
            out.append((cur, e))
    return out


COLORS = {"forward": "#4c9be8", "backward": "#e8704c", "weight": "#9b59b6", "other": "#95a5a6",
          "collective": "#f1c40f"}  # fmt: skip


def draw_timeline(intervals: dict[int, list], mesh, path: str | Path, title: str) -> None:
    """One row per device (grouped by pipeline stage, stage 0 on top): forward, backward,
    weight-gradient, other compute and collective time of one step; white is idle. Needs matplotlib
    (ImportError otherwise); OSError when `path` cannot be written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    coords = _local_ordinals(mesh)
    devs = sorted(intervals, key=lambda d: (coords.get(d, {}).get("pipe", 0), d))
    end = max((e for rows in intervals.values() for _, e, _ in rows), default=0.0) * 1e3
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.3 * len(devs)))
    for y, dev in enumerate(devs):
        for what in (*PHASES, "collective"):
            bars = [(1e3 * s, 1e3 * (e - s)) for s, e, w in intervals[dev] if w == what]
            if bars:
                ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=COLORS[what], linewidth=0)
    ax.set_yticks(range(len(devs)), [f"stage {coords.get(d, {}).get('pipe', 0)} dev {d}" for d in devs])
    ax.invert_yaxis()
    ax.set_xlim(0, end * 1.01 or 1)
    ax.set_xlabel("ms from the start of the step")
    used = {w for rows in intervals.values() for *_, w in rows}
    names = {"weight": "weight gradient", "other": "other compute (optimizer, loss)"}
    handles = [Patch(color=COLORS[w], label=names.get(w, w)) for w in (*PHASES, "collective") if w in used]
    handles.append(Patch(facecolor="white", edgecolor="#999999", label="idle"))
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=80)
    finally:
        plt.close(fig)


# ----------------------------------------------------------------------------- per stage


def stage_report(times: dict[int, dict], mesh, predicted: list[float]) -> dict:
    """Per pipeline stage (devices grouped by their 'pipe' coordinate), seconds per step as means over
    the stage's devices: span, busy, idle, collective {axis}, measured and predicted bubble; and the
    share of collective time per mesh axis over all devices (the TP:PP:DP(:EP) ratio)."""
    coords = _local_ordinals(mesh)
    stages: dict[int, list[int]] = defaultdict(list)
    for dev in sorted(times):
        stages[coords.get(dev, {}).get("pipe", 0)].append(dev)
    rows = []
    for s, devs in sorted(stages.items()):
        ts = [times[d] for d in devs]
        axes = sorted({a for t in ts for a in t["collective"] if a != "total"}, key=_axis_key(mesh))
        rows.append({
            "stage": s, "devices": devs,
            **{f"{k}_s": _mean(ts, lambda t, k=k: t[k]) for k in ("span", "busy", "idle")},
            "collective_s": {a: _mean(ts, lambda t, a=a: t["collective"].get(a, 0.0)) for a in [*axes, "total"]},
            "measured_bubble": sum((t["span"] - t["busy"]) / t["span"] if t["span"] else 0.0 for t in ts) / len(ts),
            "predicted_bubble": predicted[s] if s < len(predicted) else None,
        })  # fmt: skip
    per_axis: dict[str, float] = defaultdict(float)
    for t in times.values():
        for a, v in t["collective"].items():
            if a != "total":
                per_axis[a] += v
    total = sum(per_axis.values())
    share = {a: per_axis[a] / total if total else 0.0 for a in sorted(per_axis, key=_axis_key(mesh))}
    steps = next(iter(times.values()))["steps"] if times else 0
    return {"mesh": {a: int(mesh.shape[a]) for a in mesh.axis_names}, "steps": steps, "stages": rows,
            "collective_share": share}  # fmt: skip


def _mean(ts: list[dict], f) -> float:
    """Mean over devices of f(device times) per step."""
    return sum(f(t) / t["steps"] for t in ts) / len(ts)


def _axis_key(mesh):
    order = list(mesh.axis_names)
    return lambda a: order.index(a) if a in order else len(order)


def format_report(rep: dict, title: str) -> str:
    shape = " x ".join(f"{a}={n}" for a, n in rep["mesh"].items() if n != 1) or "1 device"
    sc = rep.get("schedule") if rep["mesh"].get("pipe", 1) > 1 else None
    sched = f", {sc['name']} m={sc['microbatches']}" if sc else ", no pipeline"
    sched += f" v={sc['virtual']}" if sc and sc["virtual"] > 1 else ""
    n = f"{rep['steps']} traced step" + ("s" if rep["steps"] != 1 else "")
    lines = [f"{title}: mesh {shape}{sched}, {n} (per step, ms; means over a stage's devices)"]
    axes = [a for a in rep["collective_share"]]
    head = f"{'stage':<7}{'devices':<12}{'span':>9}{'busy':>9}{'idle':>9}" + "".join(f"{a[:8]:>9}" for a in axes)
    lines += ["", head + f"{'bubble':>9}{'predicted':>11}"]
    for r in rep["stages"]:
        ms = lambda x: f"{1e3 * x:>9.2f}"
        pred = "-" if r["predicted_bubble"] is None else f"{r['predicted_bubble']:.3f}"
        devs = ",".join(map(str, r["devices"]))
        line = f"{r['stage']:<7}{devs[:11]:<12}{ms(r['span_s'])}{ms(r['busy_s'])}{ms(r['idle_s'])}"
        line += "".join(ms(r["collective_s"].get(a, 0.0)) for a in axes)
        lines.append(line + f"{r['measured_bubble']:>9.3f}{pred:>11}")
    if axes:
        ratio = " : ".join(f"{a} {100 * v:.0f}%" for a, v in rep["collective_share"].items())
        lines.append(f"\ncollective time by mesh axis: {ratio}")
    lines.append("bubble = (span - busy) / span: waiting in a collective is not busy; none: one-device groups")
    if rep.get("platform", "cpu") == "cpu":
        lines.append("on simulated CPU devices all devices share the host's cores: idle there is not a GPU bubble")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- running it


def report_of_trace(trace_dir: str | Path, hlo_text: str, cfg, mesh, steps: int, predicted: list[float]) -> dict:
    """Read the trace, compute the report, write trace_dir/profile.json; returns the report.
    `predicted`: the schedule's bubble per stage (the train step plan's `stage_bubbles`)."""
    times = device_times(load_trace(trace_dir), hlo_text, mesh, steps)
    if not times:
        raise DataError(
            f"the trace in {trace_dir} holds no device op events of the train step (a profiler without "
            "device tracing, or an event cap reached before the step ran); trace fewer steps with `meshrun profile`"
        )
    rep = stage_report(times, mesh, list(predicted))
    rep["schedule"] = {"name": cfg.pipeline.schedule, "microbatches": cfg.pipeline.microbatches,
                       "virtual": cfg.pipeline.virtual}  # fmt: skip
    rep["trace_dir"] = str(trace_dir)
    rep["platform"] = next(iter(mesh.devices.flat)).platform
    Path(trace_dir, "profile.json").write_text(json.dumps(rep, indent=1) + "\n")
    return rep
