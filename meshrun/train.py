"""TrainState and the jitted 3D (+EP) train step.

One step: forward, loss, grads (accumulated over microbatches), ONE data-parallel reduction,
optax update. Data-parallel reduction placement: left to itself GSPMD puts the gradient all-reduce
inside the accumulation loop (once per microbatch), so the loop runs in a `shard_map` that is
manual over the data-parallel axes ('data', 'expert') and auto over 'tensor'; the reduction is
one psum (ZeRO-0) or psum_scatter (ZeRO-1/2/3, Rajbhandari et al. 2020) after the loop. With
`mesh.pipe > 1` the pipeline executor does the same around its tick loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import meshrun_models as models
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from meshrun_models.layers import arrays as pure  # nnx.State / Variables -> nested dicts of leaves

from meshrun.config import RunConfig
from meshrun.errors import ConfigError
from meshrun.sharding import DP_AXES, compute_rules, param_rules, tree_specs, use_rules
from meshrun.zero import MANUAL, finish_reduction, gather_params, local_spec, partial_specs, reduce_grads_local


class TrainState(NamedTuple):
    params: Any
    opt_state: Any
    step: jax.Array  # int32 scalar
    rng: jax.Array  # uint32[2] PRNG key data (dropout-free models keep it for extensions)


@dataclass(frozen=True)
class StepFns:
    """What `make_train_step` returns: the jitted step plus the layouts a loop needs."""

    step: Any  # (state, tokens, labels) -> (state, metrics)
    init: Any  # () -> TrainState, jitted with out_shardings
    state_shardings: TrainState
    batch_sharding: NamedSharding
    abstract_state: TrainState  # ShapeDtypeStructs with shardings (checkpoint restore target)
    to_run: Any  # model-order state (checkpoints) -> the layout the step runs on
    to_model: Any  # inverse (identity unless interleaved: layers stored in pipeline order)


def lr_schedule(cfg: RunConfig) -> optax.Schedule:
    """Linear warmup from 0 to lr, then cosine decay to min_lr_ratio·lr at train.steps."""
    t = cfg.train
    return optax.warmup_cosine_decay_schedule(
        0.0, t.lr, max(t.warmup_steps, 1), max(t.steps, t.warmup_steps + 1), t.lr * t.min_lr_ratio
    )


def make_optimizer(cfg: RunConfig) -> optax.GradientTransformation:
    """AdamW with global-norm clipping."""
    t = cfg.train
    return optax.chain(
        optax.clip_by_global_norm(t.grad_clip),
        optax.adamw(lr_schedule(cfg), b1=t.beta1, b2=t.beta2, eps=t.adam_eps, weight_decay=t.weight_decay),
    )


def dp_degree(mesh: Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["expert"]


def validate(cfg: RunConfig, mesh: Mesh) -> None:
    """Cross-component checks: batch divisibility, model vs mesh."""
    t, m = cfg.train, cfg.pipeline.microbatches
    dp = dp_degree(mesh)
    if t.global_batch % (m * dp):
        raise ConfigError(
            "train.global_batch",
            t.global_batch,
            f"use a multiple of pipeline.microbatches ({m}) x data-parallel degree ({dp}) = {m * dp}",
            "global batch not divisible by microbatches x data-parallel degree",
        )
    if t.seq_len > cfg.model.max_seq_len:
        raise ConfigError("train.seq_len", t.seq_len, f"use at most model.max_seq_len={cfg.model.max_seq_len}")
    models.validate_model_for_mesh(cfg.model, dict(mesh.shape))


def param_names(cfg: RunConfig):
    """Logical axis names of every parameter (plain nested dicts of tuples)."""
    from flax import nnx

    from meshrun.sharding import logical_names

    names = jax.tree.map(
        logical_names, models.abstract_params(cfg.model), is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    return pure(names)


def param_specs(cfg: RunConfig, zero: int, part: str, mesh: Mesh):
    """PartitionSpecs (plain nested dicts) of the model's parameters for ZeRO `part`."""
    return pure(tree_specs(models.abstract_params(cfg.model), param_rules(zero, part), mesh))


