"""The optimizer-state tiers side by side on this machine (a script, not a test).

    python bench/offload.py [--dir DIR] [--disk-mb 1024] [--budget-mb 4] [--steps 6]

Prints, in one run: the sequential write and read bandwidth of DIR (a plain large-file write with
fsync, then a read after dropping its pages from the cache), the NVMe tier's achieved swap
bandwidth (bytes it read and wrote / seconds of its streamed update), the step time with
train.offload_optimizer = none, host and nvme (each tier in its own process, ratios against none),
and the NVMe tier's peak RSS in each phase (init, steps, checkpoint save, restore) against its bound
(`bench/offload_rss.py`). The model is sized so that its optimizer state is >= 4x the budget.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _child  # noqa: E402  (bench/_child.py)
import offload_rss  # noqa: E402  (bench/offload_rss.py: the nvme tier's peak RSS)

ROOT = _child.ROOT
MODEL = ["model.d_model=512", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4", "model.head_dim=64",
         "model.d_ff=1536", "model.vocab=256", "model.max_seq_len=128", "train.seq_len=128", "train.global_batch=8",
         "mesh.data=1", "mesh.pipe=1", "mesh.tensor=1", "pipeline.microbatches=1", "data.kind=synthetic"]  # fmt: skip


def disk_bandwidth(directory: str, mb: int) -> tuple[float, float]:
    """(write, read) bytes/s of one sequential file of `mb` MiB in 16 MiB blocks."""
    block, n = os.urandom(16 << 20), max(1, mb // 16)
    path = os.path.join(directory, "bench-disk.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        for i in range(n):
            os.pwrite(fd, block, i * len(block))
        os.fsync(fd)
        write = n * len(block) / (time.perf_counter() - t0)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages after fsync: dropped
        buf = bytearray(len(block))
        t0 = time.perf_counter()
        for i in range(n):
            os.preadv(fd, [buf], i * len(block))
        read = n * len(block) / (time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(path)
    return write, read


def rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def child(tier: str, directory: str, budget: float, steps: int) -> dict:
    """One tier's run in this process: step times, swap counters, RSS figures."""
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from meshrun.config import load_config
    from meshrun.data.datasets import global_batch_arrays, make_dataset
    from meshrun.parallel.sharding import DP_AXES
    from meshrun.runtime.mesh import build_mesh
    from meshrun.train.step import make_train_step

    over = [*MODEL, f"train.offload_optimizer={tier}", f"train.offload_dir={directory}",
            f"train.offload_budget_mb={budget}"]  # fmt: skip
    cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"), over)
    mesh = build_mesh(cfg.mesh, devices=jax.devices()[:1])
    ts = make_train_step(cfg, mesh)
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch)
    batches = [global_batch_arrays(ds, i, mesh, P(DP_AXES)) for i in range(steps)]
    compiled = ts.step.lower(ts.abstract_run, *batches[0]).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    overhead = rss("VmRSS")
    state, times = ts.init(), []
    init_peak = rss("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: the peak of the steps alone from here
    for b in batches:
        t0 = time.perf_counter()
        state, m = compiled(state, *b)
        float(m["loss"])
        times.append(time.perf_counter() - t0)
    leaves = jax.tree.leaves(state.params)
    params = sum(x.size * x.dtype.itemsize for x in leaves)
    out = {"step_s": float(np.median(times[1:])), "vmhwm": rss("VmHWM"), "init_peak": init_peak, "overhead": overhead,
           "params": params, "flat": 2 * params if ts.tier is not None else 0,
           "grads": sum(x.size * 4 for x in leaves), "temp": temp,
           "opt": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.opt_state))}  # fmt: skip
    if ts.tier is not None:
        f = ts.tier.file
        out |= {"state": f.state_bytes, "moved": f.bytes_read + f.bytes_written, "stream_s": f.stream_s,
                "peak_resident": f.peak_resident, "chunks": f.n_chunks}  # fmt: skip
    return out


def run_child(tier: str, directory: str, budget: float, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--child", tier, "--dir", directory, "--budget-mb", str(budget),
           "--steps", str(steps)]  # fmt: skip
    return _child.run_json(cmd, env=_child.env())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="")
    ap.add_argument("--disk-mb", type=int, default=1024)
    ap.add_argument("--budget-mb", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--child", default="")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.dir, args.budget_mb, args.steps)))
        return 0
    (ROOT / "runs").mkdir(exist_ok=True)  # a fresh checkout has none
    directory = args.dir or tempfile.mkdtemp(prefix="meshrun-offload-", dir=ROOT / "runs")
    mib = lambda x: f"{x / 2**20:.1f}"
    w, r = disk_bandwidth(directory, args.disk_mb)
    print(f"disk {directory}: sequential write {w / 1e9:.2f} GB/s (fsync), read {r / 1e9:.2f} GB/s (pages dropped)")
    rows = {t: run_child(t, directory, args.budget_mb, args.steps) for t in ("none", "host", "nvme")}
    nv = rows["nvme"]
    swap = nv["moved"] / nv["stream_s"]
    print(f"nvme tier: state {mib(nv['state'])} MiB = {nv['state'] / (args.budget_mb * 2**20):.1f}x the "
          f"{args.budget_mb} MiB budget, {nv['chunks']} chunks; swap {swap / 1e9:.2f} GB/s read+write "
          f"({100 * swap / min(w, r):.0f}% of the disk's slower direction); tier's peak buffers "
          f"{mib(nv['peak_resident'])} MiB")  # fmt: skip
    print("\n| tier | step s | x none |")
    print("|---|---:|---:|")
    for t, x in rows.items():
        print(f"| {t} | {x['step_s']:.3f} | {x['step_s'] / rows['none']['step_s']:.2f} |", flush=True)
    offload_rss.report(directory, args.budget_mb, 3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
