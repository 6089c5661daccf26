"""ZeRO-1 vs ZeRO-2 per microbatch vs ZeRO-3 per layer (FSDP): step time on 8 simulated CPU devices
(a script, not a test).

    python bench/zero_layer.py [--rounds 5] [--steps 4] [section.key=value ...]

One process builds the steps of train.zero=1, train.zero=2 train.zero2_reduce=microbatch and
train.zero=3 train.zero3_gather=layer on mesh.data=8 (configs/tiny_cpu.yaml with the model of
docs/memory.md's table unless overridden), compiles each, then alternates them: each round times
`--steps` steps of every variant in turn, so a drift of the machine's load moves both sides of a
ratio. Prints each round's median step per variant and its ratio to ZeRO-1, then the median of
the rounds' ratios (the target for ZeRO-3 per layer: <= 1.15x ZeRO-1), the same for the process's
CPU time per step (user + system: steadier than wall time on shared cores, blind to idle cores), and
the compiled step's bytes per device of each (`memory_analysis`: argument + temp).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from meshrun.config import load_config  # noqa: E402
from meshrun.data.datasets import global_batch_arrays, make_dataset  # noqa: E402
from meshrun.parallel.sharding import DP_AXES  # noqa: E402
from meshrun.runtime.mesh import build_mesh  # noqa: E402
from meshrun.train.step import make_train_step  # noqa: E402

BASE = ["mesh.pipe=1", "mesh.data=8", "mesh.tensor=1", "model.d_model=256", "model.d_ff=1024", "model.n_layers=8",
        "data.kind=synthetic", "train.global_batch=16", "pipeline.microbatches=2"]  # fmt: skip
VARIANTS = {
    "ZeRO-1": ["train.zero=1"],
    "ZeRO-2 per microbatch": ["train.zero=2", "train.zero2_reduce=microbatch"],
    "ZeRO-3 per layer": ["train.zero=3", "train.zero3_gather=layer"],
}


def build(over: list[str]):
    cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"), over)
    mesh = build_mesh(cfg.mesh)
    ts = make_train_step(cfg, mesh)
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch)
    batch = global_batch_arrays(ds, 0, mesh, P(DP_AXES))
    mem = ts.step.lower(ts.abstract_run, *batch).compile().memory_analysis()
    state = ts.init()
    state, _ = ts.step(state, *batch)  # compile + warm
    jax.block_until_ready(state)
    return {"ts": ts, "state": state, "batch": batch, "bytes": mem.argument_size_in_bytes + mem.temp_size_in_bytes}


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def time_steps(v: dict, n: int) -> tuple[float, float]:
    """Median wall and process CPU seconds of `n` steps."""
    wall, cpu = [], []
    for _ in range(n):
        t0, c0 = time.perf_counter(), cpu_seconds()
        v["state"], m = v["ts"].step(v["state"], *v["batch"])
        jax.block_until_ready(m["loss"])
        wall.append(time.perf_counter() - t0)
        cpu.append(cpu_seconds() - c0)
    return statistics.median(wall), statistics.median(cpu)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("overrides", nargs="*", metavar="section.key=value")
    a = ap.parse_args()
    runs = {name: build([*BASE, *over, *a.overrides]) for name, over in VARIANTS.items()}
    names = list(VARIANTS)
    print(f"{'round':>5}  " + "  ".join(f"{n + ' ms':>24}" for n in names) + "  " +
          "  ".join(f"{n.split()[0] + ' / ZeRO-1':>16}" for n in names[1:]))  # fmt: skip
    ratios: dict[str, list[float]] = {n: [] for n in names[1:]}
    cpu: dict[str, list[float]] = {n: [] for n in names[1:]}
    for r in range(a.rounds):
        both = {n: time_steps(runs[n], a.steps) for n in names}
        t = {n: w for n, (w, _) in both.items()}
        for n in names[1:]:
            ratios[n].append(t[n] / t["ZeRO-1"])
            cpu[n].append(both[n][1] / both["ZeRO-1"][1])
        print(f"{r + 1:>5}  " + "  ".join(f"{1e3 * t[n]:>24.1f}" for n in names) + "  " +
              "  ".join(f"{ratios[n][-1]:>16.3f}" for n in names[1:]), flush=True)  # fmt: skip
    print()
    for n in names:
        extra = ""
        if n != "ZeRO-1":
            w, c = statistics.median(ratios[n]), statistics.median(cpu[n])
            extra = f"; step time {w:.3f}x ZeRO-1, CPU time {c:.3f}x (medians of rounds)"
        print(f"{n:<22} compiled argument + temp {runs[n]['bytes'] / 1e6:7.1f} MB per device{extra}")
    med = statistics.median(ratios["ZeRO-3 per layer"])
    print(f"ZeRO-3 per layer / ZeRO-1 = {med:.3f}x ({'within' if med <= 1.15 else 'NOT within'} the 1.15x target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
