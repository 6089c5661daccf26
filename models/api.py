"""The meshrun_models transformer as a `meshrun.family.contract.ModelFns` (what train and pipeline drive)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
from meshrun_models.moe import keep_balance, update_balance
from meshrun_models.transformer import abstract_params, apply_layers, embed, head_loss

from meshrun.config import ModelConfig
from meshrun.family import contract
from meshrun.family.contract import ModelFns
from meshrun.parallel.sharding import state_names


@functools.cache
def model_fns(cfg: ModelConfig) -> ModelFns:
    """ModelFns of the transformer: router losses averaged over MoE layers and sequences."""
    n_moe = cfg.n_moe_layers
    bias = cfg.is_moe and cfg.balance == "bias"

    def aux_weights(n_seq: int) -> dict[str, float]:
        if not cfg.is_moe:
            return {}
        out = {"moe_aux_loss": cfg.aux_loss_coef / (n_seq * n_moe), "moe_z_loss": cfg.z_loss_coef / (n_seq * n_moe)}
        if bias:  # value 0; the gradient of each layer's 'load' is its expert loads (router.router_stats)
            out["moe_balance"] = 1.0
        return out

    def metrics(loss_sum, n_tok, sums, n_seq):
        out = {"ce_loss": loss_sum / n_tok, "n_tokens": n_tok}
        if cfg.is_moe:
            out |= {
                "moe_aux_loss": sums["moe_aux_loss"] / (n_seq * n_moe),
                "moe_z_loss": sums["moe_z_loss"] / (n_seq * n_moe),
                "dropped_tokens": sums["dropped_tokens"],
            }
        return out

    return ModelFns(
        embed=lambda prm, tok: embed(prm, tok, cfg),
        apply_layers=lambda lp, x, segment_ids=None: apply_layers(lp, x, cfg, segment_ids),
        head_loss=lambda prm, x, lab: head_loss(prm, x, lab, cfg),
        aux_weights=aux_weights,
        metrics=metrics,
        param_names=state_names(abstract_params(cfg)),
        sequence_parallel=cfg.sequence_parallel,
        # model.first_dense_layers run in `embed`, which takes no segment ids
        segments=not cfg.first_dense_layers,
        context=cfg.context_attention,
        update_state=(lambda prm, g: update_balance(prm, g, cfg.bias_rate)) if bias else None,
        keep_state=keep_balance if bias else None,
    )


def total_loss(loss_sum, n_tokens, aux: Mapping[str, jax.Array], n_sequences: int, cfg: ModelConfig):
    """Combine sums (possibly accumulated over microbatches) into the training loss:
    loss_sum/n_tokens + aux_loss_coef*moe_aux/(n_seq*n_moe) + z_loss_coef*moe_z/(n_seq*n_moe),
    i.e. the router losses are averaged over MoE layers and over sequences (routing groups)."""
    return contract.loss_share(model_fns(cfg), loss_sum, aux, n_tokens, n_sequences)


def loss_fn(params: Any, tokens_BxL: jax.Array, labels_BxL: jax.Array, cfg: ModelConfig, segment_ids_BxL=None):
    """Full-batch (loss, metrics) on one device, through the same `ModelFns` the train step drives:
    metrics = {ce_loss, n_tokens} and, for MoE, {moe_aux_loss, moe_z_loss (per layer and sequence),
    dropped_tokens}."""
    return contract.loss_fn(model_fns(cfg), params, tokens_BxL, labels_BxL, segment_ids_BxL)
