"""The optimizer the train step runs: a registry entry's optax transformation (`meshrun.optim.registry`)
inside what the framework adds around every entry:

    with_master_weights( chain( clip_by_global_norm(grad_clip), with_state_dtype(entry) ) )

Clipping needs the norm over all gradients, so the framework applies it; `with_state_dtype` keeps the
entry's moments in `optimizer.state_dtype` and computes in float32; `with_master_weights` keeps a
float32 master copy of params stored below float32. Build it with `make_optimizer(cfg, param_names)`.

A streamed offload update runs the same optax code chunk by chunk through `elementwise_transform(cfg)`
(entries declared `elementwise` only): the caller clips with the global norm over all chunks, updates
the float32 master chunk and rounds it to the param dtype as `apply_optimizer` does. A chunk's state
is the state with every parameter-shaped leaf cut to it (`map_params`, which ZeRO, offload and the
pipeline also use to re-place the state); its scalars (Adam's count) advance once per step.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from meshrun.config import OptimizerConfig, RunConfig
from meshrun.errors import ConfigError
from meshrun.optim import registry


def lr_schedule(cfg: RunConfig, horizon: int | None = None) -> optax.Schedule:
    """Linear warmup from 0 to lr over optimizer.warmup_steps (0: none, the first step at lr), then
    cosine decay to min_lr_ratio·lr at `horizon` (default `decay_horizon(cfg)`), flat after it."""
    o, steps = cfg.optimizer, decay_horizon(cfg) if horizon is None else horizon
    end = max(steps, o.warmup_steps + 1)
    if o.warmup_steps == 0:
        return optax.cosine_decay_schedule(o.lr, end, o.min_lr_ratio)
    return optax.warmup_cosine_decay_schedule(0.0, o.lr, o.warmup_steps, end, o.lr * o.min_lr_ratio)


def decay_horizon(cfg: RunConfig) -> int:
    """The step where the cosine ends: optimizer.decay_steps, else train.steps."""
    return cfg.optimizer.decay_steps or cfg.train.steps


def schedule_moved(old: dict, cfg: RunConfig, step: int) -> str | None:
    """A resume whose schedule ends at another step than the run's config.yaml (`old`) said (a larger
    train.steps stretches the cosine): one line with the lr at `step` before and after, and the key
    that keeps the old horizon; None when it ends where it did."""
    was = (old.get("optimizer") or {}).get("decay_steps") or (old.get("train") or {}).get("steps")
    now = decay_horizon(cfg)
    if not isinstance(was, int) or was == now:
        return None
    before, after = (float(lr_schedule(cfg, h)(step)) for h in (was, now))
    return (f"the learning-rate schedule now ends at step {now} (was {was}): the lr at step {step} is {after:.3g} "
            f"(was {before:.3g}); set optimizer.decay_steps={was} to keep the original horizon")  # fmt: skip


def _entry(cfg: RunConfig, param_names: Any) -> optax.GradientTransformation:
    """The registry entry's transformation for this config, its moments in optimizer.state_dtype."""
    build = registry.get(cfg.optimizer.name).build
    if isinstance(build, str):
        module, fn = build.split(":")
        build = getattr(importlib.import_module(module), fn)
    tx = build(cfg.optimizer, lr_schedule(cfg), param_names)
    return with_state_dtype(tx, cfg.optimizer.state_dtype)


def make_optimizer(cfg: RunConfig, param_names: Any = None) -> optax.GradientTransformation:
    """The optimizer of `cfg` (see the module docstring). `param_names`: the model's tree of
    logical-axis names (`ModelFns.param_names`), for entries that treat weight matrices apart (muon)."""
    clip = optax.clip_by_global_norm(cfg.optimizer.grad_clip) if cfg.optimizer.grad_clip > 0 else optax.identity()
    tx = optax.chain(clip, _entry(cfg, param_names))
    return with_master_weights(tx) if jnp.dtype(cfg.model.param_dtype).itemsize < 4 else tx


