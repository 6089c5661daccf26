"""The one interface between meshrun and a model: `ModelFns`, pure functions over plain dicts of arrays.

Both training paths drive a model only through it: the microbatch scan (`train.accumulate_grads`,
mesh.pipe = 1) and the pipeline executor (mesh.pipe > 1), so a model written against it trains on
any layout, and the logged metrics are the same whatever the layout.

    x_BxSxD = embed(params, tokens_BxS)
    x_BxSxD, aux = apply_layers(layer_params, x_BxSxD)   # a contiguous slice of params['layers']
    loss_sum, n_tokens = head_loss(params, x_BxSxD, labels_BxS)

Packed documents: a model with `segments=True` also takes `apply_layers(lp, x, segment_ids=seg_BxS)`
(attention inside each segment, positions restarting per segment); both training paths and the
evaluation call it through `layers_fn`, and the data marks the label after each segment's last
token -1, so `head_loss` needs nothing new.

`aux` holds float32 SUMS over the given layers and sequences (e.g. MoE router losses). The loss is
linear in the sums, so it is exact over any split into microbatches, stages and data shards:

    loss = sum(loss_sum) / sum(n_tokens) + sum_k aux_weights(n_sequences)[k] * sum(aux[k])

with `n_sequences` the global batch rows. `finish` turns the global sums into (loss, metrics); a
model's `metrics` hook chooses what is logged (default: ce_loss, n_tokens and the aux sums).
Context parallelism (`context=True`): with mesh.context = c > 1 every function sees L/c tokens
of each row (in `meshrun.parallel.context`'s layout); embed and head_loss are per token, so only
apply_layers' attention crosses the 'context' axis.
`param_names` is the tree of logical-axis-name tuples of the parameters (what `meshrun.parallel.sharding` maps to
mesh axes); `sequence_parallel` asks for the residual stream sharded over 'tensor' between blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from meshrun.analysis.flops import model_flops


def _no_aux(n_sequences: int) -> dict[str, float]:
    return {}


@dataclass(frozen=True)
class ModelFns:
    """A model as meshrun drives it (closed over the model's own config)."""

    embed: Callable  # (params, tokens_BxS) -> x_BxSxD
    apply_layers: Callable  # (layer_params, x_BxSxD[, segment_ids=]) -> (x_BxSxD, {name: float32 sum})
    head_loss: Callable  # (params, x_BxSxD, labels_BxS) -> (loss_sum, n_tokens)
    aux_weights: Callable[[int], Mapping[str, float]] = _no_aux  # n_sequences -> {aux name: weight}
    metrics: Callable | None = None  # (loss_sum, n_tokens, aux_sums, n_sequences) -> {name: scalar}
    param_names: Any = None  # tree of logical-axis-name tuples, same structure as params
    sequence_parallel: bool = False
    segments: bool = False  # apply_layers takes segment_ids= (packed documents)
    # mesh.context > 1: the step's shard_map gives every function only this device's chunk of each
    # sequence (`meshrun.parallel.context` layout); a model with context=True attends across the
    # 'context' axis itself and takes its positions from the chunk's global token indices
    context: bool = False
    # State the model keeps in its params but does not train (MoE balance biases): after the step's
    # gradient reduction, `update_state(params, grads) -> (params, grads)` sets it from the reduced
    # gradients and zeroes its gradients; after the optimizer, `keep_state(new_params, params)` puts
    # that state back over the optimizer's update of it
    update_state: Callable | None = None
    keep_state: Callable | None = None


def layers_fn(fns: ModelFns, segment_ids_BxS=None) -> Callable:
    """(layer_params, x) -> (x, aux) for one batch: `apply_layers` with that batch's segment ids
    bound (None: plain rows). The one way the scan, the pipeline and the evaluation call the layers."""
    if segment_ids_BxS is None:
        return fns.apply_layers
    return lambda lp, x: fns.apply_layers(lp, x, segment_ids=segment_ids_BxS)


def loss_share(fns: ModelFns, loss_sum, aux: Mapping[str, Any], n_tokens, n_sequences: int):
    """The part of the loss that `loss_sum` and `aux` (sums over some microbatch/stage/shard)
    contribute, given the GLOBAL token and sequence counts: summing shares gives the loss."""
    weights = fns.aux_weights(n_sequences)
    out = loss_sum / n_tokens
    for k, w in weights.items():
        out = out + w * aux[k]
    return out


def finish(fns: ModelFns, loss_sum, n_tokens, aux: Mapping[str, Any], n_sequences: int):
    """Global sums -> (loss, metrics). The one place the loss and the logged metrics are formed."""
    loss = loss_share(fns, loss_sum, aux, n_tokens, n_sequences)
    if fns.metrics is not None:
        metrics = dict(fns.metrics(loss_sum, n_tokens, aux, n_sequences))
    else:
        metrics = {"ce_loss": loss_sum / n_tokens, "n_tokens": n_tokens, **aux}
    return loss, metrics


def token_count(fns: ModelFns, params, tokens_BxS, labels_BxS):
    """n_tokens of a batch from its labels alone, as `head_loss` counts them (the head runs on zero
    activations and only its count is used: XLA removes the matmul)."""
    x = jax.eval_shape(fns.embed, params, tokens_BxS)
    return jnp.asarray(fns.head_loss(params, jnp.zeros(x.shape, x.dtype), labels_BxS)[1], jnp.float32)


def forward_sums(fns: ModelFns, params, tokens_BxS, labels_BxS, segment_ids_BxS=None):
    """One batch through the whole model: (loss_sum, n_tokens, aux sums)."""
    x, aux = layers_fn(fns, segment_ids_BxS)(params["layers"], fns.embed(params, tokens_BxS))
    loss_sum, n_tokens = fns.head_loss(params, x, labels_BxS)
    return loss_sum, jnp.asarray(n_tokens, jnp.float32), aux


def loss_fn(fns: ModelFns, params, tokens_BxS, labels_BxS, segment_ids_BxS=None):
    """Full-batch (loss, metrics) on one device: the reference every layout must reproduce."""
    loss_sum, n_tokens, aux = forward_sums(fns, params, tokens_BxS, labels_BxS, segment_ids_BxS)
    return finish(fns, loss_sum, n_tokens, aux, tokens_BxS.shape[0])


@dataclass(frozen=True)
class Family:
    """A model family as the framework sees it: everything else about a model stays in its folder.

    config: its config class (a `meshrun.config.ModelConfig` subclass: its own fields, its validation,
    what it supports); model_fns(cfg) -> ModelFns; init_params(cfg, seed) -> nested dict of arrays;
    abstract_params(cfg) -> tree of jax.ShapeDtypeStruct-like leaves carrying logical names
    (nnx.State); check_mesh(cfg, mesh_shape) raises ConfigError when the model cannot be split over
    the mesh; hf: its Hugging Face adapter (None: no import/export); flops_per_token(cfg, seq_len):
    its training FLOPs per token (forward + backward, no recomputation: what MFU counts), or None:
    the transformer formula when its config class is `predictable`, else no TFLOP/s and no MFU."""

    name: str
    config: type
    model_fns: Callable
    init_params: Callable
    abstract_params: Callable
    check_mesh: Callable = lambda cfg, mesh_shape: None
    hf: Any = None
    flops_per_token: Callable | None = None

    def model_flops(self, cfg, batch: int, seq_len: int) -> float | None:
        """Model FLOPs of a step of `batch` sequences of `seq_len` tokens (see `flops_per_token`)."""
        if self.flops_per_token is not None:
            return float(self.flops_per_token(cfg, seq_len)) * batch * seq_len
        return model_flops(cfg, batch, seq_len) if cfg.predictable else None

    def __post_init__(self):
        object.__setattr__(self, "init_params", _names_only(self.init_params, plain=True))
        for name in ("abstract_params", "model_fns"):  # model_fns may build its abstract params for their names
            object.__setattr__(self, name, _names_only(getattr(self, name), plain=False))


def _names_only(fn: Callable, plain: bool) -> Callable:
    """`fn` run with Flax NNX eager sharding off (parameters carry logical axis names, which meshrun
    maps to the mesh itself); `plain`: an nnx.State result becomes a plain dict of arrays."""
    if getattr(fn, "_meshrun_wrapped", False):
        return fn

    def wrapped(*args, **kw):
        with nnx.use_eager_sharding(False):
            out = fn(*args, **kw)
        return _plain(out) if plain else out

    wrapped._meshrun_wrapped = True
    return wrapped


def _plain(tree: Any) -> Any:
    if isinstance(tree, nnx.Variable):
        return tree.get_value()
    if isinstance(tree, Mapping):  # nnx.State is a Mapping
        return {k: _plain(v) for k, v in tree.items()}
    return tree
