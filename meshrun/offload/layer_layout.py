"""The file layout of offload.params's nvme tier (`param_tier.py`): the stacked layer leaves'
rows, layer-major, so that a chunk of the file is whole layers or one piece of a layer, and the rule
that picks the chunk for the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshrun.errors import ConfigError
from meshrun.offload import flat_layout, swap_file
from meshrun.offload.chunk_store import SLOTS_IN_FLIGHT


@dataclass(frozen=True)
class LayerLayout(flat_layout.FlatLayout):
    """A `FlatLayout` of the stacked layer leaves whose row is layer-major: `layers` local layers, each
    cut into `split` pieces along every leaf's first axis after the layer axis, each piece `row`
    elements (its slice of every leaf, then zeros up to a multiple of ALIGN). A chunk is `per` whole
    layers (split 1) or one piece of a layer."""

    layers: int = 0
    split: int = 1
    row: int = 0
    per: int = 1

    @property
    def sizes(self) -> tuple[int, ...]:
        """Elements of each leaf in one piece."""
        return tuple(math.prod(s[1:]) // self.split for s in self.shapes)

    @property
    def piece_shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple((s[1] // self.split, *s[2:]) for s in self.shapes)

    @property
    def segments(self) -> tuple[tuple[int, int, int, int], ...]:
        sizes, offs = self.sizes, self.offsets
        return tuple((k, u * r, u * self.row + o, r) for u in range(self.layers * self.split)
                     for k, (o, r) in enumerate(zip(offs, sizes, strict=True)))  # fmt: skip

    def where(self, i: int) -> tuple[int, int]:
        """(first local layer, piece) of chunk i."""
        return (i * self.per, 0) if self.split == 1 else divmod(i, self.split)

    def to_rows(self, leaves: list, n: int) -> jax.Array:
        """Local slices of `n` pieces (or whole layers when split is 1) of the leaves -> the row [n * row]
        (inside a shard_map body); whole shards [layers, ...] with n = layers * split."""
        parts = [x.reshape(n, -1).astype(jnp.float32) for x in leaves]
        pad = self.row - sum(self.sizes)
        parts += [jnp.zeros((n, pad), jnp.float32)] if pad else []
        return jnp.concatenate(parts, axis=1).reshape(-1)

    def from_rows(self, row, n: int) -> list:
        """The inverse of `to_rows`: float32 slices [n, *piece shape] of every leaf."""
        row = row.reshape(n, self.row)
        return [row[:, o : o + r].reshape(n, *s)
                for o, r, s in zip(self.offsets, self.sizes, self.piece_shapes, strict=True)]  # fmt: skip

    def flatten(self, leaves: list, dtype) -> jax.Array:
        ndim, n = len(self.mesh.axis_names), self.layers * self.split
        body = lambda *xs: self.to_rows(list(xs), n).astype(dtype).reshape((1,) * ndim + (self.length,))
        axes = P(*self.mesh.axis_names)
        return jax.shard_map(body, mesh=self.mesh, in_specs=self.specs, out_specs=axes, check_vma=False)(*leaves)

    def unflatten(self, flat: jax.Array, dtypes: list) -> list:
        def body(v):
            got = self.from_rows(v, self.layers * self.split)
            return tuple(x.reshape(s).astype(dt) for x, s, dt in zip(got, self.shapes, dtypes, strict=True))

        axes = P(*self.mesh.axis_names)
        return list(jax.shard_map(body, mesh=self.mesh, in_specs=axes, out_specs=self.specs, check_vma=False)(flat))


def layer_layout(mesh: Mesh, layers: Any, opt_specs: Any, slots: int, budget_bytes: float) -> LayerLayout:
    """The layout of the stacked layer leaves `layers` (their optimizer specs `opt_specs`) whose chunks
    of `slots` rows (the state's, and the gradient's when it rests in the file too) fit the budget
    (`SLOTS_IN_FLIGHT` of them): the most whole layers per chunk that divide the
    local layer count, else the fewest pieces per layer that divide every leaf's first axis after
    the layer axis; a ConfigError naming the budget the smallest chunk needs when none fits."""
    base = flat_layout.flat_layout(mesh, layers, opt_specs, slots, 2**62)  # rows, shapes; its chunk is unused
    n = base.shapes[0][0]
    bytes_of = lambda row: SLOTS_IN_FLIGHT * slots * len(base.first) * 4 * row  # in flight, one row a chunk
    aligned = lambda x: -(-x // swap_file.ALIGN) * swap_file.ALIGN
    firsts = [s[1] for s in base.shapes if len(s) > 1]
    common = math.gcd(*firsts) if len(firsts) == len(base.shapes) else 1
    sizes = [math.prod(s[1:]) for s in base.shapes]
    split, per = 1, 0
    row = aligned(sum(sizes))
    fits = [j for j in range(1, n + 1) if n % j == 0 and j * bytes_of(row) <= budget_bytes]
    if fits:
        per = max(fits)
    else:
        for q in (q for q in range(2, common + 1) if common % q == 0):
            split, row = q, aligned(sum(sizes) // q)
            if bytes_of(row) <= budget_bytes:
                per = 1
                break
    if not per:
        raise ConfigError("offload.budget_mb", budget_bytes / 2**20, f"use at least {bytes_of(row) / 2**20:.2f}",
                          f"too small for three chunks of the layers' optimizer state (offload.params "
                          f"streams layers, cut into at most {common} pieces)")  # fmt: skip
    offsets = tuple(int(o) for o in np.cumsum([0, *(r // split for r in sizes[:-1])]))
    length = n * split * row
    return LayerLayout(mesh, base.specs, base.shapes, offsets, length, length, per * row, base.local, base.owner,
                       base.first, layers=n, split=split, row=row, per=per)  # fmt: skip