def elementwise_transform(cfg: RunConfig) -> optax.GradientTransformation:
    """The entry's transformation in its state dtype, without clipping or master weights, to run on
    one chunk of the state at a time (module docstring); a ConfigError for a non-elementwise entry."""
    if not registry.get(cfg.optimizer.name).elementwise:
        raise ConfigError("optimizer.name", cfg.optimizer.name, "use an elementwise optimizer, e.g. adamw",
                          "its update needs whole weight matrices, not chunks")  # fmt: skip
    return _entry(cfg, None)


# ------------------------------------------------------------------ the entries' builders


def adamw(opt: OptimizerConfig, schedule: optax.Schedule, param_names: Any = None) -> optax.GradientTransformation:
    """AdamW (Loshchilov & Hutter 2019), weight decay on every parameter."""
    del param_names
    return optax.adamw(schedule, b1=opt.beta1, b2=opt.beta2, eps=opt.eps, weight_decay=opt.weight_decay)


BATCH_NAMES = (None, "layers", "expert")  # stacked copies of one matrix: orthogonalized one by one


def muon_dims(names: tuple) -> MuonDimensionNumbers | None:
    """Muon's view of a weight from its logical axis names: a hidden-layer weight with an 'embed'
    axis and another matrix axis is a [fan_in, fan_out] matrix ('embed' first: fan_in; last:
    fan_out), the stacked axes (BATCH_NAMES) batch; anything else (embeddings, head, norm scales,
    biases, the router) None: Adam's. Negative axes, so any stacking of the layers works."""
    mat = [i - len(names) for i, n in enumerate(names) if n not in BATCH_NAMES]
    if "layers" not in names or len(mat) < 2 or "embed" not in (names[mat[0]], names[mat[-1]]):
        return None
    if names[mat[0]] == "embed":
        return MuonDimensionNumbers(reduction_axis=(mat[0],), output_axis=tuple(mat[1:]))
    return MuonDimensionNumbers(reduction_axis=tuple(mat[:-1]), output_axis=(mat[-1],))


def muon(opt: OptimizerConfig, schedule: optax.Schedule, param_names: Any) -> optax.GradientTransformation:
    """Muon (Jordan et al. 2024) as `optax.contrib.muon` builds it: Nesterov momentum orthogonalized
    by `ns_steps` Newton-Schulz iterations on each hidden-layer weight matrix (`muon_dims`), scaled
    to AdamW's update RMS (consistent_rms=0.2, Liu et al. 2025, so optimizer.lr means what it means
    for adamw); the adamw entry on the other parameters (as the reference Muon; optax's muon gives
    its Adam part Nesterov momentum too). Built from two `optax.masked` halves instead of
    `optax.partition`, so that every state leaf is a (masked) copy of the params tree and ZeRO,
    offload and the pipeline place it like any other state (`map_params`)."""
    if param_names is None:
        raise ConfigError("optimizer.name", opt.name, "give make_optimizer the model's param_names",
                          "muon tells weight matrices from other parameters by their axis names")  # fmt: skip
    dims = jax.tree.map(muon_dims, param_names, is_leaf=lambda x: isinstance(x, tuple))
    is_matrix = jax.tree.map(lambda d: d is not None, dims, is_leaf=lambda x: x is None or isinstance(x, tuple))
    masked_dims = jax.tree.map(lambda d: d if d is not None else optax.MaskedNode(), dims,
                               is_leaf=lambda x: x is None or isinstance(x, tuple))  # fmt: skip
    matrices = optax.chain(
        scale_by_muon(ns_steps=opt.ns_steps, beta=opt.momentum, eps=opt.eps, weight_dimension_numbers=masked_dims),
        _scale_to_adam_rms(masked_dims),
        optax.add_decayed_weights(opt.weight_decay),
        optax.scale_by_learning_rate(schedule),
    )
    not_matrix = jax.tree.map(lambda m: not m, is_matrix)
    return optax.chain(optax.masked(matrices, is_matrix), optax.masked(adamw(opt, schedule), not_matrix))


