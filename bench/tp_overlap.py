"""model.tp_comm_overlap on 8 simulated CPU devices: the train step with the TP matmuls as rings
against the same layout with sequence parallelism's all-gathers and reduce-scatters (a script, not
a test).

    python bench/tp_overlap.py [--repeats 3] [--steps 8]

Each layout runs with sequence parallelism, once without and once with model.tp_comm_overlap, in
one process; within a repeat both run `--steps` steps (the order flips every other repeat) and a
ratio is the median over repeats of (overlap / plain) median step seconds. On simulated devices a
collective is a memory copy on shared cores and nothing runs beside a matmul: the ratio measures
what the rings add (t - 1 permutes per collective, per-chunk matmuls, in a pipeline the idle cells'
compute), not the overlap a GPU gets. Model: d_model 256, 4 layers, 8 heads x 32, d_ff 1024, seq
256, float32, synthetic data, global batch 16.
"""

from __future__ import annotations

import argparse
import statistics
import time

from meshrun.runtime.devices import simulate_cpu_devices

simulate_cpu_devices(8)

import jax  # noqa: E402

from meshrun.config import load_config  # noqa: E402
from meshrun.data.datasets import global_batch_arrays, make_dataset  # noqa: E402
from meshrun.parallel.sharding import DP_AXES  # noqa: E402
from meshrun.runtime.mesh import build_mesh  # noqa: E402
from meshrun.train.step import make_train_step  # noqa: E402

MODEL = ["model.d_model=256", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=8", "model.head_dim=32",
         "model.d_ff=1024", "model.max_seq_len=256", "train.seq_len=256", "train.global_batch=16",
         "data.kind=synthetic", "model.sequence_parallel=true"]  # fmt: skip
LAYOUTS = {
    "data2 tensor4": ["mesh.data=2", "mesh.pipe=1", "mesh.tensor=4", "pipeline.microbatches=1"],
    "data2 pipe2 tensor2 1f1b m4": ["mesh.data=2", "mesh.pipe=2", "mesh.tensor=2", "pipeline.microbatches=4"],
    "pipe2 tensor4 interleaved v2 m4": ["mesh.data=1", "mesh.pipe=2", "mesh.tensor=4", "pipeline.microbatches=4",
                                        "pipeline.schedule=interleaved", "pipeline.virtual=2"],
}  # fmt: skip


def stepper(over: list[str]):
    """(run n steps -> median step seconds) of a compiled, warmed-up train step."""
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs/tiny_cpu.yaml", [*MODEL, *over])
    mesh = build_mesh(cfg.mesh)
    step = make_train_step(cfg, mesh)
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch)
    batch = global_batch_arrays(ds, 0, mesh, jax.sharding.PartitionSpec(DP_AXES))
    state = step.init()
    state, m = step.step(state, *batch)
    jax.block_until_ready(m)

    def run(n: int) -> float:
        nonlocal state
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            state, m = step.step(state, *batch)
            jax.block_until_ready(m)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    print(f"{'layout':<34}{'plain s':>10}{'rings s':>10}{'rings/plain':>13}")
    for name, over in LAYOUTS.items():
        plain, ring = stepper(over), stepper([*over, "model.tp_comm_overlap=true"])
        rows = []
        for r in range(args.repeats):
            pair = (plain, ring) if r % 2 == 0 else (ring, plain)
            a, b = (f(args.steps) for f in pair)
            rows.append((a, b) if r % 2 == 0 else (b, a))
        p, q = statistics.median(x for x, _ in rows), statistics.median(y for _, y in rows)
        ratio = statistics.median(y / x for x, y in rows)
        print(f"{name:<34}{p:>10.4f}{q:>10.4f}{ratio:>13.2f}", flush=True)


if __name__ == "__main__":
    main()
