"""Per-layer parameter fetch: ZeRO-3 / ZeRO-2 per layer (FSDP) and offload.params (ZeRO-Infinity's
parameter offload, Rajbhandari et al. 2021), one fetch for weights resting in device or host memory.

A model calls `fetch_layer` on one unit's parameters at the top of its layer-scan body: the identity,
unless the step traces it under `use_layer_fetch(make_fetch(...))` (`ZeroShardings.layer_fetch`).
Then each leaf comes to device memory and is all-gathered over the data-parallel axes it rests split
over; its backward reduce-scatters the layer's float32 gradient to the gradient layout (and psums it
over the other data-parallel axes), where the primal rests. The fetch sits inside the unit's remat
(`FETCHED`: gathered weights are never saved for the backward). To get a float32 gradient of 16-bit
params the step differentiates float32 arrays beside the layers (`Shadowed`: the sums themselves);
`add_slice` / `host_zeros` keep host-resident sums off the device. With a gradient sink
(`use_grad_sink`, offload.grads=nvme) each device's block goes to the sink and the leaf's squared
sum (`sq_sum`) comes back as the cotangent of its `sink_index`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import io_callback
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshrun.parallel import layer_group
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


def rest_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """x in the memory space `like` rests in."""
    return jax.device_put(x, HOST_SPACE) if on_host(like) and not on_host(x) else x


def add_to(acc: jax.Array, g: jax.Array) -> jax.Array:
    """acc + g where `acc` rests. Into host sums a gradient on the device is one no fetch reduced: the
    zeros of a leaf the loss does not differentiate (fp8's amax history, the MoE balance bias)."""
    return rest_like(to_device(acc) + g, acc)


def add_slice(acc: jax.Array, i, y: jax.Array) -> jax.Array:
    """acc[i] += y along the leading axis; a host-resident `acc` is read to the device, added to and
    written back one slice at a time (the sums never come to the device whole)."""
    s = jax.lax.dynamic_index_in_dim(acc, i, 0, keepdims=False)
    new = to_device(s) + to_device(y).astype(acc.dtype)
    return jax.lax.dynamic_update_index_in_dim(acc, rest_like(new, acc), i, 0)


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


@dataclass(frozen=True)
class _LeafMoves:
    """The collectives of one unit's leaf: the all-gathers to its compute layout (`gathers`) and, in
    the backward, the reduce-scatters to its gradient layout (`scatters`) and the psum over the
    remaining data-parallel axes (`rest`), in `reduce_dtype`."""

    gathers: list[tuple[int, tuple[str, ...]]]
    scatters: list[tuple[int, tuple[str, ...]]]
    rest: tuple[str, ...]
    reduce_dtype: Any
    auto: tuple[str, ...] = ()  # the loop's auto axes ('tensor'): manual for the collectives
    specs: tuple[P, P, P] = (P(), P(), P())  # stored, compute, gradient layouts over `auto`

    @classmethod
    def of(cls, mesh: Mesh, spec: P, base: P, target: P | None, reduce_dtype: Any) -> _LeafMoves:
        """`spec` / `base` / `target`: one unit's stored, compute and gradient layouts (target None: spec)."""
        gathers = _split_dims(spec, base)
        scatters = gathers if target is None else _split_dims(target, base)
        used = {a for _, axes in dims_with(base, GRAD_AXES) for a in axes}
        scattered = {a for _, axes in scatters for a in axes}
        live = tuple(a for a in GRAD_AXES if mesh.shape.get(a, 1) > 1)
        rest = tuple(a for a in live if a not in used and a not in scattered)
        auto = tuple(a for a in mesh.axis_names if a not in MANUAL)
        specs = tuple(restrict_spec(s, auto) for s in (spec, base, spec if target is None else target))
        return cls(gathers, scatters, rest, reduce_dtype, auto, specs)

    def gather(self, x: jax.Array) -> jax.Array:
        return self._manual(self._gather, self.specs[0], self.specs[1])(to_device(x))

    def reduce(self, g: jax.Array, dt: Any, host: bool) -> jax.Array:
        """The gradient reduced onto its layout, in dtype `dt`, in host memory if `host`."""
        g = self._manual(lambda g: self._reduce(g, dt), self.specs[1], self.specs[2])(g)
        return jax.device_put(g, HOST_SPACE) if host else g  # where the primal came from

    def _manual(self, fn: Callable, in_spec: P, out_spec: P) -> Callable:
        """`fn` in a shard_map manual over the loop's auto axes, so each device moves its tensor shard
        as it is (left to GSPMD, XLA all-gathered the tensor shards first: twice the layer's bytes)."""
        if not self.auto:
            return fn
        return jax.shard_map(fn, in_specs=in_spec, out_specs=out_spec, axis_names=set(self.auto), check_vma=False)

    def _gather(self, x: jax.Array) -> jax.Array:
        for d, axes in self.gathers:
            x = jax.lax.all_gather(x, axes, axis=d, tiled=True)
        return x

    def _reduce(self, g: jax.Array, dt: Any) -> jax.Array:
        g = g.astype(jnp.float32)  # reduced as the whole-step reduction reduces the float32 sums
        g = g if self.reduce_dtype is None or not (self.scatters or self.rest) else g.astype(self.reduce_dtype)
        for d, axes in self.scatters:
            g = jax.lax.psum_scatter(g, axes, scatter_dimension=d, tiled=True)
        return (jax.lax.psum(g, self.rest) if self.rest else g).astype(dt)


def make_fetch(mesh: Mesh, store: Any, compute: Any, reduce_dtype: Any = None, grads: Any = None) -> Callable:
    """p_unit -> p_unit in device memory, gathered to the compute layout. `store` / `compute`: the
    PartitionSpec trees of the stacked layers (leading layer axis, ZeRO-3 and ZeRO-0 layouts). `grads`:
    the layout the backward reduce-scatters each layer's gradient to (None: `store`'s; ZeRO-2 per
    microbatch: parameters that rest whole, a gradient that is scattered)."""
    leaf = functools.partial(_fetch_leaf, mesh, reduce_dtype, grad_sink())
    shadow = lambda x: isinstance(x, Shadowed)  # noqa: E731
    if grads is None:
        return lambda p: jax.tree.map(leaf, p, store, compute, is_leaf=shadow)
    return functools.partial(_fetch_grouped, mesh, reduce_dtype, grad_sink(), store, compute, grads)


def _fetch_grouped(mesh: Mesh, reduce_dtype: Any, sink: Any, store: Any, compute: Any, grads: Any, p: Any) -> Any:
    """`_fetch_leaf` over one unit's tree (device-resting FSDP), the `Shadowed` leaves that gather and
    reduce-scatter over the same axes sharing collectives (`layer_group.Plan`)."""
    shadow = lambda x: isinstance(x, Shadowed)  # noqa: E731
    xs, tree = jax.tree.flatten(p, is_leaf=shadow)
    specs = [jax.tree.leaves(t, is_leaf=lambda s: isinstance(s, P)) for t in (store, compute, grads)]
    out: list[Any] = [None] * len(xs)
    groups: dict[tuple, list[tuple[int, _LeafMoves]]] = {}
    for i, x in enumerate(xs):
        spec, base, target = (P(*s[i][1:]) for s in specs)  # one unit: the layer axis is sliced away
        moves = _LeafMoves.of(mesh, spec, base, target, reduce_dtype)
        if sink is None and shadow(x) and not (on_host(x.x) or on_host(x.z)) and layer_group.groupable(moves):
            groups.setdefault(layer_group.group_key(moves, x.x), []).append((i, moves))
        else:
            out[i] = _fetch_leaf(mesh, reduce_dtype, sink, x, specs[0][i], specs[1][i], specs[2][i])
    for members in groups.values():
        idx, moves = [i for i, _ in members], [m for _, m in members]
        for i, y in zip(idx, _fetch_group(moves, [xs[i] for i in idx]), strict=True):
            out[i] = y
    return jax.tree.unflatten(tree, out)


def _fetch_group(moves: list[_LeafMoves], xs: list[Shadowed]) -> tuple[jax.Array, ...]:
    """The gathered `x.x` of a group of leaves, their float32 gradients sent to the `x.z`, with the
    group's collectives (`layer_group`; `_fetch_shadowed`, for several leaves)."""
    plan = layer_group.Plan.of(moves, [x.x for x in xs], [x.z.dtype for x in xs])

    @jax.custom_vjp
    def fetch(x, z):
        return plan.gather(x)

    fetch.defvjp(lambda x, z: (fetch(x, z), None), lambda _, g: (None, plan.reduce(g)))
    return fetch(tuple(x.x for x in xs), tuple(x.z for x in xs))


def reduce_rest(mesh: Mesh, compute: Any, grads: Any, reduce_dtype: Any = None) -> Callable:
    """(params, z) -> params for the entries not fetched per layer (embedding, head, final norm), in
    the loop's compute layout: the identity, whose backward reduces each leaf's gradient onto its
    gradient layout into the float32 array of `z` at its place (per layer: 1/DP sums, as the layers')."""

    def one(x, z, base, target):
        return _fetch_shadowed(_LeafMoves.of(mesh, base, base, target, reduce_dtype), Shadowed(x, z))

    return lambda p, z: jax.tree.map(one, p, z, compute, grads, is_leaf=lambda a: isinstance(a, jax.Array))


def _fetch_leaf(mesh: Mesh, reduce_dtype: Any, sink: Any, x: Any, spec: P, base: P, target: P | None = None):
    """One unit's leaf `x` (a parameter shard, or `Shadowed`) fetched: gathered in the forward, its
    gradient reduced in the backward (to `z` for a `Shadowed`, to the sink if there is one)."""
    spec, base = P(*spec[1:]), P(*base[1:])  # one unit: the layer axis is sliced away
    # `target` applies where the gradient goes to float32 arrays of its own shape (`Shadowed`); a
    # parameter's own cotangent must have its shape
    target = P(*target[1:]) if target is not None and isinstance(x, Shadowed) else None
    moves = _LeafMoves.of(mesh, spec, base, target, reduce_dtype)
    if isinstance(x, Shadowed) and sink is not None:  # the gradient to the sink, its squared sum to z
        return _fetch_to_sink(mesh, sink, moves, spec, x)
    if isinstance(x, Shadowed):
        return _fetch_shadowed(moves, x)
    return _fetch_param(moves, x)


def _fetch_param(moves: _LeafMoves, x: jax.Array) -> jax.Array:
    """The gathered parameter; its backward returns the reduced gradient where `x` rests."""
    host = on_host(x)

    @jax.custom_vjp
    def fetch(x):
        return moves.gather(x)

    fetch.defvjp(lambda x: (fetch(x), None), lambda _, g: (moves.reduce(g, g.dtype, host),))
    return fetch(x)


def _fetch_shadowed(moves: _LeafMoves, x: Shadowed) -> jax.Array:
    """The gathered `x.x`; the float32 gradient goes to `x.z` (`x.x`, not differentiated, has none)."""
    z_host = on_host(x.z)

    @jax.custom_vjp
    def fetch2(x, z):
        return moves.gather(x)

    fetch2.defvjp(lambda x, z: (moves.gather(x), None), lambda _, g: (None, moves.reduce(g, x.z.dtype, z_host)))
    return fetch2(x.x, x.z)


def _fetch_to_sink(mesh: Mesh, sink: Any, moves: _LeafMoves, spec: P, x: Shadowed) -> jax.Array:
    """The gathered `x.x`; the backward hands each device's block of the reduced gradient to `sink`
    and returns its squared sum as `x.z`'s cotangent (`x.z`: the leaf's `sink_index`)."""
    dtype = x.x.dtype if sink.cast else None
    axes = spec_axes(spec)
    auto = tuple(a for a in mesh.axis_names if a not in MANUAL)  # auto inside the loop: manual for the sink

    def hand_over(g, layer):  # manual over every axis: this device's block
        coords = tuple(jax.lax.axis_index(a) for a in mesh.axis_names)
        io_callback(sink.write, None, layer, g, *coords)
        return sq_sum(g, axes, dtype)

    @jax.custom_vjp
    def fetch3(x, z):
        return moves.gather(x)

    def bwd(z, g):
        g = moves.reduce(g, jnp.float32, False)
        if auto:
            inner = restrict_spec(spec, auto)
            return None, jax.shard_map(hand_over, in_specs=(inner, P()), out_specs=P(), axis_names=set(auto),
                                       check_vma=False)(g, z)  # fmt: skip
        return None, hand_over(g, z)

    fetch3.defvjp(lambda x, z: (moves.gather(x), z), bwd)
    return fetch3(x.x, x.z)
