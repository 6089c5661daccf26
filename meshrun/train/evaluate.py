"""Validation loss on the held-out documents (`data.val_fraction`), every `train.eval_every` steps.

val_loss = sum of token cross-entropies / number of scored tokens over `train.eval_batches` fixed
global batches of the validation split (the same batches at every evaluation, so the curve
compares like with like); perplexity = exp(val_loss). The router losses of MoE models are not part
of it (they are regularizers, not a measure of the data).

mesh.pipe = 1: a jitted forward-only pass through the same `ModelFns` as training
(`contract.forward_sums`), in a shard_map manual over the data-parallel axes, scanning the
microbatches of `pipeline.microbatches` so that the activations of one microbatch are live at a
time; one psum at the end. mesh.pipe > 1: a forward-only pipeline over the training step's
placement (`meshrun/pipeline/forward.py`), so no device ever holds more than its stage's layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from meshrun.data.datasets import global_batch_arrays
from meshrun.family import contract
from meshrun.family.contract import ModelFns
from meshrun.parallel.layer_fetch import use_layer_fetch
from meshrun.parallel.sharding import MANUAL, batch_spec, compute_rules, manual_axes, use_rules
from meshrun.parallel.zero import ZeroShardings
from meshrun.pipeline.executor import Pipeline
from meshrun.pipeline.forward import forward_sums
from meshrun.train.step import TrainStep


def forward_sums_fn(fns: ModelFns, zl: ZeroShardings, microbatches: int) -> Callable:
    """(params, tokens, labels[, segment_ids]) -> (loss_sum, n_tokens), global sums, forward only."""
    mesh, m = zl.mesh, microbatches
    live = tuple(a for a in MANUAL if mesh.shape.get(a, 1) > 1)
    psum = lambda x: jax.lax.psum(x, live) if live else x

    def body(params, *batch):
        fetch = use_layer_fetch(zl.layer_fetch())  # offload.params: layers fetched inside the scan
        with use_rules(mesh, compute_rules(fns.sequence_parallel), manual=MANUAL), fetch:
            b = batch[0].shape[0] // m

            def micro(acc, mb):
                loss_sum, n_tok, _ = contract.forward_sums(fns, params, *mb)
                return (acc[0] + loss_sum.astype(jnp.float32), acc[1] + n_tok), None

            split = lambda a: a.reshape(m, b, *a.shape[1:])
            zero = jnp.zeros((), jnp.float32)
            (loss_sum, n_tok), _ = jax.lax.scan(micro, (zero, zero), tuple(split(a) for a in batch))
            return psum(loss_sum), psum(n_tok)

    def run(params, *batch):
        fn = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(zl.local_compute(), *(batch_spec(mesh),) * len(batch)),
            out_specs=(P(), P()),
            axis_names=set(manual_axes(mesh)),
            check_vma=False,
        )
        return fn(zl.gather(params), *batch)

    return run


def make_eval_step(train_step: TrainStep, mesh) -> Callable:
    """Jitted (params in the run placement, *batch) -> (loss_sum, n_tokens) for one global batch, on
    the train step's plan: its model, layer split and parameter shardings."""
    plan = train_step.plan
    cfg, fns = plan.cfg, plan.model_fns
    if plan.pipe > 1:  # the layers as the train step stores them: padded pipeline placement, the same split
        pl = Pipeline(plan.pipeline_spec(mesh))
        sums = lambda params, *batch: forward_sums(pl, params, *batch)
    else:
        sums = forward_sums_fn(fns, plan.zero, cfg.pipeline.microbatches)
    n_batch = 3 if cfg.data.pack_documents else 2
    laid = lambda params, *batch: sums(params, *plan.lay_out(batch))  # the context axis's token layout
    return jax.jit(laid, in_shardings=(train_step.state_shardings.params, *(train_step.batch_sharding,) * n_batch))


def evaluate(eval_step: Callable, params, val_ds, n_batches: int, mesh) -> dict[str, float]:
    """{val_loss, val_perplexity, val_tokens} over validation batches 0..n_batches-1."""
    loss_sum = n_tok = 0.0
    for k in range(n_batches):
        ls, n = jax.device_get(eval_step(params, *global_batch_arrays(val_ds, k, mesh, batch_spec(mesh, tokens=False))))
        loss_sum, n_tok = loss_sum + float(ls), n_tok + float(n)
    val = loss_sum / max(n_tok, 1.0)
    return {"val_loss": val, "val_perplexity": math.exp(min(val, 700.0)), "val_tokens": float(np.round(n_tok))}
