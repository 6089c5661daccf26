"""offload.params: ZeRO-3 parameters rest in pinned host memory and each layer is fetched
inside the model's layer scan (ZeRO-Infinity's parameter offload, Rajbhandari et al. 2021).

The model calls `fetch_layer` on one unit's parameters at the top of its scan body. Outside a step
that streams parameters it is the identity. Inside one (`use_layer_fetch`, set by the step's loop
around its trace) each leaf, a slice of the host-resident ZeRO-3 shard, is moved to device memory
and all-gathered over the data-parallel axes ZeRO-3 split it over. Its backward reduce-scatters the
layer's gradient over those axes and sums it over the remaining data-parallel axes, exactly as
`ZeroShardings.finish` reduces the whole gradient once per step, and moves it to host memory: the
layer's gradient leaves the scan reduced, in the ZeRO-3 layout. With one microbatch that is the
step's gradient; with more, each layer's is added into float32 sums in host memory (`add_slice`,
used by `bw_split.vjp_into`'s accumulation: the slice of the sums and the gradient come to the
device, the sum goes back). The fetch sits inside the unit's
remat, so the backward fetches the layer again instead of keeping the gathered weights (a unit
with no remat of its own is checkpointed around them: `FETCHED`).

With a gradient sink (`use_grad_sink`: offload.grads=nvme, one microbatch) the reduced
gradient does not go to host memory at all: the fetch's backward hands each device's block of it
to the sink (a host callback that writes it to the nvme tier's file) and returns, as the cotangent
of a per-layer float32 scalar (`sink_index`: which layer and leaf, so the sink knows where it goes), the
leaf's squared sum for the global norm (`sq_sum`, the formula the update's norm uses elsewhere).

The reduced gradient is float32, as the whole-step reduction's is, whatever the params' dtype: a
cotangent must have its primal's dtype, so the step differentiates with respect to float32 arrays
shaped like the layers' shards (`Shadowed.z`: the gradient sums themselves, or zeros) that the
forward ignores, not the (e.g. bf16) parameters, and the fetch's backward returns its float32
gradient as their cotangent.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import io_callback
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshrun.parallel.sharding import GRAD_AXES, MANUAL, dims_with, restrict_spec, spec_dims

HOST_SPACE = jax.memory.Space.Host
DEVICE_SPACE = jax.memory.Space.Device

_FETCH: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("meshrun_layer_fetch", default=None)


@contextlib.contextmanager
def use_layer_fetch(fn: Callable | None) -> Iterator[None]:
    """Trace the model with `fn` applied to each unit's parameters inside its layer scan."""
    token = _FETCH.set(fn)
    try:
        yield
    finally:
        _FETCH.reset(token)


_SINK: contextvars.ContextVar[Any] = contextvars.ContextVar("meshrun_grad_sink", default=None)


@contextlib.contextmanager
def use_grad_sink(sink: Any) -> Iterator[None]:
    """Trace the step with each layer's reduced gradient handed to `sink` (its `write(index, block,
    *coords)`, called on the host per device with the `sink_index` scalar and the device's mesh
    coordinates; `cast`: square the gradient in the param dtype)."""
    token = _SINK.set(sink)
    try:
        yield
    finally:
        _SINK.reset(token)


def grad_sink() -> Any:
    """The gradient sink the step is traced with (`use_grad_sink`), or None."""
    return _SINK.get()


def sink_index(layers: Any) -> Any:
    """The scalars the layers are shadowed with for a gradient sink: per leaf j of K, [layer * K + j
    for each layer] (float32, exact below 2**24)."""
    leaves, tree = jax.tree.flatten(layers)
    k = len(leaves)
    return jax.tree.unflatten(tree, [jnp.arange(x.shape[0], dtype=jnp.float32) * k + j for j, x in enumerate(leaves)])


def spec_axes(spec: P) -> tuple[str, ...]:
    """The mesh axes a PartitionSpec splits over, in order."""
    return tuple(a for d in spec_dims(spec) for a in d)


