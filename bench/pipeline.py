"""Pipeline schedules side by side on 8 simulated CPU devices (a script, not a test).

    python bench/pipeline.py [--pipes 4] [--ms 2 4] [--tensor 2] [--zero 0] [--repeats 3] [--schedules ...]

First a table-only block (no compile): for p = 4, m = 8 and 16, the bubble of the schedule tables
with F = 1 and B + W = 2 (1F1B, interleaved v = 2, zb-h1 with B = W = 1) and the peak in-flight
microbatches (activation memory).

Then per compiled row (1F1B, interleaved v = 2, zb-h1 by default; `--ms` are multiples of p): the
table bubble, residual slots, compiled per-device temp memory, collective-permute bytes per step over
'pipe', the median step time and its ratio to the non-pipelined step (same model and global batch,
data x tensor parallel on the same 8 devices), and from a `jax.profiler` trace of two steps
(`meshrun.analysis.trace`): the measured bubble per stage ((span - busy) / span) and the compute time per
step summed over the stages (all ops' busy time: the work the schedule does, bubbles excluded).
A schedule named NAME+overlap runs NAME with `pipeline.overlap_grad_reduce` (each chunk's gradients
reduced at its grad cut); its last column is its step time over NAME's in the same run (list NAME
first). Microbatch size is fixed (1 sequence per data shard), so the global batch grows with m. On simulated
devices 8 devices share the host's cores: the step ratio and the measured idle mostly show per-tick
overhead and core sharing, not a GPU's bubble; the compute sum compares the schedules' work.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

from meshrun_models.llama.config import LlamaConfig

from meshrun.runtime.devices import simulate_cpu_devices

simulate_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import meshrun_models as mm  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from meshrun.analysis import hlo  # noqa: E402
from meshrun.analysis import trace as profile  # noqa: E402
from meshrun.analysis.profiler import trace_options  # noqa: E402
from meshrun.config import PipelineConfig  # noqa: E402
from meshrun.parallel.sharding import compute_rules, param_rules, tree_shardings, use_rules  # noqa: E402
from meshrun.pipeline import registry, schedules  # noqa: E402
from meshrun.pipeline.executor import Pipeline  # noqa: E402
from meshrun.pipeline.spec import pipeline_spec  # noqa: E402
from meshrun.pipeline.split import layer_split  # noqa: E402
from meshrun.runtime.mesh import build_mesh  # noqa: E402

SEQ = 32
CFG = LlamaConfig(vocab=256, d_model=64, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128, max_seq_len=SEQ)


def timeit(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def permute_bytes(text: str, mesh) -> int:
    """collective-permute bytes per step, counting each while loop's known trip count."""
    colls = hlo.collectives(text, dict(mesh.shape))
    return sum(c.bytes * c.per_step for c in colls if c.op == "collective-permute")


def baseline(mesh, params, tok, lab, repeats):
    """Non-pipelined step: value_and_grad of the model's loss_fn, GSPMD data x tensor parallel."""
    shard = tree_shardings(params, mesh, param_rules(0))
    shard = shard.to_pure_dict() if hasattr(shard, "to_pure_dict") else shard
    params = jax.device_put(params.to_pure_dict(), shard)
    bs = NamedSharding(mesh, P(("data", "expert")))

    def step(p, t, y):
        with use_rules(mesh, compute_rules()):
            return jax.value_and_grad(lambda q: mm.loss_fn(q, t, y, CFG)[0])(p)

    fn = jax.jit(step, in_shardings=(shard, bs, bs))
    return timeit(fn, (params, tok, lab), repeats)


