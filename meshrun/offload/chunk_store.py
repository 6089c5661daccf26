"""The pipelined pass over a process's optimizer state in fixed-size chunks (`ChunkStore.stream`)
and the host tier's store (`HostStore`: the chunks in one host array); the nvme tier's file is
`swap_file.SwapFile`. Apart from swap_file.py because the pipeline is the same for every store.

`stream` pipelines the chunks the way DeepSpeed's `PipelinedOptimizerSwapper` does: while chunk i
is updated, chunk i + 1 is read and chunk i - 1 written, each thread handing the chunk on to the
next through a queue as soon as its part is done; the tier holds at most `SLOTS_IN_FLIGHT`
chunks of host memory, counted in `resident`: either the store's two page-aligned read buffers
(the device may take a chunk without a copy; one is refilled only once the update that read it has
finished) and one chunk being written, or, in place (`stream(ring=...)`, the CPU backend), the
caller's three buffers, which the update overwrites with the new chunk and the writer writes back.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from meshrun.offload.malloc import return_freed_buffers

SLOTS_IN_FLIGHT = 3  # chunk buffers the pipeline holds at once: read i + 1, update i, write i - 1
OUTPUTS_IN_FLIGHT = 2  # updates dispatched and not yet written: the one being written and the next
# Fault injection (tests): in the N-th streamed update of the process (1-based), the middle chunk's
# swap-out fails with ENOSPC, or the process is SIGKILLed there.
FAULT_ENOSPC = "MESHRUN_FAULT_OFFLOAD_ENOSPC"
FAULT_KILL = "MESHRUN_FAULT_OFFLOAD_KILL"
_streams = [0]


def resting_bytes(lay, slots: int) -> tuple[float, float]:
    """(the store's bytes, its chunk buffers' bytes) per device of this process, for `slots` float32
    rows per element of the layout `lay`: the whole rows (replicated over devices, stored once) and
    `SLOTS_IN_FLIGHT` chunks of them (a tier's `bytes_per_device`)."""
    row = slots * len(lay.first) * 4  # bytes of one element of every slot and distinct row
    return row * lay.length / len(lay.local), SLOTS_IN_FLIGHT * row * lay.chunk / len(lay.local)


def maybe_fault(i: int, n_chunks: int) -> None:
    """The fault hooks (above) at chunk i's swap-out."""
    if i != n_chunks // 2:
        return
    if os.environ.get(FAULT_KILL, "") == str(_streams[0]):
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get(FAULT_ENOSPC, "") == str(_streams[0]):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class ChunkStore:
    """A process's optimizer state as `n_chunks` chunks of shape `chunk` (slots, rows, C), and the
    pipelined pass over them (`stream`). Where the chunks rest is the subclass's: a file (`SwapFile`,
    the nvme tier) or host memory (`HostStore`, the host tier); `read`, `write` and `settle` move them."""

    def __init__(self, n_chunks: int, chunk: tuple[int, int, int], kept: int | None = None):
        self.n_chunks, self.chunk = n_chunks, chunk
        self.chunk_bytes = int(np.prod(chunk)) * 4
        # slots a write carries: the first `kept` (the rest, e.g. a gradient slot, is written elsewhere
        # and only read with the chunk)
        self.kept = chunk[0] if kept is None else kept
        self.write_bytes = self.chunk_bytes // chunk[0] * self.kept
        self.resident = self.peak_resident = 0  # host bytes of chunk buffers held by the tier
        self.bytes_read = self.bytes_written = 0
        self.reads = self.writes = 0  # read / write calls (one per chunk unless a transfer comes up short)
        self.streams, self.stream_bytes = 0, 0  # streamed updates; bytes they moved while timed
        self.early_reads = 0  # chunks the streamed updates read before their timer started
        self.stream_s = 0.0  # wall seconds of `stream` from the gradient ready to the last write settled
        self.kept_ring: list | None = None  # a caller's in-place ring kept between passes (`keep_ring`)
        self._count = threading.Lock()
        return_freed_buffers()

    def _start(self) -> None:
        """The reader and writer threads (once the store exists)."""
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="offload-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="offload-write")
        self._buffers: list[np.ndarray] = []

    @property
    def _ring(self) -> list[np.ndarray]:
        """The store's two read buffers, made on first use (a pass with the caller's own ring,
        `stream(ring=...)`, frees them first: `release_buffers`)."""
        if not self._buffers:
            self.drop_ring()
            self._buffers = [self._hold(aligned(self.chunk)) for _ in range(2)]
        return self._buffers

    def keep_ring(self, make: Callable[[], list]) -> list:
        """The caller's in-place ring for `stream(ring=...)`, kept from one pass to the next (made by
        `make()` when there is none) and counted in `resident` while kept: the store's own buffers are
        released first, and anything else that needs chunk buffers drops it (`drop_ring`)."""
        if self.kept_ring is None:
            self.release_buffers()
            self.kept_ring = [self._hold(b) for b in make()]
        return self.kept_ring

    def drop_ring(self) -> None:
        if self.kept_ring is not None:
            for _ in self.kept_ring:
                self._release()
            self.kept_ring = None

    def release_buffers(self) -> None:
        """Unmap the store's read buffers (made again when next needed)."""
        for _ in self._buffers:
            self._release()
        self._buffers = []

    def read(self, i: int, buf: np.ndarray | list[np.ndarray]) -> np.ndarray | list[np.ndarray]:
        """Chunk i into `buf`: one chunk-shaped array, or writable pieces in the chunk's order."""
        raise NotImplementedError

    def write(self, i: int, parts: Iterable[np.ndarray]) -> None:
        raise NotImplementedError

    def settle(self) -> None:
        """After a pass: every written chunk where it rests."""

    def _swap_out(self, i: int) -> None:
        """Chunk i's new pieces exist and are about to be written (the fault hooks' place)."""

    def close(self) -> None:
        for pool in ("_reader", "_writer"):
            if hasattr(self, pool):
                getattr(self, pool).shutdown(wait=True)

    @property
    def state_bytes(self) -> int:
        return self.n_chunks * self.write_bytes

    # ------------------------------------------------------------ accounting

    def _hold(self, buf=None):
        with self._count:
            self.resident += self.chunk_bytes
            self.peak_resident = max(self.peak_resident, self.resident)
        return buf

    def _release(self) -> None:
        with self._count:
            self.resident -= self.chunk_bytes

    @contextlib.contextmanager
    def held(self):
        """One more chunk of host memory held while inside (a chunk on its way to or from the file
        that is not one of the ring buffers: init's computed chunk, a checkpoint's copy)."""
        self.drop_ring()
        self._hold(None)
        try:
            yield
        finally:
            self._release()

    @property
    def buffer(self) -> np.ndarray:
        """A ring buffer for a pass outside `stream` (init, checkpoints)."""
        return self._ring[0]

    # ------------------------------------------------------------ the pipelined pass

    def stream(self, update: Callable[[int, np.ndarray], object], fetch: Callable[[object], list[np.ndarray]],
               ready: Callable[[], object] = lambda: None,
               done: Callable[[object], object] | None = None, ring: list | None = None) -> None:  # fmt: skip
        """For every chunk i: `update(i, buf)` (buf: chunk i as read; returns a handle, e.g. arrays still
        being computed), then `fetch(handle)` on the writer thread gives the new chunk's pieces, which
        are written back. The update may keep reading buf (a device aliasing it) until `done(handle)`
        returned, or without `done` until `fetch` returned; only then is buf refilled. The reader,
        this thread (`_dispatch`) and the writer hand chunks on through queues (`_Handoff`). `ready()`
        blocks until the update's inputs exist (the gradient): the first chunks are read meanwhile.
        `stream_s` counts from its return to the last chunk settled (`settle`), `stream_bytes` what
        moved in that time (`early_reads`: chunks read before).

        `ring` (in place): the caller's SLOTS_IN_FLIGHT buffers instead of the store's (`_caller_ring`),
        objects whose `views()` are chunk i's writable pieces in the chunk's order. The update may
        overwrite a buffer with the new chunk (a device updating its donated input in place) and
        `fetch` return views of it: a buffer goes back to the reader only once written, and the store
        holds no other copy. Two of them are filled before `ready()` returns, as the store's own two."""
        _streams[0] += 1
        in_place = ring is not None
        with self._caller_ring(ring):
            h = _Handoff(ring[:2] if in_place else self._ring)
            reads = self._reader.submit(self._read_loop, h, done)
            writes = self._writer.submit(self._write_loop, h, fetch, "after write" if in_place else done is None)
            try:
                ready()
                t0, early = time.perf_counter(), h.read
                self._dispatch(h, update, None if in_place else done, ring[2:] if in_place else ())
                reads.result()
                writes.result()
                self.settle()
                self._count_stream(time.perf_counter() - t0, early)
            finally:  # on an error: stop the threads and let them finish before the buffers go away
                h.abort()
                for f in (reads, writes):
                    with contextlib.suppress(BaseException):
                        f.result()

    @contextlib.contextmanager
    def _caller_ring(self, ring: list | None):
        """While a pass runs on the caller's ring (`stream(ring=...)`): the store's own read buffers
        released, and the ring counted in `resident` unless it is the kept one (`keep_ring`: counted
        already). Nothing to do for a pass on the store's own buffers (`ring` None)."""
        counted = ring is not None and ring is not self.kept_ring
        if ring is not None:
            self.release_buffers()
        for _ in ring if counted else ():
            self._hold()
        try:
            yield
        finally:
            for _ in ring if counted else ():
                self._release()

    def _dispatch(self, h: _Handoff, update, done, spare: Iterable) -> None:
        """This thread's part of `stream`, once `ready()` returned: `update(i, buf)` for each chunk as
        the reader hands it over, the handle on to the writer, at most OUTPUTS_IN_FLIGHT updates
        dispatched and not yet written (their outputs: device memory). `spare`: the in-place ring's
        buffers beyond the first two, for the reader now; `done` (not in place): buf goes back to the
        reader with its handle, to be refilled once `done(handle)` returned."""
        for buf in spare:
            h.free.put(buf)
        for i in range(self.n_chunks):
            buf = h.filled.get()
            if buf is None or h.failed:  # the reader or the writer failed: `stream` raises its error
                break
            h.outstanding.acquire()
            handle = update(i, buf)
            if done is not None:
                h.free.put((buf, handle))  # the reader refills buf once done(handle) returned
            h.todo.put((i, handle, buf))
        h.todo.put(None)

    def _count_stream(self, seconds: float, early: int) -> None:
        """A finished pass in the counters: its `seconds` from `ready()` to the last chunk settled, and
        the bytes moved in that time (all reads and writes but the `early` chunks read before)."""
        self.stream_s += seconds
        self.streams += 1
        self.early_reads += early
        self.stream_bytes += (self.chunk_bytes + self.write_bytes) * self.n_chunks - early * self.chunk_bytes

    def _read_loop(self, h: _Handoff, done) -> None:
        """The reader's part of `stream`: chunk i into the next free ring buffer, in order."""
        try:
            for i in range(self.n_chunks):
                item = h.free.get()
                if item is None:
                    return
                if isinstance(item, tuple):  # (buf, the update reading it)
                    item, handle = item
                    done(handle)
                self.read(i, item if isinstance(item, np.ndarray) else item.views())
                h.filled.put(item)
                h.read += 1
        except BaseException:
            h.abort()
            raise

    def _write_loop(self, h: _Handoff, fetch, frees: bool | str) -> None:
        """The writer's part of `stream`: each updated chunk's pieces to the store, in order; its ring
        buffer goes back to the reader once fetched (`frees` True) or once written ("after write")."""
        try:
            while (item := h.todo.get()) is not None:
                i, handle, buf = item
                if frees == "after write":
                    self._write_back(i, fetch, handle, _Once(lambda: None), hold=False)
                    h.free.put(buf)
                else:
                    self._write_back(i, fetch, handle, _Once(lambda b=buf: h.free.put(b) if frees else None))
                h.outstanding.release()
        except BaseException:
            h.abort()
            raise

    def _write_back(self, i: int, fetch, handle, fetched: threading.Event | None = None, hold: bool = True) -> None:
        """Chunk i's new pieces (`fetch(handle)`) to the store, held while written (`hold`: they are not
        in a ring buffer). `fetched` (a streamed update): set once they exist, and chunk i's fault hooks
        run."""
        if hold:
            if fetched is None:  # not a pass's own chunk (init, a restore): no kept ring beside it
                self.drop_ring()
            self._hold()
        try:
            parts = fetch(handle)
            if fetched is not None:
                fetched.set()
                self._swap_out(i)
            self.write(i, parts)
        finally:
            if fetched is not None:
                fetched.set()
            if hold:
                self._release()

    def read_all(self, each: Callable[[int, np.ndarray], None]) -> None:
        """`each(i, buf)` for every chunk in order (checkpoints: the whole state, one chunk at a time)."""
        for i in range(self.n_chunks):
            each(i, self.read(i, self._ring[0]))

    def write_all(self, pieces: Callable[[int], list[np.ndarray]]) -> None:
        for i in range(self.n_chunks):
            self._write_back(i, pieces, i)
        self.settle()


class HostStore(ChunkStore):
    """One process's optimizer state in host memory (the host tier): the chunks in one page-aligned
    array, in the file's layout, so the streamed update, init and checkpoints run as for the nvme
    tier. A read copies chunk i into a ring buffer and a write copies the new chunk back: the update
    never takes the store's own memory, and what it holds beyond the store is counted as for a file."""

    def __init__(self, n_chunks: int, chunk: tuple[int, int, int]):
        super().__init__(n_chunks, chunk)
        self.data = aligned((n_chunks, *chunk))  # untouched pages cost nothing until written
        self._start()

    def read(self, i: int, buf: np.ndarray | list[np.ndarray]) -> np.ndarray | list[np.ndarray]:
        if isinstance(buf, np.ndarray):
            np.copyto(buf, self.data[i])
        else:
            row, done = self.data[i].reshape(-1), 0
            if sum(b.size for b in buf) != row.size:
                raise ValueError(f"chunk {i}: a buffer of {sum(b.size for b in buf) * 4} bytes, expected "
                                 f"{self.chunk_bytes}")  # fmt: skip
            for b in buf:
                np.copyto(b, row[done : done + b.size].reshape(b.shape))
                done += b.size
        self.reads += 1
        self.bytes_read += self.chunk_bytes
        return buf

    def write(self, i: int, parts: Iterable[np.ndarray]) -> None:
        """Chunk i from its (slot, row) pieces in store order."""
        parts, row, done = list(parts), self.data[i].reshape(-1), 0
        if sum(p.size for p in parts) != row.size:
            raise ValueError(f"chunk {i}: {sum(p.size for p in parts) * 4} bytes, expected {self.chunk_bytes}")
        for p in parts:
            row[done : done + p.size] = p.reshape(-1)
            done += p.size
        self.writes += 1
        self.bytes_written += self.chunk_bytes


class _Once:
    """`set()` calls `fn` the first time only (`_write_back`'s signal that the pieces exist)."""

    def __init__(self, fn: Callable[[], object]):
        self.fn: Callable[[], object] | None = fn

    def set(self) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()


class _Handoff:
    """The queues of one `stream`: ring buffers to fill (-> reader), chunks read (reader -> main
    thread), updated chunks to write (main thread -> writer); `outstanding` bounds the updates not yet
    written. None in a queue: stop (`abort`, on an error anywhere)."""

    def __init__(self, ring: list[np.ndarray]):
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        self.filled: queue.SimpleQueue = queue.SimpleQueue()
        self.todo: queue.SimpleQueue = queue.SimpleQueue()
        self.outstanding = threading.Semaphore(OUTPUTS_IN_FLIGHT)
        self.read, self.failed = 0, False  # chunks read so far
        for buf in ring:
            self.free.put(buf)

    def abort(self) -> None:
        self.failed = True
        for q in (self.free, self.filled, self.todo):
            q.put(None)
        self.outstanding.release()  # the main thread may wait for the writer


def aligned(shape: tuple[int, ...]) -> np.ndarray:
    """An uninitialized float32 array on fresh anonymous pages (page-aligned; unmapped when unused)."""
    return np.frombuffer(mmap.mmap(-1, int(np.prod(shape)) * 4), np.float32).reshape(shape)
