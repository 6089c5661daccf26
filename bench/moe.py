"""MoE dispatch: capacity routing vs dropless, step time and memory per layout (a script, not a test).

    python bench/moe.py [--steps 5] [--warmup 2] [--only dispatch|fine] [--rounds 5] [--size D[xN] ...]
                        [--one-device] [--granularity G ...]

tiny_moe_cpu.yaml (4 experts, top-2, every other layer MoE, global batch 16 x 64 tokens) on
data2 x expert2 x tensor2 and on one device, each with `model.moe_dispatch=capacity`
at capacity_factor 2.0 (= E/k: nothing can drop) and 1.25 (drops), and `dropless`: step time (median
of --steps after --warmup), compiled argument + temp bytes per device, dropped (token, choice)
assignments in the last step. Under expert parallelism dropless all-gathers the expert group's
tokens and runs its experts on worst-case buffers (ragged_all_to_all is not implemented on XLA:CPU),
and XLA:CPU runs ragged_dot as a masked dense matmul over the local experts, so CPU figures overstate
its cost against a GPU's grouped GEMM. Simulated CPU devices share the host's cores: compare ratios within one run only.

Fine-grained MoE vs dense: tiny_deepseek_cpu.yaml reshaped to 2 MoE layers on data2 x expert4, each of
64 experts of width d_ff/8, top-8, and 1 shared expert, beside the dense model of equal active FFN width
(9 d_ff/8; the router's d_model * 64 per token is extra), at d_model 128 (d_ff 512) and the 16 x 64 tokens
of a step, or with --size D[xN] at d_model D (d_ff 4D) and N x the tokens; --one-device: one device's
share of the step (1/8 of the batch, routed among the 16 experts of one expert rank) on one device;
--granularity G: 8G experts of width d_ff/G, top-G, 1 shared of that width, beside the dense width
(G + 1) d_ff/G (8: the fine-grained MoE; 2: 16 experts of width d_ff/2, top-2).
Median ms/step and CPU ms/step over --rounds alternated rounds of --steps steps each (one untimed step
per round first). At the default size an expert GEMM is a few KFLOP: the step measures per-op and
collective overhead; the larger sizes show the trend (a real MoE step has thousands of tokens per
expert group: 2048 at N = 4).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

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

FINE_CONFIG = "configs/tiny_deepseek_cpu.yaml"
FINE_MESH = ["mesh.data=2", "mesh.expert=4", "mesh.tensor=1", "model.n_layers=2", "model.first_dense_layers=0",
             "model.route_groups=0", "model.route_group_limit=0"]  # fmt: skip
FINE_TOKENS = 16 * 64  # tiny_deepseek_cpu.yaml's global batch x seq_len: --size's token factor 1


def fine_cases(d_model: int = 128, tokens: int = 1, one: bool = False, gran: int = 8) -> tuple[tuple[str, list], ...]:
    """The MoE of granularity `gran` at d_model (d_ff = 4 d_model; 8 gran experts of width d_ff/gran,
    top-gran, 1 shared of that width: 8 is the fine-grained 64 x d_ff/8, top-8) and its dense twin of
    equal active FFN width ((gran + 1) d_ff/gran), `tokens` x the global batch of 16 x 64.
    `one`: one device's share on one device (1/8 of the batch; the MoE with the 2 gran experts of one
    expert rank, so its buffers and expert GEMMs have the shapes of one device of data2 x expert4)."""
    f, batch, w = 4 * d_model, (2 if one else 16) * tokens, 4 * d_model // gran
    base = [*FINE_MESH, f"model.d_model={d_model}", f"model.d_ff={f}", f"train.global_batch={batch}"]
    base += ["mesh.data=1", "mesh.expert=1"] if one else []
    moe = [*base, f"model.n_experts={(2 if one else 8) * gran}", f"model.moe_d_ff={w}", f"model.top_k={gran}",
           "model.n_shared_experts=1"]  # fmt: skip
    dense = [*base, "model.n_experts=0", "model.moe_d_ff=0", "model.n_shared_experts=0", f"model.d_ff={(gran + 1) * w}",
             "model.balance=aux_loss", "model.router_score=softmax"]  # fmt: skip
    return (
        (f"dense d_ff={(gran + 1) * w}", dense),
        ("MoE dropless", [*moe, "model.moe_dispatch=dropless"]),
        ("MoE capacity cf=1.25", [*moe, "model.moe_dispatch=capacity", "model.capacity_factor=1.25"]),
    )


def stepper(path: str, overrides: list[str]):
    """A compiled train step on one fixed batch: a callable that runs one step and returns its seconds."""
    import jax  # after bench/train.py has set up the simulated devices
    from jax.sharding import PartitionSpec as P

    from meshrun.config import load_config
    from meshrun.data.datasets import global_batch_arrays, make_dataset
    from meshrun.parallel.sharding import DP_AXES
    from meshrun.runtime.devices import cpu_devices
    from meshrun.runtime.mesh import build_mesh
    from meshrun.train.step import make_train_step

    cfg = load_config(path, overrides)
    mesh = build_mesh(cfg.mesh, devices=cpu_devices(cfg.mesh.data * cfg.mesh.expert * cfg.mesh.tensor))
    ts = make_train_step(cfg, mesh)
    t = cfg.train
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=t.seq_len, global_batch=t.global_batch)
    batch = global_batch_arrays(ds, 0, mesh, P(DP_AXES))
    compiled, state = ts.step.lower(ts.abstract_run, *batch).compile(), [ts.init()]

    def step() -> float:
        t0 = time.perf_counter()
        state[0], metrics = compiled(state[0], *batch)
        jax.block_until_ready(metrics["loss"])
        return time.perf_counter() - t0

    return step


def alternate(cases, rounds: int, steps: int) -> dict[str, tuple[float, float]]:
    """Median (seconds, CPU seconds) per step of each case over `rounds` alternated rounds."""
    steppers = [(name, stepper(FINE_CONFIG, over)) for name, over in cases]
    times = {name: ([], []) for name, _ in steppers}
    for _ in range(rounds):
        for name, step in steppers:
            step()
            for _ in range(steps):
                c0 = time.process_time()
                times[name][0].append(step())
                times[name][1].append(time.process_time() - c0)
    return {name: (statistics.median(w), statistics.median(c)) for name, (w, c) in times.items()}


def fine_vs_dense(rounds: int, steps: int, sizes=((128, 1),), one: bool = False, grans=(8,)) -> None:
    """The MoE of each granularity in `grans` against the dense model of equal active FLOPs per
    (d_model, token factor) of `sizes`, the cases of one size and granularity alternated in rounds;
    one table (`one`: one device's share)."""
    layout = "1 device, 1/8 step" if one else "data2 x expert4"
    head = f"{'d_model tokens':<16}{'gran':<6}{layout:<22}{'ms/step':>9}{'vs dense':>10}{'CPU ms':>9}{'vs dense':>10}"
    print(f"\n{head}\n{'-' * len(head)}", flush=True)
    for d_model, factor in sizes:
        for gran in grans:
            cases = fine_cases(d_model, factor, one, gran)
            med = alternate(cases, rounds, steps)
            dense, dense_cpu = med[cases[0][0]]
            for name, (wall, c) in med.items():
                row = f"{d_model:<8}{factor * FINE_TOKENS:<8}{gran:<6}{name:<22}{1e3 * wall:>9.1f}{wall / dense:>10.2f}"
                print(f"{row}{1e3 * c:>9.1f}{c / dense_cpu:>10.2f}", flush=True)
    print("CPU ms = this process's CPU time per step (all simulated devices), steadier on shared cores.")


def size_arg(text: str) -> tuple[int, int]:
    """--size D or DxN: d_model D (a multiple of 8), N times the tokens of a step (default 1)."""
    d, _, n = text.partition("x")
    if not d.isdigit() or int(d) % 8 or not (n or "1").isdigit() or int(n or 1) < 1:
        raise argparse.ArgumentTypeError(f"--size {text!r}: give D or DxN, e.g. 256x4 (D a multiple of 8, N >= 1)")
    return int(d), int(n or 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
    ap.add_argument("--only", choices=("dispatch", "fine"), help="one of the two tables (default: both)")
    ap.add_argument("--rounds", type=int, default=5, help="fine-grained vs dense: alternated rounds")
    ap.add_argument("--size", type=size_arg, nargs="+", default=[(128, 1)], metavar="D[xN]",
                    help="fine-grained vs dense at d_model D and N x the tokens a step (default 128x1)")  # fmt: skip
    ap.add_argument("--one-device", action="store_true",
                    help="fine-grained vs dense: one device's share of a step on one device")  # fmt: skip
    ap.add_argument("--granularity", type=int, nargs="+", default=[8], metavar="G",
                    help="MoE vs dense: 8G experts of width d_ff/G, top-G, 1 shared (default 8)")  # fmt: skip
    args = ap.parse_args()
    for g, (d, _) in itertools.product(args.granularity, args.size):
        if g < 1 or 4 * d % g:
            ap.error(f"--granularity {g}: give G >= 1 that divides d_ff = {4 * d} (d_model {d}), e.g. 2, 4 or 8")
    if args.only != "fine":
        dispatch_table(args)
    if args.only != "dispatch":
        print(" ".join(__doc__.split("\n\n")[3].split()))
        fine_vs_dense(args.rounds, args.steps, args.size, args.one_device, args.granularity)


def dispatch_table(args) -> None:
    """Capacity vs dropless on tiny_moe_cpu.yaml, parallel and on one device."""
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
