"""offload.params: the optimizer update streamed layer by layer, so that the parameters,
their gradient sums and the optimizer state never come to the device whole.

The in-memory step updates the whole tree at once. Here the stacked layers (params['layers'], their
gradient sums, and the optimizer leaves shaped like them) are updated inside a `lax.scan` over the
layer axis: each iteration moves one layer's slices to the device, runs the optimizer on them and
moves the new slices back where they rest. The other entries (embedding, head, final norm) are
updated once, on the device. Both calls run the optimizer without its clip, on gradients already
clipped by optax's formula with the global norm, which a first scan over the layers sums up (the
in-memory step's norm, summed in another order). This needs an elementwise optimizer (AdamW): each
layer's update must depend on that layer's gradient, state and params alone, plus the shared
scalars (the step count, the learning rate) that both calls advance alike. Entries left out of a
call are empty arrays there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from meshrun.config import RunConfig
from meshrun.errors import ConfigError
from meshrun.offload.optimizer_tier import clip
from meshrun.optim import optimizer, registry
from meshrun.parallel.layer_fetch import rest_like, spec_axes, sq_sum, to_device
from meshrun.parallel.sharding import is_spec
from meshrun.parallel.zero import without_layers

LAYER, OTHER, SCALAR = "layer", "other", "scalar"


def no_clip_optimizer(cfg: RunConfig, param_names: Any) -> optax.GradientTransformation:
    """The step's optimizer without its global-norm clip (the same state structure); a ConfigError
    for an optimizer whose update is not elementwise."""
    if not registry.get(cfg.optimizer.name).elementwise:
        raise ConfigError(
            "offload.params", True, "use an elementwise optimizer with it, e.g. optimizer.name=adamw",
            f"streams the update layer by layer; {cfg.optimizer.name}'s update needs whole weight matrices",
        )  # fmt: skip
    return optimizer.make_optimizer(dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, grad_clip=0)),
                                    param_names)  # fmt: skip


def kinds(tx, opt_state: Any, params: Any) -> list[str]:
    """Per optimizer-state leaf: LAYER (shaped like a stacked layer leaf), OTHER, or SCALAR."""
    flags = {k: jax.tree.map(lambda _, k=k: LAYER if k == "layers" else OTHER, v) for k, v in params.items()}
    return jax.tree.leaves(
        optimizer.map_params(tx, lambda _, f: f, opt_state, flags, transform_non_params=lambda _: SCALAR)
    )


def _empty(x) -> jax.Array:
    return jnp.zeros((0,), x.dtype)


def _dtype(g, p, cast: bool):
    return g.astype(p.dtype) if cast else g


def other_sq(grads: Any, params: Any, cast: bool) -> jax.Array:
    """The squared sum of the other entries' gradients (embedding, head, final norm), on the device."""
    sq = lambda g, p: jnp.sum(jnp.square(_dtype(to_device(g), p, cast).astype(jnp.float32)))
    sums = jax.tree.map(sq, without_layers(grads), without_layers(params))
    return sum(jax.tree.leaves(sums), jnp.zeros((), jnp.float32))


def layer_sq(g: Any, p: Any, cast: bool, zl: Any) -> Any:
    """One layer's squared sums per leaf (`layer_fetch.sq_sum` on each device's block, as the backward
    computes them when the gradient goes to a sink); `zl`: the ZeroShardings of the step."""
    specs = jax.tree.leaves(zl.grads["layers"], is_leaf=is_spec)

    def one(g, p, spec):
        spec = P(*spec[1:])  # one layer: the layer axis is sliced away
        body = lambda g: sq_sum(g, spec_axes(spec), p.dtype if cast else None)
        return jax.shard_map(body, mesh=zl.mesh, in_specs=spec, out_specs=P(), check_vma=False)(to_device(g))

    return jax.tree.unflatten(jax.tree.structure(g), [one(*a) for a in zip(jax.tree.leaves(g), jax.tree.leaves(p),
                                                                            specs, strict=True)])  # fmt: skip


def global_norm(grads: Any, params: Any, cast: bool, zl: Any) -> jax.Array:
    """The gradient's global norm: the other entries on the device, then a scan over the layers."""

    def norm_body(acc, xs):
        g, p = xs
        return acc + sum(jax.tree.leaves(layer_sq(g, p, cast, zl))), None

    total, _ = jax.lax.scan(norm_body, other_sq(grads, params, cast), (grads["layers"], params["layers"]))
    return jnp.sqrt(total)


def sink_norm(grads: Any, params: Any, cast: bool) -> jax.Array:
    """The global norm when the layers' gradient went to a sink: `grads['layers']` holds each layer's
    squared sums per leaf ([L] each), added exactly as `global_norm` adds them."""

    def norm_body(acc, sq):
        return acc + sum(jax.tree.leaves(sq)), None

    total, _ = jax.lax.scan(norm_body, other_sq(grads, params, cast), grads["layers"])
    return jnp.sqrt(total)


