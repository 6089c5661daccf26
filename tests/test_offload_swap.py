"""The NVMe tier's file on its own (no jax): chunk sizing from the budget, and one streamed pass's
I/O: one positional read and one write per chunk, the update sees every chunk in order in a
page-aligned buffer that is not refilled before the update is done with it, the new state lands in
the file, at most three chunks of host memory held and two updates unwritten, the bytes counted."""

import mmap
import time

import numpy as np
import pytest

from meshrun.errors import ConfigError
from meshrun.offload import chunk_store, swap_file


def test_chunk_elems_from_budget():
    """Three chunks of (slots x rows) float32 rows fit the budget, in multiples of ALIGN, at most the
    row rounded up to ALIGN; a budget below one ALIGN per buffer is a ConfigError naming the minimum."""
    mib = 2**20
    assert chunk_store.SLOTS_IN_FLIGHT == 3 and swap_file.ALIGN == 1024
    # 16 MiB / (3 buffers x 2 slots x 1 row x 4 B) = 699050.67 elements -> 682 x 1024
    assert swap_file.chunk_elems(16 * mib, 2, 1, 13_000_000) == 682 * 1024
    assert swap_file.chunk_elems(16 * mib, 3, 4, 13_000_000) == 113 * 1024  # master, m, v of 4 distinct rows
    assert swap_file.chunk_elems(16 * mib, 2, 1, 5000) == 5 * 1024  # the whole row in one chunk
    assert swap_file.chunk_elems(3 * 2 * 4 * 1024, 2, 1, 10**6) == 1024  # exactly one ALIGN per buffer
    with pytest.raises(ConfigError, match=r"offload.budget_mb: .*use at least 0.02"):
        swap_file.chunk_elems(3 * 2 * 4 * 1024 - 1, 2, 1, 10**6)


@pytest.mark.parametrize("with_done", [False, True], ids=["freed-by-fetch", "freed-by-done"])
def test_stream_one_read_one_write_per_chunk_three_chunks_held(tmp_path, with_done):
    """One pass: one read and one write call per chunk, updates in order on page-aligned buffers that are
    refilled only once their update is done (`done`, or `fetch` without it), at most OUTPUTS_IN_FLIGHT
    updates dispatched and not yet written, three chunks held; both ring buffers are filled during
    `ready()` and those reads are not counted in the timed bytes."""
    n, chunk = 6, (2, 3, 1024)
    f = swap_file.SwapFile(tmp_path, n, chunk)
    try:
        start = np.arange(n * np.prod(chunk), dtype=np.float32).reshape(n, *chunk)
        f.write_all(lambda i: list(start[i].reshape(-1, chunk[-1])))
        assert (f.reads, f.writes) == (0, n)
        seen, ready, unwritten = [], [], []

        def update(i, buf):
            seen.append(i)
            unwritten.append(i + 1 - (f.writes - n))  # dispatched (this one too) minus written
            assert buf.ctypes.data % mmap.PAGESIZE == 0  # the device may alias it instead of copying
            np.testing.assert_array_equal(buf, start[i])
            return i, buf  # the "device" reads buf later, in done / fetch

        def finish(handle):
            i, buf = handle
            time.sleep(0.05)  # a slow update: the reader must not refill buf meanwhile
            np.testing.assert_array_equal(buf, start[i])
            return list((buf * 2 + i).reshape(-1, chunk[-1]))

        def wait_both_read():  # the gradient "arrives" once both ring buffers are filled
            while f.reads < 2:
                time.sleep(0.001)
            ready.append(len(seen))

        if with_done:
            outs = {}  # the "device's" outputs, made in done while buf still holds the chunk

            def fetch(h):
                if h[0] >= n - 2:  # no read follows the last two chunks: done is not called for them
                    return finish(h)
                while h[0] not in outs:
                    time.sleep(0.001)
                return outs.pop(h[0])

            f.stream(update, fetch, ready=wait_both_read, done=lambda h: outs.setdefault(h[0], finish(h)))
        else:
            f.stream(update, finish, ready=wait_both_read)
        assert seen == list(range(n)) and ready == [0]  # ready() before the first update
        assert chunk_store.OUTPUTS_IN_FLIGHT == 2 and max(unwritten) == 2  # the bound, reached (the writer is slow)
        assert (f.reads, f.writes, f.streams, f.early_reads) == (n, 2 * n, 1, 2)
        assert f.bytes_read == f.state_bytes and f.bytes_written == 2 * f.state_bytes
        assert f.stream_bytes == 2 * f.state_bytes - 2 * f.chunk_bytes  # chunks 0 and 1 read before the timer
        assert f.peak_resident == chunk_store.SLOTS_IN_FLIGHT * f.chunk_bytes
        got = []
        f.read_all(lambda i, buf: got.append(buf.copy()))
        np.testing.assert_array_equal(np.stack(got), start * 2 + np.arange(n).reshape(n, 1, 1, 1))
    finally:
        f.close()
    assert not f.path.exists()