def sq_sum(g: jax.Array, axes: tuple[str, ...], dtype: Any = None) -> jax.Array:
    """A leaf's squared sum from its local block `g`, inside a shard_map manual over every axis: the
    block's sum, summed over the axes the leaf is split over (`axes`); `dtype`: the gradient is cast
    to it first (as the step casts the sums to the param dtype). The layer-streamed update's norm uses
    this one formula wherever the gradient rests, so the results agree to the bit."""
    g = g if dtype is None else g.astype(dtype)
    s = jnp.sum(jnp.square(g.astype(jnp.float32)))
    return jax.lax.psum(s, axes) if axes else s


FETCHED = "layer_fetch"  # checkpoint name of fetched weights: never saved for the backward


def fetching() -> bool:
    """Whether the model is being traced with a per-layer fetch (`use_layer_fetch`)."""
    return _FETCH.get() is not None


def fetch_layer(p: Any) -> Any:
    """What a model calls on one unit's parameters inside its layer scan (identity unless the step
    streams parameters from host memory)."""
    fn = _FETCH.get()
    return p if fn is None else jax.tree.map(lambda x: checkpoint_name(x, FETCHED), fn(p))


@jax.tree_util.register_pytree_node_class
class Shadowed:
    """A resting parameter shard `x` with a float32 array `z` of its shape: the fetch gathers `x`
    and sends the reduced float32 gradient to `z` (see the module doc). A pytree node, so the
    model's layer scan slices both."""

    def __init__(self, x, z):
        self.x, self.z = x, z

    def tree_flatten(self):
        return (self.x, self.z), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)


def shadowed(params: Any, z: Any) -> Any:
    """`params` with each leaf paired with the float32 array of `z` at its place."""
    return jax.tree.map(Shadowed, params, z)


def on_host(x: jax.Array) -> bool:
    return jax.typeof(x).memory_space == HOST_SPACE


def to_device(x: jax.Array) -> jax.Array:
    """x in device memory (a no-op when it is there already)."""
    return jax.device_put(x, DEVICE_SPACE) if on_host(x) else x


def add_slice(acc: jax.Array, i, y: jax.Array) -> jax.Array:
    """acc[i] += y along the leading axis; a host-resident `acc` is read to the device, added to and
    written back one slice at a time (the sums never come to the device whole)."""
    s = jax.lax.dynamic_index_in_dim(acc, i, 0, keepdims=False)
    host = on_host(acc)
    new = to_device(s) + to_device(y).astype(acc.dtype)
    return jax.lax.dynamic_update_index_in_dim(acc, jax.device_put(new, HOST_SPACE) if host else new, i, 0)


def host_zeros(like: Any) -> Any:
    """Zeros shaped like the stacked tree `like` (arrays or ShapeDtypeStructs) in host memory, made one
    slice of the leading axis at a time, so they are never whole on the device."""

    def body(_, __):
        return None, jax.tree.map(lambda a: jax.device_put(jnp.zeros(a.shape[1:], a.dtype), HOST_SPACE), like)

    return jax.lax.scan(body, None, length=jax.tree.leaves(like)[0].shape[0])[1]


def _split_dims(spec: P, base: P) -> list[tuple[int, tuple[str, ...]]]:
    """(dim, DP axes) that `spec` splits one unit's leaf over beyond its compute layout `base`."""
    kept = dict(dims_with(base, GRAD_AXES))  # e.g. experts split over 'expert' stay split
    out = []
    for d, axes in dims_with(spec, GRAD_AXES):
        if axes := tuple(a for a in axes if a not in kept.get(d, ())):
            out.append((d, axes))
    return out


