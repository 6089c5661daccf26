"""Content checksums of a state pytree, written with each checkpoint and checked on restore.

Orbax's OCDBT files have no checksum on the array chunks they hold: bytes overwritten inside a
chunk restore without an error, as different numbers (seen in the fault-injection tests: garbage in
the middle of a data file restored silently about one time in three). So `Checkpointer.save` stores,
per leaf, two 32-bit sums of the array's bit patterns (a plain one and one weighted by a hash of the
element's position), computed on the devices in one jitted pass; `restore` recomputes them on the
restored arrays and treats a mismatch as a damaged checkpoint. Integer sums wrap exactly, so the
result does not depend on the sharding or the reduction order: a state saved on one mesh checks
against its restore on any other.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _sums(x) -> jax.Array:
    """uint32[2] of one array: sum of its words, and sum of word * (odd hash of its flat index)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = jnp.dtype(x.dtype).itemsize
    if size > 4:  # 64-bit: two 32-bit words per element
        x = lax.bitcast_convert_type(x, jnp.uint32)
    else:
        x = lax.bitcast_convert_type(x, _UINT[size])
    w = x.astype(jnp.uint32)
    # flat index from per-axis iotas (no reshape: a sharded array stays sharded)
    idx = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for ax in reversed(range(w.ndim)):
        idx = idx + lax.broadcasted_iota(jnp.uint32, w.shape, ax) * jnp.uint32(stride % 2**32)
        stride *= w.shape[ax]
    weight = idx * jnp.uint32(2654435761) + jnp.uint32(1)  # Knuth's multiplicative hash, odd
    return jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * weight, dtype=jnp.uint32)])


def _device_sharding(x):
    """Where an offloaded (pinned_host) leaf is summed: its sharding in device memory; else None."""
    s = getattr(x, "sharding", None)
    return s.with_memory_kind("device") if getattr(s, "memory_kind", None) == "pinned_host" else None


@functools.partial(jax.jit, static_argnums=1)
def _all_sums(leaves: list, to_device: tuple) -> list:
    # offloaded leaves move to the device inside the jit, where XLA can free each one once it is
    # summed (an eager device_put first would hold all of them in device memory at once)
    return [_sums(x if s is None else jax.device_put(x, s)) for x, s in zip(leaves, to_device, strict=True)]


_HOST_BYTES = 64 << 20  # a state this small is summed on the host: no jit compile (2-3 s for a small model)
_KNUTH = 2654435761


def host_sums(a: np.ndarray) -> list[int]:
    """`_sums` of a host array of 1-, 2- or 4-byte elements, in numpy (the same two 32-bit sums)."""
    w = np.ascontiguousarray(a).reshape(-1)
    w = w.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[w.dtype.itemsize]).astype(np.uint64)
    weight = (np.arange(w.size, dtype=np.uint64) * np.uint64(_KNUTH) + np.uint64(1)) & np.uint64(0xFFFFFFFF)
    return [int(np.sum(w, dtype=np.uint64)) & 0xFFFFFFFF, int(np.sum(w * weight, dtype=np.uint64)) & 0xFFFFFFFF]


def _on_host(leaves: list) -> bool:
    """Sum on the host: a small state of plain arrays this process holds whole (no PRNG keys, no
    64-bit words)."""
    plain = all(
        getattr(x, "is_fully_addressable", True)
        and not jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
        and jnp.dtype(x.dtype).itemsize <= 4
        for x in leaves
    )
    return plain and sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in leaves) <= _HOST_BYTES


def checksums(tree: Any, key) -> dict[str, list[int]]:
    """{leaf key: [sum, weighted sum]} of every array leaf; `key(path)` names a leaf."""
    flat = [(key(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0] if hasattr(x, "dtype")]
    out = {k: x.sums() for k, x in flat if hasattr(x, "sums")}  # streamed leaves sum themselves (slices.py)
    flat = [(k, x) for k, x in flat if k not in out]
    leaves = [x for _, x in flat]
    if _on_host(leaves):
        return out | {k: host_sums(np.asarray(a)) for (k, _), a in zip(flat, jax.device_get(leaves), strict=True)}
    sums = jax.device_get(_all_sums(leaves, tuple(_device_sharding(x) for x in leaves)))
    out |= {k: [int(v) for v in np.asarray(s)] for (k, _), s in zip(flat, sums, strict=True)}
    return out


def mismatches(saved: dict[str, list[int]], tree: Any, key) -> list[str]:
    """Leaves of `tree` whose checksums differ from `saved` (leaves `saved` does not list are skipped)."""
    now = checksums(tree, key)
    return [k for k, v in now.items() if k in saved and list(saved[k]) != v]
