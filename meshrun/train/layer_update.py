"""train.offload_params: the optimizer update streamed layer by layer, so that the parameters,
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

from meshrun.config import RunConfig
from meshrun.errors import ConfigError
from meshrun.optim import optimizer, registry
from meshrun.parallel.layer_fetch import HOST_SPACE, on_host, to_device
from meshrun.train.streamed import clip

LAYER, OTHER, SCALAR = "layer", "other", "scalar"


def no_clip_optimizer(cfg: RunConfig, param_names: Any) -> optax.GradientTransformation:
    """The step's optimizer without its global-norm clip (the same state structure); a ConfigError
    for an optimizer whose update is not elementwise."""
    if not registry.get(cfg.optimizer.name).elementwise:
        raise ConfigError(
            "train.offload_params", True, "use an elementwise optimizer with it, e.g. optimizer.name=adamw",
            f"streams the update layer by layer; {cfg.optimizer.name}'s update needs whole weight matrices",
        )  # fmt: skip
    return optimizer.make_optimizer(dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, grad_clip=0)),
                                    param_names)  # fmt: skip


def _kinds(tx, opt_state: Any, params: Any) -> list[str]:
    """Per optimizer-state leaf: LAYER (shaped like a stacked layer leaf), OTHER, or SCALAR."""
    flags = {k: jax.tree.map(lambda _, k=k: LAYER if k == "layers" else OTHER, v) for k, v in params.items()}
    return jax.tree.leaves(
        optimizer.map_params(tx, lambda _, f: f, opt_state, flags, transform_non_params=lambda _: SCALAR)
    )


def _empty(x) -> jax.Array:
    return jnp.zeros((0,), x.dtype)


def _back(new: jax.Array, like: jax.Array) -> jax.Array:
    """A new slice, in the memory space its source rests in."""
    return jax.device_put(new, HOST_SPACE) if on_host(like) else new


def update(tx, grads: Any, opt_state: Any, params: Any, max_norm: float, cast: bool) -> tuple[Any, Any, jax.Array]:
    """(new params, new optimizer state, the global gradient norm). `tx`: `no_clip_optimizer`;
    `cast`: the gradient sums go to the param dtype before the optimizer (as the in-memory step
    casts them); `max_norm`: the clip (0: none)."""
    treedef = jax.tree.structure(opt_state)
    kinds = _kinds(tx, opt_state, params)
    leaves = jax.tree.leaves(opt_state)
    dtype = lambda g, p: g.astype(p.dtype) if cast else g
    sq = lambda g, p: jnp.sum(jnp.square(dtype(to_device(g), p).astype(jnp.float32)))

    other = {k: v for k, v in params.items() if k != "layers"}
    other_g = {k: v for k, v in grads.items() if k != "layers"}
    total = sum(jax.tree.leaves(jax.tree.map(sq, other_g, other)), jnp.zeros((), jnp.float32))

    def norm_body(acc, xs):
        g, p = xs
        return acc + sum(jax.tree.leaves(jax.tree.map(sq, g, p))), None

    total, _ = jax.lax.scan(norm_body, total, (grads["layers"], params["layers"]))
    g_norm = jnp.sqrt(total)

    def run(g_tree, p_tree, opt_leaves):
        g_tree = jax.tree.map(lambda g, p: dtype(to_device(g), p), g_tree, p_tree)
        p_tree = jax.tree.map(to_device, p_tree)
        if max_norm > 0:
            g_tree = jax.tree.map(lambda g: clip(g, g_norm, max_norm), g_tree)
        state = jax.tree.unflatten(treedef, [to_device(x) for x in opt_leaves])
        return optimizer.apply_optimizer(tx, g_tree, state, p_tree)

    def layer_body(_, xs):
        g, p, slots = xs
        it = iter(slots)
        opt = [
            next(it) if k == LAYER else (x if k == SCALAR else _empty(x)) for x, k in zip(leaves, kinds, strict=True)
        ]
        new_p, new_opt = run(
            {**jax.tree.map(_empty, other_g), "layers": g}, {**jax.tree.map(_empty, other), "layers": p}, opt
        )
        new_slots = [n for n, k in zip(jax.tree.leaves(new_opt), kinds, strict=True) if k == LAYER]
        return None, (
            jax.tree.map(_back, new_p["layers"], p),
            [_back(n, s) for n, s in zip(new_slots, slots, strict=True)],
        )

    slots = [x for x, k in zip(leaves, kinds, strict=True) if k == LAYER]
    _, (new_layers, new_slots) = jax.lax.scan(layer_body, None, (grads["layers"], params["layers"], slots))

    empty_layers = jax.tree.map(_empty, params["layers"])
    opt = [_empty(x) if k == LAYER else x for x, k in zip(leaves, kinds, strict=True)]
    new_p, new_opt = run(
        {**other_g, "layers": jax.tree.map(_empty, grads["layers"])}, {**other, "layers": empty_layers}, opt
    )
    it = iter(new_slots)
    out = [next(it) if k == LAYER else n for n, k in zip(jax.tree.leaves(new_opt), kinds, strict=True)]
    return {**new_p, "layers": new_layers}, jax.tree.unflatten(treedef, out), g_norm
