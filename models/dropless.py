"""Dropless MoE dispatch (`model.moe_dispatch=dropless`): every (token, choice) assignment is computed.

Tokens are sorted by expert and the local experts run as one grouped matmul (gmm.py: `ragged_dot`
on GPU/TPU, MegaBlocks-style, Gale et al. 2022; on XLA:CPU batched slots of 1.25 times an expert's
expected rows plus a tile loop for any rows past them); no capacity, no drops.

Expert parallelism over `axis` (ep devices, E/ep experts each): every device all-gathers its
group's tokens with their gates and expert ids (ep*T rows; XLA:CPU has no ragged all-to-all, and a
fixed all_to_all would move the worst case, ep*T*min(k, E/ep) rows), runs its own experts on the
assignments it finds there, grouped by expert (a sort), and one reduce-scatter brings each token its
gated sum. Every row move is a gather whose gradient is the gather by the inverse map
(`take_rows`): no scatter-add.

Shape letters as in layers.py; A = T*k assignments (ep*T*k gathered), R = ep*T*min(k, E/ep) grouped rows.
"""

from __future__ import annotations

import math
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

# CPU: batched slots per expert, as a multiple of its expected rows; rows past them run in the tile loop.
# The slots run whether filled or not: 1.25 (1.0 alike) cut the fine-grained bench's dropless step by
# 15% (data2 x expert4, d_model 512, 4096 tokens; 20% at d_model 128) against 2.0; 1.5 costs 3% more.
SLACK = 1.25


