"""Parameters a family's init makes without drawing random numbers (the fp8 scaling state: the amax
history, the on/off masks of the first and last layers): a `checkpoint.init_params` that lacks them
(a Hugging Face import fine-tuned with model.fp8) gets them fresh, as the family's init makes them.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import jax
import jax.numpy as jnp

from meshrun.checkpoint.state import path_key


def seed_free(family, cfg, keys: Collection[str], target: Any) -> dict[str, jax.Array]:
    """{key: the family init's array, placed as `target`'s leaf} for each of `keys` (the 'a.b.c' keys
    of the params tree) whose initial value is the same at two seeds; a key whose value depends on
    the seed (a weight) is left out. One jitted init, returning only these leaves (XLA drops the rest)."""
    keys = sorted(keys)
    if not keys:
        return {}
    flat_target = {path_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(target)[0]}

    def pick(seed: int) -> list:
        flat = {path_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(family.init_params(cfg, seed))[0]}
        return [jnp.asarray(flat[k]) if k in flat else None for k in keys]

    def both():
        a, b = pick(0), pick(1)
        return a, [x is not None and y is not None and jnp.array_equal(x, y) for x, y in zip(a, b)]

    values, same = jax.jit(both)()
    out = {}
    for k, v, s in zip(keys, values, same):
        if v is not None and bool(s):
            sharding = getattr(flat_target.get(k), "sharding", None)
            out[k] = jax.device_put(v, sharding) if sharding is not None else v
    return out
