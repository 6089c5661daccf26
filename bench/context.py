"""Context parallelism on 8 simulated CPU devices: memory per device and step time for c = 1, 2, 4, 8
and both kinds (a script, not a test).

    python bench/context.py [--mem-len 16384] [--time-len 2048] [--cs 1 2 4 8] [--repeats 3]

Each row is the mesh data = 8/c x context = c with one sequence per data shard (global batch 8/c),
so every device holds L/c tokens of one sequence: the c = 1 row is plain data parallelism over whole
sequences. Memory: the compiled train step's temp bytes per device (`memory_analysis()`) at
`--mem-len` tokens, remat none (the probabilities of the all-gather kind, (L/c) x L per head, are
kept as Megatron keeps them), compiled only; the ratio column is temp(c) / (temp(1) / c), 1.0 when
the bytes fall exactly as 1/c. Time: the median step at `--time-len` tokens, and tokens per second
per device. On simulated devices the 8 "devices" share the host's cores and a collective is a
memory copy: the time columns compare the arithmetic each layout does (the ring kind skips the
fully masked half of its blocks), not a GPU's overlap of the ring's sends with block compute.
"""

from __future__ import annotations

import argparse
import statistics
import time

from meshrun.runtime.devices import simulate_cpu_devices

simulate_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from meshrun.config import load_config  # noqa: E402
from meshrun.data.datasets import global_batch_arrays, make_dataset  # noqa: E402
from meshrun.parallel.sharding import DP_AXES  # noqa: E402
from meshrun.runtime.mesh import build_mesh  # noqa: E402
from meshrun.train.step import make_train_step  # noqa: E402

MODEL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=16",
         "model.d_ff=192", "model.remat=none", "data.kind=synthetic", "pipeline.microbatches=1", "mesh.pipe=1",
         "mesh.tensor=1"]  # fmt: skip


def config(length: int, c: int, kind: str):
    over = [*MODEL, f"train.seq_len={length}", f"model.max_seq_len={length}", f"mesh.context={c}",
            f"mesh.data={8 // c}", f"train.global_batch={8 // c}", f"model.context_parallel={kind}"]  # fmt: skip
    return load_config("configs/tiny_cpu.yaml", over)


def temp_bytes(length: int, c: int, kind: str) -> int:
    cfg = config(length, c, kind)
    train_step = make_train_step(cfg, build_mesh(cfg.mesh))
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, length), np.int32, sharding=train_step.batch_sharding)
    return train_step.step.lower(train_step.abstract_run, batch, batch).compile().memory_analysis().temp_size_in_bytes


def step_time(length: int, c: int, kind: str, repeats: int) -> float:
    cfg = config(length, c, kind)
    mesh = build_mesh(cfg.mesh)
    train_step = make_train_step(cfg, mesh)
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=length, global_batch=cfg.train.global_batch)
    state = train_step.init()
    times = []
    for i in range(repeats + 1):
        tok, lab = global_batch_arrays(ds, i, mesh, jax.sharding.PartitionSpec(DP_AXES))
        t = time.perf_counter()
        state, metrics = train_step.step(state, tok, lab)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])  # the first call compiles


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mem-len", type=int, default=16384)
    ap.add_argument("--time-len", type=int, default=2048)
    ap.add_argument("--cs", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--kinds", nargs="+", default=["allgather", "ring"])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"data = 8/c x context = c, one sequence per data shard; memory at {args.mem_len} tokens, time at "
          f"{args.time_len} tokens (d_model 64, 2 layers, 4 heads / 2 kv heads, fp32, remat none)")  # fmt: skip
    print(f"{'kind':>9} {'c':>2} {'temp MB/device':>15} {'vs 1/c of c=1':>14} {'step s':>8} {'tok/s/device':>13}")
    base = None
    for kind in args.kinds:
        for c in args.cs:
            if c == 1 and kind != args.kinds[0]:
                continue  # c = 1 has no context attention: one row
            mem = temp_bytes(args.mem_len, c, kind)
            base = mem if c == 1 else base
            ratio = f"{mem / (base / c):.2f}" if base else "-"
            t = step_time(args.time_len, c, kind, args.repeats)
            tok = (8 // c) * args.time_len / t / 8
            name = "none" if c == 1 else kind
            print(f"{name:>9} {c:>2} {mem / 2**20:>15.1f} {ratio:>14} {t:>8.3f} {tok:>13.0f}", flush=True)


if __name__ == "__main__":
    main()
