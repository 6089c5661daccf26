"""Dropless experts on XLA:CPU: rows sorted by group (expert), `sizes_G` rows each, through their group's FFN.

XLA:CPU lowers `jax.lax.ragged_dot` to a masked dense matmul over every group and every row, the
padding rows of a worst-case buffer included. `ffn` runs one loop over tiles of `tile` rows instead,
each tile one group's rows, whose trip count is the number of tiles the actual rows fill (at most
sum(sizes)/tile + G): rows past sum(sizes) cost nothing and come out zero, as ragged_dot gives them.
A tile window that would run past the last row is moved back to end there (no padded copy of the
rows). Its gradient (custom_vjp) is one more such loop, the tile's activations recomputed and the
weight gradients summed in float32. With `cap`, each group's first cap rows run as batched matmuls
instead and the loop takes only the rows past them. GPUs and TPUs run ragged_dot (models/dropless.py).
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


def _plan(groups, tile: int):
    """Per group: its first tile, its first row; and the number of tiles the rows fill."""
    row_start_G, sizes_G = groups
    n_tiles_G = (sizes_G + tile - 1) // tile
    tile_end_G = jnp.cumsum(n_tiles_G)
    return tile_end_G - n_tiles_G, tile_end_G, row_start_G, tile_end_G[-1]


def _tile_at(t, groups, plan, tile: int, rows: int):
    """Tile t's group, the start of its window of `tile` rows (moved back so that it ends by row
    `rows`) and the window's rows that are the tile's (the rest belong to other tiles)."""
    first_tile_G, tile_end_G, row_start_G, _ = plan
    sizes_G = groups[1]
    g = jnp.sum(t >= tile_end_G).astype(jnp.int32)
    first = row_start_G[g] + (t - first_tile_G[g]) * tile
    valid = jnp.minimum(tile, sizes_G[g] + row_start_G[g] - first)
    start = jnp.minimum(first, rows - tile)
    at = jnp.arange(tile) + (start - first)
    return g, start, ((at >= 0) & (at < valid))[:, None]


def ffn(x_RxD, w_in, w2_GxFxD, sizes_G, act, tile: int = 64, cap: int = 0):
    """act(x @ w_in[0][g], x @ w_in[1][g], ...) @ w2[g] per row's group g (`w_in` a tuple of [G, D, F]
    weights, e.g. (gate, up) under swiglu), fused in one tile loop (XLA:CPU): one loop forward and
    one backward (the tile's activations recomputed), not a loop per matrix. `cap` > 0: each group's
    first `cap` rows run as one batched matmul over [G, cap] slots (`_batched`) and only the rows
    past them through the loop, which then runs no iteration unless a group has more than `cap`."""
    r = x_RxD.shape[0]
    if r < tile:  # fewer rows than one tile: pad (zero rows past the groups), run, cut
        out = ffn(jnp.pad(x_RxD, ((0, tile - r), (0, 0))), w_in, w2_GxFxD, sizes_G, act, tile, cap)
        return out[:r]
    sizes_G = sizes_G.astype(jnp.int32)
    start_G = jnp.cumsum(sizes_G) - sizes_G
    over = (start_G + cap, jnp.maximum(sizes_G - cap, 0))
    out = _fused(x_RxD, tuple(w_in), w2_GxFxD, over, act, tile)
    return out + _batched(x_RxD, tuple(w_in), w2_GxFxD, start_G, sizes_G, act, cap) if cap else out


def _batched(x_RxD, w_in, w2, start_G, sizes_G, act, cap: int):
    """Each group's first `cap` rows through its FFN as batched matmuls over [G, cap, D] slots; the
    other rows come out zero. The rows move by `take_rows` both ways (gather gradients)."""
    r, g = x_RxD.shape[0], sizes_G.shape[0]
    c = jnp.arange(cap)
    src_GxC = jnp.minimum(start_G[:, None] + c[None, :], r - 1).reshape(g * cap)
    ok_GxC = (c[None, :] < sizes_G[:, None]).reshape(g * cap)
    row = jnp.arange(r)
    g_R = jnp.minimum(jnp.sum(row[:, None] >= (start_G + sizes_G)[None, :], axis=1), g - 1)
    c_R = row - start_G[g_R]
    ok_R = (c_R < cap) & (row < start_G[-1] + sizes_G[-1])
    slot_R = g_R * cap + jnp.minimum(c_R, cap - 1)
    x = take_rows(x_RxD, src_GxC, ok_GxC, slot_R[:, None], ok_R[:, None]).reshape(g, cap, -1)
    h = act(*(jnp.einsum("gcd,gdf->gcf", x, w) for w in w_in))
    y = jnp.einsum("gcf,gfd->gcd", h, w2).reshape(g * cap, -1)
    return take_rows(y, slot_R, ok_R, src_GxC[:, None], ok_GxC[:, None])


@jax.custom_vjp
def take_rows(x_NxD, idx_O, ok_O, inv_NxQ, inv_ok_NxQ):
    """Rows x[idx] (zero where not ok). The move is a partial bijection between x's rows, each taken
    Q times, and the output's ok rows; inv/inv_ok give, per row of x, its Q places in the output, so
    the gradient is a gather too (summed over Q), not a scatter-add, which XLA:CPU runs slowly."""
    return jnp.where(ok_O[:, None], x_NxD[idx_O], 0)


def _take_fwd(x_NxD, idx_O, ok_O, inv_NxQ, inv_ok_NxQ):
    return take_rows(x_NxD, idx_O, ok_O, inv_NxQ, inv_ok_NxQ), (idx_O, ok_O, inv_NxQ, inv_ok_NxQ)


def _take_bwd(res, ct_OxD):
    idx_O, ok_O, inv_NxQ, inv_ok_NxQ = res
    dx = jnp.sum(jnp.where(inv_ok_NxQ[..., None], ct_OxD[inv_NxQ], 0), axis=1)
    return dx, None, None, None, None


take_rows.defvjp(_take_fwd, _take_bwd)


def _tile_ffn(x, w_in, w2, act):
    return jnp.dot(act(*(jnp.dot(x, w) for w in w_in)), w2)


def _ffn_loop(x_RxD, w_in, w2, groups, act, tile: int):
    r = x_RxD.shape[0]
    plan = _plan(groups, tile)

    def body(t, out):
        g, start, keep = _tile_at(t, groups, plan, tile, r)
        x = jax.lax.dynamic_slice_in_dim(x_RxD, start, tile)
        y = _tile_ffn(x, tuple(w[g] for w in w_in), w2[g], act).astype(out.dtype)
        y = jnp.where(keep, y, jax.lax.dynamic_slice_in_dim(out, start, tile))
        return jax.lax.dynamic_update_slice_in_dim(out, y, start, 0)

    out = jnp.zeros((r, w2.shape[2]), jnp.result_type(x_RxD.dtype, w2.dtype))
    out = _varying(out, x_RxD, w_in, w2, groups)
    return jax.lax.fori_loop(0, plan[3], body, out)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused(x_RxD, w_in, w2, groups, act, tile: int):
    return _ffn_loop(x_RxD, w_in, w2, groups, act, tile)


def _fused_fwd(x_RxD, w_in, w2, groups, act, tile: int):
    return _ffn_loop(x_RxD, w_in, w2, groups, act, tile), (x_RxD, w_in, w2, groups)


def _fused_bwd(act, tile: int, res, dy_RxD):
    x_RxD, w_in, w2, groups = res
    r = x_RxD.shape[0]
    plan = _plan(groups, tile)
    dy_RxD = dy_RxD.astype(x_RxD.dtype)

    def body(t, carry):
        dx, dw_in, dw2 = carry
        g, start, keep = _tile_at(t, groups, plan, tile, r)
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
    init = _varying(init, x_RxD, w_in, w2, groups, dy_RxD)
    dx, dw_in, dw2 = jax.lax.fori_loop(0, plan[3], body, init)
    dw_in = tuple(_sum_to(d.astype(w.dtype), w) for d, w in zip(dw_in, w_in, strict=True))
    return _sum_to(dx, x_RxD), dw_in, _sum_to(dw2.astype(w2.dtype), w2), (None, None)


_fused.defvjp(_fused_fwd, _fused_bwd)
