"""Dropless experts on XLA:CPU: rows sorted by group (expert), `sizes_G` rows each, through their group's FFN.

XLA:CPU lowers `jax.lax.ragged_dot` to a masked dense matmul over every group and every row, the
padding rows of a worst-case buffer included. `ffn` runs one loop over tiles of `tile` rows instead,
each tile one group's rows, whose trip count is the number of tiles the actual rows fill (at most
sum(sizes)/tile + G): rows past sum(sizes) cost nothing and come out zero, as ragged_dot gives them.
A tile window that would run past the last row is moved back to end there (no padded copy of the
rows). Its gradient (custom_vjp) is one more such loop, the tile's activations recomputed and the
weight gradients summed in float32. GPUs and TPUs run ragged_dot (a grouped GEMM; models/dropless.py).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from meshrun_models.layers import vary_over, varying_axes


def _varying(carry, *refs):
    """The loop's zero carries varying over every manual mesh axis its inputs vary over (shard_map)."""
    axes = frozenset().union(*(varying_axes(r) for r in jax.tree.leaves(refs)))
    return jax.tree.map(lambda c: vary_over(c, axes), carry)


def _sum_to(ct: jax.Array, like: jax.Array) -> jax.Array:
    """A weight's cotangent summed over the manual axes the weight does not vary over (what AD's
    transpose of the implicit pvary does), so it has the weight's type."""
    extra = tuple(sorted(varying_axes(ct) - varying_axes(like)))
    return jax.lax.psum(ct, extra) if extra else ct


def _plan(sizes_G: jax.Array, tile: int):
    """Per group: its first tile, its first row; and the number of tiles the rows fill."""
    n_tiles_G = (sizes_G + tile - 1) // tile
    tile_end_G = jnp.cumsum(n_tiles_G)
    return tile_end_G - n_tiles_G, tile_end_G, jnp.cumsum(sizes_G) - sizes_G, tile_end_G[-1]


def _tile_at(t, sizes_G, plan, tile: int, rows: int):
    """Tile t's group, the start of its window of `tile` rows (moved back so that it ends by row
    `rows`) and the window's rows that are the tile's (the rest belong to other tiles)."""
    first_tile_G, tile_end_G, row_start_G, _ = plan
    g = jnp.sum(t >= tile_end_G).astype(jnp.int32)
    first = row_start_G[g] + (t - first_tile_G[g]) * tile
    valid = jnp.minimum(tile, sizes_G[g] + row_start_G[g] - first)
    start = jnp.minimum(first, rows - tile)
    at = jnp.arange(tile) + (start - first)
    return g, start, ((at >= 0) & (at < valid))[:, None]


def ffn(x_RxD, w_in, w2_GxFxD, sizes_G, act, tile: int = 64):
    """act(x @ w_in[0][g], x @ w_in[1][g], ...) @ w2[g] per row's group g (`w_in` a tuple of [G, D, F]
    weights, e.g. (gate, up) under swiglu), fused in one tile loop (XLA:CPU): one loop forward and
    one backward (the tile's activations recomputed), not a loop per matrix."""
    r = x_RxD.shape[0]
    if r < tile:  # fewer rows than one tile: pad (zero rows past the groups), run, cut
        out = ffn(jnp.pad(x_RxD, ((0, tile - r), (0, 0))), w_in, w2_GxFxD, sizes_G, act, tile)
        return out[:r]
    return _fused(x_RxD, tuple(w_in), w2_GxFxD, sizes_G.astype(jnp.int32), act, tile)


def _tile_ffn(x, w_in, w2, act):
    return jnp.dot(act(*(jnp.dot(x, w) for w in w_in)), w2)


def _ffn_loop(x_RxD, w_in, w2, sizes_G, act, tile: int):
    r = x_RxD.shape[0]
    plan = _plan(sizes_G, tile)

    def body(t, out):
        g, start, keep = _tile_at(t, sizes_G, plan, tile, r)
        x = jax.lax.dynamic_slice_in_dim(x_RxD, start, tile)
        y = _tile_ffn(x, tuple(w[g] for w in w_in), w2[g], act).astype(out.dtype)
        y = jnp.where(keep, y, jax.lax.dynamic_slice_in_dim(out, start, tile))
        return jax.lax.dynamic_update_slice_in_dim(out, y, start, 0)

    out = jnp.zeros((r, w2.shape[2]), jnp.result_type(x_RxD.dtype, w2.dtype))
    out = _varying(out, x_RxD, w_in, w2, sizes_G)
    return jax.lax.fori_loop(0, plan[3], body, out)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused(x_RxD, w_in, w2, sizes_G, act, tile: int):
    return _ffn_loop(x_RxD, w_in, w2, sizes_G, act, tile)


def _fused_fwd(x_RxD, w_in, w2, sizes_G, act, tile: int):
    return _ffn_loop(x_RxD, w_in, w2, sizes_G, act, tile), (x_RxD, w_in, w2, sizes_G)


def _fused_bwd(act, tile: int, res, dy_RxD):
    x_RxD, w_in, w2, sizes_G = res
    r = x_RxD.shape[0]
    plan = _plan(sizes_G, tile)
    dy_RxD = dy_RxD.astype(x_RxD.dtype)

    def body(t, carry):
        dx, dw_in, dw2 = carry
        g, start, keep = _tile_at(t, sizes_G, plan, tile, r)
        x = jnp.where(keep, jax.lax.dynamic_slice_in_dim(x_RxD, start, tile), 0)
        dy = jnp.where(keep, jax.lax.dynamic_slice_in_dim(dy_RxD, start, tile), 0)
        _, vjp = jax.vjp(lambda a, b, c: _tile_ffn(a, b, c, act), x, tuple(w[g] for w in w_in), w2[g])
        dxt, d_in, d2 = vjp(dy)
        dxt = jnp.where(keep, dxt, jax.lax.dynamic_slice_in_dim(dx, start, tile))
        dx = jax.lax.dynamic_update_slice_in_dim(dx, dxt, start, 0)
        dw_in = tuple(a.at[g].add(b.astype(jnp.float32)) for a, b in zip(dw_in, d_in, strict=True))
        return dx, dw_in, dw2.at[g].add(d2.astype(jnp.float32))

    f32 = lambda w: jnp.zeros(w.shape, jnp.float32)
    init = (jnp.zeros(x_RxD.shape, x_RxD.dtype), tuple(f32(w) for w in w_in), f32(w2))
    init = _varying(init, x_RxD, w_in, w2, sizes_G, dy_RxD)
    dx, dw_in, dw2 = jax.lax.fori_loop(0, plan[3], body, init)
    dw_in = tuple(_sum_to(d.astype(w.dtype), w) for d, w in zip(dw_in, w_in, strict=True))
    return _sum_to(dx, x_RxD), dw_in, _sum_to(dw2.astype(w2.dtype), w2), None


_fused.defvjp(_fused_fwd, _fused_bwd)
