"""offload.grads=nvme: each layer's reduced float32 gradient goes from the backward straight to
the layer tier's swap file, where the streamed update reads it with the layer's optimizer state.

The file's chunks (`swap_file.SwapFile`, `[slots][rows][C]`) get one more slot after the state's: the
gradient, in the state's row layout (`layer_layout.LayerLayout`: layer-major, a layer or a piece of
one per row). The fetch's backward (`layer_fetch.use_grad_sink`) calls `GradSink.write` on the host
with each device's block of one leaf of one layer; the block goes to its place in every chunk that
holds the layer (a piece each when layers are cut) with positional writes, from the callback's own
buffer: the sink holds no gradient beyond the blocks being written (`resident`, `peak_resident`).
A stream reads the gradient slot with the state and writes back the state slots only
(`ChunkStore.kept`). Replicas of a row (devices holding the same shard) are written once.
"""

from __future__ import annotations

import threading

import numpy as np

from meshrun.errors import DataError
from meshrun.offload import swap_file
from meshrun.offload.layer_layout import LayerLayout


class GradSink:
    """The host side of the gradient's way to the file: `write(index, block, *coords)` per device, leaf
    and layer (`layer_fetch.sink_index`'s index, the device's mesh coordinates)."""

    def __init__(self, file: swap_file.SwapFile, lay: LayerLayout, slot: int, cast: bool):
        self.file, self.lay, self.slot, self.cast = file, lay, slot, cast
        self.k = len(lay.shapes)
        rows = {lay.local[r]: u for u, r in enumerate(lay.first)}  # the device that writes each distinct row
        self.row_of = {d: rows.get(d) for d in lay.local}
        self.resident = self.peak_resident = 0  # host bytes of gradient blocks being written
        self.bytes_written = self.writes = 0
        self.error: Exception | None = None
        self._count = threading.Lock()

    def offsets(self, layer: int, leaf: int, row: int) -> list[tuple[int, int, int]]:
        """(byte offset in the file, first element of the block, elements) of each piece of leaf `leaf` of
        layer `layer` in distinct row `row`."""
        lay, f = self.lay, self.file
        rows, c = len(lay.first), lay.chunk
        size = lay.sizes[leaf]
        out = []
        for k in range(lay.split):
            whole = lay.split == 1  # a chunk of `per` whole layers, else one piece of one layer
            chunk, at = (layer // lay.per, (layer % lay.per) * lay.row) if whole else (layer * lay.split + k, 0)
            elem = ((chunk * f.chunk[0] + self.slot) * rows + row) * c + at + lay.offsets[leaf]
            out.append((elem * 4, k * size, size))
        return out

    def write(self, index, block, *coords) -> None:
        """The io_callback: one device's block of one leaf of one layer, to its places in the file."""
        if self.error is not None:
            return
        device = self.lay.mesh.devices[tuple(int(c) for c in coords)]
        row = self.row_of.get(device)
        if row is None:  # another device of this process writes this row, or not this process's device
            return
        layer, leaf = divmod(int(index), self.k)
        flat = np.ascontiguousarray(block, np.float32).reshape(-1)
        with self._count:
            self.resident += flat.nbytes
            self.peak_resident = max(self.peak_resident, self.resident)
        try:
            for off, first, n in self.offsets(layer, leaf, row):
                view = memoryview(flat[first : first + n]).cast("B")
                calls = self.file.write_at(off, [view], "write the gradient to")
                with self._count:
                    self.writes += calls
                    self.bytes_written += len(view)
        except DataError as e:
            self.error = e
        finally:
            with self._count:
                self.resident -= flat.nbytes

    def check(self) -> None:
        """After the backward: a write that failed raises here (the callback's own error would lose its
        message in the runtime)."""
        if self.error is not None:
            err, self.error = self.error, None
            raise err
