"""The NVMe tier's peak host memory (part of bench/offload.py; runnable alone):

    python bench/offload_rss.py [--dir DIR] [--budget-mb 16] [--steps 3]

Each run happens in child processes, so this script's own memory does not count: one trains
(init, steps, a checkpoint save), a second one resumes from that checkpoint (restore, one step).
Each phase's peak RSS is VmHWM from /proc/self/status, reset before the phase through
/proc/self/clear_refs. The bound is params + gradient sums + activations (the compiled step's temp
bytes) + the flat param row the streamed update writes into + the tier's budget + a fixed overhead.
The overhead is measured, not assumed: the same two processes on a tiny model of the same depth
(the jax/XLA runtime, the compiled executables, orbax and TensorStore), its largest phase peak
minus its own state terms.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _child  # noqa: E402  (bench/_child.py)

ROOT = _child.ROOT
COMMON = ["model.n_layers=4", "model.vocab=256", "model.max_seq_len=128", "train.seq_len=128",
          "train.global_batch=8", "mesh.data=1", "mesh.pipe=1", "mesh.tensor=1", "pipeline.microbatches=1",
          "data.kind=synthetic"]  # fmt: skip
MODELS = {
    "tiny": ["model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=16", "model.d_ff=192"],
    "bench": ["model.d_model=512", "model.n_heads=8", "model.n_kv_heads=4", "model.head_dim=64", "model.d_ff=1536"],
}  # bench: bench/offload.py's MODEL (12.9 M params, 101 MiB of Adam state)
PHASES = ("init", "steps", "save", "restore", "step after restore")


def rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def child(model: str, directory: str, run_dir: str, budget: float, steps: int, resume: bool) -> dict:
    """One process of the nvme tier: the phases' peaks and the bound's terms."""
    import jax
    from jax.sharding import PartitionSpec as P

    from meshrun.checkpoint.state import Checkpointer
    from meshrun.config import load_config
    from meshrun.data.datasets import global_batch_arrays, make_dataset
    from meshrun.parallel.sharding import DP_AXES
    from meshrun.runtime.mesh import build_mesh
    from meshrun.train.step import make_train_step

    over = [*COMMON, *MODELS[model], "offload.optimizer=nvme", f"offload.dir={directory}",
            f"offload.budget_mb={budget}", f"train.run_dir={run_dir}"]  # fmt: skip
    cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"), over)
    mesh = build_mesh(cfg.mesh, devices=jax.devices()[:1])
    ts = make_train_step(cfg, mesh)
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch)
    batches = [global_batch_arrays(ds, i, mesh, P(DP_AXES)) for i in range(steps + 1)]
    compiled = ts.step.lower(ts.abstract_run, *batches[0]).compile()
    ck = Checkpointer(run_dir, cfg.checkpoint, meta={})
    out: dict = {"baseline": rss("VmRSS")}

    def phase(name, fn):
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        result = fn()
        out[name] = rss("VmHWM")
        return result

    held: list = []  # the state between phases (a step's input is not kept alive beside its output)

    def run(bs):
        state = held.pop()
        for b in bs:
            state, m = compiled(state, *b)
            float(m["loss"])
        return state

    if resume:
        own = getattr(ts, "restore", None)  # before the streamed restore: the whole state, then the tier
        whole = lambda: ts.to_run(ck.restore(steps, ts.abstract_state))
        held.append(phase("restore", lambda: own(ck, steps) if own else whole()))
        held.append(phase("step after restore", lambda: run(batches[steps:])))
    else:
        held.append(phase("init", ts.init))
        held.append(phase("steps", lambda: run(batches[:steps])))
        save = getattr(ts, "to_save", None) or ts.to_model
        phase("save", lambda: (ck.save(steps, save(held[0]), force=True), ck.wait()))
    ck.close()
    leaves = jax.tree.leaves(held[0].params)
    f = ts.tier.file
    params = sum(x.size * x.dtype.itemsize for x in leaves)
    return out | {"params": params, "grads": sum(x.size * 4 for x in leaves), "flat": params,
                  "temp": compiled.memory_analysis().temp_size_in_bytes, "resident": f.peak_resident,
                  "state": f.state_bytes, "chunks": f.n_chunks}  # fmt: skip


def run_child(*argv: str) -> dict:
    return _child.run_json([sys.executable, __file__, "--child", *argv], env=_child.env())


def measure(model: str, directory: str, budget: float, steps: int) -> dict:
    run_dir = tempfile.mkdtemp(prefix=f"rss-{model}-", dir=directory)
    args = [model, directory, run_dir, str(budget), str(steps)]
    return run_child(*args, "train") | {k: v for k, v in run_child(*args, "resume").items() if k in PHASES}


def report(directory: str, budget: float, steps: int) -> None:
    mib = lambda x: f"{x / 2**20:.1f}"
    tiny, big = (measure(m, directory, budget, steps) for m in ("tiny", "bench"))
    terms = lambda x: x["params"] + x["grads"] + x["temp"] + x["flat"]
    overhead = max(tiny[p] for p in PHASES) - terms(tiny) - tiny["resident"]
    bound = terms(big) + budget * 2**20 + overhead
    print(f"\nnvme tier peak RSS: state {mib(big['state'])} MiB = {big['state'] / (budget * 2**20):.1f}x the "
          f"{budget} MiB budget, {big['chunks']} chunks; the tier's own buffers peaked at {mib(big['resident'])} MiB "
          f"(counted by it)")  # fmt: skip
    print(f"bound {mib(bound)} MiB = params {mib(big['params'])} + gradient sums {mib(big['grads'])} + activations "
          f"{mib(big['temp'])} + flat param row {mib(big['flat'])} + budget {mib(budget * 2**20)} + overhead "
          f"{mib(overhead)} (the tiny model's largest peak {mib(max(tiny[p] for p in PHASES))} - its state terms "
          f"{mib(terms(tiny) + tiny['resident'])})")  # fmt: skip
    print("\n| phase | peak RSS MiB | bound MiB | peak - bound MiB | tiny model's peak MiB |")
    print("|---|---:|---:|---:|---:|")
    for p in PHASES:
        print(f"| {p} | {mib(big[p])} | {mib(bound)} | {mib(big[p] - bound)} | {mib(tiny[p])} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="")
    ap.add_argument("--budget-mb", type=float, default=16.0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--child", nargs=6, default=None)
    args = ap.parse_args()
    if args.child:
        model, directory, run_dir, budget, steps, mode = args.child
        print(json.dumps(child(model, directory, run_dir, float(budget), int(steps), mode == "resume")))
        return 0
    (ROOT / "runs").mkdir(exist_ok=True)  # a fresh checkout has none
    directory = args.dir or tempfile.mkdtemp(prefix="meshrun-offload-", dir=ROOT / "runs")
    Path(directory).mkdir(parents=True, exist_ok=True)  # --dir may name one not made yet
    report(directory, args.budget_mb, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