@dataclasses.dataclass(frozen=True)
class Update:
    """The optimizer (`no_clip_optimizer`) over one part of the tree at a time: the layers (one layer,
    or a chunk of them: leaves with a leading layer axis) or the other entries; the leaves of the
    part left out are empty arrays. `cast`: the gradient sums go to the param dtype before the
    optimizer (as the in-memory step casts them); `max_norm`: the clip (0: none)."""

    tx: Any
    treedef: Any
    kinds: tuple
    dtypes: tuple  # of the optimizer-state leaves
    max_norm: float
    cast: bool

    @classmethod
    def of(cls, tx, opt_state: Any, params: Any, max_norm: float, cast: bool) -> Update:
        dtypes = tuple(jnp.dtype(x.dtype) for x in jax.tree.leaves(opt_state))
        return cls(tx, jax.tree.structure(opt_state), tuple(kinds(tx, opt_state, params)), dtypes, max_norm, cast)

    def run(self, g_tree, p_tree, opt_leaves, g_norm):
        g_tree = jax.tree.map(lambda g, p: _dtype(to_device(g), p, self.cast), g_tree, p_tree)
        p_tree = jax.tree.map(to_device, p_tree)
        if self.max_norm > 0:
            g_tree = jax.tree.map(lambda g: clip(g, g_norm, self.max_norm), g_tree)
        state = jax.tree.unflatten(self.treedef, [to_device(x) for x in opt_leaves])
        return optimizer.apply_optimizer(self.tx, g_tree, state, p_tree)

    def layers(self, g, p, slots, scalars, like: Any, like_g: Any, g_norm) -> tuple[Any, list]:
        """(new layer params, new LAYER leaves) of one layer or chunk: `slots` its LAYER leaves,
        `scalars` the SCALAR leaves, `like` / `like_g` the params / gradient (for the other entries'
        empty leaves)."""
        it, sc = iter(slots), iter(scalars)
        opt = [next(it) if k == LAYER else (next(sc) if k == SCALAR else jnp.zeros((0,), dt))
               for k, dt in zip(self.kinds, self.dtypes, strict=True)]  # fmt: skip
        empty = lambda t: jax.tree.map(_empty, without_layers(t))
        new_p, new_opt = self.run({**empty(like_g), "layers": g}, {**empty(like), "layers": p}, opt, g_norm)
        return new_p["layers"], [n for n, k in zip(jax.tree.leaves(new_opt), self.kinds, strict=True) if k == LAYER]

    def others(self, grads, params, kept, g_norm) -> tuple[Any, list]:
        """(new params of the other entries, new non-LAYER leaves): `kept` the non-LAYER leaves."""
        it = iter(kept)
        opt = [jnp.zeros((0,), dt) if k == LAYER else next(it) for k, dt in zip(self.kinds, self.dtypes, strict=True)]
        empty = jax.tree.map(_empty, params["layers"])
        empty_g = jax.tree.map(_empty, grads["layers"])
        new_p, new_opt = self.run(
            {**without_layers(grads), "layers": empty_g}, {**without_layers(params), "layers": empty}, opt, g_norm
        )
        return without_layers(new_p), \
            [n for n, k in zip(jax.tree.leaves(new_opt), self.kinds, strict=True) if k != LAYER]  # fmt: skip

    def split(self, opt_state: Any) -> tuple[list, list]:
        """(LAYER leaves, the other leaves) of an optimizer state."""
        leaves = jax.tree.leaves(opt_state)
        return [x for x, k in zip(leaves, self.kinds, strict=True) if k == LAYER], \
            [x for x, k in zip(leaves, self.kinds, strict=True) if k != LAYER]  # fmt: skip

    def join(self, layer_leaves: list, kept: list) -> Any:
        a, b = iter(layer_leaves), iter(kept)
        return jax.tree.unflatten(self.treedef, [next(a) if k == LAYER else next(b) for k in self.kinds])


def update(tx, grads: Any, opt_state: Any, params: Any, max_norm: float, cast: bool,
           zl: Any) -> tuple[Any, Any, jax.Array]:  # fmt: skip
    """(new params, new optimizer state, the global gradient norm). `tx`: `no_clip_optimizer`;
    `cast`: the gradient sums go to the param dtype before the optimizer (as the in-memory step
    casts them); `max_norm`: the clip (0: none); `zl`: the step's ZeroShardings."""
    up = Update.of(tx, opt_state, params, max_norm, cast)
    g_norm = global_norm(grads, params, cast, zl)
    slots, kept = up.split(opt_state)
    scalars = [x for x, k in zip(jax.tree.leaves(opt_state), up.kinds, strict=True) if k == SCALAR]

    def layer_body(_, xs):
        g, p, slots = xs
        new_p, new_slots = up.layers(g, p, slots, scalars, params, grads, g_norm)
        new_slots = [rest_like(n, s) for n, s in zip(new_slots, slots, strict=True)]
        return None, (jax.tree.map(rest_like, new_p, p), new_slots)

    _, (new_layers, new_slots) = jax.lax.scan(layer_body, None, (grads["layers"], params["layers"], slots))
    new_other, new_kept = up.others(grads, params, kept, g_norm)
    return {**new_other, "layers": new_layers}, up.join(new_slots, new_kept), g_norm
