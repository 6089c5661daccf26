"""Save and restore time of the two checkpoint tiers on the same training state (a script, not a test).

    python bench/checkpoint_tiers.py [--dir DIR] [--ram DIR] [--d-model 512] [--layers 8] [--repeat 3]

One process, 8 CPU devices (pipe 2 x data 2 x tensor 2, ZeRO-1). The same state is saved by the
persistent tier (orbax, `checkpoint.every`) into DIR and by the local tier (`checkpoint.local_every`)
into DIR and into a RAM disk (--ram, default /dev/shm when it exists), each synchronously (the whole
save) and asynchronously (the time the train loop is blocked: the host copy; the write goes on in the
background), then restored into the same layout. Prints the median of --repeat runs per row and
its ratio to the persistent tier's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, str(ROOT))


def build(d_model: int, layers: int):
    """(train step, model-order state, config) of a llama-style model on 8 CPU devices."""
    import jax

    from meshrun.config import load_config
    from meshrun.runtime.mesh import build_mesh
    from meshrun.train.step import make_train_step

    over = [f"model.d_model={d_model}", f"model.n_layers={layers}", "model.n_heads=8", "model.n_kv_heads=8",
            f"model.d_ff={3 * d_model}", "model.vocab=4096", "model.max_seq_len=64", "train.seq_len=64",
            "train.global_batch=8", "pipeline.microbatches=2", "data.kind=synthetic"]  # fmt: skip
    cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"), over)
    ts = make_train_step(cfg, build_mesh(cfg.mesh, devices=jax.devices()))
    state = jax.block_until_ready(ts.to_model(ts.init()))
    return ts, state, cfg


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="disk directory (default: a temporary one)")
    ap.add_argument("--ram", default="/dev/shm" if os.path.isdir("/dev/shm") else None, help="RAM disk directory")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    import jax

    from meshrun.checkpoint.local import LocalTier
    from meshrun.checkpoint.state import Checkpointer
    from meshrun.config import CheckpointConfig
    from meshrun.train.restore import checkpoint_meta

    ts, state, cfg = build(args.d_model, args.layers)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    meta = checkpoint_meta(cfg)
    disk = Path(tempfile.mkdtemp(prefix="meshrun-bench-", dir=args.dir))
    ram = Path(tempfile.mkdtemp(prefix="meshrun-bench-", dir=args.ram)) if args.ram else None
    rows: list[tuple[str, list[float]]] = []
    try:
        for async_save in (False, True):
            mode = "async (blocked)" if async_save else "sync"
            ck_cfg = CheckpointConfig(every=1, keep=1, async_save=async_save)
            times, back = [], []
            with Checkpointer(disk / "run", ck_cfg, meta=meta) as ck:
                for i in range(args.repeat):
                    times.append(timed(lambda i=i: ck.save(i + 1, state, force=True)))
                    ck.wait()
                back = [timed(lambda: jax.block_until_ready(ck.restore(args.repeat, ts.abstract_state)))]
            rows.append((f"persistent (orbax), disk, {mode}", times))
            if not async_save:
                rows.append(("persistent restore, disk", back))
            for where, base in (("disk", disk), ("RAM disk", ram)):
                if base is None:
                    continue
                tier_cfg = CheckpointConfig(local_every=1, local_dir=str(base / "local"), async_save=async_save)
                tier = LocalTier(tier_cfg, str(disk / "run"), meta)
                times = []
                for i in range(args.repeat):
                    times.append(timed(lambda i=i, t=tier: t.save(i + 1, state)))
                    assert tier.wait() is None
                rows.append((f"local, {where}, {mode}", times))
                if not async_save:
                    back = [timed(lambda t=tier: jax.block_until_ready(t.restore(args.repeat, ts.abstract_state)))]
                    rows.append((f"local restore, {where}", back))
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        if ram is not None:
            shutil.rmtree(ram, ignore_errors=True)

    print(f"state {nbytes / 2**20:.1f} MiB (params + optimizer), 8 CPU devices, median of {args.repeat} saves; "
          "ratio: against the persistent tier's time of the same kind")  # fmt: skip
    base = {}
    for name, ts_ in rows:
        kind = "restore" if "restore" in name else name.split(", ")[-1]
        base.setdefault(kind, statistics.median(ts_))
    print(f"{'tier':<44} {'seconds':>9} {'ratio':>7}")
    for name, ts_ in rows:
        kind = "restore" if "restore" in name else name.split(", ")[-1]
        med = statistics.median(ts_)
        print(f"{name:<44} {med:>9.3f} {med / base[kind]:>7.2f}")


if __name__ == "__main__":
    main()
