"""The optimizer-state tiers side by side on this machine (a script, not a test).

    python bench/offload.py [--dir DIR] [--disk-mb 1024] [--budget-mb 4] [--steps 6] [--global-batch 8]
                            [--rounds 3] [--no-update-on]

Prints, in one run: the sequential write and read bandwidth of DIR, the NVMe tier's achieved swap
bandwidth against it, the streamed update against the update alone and the I/O at the disk's limit,
the step time with offload.optimizer = none, host and nvme (each tier in its own process,
ratios against none; the processes alternate over --rounds rounds, each round's ratios are printed
and the verdict takes their median, so a drift of the machine's load between processes moves both
sides of a ratio), the nvme step's parts (the device part, the stream, the rest) against its
floor (the device part, then the update or the I/O at the disk's limit, whichever is longer: the
update starts once the whole gradient's norm exists), the nvme tier's stream and step with its
chunk update in place (auto on CPU devices), on the device (the copy path) and on the host CPU
(`offload.update_on`; skipped with --no-update-on), and the NVMe tier's peak RSS in each phase
(init, steps, checkpoint save, restore) against its bound (`bench/offload_rss.py`). The model is
sized so that its optimizer state is >= 4x the budget.

The disk and the tier are measured the same way, without the page cache: the disk figure is a
rewrite of a file written once before (as the tier rewrites its preallocated file each step), timed
up to `fdatasync`, and a read after `posix_fadvise(DONTNEED)` dropped the file's pages; the tier
drops its pages as it writes and ends each streamed update with `fdatasync` + DONTNEED
(`swap_file.SwapFile.settle`), so its reads come from the disk too. Both figures are then the disk's,
whatever the file size and the free memory; on a tmpfs (printed) they are memory bandwidth. The
tier's state is meant to exceed host memory, where the page cache could not hold it anyway.
"""

from __future__ import annotations

import argparse
import contextlib
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
PLACES = ("auto", "device", "host")  # offload.update_on
MODEL = ["model.d_model=512", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4", "model.head_dim=64",
         "model.d_ff=1536", "model.vocab=256", "model.max_seq_len=128", "train.seq_len=128", "train.global_batch=8",
         "mesh.data=1", "mesh.pipe=1", "mesh.tensor=1", "pipeline.microbatches=1", "data.kind=synthetic"]  # fmt: skip


def disk_bandwidth(directory: str, mb: int, passes: int = 2) -> tuple[float, float]:
    """(write, read) bytes/s of one sequential `mb` MiB file in 16 MiB blocks, the best of `passes`:
    written once untimed (the filesystem allocates its extents), then each pass rewrites it up to
    fdatasync, drops its pages and reads it back."""
    block, n = os.urandom(16 << 20), max(1, mb // 16)
    path = os.path.join(directory, "bench-disk.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    write = read = 0.0
    try:
        for i in range(n):
            os.pwrite(fd, block, i * len(block))
        os.fdatasync(fd)
        buf = bytearray(len(block))
        for _ in range(passes):
            t0 = time.perf_counter()
            for i in range(n):
                os.pwrite(fd, block, i * len(block))
            os.fdatasync(fd)
            write = max(write, n * len(block) / (time.perf_counter() - t0))
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages after fdatasync: dropped
            t0 = time.perf_counter()
            for i in range(n):
                os.preadv(fd, [buf], i * len(block))
            read = max(read, n * len(block) / (time.perf_counter() - t0))
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
        os.unlink(path)
    return write, read


def fs_type(directory: str) -> str:
    """The filesystem type of the mount holding `directory` (/proc/self/mounts: the longest prefix)."""
    real, best = os.path.realpath(directory), ("", "?")
    for line in Path("/proc/self/mounts").read_text().splitlines():
        point, kind = (line.split()[1:3] + ["?"])[:2]
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0]):
            best = (point, kind)
    return best[1]


@contextlib.contextmanager
def io_file(directory, n_chunks: int, chunk: tuple[int, int, int]):
    """A swap file of `n_chunks` chunks shaped `chunk` in `directory`, written once, and a pass over it
    without an update: the tier's I/O pipeline alone (read one chunk ahead, write one behind, settle).
    Yields (the file, the pass); the file is closed (and removed) on exit."""
    from meshrun.offload import swap_file
    from meshrun.offload.chunk_store import aligned

    f = swap_file.SwapFile(Path(directory), n_chunks, chunk)
    try:
        out = aligned(f.chunk)
        out[:] = 1.0
        pieces = list(out.reshape(-1, f.chunk[-1]))
        f.write_all(lambda i: pieces)
        yield f, lambda: f.stream(lambda i, buf: None, lambda h: pieces)
    finally:
        f.close()


