"""`meshrun profile CONFIG [section.key=value ...] [--steps N] [--out DIR] [--json]`: a thin shell over
`meshrun.report.profile` (trace N steps, report busy/idle/collective time per pipeline stage)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from meshrun.config import check_device_count, load_config, load_mesh
from meshrun.errors import ConfigError
from meshrun.runtime.devices import add_fast_compile_flag
from meshrun.runtime.distributed import start_command


def register(sub) -> None:
    p = sub.add_parser("profile", help="trace a few train steps: busy/idle/collective time and the bubble per stage")
    p.add_argument("config", help="YAML config, e.g. configs/tiny_cpu.yaml")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="config overrides, e.g. mesh.tensor=2 train.steps=10 (keys: `meshrun config`)",
    )
    p.add_argument("--steps", type=int, default=3, help="steps to trace, after one untraced step (default 3)")
    p.add_argument("--out", help="trace directory (default RUN_DIR/profile); profile.json is written there")
    p.add_argument("--devices", type=int, default=None, help="simulated CPU devices (as `meshrun train --devices`)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    add_fast_compile_flag(p)
    p.set_defaults(func=run_profile)


MAX_STEPS = 100  # a trace holds every op of every step: more would run long and overflow its event cap


def run_profile(args) -> int:
    check_device_count("--devices", args.devices)  # 0 is a value, not "not given"
    args.devices = args.devices or 0
    if not 1 <= args.steps <= MAX_STEPS:
        raise ConfigError("--steps", args.steps, f"trace 1..{MAX_STEPS} steps, e.g. --steps 3", "out of range")
    start_command(load_mesh(args.config, args.overrides), args, "profile")  # before a family's module imports jax
    cfg = load_config(args.config, args.overrides)
    from meshrun.analysis.trace import format_report  # imports jax: only once the devices are set up
    from meshrun.report.profile import profile

    out = Path(args.out) if args.out else Path(cfg.train.run_dir) / "profile"
    rep = profile(cfg, args.steps, out)
    print(json.dumps(rep) if args.json else format_report(rep, str(args.config)))
    print(trace_hint(out), file=sys.stderr)
    if rep.get("timeline_png"):
        print(f"timeline: {rep['timeline_png']} (one traced step per device: forward, backward, weight "
              "gradient, collective; white is idle)", file=sys.stderr)  # fmt: skip
    else:
        print(f"meshrun profile: note: no timeline picture: {rep.get('timeline_note')}", file=sys.stderr)
    return 0


def trace_hint(out: Path) -> str:
    """Where the trace is and how to look at it (the newest Perfetto file jax.profiler wrote)."""
    traces = sorted(out.rglob("*perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    where = traces[-1] if traces else out
    return (
        f"trace: {where}\n"
        "  open it at https://ui.perfetto.dev (Open trace file), or `tensorboard --logdir "
        f"{out}` (Profile tab)"
    )
