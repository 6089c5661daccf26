"""Context parallelism's sequence layout: how a batch's tokens are placed on the `context` axis.

The step's shard_maps split every [batch, length] input over `context` in contiguous shards
(`sharding.BATCH_SPEC`). The all-gather kind uses the sequence as it is: shard i holds tokens
[i L/c, (i+1) L/c). The ring kind lays each row out in zigzag order first (Brandon et al. 2023's
load balancing, as in Megatron-Core's context parallelism): the sequence is cut into 2c chunks and
shard i holds chunks i and 2c-1-i, so under the causal mask every device has the same amount of
visible work at every ring step. Tokens, labels and segment ids move together (a label stays with
its token), the loss is a sum over tokens, so the layout changes no number; the model computes the
global index of each local token (`local_index`) for RoPE and the mask.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from meshrun.parallel.sharding import CONTEXT, current_rules


def zigzag_index(length: int, c: int) -> np.ndarray:
    """int32 [length]: the global token index at each position of the zigzag layout (c shards of
    2 chunks each). `x[:, zigzag_index(L, c)]` lays a row out; `np.argsort` of it undoes that."""
    if length % (2 * c):
        raise ValueError(f"length {length} is not divisible by 2 x context ({2 * c})")
    chunk = length // (2 * c)
    order = [k for i in range(c) for k in (i, 2 * c - 1 - i)]
    return np.concatenate([np.arange(k * chunk, (k + 1) * chunk) for k in order]).astype(np.int32)


def lay_out(batch: tuple, c: int, zigzag: bool) -> tuple:
    """The [B, L] batch arrays (tokens, labels[, segment ids]) in the layout the context axis splits:
    unchanged unless `zigzag` with c > 1."""
    if c == 1 or not zigzag:
        return tuple(batch)
    idx = jnp.asarray(zigzag_index(batch[0].shape[1], c))
    return tuple(jnp.take(a, idx, axis=1) for a in batch)


def shard_index(j, c: int, local_len: int, zigzag: bool) -> jax.Array:
    """int32 [local_len]: the global indices of shard j's tokens (j may be traced): a contiguous
    shard, or the zigzag pair of chunks j and 2c-1-j."""
    if not zigzag:
        return j * local_len + jnp.arange(local_len, dtype=jnp.int32)
    half = jnp.arange(local_len // 2, dtype=jnp.int32)
    return jnp.concatenate([j * (local_len // 2) + half, (2 * c - 1 - j) * (local_len // 2) + half]).astype(jnp.int32)


def local_index(local_len: int, axis: str, zigzag: bool) -> jax.Array:
    """Inside a shard_map manual over `axis`: int32 [local_len], the global indices of this device's
    tokens (`shard_index` of this device)."""
    return shard_index(jax.lax.axis_index(axis), jax.lax.axis_size(axis), local_len, zigzag)


class SeqSplit(NamedTuple):
    """How the caller's shard_map splits each sequence: over `axis` (manual) in `c` shards, each
    holding the chunks `chunk_ids[i]` (global chunk order) of length/(c * chunks_per_shard) tokens."""

    axis: str
    c: int
    chunk_ids: np.ndarray  # int [c, chunks per shard]

    @property
    def n_chunks(self) -> int:
        return self.chunk_ids.size


def chunk_ids(c: int, zigzag: bool) -> np.ndarray:
    """[c, 1] (contiguous shards) or [c, 2] (zigzag: chunks i and 2c-1-i) global chunk indices."""
    if not zigzag:
        return np.arange(c)[:, None]
    return np.array([[i, 2 * c - 1 - i] for i in range(c)])


def sequence_split(zigzag: bool) -> SeqSplit | None:
    """The active split of the sequence over a live manual 'context' axis (`sharding.use_rules`),
    or None when every device holds whole sequences."""
    mesh, _, manual = current_rules()
    if mesh is None or CONTEXT not in manual or mesh.shape.get(CONTEXT, 1) == 1:
        return None
    c = int(mesh.shape[CONTEXT])
    return SeqSplit(CONTEXT, c, chunk_ids(c, zigzag))
