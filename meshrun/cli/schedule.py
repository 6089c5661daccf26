"""`meshrun schedule`: print a pipeline schedule as a text chart (or JSON, or a PNG) with its bubble."""

from __future__ import annotations

import json

from meshrun.errors import MATPLOTLIB_FIX, ConfigError
from meshrun.pipeline import registry
from meshrun.pipeline import schedules as S


def register(subparsers) -> None:
    p = subparsers.add_parser("schedule", help="show a pipeline schedule table and its bubble fraction")
    p.add_argument("--pipe", type=int, required=True, metavar="P", help="pipeline stages p")
    p.add_argument("--microbatches", type=int, required=True, metavar="M", help="microbatches m per step")
    p.add_argument("--schedule", default="1f1b", choices=registry.names(), help="pipeline schedule (default 1f1b)")
    p.add_argument(
        "--virtual",
        type=int,
        default=None,
        metavar="V",
        help="virtual chunks per stage (schedules whose chunk count is free; default: the schedule's)",
    )
    p.add_argument("--lockstep", action="store_true", help="show the lockstep (fwd, bwd) per tick view")
    p.add_argument(
        "--per-op",
        action="store_true",
        help="show what pipeline.executor=per_op plays (each backward split into B and W, F = B = W)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--png", default=None, metavar="FILE", help="draw the per-op timeline (needs matplotlib)")
    p.set_defaults(func=run_schedule)


MAX_CELLS = 2**14  # p*m*v: p=16, m=256, v=4 answers in ~2 s on one shared CPU core


def _label(op, v: int):
    return None if op is None else op.label(v)


def run_schedule(args) -> int:
    sched = registry.get(args.schedule, "--schedule")
    p, m = args.pipe, args.microbatches
    v = args.virtual if args.virtual is not None else sched.chunks_of(1)
    per_op = _check_args(args, sched, p, m, v)
    executor = "per_op" if per_op else "lockstep"
    table = sched.table(p, m, v, executor)
    bubble = S.bubble_fraction(table, 1.0, 1.0, 1.0) if per_op else S.bubble_fraction(table)  # F = 1, B + W = 2
    shown = S.lockstep(table) if args.lockstep else table
    in_flight = [S.max_in_flight(shown, s) for s in range(p)]
    if args.png:
        cost = "F=B=W" if per_op else "F=1, B+W=2"
        draw_png(table, v, args.png, f"{args.schedule} p={p} m={m} v={v}: bubble {bubble:.1%} ({cost})")
    if args.json:
        cells = [
            [[_label(c.fwd, v), _label(c.bwd, v)] if args.lockstep else _label(c, v) for c in row] for row in shown
        ]
        out = {
            "ticks": len(shown),
            "bubble_fraction": bubble,
            "table": cells,
            "schedule": args.schedule,
            "pipe": p,
            "microbatches": m,
            "virtual": v,
            "lockstep": bool(args.lockstep),
            "bubble_closed_form": sched.bubble(p, m, v, executor),
            "per_op": per_op,
            "max_in_flight": in_flight,
        }
        print(json.dumps(out))
        return 0
    _print_text(args, sched, shown, (p, m, v), bubble, per_op, in_flight)
    return 0


def _check_args(args, sched, p: int, m: int, v: int) -> bool:
    """Bounds on p, m, v and the executor flags; returns whether the per-op timeline is shown."""
    for flag, n in (("--pipe", p), ("--microbatches", m), ("--virtual", v)):
        if n > MAX_CELLS:  # below 1: the schedule's own check names the field
            raise ConfigError(flag, n, f"use a whole number in [1, {MAX_CELLS}]", "out of range")
    # building and checking the table grows faster than p*m*v: bound the answer time
    if p > 0 and m > 0 and v > 0 and p * m * v > MAX_CELLS:
        raise ConfigError(
            "--microbatches", m, f"keep pipe x microbatches x virtual <= {MAX_CELLS} (got {p * m * v})", "too large"
        )
    per_op = args.per_op or "lockstep" not in sched.executors
    if args.per_op and "per_op" not in sched.executors:
        runs = [n for n, s in registry.SCHEDULES.items() if "per_op" in s.executors]
        fix = f"drop --per-op or use --schedule {' or '.join(runs)}"
        why = f"the per-op executor runs {', '.join(runs)} only"
        raise ConfigError("--per-op", True, fix, why)
    if args.lockstep and per_op:
        raise ConfigError(
            "--lockstep", True, "drop --lockstep: the per-op executor runs its per-op timeline as is (one op per tick)"
        )
    return per_op


def _print_text(args, sched, shown, pmv: tuple[int, int, int], bubble: float, per_op: bool, in_flight) -> None:
    """The text chart, its bubble against the closed form, and the in-flight bound per stage."""
    p, m, v = pmv
    executor = "per_op" if per_op else "lockstep"
    view = "lockstep (fwd+bwd per tick)" if args.lockstep else "per-op timeline"
    print(f"schedule {args.schedule}  p={p}  m={m}  v={v}  {view}: {len(shown)} ticks")
    print(S.render(shown, v))
    closed = sched.bubble(p, m, v, executor)
    cost = "F = B = W" if per_op else "backward = 2 x forward"
    print(f"bubble fraction ({cost}): {bubble:.4f}  closed form {closed:.4f}")
    whole = sched.timeline(p, m, v, "lockstep") if per_op else None
    if whole is not None and not any(op is not None and op.kind == "W" for row in whole for op in row):
        same = S.bubble_fraction(whole)
        print(f"{sched.title}'s order with whole backwards (F = 1, B = 2) at the same p, m: {same:.4f}")
    print(f"max in-flight microbatch chunks per stage: {in_flight}")


def draw_png(table, v: int, path: str, title: str) -> None:
    """Gantt chart of the per-op timeline: forward blue, backward orange, weight-gradient green, each
    op as wide as its cost (F = 1; B = 2 when it includes W, else B = W = 1); a tick lasts as long as its
    longest op (the lockstep executor), so the gaps are idle time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError("--png", path, MATPLOTLIB_FIX, "matplotlib is not installed") from e
    p = len(table[0])
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(table)), 0.5 * p + 1.2))
    colors = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
    split_w = any(op is not None and op.kind == "W" for row in table for op in row)
    width = {"F": 1.0, "B": 1.0 if split_w else 2.0, "W": 1.0}
    starts = [0.0]
    for row in table:
        starts.append(starts[-1] + max((width[op.kind] for op in row if op is not None), default=1.0))
    for t, row in enumerate(table):
        for s, op in enumerate(row):
            if op is None:
                continue
            alpha = 1.0 - 0.5 * op.chunk / max(v - 1, 1)
            w = width[op.kind]
            ax.barh(s, w, left=starts[t], color=colors[op.kind], alpha=alpha, edgecolor="black", linewidth=0.3)
            ax.text(starts[t] + w / 2, s, op.label(v), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
    ax.set_xlim(0, starts[-1])
    ax.invert_yaxis()
    ax.set_xlabel("time (F = 1)")
    ax.set_title(title)
    try:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    except OSError as e:
        raise ConfigError("--png", path, "use a writable file path", f"cannot write the PNG ({e.strerror})") from e
    finally:
        plt.close(fig)
