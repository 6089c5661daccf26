"""The nvme tier's I/O pipeline alone, after an idle gap before each pass (a script, not a test).

    python bench/offload_gap.py [--dir DIR] [--disk-mb 512] [--gaps 0.5,1,1.5,2.5,3.5,5] [--reps 3]

Each pass is the tier's own (`SwapFile.stream` without an update: the next chunk read while the
last is written, then the settle: `fdatasync` and the file's pages dropped), over a file shaped as
bench/offload.py's state (101 MiB in 19 chunks). Before each pass the process sleeps for the gap;
the gaps take turns within each repetition. A step's device part is such a gap for the stream: 0.6 s
at bench/offload.py's default batch, 2.5 s at `--global-batch 32`. Prints, per gap, the pass's
seconds (median), its bandwidth against the disk's limit for equal reads and writes, and the
process's kernel CPU seconds per pass (getrusage). On a machine where the gap does not matter the
rows agree; docs/offload.md ("A gap before the pass") has what this CPU machine gave.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _child  # noqa: E402  (bench/_child.py)
from offload import disk_bandwidth, fs_type, io_file  # noqa: E402  (bench/offload.py)

ROOT = _child.ROOT
CHUNKS = 19  # bench/offload.py's state at its 16 MiB budget: 19 chunks of 2 slots (Adam's m, v) x 1 row


def gaps_arg(text: str) -> list[float]:
    try:
        gaps = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        gaps = []
    if not gaps or any(g < 0 for g in gaps):
        raise argparse.ArgumentTypeError(f"{text!r}: use seconds >= 0, comma-separated (e.g. 0.5,3)")
    return gaps


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from meshrun.offload import swap_file

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="")
    ap.add_argument("--disk-mb", type=int, default=512)
    ap.add_argument("--gaps", type=gaps_arg, default=gaps_arg("0.5,1,1.5,2.5,3.5,5"), help="seconds, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if args.reps < 1:
        print(f"bench/offload_gap.py: --reps {args.reps}: use a whole number >= 1", file=sys.stderr)
        return 2
    (ROOT / "runs").mkdir(exist_ok=True)
    directory = args.dir or tempfile.mkdtemp(prefix="meshrun-offload-gap-", dir=ROOT / "runs")
    Path(directory).mkdir(parents=True, exist_ok=True)
    w, r = disk_bandwidth(directory, args.disk_mb)
    limit = 2 / (1 / r + 1 / w)
    chunk = (2, 1, swap_file.chunk_elems(16 * 2**20, 2, 1, 1 << 30))  # the chunk that budget gives
    with io_file(directory, CHUNKS, chunk) as (f, one_pass):
        moved = f.n_chunks * (f.chunk_bytes + f.write_bytes)  # one pass: every chunk read and written
        one_pass()  # once untimed: the threads and buffers exist
        runs: dict[float, list[tuple[float, float]]] = {g: [] for g in args.gaps}
        for _ in range(args.reps):
            for gap in args.gaps:
                time.sleep(gap)
                s0, k0 = f.stream_s, resource.getrusage(resource.RUSAGE_SELF).ru_stime
                one_pass()
                runs[gap].append((f.stream_s - s0, resource.getrusage(resource.RUSAGE_SELF).ru_stime - k0))
    print(f"disk {directory} ({fs_type(directory)}): write {w / 1e9:.2f} GB/s, read {r / 1e9:.2f} GB/s, limit for "
          f"equal reads and writes {limit / 1e9:.2f} GB/s; one pass moves {moved / 2**20:.1f} MiB "
          f"({CHUNKS} chunks); {args.reps} passes per gap, the gaps in turn")  # fmt: skip
    print("\n| gap before the pass s | pass s (median) | each pass s | GB/s | % of the limit | kernel CPU s per pass |")
    print("|---:|---:|---|---:|---:|---:|")
    for gap, xs in runs.items():
        s = statistics.median(x[0] for x in xs)
        each = ", ".join(f"{x[0]:.3f}" for x in xs)
        print(f"| {gap:g} | {s:.3f} | {each} | {moved / s / 1e9:.2f} | {100 * moved / s / limit:.0f} | "
              f"{statistics.median(x[1] for x in xs):.3f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
