"""The streamed tiers' flat view of the params and optimizer state: every device's ZeRO shard of
every leaf as one row (`FlatLayout`, chunked for the store) and where a state's parameter-shaped
leaves are (`StatePattern`). Apart from optimizer_tier.py because the layer tier builds on them too."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshrun.offload import swap_file
from meshrun.parallel.sharding import is_spec


@dataclass(frozen=True)
class FlatLayout:
    """Every device's shard of every parameter leaf (in the optimizer's ZeRO layout) as one row of a
    `[*mesh, length]` array; `local` are this process's devices (rows), `owner[r]` the distinct row
    that local row r holds (replicas share one copy on disk), `first[u]` a local row holding u."""

    mesh: Mesh
    specs: tuple  # the optimizer's PartitionSpec per leaf
    shapes: tuple  # local shard shape per leaf
    offsets: tuple
    used: int  # elements of a row holding data (the rest is zero padding)
    length: int  # a multiple of `chunk`
    chunk: int
    local: tuple
    owner: tuple
    first: tuple

    @property
    def n_chunks(self) -> int:
        return self.length // self.chunk

    @property
    def segments(self) -> tuple[tuple[int, int, int, int], ...]:
        """(leaf, first element in the leaf's flat shard, offset in the row, length) of each run of
        consecutive elements of one leaf in the row: here each leaf's whole shard."""
        return tuple((k, 0, o, math.prod(s)) for k, (o, s) in enumerate(zip(self.offsets, self.shapes, strict=True)))

    @property
    def sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(*self.mesh.axis_names))

    def shape(self, n: int) -> tuple[int, ...]:
        return (*self.mesh.devices.shape, n)

    def flatten(self, leaves: list, dtype) -> jax.Array:
        """Leaves in the optimizer layout -> [*mesh, length] rows (inside jit)."""
        ndim, pad = len(self.mesh.axis_names), self.length - self.used

        def body(*xs):
            parts = [x.reshape(-1).astype(dtype) for x in xs] + ([jnp.zeros(pad, dtype)] if pad else [])
            return jnp.concatenate(parts).reshape((1,) * ndim + (self.length,))

        axes = P(*self.mesh.axis_names)
        return jax.shard_map(body, mesh=self.mesh, in_specs=self.specs, out_specs=axes, check_vma=False)(*leaves)

    def unflatten(self, flat: jax.Array, dtypes: list) -> list:
        """The inverse of `flatten` (inside jit): the row as one piece."""
        return self.unflatten_pieces([flat], dtypes)

    def unflatten_pieces(self, pieces: list, dtypes: list) -> list:
        """`unflatten` of a row given as consecutive pieces ([*mesh, n_k] each, in row order; the streamed
        update's outputs), each leaf cut straight from the pieces it spans: no whole row in between
        (inside jit)."""
        starts = [int(x) for x in np.cumsum([0, *(p.shape[-1] for p in pieces)])]

        def leaf(ps: list, o: int, s: tuple, dt) -> jax.Array:
            n = math.prod(s)
            parts = [ps[k][max(o, a) - a : min(o + n, b) - a]
                     for k, (a, b) in enumerate(zip(starts, starts[1:])) if max(o, a) < min(o + n, b)]  # fmt: skip
            flat = parts[0] if len(parts) == 1 else jnp.concatenate(parts) if parts else jnp.zeros(0, dt)
            return flat.reshape(s).astype(dt)

        def body(*ps):
            ps = [p.reshape(-1) for p in ps]
            return tuple(leaf(ps, o, s, dt) for o, s, dt in zip(self.offsets, self.shapes, dtypes, strict=True))

        axes = P(*self.mesh.axis_names)
        return list(jax.shard_map(body, mesh=self.mesh, in_specs=(axes,) * len(pieces), out_specs=self.specs,
                                  check_vma=False)(*pieces))  # fmt: skip

    def put(self, rows: np.ndarray, n: int) -> jax.Array:
        """Host rows [distinct rows, n] -> a [*mesh, n] array on this process's devices. `rows` must stay
        unchanged until the computations reading the array have finished: XLA:CPU aliases a page-aligned
        array (`chunk_store.aligned`) instead of copying it, and a copy may still be in flight when this returns
        (measured: a ring buffer refilled too early gave a chunk the next one's state)."""
        blk = (1,) * len(self.mesh.axis_names) + (n,)
        arrays = [jax.device_put(rows[u].reshape(blk), d) for d, u in zip(self.local, self.owner)]
        return jax.make_array_from_single_device_arrays(self.shape(n), self.sharding, arrays)

    def rows(self, flat: jax.Array) -> list[np.ndarray]:
        """A [*mesh, n] array -> its distinct local rows on the host, [n] each."""
        by_dev = {s.device: s.data for s in flat.addressable_shards}
        return [np.asarray(by_dev[self.local[r]]).reshape(-1) for r in self.first]


