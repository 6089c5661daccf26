"""Grouped matmul for dropless MoE: rows sorted by group, `sizes_G` rows each, row r times its group's weight.

`gmm` is `jax.lax.ragged_dot` on GPU and TPU (a grouped GEMM). XLA:CPU lowers ragged_dot to a masked
dense matmul over every group and every row, padding rows included; there `gmm` runs a loop over
tiles of `tile` rows instead, each tile one group's rows, whose trip count is the number of tiles the
actual rows fill (at most sum(sizes)/tile + G): padding rows past sum(sizes) cost nothing. Its
gradient (custom_vjp) is two more such loops: dx = gmm(dy, w^T), dw[g] = sum of x_tile^T dy_tile.
Rows past sum(sizes) are zero in the output, as ragged_dot gives them.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def gmm(x_RxK: jax.Array, w_GxKxN: jax.Array, sizes_G: jax.Array, tile: int = 32) -> jax.Array:
    """Grouped matmul: ragged_dot off CPU, the tile loop (work ~ the actual rows) on XLA:CPU."""
    sizes_G = sizes_G.astype(jnp.int32)
    if jax.default_backend() != "cpu":
        return jax.lax.ragged_dot(x_RxK, w_GxKxN, sizes_G)
    return _tiled(x_RxK, w_GxKxN, sizes_G, tile)


def _varying(carry, *refs):
    """The loop's zero carries varying over every manual mesh axis its inputs vary over (shard_map)."""
    axes = tuple(sorted(set().union(*(_vma(r) for r in refs))))
    return jax.tree.map(lambda c: jax.lax.pcast(c, axes, to="varying") if axes else c, carry)


def _sum_to(ct: jax.Array, like: jax.Array) -> jax.Array:
    """A weight's cotangent summed over the manual axes the weight does not vary over (what AD's
    transpose of the implicit pvary does), so it has the weight's type."""
    extra = tuple(sorted(_vma(ct) - _vma(like)))
    return jax.lax.psum(ct, extra) if extra else ct


def _vma(x: jax.Array) -> frozenset:
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)  # jax >= 0.10; older jax: ShapedArray.vma
    return frozenset(mat.varying if mat is not None else getattr(t, "vma", ()))


def _plan(sizes_G: jax.Array, tile: int):
    """Per group: its first tile, its first row; and the number of tiles the rows fill."""
    n_tiles_G = (sizes_G + tile - 1) // tile
    tile_end_G = jnp.cumsum(n_tiles_G)
    return tile_end_G - n_tiles_G, tile_end_G, jnp.cumsum(sizes_G) - sizes_G, tile_end_G[-1]


def _tile_at(t, sizes_G, plan, tile: int):
    """Tile t's group, first row and number of valid rows (the rest belong to later groups)."""
    first_tile_G, tile_end_G, row_start_G, _ = plan
    g = jnp.sum(t >= tile_end_G).astype(jnp.int32)
    off = (t - first_tile_G[g]) * tile
    return g, row_start_G[g] + off, jnp.minimum(tile, sizes_G[g] - off)


def _loop_mm(x_RxK, w_GxKxN, sizes_G, tile: int):
    """out[rows of g] = x[rows of g] @ w[g], tile by tile over the filled tiles only."""
    r = x_RxK.shape[0]
    plan = _plan(sizes_G, tile)
    x_pad = jnp.pad(x_RxK, ((0, tile), (0, 0)))  # a last partial tile reads past row r
    dt = jnp.result_type(x_RxK.dtype, w_GxKxN.dtype)

    def body(t, out):
        g, start, valid = _tile_at(t, sizes_G, plan, tile)
        y = jnp.dot(jax.lax.dynamic_slice_in_dim(x_pad, start, tile), w_GxKxN[g]).astype(dt)
        keep = (jnp.arange(tile) < valid)[:, None]
        y = jnp.where(keep, y, jax.lax.dynamic_slice_in_dim(out, start, tile))
        return jax.lax.dynamic_update_slice_in_dim(out, y, start, 0)

    out = _varying(jnp.zeros((r + tile, w_GxKxN.shape[2]), dt), x_RxK, w_GxKxN, sizes_G)
    return jax.lax.fori_loop(0, plan[3], body, out)[:r]


def _loop_dw(x_RxK, dy_RxN, sizes_G, n_groups: int, tile: int):
    """dw[g] = x[rows of g]^T @ dy[rows of g] (float32 sums), tile by tile over the filled tiles."""
    plan = _plan(sizes_G, tile)
    x_pad = jnp.pad(x_RxK, ((0, tile), (0, 0)))
    dy_pad = jnp.pad(dy_RxN, ((0, tile), (0, 0)))

    def body(t, dw):
        g, start, valid = _tile_at(t, sizes_G, plan, tile)
        keep = (jnp.arange(tile) < valid)[:, None]
        x = jnp.where(keep, jax.lax.dynamic_slice_in_dim(x_pad, start, tile), 0)
        dy = jax.lax.dynamic_slice_in_dim(dy_pad, start, tile)
        upd = jnp.dot(x.T, dy, preferred_element_type=jnp.float32)
        return dw.at[g].add(upd)

    dw = _varying(jnp.zeros((n_groups, x_RxK.shape[1], dy_RxN.shape[1]), jnp.float32), x_RxK, dy_RxN, sizes_G)
    return jax.lax.fori_loop(0, plan[3], body, dw)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled(x_RxK, w_GxKxN, sizes_G, tile: int):
    return _loop_mm(x_RxK, w_GxKxN, sizes_G, tile)


