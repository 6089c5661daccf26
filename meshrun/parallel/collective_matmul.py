"""Tensor-parallel matmuls with their sequence-parallel collective run as a ring beside the matmul
(`model.tp_comm_overlap`; collective matmul, Wang et al. 2023; Megatron-Core's --tp-comm-overlap).

Under sequence parallelism a column-parallel matmul needs an all-gather over 'tensor' first and a
row-parallel one a reduce-scatter after. `ag_matmul` multiplies the sequence chunk it holds while
`ppermute` passes it on; `matmul_rs` adds its share of an output chunk to a partial sum that moves
on while the next chunk's matmul runs: t - 1 collective-permutes per collective, each beside a
matmul for XLA's latency-hiding scheduler. The backward is the same rings (a custom_vjp whose
residuals are the primal inputs only, so remat policies keep their meaning).

Use: `t = ring_degree(cfg.tp_comm_overlap, length)`; when t > 0, call `ag_matmul(spec, x, w, w_dim, t)`
or `matmul_rs(...)` inside the step's shard_maps (auto over 'tensor'; they open one manual over
'tensor'). Arrays have the sequence on dimension 1; `spec` is a two-operand einsum whose output has
it on dimension 1 too; `w_dim` is the weight's dimension sharded over 'tensor'.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshrun.parallel.sharding import current_rules

TENSOR = "tensor"


def _operands(spec: str) -> tuple[str, str, str]:
    ins, out = spec.split("->")
    x, w = ins.split(",")
    return x, w, out


def _spec_at(ndim: int, dim: int) -> P:
    return P(*[TENSOR if i == dim else None for i in range(ndim)])


def _ring(t: int) -> list[tuple[int, int]]:
    return [(d, (d + 1) % t) for d in range(t)]


def _chunk(a: jax.Array, j, n: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(a, j * n, n, axis=1)


def _einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, w)


def _grads(spec: str, x: jax.Array, w: jax.Array, dy: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(dx, dw) of einsum(spec, x, w) at cotangent dy."""
    return jax.vjp(functools.partial(_einsum, spec), x, w)[1](dy)


# ---------------------------------------------------------------- the rings (per device, inside shard_map)


def _gather_ring(spec, x, w, t):
    """y = einsum(spec, all_gather(x over the sequence), w): step s multiplies chunk (d - s) mod t."""
    d, n = jax.lax.axis_index(TENSOR), x.shape[1]
    y = None
    for s in range(t):
        j = (d - s) % t
        y_j = _einsum(spec, x, w)
        if y is None:
            y = jnp.zeros((y_j.shape[0], n * t, *y_j.shape[2:]), y_j.dtype)
        y = jax.lax.dynamic_update_slice_in_dim(y, y_j, j * n, axis=1)
        if s < t - 1:
            x = jax.lax.ppermute(x, TENSOR, _ring(t))
    return y


def _scatter_ring(contrib, n, t):
    """Reduce-scatter over the sequence of sum_d contrib_d(c) (c: an output chunk index): the partial
    sum of chunk (d - s - 1) mod t gets this device's share at step s, then moves on; after t steps
    each device holds its own chunk's sum."""
    d = jax.lax.axis_index(TENSOR)
    acc = None
    for s in range(t):
        part = contrib((d - s - 1) % t)
        acc = part if acc is None else acc + part
        if s < t - 1:
            acc = jax.lax.ppermute(acc, TENSOR, _ring(t))
    return acc


def _ag_bwd_local(spec, x, w, dy, t):
    """Backward of `_gather_ring`: dx reduce-scattered by a ring, dw summed over the chunks of x
    passed around a second ring."""
    d, n = jax.lax.axis_index(TENSOR), x.shape[1]
    dx = _scatter_ring(lambda c: _grads(spec, x, w, _chunk(dy, c, n))[0], n, t)
    dw = jnp.zeros(w.shape, jnp.float32)
    for s in range(t):
        j = (d - s) % t
        dw = dw + _grads(spec, x, w, _chunk(dy, j, n))[1].astype(jnp.float32)
        if s < t - 1:
            x = jax.lax.ppermute(x, TENSOR, _ring(t))
    return dx, dw.astype(w.dtype)


def _rs_bwd_local(spec, a, w, dz, t):
    """Backward of `matmul_rs`: the cotangent's chunks pass around the ring; each gives its rows of
    da and a share of dw."""
    d, n = jax.lax.axis_index(TENSOR), dz.shape[1]
    da = jnp.zeros(a.shape, a.dtype)
    dw = jnp.zeros(w.shape, jnp.float32)
    for s in range(t):
        j = (d - s) % t
        da_j, dw_j = _grads(spec, _chunk(a, j, n), w, dz)
        da = jax.lax.dynamic_update_slice_in_dim(da, da_j.astype(a.dtype), j * n, axis=1)
        dw = dw + dw_j.astype(jnp.float32)
        if s < t - 1:
            dz = jax.lax.ppermute(dz, TENSOR, _ring(t))
    return da, dw.astype(w.dtype)


