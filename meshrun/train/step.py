"""TrainState and the jitted 3D (+EP) train step.

One step: forward, loss, grads (accumulated over microbatches in float32), ONE data-parallel
reduction (in `train.grad_reduce_dtype`), optax update. The model is driven only through its
`ModelFns` (meshrun/family/contract.py) and the parameter/gradient/optimizer shardings come from one
`ZeroShardings` (meshrun/parallel/zero.py), both decided once in the run's `StepPlan`
(meshrun/train/plan.py) and handed to whichever loop accumulates the gradients. Data-parallel
reduction placement: left to itself GSPMD puts the gradient all-reduce inside the accumulation loop
(once per microbatch), so the loop runs in a `shard_map` that is manual over the data-parallel axes
('data', 'expert') and auto over 'tensor'; the reduction is one psum (ZeRO-0) or psum_scatter
(ZeRO >= 1, Rajbhandari et al. 2020) after the loop. With `mesh.pipe > 1` the pipeline executor
does the same around its tick loop.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshrun.config import RunConfig
from meshrun.errors import ConfigError
from meshrun.family import contract
from meshrun.family.contract import ModelFns
from meshrun.offload import layer_update
from meshrun.offload.registry import build_tier
from meshrun.offload.tier import StateTier, with_tier
from meshrun.optim.optimizer import MasterState, apply_optimizer, make_optimizer, map_params
from meshrun.parallel import fp8
from meshrun.parallel.layer_fetch import grad_sink, host_zeros, on_host, shadowed, sink_index, use_layer_fetch
from meshrun.parallel.sharding import MANUAL, batch_spec, compute_rules, is_spec, manual_axes, use_rules
from meshrun.parallel.zero import ZeroShardings, accum_zeros
from meshrun.pipeline import bw_split
from meshrun.pipeline.executor import Pipeline
from meshrun.train.plan import StepPlan, build_plan, dp_degree


class TrainState(NamedTuple):
    params: Any
    opt_state: Any
    step: jax.Array  # int32 scalar


Params = Mapping[str, Any]  # a parameter tree: nested dicts of arrays


@dataclass(frozen=True, kw_only=True)
class TrainStep:
    """What `make_train_step` returns: the jitted step plus the shardings and relayouts a loop needs
    (built by keyword only)."""

    # (state, tokens, labels[, segment_ids]) -> (state, metrics); segment ids iff data.pack_documents
    step: Callable[..., tuple[TrainState, dict]]
    init: Callable[[], TrainState]  # jitted with out_shardings
    # params (model order, stored placement) -> a TrainState with fresh optimizer state, step 0
    init_from: Callable[[Params], TrainState]
    state_shardings: TrainState
    batch_sharding: NamedSharding
    abstract_state: TrainState  # ShapeDtypeStructs with shardings, model order (checkpoint restore target)
    to_run: Callable[[TrainState], TrainState]  # model-order state (checkpoints) -> the placement the step runs on
    # the inverse (identity unless interleaved or uneven: layers stored in pipeline placement)
    to_model: Callable[[TrainState], TrainState]
    # (params, tokens, labels[, segment_ids]) -> (loss, grads, metrics), traced inside `step`
    loss_and_grads: Callable[..., tuple[jax.Array, Params, dict]]
    abstract_run: TrainState  # as abstract_state, in the placement `step` takes
    plan: StepPlan  # the static plan it was built from (the evaluation reuses its split and shardings)
    tx: optax.GradientTransformation  # the optimizer the step runs (`meshrun.optim.optimizer.make_optimizer`)
    tier: StateTier | None = None  # the tier holding part of the state (`meshrun.offload`), if any
    # run state -> what a checkpoint saves (None: to_model; the nvme tier streams its file)
    to_save: Callable[[TrainState], TrainState] | None = None
    # (Checkpointer, step) -> run state (None: to_run of the restored model-order state)
    restore: Callable[[object, int], TrainState] | None = None


def accumulate_grads(fns: ModelFns, zl: ZeroShardings, microbatches: int, params, tokens, labels, segment_ids=None):
    """Non-pipelined: scan over microbatches inside a shard_map manual over the DP axes; one
    reduction after the loop. Returns (loss, grads in the ZeRO grad sharding, metrics)."""
    mesh, m = zl.mesh, microbatches
    live = tuple(a for a in MANUAL if mesh.shape.get(a, 1) > 1)
    psum = lambda x: jax.lax.psum(x, live) if live else x
    params = zl.gather(params)  # ZeRO-3: all-gather the DP-sharded dims once per step
    batch = (tokens, labels) if segment_ids is None else (tokens, labels, segment_ids)
    sink = zl.streamed and grad_sink() is not None  # offload.grads=nvme: the layers' gradient to the file
    if sink and m != 1:
        raise ValueError("a gradient sink takes one microbatch (config.offload_params_refusals)")
    out_grads = zl.partial_specs()
    if sink:  # the layers' squared sums per layer and leaf, the same on every device
        out_grads = {**out_grads, "layers": jax.tree.map(lambda _: P(), out_grads["layers"], is_leaf=is_spec)}

    def body(params, *batch):
        tokens, labels = batch[:2]
        fetch = use_layer_fetch(zl.layer_fetch())  # offload.params: layers fetched inside the scan
        with use_rules(mesh, compute_rules(fns.sequence_parallel), manual=MANUAL), fetch:
            n_tok = psum(contract.token_count(fns, params, tokens, labels))  # global counts: shares add up
            n_seq = tokens.shape[0] * dp_degree(mesh)
            b = tokens.shape[0] // m

            def share(p, *mb):
                loss_sum, _, aux = contract.forward_sums(fns, p, *mb)
                return contract.loss_share(fns, loss_sum, aux, n_tok, n_seq), (loss_sum, aux)

            if zl.per_layer:  # differentiate w.r.t. float32 arrays beside the layers (`layer_fetch.Shadowed`):
                layers = params["layers"]  # the layers' sums (or, with m = 1, zeros), in host memory when streamed
                rest = {k: v for k, v in params.items() if k != "layers"}
                share_d = lambda d, *mb: share({**d[0], "layers": shadowed(layers, d[1])}, *mb)
                diff = lambda acc: ({k: v for k, v in acc.items() if k != "layers"}, acc["layers"])
                primal = lambda acc: (rest, acc["layers"])
                split_g = lambda g: {**g[0], "layers": g[1]}
            else:
                share_d, diff, primal, split_g = share, (lambda acc: acc), (lambda acc: params), (lambda g: g)
            grad_fn = jax.grad(share_d, has_aux=True)

            def micro(acc, mb):
                if m == 1:  # nothing to accumulate: the gradient is the sum
                    g, sums = grad_fn(primal(acc[0]), *mb)
                    # streamed layers: their gradient came out of the scan reduced, in host memory
                    add = lambda a, x: x if on_host(x) else a + x
                    out = jax.tree.map(add, acc, (split_g(g), sums))
                    if sink:  # the layers' gradient went to the sink; their squared sums came back
                        out[0]["layers"] = split_g(g)["layers"]
                    return out, None
                # the backward's layer loop adds each layer's gradients into the float32 sums in
                # place (`bw_split.vjp_into`): no whole fresh gradient beside the sums
                loss, vjp, sums = jax.vjp(lambda d: share_d(d, *mb), primal(acc[0]), has_aux=True)
                (g,) = bw_split.vjp_into(vjp, jnp.ones_like(loss), (diff(acc[0]),))
                return (split_g(g), jax.tree.map(jnp.add, acc[1], sums)), None

            shapes = jax.eval_shape(jax.grad(share, has_aux=True), params, *(a[:b] for a in batch))
            sums = accum_zeros(shapes[0])
            if sink:  # the layers are shadowed by their sink indices (`layer_fetch.sink_index`)
                sums["layers"] = sink_index(params["layers"])
            elif zl.streamed:  # the layers' float32 sums rest in host memory, added to a layer at a time (m = 1:
                # the float32 reduced gradient itself)
                sums["layers"] = host_zeros(jax.eval_shape(accum_zeros, shapes[0]["layers"]))
            elif zl.fsdp:  # the layers' float32 sums in device memory, 1/DP of them (ZeRO-2: of whole params)
                sums["layers"] = zl.layer_sums(params["layers"])
            zeros = (sums, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[1]))
            # Microbatch j = local rows j, m+j, 2m+j, ... (as the pipeline executor splits): over the
            # data shards that is global rows j, m+j, ... whatever the data-parallel degree, so a
            # per-microbatch statistic (fp8's tensorwise amax) does not depend on the layout.
            split = lambda a: a.reshape(b, m, *a.shape[1:]).swapaxes(0, 1)
            (gsum, (loss_sum, aux)), _ = jax.lax.scan(micro, zeros, tuple(split(a) for a in batch))
            loss, metrics = contract.finish(fns, psum(loss_sum), n_tok, psum(aux), n_seq)
            return loss, zl.reduce_local(gsum), metrics

    bspec = batch_spec(mesh)  # rows over the DP axes, tokens over 'context'
    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(zl.local_compute(), *(bspec,) * len(batch)),
        out_specs=(P(), out_grads, P()),
        axis_names=set(manual_axes(mesh)),
        check_vma=False,
    )
    loss, grads, metrics = fn(params, *batch)
    return loss, zl.finish(grads), metrics


def relayout(state: TrainState, tx, fn) -> TrainState:
    """Apply a layer re-placement `fn` (a LayerSplit's to_pipeline / from_pipeline) to params['layers']
    and the matching optimizer leaves. Training runs with the layers in pipeline placement so that each
    stage's chunks are local (no weight moves per step; interleaved: chunk order, uneven: padded);
    checkpoints keep model order, so they restore into any placement and split."""
    flags = {k: jax.tree.map(lambda _, k=k: k == "layers", sub) for k, sub in state.params.items()}
    one = lambda x, is_layer: fn({"x": x})["x"] if is_layer else x
    params = {**state.params, "layers": fn(state.params["layers"])}
    opt = map_params(tx, one, state.opt_state, flags)
    return state._replace(params=params, opt_state=opt)


def make_loss_and_grads(plan: StepPlan, mesh: Mesh):
    """(params, tokens, labels) -> (loss, grads in the ZeRO grad sharding, metrics), traced inside the
    step: the pipeline executor when mesh.pipe > 1 (params in pipeline placement), else the microbatch scan."""
    if plan.pipe > 1:
        pl = Pipeline(plan.pipeline_spec(mesh))  # the layers in pipeline placement
        return pl.loss_and_grads
    return functools.partial(accumulate_grads, plan.model_fns, plan.zero, plan.cfg.pipeline.microbatches)


def make_train_step(cfg: RunConfig, mesh: Mesh, plan: StepPlan | None = None) -> TrainStep:
    """Jitted train step with explicit in/out shardings and donated state (`plan`: `build_plan(cfg, mesh)`)."""
    plan = plan or build_plan(cfg, mesh)
    fp8.check_platform(cfg.model.fp8, mesh.devices.flat[0])
    tx = make_optimizer(cfg, plan.model_fns.param_names)
    fns = plan.model_fns
    if cfg.data.pack_documents and not fns.segments:
        raise ConfigError(
            "data.pack_documents",
            True,
            "use a model whose ModelFns has segments=True, or set it false",
            "the model cannot take segment ids",
        )

    def state_from(params) -> TrainState:
        return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))

    def init_state() -> TrainState:
        return state_from(plan.family.init_params(cfg.model, cfg.train.seed))

    abstract = jax.eval_shape(state_from, plan.abstract_params)
    split, relay, zl = plan.split, plan.relaid, plan.zero  # relay: layers stored in pipeline placement
    run_state = (lambda: relayout(init_state(), tx, split.to_pipeline)) if relay else init_state
    abstract_run = jax.eval_shape(lambda prm: relayout(state_from(prm), tx, split.to_pipeline), plan.abstract_params) \
        if relay else abstract  # fmt: skip
    state_sh = state_shardings(zl, tx, abstract_run)
    batch_sh = NamedSharding(mesh, batch_spec(mesh, tokens=False))
    # Offloaded state rests in host memory: whatever computes on it moves it in and back out.
    host = lambda st, sh=state_sh: zl.to_host(st, sh)
    init = jax.jit(lambda: host(run_state()), out_shardings=state_sh)
    if relay:  # checkpoints: model order, whose [L] layer axis may not divide over 'pipe' (uneven)
        model_sh = state_shardings(plan.model_zero, tx, abstract)
        to_run = jax.jit(lambda st: host(relayout(zl.to_device(st, model_sh), tx, split.to_pipeline)),
                         out_shardings=state_sh)  # fmt: skip
        to_model = jax.jit(lambda st: host(relayout(zl.to_device(st, state_sh), tx, split.from_pipeline), model_sh),
                           out_shardings=model_sh)  # fmt: skip
        init_from = jax.jit(lambda prm: host(relayout(state_from(prm), tx, split.to_pipeline)), out_shardings=state_sh)
    else:
        model_sh = state_sh
        to_run = to_model = lambda st: st
        init_from = jax.jit(lambda prm: host(state_from(prm)), out_shardings=state_sh)
    loss_and_grads = make_loss_and_grads(plan, mesh)
    tx_streamed = layer_update.no_clip_optimizer(cfg, fns.param_names) if zl.streamed else None

    def train_step(state: TrainState, *batch):  # batch: tokens, labels[, segment_ids]
        if zl.streamed:  # params, gradient sums and optimizer state cross to the device a layer at a time
            loss, grads, aux = loss_and_grads(state.params, *plan.lay_out(batch))
            cast = not isinstance(state.opt_state, MasterState) or plan.pipe > 1  # as below / the pipeline does
            params, opt_state, g_norm = layer_update.update(
                tx_streamed, grads, state.opt_state, state.params, cfg.optimizer.grad_clip, cast, zl
            )
            return host(TrainState(params, opt_state, state.step + 1)), {"loss": loss, "grad_norm": g_norm, **aux}
        state = zl.to_device(state, state_sh)  # offloaded moments / master weights: host -> device
        loss, grads, aux = loss_and_grads(state.params, *plan.lay_out(batch))  # context axis: token layout
        scaled, grads = fp8.update_state(state.params, grads)  # delayed fp8: amax histories take this step's
        if fns.update_state is not None:  # untrained model state (MoE balance biases) from the reduced grads
            scaled, grads = fns.update_state(scaled, grads)
        if not isinstance(state.opt_state, MasterState):  # master weights: Adam takes the fp32 sums as they are
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)  # fp32 sums -> param dtype
        params, opt_state = apply_optimizer(tx, grads, state.opt_state, state.params)
        params = fp8.with_state(params, scaled)
        if fns.keep_state is not None:
            params = fns.keep_state(params, scaled)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux}
        return host(TrainState(params, opt_state, state.step + 1)), metrics

    n_batch = 3 if cfg.data.pack_documents else 2
    step = jax.jit(
        train_step, in_shardings=(state_sh, *(batch_sh,) * n_batch), out_shardings=(state_sh, None), donate_argnums=(0,)
    )
    with_sh = lambda t, s: jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), t, s)
    ts = TrainStep(
        step=step,
        init=init,
        init_from=init_from,
        state_shardings=state_sh,
        batch_sharding=batch_sh,
        abstract_state=with_sh(abstract, model_sh),
        to_run=to_run,
        to_model=to_model,
        loss_and_grads=loss_and_grads,
        abstract_run=with_sh(abstract_run, state_sh),
        plan=plan,
        tx=tx,
    )
    tier = build_tier(ts, cfg)
    return ts if tier is None else with_tier(ts, tier)


def state_shardings(zl: ZeroShardings, tx, abstract: TrainState) -> TrainState:
    """NamedShardings of a TrainState: params as ZeRO stores them, optimizer moments as `zl.opt`, each in
    the memory `zl` rests it in (pinned host when offloaded)."""
    sh = lambda spec: NamedSharding(zl.mesh, spec)
    opt_sh = map_params(
        tx,
        lambda _, s: s,
        abstract.opt_state,
        jax.tree.map(lambda s: zl.sharding("opt", s), zl.opt, is_leaf=is_spec),
        transform_non_params=lambda _: sh(P()),
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    return TrainState(jax.tree.map(lambda s: zl.sharding("store", s), zl.store, is_leaf=is_spec), opt_sh, sh(P()))
