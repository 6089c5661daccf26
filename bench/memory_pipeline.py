"""1F1B's residual memory and step time per pipeline executor on 8 simulated CPU devices (a script,
not a test; tests/test_pipeline.py asserts the slot counts and the temp-bytes order).

    python bench/memory_pipeline.py [--pipes 2 4] [--ms 8 16] [--tensor 1] [--repeats 5] [--d-model 64] [--seq 32]

Rows per (p, m): 1F1B on the lockstep executor (`pipeline.executor=lockstep`: one forward and one
backward per stage per tick, min(m, 2p-1) residual slots), 1F1B on the per-op executor (`per_op`:
Megatron's order, one op per stage per tick with each backward split into B and W in consecutive
ticks, p - s slots on stage s and one stash) and zb-h1 (per-op, W's deferred). Columns: ticks, the
table bubble (lockstep F = 1, B = 2; per-op F = B = W = 1), stage 0's residual slots, one
microbatch's stored residuals on a stage (per device with tensor = 1, as in the default), stage 0's
residual bytes (slots x that), the compiled per-device temp bytes, the median step time and its
ratio to lockstep 1F1B, timed round-robin in one run so the ratios share the machine's load. The
model is bench/pipeline.py's (d_model 64, 8 layers, seq 32; --d-model/--seq widen it, heads of
d_model/4, d_ff 4 d_model), one sequence per microbatch and data shard. On simulated devices the
cores are shared by all 8 devices, so time sums the stages' work plus the per-tick overhead (the
toy's tiny ops make the per-op executor's extra ticks show; at d_model 256 they mostly vanish); on
an accelerator a tick waits for its slowest stage (see the executor's notes).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshrun.runtime.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import meshrun_models as mm  # noqa: E402

from bench.pipeline import CFG, SEQ  # noqa: E402
from meshrun.config import PipelineConfig  # noqa: E402
from meshrun.pipeline.executor import Pipeline  # noqa: E402
from meshrun.pipeline.residuals import activation_residuals  # noqa: E402
from meshrun.pipeline.spec import pipeline_spec  # noqa: E402
from meshrun.pipeline.split import layer_split  # noqa: E402
from meshrun.runtime.mesh import build_mesh  # noqa: E402

VARIANTS = (("1f1b", "lockstep"), ("1f1b", "per_op"), ("zb-h1", "per_op"), ("zb-v", "per_op"))


def residual_bytes(p: int, rows: int) -> int:
    """Stored residuals of one microbatch (`rows` sequences) on one stage: the activation-dependent
    leaves of the stage's vjp, what each residual slot holds (`stage.activation_residuals`)."""
    _, params = mm.init_params(CFG, 0)
    lp = jax.tree.map(lambda a: a[: CFG.n_layers // p], params.to_pure_dict()["layers"])
    x = jnp.zeros((rows, SEQ, CFG.d_model), jnp.dtype(CFG.dtype))
    mask, avals = activation_residuals(lambda q, a: mm.apply_layers(q, a, CFG), lp, x)
    return sum(a.size * a.dtype.itemsize for a, d in zip(avals, mask, strict=True) if d)


def main(argv=None) -> None:
    global CFG, SEQ
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--ms", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--tensor", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--d-model", type=int, default=CFG.d_model)
    ap.add_argument("--seq", type=int, default=SEQ)
    a = ap.parse_args(argv)
    if (a.d_model, a.seq) != (CFG.d_model, SEQ):
        d = a.d_model
        CFG = dataclasses.replace(CFG, d_model=d, head_dim=d // CFG.n_heads, d_ff=4 * d, max_seq_len=a.seq)
        SEQ = a.seq
    _, params = mm.init_params(CFG, 0)
    print(f"model: d_model={CFG.d_model} layers={CFG.n_layers} seq={SEQ} {CFG.dtype}; {jax.device_count()} devices")
    head = f"{'schedule':<7}{'executor':>9}{'p':>3}{'m':>4}{'ticks':>6}{'bubble':>8}{'slots s0':>9}"
    head += f"{'res/mb KiB':>11}{'res s0 KiB':>11}{'temp KiB':>10}{'step ms':>9}{'ratio':>7}"
    print(head)
    for p in a.pipes:
        data = 8 // (p * a.tensor)
        mesh = build_mesh(pipe=p, data=data, tensor=a.tensor)
        per_mb = residual_bytes(p, 1) / a.tensor  # tensor > 1: a rough per-device share
        for m in a.ms:
            tok = jax.random.randint(jax.random.key(m), (m * data, SEQ), 0, CFG.vocab)
            lab = jnp.roll(tok, -1, axis=1)
            runs = []
            for sched, ex in VARIANTS:
                pc = PipelineConfig(schedule=sched, microbatches=m, executor=ex)
                pure = params.to_pure_dict()
                pure["layers"] = layer_split(pc, CFG.n_layers, p).to_pipeline(pure["layers"])
                pl = Pipeline(pipeline_spec(mm.model_fns(CFG), pc, mesh, pure, placement="pipeline"))
                compiled = pl.lower(pure, tok, lab).compile()
                jax.block_until_ready(compiled(pure, tok, lab))
                runs.append((sched, ex, pl.program, compiled, (pure, tok, lab), []))
            for _ in range(a.repeats):  # round-robin: the variants see the same load
                for *_, compiled, args, ts in runs:
                    t = time.perf_counter()
                    jax.block_until_ready(compiled(*args))
                    ts.append(time.perf_counter() - t)
            base = statistics.median(runs[0][-1])
            for sched, ex, prog, compiled, _, ts in runs:
                s0 = prog.stage_slots()[0]
                temp = compiled.memory_analysis().temp_size_in_bytes
                step = statistics.median(ts)
                print(
                    f"{sched:<7}{ex:>9}{p:>3}{m:>4}{prog.ticks:>6}{prog.bubble:>8.3f}{s0:>9}{per_mb / 1024:>11.1f}"
                    f"{s0 * per_mb / 1024:>11.1f}{temp / 1024:>10.1f}{1e3 * step:>9.1f}{step / base:>7.2f}",
                    flush=True,
                )
    print(f"# mesh: pipe p x data 8/(p*tensor) x tensor {a.tensor}; ratio: step / lockstep 1F1B's, same (p, m)")
    print("# bubble: table, F = 1, B + W = 2; slots s0: residual slots stage 0's schedule holds")


if __name__ == "__main__":
    sys.exit(main())
