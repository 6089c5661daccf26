"""`meshrun plot RUN_DIR [--out FILE]`: loss, val_loss, lr and throughput of a run, from
RUN_DIR/metrics.jsonl, as one PNG (default RUN_DIR/metrics.png). Needs matplotlib (`meshrun[plot]`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from meshrun.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser("plot", help="draw a run's loss, val_loss, lr and throughput to a PNG (needs matplotlib)")
    p.add_argument("run_dir", help="a train.run_dir holding metrics.jsonl")
    p.add_argument("--out", default=None, metavar="FILE", help="PNG to write (default RUN_DIR/metrics.png)")
    p.set_defaults(func=run_plot)


def read_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl's rows; a resumed run's rows of a step seen twice keep the later one."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(
            "RUN_DIR", str(run_dir), "give a train.run_dir that a `meshrun train` wrote", "no metrics.jsonl"
        )
    rows: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut off by a kill
        if isinstance(row, dict) and "step" in row:
            rows[int(row["step"])] = {**rows.get(int(row["step"]), {}), **row}
    return [rows[s] for s in sorted(rows)]


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]
    return [s for s, _ in pts], [v for _, v in pts]


def run_plot(args) -> int:
    run_dir = Path(args.run_dir)
    rows = read_rows(run_dir)
    out = Path(args.out) if args.out else run_dir / "metrics.png"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError("meshrun plot", str(out), "pip install 'meshrun[plot]'", "matplotlib is not installed") from e
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for key in ("loss", "val_loss"):
        x, y = _series(rows, key)
        if x:
            axes[0].plot(x, y, label=key, marker="o" if key == "val_loss" else None, markersize=3)
    axes[0].set(title="loss", xlabel="step")
    axes[0].legend()
    x, y = _series(rows, "lr")
    axes[1].plot(x, y)
    axes[1].set(title="learning rate", xlabel="step")
    x, y = _series(rows[1:], "tokens_per_s")  # step 1 of an attempt may hold warm-up
    axes[2].plot(x, y)
    axes[2].set(title="tokens/s", xlabel="step")
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=80)
    except OSError as e:
        raise ConfigError("--out", str(out), "use a writable file path", f"cannot write the PNG ({e.strerror})") from e
    finally:
        plt.close(fig)
    print(f"wrote {out} ({len(rows)} steps)", file=sys.stderr)
    return 0
