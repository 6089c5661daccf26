"""Loss with the data-parallel gradient reduction in float32 vs bfloat16 (a script, not a test).

    python bench/grad_reduce.py                       # configs/tiny_cpu.yaml, 20 steps, both dtypes
    python bench/grad_reduce.py --steps 20 mesh.pipe=1 mesh.data=4   # extra overrides for both runs

Each dtype is one `meshrun train CONFIG train.steps=N train.grad_reduce_dtype=D` process into a
fresh run dir (XLA's default flags, the config's real data), so both see the same batches; the
table holds the loss of every step from each run's metrics.jsonl and the relative difference.
Gradients accumulate in float32 either way; only the one DP reduction per step is narrowed. The
last line says whether the final loss is within 1% of the float32 run's (the issue's bar).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _child  # noqa: E402  (bench/_child.py)

DTYPES = ("float32", "bfloat16")


def train(config: str, steps: int, dtype: str, extra: list[str], run_dir: Path) -> tuple[list[float], float]:
    """Per-step losses of one `meshrun train` run, and its wall-clock seconds (whole process)."""
    cmd = _child.meshrun("train", "--quiet", config, f"train.steps={steps}", f"train.grad_reduce_dtype={dtype}",
                         f"train.run_dir={run_dir}", "checkpoint.every=0", *extra)  # fmt: skip
    t0 = time.monotonic()
    r = _child.run(cmd, env=_child.env())
    if r.returncode:
        sys.exit(f"{dtype}: exit {r.returncode}: {r.stderr.strip()[-2000:]}")
    return [row["loss"] for row in _child.metrics(run_dir)], time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny_cpu.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("overrides", nargs="*", metavar="section.key=value")
    a = ap.parse_args()
    losses = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dt in DTYPES:
            losses[dt], secs = train(a.config, a.steps, dt, a.overrides, Path(tmp) / dt)
            print(f"# {dt}: {secs:.0f} s (whole process)", flush=True)
    f32, bf16 = losses["float32"], losses["bfloat16"]
    print(f"{'step':>4}  {'loss float32':>13}  {'loss bfloat16':>13}  {'rel diff':>9}")
    for i, (x, y) in enumerate(zip(f32, bf16, strict=True)):
        print(f"{i + 1:>4}  {x:>13.6f}  {y:>13.6f}  {(y - x) / x:>+9.2e}")
    rel = abs(bf16[-1] - f32[-1]) / f32[-1]
    cmd = " ".join([a.config, *a.overrides])
    print(f"{cmd}: loss after {a.steps} steps float32 {f32[-1]:.6f}, bfloat16 {bf16[-1]:.6f}, "
          f"relative difference {rel:.2e} ({'within' if rel <= 0.01 else 'NOT within'} 1%)")  # fmt: skip
    return 0 if rel <= 0.01 else 1


if __name__ == "__main__":
    sys.exit(main())
