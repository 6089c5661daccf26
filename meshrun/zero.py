"""ZeRO data-parallel collectives shared by the train step and the pipeline executor.

Everything here runs once per step, outside any microbatch/tick loop. Gathers (ZeRO-3) and
reduce-scatters (ZeRO-1/2/3) run in shard_maps manual over EVERY mesh axis, so each device moves
its local tensor shard as it is: the same collectives inside a shard_map that leaves 'tensor' to
GSPMD made XLA all-gather the tensor shards first (measured in the compiled HLO).
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshrun.sharding import DP_AXES

MANUAL = ("pipe", "data", "expert")  # the loops' shard_map manual axes; 'tensor' stays auto


def local_spec(spec: P, axes=MANUAL) -> P:
    """Keep only shard_map-manual axes of a spec (in_specs may name only manual axes)."""

    def keep(entry):
        if entry is None:
            return None
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(a for a in names if a in axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return P(*(keep(e) for e in spec))


def dims_with(spec: P, axes) -> list[tuple[int, tuple[str, ...]]]:
    """(dim, manual DP axes on it) for every dim of `spec` that names one of `axes`."""
    out = []
    for d, entry in enumerate(spec):
        names = entry if isinstance(entry, tuple) else (entry,) if entry else ()
        hit = tuple(a for a in names if a in axes)
        if hit:
            out.append((d, hit))
    return out


def gather_params(params, specs, base_specs, mesh: Mesh):
    """ZeRO-3: all-gather every parameter's data-parallel shards once per step, before the loop, in
    a shard_map manual over every axis (so local tensor shards are gathered as they are)."""

    def body(params):
        def one(x, spec, base):
            kept = dict(dims_with(base, DP_AXES))  # e.g. experts split over 'expert' stay split
            for d, axes in dims_with(spec, DP_AXES):
                if axes := tuple(a for a in axes if a not in kept.get(d, ())):
                    x = jax.lax.all_gather(x, axes, axis=d, tiled=True)
            return x

        return jax.tree.map(one, params, specs, base_specs, is_leaf=lambda x: isinstance(x, jax.Array))

    return jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=base_specs, check_vma=False)(params)


def reduction_axes(base: P, mesh: Mesh) -> tuple[str, ...]:
    """DP axes a gradient is summed over: all live ones, except those the weight is already split
    over (experts over 'expert' are reduced over 'data' only)."""
    used = {a for _, axes in dims_with(base, DP_AXES) for a in axes}
    return tuple(a for a in DP_AXES if mesh.shape[a] > 1 and a not in used)


def deferred(base: P, target: P, mesh: Mesh) -> bool:
    """ZeRO >= 1 leaves whose reduced gradient is scattered over a DP axis."""
    red = reduction_axes(base, mesh)
    return any(a in red for _, axes in dims_with(target, DP_AXES) for a in axes)


def reduce_grads_local(grads, base_specs, grad_specs, mesh: Mesh, extra: tuple[str, ...] = ()):
    """Inside the DP-manual shard_map, after the accumulation loop: psum what stays replicated;
    leaves that ZeRO scatters leave as per-rank partial sums [1, ...] (see `finish_reduction`).
    `extra`: axes summed in any case (the pipeline sums embedding/head grads over 'pipe')."""

    def one(g, base, target):
        if deferred(base, target, mesh):
            return (jax.lax.psum(g, extra) if extra else g)[None]
        red = extra + reduction_axes(base, mesh)
        return jax.lax.psum(g, red) if red else g

    return jax.tree.map(one, grads, base_specs, grad_specs)


def partial_specs(base_specs, grad_specs, mesh: Mesh):
    """shard_map out_specs for `reduce_grads_local`'s output (manual axes only)."""

    def one(base, target):
        if deferred(base, target, mesh):
            return P(reduction_axes(base, mesh), *local_spec(base))
        return local_spec(target)

    return jax.tree.map(one, base_specs, grad_specs, is_leaf=lambda x: isinstance(x, P))


def finish_reduction(grads, base_specs, grad_specs, mesh: Mesh):
    """Sum the per-rank partials onto the ZeRO layout with one reduce-scatter per leaf, in a
    shard_map manual over every axis: local tensor shards are reduce-scattered as they are (a
    psum_scatter inside the tensor-auto accumulation shard_map made XLA all-gather the tensor
    shards first, and a GSPMD sum gave a full all-reduce)."""
    is_p = lambda x: isinstance(x, P)  # noqa: E731
    flat_g, tree = jax.tree.flatten(grads)
    flat_b = jax.tree.leaves(base_specs, is_leaf=is_p)
    flat_t = jax.tree.leaves(grad_specs, is_leaf=is_p)
    idx = [i for i, (b, t) in enumerate(zip(flat_b, flat_t)) if deferred(b, t, mesh)]
    if not idx:
        return grads

    def body(*gs):
        out = []
        for g, i in zip(gs, idx):
            g = g[0]
            red = reduction_axes(flat_b[i], mesh)
            for d, axes in dims_with(flat_t[i], DP_AXES):
                if axes := tuple(a for a in axes if a in red):
                    g = jax.lax.psum_scatter(g, axes, scatter_dimension=d, tiled=True)
                    red = tuple(a for a in red if a not in axes)
            out.append(jax.lax.psum(g, red) if red else g)
        return tuple(out)

    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=tuple(P(reduction_axes(flat_b[i], mesh), *flat_b[i]) for i in idx),
        out_specs=tuple(flat_t[i] for i in idx),
        check_vma=False,
    )
    reduced = fn(*(flat_g[i] for i in idx))
    for i, g in zip(idx, reduced):
        flat_g[i] = g
    return jax.tree.unflatten(tree, flat_g)
