"""Dropless MoE dispatch (`model.moe_dispatch=dropless`): every (token, choice) assignment is computed.

Tokens are sorted by expert and the local experts run as one grouped matmul (gmm.py: `ragged_dot`
on GPU/TPU, MegaBlocks-style, Gale et al. 2022; on XLA:CPU batched slots of twice an expert's
expected rows plus a tile loop for any rows past them); no capacity, no drops.

Expert parallelism over `axis` (ep devices, E/ep experts each): the per-destination row counts are
exchanged first, then the rows travel in a fixed-size all_to_all sized to the worst case,
M = T * min(k, E/ep) rows per destination (XLA:CPU has no ragged all-to-all). The receiver groups
the rows by local expert (positions computed from the counts, no sort), runs the grouped matmul
and sends the results back the same way. Every row
move is a gather whose gradient is the gather by the inverse map (`take_rows`): no scatter-add.

Shape letters as in layers.py; A = T*k assignments, M rows per destination, R = ep*M received rows.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from meshrun_models.gmm import ffn, take_rows
from meshrun_models.layers import dtype_of, fp8_slot
from meshrun_models.router import router_stats, top_k_gates

from meshrun.config import ModelConfig
from meshrun.parallel import fp8
from meshrun.parallel.context import sequence_split
from meshrun.parallel.sharding import constrain, splits

SLACK = 2  # CPU: batched slots per expert, as a multiple of its expected rows; rows past them run in a loop


def grouped_ffn(p: Mapping[str, jax.Array], x_RxD: jax.Array, sizes_E: jax.Array, cfg: ModelConfig, f8=None, mean=1):
    """Expert FFNs on rows sorted by expert, sizes_E rows each (rows past their sum are padding, unused,
    zeros under expert parallelism). 'mlp' stays column/row-parallel over tensor, as in the dense MLP.
    `f8`: the block's fp8 state; the grouped matmuls run in fp8 under cfg.fp8 (`fp8.ragged_dot`).
    On CPU each expert's first SLACK * `mean` rows (`mean`: the expected rows per expert) run as one
    batched matmul, the rest, if any, in the tile loop (gmm.ffn)."""
    dt = dtype_of(cfg.dtype)
    sizes_E = sizes_E.astype(jnp.int32)
    cpu = cfg.fp8 == "none" and jax.default_backend() == "cpu"  # one fused tile loop: only the tiles the rows fill
    if cpu and splits("mlp") == 1:
        # gate and up as two matmuls: no stacked weight copy, no interleaved output to split
        w_in, act_in = ((p["gate"], p["up"]), _silu_mul) if cfg.mlp == "swiglu" else ((p["up"],), jax.nn.gelu)
        return ffn(x_RxD, tuple(w.astype(dt) for w in w_in), p["down"].astype(dt), sizes_E, act_in, cap=SLACK * mean)
    if cfg.mlp == "swiglu":
        # gate and up in one grouped matmul (one input-gradient all-reduce over tensor in backward, not
        # two): [E, D, F, 2] -> [E, D, 2F] keeps each tensor shard's F slice contiguous.
        e, d, f = p["up"].shape
        w_up = jnp.stack([p["gate"], p["up"]], axis=-1).reshape(e, d, 2 * f)
        act, spec = _swiglu, (None, "mlp", None)
    else:
        w_up, act, spec = p["up"], jax.nn.gelu, (None, "mlp")
    if cpu:
        return ffn(x_RxD, (w_up.astype(dt),), p["down"].astype(dt), sizes_E, act, cap=SLACK * mean)
    if cfg.fp8 != "none":  # the grouped matmuls in fp8

        def mm(x, w, slot):
            pairs = 2 if slot == "expert_in" and cfg.mlp == "swiglu" else 1  # blockwise: gate and up apart
            i = fp8_slot(cfg, slot)
            return fp8.ragged_dot(x, w, sizes_E, cfg.fp8, f8, i, block=cfg.fp8_block, interleaved=pairs)

    else:

        def mm(x, w, slot):
            return jax.lax.ragged_dot(x, w.astype(dt), sizes_E)

    h = mm(x_RxD, w_up, "expert_in")
    a_RxF = act(constrain(h.reshape(-1, f, 2), spec).reshape(h.shape) if cfg.mlp == "swiglu" else constrain(h, spec))
    return mm(a_RxF, p["down"], "expert_out")


def _silu_mul(g: jax.Array, u: jax.Array) -> jax.Array:
    return jax.nn.silu(g) * u


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
    where_A = jnp.zeros_like(order_A).at[order_A].set(jnp.arange(t * k, dtype=order_A.dtype))
    counts_E = jnp.sum(jax.nn.one_hot(expert_A, e, dtype=jnp.int32), axis=0)
    h_TxD, yes = h_GxSxD.reshape(t, d), lambda *shape: jnp.ones(shape, bool)
    if axis is None:
        x_AxD = take_rows(h_TxD, order_A // k, yes(t * k), where_A.reshape(t, k), yes(t, k))
        y_sorted = grouped_ffn(p, x_AxD, counts_E, cfg, f8, -(-t * k // e))
        y_AxD = take_rows(y_sorted, where_A, yes(t * k), order_A[:, None], yes(t * k, 1))
    else:
        y_AxD = _expert_parallel(p, h_TxD, order_A, where_A, counts_E, cfg, axis, f8)
    y_TxkxD = y_AxD.reshape(t, k, d)
    out_TxD = jnp.einsum("tkd,tk->td", y_TxkxD, gates_GxSxk.reshape(t, k).astype(y_TxkxD.dtype))
    return out_TxD.reshape(g, s, d), stats


def _send_slots(order_A, where_A, counts_E, ep: int, m: int):
    """Sender side: send-buffer slot -> assignment (and whether it holds one), assignment -> slot.
    Destination j's rows (contiguous in expert order) sit at the front of its block of m slots."""
    a = order_A.shape[0]
    per_dev_J = counts_E.reshape(ep, -1).sum(axis=1)
    start_J = jnp.cumsum(per_dev_J) - per_dev_J
    ok_JxM = jnp.arange(m)[None, :] < per_dev_J[:, None]
    asg_JxM = order_A[jnp.minimum(start_J[:, None] + jnp.arange(m)[None, :], a - 1)]
    dest_A = jnp.sum(where_A[:, None] >= jnp.cumsum(per_dev_J)[None, :], axis=1)
    slot_A = dest_A * m + where_A - start_J[dest_A]
    return asg_JxM.reshape(ep * m), ok_JxM.reshape(ep * m), slot_A


