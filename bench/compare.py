"""Pipelined vs non-pipelined steps on the same simulated CPU devices (a script, not a test).

    python bench/compare.py [--repeat 3] [--steps 12] [--out rows.jsonl] [--quick]

Each configuration runs as its own `meshrun train` process on exactly its device count
(XLA_FLAGS=--xla_force_host_platform_device_count=N, nothing else: XLA's default optimisation level)
and its steady step is the median `step_time_s` of steps 3..steps in its metrics.jsonl. Every
pipelined layout is compared with the non-pipelined layout on the same devices (data x tensor
parallel, no gradient accumulation), the interleaved schedule with 1F1B at the same p and m. Within a
repeat a group runs its reference first and its layouts right after (the order flips every other
repeat); a ratio is the median over repeats of (layout / reference of the same repeat).

Model: d_model 256, 4 layers, 4 heads x 64, d_ff 512, vocab 1024, seq 128, float32, synthetic data,
global batch 32. pipe4 x interleaved v=2 needs layers divisible by p x v = 8: that group uses 8 layers.
Wall-clock on simulated devices sharing a few CPU cores measures per-step overhead (bubble,
microbatch loop, collectives as copies), not GPU speed: compare ratios of one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _child  # noqa: E402  (bench/_child.py)

ROOT = _child.ROOT
CONFIG = ROOT / "configs/tiny_cpu.yaml"
MODEL = [
    "model.d_model=256",
    "model.n_heads=4",
    "model.n_kv_heads=4",
    "model.head_dim=64",
    "model.d_ff=512",
    "model.vocab=1024",
    "model.max_seq_len=128",
    "model.dtype=float32",
    "model.param_dtype=float32",
    "train.seq_len=128",
    "train.global_batch=32",
    "optimizer.warmup_steps=2",
    "data.kind=synthetic",
    "checkpoint.every=0",
    "checkpoint.async_save=false",
]


@dataclass(frozen=True)
class Layout:
    data: int = 1
    pipe: int = 1
    tensor: int = 1
    m: int = 1
    v: int = 1
    layers: int = 4

    @property
    def devices(self) -> int:
        return self.data * self.pipe * self.tensor

    @property
    def schedule(self) -> str:
        return "interleaved" if self.v > 1 else "1f1b"

    @property
    def name(self) -> str:
        axes = [f"{a}{n}" for a, n in (("pipe", self.pipe), ("data", self.data), ("tensor", self.tensor)) if n > 1]
        s = "·".join(axes) or "1 device"
        if self.pipe > 1:
            s += f" m={self.m}" + (f" interleaved v={self.v}" if self.v > 1 else " 1f1b")
        return s + (f" ({self.layers} layers)" if self.layers != 4 else "")

    def overrides(self) -> list[str]:
        return [
            f"mesh.data={self.data}",
            f"mesh.pipe={self.pipe}",
            f"mesh.tensor={self.tensor}",
            "mesh.expert=1",
            f"model.n_layers={self.layers}",
            f"pipeline.schedule={self.schedule}",
            f"pipeline.microbatches={self.m}",
            f"pipeline.virtual={self.v}",
        ]


@dataclass
class Row:
    layout: Layout
    ref: Layout | None = None  # what the ratio divides by
    target: float | None = None  # the ratio this layout should reach (<=)
    times: list[float] = field(default_factory=list)  # steady step per repeat
    ratios: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def groups(quick: bool) -> list[tuple[Layout, list[tuple[Layout, Layout | None, float | None]]]]:
    """(reference, [(layout, its reference (None: the group's), target ratio)]) in run order."""
    one = Layout()
    d2, p2 = Layout(data=2), Layout(pipe=2, m=16)
    if quick:
        return [(one, []), (d2, [(p2, None, 1.05)])]
    d4t2 = Layout(data=4, tensor=2)
    p2d2t2 = {m: Layout(pipe=2, data=2, tensor=2, m=m) for m in (4, 8, 16)}
    i2 = Layout(pipe=2, data=2, tensor=2, m=8, v=2)
    p4t2 = Layout(pipe=4, tensor=2, m=16)
    d8, p2d4 = Layout(data=8), Layout(pipe=2, data=4, m=8)
    d2t4, p2t4 = Layout(data=2, tensor=4), Layout(pipe=2, tensor=4, m=8)
    d4t2_8, p4t2_8 = Layout(data=4, tensor=2, layers=8), Layout(pipe=4, tensor=2, m=16, layers=8)
    i4_8 = Layout(pipe=4, tensor=2, m=16, v=2, layers=8)
    return [
        (one, []),
        (d2, [(p2, None, 1.05)]),
        (d4t2, [(p2d2t2[4], None, None), (p2d2t2[8], None, 1.15), (i2, p2d2t2[8], 1.0),
                (p2d2t2[16], None, None), (p4t2, None, 1.2)]),
        (d8, [(p2d4, None, 1.15)]),
        (d2t4, [(p2t4, None, None)]),
        (d4t2_8, [(p4t2_8, None, 1.2), (i4_8, p4t2_8, 1.0)]),
    ]  # fmt: skip


def run_one(lay: Layout, steps: int, timeout: float) -> tuple[float | None, str]:
    """Steady step seconds of one `meshrun train` process (median of steps 3..steps), or an error."""
    with tempfile.TemporaryDirectory(prefix="meshrun-compare-") as tmp:
        cmd = _child.meshrun("train", str(CONFIG), *MODEL, *lay.overrides(), f"train.steps={steps}",
                             f"train.run_dir={tmp}/run", "--quiet")  # fmt: skip
        flags = f"--xla_force_host_platform_device_count={lay.devices}"
        r = _child.run(cmd, env=_child.env(XLA_FLAGS=flags, JAX_PLATFORMS="cpu"), timeout=timeout)
        run_dir = Path(tmp) / "run"
        if r.error or not (run_dir / "metrics.jsonl").exists():
            return None, r.error or "no metrics.jsonl"
        times = {rec["step"]: rec["step_time_s"] for rec in _child.metrics(run_dir) if "step_time_s" in rec}
        steady = [t for s, t in times.items() if s >= min(3, steps)]
        return statistics.median(steady), ""


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs of every configuration (interleaved)")
    ap.add_argument("--steps", type=int, default=12, help="steps per run; steady = median of steps 3..steps")
    ap.add_argument("--quick", action="store_true", help="1 device, data2 vs pipe2 m=16; 4 steps, 1 repeat")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    ap.add_argument("--out", type=Path, help="also write one JSON object per row to this file")
    a = ap.parse_args(argv)
    if a.quick:
        a.steps, a.repeat = min(a.steps, 4), 1
    if a.steps < 3:
        ap.error("--steps must be >= 3 (steps 1-2 include compilation)")
    plan = groups(a.quick)
    rows: dict[Layout, Row] = {}
    for ref, members in plan:
        rows.setdefault(ref, Row(ref))
        for lay, own_ref, target in members:
            rows[lay] = Row(lay, own_ref or ref, target)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    print(f"# meshrun {commit.stdout.strip() or '?'}; {a.repeat} repeat(s) x {a.steps} steps; XLA default flags; "
          f"{os.cpu_count()} CPUs, load average {_load()}")  # fmt: skip
    t_start = time.perf_counter()
    for rep in range(a.repeat):
        order = plan if rep % 2 == 0 else [(r, m[::-1]) for r, m in plan[::-1]]
        for ref, members in order:
            seq = [ref, *[m[0] for m in members]] if rep % 2 == 0 else [*[m[0] for m in members], ref]
            measured: dict[Layout, float] = {}
            for lay in seq:
                t, err = run_one(lay, a.steps, a.timeout)
                row = rows[lay]
                if t is None:
                    row.errors.append(err)
                else:
                    row.times.append(t)
                    measured[lay] = t
                print(f"#   repeat {rep + 1} {lay.name:<48} {fmt(t, '.4f')} s {err}", file=sys.stderr, flush=True)
            for lay in seq:
                row = rows[lay]
                if row.ref is not None and lay in measured and row.ref in measured:
                    row.ratios.append(measured[lay] / measured[row.ref])
    head = (f"{'devices':>7}  {'layout':<48}{'step s':>8}{'÷ ref':>8}{'range':>13}{'target':>8}       "
            "reference (same devices)")  # fmt: skip
    print(head)
    print("-" * len(head))
    out = []
    for lay, row in rows.items():
        step = statistics.median(row.times) if row.times else None
        ratio = statistics.median(row.ratios) if row.ratios else None
        ok = "" if row.target is None or ratio is None else (" ok" if ratio <= row.target else " MISS")
        tgt = f"≤{row.target:.2f}" if row.target is not None else ""
        ref_name = row.ref.name if row.ref else ""
        err = f"  error: {row.errors[-1]}" if row.errors else ""
        spread = f"{min(row.ratios):.2f}-{max(row.ratios):.2f}" if len(row.ratios) > 1 else ""
        print(f"{lay.devices:>7}  {lay.name:<48}{fmt(step, '.4f'):>8}{fmt(ratio, '.3f'):>8}{spread:>13}{tgt:>8}"
              f"{ok:<7}{ref_name}{err}")  # fmt: skip
        out.append({
            "devices": lay.devices, "layout": lay.name, "mesh": {"pipe": lay.pipe, "data": lay.data,
            "tensor": lay.tensor}, "schedule": lay.schedule if lay.pipe > 1 else None, "microbatches": lay.m,
            "virtual": lay.v, "n_layers": lay.layers, "step_s": step, "step_s_runs": row.times,
            "ref": ref_name or None, "ratio": ratio, "ratio_runs": row.ratios, "target": row.target,
            "meets_target": None if not ok else ok.strip() == "ok", "errors": row.errors,
            "steps": a.steps, "repeat": a.repeat, "commit": commit.stdout.strip() or None,
        })  # fmt: skip
    took = time.perf_counter() - t_start
    print(f"# ÷ ref: median over repeats of step / reference step of the same repeat (range: min-max over repeats);"
          f" {took:.0f} s in all; load average now {_load()}")  # fmt: skip
    if a.out:
        a.out.write_text("".join(json.dumps(r) + "\n" for r in out))
    return 1 if any(r["errors"] for r in out) else 0


if __name__ == "__main__":
    sys.exit(main())
