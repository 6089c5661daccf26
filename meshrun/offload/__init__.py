"""Where optimizer state, parameters and gradients rest (the `offload:` config section).

`registry.placement(cfg)` decides once which tier a run uses (kept in the step plan), and
`tier.with_tier(train_step, tier)` composes a built TrainStep with it. The tiers:
`optimizer_tier.OptimizerTier` (optimizer state in host memory or NVMe files, the update streamed
through the device in chunks) and `param_tier.ParamTier` (offload.params: the stacked layers'
state in NVMe files, streamed a few layers at a time). Both follow the `tier.StateTier` protocol.
Stores, layouts and checkpoint I/O: chunk_store, swap_file, flat_layout, layer_layout, checkpoint_io.
"""
