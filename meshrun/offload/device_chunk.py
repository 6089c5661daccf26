"""The in-place pass's ring buffer (`DeviceChunk`): on the CPU backend the device's memory is host
memory, so the streamed update's chunk buffers can be the device's own arrays, read and written by
the store in place (`chunk_store.ChunkStore.stream(ring=...)`, `optimizer_tier.OptimizerTier.step`)."""

from __future__ import annotations

import ctypes
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class DeviceChunk:
    """One ring buffer of the in-place pass (the CPU backend, where the device's memory is host
    memory): a chunk of every slot as the device's own arrays, each slot's two halves. The store reads
    chunk i straight into them (`views`), the update donates them and writes the new chunk into the
    same buffers (XLA aliases a donated input with the output of its shape), and the store writes
    those back: no copy between numpy and jax, no fresh pages per chunk. Only whole passes touch the
    buffers: the store reads into one only after its last write finished, and no computation reads
    it then. If XLA did not alias an input, the output arrays simply become the buffers."""

    def __init__(self, lay: Any, pieces: tuple[int, ...], n_slots: int):  # lay: a flat_layout.FlatLayout
        self.lay = lay
        self.slots = tuple(tuple(jnp.zeros(lay.shape(n), jnp.float32, device=lay.sharding) for n in pieces)
                           for _ in range(n_slots))  # fmt: skip
        jax.block_until_ready(self.slots)  # the zeros written before the store reads into them
        # rows replicated over local devices (not their owner's first): `spread` fills them
        self.others = [r for r in range(len(lay.local)) if lay.first[lay.owner[r]] != r]
        self.sources = [lay.first[lay.owner[r]] for r in self.others]

    def _views(self, rows) -> list[np.ndarray]:
        """Writable host views of the local rows `rows` of every slot's halves, in the file's order."""
        out = []
        for s in self.slots:
            by_dev = [{x.device: x.data for x in half.addressable_shards} for half in s]
            out += [host_view(d[self.lay.local[r]]) for r in rows for d in by_dev]
        return out

    def views(self) -> list[np.ndarray]:
        return self._views(self.lay.first)

    def spread(self) -> None:
        """Rows replicated over local devices: copy each distinct row to its other replicas."""
        if self.others:
            for dst, src in zip(self._views(self.others), self._views(self.sources), strict=True):
                np.copyto(dst, src)

    def written(self) -> list[np.ndarray]:
        """The new chunk's pieces in the file's order, once the update that made them has finished."""
        jax.block_until_ready(self.slots)
        return self.views()


def host_view(x: jax.Array) -> np.ndarray:
    """A writable float32 view of a CPU device buffer (its memory is host memory)."""
    n = x.size
    return np.ctypeslib.as_array((ctypes.c_float * n).from_address(x.unsafe_buffer_pointer()))