def _scale_to_adam_rms(dims: Any, rms: float = 0.2) -> optax.GradientTransformation:
    """Each orthogonalized matrix times sqrt(max(fan_in, fan_out)) * rms (Liu et al. 2025: 0.2 gives
    AdamW's update RMS; optax's muon `consistent_rms`, written out as its helper is private)."""

    def scale(u, d):
        fan_in = math.prod(u.shape[a] for a in d.reduction_axis)
        fan_out = math.prod(u.shape[a] for a in d.output_axis)
        return u * (rms * math.sqrt(max(fan_in, fan_out)))

    def update(updates, state, params=None):
        del params
        return jax.tree.map(scale, updates, dims, is_leaf=lambda x: isinstance(x, MuonDimensionNumbers)), state

    return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


# ------------------------------------------------------------------ wrappers the framework adds


def map_params(tx: optax.GradientTransformation, f: Callable, state: Any, *rest: Any,
               transform_non_params: Callable | None = None, is_leaf: Callable | None = None) -> Any:  # fmt: skip
    """`optax.tree_map_params` that also walks masked copies of the params (`optax.masked`): a
    masked-out leaf stays an `optax.MaskedNode`."""
    masked = lambda x: isinstance(x, optax.MaskedNode)
    leaf = lambda x: masked(x) or (is_leaf is not None and is_leaf(x))
    g = lambda x, *r: x if masked(x) else f(x, *r)
    return optax.tree_map_params(tx, g, state, *rest, transform_non_params=transform_non_params, is_leaf=leaf)


def with_state_dtype(inner: optax.GradientTransformation, dtype: str) -> optax.GradientTransformation:
    """`inner` with its parameter-shaped floating state stored in `dtype` (bfloat16: half the bytes
    of Adam's m and v, as torchtitan and Megatron-Core offer) and its update computed in float32.
    float32: `inner` itself, unchanged."""
    if dtype == "float32":
        return inner
    cast = lambda dt: lambda x: x.astype(dt) if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) else x
    down, up = cast(jnp.dtype(dtype)), cast(jnp.float32)

    def init(params):
        return map_params(inner, down, inner.init(params))

    def update(grads, state, params=None):
        updates, state = inner.update(grads, map_params(inner, up, state), params)
        return updates, map_params(inner, down, state)

    return optax.GradientTransformation(init, update)


class MasterState(NamedTuple):
    master: Any  # float32 copy of the params: the weights the optimizer updates
    inner: Any  # the wrapped optimizer's state


def with_master_weights(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """Mixed-precision training (Micikevicius et al. 2018; Megatron-LM's fp32 main params): the model's
    params stay in their low precision (what the forward reads, what ZeRO < 3 replicates); the
    optimizer state holds a float32 master copy, updated by `inner` from float32 gradients, and the new
    params are the master rounded to the param dtype (`apply_optimizer`). Master and moments are
    parameter-shaped optimizer leaves, so ZeRO >= 1 shards them over the data-parallel group and
    offload_optimizer moves them to host."""
    f32 = lambda x: x.astype(jnp.float32) if hasattr(x, "astype") else x  # (optax's placeholders pass through)

    def init(params):
        master = jax.tree.map(f32, params)
        return MasterState(master, inner.init(master))

    def update(grads, state, params=None):
        del params
        updates, inner_state = inner.update(jax.tree.map(f32, grads), state.inner, state.master)
        return updates, MasterState(optax.apply_updates(state.master, updates), inner_state)

    return optax.GradientTransformation(init, update)


def apply_optimizer(tx: optax.GradientTransformation, grads, opt_state, params):
    """(new params, new optimizer state). With master weights the params are the updated master in
    the param dtype (one rounding), not params + a rounded update."""
    updates, opt_state = tx.update(grads, opt_state, params)
    if isinstance(opt_state, MasterState):
        return jax.tree.map(lambda m, p: m.astype(p.dtype), opt_state.master, params), opt_state
    return optax.apply_updates(params, updates), opt_state