def _tiled_fwd(x_RxK, w_GxKxN, sizes_G, tile: int):
    return _loop_mm(x_RxK, w_GxKxN, sizes_G, tile), (x_RxK, w_GxKxN, sizes_G)


def _tiled_bwd(tile: int, res, dy_RxN):
    x_RxK, w_GxKxN, sizes_G = res
    dx = _loop_mm(dy_RxN, jnp.swapaxes(w_GxKxN, 1, 2), sizes_G, tile).astype(x_RxK.dtype)
    dw = _loop_dw(x_RxK, dy_RxN, sizes_G, w_GxKxN.shape[0], tile).astype(w_GxKxN.dtype)
    return _sum_to(dx, x_RxK), _sum_to(dw, w_GxKxN), None


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


def ffn(x_RxD, w1_GxDxH, w2_GxFxD, sizes_G, act, tile: int = 64):
    """act(x @ w1[g]) @ w2[g] per row's group g, fused in one tile loop (XLA:CPU): one loop forward
    and one backward (the tile's activations recomputed) instead of a gmm loop per matrix."""
    return _fused(x_RxD, w1_GxDxH, w2_GxFxD, sizes_G.astype(jnp.int32), act, tile)


def _tile_ffn(x, w1, w2, act):
    return jnp.dot(act(jnp.dot(x, w1)), w2)


def _ffn_loop(x_RxD, w1, w2, sizes_G, act, tile: int):
    r = x_RxD.shape[0]
    plan = _plan(sizes_G, tile)
    x_pad = jnp.pad(x_RxD, ((0, tile), (0, 0)))

    def body(t, out):
        g, start, valid = _tile_at(t, sizes_G, plan, tile)
        y = _tile_ffn(jax.lax.dynamic_slice_in_dim(x_pad, start, tile), w1[g], w2[g], act).astype(out.dtype)
        keep = (jnp.arange(tile) < valid)[:, None]
        y = jnp.where(keep, y, jax.lax.dynamic_slice_in_dim(out, start, tile))
        return jax.lax.dynamic_update_slice_in_dim(out, y, start, 0)

    out = jnp.zeros((r + tile, w2.shape[2]), jnp.result_type(x_RxD.dtype, w2.dtype))
    out = _varying(out, x_RxD, w1, w2, sizes_G)
    return jax.lax.fori_loop(0, plan[3], body, out)[:r]


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused(x_RxD, w1, w2, sizes_G, act, tile: int):
    return _ffn_loop(x_RxD, w1, w2, sizes_G, act, tile)


def _fused_fwd(x_RxD, w1, w2, sizes_G, act, tile: int):
    return _ffn_loop(x_RxD, w1, w2, sizes_G, act, tile), (x_RxD, w1, w2, sizes_G)


def _fused_bwd(act, tile: int, res, dy_RxD):
    x_RxD, w1, w2, sizes_G = res
    plan = _plan(sizes_G, tile)
    x_pad = jnp.pad(x_RxD, ((0, tile), (0, 0)))
    dy_pad = jnp.pad(dy_RxD.astype(x_RxD.dtype), ((0, tile), (0, 0)))

    def body(t, carry):
        dx, dw1, dw2 = carry
        g, start, valid = _tile_at(t, sizes_G, plan, tile)
        keep = (jnp.arange(tile) < valid)[:, None]
        x = jnp.where(keep, jax.lax.dynamic_slice_in_dim(x_pad, start, tile), 0)
        dy = jnp.where(keep, jax.lax.dynamic_slice_in_dim(dy_pad, start, tile), 0)
        _, vjp = jax.vjp(lambda a, b, c: _tile_ffn(a, b, c, act), x, w1[g], w2[g])
        dxt, d1, d2 = vjp(dy)
        dxt = jnp.where(keep, dxt, jax.lax.dynamic_slice_in_dim(dx, start, tile))
        dx = jax.lax.dynamic_update_slice_in_dim(dx, dxt, start, 0)
        return dx, dw1.at[g].add(d1.astype(jnp.float32)), dw2.at[g].add(d2.astype(jnp.float32))

    f32 = lambda w: jnp.zeros(w.shape, jnp.float32)
    init = (jnp.zeros((x_RxD.shape[0] + tile, x_RxD.shape[1]), x_RxD.dtype), f32(w1), f32(w2))
    init = _varying(init, x_RxD, w1, w2, sizes_G, dy_RxD)
    dx, dw1, dw2 = jax.lax.fori_loop(0, plan[3], body, init)
    dx = _sum_to(dx[: x_RxD.shape[0]], x_RxD)
    return dx, _sum_to(dw1.astype(w1.dtype), w1), _sum_to(dw2.astype(w2.dtype), w2), None


_fused.defvjp(_fused_fwd, _fused_bwd)
