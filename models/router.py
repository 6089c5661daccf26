"""Top-k router shared by both MoE dispatches: gates and the per-group load-balancing statistics.

Shape letters as in layers.py (G groups = sequences, S tokens per group, E experts, k = top_k).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshrun.config import ModelConfig


def top_k_gates(logits_GxSxE: jax.Array, cfg: ModelConfig):
    """float32 softmax probabilities, the top-k expert ids and their gates (renormalised when k > 1)."""
    probs_GxSxE = jax.nn.softmax(logits_GxSxE.astype(jnp.float32), axis=-1)
    top_p_GxSxk, top_i_GxSxk = jax.lax.top_k(probs_GxSxE, cfg.top_k)
    if cfg.top_k > 1:
        top_p_GxSxk = top_p_GxSxk / jnp.sum(top_p_GxSxk, -1, keepdims=True)
    return probs_GxSxE, top_i_GxSxk, top_p_GxSxk


def router_stats(
    logits_GxSxE: jax.Array, probs_GxSxE: jax.Array, top_i_GxSxk: jax.Array, dropped: jax.Array, split=None
):
    """Sums over groups: Switch load-balancing loss E * sum_e f_e * P_e (f = fraction of the group's
    S*k assignments sent to e, P = mean router probability; 1.0 per balanced group), ST-MoE z-loss
    mean_s logsumexp(logits_s)^2, and the number of dropped (token, choice) assignments.

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
    return {
        "moe_aux_loss": e * jnp.sum(jax.lax.stop_gradient(frac_GxE) * mean_p_GxE) / c,
        "moe_z_loss": jnp.sum(jnp.sum(lse_GxS**2, axis=1) / (s * c)),
        "dropped_tokens": jax.lax.stop_gradient(jnp.asarray(dropped, jnp.float32)),
    }
