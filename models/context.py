"""Attention over a sequence split along a manual mesh axis (context parallelism).

Called inside a shard_map that is manual over `axis`: each device holds L local tokens of a
sequence of c L, and only attention crosses the axis. Two kinds:
- `allgather_attention`: K and V are all-gathered over the axis and the local queries attend to
  every key (Llama 3's choice).
- `ring_attention`: Ring Attention (Liu et al. 2023): K/V blocks pass around the ring by ppermute
  with an online float32 softmax; the backward is a second ring in which dK/dV travel with their
  block. In the zigzag layout (`zigzag_index`) every ring step after the first computes half a block.

The mask is exact in global token indices (causal, same packed document, sliding window), with
attention_core's arithmetic. Shape letters as in `layers.py`; S is the length of a block of keys.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P
from meshrun_models.layers import softmax_to

from meshrun.parallel.context import local_index, shard_index, zigzag_index
from meshrun.parallel.sharding import current_rules

__all__ = ["allgather_attention", "local_index", "ring_attention", "zigzag_index"]

TENSOR = "tensor"
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


def _keep(qi_L, ki_S, qseg_BxL, kseg_BxS, window) -> jax.Array:
    """B|1 x 1 x 1 x L x S: causal, same document (segment ids given), within `window` keys back."""
    d_LxS = qi_L[:, None] - ki_S[None, :]
    keep = d_LxS >= 0
    if window is not None:
        keep = keep & (d_LxS <= window)
    keep = keep[None, None, None]
    if qseg_BxL is not None:
        keep = keep & (qseg_BxL[:, None, None, :, None] == kseg_BxS[:, None, None, None, :])
    return keep


def _precision(dt):
    return jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if dt == jnp.bfloat16 else None


def _scores(q_BxLxKxGxDh, k_BxSxKxDh, keep) -> jax.Array:
    """Masked float32 scores B x K x G x L x S."""
    dt = q_BxLxKxGxDh.dtype
    s = jnp.einsum(
        "blkgd,bskd->bkgls", q_BxLxKxGxDh, k_BxSxKxDh, precision=_precision(dt), preferred_element_type=jnp.float32
    )
    s = s * jnp.float32(q_BxLxKxGxDh.shape[-1] ** -0.5)
    return jnp.where(keep, s, jnp.float32(_MASKED))


# ---------------------------------------------------------------- all-gather


def _tensor_split() -> str | None:
    """'tensor' when it is a live axis the caller left to GSPMD (K/V heads are split over it)."""
    mesh, _, manual = current_rules()
    if mesh is None or TENSOR in manual or mesh.shape.get(TENSOR, 1) == 1:
        return None
    return TENSOR


def gather_kv(kv_BxLx2xKxDh: jax.Array, axis: str) -> jax.Array:
    """All-gather of stacked K/V over `axis` (tiled on the length), reduce-scatter of its cotangent.
    With heads split over an auto 'tensor' axis, a collective over a manual axis made XLA gather
    the tensor shards first (every device held all heads: t x the bytes). Run inside a shard_map
    manual over 'tensor' too, each device moves only its heads; a custom_vjp keeps that nested
    shard_map out of autodiff (its transpose is the matching reduce-scatter, written out)."""
    tensor = _tensor_split()
    if tensor is None:
        return jax.lax.all_gather(kv_BxLx2xKxDh, axis, axis=1, tiled=True)
    return _gather_heads_split(kv_BxLx2xKxDh, axis, tensor)


def _heads_split(fn, tensor: str):
    spec = P(None, None, None, tensor)  # [B, L, 2, K, Dh]: K over 'tensor'
    return jax.shard_map(fn, in_specs=spec, out_specs=spec, axis_names={tensor}, check_vma=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_heads_split(kv, axis: str, tensor: str):
    return _heads_split(lambda x: jax.lax.all_gather(x, axis, axis=1, tiled=True), tensor)(kv)


def _gather_fwd(kv, axis, tensor):
    return _gather_heads_split(kv, axis, tensor), None


def _gather_bwd(axis, tensor, _, g):
    scatter = lambda x: jax.lax.psum_scatter(x, axis, scatter_dimension=1, tiled=True)
    return (_heads_split(scatter, tensor)(g),)


_gather_heads_split.defvjp(_gather_fwd, _gather_bwd)


def allgather_attention(
    q_BxLxKxGxDh: jax.Array,
    k_BxLxKxDh: jax.Array,
    v_BxLxKxDh: jax.Array,
    seg_BxL: jax.Array | None = None,
    *,
    axis: str,
    window: int | None = None,
    zigzag: bool = False,
) -> jax.Array:
    """Local queries against K/V all-gathered over `axis` (one all-gather of K and V stacked; its
    transpose, one reduce-scatter of dK, dV). `window`: keys at most that many tokens back.
    The key indices are the layout's, a constant. Returns B x L x K x G x Dh in q's dtype."""
    dt, n = q_BxLxKxGxDh.dtype, q_BxLxKxGxDh.shape[1]
    c = jax.lax.axis_size(axis)
    kv_BxLx2xKxDh = jnp.stack([k_BxLxKxDh, v_BxLxKxDh], axis=2)
    # Named: a remat policy listing "kv_gathered" keeps c x the local K/V instead of re-gathering it.
    kv_BxSx2xKxDh = checkpoint_name(gather_kv(kv_BxLx2xKxDh, axis), "kv_gathered")
    ki_S = jnp.asarray(zigzag_index(n * c, c)) if zigzag else jnp.arange(n * c, dtype=jnp.int32)
    kseg_BxS = None if seg_BxL is None else jax.lax.all_gather(seg_BxL, axis, axis=1, tiled=True)
    keep = _keep(local_index(n, axis, zigzag), ki_S, seg_BxL, kseg_BxS, window)
    s_BxKxGxLxS = _scores(q_BxLxKxGxDh, kv_BxSx2xKxDh[:, :, 0], keep)
    p_BxKxGxLxS = checkpoint_name(softmax_to(s_BxKxGxLxS, dt), "probs")
    return jnp.einsum("bkgls,bskd->blkgd", p_BxKxGxLxS, kv_BxSx2xKxDh[:, :, 1])


# ---------------------------------------------------------------- ring


def _ring_blocks(axis: str, n: int, zigzag: bool, step_fn, carry, kv, extra=None):
    """Run the ring: step 0 on the local block, then c - 1 ppermutes of (kv, extra) to the next
    device, each followed by the block that arrived. `step_fn(carry, kv, j, extra, rows, cols)`
    returns (carry, extra) for query rows `rows` and key columns `cols` (static slices) of block j.
    Zigzag: from device j < i only chunk j (the first half of its block) is visible, to every local
    query; from j > i only the second local query chunk sees anything, the whole block. Contiguous:
    j < i is fully visible, j > i fully masked (skipped)."""
    i, c = jax.lax.axis_index(axis), jax.lax.axis_size(axis)
    h, full = n // 2, slice(None)
    carry, extra = step_fn(carry, kv, i, extra, full, full)
    perm = [(d, (d + 1) % c) for d in range(c)]
    for s in range(1, c):
        kv, extra = jax.lax.ppermute((kv, extra), axis, perm)
        j = (i - s) % c
        if zigzag:
            earlier = functools.partial(step_fn, rows=full, cols=slice(0, h))
            later = functools.partial(step_fn, rows=slice(h, None), cols=full)
        else:
            earlier = functools.partial(step_fn, rows=full, cols=full)
            later = lambda carry, kv, j, extra: (carry, extra)  # all masked: skipped
        carry, extra = jax.lax.cond(j < i, earlier, later, carry, kv, j, extra)
    return carry, extra


def _block_segments(segs, j, rows, cols):
    """(segment ids of the query rows, of block j's key columns), or (None, None)."""
    if segs is None:
        return None, None
    seg_BxL, segall_BxS = segs
    n = seg_BxL.shape[1]
    return seg_BxL[:, rows], jax.lax.dynamic_slice_in_dim(segall_BxS, j * n, n, axis=1)[:, cols]


def _ring_forward(q_BxLxKxGxDh, k_BxLxKxDh, v_BxLxKxDh, segs, axis, window, zigzag):
    """(out B x L x K x G x Dh in q's dtype, lse B x K x G x L float32). `segs`: None or the local
    and the all-gathered segment ids."""
    b, n, nk, g, dh = q_BxLxKxGxDh.shape
    dt, c = q_BxLxKxGxDh.dtype, jax.lax.axis_size(axis)
    qi_L = local_index(n, axis, zigzag)

    def step(carry, kv, j, extra, rows, cols):
        m_BxKxGxL, l_BxKxGxL, acc_BxKxGxLxDh = carry
        ki_S = shard_index(j, c, n, zigzag)[cols]
        keep = _keep(qi_L[rows], ki_S, *_block_segments(segs, j, rows, cols), window)
        s_BxKxGxLxS = _scores(q_BxLxKxGxDh[:, rows], kv[:, cols, 0], keep)
        m_old = m_BxKxGxL[..., rows]
        m_new = jnp.maximum(m_old, s_BxKxGxLxS.max(axis=-1))
        p_BxKxGxLxS = jnp.exp(s_BxKxGxLxS - m_new[..., None])
        corr = jnp.exp(m_old - m_new)  # online softmax (Milakov & Gimelshein 2018)
        l_new = l_BxKxGxL[..., rows] * corr + p_BxKxGxLxS.sum(axis=-1)
        pv = jnp.einsum(
            "bkgls,bskd->bkgld", p_BxKxGxLxS.astype(dt), kv[:, cols, 1], precision=_precision(dt),
            preferred_element_type=jnp.float32,
        )  # fmt: skip
        acc_new = acc_BxKxGxLxDh[..., rows, :] * corr[..., None] + pv
        m_BxKxGxL = m_BxKxGxL.at[..., rows].set(m_new)
        l_BxKxGxL = l_BxKxGxL.at[..., rows].set(l_new)
        acc_BxKxGxLxDh = acc_BxKxGxLxDh.at[..., rows, :].set(acc_new)
        return (m_BxKxGxL, l_BxKxGxL, acc_BxKxGxLxDh), extra

    m0 = jnp.full((b, nk, g, n), _MASKED, jnp.float32)
    carry = (m0, jnp.zeros((b, nk, g, n), jnp.float32), jnp.zeros((b, nk, g, n, dh), jnp.float32))
    kv = jnp.stack([k_BxLxKxDh, v_BxLxKxDh], axis=2)
    (m, total, acc), _ = _ring_blocks(axis, n, zigzag, step, carry, kv)
    # total >= 1 in every row: its maximum contributes exp(0) (NaN-free even with no visible key).
    out_BxLxKxGxDh = jnp.einsum("bkgld->blkgd", acc / total[..., None]).astype(dt)
    return out_BxLxKxGxDh, m + jnp.log(total)


def _ring_backward(q_BxLxKxGxDh, k_BxLxKxDh, v_BxLxKxDh, segs, out, lse_BxKxGxL, do, axis, window, zigzag):
    """Flash attention's backward as a ring: dQ stays, dK/dV (float32) travel with their K/V
    block, c - 1 steps, then one more ppermute brings them home. Returns (dq, dk, dv)."""
    n, dt, c = q_BxLxKxGxDh.shape[1], q_BxLxKxGxDh.dtype, jax.lax.axis_size(axis)
    prec = _precision(dt)
    qi_L = local_index(n, axis, zigzag)
    f32 = jnp.float32
    delta_BxKxGxL = jnp.einsum("blkgd,blkgd->bkgl", do.astype(f32), out.astype(f32))

    def step(dq_BxLxKxGxDh, kv, j, dkv_BxSx2xKxDh, rows, cols):
        ki_S = shard_index(j, c, n, zigzag)[cols]
        keep = _keep(qi_L[rows], ki_S, *_block_segments(segs, j, rows, cols), window)
        q, k, v, do_r = q_BxLxKxGxDh[:, rows], kv[:, cols, 0], kv[:, cols, 1], do[:, rows]
        p_BxKxGxLxS = jnp.exp(_scores(q, k, keep) - lse_BxKxGxL[..., rows, None])
        dv = jnp.einsum("bkgls,blkgd->bskd", p_BxKxGxLxS.astype(dt), do_r, precision=prec, preferred_element_type=f32)
        dp_BxKxGxLxS = jnp.einsum("blkgd,bskd->bkgls", do_r, v, precision=prec, preferred_element_type=f32)
        ds = (p_BxKxGxLxS * (dp_BxKxGxLxS - delta_BxKxGxL[..., rows, None])).astype(dt)
        scale = f32(q.shape[-1] ** -0.5)
        dq = jnp.einsum("bkgls,bskd->blkgd", ds, k, precision=prec, preferred_element_type=f32) * scale
        dk = jnp.einsum("bkgls,blkgd->bskd", ds, q, precision=prec, preferred_element_type=f32) * scale
        dq_BxLxKxGxDh = dq_BxLxKxGxDh.at[:, rows].add(dq)
        dkv_BxSx2xKxDh = dkv_BxSx2xKxDh.at[:, cols].add(jnp.stack([dk, dv], axis=2))
        return dq_BxLxKxGxDh, dkv_BxSx2xKxDh

    kv = jnp.stack([k_BxLxKxDh, v_BxLxKxDh], axis=2)
    dq, dkv = _ring_blocks(axis, n, zigzag, step, jnp.zeros(q_BxLxKxGxDh.shape, f32), kv, jnp.zeros(kv.shape, f32))
    dkv = jax.lax.ppermute(dkv, axis, [(d, (d + 1) % c) for d in range(c)])  # home: block j is on j - 1
    return dq.astype(dt), dkv[:, :, 0].astype(k_BxLxKxDh.dtype), dkv[:, :, 1].astype(v_BxLxKxDh.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _ring(q, k, v, seg, axis, window, zigzag):
    return _ring_forward(q, k, v, seg, axis, window, zigzag)[0]


def _ring_fwd(q, k, v, seg, axis, window, zigzag):
    out, lse = _ring_forward(q, k, v, seg, axis, window, zigzag)
    # Named residuals: a remat policy that saves them keeps the backward from re-running the forward ring.
    out, lse = checkpoint_name(out, "ring_out"), checkpoint_name(lse, "ring_lse")
    return out, (q, k, v, seg, out, lse)


def _ring_bwd(axis, window, zigzag, res, do):
    q, k, v, seg, out, lse = res
    return (*_ring_backward(q, k, v, seg, out, lse, do, axis, window, zigzag), None)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(
    q_BxLxKxGxDh: jax.Array,
    k_BxLxKxDh: jax.Array,
    v_BxLxKxDh: jax.Array,
    seg_BxL: jax.Array | None = None,
    *,
    axis: str,
    window: int | None = None,
    zigzag: bool = True,
) -> jax.Array:
    """Ring Attention of the local queries over the sequence split along `axis` (see the module
    docstring); `zigzag`: the tokens are in `zigzag_index` layout (balanced, half a block a step).
    Returns B x L x K x G x Dh in q's dtype. Needs an even local length when zigzag."""
    n = q_BxLxKxGxDh.shape[1]
    if zigzag and n % 2:
        raise ValueError(
            f"ring_attention: local length must be even in the zigzag layout (got {n}); use length % 2c == 0"
        )
    # Segment ids: all-gathered once (int32 per token), not passed around the ring with K/V.
    segs = None if seg_BxL is None else (seg_BxL, jax.lax.all_gather(seg_BxL, axis, axis=1, tiled=True))
    return _ring(q_BxLxKxGxDh, k_BxLxKxDh, v_BxLxKxDh, segs, axis, window, zigzag)