def microbatch_loss(params, tokens, labels, n_tokens, n_sequences, cfg: RunConfig):
    """One microbatch's share of the global loss: sums normalised by the GLOBAL token/sequence
    counts, so that the sum over microbatches and data shards is exactly the full-batch loss."""
    x = models.embed(params, tokens, cfg.model)
    x, sums = models.apply_layers(params["layers"], x, cfg.model)
    loss_sum, _ = models.head_loss(params, x, labels, cfg.model)
    return models.total_loss(loss_sum, n_tokens, sums, n_sequences, cfg.model), {"ce_sum": loss_sum, **sums}


def accumulate_grads(params, tokens, labels, cfg: RunConfig, mesh: Mesh):
    """Non-pipelined: scan over microbatches inside a shard_map manual over the DP axes; one
    reduction after the loop. Returns (loss, grads in the ZeRO grad layout, metrics)."""
    zero, m = cfg.train.zero, cfg.pipeline.microbatches
    base, pspec, gspec = (
        param_specs(cfg, z, part, mesh) for z, part in ((0, "params"), (zero, "params"), (zero, "grads"))
    )
    is_p = lambda x: isinstance(x, P)  # noqa: E731
    local = lambda t: jax.tree.map(local_spec, t, is_leaf=is_p)  # noqa: E731
    rules = compute_rules(cfg.model.sequence_parallel)
    live = tuple(a for a in MANUAL if mesh.shape[a] > 1)
    psum = lambda x: jax.lax.psum(x, live) if live else x  # noqa: E731

    if zero >= 3:
        params, pspec = gather_params(params, pspec, base, mesh), base

    def body(params, tokens, labels):
        with use_rules(mesh, rules, manual=MANUAL):
            full = params
            n_tok = psum(jnp.sum(labels >= 0).astype(jnp.float32))
            n_seq = tokens.shape[0] * dp_degree(mesh)
            b = tokens.shape[0] // m
            tok, lab = tokens.reshape(m, b, -1), labels.reshape(m, b, -1)
            grad_fn = jax.value_and_grad(lambda p, x, y: microbatch_loss(p, x, y, n_tok, n_seq, cfg), has_aux=True)

            def micro(carry, xy):
                (loss, parts), g = grad_fn(full, *xy)
                return jax.tree.map(jnp.add, carry, (g, loss, parts)), None

            shapes = jax.eval_shape(grad_fn, full, tok[0], lab[0])
            (parts_shape, grads_shape) = shapes[0][1], shapes[1]
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (grads_shape, jnp.float32(0), parts_shape))
            (gsum, loss, parts), _ = jax.lax.scan(micro, zeros, (tok, lab))
            grads = reduce_grads_local(gsum, local(base), local(gspec), mesh)
            return psum(loss), grads, summarize_parts(psum(parts), n_tok, n_seq, cfg)

    batch_spec = P(DP_AXES)
    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(local(pspec), batch_spec, batch_spec),
        out_specs=(P(), partial_specs(base, gspec, mesh), P()),
        axis_names=set(MANUAL),
        check_vma=False,
    )
    loss, grads, metrics = fn(params, tokens, labels)
    return loss, finish_reduction(grads, base, gspec, mesh), metrics


def summarize_parts(parts, n_tokens, n_sequences, cfg: RunConfig) -> dict:
    """Globally summed loss parts -> logged metrics (router losses per MoE layer and sequence)."""
    out = {"ce_loss": parts["ce_sum"] / n_tokens}
    if cfg.model.is_moe:
        denom = n_sequences * models.n_moe_layers(cfg.model)
        out |= {
            "moe_aux_loss": parts["moe_aux_loss"] / denom,
            "moe_z_loss": parts["moe_z_loss"] / denom,
            "dropped_tokens": parts["dropped_tokens"],
        }
    return out


