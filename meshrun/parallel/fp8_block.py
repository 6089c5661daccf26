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
