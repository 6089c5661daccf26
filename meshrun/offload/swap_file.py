"""The nvme tier's store (`SwapFile`): a process's optimizer state as fixed-size chunks in one
preallocated file, read and written with positional I/O, `os.preadv` / `os.pwritev`, which release
the GIL, on the pipeline's one reader and one writer thread (`chunk_store.ChunkStore.stream`).

File layout: chunk-major, `[n_chunks][slots][rows][C]` float32, so one chunk (every slot: master,
m, v, ... of every distinct local row, `C` elements each) is one contiguous read and one contiguous
write. The file's pages leave the page cache as they are written (`settle`). The directory is
locked (`directory.lock_dir`) for this process: a second process on it is refused.
"""

from __future__ import annotations

import contextlib
import errno
import os
import weakref
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from meshrun.errors import ConfigError, DataError
from meshrun.offload.chunk_store import SLOTS_IN_FLIGHT, ChunkStore, maybe_fault

ALIGN = 1024  # chunk length granularity in elements (4 KiB of float32: page-aligned file offsets)


def _io_error(path: Path, e: OSError, what: str) -> DataError:
    hint = "free space on it or use another offload.dir" if e.errno in (errno.ENOSPC, errno.EFBIG) else \
        "check the disk and offload.dir"  # fmt: skip
    return DataError(f"optimizer offload: cannot {what} {path} ({e.strerror or e}); {hint}")


class SwapFile(ChunkStore):
    """One process's optimizer state on disk (the nvme tier): one preallocated file, positional I/O."""

    def __init__(self, directory: Path, n_chunks: int, chunk: tuple[int, int, int], kept: int | None = None):
        super().__init__(n_chunks, chunk, kept)
        self.directory = Path(directory)
        self.path = self.directory / f"optimizer-state-{os.getpid()}-{id(self):x}.bin"
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as e:
            raise _io_error(self.directory, e, "create a file in") from None
        self._final = weakref.finalize(self, _close, self.fd, str(self.path))
        try:
            os.posix_fallocate(self.fd, 0, self.n_chunks * self.chunk_bytes)  # a full disk fails here, not mid-step
        except OSError as e:
            self.close()
            raise _io_error(self.directory, e, "allocate the optimizer state in") from None
        self._start()

    def close(self) -> None:
        super().close()
        self._final()

    def _swap_out(self, i: int) -> None:
        try:
            maybe_fault(i, self.n_chunks)
        except OSError as e:
            raise _io_error(self.directory, e, "write the optimizer state to") from None

    # ------------------------------------------------------------ positional I/O

    def read(self, i: int, buf: np.ndarray | list[np.ndarray]) -> np.ndarray | list[np.ndarray]:
        views = _bytes(buf if isinstance(buf, list) else [buf])
        off, total, done = i * self.chunk_bytes, sum(len(v) for v in views), 0
        if total != self.chunk_bytes:
            raise ValueError(f"chunk {i}: a buffer of {total} bytes, expected {self.chunk_bytes}")
        try:
            while done < total:  # a short read: continue after what was read
                n = os.preadv(self.fd, _after(views, done), off + done)
                self.reads += 1
                if n == 0:
                    raise OSError(errno.EIO, "short read")
                done += n
        except OSError as e:
            raise _io_error(self.directory, e, "read the optimizer state from") from None
        self.bytes_read += done
        return buf

    def write(self, i: int, parts: Iterable[np.ndarray]) -> None:
        """Chunk i's first `kept` slots from their (slot, row) pieces in file order."""
        views = _bytes(np.ascontiguousarray(p, np.float32) for p in parts)
        off, total = i * self.chunk_bytes, sum(len(v) for v in views)
        if total != self.write_bytes:
            raise ValueError(f"chunk {i}: {total} bytes, expected {self.write_bytes}")
        self.writes += self.write_at(off, views)
        try:
            _advise(self.fd, off, total)  # start the chunk's writeback now (its pages go once clean)
        except OSError as e:
            raise _io_error(self.directory, e, "write the optimizer state to") from None
        self.bytes_written += total

    def write_at(self, off: int, views: list[memoryview], what: str = "write the optimizer state to") -> int:
        """`views` (bytes) at byte offset `off`, continuing after a short write; the number of write
        calls. An OSError (or a write that writes nothing) raises `DataError` saying what failed."""
        total, done, calls = sum(len(v) for v in views), 0, 0
        try:
            while done < total:  # a short write: continue after what was written
                n = os.pwritev(self.fd, _after(views, done), off + done)
                calls += 1
                if n == 0:
                    raise OSError(errno.EIO, "short write")
                done += n
        except OSError as e:
            raise _io_error(self.directory, e, what) from None
        return calls

    def settle(self) -> None:
        """Every written chunk on disk, and the file's pages out of the page cache: the tier's state rests
        on the disk, not in host memory, and the next pass reads it from there."""
        try:
            os.fdatasync(self.fd)
        except OSError as e:
            raise _io_error(self.directory, e, "write the optimizer state to") from None
        _advise(self.fd, 0, 0)


def _bytes(arrays: Iterable[np.ndarray]) -> list[memoryview]:
    return [memoryview(a).cast("B") for a in arrays]


def _after(views: list[memoryview], skip: int) -> list[memoryview]:
    """`views` without their first `skip` bytes (what is left after a short read or write)."""
    rest = []
    for v in views:
        if skip < len(v):
            rest.append(v[skip:])
        skip = max(0, skip - len(v))
    return rest


def _close(fd: int, path: str) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(path)


def _advise(fd: int, off: int, n: int) -> None:
    """posix_fadvise(DONTNEED) on bytes [off, off + n) (n = 0: to the end): Linux starts writing dirty
    pages back and drops clean ones. Without it the page cache would hold up to the whole file."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)


def chunk_elems(budget_bytes: float, slots: int, rows: int, row_len: int) -> int:
    """Elements per row of one chunk: SLOTS_IN_FLIGHT chunks of (slots x rows) float32 rows fit the
    budget; a multiple of ALIGN, at most the row length rounded up to ALIGN."""
    fit = int(budget_bytes // (SLOTS_IN_FLIGHT * slots * rows * 4)) // ALIGN * ALIGN
    if fit < ALIGN:
        need = SLOTS_IN_FLIGHT * slots * rows * 4 * ALIGN / 2**20
        raise ConfigError("offload.budget_mb", budget_bytes / 2**20, f"use at least {need:.2f}",
                          "too small for one chunk per buffer")  # fmt: skip
    whole = -(-row_len // ALIGN) * ALIGN
    return min(fit, whole)