def io_alone(tier, passes: int = 2) -> tuple[int, float]:
    """(bytes, seconds) of `passes` passes of the tier's I/O pipeline alone (`io_file`) through a second
    file shaped as the tier's."""
    with io_file(tier.directory, tier.file.n_chunks, tier.file.chunk) as (f, one_pass):
        for _ in range(passes):
            one_pass()
        return f.stream_bytes, f.stream_s


def update_alone(ts, state, batch) -> tuple[float, float]:
    """(wall, CPU) seconds of the nvme tier's streamed update without the disk: every chunk updated as
    the tier's step does (in place in the device's own buffers on the CPU backend, else copied to the
    device and back), one after another, from buffers in memory. CPU: this process's, all threads."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from meshrun.offload import device_chunk, host_update, malloc
    from meshrun.offload.optimizer_tier import HostCPUUpdate, InPlaceUpdate

    tier = ts.tier
    lay, scalars = tier.layout, tuple(state.opt_state)
    g, p, g_norm, _ = tier.device_part(state.params, tier.new_rows(), *batch)
    jax.block_until_ready(g)
    if isinstance(tier.update, HostCPUUpdate):  # on the CPU backend's device: the gradient down, the update, up
        h = tier.update.host
        item = host_update.HostChunk(h.cpu, len(lay.first), tier.pieces, tier.pattern.n_slots)
        sc, gn = tuple(jax.device_put(x.addressable_data(0), h.cpu) for x in scalars), jax.device_put(
            g_norm.addressable_data(0), h.cpu)  # fmt: skip
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(lay.n_chunks):
            gc, pc = h.take(g, p, jnp.int32(i * lay.chunk))
            item.slots, rows, _ = h.update(h.down(gc), None if pc is None else h.down(pc), item.slots, sc, gn)
            jax.block_until_ready(h.up(rows))
            item.written()
        return time.perf_counter() - t0, time.process_time() - c0
    if isinstance(tier.update, InPlaceUpdate):
        item = device_chunk.DeviceChunk(lay, tier.pieces, tier.pattern.n_slots)
        p = tier.new_param_row() if p is None else p
        t0, c0 = time.perf_counter(), time.process_time()
        with malloc.keeping_freed_buffers():  # as the tier's step
            for i in range(lay.n_chunks):
                item.slots, p, _ = tier.chunk_part_in_place(g, p, item.slots, scalars, g_norm, jnp.int32(i * lay.chunk))
                item.written()
        return time.perf_counter() - t0, time.process_time() - c0
    buf = np.zeros(tier.file.chunk, np.float32)
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(lay.n_chunks):
        slots = tuple(lay.put(buf[s], lay.chunk) for s in range(buf.shape[0]))
        _, new_slots, _ = tier.chunk_part(g, p, slots, scalars, g_norm, jnp.int32(i * lay.chunk))
        [lay.rows(x) for s in new_slots for x in s]
    return time.perf_counter() - t0, time.process_time() - c0


def watch_streams(store) -> dict[str, float]:
    """Wraps `store.stream`; returns what it records: "cpu", this process's CPU seconds (all threads)
    from the gradient ready to the pass's end (the span `stream_s` times), added up over the passes;
    "ready", the wall clock (`time.perf_counter`) when the last pass's gradient was ready."""
    seen, stream = {"cpu": 0.0, "ready": 0.0}, store.stream

    def timed(update, fetch, ready=lambda: None, **kw):
        start = []

        def ready_then_start():
            ready()
            seen["ready"] = time.perf_counter()
            start.append(time.process_time())

        stream(update, fetch, ready=ready_then_start, **kw)
        seen["cpu"] += time.process_time() - start[0]

    store.stream = timed
    return seen


def rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def one_device_step(over: list[str], steps: int):
    """configs/tiny_cpu.yaml with `over` on one CPU device: (train step, mesh, `steps` batches, the
    compiled step). Shared by this bench's children and bench/offload_host.py's."""
    import jax
    from jax.sharding import PartitionSpec as P

    from meshrun.config import load_config
    from meshrun.data.datasets import global_batch_arrays, make_dataset
    from meshrun.parallel.sharding import DP_AXES
    from meshrun.runtime.mesh import build_mesh
    from meshrun.train.step import make_train_step

    cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"), over)
    mesh = build_mesh(cfg.mesh, devices=jax.devices()[:1])
    ts = make_train_step(cfg, mesh)
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch)
    batches = [global_batch_arrays(ds, i, mesh, P(DP_AXES)) for i in range(steps)]
    return ts, mesh, batches, ts.step.lower(ts.abstract_run, *batches[0]).compile()


def child(name: str, directory: str, budget: float, steps: int, batch: int) -> dict:
    """One tier's run in this process (`name`: none, host, nvme or nvme:ON with offload.update_on=ON):
    step times, swap counters, RSS figures."""
    import jax
    import numpy as np

    tier, _, on = name.partition(":")
    over = [*MODEL, f"offload.optimizer={tier}", f"offload.dir={directory}",
            f"offload.budget_mb={budget}", f"train.global_batch={batch}",
            *([f"offload.update_on={on}"] if on else [])]  # fmt: skip
    ts, _, batches, compiled = one_device_step(over, steps)
    temp = compiled.memory_analysis().temp_size_in_bytes
    overhead = rss("VmRSS")
    state, times, device, rest = ts.init(), [], [], []  # nvme: the device part (to the gradient ready), the rest
    init_peak = rss("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: the peak of the steps alone from here
    warm = None  # the tier's counters after step 1 (which compiles the chunk update): the swap from step 2 on
    seen = watch_streams(ts.tier.ensure_file()) if tier == "nvme" else {"cpu": 0.0}
    for k, b in enumerate(batches):
        if k == 1 and tier == "nvme":
            f = ts.tier.file
            warm = (f.stream_s, f.stream_bytes, f.streams, seen["cpu"], f.early_reads)
        s0 = ts.tier.file.stream_s if tier == "nvme" else 0.0
        t0 = time.perf_counter()
        state, m = compiled(state, *b)
        float(m["loss"])
        times.append(time.perf_counter() - t0)
        if tier == "nvme":  # the step less its device part and its stream
            device.append(seen["ready"] - t0)
            rest.append(times[-1] - device[-1] - (ts.tier.file.stream_s - s0))
    leaves = jax.tree.leaves(state.params)
    params = sum(x.size * x.dtype.itemsize for x in leaves)
    out = {"step_s": float(np.median(times[1:])), "vmhwm": rss("VmHWM"), "init_peak": init_peak, "overhead": overhead,
           "params": params, "flat": 2 * params if ts.tier is not None else 0,
           "grads": sum(x.size * 4 for x in leaves), "temp": temp,
           "opt": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.opt_state))}  # fmt: skip
    if tier == "nvme":  # (the host tier streams through an OptimizerTier too, without a file to time)
        f, lay = ts.tier.file, ts.tier.layout
        out |= {"state": f.state_bytes, "stream_bytes": f.stream_bytes - warm[1], "stream_s": f.stream_s - warm[0],
                "streams": f.streams - warm[2], "early_reads": f.early_reads - warm[4],
                "device_s": float(np.median(device[1:])), "rest_s": float(np.median(rest[1:])),
                "peak_resident": f.peak_resident, "chunks": f.n_chunks, "chunk_bytes": f.chunk_bytes,
                "stream_cpu": seen["cpu"] - warm[3], "load": os.getloadavg()[0],
                "update": update_alone(ts, state, batches[0]), "grad_row": 4 * lay.used * len(lay.first),
                "param_row": jax.numpy.dtype(ts.tier.param_dtypes[0]).itemsize * lay.used * len(lay.first),
                "master": ts.tier.master}  # fmt: skip
        out["io_bytes"], out["io_s"] = io_alone(ts.tier)
    return out


SUMMED = ("stream_bytes", "stream_s", "streams", "early_reads", "stream_cpu", "io_bytes", "io_s")


def merge(runs: list[dict]) -> dict:
    """One tier's runs (one per round) as one row: the swap counters added up (so bandwidths are over
    every round's passes), the step times and the update's medians over the rounds, the highest load."""
    import numpy as np

    out = dict(runs[0])
    for k in ("step_s", "device_s", "rest_s"):
        if k in out:
            out[k] = float(np.median([r[k] for r in runs]))
    for k in SUMMED:
        if k in out:
            out[k] = sum(r[k] for r in runs)
    if "update" in out:
        out["update"] = tuple(float(np.median([r["update"][j] for r in runs])) for j in range(2))
    if "load" in out:
        out["load"] = max(r["load"] for r in runs)
    return out


