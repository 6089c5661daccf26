"""ZeRO shardings of one step (Rajbhandari et al. 2020): where parameters, gradients and optimizer
state live, and the data-parallel collectives between those layouts.

`ZeroShardings.build` is called once per step (by the step plan) and handed to the loop that
accumulates the gradients (`train.step.accumulate_grads` or the pipeline executor). It holds four
PartitionSpec trees over the whole mesh: `store` (params as the state keeps them; ZeRO-3: split
over the DP axes), `compute` (as the loop uses them), `grads` (reduced gradients; ZeRO >= 1:
scattered) and `opt` (optimizer moments). `sharding(part, spec)` gives a leaf's resting place
(pinned host memory for the `offload` parts), `to_device` / `to_host` move offloaded state in and
out. In the loop: `gather` (ZeRO-3, once per step) or `layer_fetch` (per layer), then
`reduce_local` and `finish` (one reduction per step, in `reduce_dtype`), all in shard_maps manual
over every axis so each device moves its tensor shard as it is. Gradients accumulate in float32
(`accum_zeros`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshrun.parallel import layer_fetch
from meshrun.parallel.sharding import GRAD_AXES, dims_with, is_spec, names_to_specs, param_rules, restrict_spec

HOST = "pinned_host"  # where offloaded state rests between steps (page-locked: DMA at full PCIe/C2C speed)


def _map(fn: Callable, *trees: Any) -> Any:
    return jax.tree.map(fn, *trees, is_leaf=is_spec)


def accum_zeros(tree: Any) -> Any:
    """Zero gradient accumulators for `tree` (arrays or ShapeDtypeStructs): float32 for every
    floating leaf, 16-bit ones included ("gradients accumulated locally in FP32")."""

    def one(a):
        dt = jnp.promote_types(a.dtype, jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a.dtype
        return jnp.zeros(a.shape, dt)

    return jax.tree.map(one, tree)


def zeros_like_shapes(tree: Any) -> Any:
    """Zeros of each leaf's own shape and dtype (`tree`: arrays or ShapeDtypeStructs)."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)


def without_layers(tree: dict) -> dict:
    """The entries of a params-shaped dict other than 'layers' (embedding, head, final norm)."""
    return {k: v for k, v in tree.items() if k != "layers"}


