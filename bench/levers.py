"""Memory levers side by side, each measured by `meshrun explain` (a script, not a test).

    python bench/levers.py [CONFIG] [--cluster h100-80g:1x8] [extra section.key=value ...]

One `meshrun explain CONFIG <lever> --json --cluster C` process per row; prints a Markdown table of
compiled device GB and pinned-host GB per device (XLA's memory_analysis, split by memory space),
the step model's predicted device / host GB, and the planner's predicted step time on C.
XLA:CPU elides in-step host transfers, so `offload activations` compiles like `selective` there:
its compiled columns show selective's bytes, the predicted ones what a GPU would hold.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _child  # noqa: E402  (bench/_child.py)

LEVERS = (
    ("none", ["model.remat=none"]),
    ("selective", ["model.remat=selective"]),
    ("full", ["model.remat=full"]),
    ("remat_every=2", ["model.remat=full", "model.remat_every=2"]),
    # the whole-shard host update: its state is an argument of the compiled step (docs/offload.md)
    ("offload optimizer", ["model.remat=selective", "offload.optimizer=true", "offload.update=whole"]),
    ("offload activations", ["model.remat=offload"]),
)


def explain(config: str, over: list[str], cluster: str) -> dict:
    cmd = _child.meshrun("explain", config, *over, "--json", "--cluster", cluster)
    return _child.run_json(cmd, env=_child.env())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default="configs/llama7b_h100.yaml")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--cluster", default="h100-80g:1x8")
    args = ap.parse_args()
    gb = lambda x: f"{x / 1e9:.2f}"
    print(f"{args.config} {' '.join(args.overrides)} on {args.cluster}\n")
    print("| lever | device GB | host GB | predicted device GB | predicted host GB | predicted step s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, over in LEVERS:
        rep = explain(args.config, [*args.overrides, *over], args.cluster)
        cm, pm = rep["memory"]["compiled"], rep["memory"]["predicted"]
        row = [name, gb(cm["device"]), gb(cm["host"]), gb(pm["device"]), gb(pm["host"])]
        print(f"| {' | '.join(row)} | {rep['step_time_s']['predicted']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