def measured(compiled, args, mesh, sched: str, p: int, m: int, v: int, steps: int = 2) -> dict:
    """`meshrun.analysis.trace`'s per-stage report of `steps` traced executions of `compiled`."""
    with tempfile.TemporaryDirectory() as out:
        with jax.profiler.trace(out, create_perfetto_trace=True, profiler_options=trace_options()):
            for _ in range(steps):
                jax.block_until_ready(compiled(*args))
        times = profile.device_times(profile.load_trace(out), compiled.as_text(), mesh, steps)
    return profile.stage_report(times, mesh, schedules.stage_bubbles(registry.get(sched).table(p, m, v)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipes", type=int, nargs="+", default=[4])
    ap.add_argument("--ms", type=int, nargs="+", default=[2, 4], help="m as multiples of p")
    ap.add_argument("--tensor", type=int, default=2)
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "interleaved", "zb-h1"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--zero", type=int, default=0, help="ZeRO stage of the pipelined steps' shardings")
    a = ap.parse_args(argv)
    print(f"{'schedule':<12}{'p':>3}{'m':>4}{'v':>3}{'bubble (table)':>16}{'peak in-flight chunks':>23}")
    for m in (8, 16):
        for sched, v in (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)):
            table = registry.get(sched).table(4, m, v)
            peak = max(schedules.max_in_flight(table, s) for s in range(4))
            print(f"{sched:<12}{4:>3}{m:>4}{v:>3}{schedules.bubble_fraction(table):>16.4f}{peak:>23}")
    _, params = mm.init_params(CFG, 0)
    devs = f"{jax.device_count()} {jax.devices()[0].platform} devices"
    print(f"\nmodel: d_model={CFG.d_model} layers={CFG.n_layers} seq={SEQ}; {devs}")
    head = f"{'schedule':<12}{'p':>3}{'m':>4}{'v':>3}{'bubble':>8}{'slots':>6}{'temp KiB':>10}{'permute KiB':>12}"
    head += f"{'step s':>8}{'ratio':>7}  {'measured bubble per stage':<28}{'compute ms':>11}{'vs plain':>9}"
    print(head)
    for p in a.pipes:
        data = 8 // (p * a.tensor)
        mesh = build_mesh(pipe=p, data=data, tensor=a.tensor)
        flat = build_mesh(pipe=1, data=8 // a.tensor, tensor=a.tensor)
        for k in a.ms:
            m = k * p
            gb = m * data
            key = jax.random.key(m)
            tok = jax.random.randint(key, (gb, SEQ), 0, CFG.vocab)
            lab = jnp.roll(tok, -1, axis=1)
            if gb % (8 // a.tensor):
                print(f"# skip baseline m={m}: batch {gb} not divisible by {8 // a.tensor}")
                base = float("nan")
            else:
                base = baseline(flat, params, tok, lab, a.repeats)
            plain: dict[str, float] = {}
            for row in a.schedules:
                sched, _, opt = row.partition("+")
                v = 2 if sched == "interleaved" else 1
                if CFG.n_layers % (p * v):
                    continue
                # Interleaved: params stored in pipeline order, so no weights cross 'pipe' per step.
                pc = PipelineConfig(schedule=sched, microbatches=m, virtual=v, overlap_grad_reduce=opt == "overlap")
                pure = params.to_pure_dict()
                pure["layers"] = layer_split(pc, CFG.n_layers, p).to_pipeline(pure["layers"])
                spec = pipeline_spec(mm.model_fns(CFG), pc, mesh, pure, placement="pipeline", zero=a.zero)
                pl = Pipeline(spec)
                compiled = pl.lower(pure, tok, lab).compile()
                temp = compiled.memory_analysis().temp_size_in_bytes
                pb = permute_bytes(compiled.as_text(), mesh)
                t = timeit(compiled, (pure, tok, lab), a.repeats)
                rep = measured(compiled, (pure, tok, lab), mesh, sched, p, m, v)
                per_stage = " ".join(f"{r['measured_bubble']:.2f}" for r in rep["stages"])
                work = 1e3 * sum(r["busy_s"] * len(r["devices"]) for r in rep["stages"]) / a.tensor / data
                if not opt:
                    plain[sched] = t
                vs = f"{t / plain[sched]:>9.3f}" if opt and sched in plain else ""
                print(
                    f"{row:<12}{p:>3}{m:>4}{v:>3}{pl.program.bubble:>8.3f}{pl.program.slots:>6}{temp / 1024:>10.1f}"
                    f"{pb / 1024:>12.1f}{t:>8.3f}{t / base:>7.2f}  {per_stage:<28}{work:>11.1f}{vs}",
                    flush=True,
                )
    print(f"# baseline: non-pipelined data={8 // a.tensor} x tensor={a.tensor} step on the same devices")
    print("# bubble: table (F = 1, B + W = 2); measured bubble: (span - busy) / span per stage from a trace")
    print("# compute ms: busy time per step summed over stages (mean over each stage's devices)")


if __name__ == "__main__":
    sys.exit(main())
