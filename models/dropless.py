"""Dropless MoE dispatch (`model.moe_dispatch=dropless`): every (token, choice) assignment is computed.

Tokens are sorted by expert and the local experts run as one grouped matmul (gmm.py: `ragged_dot`
on GPU/TPU, MegaBlocks-style, Gale et al. 2022; on XLA:CPU a loop over the tiles the rows fill);
no capacity, no drops.

Expert parallelism over `axis` (ep devices, E/ep experts each): the per-destination row counts are
exchanged first, then the rows travel in a fixed-size all_to_all sized to the worst case,
M = T * min(k, E/ep) rows per destination (XLA:CPU has no ragged all-to-all). The receiver sorts
the R = ep*M rows by local expert (the padding last), runs the grouped matmul, which on CPU computes
the filled tiles only, and sends the results back the same way.

Shape letters as in layers.py; A = T*k assignments, M rows per destination, R = ep*M received rows.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from meshrun_models.gmm import ffn
from meshrun_models.layers import dtype_of, fp8_slot
from meshrun_models.router import router_stats, top_k_gates

from meshrun.config import ModelConfig
from meshrun.parallel import fp8
from meshrun.parallel.context import sequence_split
from meshrun.parallel.sharding import constrain


def grouped_ffn(p: Mapping[str, jax.Array], x_RxD: jax.Array, sizes_E: jax.Array, cfg: ModelConfig, f8=None):
    """Expert FFNs on rows sorted by expert, sizes_E rows each (rows past their sum are padding, unused,
    zeros under expert parallelism). 'mlp' stays column/row-parallel over tensor, as in the dense MLP.
    `f8`: the block's fp8 state; the grouped matmuls run in fp8 under cfg.fp8 (`fp8.ragged_dot`)."""
    dt = dtype_of(cfg.dtype)
    sizes_E = sizes_E.astype(jnp.int32)
    if cfg.mlp == "swiglu":
        # gate and up in one grouped matmul (one input-gradient all-reduce over tensor in backward, not
        # two): [E, D, F, 2] -> [E, D, 2F] keeps each tensor shard's F slice contiguous.
        e, d, f = p["up"].shape
        w_up = jnp.stack([p["gate"], p["up"]], axis=-1).reshape(e, d, 2 * f)
        act, spec = _swiglu, (None, "mlp", None)
    else:
        w_up, act, spec = p["up"], jax.nn.gelu, (None, "mlp")
    if cfg.fp8 != "none":  # the grouped matmuls in fp8

        def mm(x, w, slot):
            return fp8.ragged_dot(x, w, sizes_E, cfg.fp8, f8, fp8_slot(cfg, slot))

    elif jax.default_backend() == "cpu":  # one fused tile loop: only the tiles the rows fill
        return ffn(x_RxD, w_up.astype(dt), p["down"].astype(dt), sizes_E, act)
    else:

        def mm(x, w, slot):
            return jax.lax.ragged_dot(x, w.astype(dt), sizes_E)

    h = mm(x_RxD, w_up, "expert_in")
    a_RxF = act(constrain(h.reshape(-1, f, 2), spec).reshape(h.shape) if cfg.mlp == "swiglu" else constrain(h, spec))
    return mm(a_RxF, p["down"], "expert_out")


def _swiglu(gu: jax.Array) -> jax.Array:
    """silu(gate) * up of gate/up interleaved along the last axis ([..., 2F] = [..., F, 2])."""
    g = gu.reshape(*gu.shape[:-1], -1, 2)
    return jax.nn.silu(g[..., 0]) * g[..., 1]


