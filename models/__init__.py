"""Flax NNX transformer naming logical axes only (import as `meshrun_models`). Functional API::
    graphdef, params = init_params(cfg, rng_seed)   # embed, layers (stacked), final_norm, head
    x_BxLxD = embed(params, tokens_BxL, cfg)
    x_BxLxD, aux = apply_layers(jax.tree.map(lambda w: w[a:b], params['layers']), x_BxLxD, cfg)
    loss_sum, n_tokens = head_loss(params, x_BxLxD, labels_BxL, cfg)   # sums; labels < 0 are ignored
    loss = total_loss(loss_sum, n_tokens, aux, n_sequences, cfg)        # after summing over microbatches
    loss, metrics = loss_fn(params, tokens_BxL, labels_BxL, cfg)       # the whole thing, one batch
    fns = model_fns(cfg)   # the same as a meshrun.family.contract.ModelFns

`aux` ({'moe_aux_loss', 'moe_z_loss', 'dropped_tokens'}) holds float32 sums, so summing loss_sum,
n_tokens and aux over microbatches and stages, then one total_loss, equals loss_fn on the batch.
Params carry logical axis names only (`meshrun.parallel.sharding.tree_shardings` maps them); run the
functions under `use_rules(mesh, compute_rules(sp))` or without a mesh. cfg.remat: none | full | selective |
offload. An MoE model with moe_every=k stacks n_layers/k units of k-1 dense blocks and one MoE block.
"""

import importlib

# Plain Python until a name is used: a family's `config` module loads without jax (`meshrun plan`).
_LAZY = {
    "loss_fn": "api", "model_fns": "api", "total_loss": "api",
    "capacity": "moe", "moe_ffn": "moe", "route": "moe",
    **{n: "transformer" for n in (
        "Transformer", "abstract_params", "apply_layers", "embed", "head_loss", "init_params", "logits",
        "n_moe_layers", "n_units", "validate_model_for_mesh",
    )},
}  # fmt: skip
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"meshrun_models.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'meshrun_models' has no attribute {name!r}")