@dataclass(frozen=True)
class ZeroShardings:
    """PartitionSpec trees (plain nested dicts) of one model's parameters at one ZeRO stage."""

    mesh: Mesh
    stage: int
    store: Any
    compute: Any
    grads: Any
    opt: Any
    reduce_dtype: Any = None  # dtype of the data-parallel gradient collectives (None: the gradients')
    offload: frozenset[str] = frozenset()  # parts resting in pinned host memory: 'opt', 'store'
    from_host: bool = False  # offload.params: params['layers'] fetched layer by layer from host memory
    root: bool = False  # with `per_layer`: this is the layout of params['layers'] itself (`sub('layers')`)
    fsdp: bool = False  # train.zero3_gather=layer: params['layers'] gathered layer by layer from device memory
    # per layer: the other entries' gradients too left the loop reduced (`rest_sums`); on a layout without
    # the layers (`without`: the pipeline's embedding and head), those entries' own
    rest_reduced: bool = False

    @property
    def per_layer(self) -> bool:
        """params['layers'] are gathered layer by layer inside the layer scan (layer_fetch.py), each
        layer's gradient reduce-scattered as the backward makes it: FSDP (`fsdp`, the weights in device
        memory) or offload.params (`from_host`, in host memory). One fetch, two sources."""
        return self.from_host or self.fsdp

    def shadows(self, layers: Any) -> bool:
        """Whether the pipeline's stage vjp differentiates float32 arrays beside the layers
        (`layer_fetch.Shadowed`, `layer_sums`) rather than the layers (`layers`: the stacked layers or
        their shapes): ZeRO-2 per microbatch (the layers rest whole, each layer's gradient is reduce-scattered
        to 1/DP of them) and per-layer layers stored below float32 (their own cotangent would round
        each layer's reduced gradient to their dtype)."""
        narrow = any(a.dtype != jnp.float32 for a in jax.tree.leaves(layers))
        return self.per_layer and (narrow or self.fsdp and self.stage == 2)

    @classmethod
    def build(
        cls,
        names: Any,
        shapes: Any,
        mesh: Mesh,
        stage: int,
        reduce_dtype: Any = None,
        offload: tuple[str, ...] = (),
        from_host: bool = False,
        fsdp: bool = False,
    ) -> ZeroShardings:
        """names: tree of logical-name tuples; shapes: the same tree of arrays / ShapeDtypeStructs.
        reduce_dtype: e.g. 'bfloat16' to run the data-parallel reduction in bf16; offload: parts in host
        memory; from_host: the stacked layers are gathered and reduced layer by layer inside the layer scan, from
        host memory (offload.params); fsdp: the same from device memory (ZeRO-3 per layer)."""
        specs = lambda z, part: names_to_specs(names, shapes, param_rules(z, part), mesh)
        rd = None if reduce_dtype is None else jnp.dtype(reduce_dtype)
        rd = None if rd == jnp.float32 else rd  # the accumulators are float32: nothing to cast
        trees = (specs(stage, "params"), specs(0, "params"), specs(stage, "grads"), specs(stage, "opt"))
        return cls(mesh, stage, *trees, reduce_dtype=rd, offload=frozenset(offload), from_host=from_host,
                   fsdp=fsdp and not from_host)  # fmt: skip

    def sub(self, key: str) -> ZeroShardings:
        """The layout of one top-level entry of the parameter dict (e.g. 'layers')."""
        trees = (t[key] for t in (self.store, self.compute, self.grads, self.opt))
        layers = key == "layers"
        return ZeroShardings(
            self.mesh, self.stage, *trees, reduce_dtype=self.reduce_dtype, offload=self.offload,
            from_host=self.from_host and layers, root=self.per_layer and layers, fsdp=self.fsdp and layers,
        )  # fmt: skip

    def without(self, key: str) -> ZeroShardings:
        """The layout of every top-level entry but `key`."""
        drop = lambda t: {k: v for k, v in t.items() if k != key}
        trees = (drop(t) for t in (self.store, self.compute, self.grads, self.opt))
        return ZeroShardings(self.mesh, self.stage, *trees, reduce_dtype=self.reduce_dtype, offload=self.offload)

    # ------------------------------------------------------------ memory kinds (host offload)

    def sharding(self, part: str, spec: P) -> NamedSharding:
        """Where a leaf of `part` ('store' or 'opt') rests between steps."""
        return NamedSharding(self.mesh, spec, memory_kind=HOST if part in self.offload else None)

    def device(self, spec: P) -> NamedSharding:
        """The same layout in device memory (where the step computes)."""
        return NamedSharding(self.mesh, spec, memory_kind="device")

    def to_device(self, tree: Any, shardings: Any) -> Any:
        """Inside the step: offloaded leaves (resting shardings `shardings`) -> device memory."""
        if not self.offload:
            return tree
        move = lambda x, s: jax.device_put(x, self.device(s.spec)) if s.memory_kind == HOST else x
        return jax.tree.map(move, tree, shardings)

    def to_host(self, tree: Any, shardings: Any) -> Any:
        """Inside the step: leaves whose resting place is host memory go back there."""
        if not self.offload:
            return tree
        return jax.tree.map(lambda x, s: jax.device_put(x, s) if s.memory_kind == HOST else x, tree, shardings)

    # ------------------------------------------------------------ layer by layer (FSDP, offload.params)

    def layer_fetch(self) -> Callable | None:
        """The per-layer fetch the loop traces the model with (`layer_fetch.use_layer_fetch`), or None."""
        if not self.per_layer:
            return None
        pick = (lambda t: t) if self.root else (lambda t: t["layers"])
        grads = pick(self.grads) if self.fsdp else None  # ZeRO-2: reduce-scattered, nothing gathered
        return layer_fetch.make_fetch(self.mesh, pick(self.store), pick(self.compute), self.reduce_dtype, grads)

    def rest_fetch(self) -> Callable | None:
        """Per layer: (params, z) -> the entries other than the layers (embedding, head, final norm) as
        they are, whose backward reduces each leaf's gradient every microbatch into its 1/DP float32
        sums `z` (`rest_sums`, `layer_fetch.reduce_rest`), in the microbatch scan and the pipeline alike;
        None when the layers are not fetched per layer."""
        if not self.per_layer:
            return None
        compute, grads = without_layers(self.compute), without_layers(self.grads)
        return layer_fetch.reduce_rest(self.mesh, compute, grads, self.reduce_dtype)

    def layer_sums(self, layers: Any) -> Any:
        """Float32 zeros for the layers' gradient sums inside the loop's shard_map, shaped like their
        local block of the grad layout (`layers`: the local stored layers, arrays or shapes): ZeRO-3's
        shards as they rest, ZeRO-2's 1/DP of the whole parameters."""
        pick = (lambda t: t) if self.root else (lambda t: t["layers"])
        return accum_zeros(jax.tree.map(self._grad_block, layers, pick(self.store), pick(self.grads)))

    def rest_sums(self, params: Any) -> Any:
        """Float32 zeros for the gradient sums of the entries other than the layers inside the loop's
        shard_map, shaped like their local block of the grad layout (`params`: the local compute-layout
        params, arrays or shapes); with `rest_reduced` the loop reduces into them."""
        rest = (without_layers(t) for t in (params, self.compute, self.grads))
        return accum_zeros(jax.tree.map(self._grad_block, *rest))

    def _grad_block(self, a: Any, base: P, target: P) -> jax.ShapeDtypeStruct:
        """The shape of a local block `a` (laid out by `base`) once cut to the grad layout `target`: each
        dim divided by the ZeRO axes `target` adds to `base`'s."""
        shape = list(a.shape)
        for d, axes in dims_with(target, GRAD_AXES):
            extra = [x for x in axes if x not in dict(dims_with(base, GRAD_AXES)).get(d, ())]
            shape[d] //= math.prod(self.mesh.shape[x] for x in extra)
        return jax.ShapeDtypeStruct(tuple(shape), a.dtype)

    def _rest(self, tree: Any, fn: Callable) -> Any:
        """`fn` (a method of the layout without 'layers') on every entry but the layers fetched per layer."""
        if not self.per_layer:
            return fn(self, tree)
        if self.root:
            return tree
        rest = fn(self.without("layers"), without_layers(tree))
        return {**rest, "layers": tree["layers"]}

    # ------------------------------------------------------------ what the loop's shard_map sees

    def local_compute(self) -> Any:
        """in_specs of the compute-layout parameters in the loop's shard_map (manual axes only); layers
        fetched per layer enter as their ZeRO-3 shards."""
        if self.root:
            return _map(restrict_spec, self.store)
        specs = _map(restrict_spec, self.compute)
        return {**specs, "layers": _map(restrict_spec, self.store["layers"])} if self.per_layer else specs

    def partial_specs(self) -> Any:
        """out_specs of `reduce_local`'s output: scattered leaves leave as per-rank partial sums with
        a leading axis over their reduction axes."""

        def one(base, target):
            if self._deferred(base, target):
                return P(self._reduction_axes(base), *restrict_spec(base))
            return restrict_spec(target)

        if self.root or self.rest_reduced:
            return _map(restrict_spec, self.grads)
        specs = _map(one, self.compute, self.grads)
        return {**specs, "layers": _map(restrict_spec, self.grads["layers"])} if self.per_layer else specs

    # ------------------------------------------------------------ collectives

    def gather(self, params: Any) -> Any:
        """ZeRO-3: all-gather every parameter's data-parallel shards (store -> compute layout) once per
        step, before the loop. A no-op below stage 3. Layers gathered per layer (`per_layer`) stay as they
        rest (device or host memory); the other entries come to the device first."""
        if self.per_layer:
            return self._rest(params, lambda zl, t: ZeroShardings.gather(zl, jax.tree.map(layer_fetch.to_device, t)))
        if self.stage < 3:
            return params

        def body(params):
            def one(x, spec, base):
                kept = dict(dims_with(base, GRAD_AXES))  # e.g. experts split over 'expert' stay split
                for d, axes in dims_with(spec, GRAD_AXES):
                    if axes := tuple(a for a in axes if a not in kept.get(d, ())):
                        x = jax.lax.all_gather(x, axes, axis=d, tiled=True)
                return x

            return jax.tree.map(one, params, self.store, self.compute, is_leaf=lambda x: isinstance(x, jax.Array))

        return jax.shard_map(body, mesh=self.mesh, in_specs=(self.store,), out_specs=self.compute, check_vma=False)(
            params
        )

    def reduce_local(self, grads: Any, extra: tuple[str, ...] = ()) -> Any:
        """Inside the loop's shard_map, after the accumulation: psum what stays replicated; leaves that
        ZeRO scatters leave as per-rank partial sums [1, ...] for `finish`. `extra`: axes summed in any
        case (the pipeline sums embedding/head grads over 'pipe'). Per-layer layers left the scan reduced;
        with `rest_reduced` the other entries too (only `extra` is summed)."""
        if self.rest_reduced and not self.per_layer:  # the pipeline's entries but the layers: 1/DP sums
            return jax.lax.psum(grads, extra) if extra else grads
        if self.per_layer:
            if self.rest_reduced:
                return grads
            return self._rest(grads, lambda zl, t: ZeroShardings.reduce_local(zl, t, extra))

        def one(g, base, target):
            if self._deferred(base, target):
                return (jax.lax.psum(g, extra) if extra else g)[None]
            red = extra + self._reduction_axes(base)
            return jax.lax.psum(g, red) if red else g

        return jax.tree.map(one, grads, self.compute, self.grads)

    def finish(self, grads: Any) -> Any:
        """Sum the per-rank partials onto the ZeRO grad layout, one reduce-scatter per leaf, in a
        shard_map manual over every axis: local tensor shards are reduce-scattered as they are (a
        psum_scatter inside the tensor-auto loop made XLA all-gather the tensor shards first, and a
        GSPMD sum gave a full all-reduce). Per-layer layers left the scan reduced."""
        if self.rest_reduced and not self.per_layer:
            return grads
        if self.per_layer:
            return grads if self.rest_reduced else self._rest(grads, ZeroShardings.finish)
        flat_g, tree = jax.tree.flatten(grads)
        flat_b, flat_t = jax.tree.leaves(self.compute, is_leaf=is_spec), jax.tree.leaves(self.grads, is_leaf=is_spec)
        idx = [i for i, (b, t) in enumerate(zip(flat_b, flat_t, strict=True)) if self._deferred(b, t)]
        if not idx:
            return grads

        def body(*gs):
            out = []
            for g, i in zip(gs, idx, strict=True):
                out.append(self._scatter_sum(g[0], flat_b[i], flat_t[i]))
            return tuple(out)

        fn = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=tuple(P(self._reduction_axes(flat_b[i]), *flat_b[i]) for i in idx),
            out_specs=tuple(flat_t[i] for i in idx),
            check_vma=False,
        )
        for i, g in zip(idx, fn(*(flat_g[i] for i in idx)), strict=True):
            flat_g[i] = g
        return jax.tree.unflatten(tree, flat_g)

    def reduce_rows(self, rows: Any) -> Any:
        """Inside the loop's shard_map (manual over 'pipe' and the DP axes, auto over 'tensor'): what
        `finish(reduce_local(rows))` gives for some rows of the stacked layer sums, as local shards
        (ZeRO >= 1: reduce-scattered to their grad layout; else psum'd), in a shard_map manual over
        'tensor' nested in the loop's, so each device moves its tensor shard as it is (the same
        collectives with 'tensor' left to GSPMD all-gathered the tensor shards first), also where
        'tensor' has size 1: a 16-bit reduction (`reduce_dtype`) with an axis left to GSPMD aborted
        XLA:CPU as in `_deferred`. `pipeline.overlap_grad_reduce` reduces a final chunk a few layers
        per tick this way."""
        tensor = "tensor" in self.mesh.shape

        def one(g, base, target):
            def body(g):
                if self._deferred(base, target):
                    return self._scatter_sum(g, base, target)
                red = self._reduction_axes(base)
                return jax.lax.psum(g, red) if red else g

            if not tensor:
                return body(g)
            spec = restrict_spec(base, ("tensor",))
            return jax.shard_map(body, in_specs=spec, out_specs=spec, axis_names={"tensor"}, check_vma=False)(g)

        return jax.tree.map(one, rows, self.compute, self.grads)

    def reduced_specs(self) -> Any:
        """out_specs of `reduce_rows`'s output stacked into whole layers: the grad layout (manual axes)."""
        return _map(restrict_spec, self.grads)

    # ------------------------------------------------------------ per-leaf rules

    def _scatter_sum(self, g: jax.Array, base: P, target: P) -> jax.Array:
        """A scattered leaf's local sums (manual over every axis it reduces) onto its ZeRO grad layout:
        reduce-scattered along the target's dims, psum'd over the rest, in `reduce_dtype`."""
        dt, g = g.dtype, self._down(g)
        red = self._reduction_axes(base)
        for d, axes in dims_with(target, GRAD_AXES):
            if axes := tuple(a for a in axes if a in red):
                g = jax.lax.psum_scatter(g, axes, scatter_dimension=d, tiled=True)
                red = tuple(a for a in red if a not in axes)
        return (jax.lax.psum(g, red) if red else g).astype(dt)

    def _down(self, g: jax.Array) -> jax.Array:
        """A gradient as the data-parallel collective carries it (`reduce_dtype`)."""
        return g if self.reduce_dtype is None or g.dtype == self.reduce_dtype else g.astype(self.reduce_dtype)

    def _reduction_axes(self, base: P) -> tuple[str, ...]:
        """DP axes a gradient is summed over: all live ones, except those the weight is already split
        over (experts over 'expert' are reduced over 'data' only)."""
        used = {a for _, axes in dims_with(base, GRAD_AXES) for a in axes}
        return tuple(a for a in GRAD_AXES if self.mesh.shape.get(a, 1) > 1 and a not in used)

    def _deferred(self, base: P, target: P) -> bool:
        """Leaves reduced in `finish`: those whose reduced gradient is scattered over a DP axis
        (ZeRO >= 1), and with a narrower `reduce_dtype` every leaf with a DP reduction. A 16-bit
        all-reduce inside the loop's shard_map (manual over pipe/data/expert, auto over tensor)
        aborted XLA:CPU's all-reduce promotion (jax 0.10.2: "Invalid binary instruction opcode
        copy"); in `finish`'s shard_map, manual over every axis, it compiles and runs."""
        red = self._reduction_axes(base)
        if self.reduce_dtype is not None and red:
            return True
        return any(a in red for _, axes in dims_with(target, GRAD_AXES) for a in axes)
