"""Flax NNX transformer naming logical axes only (import as `meshrun_models`).

Functional API (what the train step and the pipeline executor call)::

    graphdef, params = init_params(cfg, rng_seed)        # params: nnx.State of nnx.Param
    # params keys: 'embed' {'embedding' [V,D] ('vocab','embed')}, 'layers' (every leaf has the leading
    # stacked 'layers' axis), 'final_norm' {'scale' [D] ('norm',)}, 'head' {'kernel' [D,V] ('embed','vocab')}
    # ('head' absent when cfg.tie_embeddings; attn q_bias/k_bias/v_bias only with cfg.qkv_bias).
    # Shardings: meshrun.parallel.sharding.tree_shardings(params, mesh, rules).
    x_BxLxD = embed(params, tokens_BxL, cfg)
    x_BxLxD, aux = apply_layers(jax.tree.map(lambda w: w[a:b], params['layers']), x_BxLxD, cfg)
    loss_sum, n_tokens = head_loss(params, x_BxLxD, labels_BxL, cfg)   # sums; labels < 0 are ignored
    loss = total_loss(loss_sum, n_tokens, aux, n_sequences, cfg)        # after summing over microbatches
    loss, metrics = loss_fn(params, tokens_BxL, labels_BxL, cfg)       # the whole thing, one batch
    fns = model_fns(cfg)   # the same functions as a meshrun.family.contract.ModelFns (what train/pipeline drive)

`aux` = {'moe_aux_loss', 'moe_z_loss', 'dropped_tokens'}: float32 sums over the given units' MoE
layers and over sequences (zeros for dense). loss = loss_sum/n_tokens + aux_loss_coef * moe_aux /
(n_sequences * n_moe_layers) + z_loss_coef * moe_z / (n_sequences * n_moe_layers): add up
loss_sum, n_tokens and aux over microbatches (and over pipeline stages), call total_loss once with
the global number of sequences, and the result equals loss_fn on the whole batch.

Inside a caller's shard_map (a pipeline executor): list its manual axes in `use_rules(..., manual=...)`;
with 'expert' manual too, the MoE layers run their all_to_all directly and `aux` holds the local
shard's sums (psum them like loss_sum). A caller manual over 'data' but not 'expert' is refused
(the nested expert shard_map does not differentiate under Shardy).

Sharding: params carry logical names only (norm scales are ('norm',) so ZeRO-3 never splits them;
router ('embed', None); experts ('expert','embed','mlp') / ('expert','mlp','embed')). Activations:
residual stream ('batch','length','embed') -- 'length' over tensor with compute_rules(True), i.e.
sequence parallelism -- and full length inside blocks; logits ('batch', None, 'vocab'). Per layer
under TP: 2 all-reduces of b·s·h forward, 2 backward (q/k/v and gate/up are fused at run time).
Remat (cfg.remat): none | full (jax.checkpoint of the whole unit) | selective (saves the names in
layers.SAVED_NAMES, recomputes the attention core) | offload (those names in pinned host memory);
cfg.remat_every=k with full: one checkpoint per group of k units. attention_impl='cudnn' falls back to XLA off-GPU.

Stacked units: a dense model has n_layers units; an MoE model with moe_every=k has n_layers/k
units, each k-1 dense blocks (params['layers']['dense'], axes ['layers', None, ...]) then one MoE
block (params['layers']['moe']). All functions accept nnx.State or plain dicts of arrays, and run
under `meshrun.parallel.sharding.use_rules(mesh, compute_rules(sp))` (activation constraints) or without a mesh.
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