def run_child(tier: str, directory: str, budget: float, steps: int, batch: int) -> dict:
    cmd = [sys.executable, __file__, "--child", tier, "--dir", directory, "--budget-mb", str(budget),
           "--steps", str(steps), "--global-batch", str(batch)]  # fmt: skip
    # the nvme runs get 2 CPU devices, the mesh the first: with offload.update_on=host the update's
    # CPU device is then outside the mesh, as on a GPU machine (its gradient and params cross devices)
    two = {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip()}
    return _child.run_json(cmd, env=_child.env(**(two if tier.startswith("nvme") else {})))


def main() -> int:
    import numpy as np

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="")
    ap.add_argument("--disk-mb", type=int, default=1024)
    ap.add_argument("--budget-mb", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--global-batch", type=int, default=8, help="sequences of 128 tokens per step")
    ap.add_argument("--rounds", type=int, default=3, help="each tier's process this many times, alternating")
    ap.add_argument("--child", default="")
    ap.add_argument("--no-update-on", dest="update_on", action="store_false",
                    help="skip the nvme tier's runs with offload.update_on=device and host")  # fmt: skip
    args = ap.parse_args()
    if args.global_batch < 1:  # one line, before any child runs (the config's own check would end in a traceback)
        print(f"bench/offload.py: --global-batch {args.global_batch}: use a whole number >= 1", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print(f"bench/offload.py: --rounds {args.rounds}: use a whole number >= 1", file=sys.stderr)
        return 2
    if args.child:
        print(json.dumps(child(args.child, args.dir, args.budget_mb, args.steps, args.global_batch)))
        return 0
    (ROOT / "runs").mkdir(exist_ok=True)  # a fresh checkout has none
    directory = args.dir or tempfile.mkdtemp(prefix="meshrun-offload-", dir=ROOT / "runs")
    Path(directory).mkdir(parents=True, exist_ok=True)  # --dir may name one not made yet
    mib = lambda x: f"{x / 2**20:.1f}"
    w, r = disk_bandwidth(directory, args.disk_mb)
    print(f"disk {directory} ({fs_type(directory)}): sequential write {w / 1e9:.2f} GB/s (a rewrite up to "
          f"fdatasync), read {r / 1e9:.2f} GB/s (pages dropped); best of 2 passes over {args.disk_mb} MiB")  # fmt: skip
    tiers = ("none", "host", "nvme") + tuple(f"nvme:{on}" for on in PLACES[1:] if args.update_on)
    runs: dict[str, list[dict]] = {t: [] for t in tiers}
    for _ in range(args.rounds):  # the tiers' processes in turn, round after round
        for t in tiers:
            runs[t].append(run_child(t, directory, args.budget_mb, args.steps, args.global_batch))
    rows = {t: merge(x) for t, x in runs.items()}
    nv, none_s = rows["nvme"], rows["none"]["step_s"]
    state, n = nv["state"], nv["streams"]
    io_s = state / r + state / w  # one step's reads and writes at the disk's limit
    limit = 2 * state / io_s  # the disk's bandwidth for equal reads and writes, one after the other
    swap = nv["stream_bytes"] / nv["stream_s"]
    stream_s = nv["stream_s"] / n
    print(f"nvme tier: state {mib(state)} MiB = {state / (args.budget_mb * 2**20):.1f}x the {args.budget_mb} MiB "
          f"budget, {nv['chunks']} chunks of {mib(nv['chunk_bytes'])} MiB; tier's peak buffers "
          f"{mib(nv['peak_resident'])} MiB")  # fmt: skip
    print(f"swap: {swap / 1e9:.2f} GB/s read+write = {100 * swap / limit:.0f}% of the disk's limit for equal reads "
          f"and writes ({limit / 1e9:.2f} GB/s = 2 / (1/read + 1/write)); target >= 70%")  # fmt: skip
    io = nv["io_bytes"] / nv["io_s"]
    print(f"the tier's I/O pipeline alone (no update, 2 passes): {io / 1e9:.2f} GB/s = {100 * io / limit:.0f}% of "
          "the disk's limit")  # fmt: skip
    (update_s, update_cpu), cores = nv["update"], os.cpu_count()
    print(f"streamed update: {stream_s:.3f} s per step (gradient ready -> state on disk); the update alone (no disk) "
          f"{update_s:.3f} s, the I/O at the disk's limit {io_s:.3f} s: "
          f"{stream_s / max(update_s, io_s):.2f}x their max")  # fmt: skip
    print(f"CPU (this process, all threads): the stream {nv['stream_cpu'] / n:.3f} s per step, the update alone "
          f"{update_cpu:.3f} s; {cores} cores, load average {nv['load']:.1f} after the nvme steps")  # fmt: skip
    bound = 1.1 * max(none_s, io_s)
    # each round's nvme step against its own round's bound (the processes ran next to each other)
    per_round = [a["step_s"] / (1.1 * max(b["step_s"], io_s)) for a, b in zip(runs["nvme"], runs["none"])]
    verdict = float(np.median(per_round))
    print(f"nvme step {nv['step_s']:.3f} s vs 1.1 x max(none {none_s:.3f} s, I/O {io_s:.3f} s) = {bound:.3f} s "
          f"(medians over {args.rounds} rounds); each round's nvme step / its bound: "
          f"{', '.join(f'{x:.2f}x' for x in per_round)}; median {verdict:.2f}x: "
          f"{'met' if verdict <= 1 else 'missed'}")  # fmt: skip
    # The floor: the update waits for the whole gradient's norm (the clip), so the stream follows the
    # device part; at best it takes the update or the I/O at the disk's limit, whichever is longer,
    # less the chunks read while the device part ran.
    early = nv["early_reads"] / n * nv["chunk_bytes"] / r
    floor = nv["device_s"] + max(update_s, io_s - early)
    print(f"nvme step: device part {nv['device_s']:.3f} s, stream {stream_s:.3f} s, the rest {nv['rest_s']:.3f} s "
          "(medians over the steps); its "
          f"floor = device part + max(update alone {update_s:.3f} s, I/O at the limit less the early reads "
          f"{io_s - early:.3f} s) = {floor:.3f} s = {floor / bound:.2f}x the bound; the step is "
          f"{nv['step_s'] / floor:.2f}x its floor")  # fmt: skip
    host = nv["grad_row"] + nv["param_row"] * (1 if nv["master"] else 2)  # no master: the old params go out too
    out = "gradient" if nv["master"] else "gradient, params"
    print(f"host<->device bytes per step with the update on the device (state in and out): {mib(2 * state)} MiB; "
          f"on the host CPU ({out} out, new params in): {mib(host)} MiB")  # fmt: skip
    print(
        f"\n| tier | step s (median of {args.rounds}) | x none (median of the rounds' ratios) | each round's step s |"
    )
    print("|---|---:|---:|---|")
    for t, x in rows.items():
        if ":" not in t:
            ratio = np.median([a["step_s"] / b["step_s"] for a, b in zip(runs[t], runs["none"])])
            each = ", ".join(f"{a['step_s']:.3f}" for a in runs[t])
            print(f"| {t} | {x['step_s']:.3f} | {ratio:.2f} | {each} |", flush=True)
    if args.update_on:
        update_places(rows, {"auto": 0, "device": 2 * state, "host": host})
    offload_rss.report(directory, args.budget_mb, 3)
    return 0


def update_places(rows: dict, link: dict) -> None:
    """The nvme tier's stream and step with the chunk update in each place (`offload.update_on`)."""
    mib = lambda x: f"{x / 2**20:.1f}"
    print("\nwhere the nvme tier's update runs (offload.update_on; auto: in place on CPU devices), "
          f"load average {rows['nvme:host']['load']:.1f} after the last:")  # fmt: skip
    print("| update on | stream s | x auto | update alone s | stream CPU s | step s | x none "
          "| host link MiB/step on a GPU |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    auto, none_s = rows["nvme"], rows["none"]["step_s"]
    per = lambda x: x["stream_s"] / x["streams"]
    for on in PLACES:
        x = rows["nvme" if on == "auto" else f"nvme:{on}"]
        print(f"| {on} | {per(x):.3f} | {per(x) / per(auto):.2f} | {x['update'][0]:.3f} | "
              f"{x['stream_cpu'] / x['streams']:.3f} | {x['step_s']:.3f} | {x['step_s'] / none_s:.2f} | "
              f"{mib(link[on])} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