def loss_and_grads(params, tokens, labels, cfg: RunConfig, mesh: Mesh):
    if mesh.shape["pipe"] > 1:
        from meshrun.pipeline.executor import pipeline_loss_and_grads

        layout = "pipeline" if interleaved(cfg, mesh) else "model"
        return pipeline_loss_and_grads(
            params,
            tokens,
            labels,
            cfg.model,
            cfg.pipeline,
            mesh,
            zero=cfg.train.zero,
            names=param_names(cfg),
            layout=layout,
        )
    return accumulate_grads(params, tokens, labels, cfg, mesh)


def interleaved(cfg: RunConfig, mesh: Mesh) -> bool:
    """Interleaved 1F1B: stage s holds the non-contiguous chunks s, p+s, 2p+s, ... of the layers."""
    return mesh.shape["pipe"] > 1 and cfg.pipeline.schedule == "interleaved" and cfg.pipeline.virtual > 1


def relayout(state: TrainState, tx, fn, p: int, v: int) -> TrainState:
    """Apply a layer-order permutation `fn` to params['layers'] and the matching optimizer leaves.
    Training runs with the layers in pipeline order so that each stage's chunks are local (no weight
    moves per step); checkpoints keep model order, so they restore into any layout."""
    flags = {k: jax.tree.map(lambda _, k=k: k == "layers", sub) for k, sub in state.params.items()}
    one = lambda x, is_layer: fn({"x": x}, p, v)["x"] if is_layer else x  # noqa: E731
    params = {**state.params, "layers": fn(state.params["layers"], p, v)}
    opt = optax.tree_map_params(tx, one, state.opt_state, flags)
    return state._replace(params=params, opt_state=opt)


def make_train_step(cfg: RunConfig, mesh: Mesh) -> StepFns:
    """Jitted train step with explicit in/out shardings and donated state."""
    validate(cfg, mesh)
    tx = make_optimizer(cfg)
    zero = cfg.train.zero

    def init_state() -> TrainState:
        params = pure(models.init_params(cfg.model, cfg.train.seed)[1])
        return TrainState(
            params, tx.init(params), jnp.zeros((), jnp.int32), jax.random.key_data(jax.random.key(cfg.train.seed))
        )

    abstract = jax.eval_shape(init_state)
    sh = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    is_p = lambda x: isinstance(x, P)  # noqa: E731
    param_sh = jax.tree.map(sh, param_specs(cfg, zero, "params", mesh), is_leaf=is_p)
    opt_param_sh = jax.tree.map(sh, param_specs(cfg, zero, "opt", mesh), is_leaf=is_p)
    opt_sh = optax.tree_map_params(
        tx,
        lambda _, s: s,
        abstract.opt_state,
        opt_param_sh,
        transform_non_params=lambda _: sh(P()),
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    state_sh = TrainState(param_sh, opt_sh, sh(P()), sh(P()))
    batch_sh = sh(P(DP_AXES))
    if interleaved(cfg, mesh):
        from meshrun.pipeline.stage import from_pipeline_layout, to_pipeline_layout

        p, v = mesh.shape["pipe"], cfg.pipeline.virtual
        to_run = jax.jit(lambda st: relayout(st, tx, to_pipeline_layout, p, v), out_shardings=state_sh)
        to_model = jax.jit(lambda st: relayout(st, tx, from_pipeline_layout, p, v), out_shardings=state_sh)
        init = jax.jit(lambda: relayout(init_state(), tx, to_pipeline_layout, p, v), out_shardings=state_sh)
    else:
        to_run = to_model = lambda st: st  # noqa: E731
        init = jax.jit(init_state, out_shardings=state_sh)

    def train_step(state: TrainState, tokens, labels):
        loss, grads, aux = loss_and_grads(state.params, tokens, labels, cfg, mesh)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux}
        return TrainState(params, opt_state, state.step + 1, state.rng), metrics

    step = jax.jit(
        train_step, in_shardings=(state_sh, batch_sh, batch_sh), out_shardings=(state_sh, None), donate_argnums=(0,)
    )
    abstract_sh = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_sh)
    return StepFns(step, init, state_sh, batch_sh, abstract_sh, to_run, to_model)