# ---------------------------------------------------------------- shard_map wrappers


def _tensor_map(fn, in_specs, out_specs):
    # Inside the step's shard_maps the context mesh is theirs (abstract, manual axes); outside any
    # (a model called under `use_rules` alone) the rules' mesh.
    mesh, _, manual = current_rules()
    mesh = None if manual else mesh
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={TENSOR}, check_vma=False)


def _ag_specs(spec: str, w_ndim: int, w_dim: int, y_ndim: int) -> tuple[P, P, P]:
    xs, ws, out = _operands(spec)
    x_spec = _spec_at(len(xs), 1)
    return x_spec, _spec_at(w_ndim, w_dim), _spec_at(y_ndim, out.index(ws[w_dim]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def _ag_matmul(spec, x, w, w_dim, t):
    x_spec, w_spec, y_spec = _ag_specs(spec, w.ndim, w_dim, len(_operands(spec)[2]))
    return _tensor_map(functools.partial(_gather_ring, spec, t=t), (x_spec, w_spec), y_spec)(x, w)


def _ag_fwd(spec, x, w, w_dim, t):
    return _ag_matmul(spec, x, w, w_dim, t), (x, w)


def _ag_bwd(spec, w_dim, t, res, dy):
    x, w = res
    x_spec, w_spec, y_spec = _ag_specs(spec, w.ndim, w_dim, dy.ndim)
    fn = functools.partial(_ag_bwd_local, spec, t=t)
    return _tensor_map(fn, (x_spec, w_spec, y_spec), (x_spec, w_spec))(x, w, dy)


_ag_matmul.defvjp(_ag_fwd, _ag_bwd)


def _rs_specs(spec: str, a_ndim: int, w_ndim: int, w_dim: int, z_ndim: int) -> tuple[P, P, P]:
    as_, ws, _ = _operands(spec)
    return _spec_at(a_ndim, as_.index(ws[w_dim])), _spec_at(w_ndim, w_dim), _spec_at(z_ndim, 1)


def _rs_local(spec, a, w, t):
    n = a.shape[1] // t
    return _scatter_ring(lambda c: _einsum(spec, _chunk(a, c, n), w), n, t)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def _matmul_rs(spec, a, w, w_dim, t):
    a_spec, w_spec, z_spec = _rs_specs(spec, a.ndim, w.ndim, w_dim, len(_operands(spec)[2]))
    return _tensor_map(functools.partial(_rs_local, spec, t=t), (a_spec, w_spec), z_spec)(a, w)


def _rs_fwd(spec, a, w, w_dim, t):
    return _matmul_rs(spec, a, w, w_dim, t), (a, w)


def _rs_bwd(spec, w_dim, t, res, dz):
    a, w = res
    a_spec, w_spec, z_spec = _rs_specs(spec, a.ndim, w.ndim, w_dim, dz.ndim)
    fn = functools.partial(_rs_bwd_local, spec, t=t)
    return _tensor_map(fn, (a_spec, w_spec, z_spec), (a_spec, w_spec))(a, w, dz)


_matmul_rs.defvjp(_rs_fwd, _rs_bwd)


def ag_matmul(spec: str, x: jax.Array, w: jax.Array, w_dim: int, t: int) -> jax.Array:
    """einsum(spec, x, w) for x split over 'tensor' along the sequence (dim 1) and w along `w_dim`:
    the output has the whole sequence and is split over 'tensor' where w's dimension `w_dim` went."""
    return _ag_matmul(spec, x, w, w_dim, t)


def matmul_rs(spec: str, a: jax.Array, w: jax.Array, w_dim: int, t: int) -> jax.Array:
    """einsum(spec, a, w) for the contracted dimension split over 'tensor' (w's `w_dim`, and a's
    matching one): the sum over 'tensor', returned split over 'tensor' along the sequence (dim 1)."""
    return _matmul_rs(spec, a, w, w_dim, t)


def ring_degree(enabled: bool, length: int) -> int:
    """The tensor degree t when a block's matmuls run as rings: `enabled` (model.tp_comm_overlap),
    'tensor' a live auto axis of size > 1 whose rules split the sequence (sequence parallelism) and
    t dividing `length`; else 0 (the plain matmuls, whose constraints then do not split it either)."""
    if not enabled:
        return 0
    mesh, rules, manual = current_rules()
    if mesh is None or TENSOR in manual or TENSOR not in rules.get("length", ()):
        return 0
    t = mesh.shape.get(TENSOR, 1)
    return t if t > 1 and length % t == 0 else 0
