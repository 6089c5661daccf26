"""Activation, gradient and optimizer bytes of meshrun's compiled step against Megatron-LM's count
(a script, not a test; tests/test_memory.py asserts a few of the same figures).

    python bench/memory.py            # the grid below at d_model 256, seq 256, float32 (~25 min on 2 cores)
    python bench/memory.py --quick    # four rows
    python bench/memory.py --dtype bfloat16 --quick

Saved activations per layer and sequence: `meshrun.report.explain.saved_bytes_per_layer`, the double
difference of compiled temp bytes over two depths and two microbatch sizes (working set, gradients
and optimizer temporaries cancel): the bytes live at once (from XLA's buffer-assignment and
live-range dumps), and beside them the same difference of `memory_analysis().temp`, the extent of
the temp allocation, which adds the holes XLA's heap packing leaves (they do not grow with depth but
move by up to a working set between compiles). Megatron's count: Korthikanti et al. 2022 section 4
without dropout (`planner.activations.layer_activation_bytes`); the planner's column is its model of
meshrun's step (`planner.activations.meshrun_layer_bytes`). float32 by default: XLA:CPU computes
bf16 dots in float32 and hoists a float32 copy of each stack of saved bf16 activations out of the
backward loop, which a GPU never does; `--dtype bfloat16` shows that CPU figure.

Then the state bytes per parameter (compiled argument + the per-layer non-activation temp) and the
step time of each remat choice on 8 simulated devices, as ratios to remat=none measured in one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshrun.config import RunConfig, from_dict  # noqa: E402
from meshrun.planner import activations  # noqa: E402
from meshrun.planner.layout import DTYPE_BYTES  # noqa: E402

BASE = {
    "mesh": {"data": 2, "pipe": 1, "tensor": 4},
    "model": {
        "vocab": 1024,
        "d_model": 256,
        "n_layers": 2,
        "n_heads": 8,
        "n_kv_heads": 8,
        "head_dim": 32,
        "d_ff": 1024,
        "max_seq_len": 256,
        "mlp": "gelu",
        "dtype": "float32",
    },  # fmt: skip
    "pipeline": {"schedule": "1f1b", "microbatches": 1},
    "train": {"steps": 3, "global_batch": 2, "seq_len": 256},
    "optimizer": {"warmup_steps": 1},
    "data": {"kind": "synthetic"},
}
SHAPES = {  # name -> model overrides
    "gelu MHA": {"mlp": "gelu", "n_kv_heads": 8, "d_ff": 1024},
    "swiglu GQA": {"mlp": "swiglu", "n_kv_heads": 4, "d_ff": 768},  # 8 query heads on 4 kv heads: TP up to 4
}
QUICK = [("gelu MHA", 4, True, "none"), ("gelu MHA", 4, True, "selective"),
         ("swiglu GQA", 2, False, "none"), ("swiglu GQA", 2, False, "selective")]  # fmt: skip


def config(shape: str, t: int, sp: bool, remat: str, dtype: str) -> RunConfig:
    model = {**BASE["model"], **SHAPES[shape], "dtype": dtype, "remat": remat, "sequence_parallel": sp}
    return from_dict(RunConfig, {**BASE, "mesh": {"data": 8 // t, "pipe": 1, "tensor": t}, "model": model})


def grid(quick: bool):
    if quick:
        return QUICK
    rows = []
    for shape in SHAPES:
        for t in (1, 2, 4):
            for sp in (False, True) if t > 1 else (False,):
                rows += [(shape, t, sp, remat) for remat in ("none", "selective")]
    return rows


def activation_table(rows, dtype: str) -> list[str]:
    from meshrun.report.explain import saved_bytes_per_layer

    out = ["| model | TP | SP | remat | compiled MB/layer | temp extent MB/layer | Megatron's count MB "
           "| compiled / count | planner MB | planner / compiled |",
           "|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    print("\n".join(out), flush=True)
    for shape, t, sp, remat in rows:
        cfg = config(shape, t, sp, remat, dtype)
        m, s, act = cfg.model, cfg.train.seq_len, DTYPE_BYTES[dtype]
        got = saved_bytes_per_layer(cfg)  # the bytes live at once
        ext = saved_bytes_per_layer(cfg, measure="extent")  # memory_analysis().temp: with the packing's holes
        meg = activations.layer_activation_bytes(m, 1, s, t, sp=sp, remat=remat, act=act, dropout=False, flash=False)
        plan = activations.meshrun_layer_bytes(m, 1, s, t, sp=sp, remat=remat, act=act, flash=False)
        row = [shape, str(t), "y" if sp else "n", remat, f"{got / 1e6:.3f}", f"{ext / 1e6:.3f}", f"{meg / 1e6:.3f}",
               f"{got / meg:.2f}", f"{plan / 1e6:.3f}", f"{plan / got:.2f}"]  # fmt: skip
        out.append("| " + " | ".join(row) + " |")
        print(out[-1], flush=True)
    return out


def state_bytes(dtype: str) -> list[str]:
    """Bytes per parameter of one layer's state and its non-activation temporaries on one device
    (depth difference of argument and temp bytes, less the activations), per ZeRO stage, m = 1 and 4."""
    from meshrun.report.explain import compile_step, live_temp, saved_bytes_per_layer

    out = ["| ZeRO | microbatches | argument B/param | temp B/param (grads + optimizer temporaries) |",
           "|---:|---:|---:|---:|"]  # fmt: skip
    print("\n".join(out), flush=True)
    for zero, m in ((0, 1), (1, 1), (1, 4), (3, 4)):
        cfg = config("gelu MHA", 1, False, "selective", dtype)
        cfg = replace(cfg, mesh=replace(cfg.mesh, data=8), train=replace(cfg.train, zero=zero, global_batch=8 * m),
                      pipeline=replace(cfg.pipeline, microbatches=m))  # fmt: skip
        acts = saved_bytes_per_layer(cfg)
        depth = {n: replace(cfg, model=replace(cfg.model, n_layers=n)) for n in (2, 4)}
        ma = {n: compile_step(c)[0].memory_analysis() for n, c in depth.items()}
        live = {n: live_temp(c)["peak"] for n, c in depth.items()}  # temp bytes live at once, as `acts`
        per_layer = 12 * cfg.model.d_model**2 + 2 * cfg.model.d_model  # params of one gelu MHA layer (t = 1)
        arg = (ma[4].argument_size_in_bytes - ma[2].argument_size_in_bytes) / 2 / per_layer
        temp = ((live[4] - live[2]) / 2 - acts) / per_layer
        out.append(f"| {zero} | {m} | {arg:.2f} | {temp:.2f} |")
        print(out[-1], flush=True)
    return out


def step_times(dtype: str, steps: int = 6) -> list[str]:
    """Seconds per step of each remat choice on data2 x tensor4 (mean of the steps after the first)."""
    import jax

    from meshrun.runtime.devices import cpu_devices
    from meshrun.runtime.mesh import build_mesh
    from meshrun.train.step import make_train_step

    out = ["| remat | step s | ratio to none |", "|---|---:|---:|"]
    print("\n".join(out), flush=True)
    base = None
    for remat in ("none", "selective", "full"):
        cfg = config("gelu MHA", 4, True, remat, dtype)
        cfg = replace(cfg, model=replace(cfg.model, n_layers=4), train=replace(cfg.train, global_batch=8))
        mesh = build_mesh(cfg.mesh, devices=cpu_devices(8))
        ts = make_train_step(cfg, mesh)
        state = ts.init()
        tokens = jax.device_put(jax.numpy.ones((8, cfg.train.seq_len), jax.numpy.int32), ts.batch_sharding)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            state, metrics = ts.step(state, tokens, tokens)
            jax.block_until_ready(metrics["loss"])
            times.append(time.perf_counter() - t0)
        sec = sum(times[1:]) / (steps - 1)
        base = base or sec
        out.append(f"| {remat} | {sec:.3f} | {sec / base:.2f} |")
        print(out[-1], flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="four rows of the activation grid")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--skip", nargs="*", default=(), choices=("activations", "state", "time"))
    args = ap.parse_args()
    print(f"d_model 256, seq 256, {args.dtype}, one sequence per microbatch, 8 simulated CPU devices\n")
    if "activations" not in args.skip:
        activation_table(grid(args.quick), args.dtype)
        print()
    if "state" not in args.skip:
        state_bytes(args.dtype)
        print()
    if "time" not in args.skip:
        step_times(args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
