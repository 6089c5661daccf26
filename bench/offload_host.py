"""The host tier's two updates side by side: streamed (the default) and the whole shard
(`offload.update=whole`), with the in-memory step beside them (a script, not a test).

    python bench/offload_host.py [--budget-mb 16] [--steps 3]

For bench/offload.py's model on one CPU device, float32 params and bf16 params with a float32
master, each variant runs in its own process and prints:

- compiled bytes per device (`memory_analysis()`, split by memory space): the step (the whole-shard
  update, none) or the streamed update's two programs (the device part, one chunk's update);
- the update's device peak these imply. The whole-shard update brings the whole state shard to the
  device for the update on a GPU; XLA:CPU emits no transfer and leaves the shard in host memory, so
  its figure is the compiled device bytes plus the shard's host bytes. The streamed update's chunk
  loop holds the chunk program's bytes plus the new params gathered so far (at most the params);
- the peak RSS (VmHWM) of init and of the steps.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _child  # noqa: E402  (bench/_child.py)
import offload  # noqa: E402  (bench/offload.py: MODEL)
import offload_rss  # noqa: E402  (peak RSS from /proc)

ROOT = _child.ROOT
VARIANTS = {
    "none": [],
    "host whole": ["offload.optimizer=host", "offload.update=whole"],
    "host streamed": ["offload.optimizer=host"],
}
DTYPES = {"float32": [], "bf16 + fp32 master": ["model.param_dtype=bfloat16", "model.dtype=bfloat16"]}


def child(variant: str, dtype: str, budget: float, steps: int) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from meshrun.analysis.memory import memory_spaces

    over = [*offload.MODEL, *DTYPES[dtype], *VARIANTS[variant], f"offload.budget_mb={budget}"]
    ts, mesh, batches, compiled = offload.one_device_step(over, steps)
    step = memory_spaces(compiled)
    opt_sh = jax.tree.leaves(ts.state_shardings.opt_state, is_leaf=lambda x: isinstance(x, NamedSharding))
    state = sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
                for a, s in zip(jax.tree.leaves(ts.abstract_run.opt_state), opt_sh, strict=True) if a.ndim)  # fmt: skip
    params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(ts.abstract_run.params))
    out: dict = {"step": step, "state": state, "params": params}
    tier = ts.tier
    if tier is not None:  # the chunk program, compiled with abstract arguments
        lay, slots = tier.layout, tier.pattern.n_slots
        row = lambda n, dt=jnp.float32: jax.ShapeDtypeStruct(lay.shape(n), dt, sharding=lay.sharding)
        scalar = lambda dt: jax.ShapeDtypeStruct((), dt, sharding=NamedSharding(mesh, P()))
        _, scalars = tier.pattern.split(jax.tree.leaves(ts.abstract_run.opt_state))
        p_row = None if tier.master else row(lay.length, tier.param_dtypes[0])
        args = (row(lay.length), p_row, (row(lay.chunk),) * slots, tuple(scalars), scalar(jnp.float32),
                scalar(jnp.int32))  # fmt: skip
        out["chunk"] = memory_spaces(tier.chunk_part.lower(*args).compile())
        out["chunks"] = lay.n_chunks
    rss = {}

    def phase(name, fn):
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        result = fn()
        rss[name] = offload_rss.rss("VmHWM")
        return result

    held = [phase("init", ts.init)]

    def run():
        st = held.pop()
        for b in batches:
            st, m = compiled(st, *b)
            float(m["loss"])
        return st

    held.append(phase("steps", run))
    out["rss"] = rss
    if tier is not None:
        out["resident"] = tier.file.peak_resident
    return out


def report(budget: float, steps: int) -> None:
    mib = lambda x: f"{x / 2**20:.1f}"
    print(f"\nhost tier: bench/offload.py's model, one CPU device, budget {budget} MiB, {steps} steps; MiB per device")
    print("\n| params | update | program | device args | temp | device total | host | update's device peak "
          "| peak RSS init | peak RSS steps |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for dtype in DTYPES:
        for variant in VARIANTS:
            cmd = [sys.executable, __file__, "--child", variant, dtype, str(budget), str(steps)]
            r = _child.run_json(cmd, env=_child.env())
            s, rss = r["step"], r["rss"]
            if "chunk" in r:
                c = r["chunk"]
                peak = f"{mib(c['device'] + r['params'])} (chunk loop, {r['chunks']} chunks)"
                rows = [("device part", s, ""), ("one chunk's update", c, peak)]
            else:
                peak = s["device"] + (s["host"] if variant == "host whole" else 0)
                rows = [("the step", s, f"{mib(peak)} (the step{' + the shard' if s['host'] else ''})")]
            for i, (prog, m, pk) in enumerate(rows):
                tail = f"{mib(rss['init'])} | {mib(rss['steps'])}" if i == 0 else " | "
                print(f"| {dtype} | {variant} | {prog} | {mib(m['device_argument'])} | {mib(m['temp'])} | "
                      f"{mib(m['device'])} | {mib(m['host'])} | {pk} | {tail} |")  # fmt: skip
        print(f"| {dtype} | | optimizer state shard: {mib(r['state'])} MiB, params {mib(r['params'])} MiB | "
              "| | | | | | |")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-mb", type=float, default=16.0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--child", nargs=4, default=None)
    args = ap.parse_args()
    if args.child:
        variant, dtype, budget, steps = args.child
        print(json.dumps(child(variant, dtype, float(budget), int(steps))))
        return 0
    report(args.budget_mb, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
