"""bf16 vs fp8 (tensorwise, delayed, blockwise) on the tiny model and real text, one device (a script, not a test).

    python bench/fp8.py [--steps 300] [--recipes none,blockwise] [--plot docs/fp8_loss.png] [--json out.json]

tiny_cpu.yaml's model (d_model 64, 4 layers) in bfloat16 compute on byte-level text (data.kind=text:
the Python standard library's sources), one CPU device, the same batches for every recipe: the loss
at fixed steps, the final-loss gap to bf16 (mean of the last 20 steps), NaN/Inf count, median step
time and compiled argument + temp bytes. blockwise runs with model.fp8_block=64 (d_ff 192 is not a
multiple of 128). XLA:CPU has no fp8 GEMMs: it upcasts the e4m3/e5m2 operands
to float32 (the same products and float32 sums as an fp8 tensor core, in emulation), so fp8 is
SLOWER here, by the casts and amax reductions, and its memory is not what a GPU would use; only the
numerics carry over. Wall-clock is noisy on a shared machine: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import jax
from jax.sharding import PartitionSpec as P

from meshrun.config import load_config
from meshrun.data.datasets import global_batch_arrays, make_dataset
from meshrun.parallel.sharding import DP_AXES
from meshrun.runtime.mesh import build_mesh
from meshrun.train.step import make_train_step

RECIPES = ("none", "tensorwise", "delayed", "blockwise")
EXTRA = {"blockwise": ["model.fp8_block=64"]}
BASE = ["mesh.data=1", "mesh.pipe=1", "mesh.tensor=1", "mesh.expert=1", "pipeline.microbatches=1",
        "model.dtype=bfloat16", "data.kind=text", "checkpoint.every=0"]  # fmt: skip
AT = (1, 50, 100, 200, 300)


def run(recipe: str, steps: int) -> dict:
    over = [*BASE, f"model.fp8={recipe}", *EXTRA.get(recipe, []), f"train.steps={steps}"]
    cfg = load_config("configs/tiny_cpu.yaml", over)
    mesh = build_mesh(cfg.mesh, devices=jax.devices()[:1])
    ts = make_train_step(cfg, mesh)
    t = cfg.train
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=t.seq_len, global_batch=t.global_batch)
    first = global_batch_arrays(ds, 0, mesh, P(DP_AXES))
    compiled = ts.step.lower(ts.abstract_run, *first).compile()
    ma = compiled.memory_analysis()
    state, losses, times = ts.init(), [], []
    for i in range(steps):
        batch = global_batch_arrays(ds, i, mesh, P(DP_AXES))
        t0 = time.perf_counter()
        state, metrics = compiled(state, *batch)
        losses.append(float(metrics["loss"]))  # blocks until the step is done
        times.append(time.perf_counter() - t0)
    return {
        "losses": losses,
        "step_s": statistics.median(times[2:] or times),
        "bytes": ma.argument_size_in_bytes + ma.temp_size_in_bytes,
        "nonfinite": sum(not math.isfinite(x) for x in losses),
    }


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for recipe, r in results.items():
        ax.plot(
            range(1, len(r["losses"]) + 1), r["losses"], label="bf16" if recipe == "none" else f"fp8 {recipe}", lw=1
        )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte)")
    ax.set_title("tiny_cpu model on byte-level text, one CPU device (fp8 emulated)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--plot", default="", help="write the loss curves here (PNG)")
    ap.add_argument("--json", default="", help="write the losses and figures here")
    ap.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated, bf16's 'none' first")
    args = ap.parse_args()
    results = {r: run(r, args.steps) for r in args.recipes.split(",")}
    base = results["none"]
    tail = lambda r: statistics.fmean(r["losses"][-20:])
    at = [s for s in AT if s <= args.steps]
    head = f"{'recipe':<12}" + "".join(f"{'loss@' + str(s):>10}" for s in at)
    head += f"{'final gap':>11}{'NaN/Inf':>9}{'step ms':>9}{'x bf16':>8}{'MiB':>8}"
    print(head)
    print("-" * len(head))
    for name, r in results.items():
        row = f"{'bf16' if name == 'none' else name:<12}" + "".join(f"{r['losses'][s - 1]:>10.4f}" for s in at)
        gap = tail(r) / tail(base) - 1
        row += f"{gap:>+10.2%} {r['nonfinite']:>8}{r['step_s'] * 1e3:>9.1f}{r['step_s'] / base['step_s']:>8.2f}"
        print(row + f"{r['bytes'] / 2**20:>8.2f}")
    print("\nfinal gap: mean loss of the last 20 steps vs bf16's. CPU emulation: fp8 is slower here, not faster.")
    if args.plot:
        plot(results, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
