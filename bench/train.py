"""Train-step throughput and compiled memory, parallel layout vs one device (a script, not a test).

    python bench/train.py [--steps 5] [--warmup 2]

For tiny_cpu.yaml (data2 x pipe2 x tensor2, 1F1B m=4), the same dense model with pipe=1 data=4, and
tiny_moe_cpu.yaml (data2 x expert2 x tensor2): tokens/s (median over --steps timed steps after
--warmup untimed ones, real batches from meshrun.data.datasets) and compiled argument + temp bytes per device,
against the same model, global batch and microbatches on ONE device, with the ratios of this run.
Wall-clock on 8 simulated CPU devices sharing 2 cores says little about GPU speed: compare the
ratios within one run only, never absolute times across machines (XLA's default flags; export
XLA_FLAGS=--xla_backend_optimization_level=0 to compile faster and run slower, as the tests do).
"""

from __future__ import annotations

import argparse
import statistics
import time

from meshrun.runtime.devices import simulate_cpu_devices

simulate_cpu_devices(8)

import jax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from meshrun.config import load_config  # noqa: E402
from meshrun.data.datasets import global_batch_arrays, make_dataset  # noqa: E402
from meshrun.parallel.sharding import DP_AXES  # noqa: E402
from meshrun.runtime.devices import cpu_devices  # noqa: E402
from meshrun.runtime.mesh import build_mesh  # noqa: E402
from meshrun.train.step import make_train_step  # noqa: E402

CASES = (
    ("tiny_cpu (d2 p2 t2)", "configs/tiny_cpu.yaml", []),
    ("tiny_cpu pipe=1 (d4 t2)", "configs/tiny_cpu.yaml", ["mesh.pipe=1", "mesh.data=4"]),
    ("tiny_moe_cpu (d2 e2 t2)", "configs/tiny_moe_cpu.yaml", []),
)
ONE_DEVICE = ["mesh.data=1", "mesh.pipe=1", "mesh.tensor=1", "mesh.expert=1"]


def measure(path: str, overrides: list[str], steps: int, warmup: int) -> dict:
    """Compile, warm up, time `steps` steps; tokens/s (median) and compiled argument + temp bytes."""
    cfg = load_config(path, overrides)
    n = cfg.mesh.data * cfg.mesh.pipe * cfg.mesh.tensor * cfg.mesh.expert
    mesh = build_mesh(cfg.mesh, devices=cpu_devices(n))
    train_step = make_train_step(cfg, mesh)
    t = cfg.train
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=t.seq_len, global_batch=t.global_batch)
    batches = [global_batch_arrays(ds, i, mesh, P(DP_AXES)) for i in range(warmup + steps)]
    t0 = time.perf_counter()
    compiled = train_step.step.lower(train_step.abstract_run, *batches[0]).compile()
    compile_s = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    state = train_step.init()
    times = []
    for i, (tokens, labels) in enumerate(batches):
        t0 = time.perf_counter()
        state, metrics = compiled(state, tokens, labels)
        jax.block_until_ready(metrics["loss"])
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return {
        "devices": n,
        "tokens_per_s": t.global_batch * t.seq_len / statistics.median(times),
        "mem": ma.argument_size_in_bytes + ma.temp_size_in_bytes,
        "compile_s": compile_s,
        "loss": float(metrics["loss"]),
        "metrics": {k: float(v) for k, v in metrics.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
    args = ap.parse_args()
    print(__doc__.split("\n\n")[2].replace("\n", " "))
    print()
    head = (
        f"{'layout':<26}{'devs':>5}{'tok/s':>10}{'1-dev tok/s':>12}{'speed ratio':>12}"
        f"{'MiB/dev':>9}{'1-dev MiB':>10}{'mem ratio':>10}"
    )
    print(head)
    print("-" * len(head))
    for name, path, over in CASES:
        par = measure(path, over, args.steps, args.warmup)
        one = measure(path, over + ONE_DEVICE, args.steps, args.warmup)
        print(
            f"{name:<26}{par['devices']:>5}{par['tokens_per_s']:>10.0f}{one['tokens_per_s']:>12.0f}"
            f"{par['tokens_per_s'] / one['tokens_per_s']:>12.2f}{par['mem'] / 2**20:>9.2f}"
            f"{one['mem'] / 2**20:>10.2f}{par['mem'] / one['mem']:>10.2f}",
            flush=True,
        )
    print(
        "\nspeed ratio = parallel tok/s / one-device tok/s; mem ratio = per-device (argument + temp) "
        "compiled bytes, parallel / one device. Simulated CPU devices share 2 cores: ratios of this run only."
    )


if __name__ == "__main__":
    main()
