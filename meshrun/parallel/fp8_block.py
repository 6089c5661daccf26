"""`model.fp8=blockwise`: DeepSeek-V3's fine-grained fp8 recipe (DeepSeek-AI 2024, section 3.3).

Every operand in e4m3 with float32 scales amax / 448 of its own tile: activations in 1 x b tiles (one
token, b channels of the contraction), weights in b x b blocks. Per contraction block an fp8 GEMM
with a float32 result, scaled by its two tiles' scales and summed in float32 (the recipe's promotion
to float32 every b products). Backward, DeepSeek-V3's choice: the input gradient from dY in 1 x b
tiles (b output channels) and the same weight blocks; the weight gradient from x (dequantised from
its forward tiles) and dY re-quantised in b x 1 tiles (b tokens of one channel; the tokens are its
contraction). b is `model.fp8_block`, or a dim's size when smaller. Stateless: no history, no pmax
(a tile never spans the manual axes: the config keeps a context shard's chunks whole tiles).

A reference for the numerics: the per-block partial products are materialised (on a GPU a kernel
keeps them in registers). Letters of an einsum spec: c the blocked contraction (the last one of x),
n the blocked output channel (the last of w), t the token tiled in the weight gradient (the last of
x not in w); other letters keep one scale per index.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn
FMAX = float(jnp.finfo(E4M3).max)  # 448


def _letters(spec: str) -> tuple[str, str, str, str, str, str]:
    """(xs, ws, ys, c, n, t) of a two-operand einsum spec."""
    xs, rest = spec.split(",")
    ws, ys = rest.split("->")
    c = [a for a in xs if a in ws and a not in ys][-1]
    n = [a for a in ws if a in ys and a not in xs][-1]
    t = [a for a in xs if a in ys and a not in ws][-1]
    return xs, ws, ys, c, n, t


def _split(a: jax.Array, spec: str, letter: str, block: int) -> tuple[jax.Array, str]:
    """Axis `letter` of `a` (zero-padded to a multiple of its block) as (blocks, block): the spec gets
    `letter.upper()` before it. Its block: min(block, size)."""
    i = spec.index(letter)
    size = a.shape[i]
    b = min(block, size)
    if size % b:
        a = jnp.pad(a, [(0, -size % b if j == i else 0) for j in range(a.ndim)])
    a = a.reshape(*a.shape[:i], a.shape[i] // b, b, *a.shape[i + 1 :])
    return a, spec.replace(letter, letter.upper() + letter)


def _quantize(a: jax.Array, spec: str, inner: str) -> tuple[jax.Array, jax.Array, str]:
    """(e4m3 values, float32 scales, the scales' spec): one scale amax / 448 per tile, a tile spanning
    the `inner` letters (1 where a tile is all zeros)."""
    axes = tuple(spec.index(a_) for a_ in inner)
    amax = jnp.max(jnp.abs(a.astype(jnp.float32)), axis=axes, keepdims=True)
    scale = jnp.where((amax > 0) & jnp.isfinite(amax), amax / FMAX, 1.0).astype(jnp.float32)
    q = jnp.clip(a.astype(jnp.float32) / scale, -FMAX, FMAX).astype(E4M3)
    return q, jnp.squeeze(scale, axes), "".join(a_ for a_ in spec if a_ not in inner)


def _blocked_dot(qa, sa, a_spec, sa_spec, qb, sb, b_spec, sb_spec, inner: str, out: str) -> jax.Array:
    """sum over blocks of (scale_a scale_b) x (the fp8 GEMM of the two tiles over `inner`), float32."""
    keep = "".join(dict.fromkeys(a_ for a_ in a_spec + b_spec if a_ != inner))
    part = jnp.einsum(f"{a_spec},{b_spec}->{keep}", qa, qb, preferred_element_type=jnp.float32)
    return jnp.einsum(f"{sa_spec},{sb_spec},{keep}->{out}", sa, sb, part)


def _merge(a: jax.Array, spec: str, letter: str, size: int) -> jax.Array:
    """Undo `_split` of `letter` (and its padding) to `size`."""
    i = spec.index(letter.upper())
    a = a.reshape(*a.shape[:i], a.shape[i] * a.shape[i + 1], *a.shape[i + 2 :])
    return jax.lax.slice_in_dim(a, 0, size, axis=i)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def einsum(spec: str, block: int, x: jax.Array, w: jax.Array) -> jax.Array:
    """`jnp.einsum(spec, x, w)` in x's dtype through the blockwise recipe."""
    return _fwd(spec, block, x, w)[0]


def _fwd(spec, block, x, w):
    xs, ws, ys, c, n, _ = _letters(spec)
    xb, xbs = _split(x, xs, c, block)
    wb, wbs = _split(w, ws, c, block)
    wb, wbs = _split(wb, wbs, n, block)
    qx, sx, sxs = _quantize(xb, xbs, c)
    qw, sw, sws = _quantize(wb, wbs, c + n)
    yb_spec = ys.replace(n, n.upper() + n)
    y = _blocked_dot(qx, sx, xbs, sxs, qw, sw, wbs, sws, c, yb_spec)
    y = _merge(y, yb_spec, n, w.shape[ws.index(n)])
    # zero-size tags: the static contraction size and w's dtype (residuals must be arrays)
    return y.astype(x.dtype), (qx, sx, qw, sw, jnp.zeros((0, x.shape[xs.index(c)]), w.dtype))


def _bwd(spec, block, res, dy):
    qx, sx, qw, sw, tag = res
    xs, ws, ys, c, n, t = _letters(spec)
    k = tag.shape[1]
    xbs, wbs = xs.replace(c, c.upper() + c), ws.replace(c, c.upper() + c).replace(n, n.upper() + n)
    sws = wbs.replace(c, "").replace(n, "")
    # input gradient: dY in 1 x b tiles along n, the forward's weight blocks
    dyb, dybs = _split(dy, ys, n, block)
    qdy, sdy, sdys = _quantize(dyb, dybs, n)
    dx = _blocked_dot(qdy, sdy, dybs, sdys, qw, sw, wbs, sws, n, xbs)
    dx = _merge(dx, xbs, c, k)
    # weight gradient: x (dequantised) and dY re-quantised in b x 1 tiles along the tokens t
    x_deq = _merge(qx.astype(jnp.float32) * jnp.expand_dims(sx, xbs.index(c)), xbs, c, k)
    xt, xts = _split(x_deq, xs, t, block)
    yt, yts = _split(dy, ys, t, block)
    qx2, sx2, sx2s = _quantize(xt, xts, t)
    qdy2, sdy2, sdy2s = _quantize(yt, yts, t)
    dw = _blocked_dot(qx2, sx2, xts, sx2s, qdy2, sdy2, yts, sdy2s, t, ws)
    return dx.astype(dy.dtype), dw.astype(tag.dtype)


einsum.defvjp(_fwd, _bwd)


# ---------------------------------------------------------------- the grouped matmul (dropless experts)
# x [R, K] rows sorted by group (expert), sizes[g] rows each (rows past their sum come out zero), w [E, K, N].
# Activation tiles are per row (1 x b of K; 1 x b of N for dY) and weight blocks per expert, so the forward
# and input gradient are batched ragged GEMMs over the contraction blocks, each partial scaled by its row's
# tile scale and its row's expert's block scale. The weight gradient's b x 1 token tiles start at each
# group's first row (a group's last tile may be short). N may hold `m` interleaved matrices ([N/m, m]:
# SwiGLU's gate and up), each blocked on its own.


def _row_groups(sizes_E: jax.Array, r: int) -> jax.Array:
    """Each row's group [R] (rows past the groups: the last one; their products are zero)."""
    ends = jnp.cumsum(sizes_E)
    return jnp.minimum(jnp.sum(jnp.arange(r)[:, None] >= ends[None, :], axis=1), sizes_E.shape[0] - 1)


def _token_tiles(sizes_E: jax.Array, r: int, b: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The weight gradient's token tiles, b rows from each group's first: per tile (at most R // b + E) its
    rows [T, b] (clipped), which of them it holds [T, b], and its group [T] (E for no tile)."""
    e = sizes_E.shape[0]
    n_tiles_E = (sizes_E + b - 1) // b
    tile_end_E = jnp.cumsum(n_tiles_E)
    t = jnp.arange(r // b + e)
    g_T = jnp.sum(t[:, None] >= tile_end_E[None, :], axis=1)
    g = jnp.minimum(g_T, e - 1)
    first_T = jnp.cumsum(sizes_E)[g] - sizes_E[g] + (t - tile_end_E[g] + n_tiles_E[g]) * b
    n_T = jnp.where(g_T < e, jnp.clip(jnp.cumsum(sizes_E)[g] - first_T, 0, b), 0)
    j = jnp.arange(b)[None, :]
    return jnp.minimum(first_T[:, None] + j, r - 1), j < n_T[:, None], g_T


def _ragged_batched(x_BxRxC, w_BxExCxN, sizes_E) -> jax.Array:
    """Per batch index b: ragged_dot(x[b], w[b], sizes), e4m3 operands, float32 results [B, R, N]."""
    dn = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([2], [2]), ([0], [0])), lhs_ragged_dimensions=[1], rhs_group_dimensions=[1]
    )  # fmt: skip
    return jax.lax.ragged_dot_general(x_BxRxC, w_BxExCxN, sizes_E, dn, preferred_element_type=jnp.float32)


def _blocks(k: int, n: int, m: int, block: int) -> tuple[int, int]:
    """The K and N blocks (a dim below `block` is one block); ValueError if one does not tile."""
    bk, bn = min(block, k), min(block, n // m)
    if k % bk or n % (bn * m):
        raise ValueError(f"fp8_block {block} does not tile a grouped matmul of K={k}, N={n} ({m} interleaved)")
    return bk, bn


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def ragged_dot(block: int, m: int, x_RxK: jax.Array, w_ExKxN: jax.Array, sizes_E: jax.Array) -> jax.Array:
    """`jax.lax.ragged_dot(x, w, sizes)` in x's dtype through the blockwise recipe; `m` interleaved
    matrices along N (1, or 2 for SwiGLU's [gate, up] pairs), each in its own weight blocks."""
    return _ragged_fwd(block, m, x_RxK, w_ExKxN, sizes_E)[0]


def _ragged_fwd(block, m, x, w, sizes):
    (r, k), (e, _, n) = x.shape, w.shape
    bk, bn = _blocks(k, n, m, block)
    kb, nb = k // bk, n // (bn * m)
    sizes = sizes.astype(jnp.int32)
    qx, sx, _ = _quantize(x.reshape(r, kb, bk), "rKk", "k")  # [R, Kb, bk], [R, Kb]
    qw, sw, _ = _quantize(w.reshape(e, kb, bk, nb, bn, m), "eKkNnm", "kn")  # sw [E, Kb, Nb, m]
    part = _ragged_batched(qx.transpose(1, 0, 2), qw.reshape(e, kb, bk, n).transpose(1, 0, 2, 3), sizes)
    sw_R = sw[_row_groups(sizes, r)]
    y = jnp.einsum("rK,rKNm,KrNnm->rNnm", sx, sw_R, part.reshape(kb, r, nb, bn, m)).reshape(r, n)
    return y.astype(x.dtype), (qx, sx, qw, sw_R, sizes, jnp.zeros((0,), w.dtype))


def _ragged_bwd(block, m, res, dy):
    qx, sx, qw, sw_R, sizes, tag = res
    (r, kb, bk), (e, _, _, nb, bn, _) = qx.shape, qw.shape
    # input gradient: dY in 1 x b tiles along N (per interleaved matrix), the forward's weight blocks
    qdy, sdy, _ = _quantize(dy.reshape(r, nb, bn, m), "rNnm", "n")  # [R, Nb, bn, m], [R, Nb, m]
    w_T = qw.transpose(3, 5, 0, 4, 1, 2).reshape(nb * m, e, bn, kb * bk)  # [Nb m, E, bn, K]
    part = _ragged_batched(qdy.transpose(1, 3, 0, 2).reshape(nb * m, r, bn), w_T, sizes)
    dx = jnp.einsum("rNm,rKNm,NmrKk->rKk", sdy, sw_R, part.reshape(nb, m, r, kb, bk)).reshape(r, kb * bk)
    # weight gradient: x (dequantised) and dY re-quantised in b x 1 tiles of each group's rows
    rows_TxB, ok_TxB, g_T = _token_tiles(sizes, r, block)
    x_deq = (qx.astype(jnp.float32) * sx[..., None]).reshape(r, kb * bk)
    tiles = lambda a: jnp.where(ok_TxB[..., None], a[rows_TxB], 0)
    qx2, sx2, _ = _quantize(tiles(x_deq), "tsk", "s")  # [T, b, K], [T, K]
    qdy2, sdy2, _ = _quantize(tiles(dy.astype(jnp.float32)), "tsn", "s")
    part = jnp.einsum("tsk,tsn->tkn", qx2, qdy2, preferred_element_type=jnp.float32)
    dw = jnp.einsum("tk,tn,tkn,te->ekn", sx2, sdy2, part, jax.nn.one_hot(g_T, e, dtype=jnp.float32))
    return dx.astype(dy.dtype), dw.astype(tag.dtype), None


ragged_dot.defvjp(_ragged_fwd, _ragged_bwd)
