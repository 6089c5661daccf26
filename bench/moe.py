"""MoE dispatch: capacity routing vs dropless, step time and memory per layout (a script, not a test).

    python bench/moe.py [--steps 5] [--warmup 2]

tiny_moe_cpu.yaml (4 experts, top-2, every other layer MoE, global batch 16 x 64 tokens) on
data2 x expert2 x tensor2 and on one device, each with `model.moe_dispatch=capacity`
at capacity_factor 2.0 (= E/k: nothing can drop) and 1.25 (drops), and `dropless`: step time (median
of --steps after --warmup), compiled argument + temp bytes per device, dropped (token, choice)
assignments in the last step. Dropless moves fixed worst-case all_to_all buffers under expert
parallelism (ragged_all_to_all is not implemented on XLA:CPU), and XLA:CPU runs ragged_dot as a
masked dense matmul over the local experts, so CPU figures overstate its cost against a GPU's grouped
GEMM. Simulated CPU devices share the host's cores: compare ratios within one run only.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import ONE_DEVICE, measure  # noqa: E402  (bench/train.py; simulates 8 CPU devices on import)

CONFIG = "configs/tiny_moe_cpu.yaml"
LAYOUTS = (
    ("d2 e2 t2", []),
    ("1 device", ONE_DEVICE),
)
DISPATCHES = (
    ("capacity cf=2", ["model.moe_dispatch=capacity", "model.capacity_factor=2.0"]),
    ("capacity cf=1.25", ["model.moe_dispatch=capacity", "model.capacity_factor=1.25"]),
    ("dropless", ["model.moe_dispatch=dropless"]),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
    args = ap.parse_args()
    print(" ".join(__doc__.split("\n\n")[2].split()))
    print()
    head = f"{'layout':<10}{'dispatch':<18}{'step ms':>9}{'tok/s':>9}{'MiB/dev':>9}{'dropped':>9}{'vs cf=2':>9}"
    print(head)
    print("-" * len(head))
    for layout, over in LAYOUTS:
        base = None
        for name, dispatch in DISPATCHES:
            r = measure(CONFIG, over + dispatch, args.steps, args.warmup)
            step_ms = 1e3 * 16 * 64 / r["tokens_per_s"]
            base = base or step_ms
            print(
                f"{layout:<10}{name:<18}{step_ms:>9.1f}{r['tokens_per_s']:>9.0f}{r['mem'] / 2**20:>9.2f}"
                f"{r['metrics']['dropped_tokens']:>9.0f}{step_ms / base:>9.2f}",
                flush=True,
            )
    print("\nvs cf=2 = step time / step time of capacity routing at capacity_factor 2.0 on the same layout.")


if __name__ == "__main__":
    main()