def dropless_local(p: Mapping[str, jax.Array], h_GxSxD: jax.Array, cfg: ModelConfig, axis: str | None, f8=None):
    """Route local groups with no capacity; experts local (axis None) or spread over mesh axis `axis`."""
    g, s, d = h_GxSxD.shape
    e, k, t = cfg.n_experts, cfg.top_k, g * s
    logits = jnp.einsum("gsd,de->gse", h_GxSxD.astype(jnp.float32), p["router"].astype(jnp.float32))
    bal = p.get("balance")  # model.balance=bias: {'bias', 'load'}
    probs, top_i_GxSxk, gates_GxSxk = top_k_gates(logits, cfg, None if bal is None else bal["bias"])
    split = sequence_split(cfg.context_parallel == "ring")  # statistics of the whole sequence
    stats = router_stats(logits, probs, top_i_GxSxk, jnp.zeros((), jnp.float32), split, bal)

    expert_A = top_i_GxSxk.reshape(t * k)  # token-major: assignment a is token a // k
    order_A = jnp.argsort(expert_A, stable=True)  # sorted position -> assignment
    counts_E = jnp.sum(jax.nn.one_hot(expert_A, e, dtype=jnp.int32), axis=0)
    x_AxD = h_GxSxD.reshape(t, d)[order_A // k]
    if axis is None:
        y_AxD = grouped_ffn(p, x_AxD, counts_E, cfg, f8)
    else:
        y_AxD = _expert_parallel(p, x_AxD, counts_E, cfg, axis, f8)
    where_A = jnp.zeros_like(order_A).at[order_A].set(jnp.arange(t * k, dtype=order_A.dtype))
    y_TxkxD = y_AxD[where_A].reshape(t, k, d)
    out_TxD = jnp.einsum("tkd,tk->td", y_TxkxD, gates_GxSxk.reshape(t, k).astype(y_TxkxD.dtype))
    return out_TxD.reshape(g, s, d), stats


def _expert_parallel(p, x_AxD: jax.Array, counts_E: jax.Array, cfg: ModelConfig, axis: str, f8=None) -> jax.Array:
    """Rows sorted by (global) expert -> this device's rows through their experts, over `axis`."""
    a, d = x_AxD.shape
    ep = jax.lax.axis_size(axis)
    e_loc = cfg.n_experts // ep
    m = (a // cfg.top_k) * min(cfg.top_k, e_loc)  # worst case rows for one destination
    # Send buffer [ep, M, D]: destination j's rows (contiguous in expert order) at the front of block j.
    per_dev_J = counts_E.reshape(ep, e_loc).sum(axis=1)
    start_J = jnp.cumsum(per_dev_J) - per_dev_J
    src_JxM = start_J[:, None] + jnp.arange(m)[None, :]
    valid_JxM = jnp.arange(m)[None, :] < per_dev_J[:, None]
    send = jnp.where(valid_JxM[..., None], x_AxD[jnp.minimum(src_JxM, a - 1)], 0)
    # Counts first: recv_counts[i, j] = rows device i sends for my local expert j.
    recv_counts = jax.lax.all_to_all(counts_E.reshape(ep, e_loc), axis, 0, 0, tiled=True)
    recv = jax.lax.all_to_all(send, axis, 0, 0, tiled=True)  # [ep, M, D]: block i came from device i
    # Each source's block is sorted by local expert; regroup all R = ep*M rows by local expert
    # (padding rows get key e_loc and sort last, past the groups; their outputs are never read).
    ends_IxE = jnp.cumsum(recv_counts, axis=1)
    key_IxM = jnp.sum(jnp.arange(m)[None, :, None] >= ends_IxE[:, None, :], axis=-1)
    order_R = jnp.argsort(key_IxM.reshape(ep * m), stable=True)
    y_sorted = grouped_ffn(p, recv.reshape(ep * m, d)[order_R], recv_counts.sum(axis=0), cfg, f8)
    back_R = jnp.zeros_like(order_R).at[order_R].set(jnp.arange(ep * m, dtype=order_R.dtype))
    y = jax.lax.all_to_all(y_sorted[back_R].reshape(ep, m, d), axis, 0, 0, tiled=True)
    # Row r of the sorted input went to destination j = dest_A[r], slot r - start_J[j].
    dest_A = jnp.sum(jnp.arange(a)[:, None] >= jnp.cumsum(per_dev_J)[None, :], axis=1)
    return y.reshape(ep * m, d)[dest_A * m + jnp.arange(a) - start_J[dest_A]]