def grouped_ffn(p: Mapping[str, jax.Array], x_RxD: jax.Array, sizes_E: jax.Array, cfg: ModelConfig, f8=None, mean=1):
    """Expert FFNs on rows sorted by expert, sizes_E rows each (rows past their sum are padding, unused,
    zeros under expert parallelism). 'mlp' stays column/row-parallel over tensor, as in the dense MLP.
    `f8`: the block's fp8 state; the grouped matmuls run in fp8 under cfg.fp8 (`fp8.ragged_dot`).
    On CPU each expert's first SLACK * `mean` rows (`mean`: the expected rows per expert) run as one
    batched matmul, the rest, if any, in the tile loop (gmm.ffn)."""
    dt = dtype_of(cfg.dtype)
    sizes_E = sizes_E.astype(jnp.int32)
    cpu = cfg.fp8 == "none" and jax.default_backend() == "cpu"  # one fused tile loop: only the tiles the rows fill
    slots = math.ceil(SLACK * mean)
    if cpu and splits("mlp") == 1:
        # gate and up as two matmuls: no stacked weight copy, no interleaved output to split
        w_in, act_in = ((p["gate"], p["up"]), _silu_mul) if cfg.mlp == "swiglu" else ((p["up"],), jax.nn.gelu)
        return ffn(x_RxD, tuple(w.astype(dt) for w in w_in), p["down"].astype(dt), sizes_E, act_in, cap=slots)
    if cfg.mlp == "swiglu":
        # gate and up in one grouped matmul (one input-gradient all-reduce over tensor in backward, not
        # two): [E, D, F, 2] -> [E, D, 2F] keeps each tensor shard's F slice contiguous.
        e, d, f = p["up"].shape
        w_up = jnp.stack([p["gate"], p["up"]], axis=-1).reshape(e, d, 2 * f)
        act, spec = _swiglu, (None, "mlp", None)
    else:
        w_up, act, spec = p["up"], jax.nn.gelu, (None, "mlp")
    if cpu:
        return ffn(x_RxD, (w_up.astype(dt),), p["down"].astype(dt), sizes_E, act, cap=slots)
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

    h_TxD, gates_Txk = h_GxSxD.reshape(t, d), gates_GxSxk.reshape(t, k)
    if axis is not None:
        return _expert_parallel(p, h_TxD, top_i_GxSxk.reshape(t, k), gates_Txk, cfg, axis, f8).reshape(g, s, d), stats
    expert_A = top_i_GxSxk.reshape(t * k)  # token-major: assignment a is token a // k
    order_A = jnp.argsort(expert_A, stable=True)  # sorted position -> assignment
    where_A = jnp.zeros_like(order_A).at[order_A].set(jnp.arange(t * k, dtype=order_A.dtype))
    counts_E = jnp.sum(jax.nn.one_hot(expert_A, e, dtype=jnp.int32), axis=0)
    yes = lambda *shape: jnp.ones(shape, bool)
    x_AxD = take_rows(h_TxD, order_A // k, yes(t * k), where_A.reshape(t, k), yes(t, k))
    y_sorted = grouped_ffn(p, x_AxD, counts_E, cfg, f8, -(-t * k // e))
    y_TxkxD = take_rows(y_sorted, where_A, yes(t * k), order_A[:, None], yes(t * k, 1)).reshape(t, k, d)
    out_TxD = jnp.einsum("tkd,tk->td", y_TxkxD, gates_Txk.astype(y_TxkxD.dtype))
    return out_TxD.reshape(g, s, d), stats


def _gather_tokens(h_TxD: jax.Array, gates_Txk: jax.Array, top_i_Txk: jax.Array, axis: str):
    """The tokens of every device on `axis` with their gates and expert ids, as one float32 all-gather of
    [T, D + 2k] rows (the ids bit-cast, outside the gradient); its transpose, a reduce-scatter, returns
    the tokens' and the gates' gradients in one collective too. Returns [ep*T, D], [ep*T, k] x2."""
    d, k = h_TxD.shape[1], gates_Txk.shape[1]
    ids = jax.lax.stop_gradient(jax.lax.bitcast_convert_type(top_i_Txk.astype(jnp.int32), jnp.float32))
    packed = jnp.concatenate([h_TxD.astype(jnp.float32), gates_Txk.astype(jnp.float32), ids], axis=1)
    rows = jax.lax.all_gather(packed, axis, axis=0, tiled=True)
    ids_all = jax.lax.bitcast_convert_type(jax.lax.stop_gradient(rows[:, d + k :]), jnp.int32)
    return rows[:, :d].astype(h_TxD.dtype), rows[:, d : d + k], ids_all


def _expert_parallel(p, h_TxD, top_i_Txk, gates_Txk, cfg: ModelConfig, axis: str, f8=None) -> jax.Array:
    """Tokens -> their gated expert outputs summed [T, D], the experts spread over `axis`.

    All-gather, local select, reduce-scatter: every device gets its group's tokens once (ep*T rows,
    fewer than the worst-case all_to_all buffer of ep*T*min(k, E/ep) rows), runs its own experts'
    assignments among them, sorted by local expert, and the gated sums per token come home by one
    reduce-scatter. The received rows, R = ep*T*min(k, E/ep) at most, are grouped as a worst-case
    all_to_all would group them (by expert, then source and token order)."""
    t, d = h_TxD.shape
    k, ep = cfg.top_k, jax.lax.axis_size(axis)
    e_loc = cfg.n_experts // ep
    h_all, g_all, i_all = _gather_tokens(h_TxD, gates_Txk, top_i_Txk, axis)
    local = i_all - jax.lax.axis_index(axis) * e_loc
    mine = (local >= 0) & (local < e_loc)  # [ep*T, k]
    key_A = jnp.where(mine, local, e_loc).reshape(-1)  # other devices' assignments sort last
    a, r = key_A.shape[0], ep * t * min(k, e_loc)  # a token has at most min(k, E/ep) local choices
    order_A = jnp.argsort(key_A, stable=True)[:r]  # grouped row -> assignment
    where_A = jnp.zeros(a, jnp.int32).at[order_A].set(jnp.arange(r, dtype=jnp.int32), mode="drop")
    sizes = jnp.sum(jax.nn.one_hot(key_A, e_loc, dtype=jnp.int32), axis=0)
    ok_R = jnp.arange(r) < jnp.sum(sizes)
    x_RxD = take_rows(h_all, order_A // k, ok_R, where_A.reshape(-1, k), mine)
    y_RxD = grouped_ffn(p, x_RxD, sizes, cfg, f8, -(-t * k // e_loc))
    y_AxD = take_rows(y_RxD, where_A, mine.reshape(-1), order_A[:, None], ok_R[:, None])
    w_Txk = jnp.where(mine, g_all, 0.0).astype(y_AxD.dtype)
    out = jnp.einsum("tkd,tk->td", y_AxD.reshape(-1, k, d), w_Txk)
    return jax.lax.psum_scatter(out, axis, scatter_dimension=0, tiled=True)
