"""`meshrun plot RUN_DIR [RUN_DIR ...] [--out FILE]`: loss, val_loss, lr and throughput of one or more
runs, from each RUN_DIR/metrics.jsonl, as one PNG (one line per run). Needs matplotlib (the `plot` extra)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from meshrun.errors import MATPLOTLIB_FIX, ConfigError


def register(sub) -> None:
    p = sub.add_parser(
        "plot",
        help="draw runs' loss, val_loss, lr and throughput to a PNG (needs matplotlib)",
        description="Draw loss, val_loss, learning rate and tokens/s of one or more runs from their "
        "metrics.jsonl into one PNG, one line per run.",
        epilog="examples:\n  meshrun plot runs/tiny\n  meshrun plot runs/quickstart-* --out compare.png",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="train.run_dir(s) holding metrics.jsonl")
    p.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="PNG to write (default RUN_DIR/metrics.png; with several runs, the first's metrics-compare.png)",
    )
    p.set_defaults(func=run_plot)


def _row(raw: bytes) -> dict | None:
    """One metrics.jsonl line as a row with an integer step; None for a line cut off by a kill, bytes
    that are not UTF-8, or a row whose step is not a whole number."""
    try:
        row = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return row if isinstance(step, int) and not isinstance(step, bool) else None


def read_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl's rows; a resumed run's rows of a step seen twice keep the later one. Lines that
    are not a row with an integer step are skipped; none left -> ConfigError."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(
            "RUN_DIR", str(run_dir), "give a train.run_dir that a `meshrun train` wrote", "no metrics.jsonl"
        )
    rows: dict[int, dict] = {}
    for raw in path.read_bytes().splitlines():
        row = _row(raw)
        if row is not None:
            rows[row["step"]] = {**rows.get(row["step"], {}), **row}
    if not rows:
        raise ConfigError("RUN_DIR", str(run_dir), "give a train.run_dir that a `meshrun train` wrote",
                          f"{path} holds no metrics row (a JSON object with an integer step)")  # fmt: skip
    return [rows[s] for s in sorted(rows)]


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]
    return [s for s, _ in pts], [v for _, v in pts]


def run_plot(args) -> int:
    run_dirs = [Path(d) for d in args.run_dirs]
    runs = [(d, read_rows(d)) for d in run_dirs]
    default = "metrics.png" if len(runs) == 1 else "metrics-compare.png"
    out = Path(args.out) if args.out else run_dirs[0] / default
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError("--out", str(out), MATPLOTLIB_FIX, "matplotlib is not installed") from e
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for run_dir, rows in runs:
        name = f"{run_dir.name}: " if len(runs) > 1 else ""
        for key in ("loss", "val_loss"):
            x, y = _series(rows, key)
            if x:
                axes[0].plot(x, y, label=name + key, marker="o" if key == "val_loss" else None, markersize=3)
        axes[1].plot(*_series(rows, "lr"), label=run_dir.name)
        axes[2].plot(*_series(rows[1:], "tokens_per_s"), label=run_dir.name)  # step 1 may hold warm-up
    axes[0].set(title="loss", xlabel="step")
    if axes[0].get_legend_handles_labels()[0]:  # no loss at all: no legend (and no matplotlib warning)
        axes[0].legend()
    axes[1].set(title="learning rate", xlabel="step")
    axes[2].set(title="tokens/s", xlabel="step")
    fig.suptitle(str(run_dirs[0]) if len(runs) == 1 else f"{len(runs)} runs")
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=80)
    except OSError as e:
        raise ConfigError("--out", str(out), "use a writable file path", f"cannot write the PNG ({e.strerror})") from e
    finally:
        plt.close(fig)
    steps = ", ".join(str(len(rows)) for _, rows in runs)
    print(f"wrote {out} ({steps} steps)", file=sys.stderr)
    return 0
