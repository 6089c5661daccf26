"""Shared collectives for the per-layer fetch (`layer_fetch.make_fetch`, ZeRO-3 per layer).

Leaf by leaf, a Llama layer costs seven all-gathers in the forward, seven again in the backward
(under remat) and seven reduce-scatters, and the model stacks the gathered gate and up (a copy of
both, forward and recompute). The leaves of one unit that split over the same data-parallel axes
share collectives instead (a `Plan`):

* stacked -- leaves of one shape, split on one dim d, are stacked on a new axis d + 1 (a copy of
  the local shards) and gathered along d as one array. SwiGLU's stack of gate and up then folds
  away (XLA drops the slices and the stack). Their gradients are reduce-scattered leaf by leaf.
* packed  -- the small leaves (at most 1/SMALL of the unit's largest: attention's q, k, v, o) are
  flattened, split dim first, into one buffer: one all-gather and one reduce-scatter.

Every element is gathered and summed over the same devices in the same order: the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

SMALL = 8  # leaves at most 1/SMALL of the unit's largest leaf are packed into one buffer


def groupable(moves: Any) -> bool:
    """A leaf whose fetch is one gather and the reduce-scatter back over the same dim and axes."""
    return len(moves.gathers) == 1 and moves.scatters == moves.gathers


def group_key(moves: Any, x: jax.Array) -> tuple:
    """Leaves with equal keys may share collectives: the same axes, dtype and reduction."""
    return (moves.gathers[0][1], moves.rest, moves.reduce_dtype, moves.auto, jnp.dtype(x.dtype))


@dataclass(frozen=True)
class Plan:
    """The collectives of one group of leaves (`moves`: their `layer_fetch._LeafMoves`, one group key):
    `units`, each ("stack" | "pack", leaf indices); `dtypes`: the gradients' dtypes."""

    moves: tuple[Any, ...]
    units: tuple[tuple[str, tuple[int, ...]], ...]
    dtypes: tuple[Any, ...]

    @classmethod
    def of(cls, moves: Sequence[Any], xs: Sequence[jax.Array], dtypes: Sequence[Any]) -> Plan:
        big = max(x.size for x in xs)
        small = tuple(i for i, x in enumerate(xs) if x.size * SMALL <= big)
        small = small if len(small) > 1 else ()
        stacks: dict[tuple, list[int]] = {}
        for i, (m, x) in enumerate(zip(moves, xs, strict=True)):
            if i not in small:
                stacks.setdefault((x.shape, m.gathers[0][0], m.specs), []).append(i)
        units = [("stack", tuple(v)) for v in stacks.values()] + ([("pack", small)] if small else [])
        return cls(tuple(moves), tuple(units), tuple(dtypes))

    @property
    def axes(self) -> tuple[str, ...]:
        return self.moves[0].gathers[0][1]

    def dim(self, i: int) -> int:
        return self.moves[i].gathers[0][0]

    def gather(self, xs: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        """The leaves `xs` (resting shards) gathered to their compute layout."""
        return self._manual(self._gather, 0, 1)(tuple(xs))

    def reduce(self, gs: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        """The gradients `gs` (compute layout) reduce-scattered to where the leaves rest, in `dtypes`
        (as `_LeafMoves._reduce`: in float32, or the reduce dtype; psum over the `rest` axes)."""
        return self._manual(self._reduce, 1, 2)(tuple(gs))

    def _manual(self, fn: Callable, i_in: int, i_out: int) -> Callable:
        """`fn` manual over the loop's auto axes, each leaf from layout `specs[i_in]` to `specs[i_out]`."""
        auto = self.moves[0].auto
        if not auto:
            return fn
        ins, outs = tuple(m.specs[i_in] for m in self.moves), tuple(m.specs[i_out] for m in self.moves)
        return jax.shard_map(fn, in_specs=(ins,), out_specs=outs, axis_names=set(auto), check_vma=False)

    def _gather(self, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        out: list[Any] = [None] * len(xs)
        for kind, idx in self.units:
            for i, y in zip(idx, (_gather_stack if kind == "stack" else _gather_pack)(self, idx, xs), strict=True):
                out[i] = y
        return tuple(out)

    def _reduce(self, gs: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        rd = self.moves[0].reduce_dtype
        gs = tuple(g.astype(jnp.float32) for g in gs)
        gs = gs if rd is None else tuple(g.astype(rd) for g in gs)
        out: list[Any] = [None] * len(gs)
        for kind, idx in self.units:
            for i, r in zip(idx, (_scatter_stack if kind == "stack" else _scatter_pack)(self, idx, gs), strict=True):
                out[i] = r.astype(self.dtypes[i])
        return tuple(out)

    def _rest(self, r: jax.Array) -> jax.Array:
        """The psum over the data-parallel axes the leaves are not split over (HSDP's replicas)."""
        rest = self.moves[0].rest
        return jax.lax.psum(r, rest) if rest else r


def _gather_stack(plan: Plan, idx: tuple[int, ...], xs: tuple) -> list[jax.Array]:
    d = plan.dim(idx[0])
    if len(idx) == 1:
        return [jax.lax.all_gather(xs[idx[0]], plan.axes, axis=d, tiled=True)]
    g = jax.lax.all_gather(jnp.stack([xs[i] for i in idx], axis=d + 1), plan.axes, axis=d, tiled=True)
    return [jax.lax.index_in_dim(g, k, d + 1, keepdims=False) for k in range(len(idx))]


def _scatter_stack(plan: Plan, idx: tuple[int, ...], gs: tuple) -> list[jax.Array]:
    # leaf by leaf: stacked, the two gradients and their transposing copy before the one
    # reduce-scatter are live at once (+0.46 MB on docs/memory.md's ZeRO-3 config)
    d = plan.dim(idx[0])
    return [plan._rest(jax.lax.psum_scatter(gs[i], plan.axes, scatter_dimension=d, tiled=True)) for i in idx]


def _gather_pack(plan: Plan, idx: tuple[int, ...], xs: tuple) -> list[jax.Array]:
    front = [jnp.moveaxis(xs[i], plan.dim(i), 0) for i in idx]
    g = jax.lax.all_gather(jnp.concatenate([f.reshape(-1) for f in front]), plan.axes, axis=0)  # [n, total]
    out, at = [], 0
    for i, f in zip(idx, front, strict=True):
        part = g[:, at : at + f.size].reshape(-1, *f.shape[1:])  # device-major rows: the tiled gather
        out.append(jnp.moveaxis(part, 0, plan.dim(i)))
        at += f.size
    return out


def _scatter_pack(plan: Plan, idx: tuple[int, ...], gs: tuple) -> list[jax.Array]:
    n = math.prod(jax.lax.axis_size(a) for a in plan.axes)
    front = [jnp.moveaxis(gs[i], plan.dim(i), 0) for i in idx]
    r = jax.lax.psum_scatter(jnp.concatenate([f.reshape(n, -1) for f in front], axis=1), plan.axes, scatter_dimension=0)
    r = plan._rest(r)
    out, at = [], 0
    for i, f in zip(idx, front, strict=True):
        k = f.size // n
        out.append(jnp.moveaxis(r[at : at + k].reshape(f.shape[0] // n, *f.shape[1:]), 0, plan.dim(i)))
        at += k
    return out