def flat_layout(mesh: Mesh, params: Any, opt_specs: Any, slots: int, budget_bytes: float) -> FlatLayout:
    leaves = jax.tree.leaves(params)
    specs = tuple(jax.tree.leaves(opt_specs, is_leaf=is_spec))
    shardings = [NamedSharding(mesh, s) for s in specs]
    shapes = tuple(tuple(sh.shard_shape(x.shape)) for sh, x in zip(shardings, leaves, strict=True))
    sizes = [math.prod(s) for s in shapes]
    offsets = tuple(int(o) for o in np.cumsum([0, *sizes[:-1]]))
    local = tuple(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    maps = [sh.devices_indices_map(x.shape) for sh, x in zip(shardings, leaves, strict=True)]
    key = lambda d: tuple(tuple((s.start, s.stop, s.step) for s in m[d]) for m in maps)
    distinct: dict = {}
    owner = tuple(distinct.setdefault(key(d), len(distinct)) for d in local)
    first = tuple(owner.index(u) for u in range(len(distinct)))
    used = sum(sizes)
    chunk = swap_file.chunk_elems(budget_bytes, slots, len(first), used)
    length = -(-used // chunk) * chunk
    return FlatLayout(mesh, specs, shapes, offsets, used, length, chunk, local, owner, first)


@dataclass(frozen=True)
class StatePattern:
    """Where a state's parameter-shaped leaves are: `tokens[i]` is ('slot', s) or ('scalar', j) for the
    i-th group of leaves (a slot: one copy of the parameter tree, k leaves)."""

    tokens: tuple
    k: int

    @classmethod
    def of(cls, tx, state: Any, params: Any) -> StatePattern:
        k = len(jax.tree.leaves(params))
        idx = jax.tree.unflatten(jax.tree.structure(params), list(range(k)))
        marked = optax.tree_map_params(tx, lambda _, i: i, state, idx, transform_non_params=lambda _: -1)
        marks = jax.tree.leaves(marked)
        tokens, i, slots, scalars = [], 0, 0, 0
        while i < len(marks):
            if marks[i] == -1:
                tokens.append(("scalar", scalars))
                scalars, i = scalars + 1, i + 1
                continue
            if marks[i : i + k] != list(range(k)):
                raise ValueError("optimizer state: a parameter-shaped subtree is not contiguous")
            tokens.append(("slot", slots))
            slots, i = slots + 1, i + k
        return cls(tuple(tokens), k)

    @property
    def n_slots(self) -> int:
        return sum(t == "slot" for t, _ in self.tokens)

    def split(self, leaves: list) -> tuple[list[list], list]:
        slots, scalars, i = [], [], 0
        for kind, _ in self.tokens:
            if kind == "slot":
                slots.append(list(leaves[i : i + self.k]))
                i += self.k
            else:
                scalars.append(leaves[i])
                i += 1
        return slots, scalars

    def join(self, slots: list[list], scalars: list) -> list:
        out: list = []
        for kind, j in self.tokens:
            out.extend(slots[j] if kind == "slot" else [scalars[j]])
        return out
