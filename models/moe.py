"""Mixture-of-experts FFN: top-k router, capacity with token dropping, expert parallelism by all-to-all.

`model.moe_dispatch`: `capacity` (this module) or `dropless` (dropless.py: nothing dropped); both run
under the same shard_map and report the same stats.

Routing groups are sequences (GShard's groups), so capacity, drops and the auxiliary losses do not
depend on the mesh or the microbatch split. Per group and expert the buffer holds
C = ceil(capacity_factor * S * top_k / E) tokens, filled in GShard priority; assignments past C drop.
Expert parallelism (GShard): inside a shard_map manual over ('data', 'expert'), `all_to_all` over
'expert' sends each expert's buffer to its device and a second one brings results home; expert
weights never move. Statistics per layer, summed over groups: `moe_aux_loss` (Switch load
balancing, 1.0 per group when balanced), `moe_z_loss` (ST-MoE router z-loss), `dropped_tokens`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from meshrun_models.dropless import dropless_local
from meshrun_models.gmm import take_rows
from meshrun_models.layers import Lead, dtype_of, fp8_slot, normal_param
from meshrun_models.router import router_stats, top_k_gates

from meshrun.config import ModelConfig
from meshrun.parallel import fp8
from meshrun.parallel.context import sequence_split
from meshrun.parallel.layer_fetch import to_device
from meshrun.parallel.sharding import constrain, current_rules, splits, use_rules

STATS = ("moe_aux_loss", "moe_z_loss", "dropped_tokens", "moe_balance")
BALANCE = "balance"  # an MoE layer's balance=bias state: {'bias' [E], 'load' [E]} (float32, not trained)
MOE_AXES = ("data", "expert")  # manual in the MoE shard_map: tokens are routed where they live


class Balance(nnx.Module):
    """balance=bias state, float32 whatever the param dtype and drawn from no random numbers: 'bias'
    (added to the scores for the choice) and 'load' (zeros; its gradient is the step's expert loads).
    Neither is trained: `update_balance` sets both after each step and zeroes their gradients."""

    def __init__(self, cfg: ModelConfig, lead: Lead):
        shape, names = tuple(s for s, _ in lead), tuple(n for _, n in lead)
        self.bias = nnx.Param(jnp.zeros((*shape, cfg.n_experts), jnp.float32), out_sharding=(*names, None))
        self.load = nnx.Param(jnp.zeros((*shape, cfg.n_experts), jnp.float32), out_sharding=(*names, None))


class MoE(nnx.Module):
    """Router and the E routed experts (width expert_d_ff); the shared experts are a dense MLP beside
    it (transformer.Block)."""

    def __init__(self, cfg: ModelConfig, lead: Lead, *, rngs: nnx.Rngs):
        d, f, e = cfg.d_model, cfg.expert_d_ff, cfg.n_experts
        self.router = normal_param(rngs.params(), (d, e), ("embed", None), lead, cfg)
        if cfg.mlp == "swiglu":
            self.gate = normal_param(rngs.params(), (e, d, f), ("expert", "embed", "mlp"), lead, cfg)
        self.up = normal_param(rngs.params(), (e, d, f), ("expert", "embed", "mlp"), lead, cfg)
        self.down = normal_param(rngs.params(), (e, f, d), ("expert", "mlp", "embed"), lead, cfg)
        if cfg.balance == "bias":
            self.balance = Balance(cfg, lead)


def update_balance(params, grads, rate: float):
    """After the step's gradient reduction: every MoE layer's bias moves by `rate` towards balance,
    bias += rate * sign(mean load - load) (DeepSeek-V3's update; the loads are the 'load' gradients:
    the step's assignment counts over all tokens; 'load' itself stays 0) and both gradients are zeroed,
    so clipping, the logged norm and the optimizer never see them. Returns (params, grads)."""
    if not isinstance(params, Mapping):
        return params, grads
    new_p, new_g = dict(params), dict(grads)
    for key, sub in params.items():
        if key == BALANCE and isinstance(sub, Mapping) and "bias" in sub:
            load = to_device(grads[key]["load"]).astype(jnp.float32)  # offload.params: in host memory
            step = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
            bias = to_device(sub["bias"])
            new_p[key] = {**sub, "bias": bias + step.astype(bias.dtype)}  # 'load' stays zero: its gradient counts
            new_g[key] = jax.tree.map(jnp.zeros_like, grads[key])
        else:
            new_p[key], new_g[key] = update_balance(sub, grads[key], rate)
    return new_p, new_g


def keep_balance(params, src):
    """`params` with every balance subtree taken from `src` (the optimizer's update of it discarded)."""
    if not isinstance(params, Mapping):
        return params
    return {k: src[k] if k == BALANCE else keep_balance(v, src[k]) for k, v in params.items()}


def capacity(cfg: ModelConfig, tokens_per_group: int) -> int:
    """Expert buffer slots per group: ceil(capacity_factor * S * k / E) (at least 1)."""
    return max(1, math.ceil(cfg.capacity_factor * tokens_per_group * cfg.top_k / cfg.n_experts))


def queue_positions(choice_GxSxkxE: jax.Array, split=None) -> jax.Array:
    """Each (token, choice)'s place in its expert's queue over the whole group, GShard priority: every
    first choice before any second choice, then sequence order. [G, S, k] float32.

    `split` (a sequence split over the context axis): the local tokens are chunks of the sequence;
    the per-chunk counts of all shards (G*k*E numbers per chunk) are all-gathered, so a token's
    place counts the choices of the tokens before it on other shards too."""
    g, s, k, e = choice_GxSxkxE.shape
    n = 1 if split is None else split.chunk_ids.shape[1]  # chunks on this shard
    c_GxNxTxkxE = choice_GxSxkxE.reshape(g, n, s // n, k, e)
    # same choice rank, same expert, earlier in chunk: an exclusive prefix sum as one matmul by a strictly
    # lower-triangular matrix (exact: sums of 0/1; XLA:CPU runs cumsum as an O(S^2) reduce-window)
    earlier_TxT = (jnp.arange(s // n)[None, :] < jnp.arange(s // n)[:, None]).astype(jnp.float32)
    within = jnp.einsum("ut,gntke->gnuke", earlier_TxT, c_GxNxTxkxE)
    counts_GxNxkxE = jnp.sum(c_GxNxTxkxE, axis=2)
    if split is None:
        all_GxQxkxE, mine_N = counts_GxNxkxE, jnp.arange(n)
    else:  # [c, G, n, k, E] -> chunks in sequence order
        gathered = jax.lax.all_gather(counts_GxNxkxE, split.axis)
        by_chunk = gathered.transpose(1, 0, 2, 3, 4).reshape(g, split.n_chunks, k, e)
        all_GxQxkxE = by_chunk[:, np.argsort(split.chunk_ids.reshape(-1))]
        mine_N = jnp.asarray(split.chunk_ids)[jax.lax.axis_index(split.axis)]
    before_chunk = jnp.cumsum(all_GxQxkxE, axis=1) - all_GxQxkxE  # same choice, earlier chunks
    total_GxkxE = jnp.sum(all_GxQxkxE, axis=1)
    before_choice = jnp.cumsum(total_GxkxE, axis=1) - total_GxkxE  # every lower-rank choice
    offset_GxNxkxE = before_choice[:, None] + jnp.take(before_chunk, mine_N, axis=1)
    pos = (within + offset_GxNxkxE[:, :, None]).reshape(g, s, k, e)
    return jnp.sum(pos * choice_GxSxkxE, axis=-1)


def route(logits_GxSxE: jax.Array, cfg: ModelConfig, cap: int, split=None, bal=None):
    """Top-k routing with capacity. Returns the choices [G,S,k], their gates (float32), their slots in
    the expert's buffer of C, whether they are kept, and the stats. A sequence split over the context
    axis (`split`) routes as the whole sequence would: places in the queue are global; a kept token's
    slot in this shard's buffer is its rank among this shard's kept tokens (at most C of them), so the
    experts see the same rows."""
    g, s, e = logits_GxSxE.shape
    k = cfg.top_k
    probs_GxSxE, top_i_GxSxk, gates_GxSxk = top_k_gates(logits_GxSxE, cfg, None if bal is None else bal["bias"])
    choice_GxSxkxE = jax.nn.one_hot(top_i_GxSxk, e, dtype=jnp.float32)
    pos_GxSxk = queue_positions(choice_GxSxkxE, split)
    keep_GxSxk = pos_GxSxk < cap
    if split is not None:  # local slots: kept assignments, choice-major
        kept_GxkSxE = (choice_GxSxkxE * keep_GxSxk[..., None]).transpose(0, 2, 1, 3).reshape(g, k * s, e)
        slot_GxkSxE = jnp.cumsum(kept_GxkSxE, axis=1) - 1.0
        pos_GxSxk = jnp.sum(slot_GxkSxE.reshape(g, k, s, e).transpose(0, 2, 1, 3) * choice_GxSxkxE, axis=-1)
    stats = router_stats(
        logits_GxSxE, probs_GxSxE, top_i_GxSxk, jnp.sum(1.0 - keep_GxSxk.astype(jnp.float32)), split, bal
    )
    return top_i_GxSxk, gates_GxSxk, pos_GxSxk.astype(jnp.int32), keep_GxSxk, stats


def slots(top_i_GxSxk, pos_GxSxk, keep_GxSxk, n_experts: int, cap: int):
    """Buffer [E, G, C] slot of each (token, choice) (clipped where dropped) and, per slot, the
    assignment (g, s, choice) it holds and whether it holds one: the dispatch and the combine are
    row gathers (`take_rows`), not one-hot einsums over tokens x experts x capacity x d_model."""
    g, s, k = top_i_GxSxk.shape
    group_G = jnp.arange(g)[:, None, None]
    slot_GxSxk = jnp.where(keep_GxSxk, (top_i_GxSxk * g + group_G) * cap + pos_GxSxk, n_experts * g * cap)
    asg_A = jnp.arange(g * s * k, dtype=jnp.int32)
    owner = jnp.full(n_experts * g * cap, -1, jnp.int32).at[slot_GxSxk.reshape(-1)].set(asg_A, mode="drop")
    slot_A = jnp.minimum(slot_GxSxk.reshape(-1), n_experts * g * cap - 1)
    return slot_A, owner, keep_GxSxk.reshape(-1)


def experts(p: Mapping[str, jax.Array], x_ExGxCxD: jax.Array, cfg: ModelConfig, f8=None) -> jax.Array:
    """Each expert's FFN on its buffers (G groups of C slots); 'mlp' column/row-parallel over tensor as
    in the dense MLP. Without fp8 and with 'mlp' whole, the slots are one row axis and gate and up two
    einsums: [E, rows, D] batched matmuls whose weight gradients contract one axis (on XLA:CPU 1.4x less
    time than a gate/up stacked over [E, D, 2, F] on [E, G, C, D], whose output slices and weight stack
    cost copies). With 'mlp' split, gate and up stay one stacked GEMM: one input-gradient all-reduce
    over tensor in the backward, not two."""
    if cfg.fp8 != "none" or splits("mlp") > 1:
        return _experts_stacked(p, x_ExGxCxD, cfg, f8)
    e, g, c, d = x_ExGxCxD.shape
    dt = dtype_of(cfg.dtype)
    x_ExRxD = x_ExGxCxD.reshape(e, g * c, d)
    up = lambda w: constrain(jnp.einsum("erd,edf->erf", x_ExRxD, w.astype(dt)), ("expert", None, "mlp"))
    if cfg.mlp == "swiglu":
        a_ExRxF = jax.nn.silu(up(p["gate"])) * up(p["up"])
    else:
        a_ExRxF = jax.nn.gelu(up(p["up"]))
    return jnp.einsum("erf,efd->erd", a_ExRxF, p["down"].astype(dt)).reshape(e, g, c, d)


def _experts_stacked(p: Mapping[str, jax.Array], x_ExGxCxD: jax.Array, cfg: ModelConfig, f8) -> jax.Array:
    """`experts` with gate and up stacked into one GEMM; under cfg.fp8 (`f8`: the block's fp8 state) one
    tensorwise scale for all the experts' weights of a GEMM (reduced over 'expert', which splits them);
    blockwise's token tiles lie inside a group's slots, whatever the layout."""
    dt = dtype_of(cfg.dtype)
    w = (lambda w: w) if cfg.fp8 != "none" else (lambda w: w.astype(dt))
    gemm = lambda spec, x, w, slot: fp8.einsum(
        spec, x, w, cfg.fp8, f8, fp8_slot(cfg, slot), split_w=True, block=cfg.fp8_block
    )
    if cfg.mlp == "swiglu":
        w_ExDx2xF = w(jnp.stack([p["gate"], p["up"]], axis=2))
        gu = constrain(gemm("egcd,edtf->egctf", x_ExGxCxD, w_ExDx2xF, "expert_in"), ("expert", None, None, None, "mlp"))
        a_ExGxCxF = jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :]
    else:
        u = constrain(gemm("egcd,edf->egcf", x_ExGxCxD, w(p["up"]), "expert_in"), ("expert", None, None, "mlp"))
        a_ExGxCxF = jax.nn.gelu(u)
    return gemm("egcf,efd->egcd", a_ExGxCxF, w(p["down"]), "expert_out")


def moe_local(p: Mapping[str, jax.Array], h_GxSxD: jax.Array, cfg: ModelConfig, axis: str | None, f8=None):
    """Route local groups, exchange tokens over `axis` (None: no communication), run the local experts."""
    if cfg.moe_dispatch == "dropless":
        return dropless_local(p, h_GxSxD, cfg, axis, f8)
    return capacity_local(p, h_GxSxD, cfg, axis, f8)


def capacity_local(p: Mapping[str, jax.Array], h_GxSxD: jax.Array, cfg: ModelConfig, axis: str | None, f8=None):
    """Capacity routing: dispatch to [E, G, C, D] buffers, all_to_all over `axis`, experts, combine."""
    g, s, d = h_GxSxD.shape
    e, k = cfg.n_experts, cfg.top_k
    split = sequence_split(cfg.context_parallel == "ring")  # a sequence split over 'context': route it whole
    cap = capacity(cfg, s * (1 if split is None else split.c))
    logits = jnp.einsum("gsd,de->gse", h_GxSxD.astype(jnp.float32), p["router"].astype(jnp.float32))
    top_i, gates_GxSxk, pos, keep, stats = route(logits, cfg, cap, split, p.get(BALANCE))
    slot_A, owner, keep_A = slots(top_i, pos, keep, e, cap)
    inv = (slot_A.reshape(g * s, k), keep_A.reshape(g * s, k))  # a token's k slots: the dispatch's gradient
    x = take_rows(h_GxSxD.reshape(g * s, d), jnp.maximum(owner, 0) // k, owner >= 0, *inv)
    x_ExGxCxD = x.reshape(e, g, cap, d)
    if axis is not None:  # [E, G, C, D] -> [E/ep, G*ep, C, D]: buffers go to their expert's device
        x_ExGxCxD = jax.lax.all_to_all(x_ExGxCxD, axis, split_axis=0, concat_axis=1, tiled=True)
    y = experts(p, x_ExGxCxD, cfg, f8)
    if axis is not None:  # and back: [E/ep, G*ep, C, D] -> [E, G, C, D]
        y = jax.lax.all_to_all(y, axis, split_axis=1, concat_axis=0, tiled=True)
    y_AxD = take_rows(y.reshape(e * g * cap, d), slot_A, keep_A, jnp.maximum(owner, 0)[:, None], (owner >= 0)[:, None])
    w_GxSxk = jnp.where(keep, gates_GxSxk, 0.0).astype(y.dtype)
    out_GxSxD = jnp.einsum("gskd,gsk->gsd", y_AxD.reshape(g, s, k, d), w_GxSxk)
    return out_GxSxD, stats


def moe_ffn(p: Mapping[str, jax.Array], h_BxLxD: jax.Array, cfg: ModelConfig, f8=None):
    """MoE FFN on normed, full-length input. Returns (out_BxLxD, stats summed over this call's groups).
    `f8`: the block's fp8 state (`layers.fp8_state`), replicated into the shard_map.

    Inside a caller's shard_map with 'expert' manual, stats are the local shard's sums (reduce them
    like the loss sum); otherwise they are global sums.
    """
    mesh, rules, manual = current_rules()
    if mesh is None or mesh.size == 1:
        return moe_local(p, h_BxLxD, cfg, None, f8)
    ep_axis = "expert" if mesh.shape.get("expert", 1) > 1 else None
    if "expert" in manual:
        return moe_local(p, h_BxLxD, cfg, ep_axis, f8)
    new = tuple(a for a in MOE_AXES if mesh.shape.get(a, 1) > 1 and a not in manual)
    if not new:  # nothing sharded that is not already local
        return moe_local(p, h_BxLxD, cfg, None, f8)
    if ep_axis and any(a in manual for a in rules.get("batch", ())):
        # A nested shard_map manual over 'expert' under a caller manual over 'data' lowers in forward
        # but its backward fails in Shardy (manual axis 'expert' after free axis 'data' in one dimension).
        raise ValueError(
            f"MoE with expert parallelism inside a shard_map manual over {sorted(manual)}: make 'expert' "
            "manual in that shard_map too (then the MoE runs its all_to_all directly)"
        )
    batch_axes = tuple(a for a in rules.get("batch", ()) if a in new)
    expert_spec = P("expert") if "expert" in new else P()
    w_specs = {k: (jax.tree.map(lambda _: P(), p[k]) if k in ("router", BALANCE) else expert_spec) for k in p}

    def body(p_local, h_local, f8_local):
        with use_rules(mesh, rules, manual=tuple(manual) + new):
            out, stats = moe_local(p_local, h_local, cfg, ep_axis, f8_local)
        if batch_axes:
            stats = jax.lax.psum(stats, batch_axes)
        return out, stats

    fn = jax.shard_map(
        body,
        mesh=None if manual else mesh,
        in_specs=(w_specs, P(batch_axes), jax.tree.map(lambda _: P(), f8)),
        out_specs=(P(batch_axes), {k: P() for k in STATS}),
        axis_names=set(new),
    )
    return fn(dict(p), h_BxLxD, f8)
