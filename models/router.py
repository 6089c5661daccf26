"""Top-k router shared by both MoE dispatches: gates and the per-group load-balancing statistics.

Shape letters as in layers.py (G groups = sequences, S tokens per group, E experts, k = top_k).

Scores (`model.router_score`): softmax over the experts (Mixtral, Qwen3-MoE) or a sigmoid per expert
(DeepSeek-V3). The k experts are chosen on the scores plus, with `model.balance=bias`, the per-expert
balancing bias (for the choice only: the gates are the unbiased scores), and with `model.route_groups`
> 1 only among the experts of each token's `route_group_limit` best groups (a group's score: its
best score under softmax, the sum of its two best under sigmoid, as DeepSeek-V2/V3 rank them). The
gates are the chosen scores, renormalised to sum 1 (`router_norm_topk`, k > 1), times `routed_scaling`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshrun.config import ModelConfig


def _scores(logits_GxSxE: jax.Array, cfg: ModelConfig) -> jax.Array:
    x = logits_GxSxE.astype(jnp.float32)
    return jax.nn.sigmoid(x) if getattr(cfg, "router_score", "softmax") == "sigmoid" else jax.nn.softmax(x, axis=-1)


def _group_limited(choose_GxSxE: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Scores outside each token's route_group_limit best groups set to -inf."""
    g, m = cfg.route_groups, cfg.route_group_limit
    *lead, e = choose_GxSxE.shape
    by_group = choose_GxSxE.reshape(*lead, g, e // g)
    if cfg.router_score == "sigmoid":
        group_score = jnp.sum(jax.lax.top_k(by_group, min(2, e // g))[0], axis=-1)
    else:
        group_score = jnp.max(by_group, axis=-1)
    _, best = jax.lax.top_k(group_score, m)
    allowed = jnp.sum(jax.nn.one_hot(best, g, dtype=jnp.float32), axis=-2) > 0  # [..., g]
    return jnp.where(allowed[..., None], by_group, -jnp.inf).reshape(choose_GxSxE.shape)


def top_k_gates(logits_GxSxE: jax.Array, cfg: ModelConfig, bias_E: jax.Array | None = None):
    """float32 probabilities for the balancing loss (softmax scores, or sigmoid scores normalised to sum
    1 per token), the top-k expert ids and their gates. `bias_E`: added to the scores for the choice."""
    scores_GxSxE = _scores(logits_GxSxE, cfg)
    choose = scores_GxSxE if bias_E is None else scores_GxSxE + jax.lax.stop_gradient(bias_E.astype(jnp.float32))
    if getattr(cfg, "route_groups", 0) > 1:
        choose = _group_limited(choose, cfg)
    top_i_GxSxk = jax.lax.top_k(choose, cfg.top_k)[1]
    top_p_GxSxk = jnp.take_along_axis(scores_GxSxE, top_i_GxSxk, axis=-1)
    if cfg.top_k > 1 and getattr(cfg, "router_norm_topk", True):
        top_p_GxSxk = top_p_GxSxk / jnp.sum(top_p_GxSxk, -1, keepdims=True)
    scaling = getattr(cfg, "routed_scaling", 1.0)
    if scaling != 1.0:
        top_p_GxSxk = top_p_GxSxk * scaling
    if getattr(cfg, "router_score", "softmax") == "sigmoid":
        scores_GxSxE = scores_GxSxE / jnp.sum(scores_GxSxE, -1, keepdims=True)
    return scores_GxSxE, top_i_GxSxk, top_p_GxSxk


def expert_load(top_i_GxSxk: jax.Array, n_experts: int) -> jax.Array:
    """Assignments per expert [E] (float32) among these tokens: what balance=bias moves the bias by."""
    return jnp.sum(jax.nn.one_hot(top_i_GxSxk, n_experts, dtype=jnp.float32), axis=(0, 1, 2))


def router_stats(
    logits_GxSxE: jax.Array,
    probs_GxSxE: jax.Array,
    top_i_GxSxk: jax.Array,
    dropped: jax.Array,
    split=None,
    balance: dict | None = None,
):
    """Sums over groups: Switch load-balancing loss E * sum_e f_e * P_e (f = fraction of the group's
    S*k assignments sent to e, P = mean router probability; 1.0 per balanced group), ST-MoE z-loss
    mean_s logsumexp(logits_s)^2, and the number of dropped (token, choice) assignments.
    Groups are sequences, so the first is DeepSeek-V3's sequence-wise balance loss too (its f_i =
    N_r/(K_r T) count_i and P_i = mean normalised score are E * f_e and P_e here).

    `balance` (model.balance=bias: the layer's {'bias', 'load'} state): `moe_balance` is
    sum_e load_e * count_e with the local assignment counts held constant. `load` is always 0, so the
    value is 0, and its gradient (aux weight 1) is the step's assignment counts summed over every
    microbatch, stage and token shard, which the train step turns into the bias update
    (`meshrun_models.moe.update_balance`).

    `split` (`meshrun.parallel.context.SeqSplit`): each group is one of c chunks of a sequence split
    over the context axis. f and P are then summed over the axis before their product, and every
    shard returns its 1/c share of it (the caller sums the shards), so the figures are the whole
    sequence's: a psum's transpose sums the shares' cotangents back."""
    _, s, e = logits_GxSxE.shape
    k = top_i_GxSxk.shape[-1]
    c = 1 if split is None else split.c
    whole = (lambda x: x) if split is None else (lambda x: jax.lax.psum(x, split.axis))
    frac_GxE = whole(jnp.sum(jax.nn.one_hot(top_i_GxSxk, e, dtype=jnp.float32), axis=(1, 2))) / (s * c * k)
    mean_p_GxE = whole(jnp.sum(probs_GxSxE, axis=1)) / (s * c)
    lse_GxS = jax.nn.logsumexp(logits_GxSxE.astype(jnp.float32), axis=-1)
    tap = jnp.zeros((), jnp.float32)
    if balance is not None:
        load = jax.lax.stop_gradient(expert_load(top_i_GxSxk, e))
        tap = jnp.sum(balance["load"].astype(jnp.float32) * load)
    return {
        "moe_aux_loss": e * jnp.sum(jax.lax.stop_gradient(frac_GxE) * mean_p_GxE) / c,
        "moe_z_loss": jnp.sum(jnp.sum(lse_GxS**2, axis=1) / (s * c)),
        "dropped_tokens": jax.lax.stop_gradient(jnp.asarray(dropped, jnp.float32)),
        "moe_balance": tap,
    }