def _group_rows(n_IxJ, m: int):
    """Receiver side, n[i, j] rows from source i for local expert j, source i's rows at the front of
    its block of m, by expert: grouped row q (by expert, then source) -> received row, and back."""
    ep, e_loc = n_IxJ.shape
    blk_off = jnp.cumsum(n_IxJ, axis=1) - n_IxJ  # expert j's first row in source i's block
    src_end = jnp.cumsum(n_IxJ, axis=0)
    src_off = src_end - n_IxJ  # source i's first row among expert j's
    exp_end = src_end[-1].cumsum()
    exp_start = exp_end - src_end[-1]
    q = jnp.arange(ep * m)
    j_q = jnp.minimum(jnp.sum(q[:, None] >= exp_end[None, :], axis=1), e_loc - 1)
    o_q = q - exp_start[j_q]
    i_q = jnp.minimum(jnp.sum(o_q[:, None] >= src_end[:, j_q].T, axis=1), ep - 1)
    row_q = i_q * m + blk_off[i_q, j_q] + o_q - src_off[i_q, j_q]
    r_IxM = jnp.arange(m)[None, :]
    j_r = jnp.minimum(jnp.sum(r_IxM[..., None] >= jnp.cumsum(n_IxJ, axis=1)[:, None, :], axis=-1), e_loc - 1)
    i_r = jnp.arange(ep)[:, None]
    pos_r = exp_start[j_r] + src_off[i_r, j_r] + r_IxM - blk_off[i_r, j_r]
    ok_r = r_IxM < n_IxJ.sum(axis=1)[:, None]
    return row_q, q < exp_end[-1], pos_r.reshape(ep * m), ok_r.reshape(ep * m)


def _expert_parallel(p, h_TxD, order_A, where_A, counts_E, cfg: ModelConfig, axis: str, f8=None) -> jax.Array:
    """Tokens -> their assignments' expert outputs [A, D] (token-major), the experts spread over `axis`."""
    t, d = h_TxD.shape
    a, ep = order_A.shape[0], jax.lax.axis_size(axis)
    e_loc = cfg.n_experts // ep
    m = t * min(cfg.top_k, e_loc)  # worst case rows for one destination
    asg_S, ok_S, slot_A = _send_slots(order_A, where_A, counts_E, ep, m)
    yes = lambda *shape: jnp.ones(shape, bool)
    send = take_rows(h_TxD, asg_S // cfg.top_k, ok_S, slot_A.reshape(t, -1), yes(t, a // t))
    # Counts first: n[i, j] = rows device i sends for my local expert j.
    n_IxJ = jax.lax.all_to_all(counts_E.reshape(ep, e_loc), axis, 0, 0, tiled=True)
    recv = jax.lax.all_to_all(send.reshape(ep, m, d), axis, 0, 0, tiled=True).reshape(ep * m, d)
    row_q, ok_q, pos_r, ok_r = _group_rows(n_IxJ, m)
    x_grouped = take_rows(recv, row_q, ok_q, pos_r[:, None], ok_r[:, None])
    y_grouped = grouped_ffn(p, x_grouped, n_IxJ.sum(axis=0), cfg, f8, -(-a // e_loc))
    y_recv = take_rows(y_grouped, pos_r, ok_r, row_q[:, None], ok_q[:, None])
    y = jax.lax.all_to_all(y_recv.reshape(ep, m, d), axis, 0, 0, tiled=True).reshape(ep * m, d)
    return take_rows(y, slot_A, yes(a), asg_S[:, None], ok_S[:, None])