def make_fetch(mesh: Mesh, store: Any, compute: Any, reduce_dtype: Any = None, grads: Any = None) -> Callable:
    """p_unit -> p_unit in device memory, gathered to the compute layout. `store` / `compute`: the
    PartitionSpec trees of the stacked layers (leading layer axis, ZeRO-3 and ZeRO-0 layouts). `grads`:
    the layout the backward reduce-scatters each layer's gradient to (None: `store`'s; ZeRO-2 per
    microbatch: parameters that rest whole, a gradient that is scattered)."""
    live = tuple(a for a in GRAD_AXES if mesh.shape.get(a, 1) > 1)

    def leaf(x, spec, base, target=None):
        spec, base = P(*spec[1:]), P(*base[1:])  # one unit: the layer axis is sliced away
        gathers = _split_dims(spec, base)
        # `grads` applies where the gradient goes to float32 arrays of its own shape (`Shadowed`); a
        # parameter's own cotangent must have its shape
        scatters = _split_dims(P(*target[1:]), base) if target is not None and isinstance(x, Shadowed) else gathers
        used = {a for _, axes in dims_with(base, GRAD_AXES) for a in axes}
        scattered = {a for _, axes in scatters for a in axes}
        rest = tuple(a for a in live if a not in used and a not in scattered)

        def gather(x):
            x = to_device(x)
            for d, axes in gathers:
                x = jax.lax.all_gather(x, axes, axis=d, tiled=True)
            return x

        def reduce(g, dt, host):
            g = g.astype(jnp.float32)  # reduced as the whole-step reduction reduces the float32 sums
            g = g if reduce_dtype is None or not (scatters or rest) else g.astype(reduce_dtype)
            for d, axes in scatters:
                g = jax.lax.psum_scatter(g, axes, scatter_dimension=d, tiled=True)
            g = (jax.lax.psum(g, rest) if rest else g).astype(dt)
            return jax.device_put(g, HOST_SPACE) if host else g  # where the primal came from

        if isinstance(x, Shadowed) and sink is not None:  # the gradient to the sink, its squared sum to z
            return _to_sink(x, gather, reduce, spec)

        if isinstance(x, Shadowed):  # the float32 gradient goes to z; x (not differentiated) has none
            z_host = on_host(x.z)

            @jax.custom_vjp
            def fetch2(x, z):
                return gather(x)

            fetch2.defvjp(lambda x, z: (gather(x), None), lambda _, g: (None, reduce(g, x.z.dtype, z_host)))
            return fetch2(x.x, x.z)

        host = on_host(x)

        @jax.custom_vjp
        def fetch(x):
            return gather(x)

        fetch.defvjp(lambda x: (fetch(x), None), lambda _, g: (reduce(g, g.dtype, host),))
        return fetch(x)

    sink = grad_sink()
    auto = tuple(a for a in mesh.axis_names if a not in MANUAL)  # auto inside the loop: manual for the sink

    def _to_sink(x, gather, reduce, spec):
        dtype = x.x.dtype if sink.cast else None
        axes = spec_axes(spec)

        def hand_over(g, layer):  # manual over every axis: this device's block
            coords = tuple(jax.lax.axis_index(a) for a in mesh.axis_names)
            io_callback(sink.write, None, layer, g, *coords)
            return sq_sum(g, axes, dtype)

        @jax.custom_vjp
        def fetch3(x, z):
            return gather(x)

        def bwd(z, g):
            g = reduce(g, jnp.float32, False)
            if auto:
                inner = restrict_spec(spec, auto)
                return None, jax.shard_map(hand_over, in_specs=(inner, P()), out_specs=P(), axis_names=set(auto),
                                           check_vma=False)(g, z)  # fmt: skip
            return None, hand_over(g, z)

        fetch3.defvjp(lambda x, z: (gather(x), z), bwd)
        return fetch3(x.x, x.z)

    shadow = lambda x: isinstance(x, Shadowed)  # noqa: E731
    if grads is None:
        return lambda p: jax.tree.map(leaf, p, store, compute, is_leaf=shadow)
    return lambda p: jax.tree.map(leaf, p, store, compute, grads, is_leaf=shadow)
