"""glibc's handling of the streamed tiers' freed chunk buffers.

`return_freed_buffers()` (once per process, by every chunk store) makes chunk-sized buffers mapped
and unmapped rather than kept in glibc's arenas; `stepping()` wraps a tier's step so that its
temporaries are reused inside it and given back (`trim_freed`) after it. Not glibc: each is a no-op.
"""

from __future__ import annotations

import contextlib
import ctypes

M_MMAP_THRESHOLD, MMAP_THRESHOLD = -3, 1 << 20  # glibc's mallopt parameter (malloc.h) and the value
M_TRIM_THRESHOLD, TRIM_THRESHOLD = -1, 2 << 20  # (2x the mmap threshold, as glibc sets it itself)
KEPT_MMAP_THRESHOLD, KEPT_TRIM_THRESHOLD = 32 << 20, 1 << 30  # inside `keeping_freed_buffers` (32 MiB: the most)
_MALLOPT_DONE: list = []
_LIBC: list = []  # [glibc's CDLL, or None where there is none], loaded on first use (`_libc`)


def return_freed_buffers() -> None:
    """Make glibc give freed chunk-sized buffers back to the OS (once per process). glibc raises its
    mmap threshold to the size of any mapping freed, up to 32 MiB; chunk buffers and their device
    copies then come from its per-thread arenas and stay resident after they are freed, step after
    step (docs/offload.md, "Peak host memory"). A fixed 1 MiB threshold maps each one and unmaps it
    when freed. Not glibc: nothing to do."""
    if _MALLOPT_DONE:
        return
    _MALLOPT_DONE.append(True)
    try:
        _libc().mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        _libc().mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    except AttributeError:  # not glibc (or no libc.so.6: None)
        pass


@contextlib.contextmanager
def keeping_freed_buffers():
    """Inside, buffers up to 32 MiB come from glibc's heap and stay there when freed, instead of being
    mapped and unmapped (or trimmed off the heap's top) each time (`return_freed_buffers`' setting
    again on exit). For a pass that allocates and frees the same buffers over and over: the
    streamed update's chunks, whose temporaries XLA allocates for every chunk (each time a fresh
    mapping, its pages faulted in). The caller gives what stayed back with `trim_freed` after. Not
    glibc: nothing to do."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        yield
        return
    return_freed_buffers()
    libc.mallopt(M_TRIM_THRESHOLD, KEPT_TRIM_THRESHOLD)
    libc.mallopt(M_MMAP_THRESHOLD, KEPT_MMAP_THRESHOLD)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)


@contextlib.contextmanager
def stepping():
    """A streamed tier's step (`optimizer_tier.OptimizerTier.step`, `param_tier.ParamTier.step`): inside, freed buffers
    stay in glibc's heap (`keeping_freed_buffers`), as glibc's own rule keeps them in the in-memory
    step's process: the device part's temporaries are reused from step to step instead of mapped,
    faulted in and unmapped each time above the tiers' 1 MiB mmap threshold (measured on
    bench/offload.py's model in one process, steps alternating with and without: the nvme step 3-8%
    faster, with offload.params too 8%; docs/offload.md), and each chunk's temporaries reuse the
    last chunk's pages. After, what stayed is given back (`trim_freed`): between steps no freed
    buffers stay resident."""
    with keeping_freed_buffers():
        yield
    trim_freed()


def trim_freed() -> None:
    """Give the memory freed into glibc's arenas back to the OS (`malloc_trim(0)`, a few ms). Buffers
    below the mmap threshold that XLA's compiler, the tier's init and the chunk updates free stay
    resident in the arenas otherwise (measured on bench/offload.py's model: about 120 MiB after
    compiling, 90 MiB after init), beside the step's own peak. Not glibc: nothing to do."""
    try:
        _libc().malloc_trim(0)
    except AttributeError:  # not glibc (or no libc.so.6: None)
        pass


def _libc() -> ctypes.CDLL | None:
    """glibc, loaded once per process; None where there is no libc.so.6."""
    if not _LIBC:
        try:
            _LIBC.append(ctypes.CDLL("libc.so.6"))
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]
