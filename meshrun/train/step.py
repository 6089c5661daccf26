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
from meshrun.parallel.layer_fetch import rest_like, use_layer_fetch
from meshrun.parallel.sharding import MANUAL, batch_spec, compute_rules, is_spec, manual_axes, use_rules
from meshrun.parallel.zero import ZeroShardings, zeros_like_shapes
from meshrun.pipeline import bw_split
from meshrun.pipeline.executor import Pipeline
from meshrun.train.grad_sums import GradSums
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
    params = zl.gather(params)  # ZeRO-3: all-gather the DP-sharded dims once per step
    batch = (tokens, labels) if segment_ids is None else (tokens, labels, segment_ids)
    sums = GradSums.of(zl, microbatches)  # what is differentiated, where the gradient sums rest
    zl = sums.layout(zl)
    fn = jax.shard_map(
        functools.partial(_local_grads, fns, zl, sums, microbatches),
        mesh=zl.mesh,
        # rows over the DP axes, tokens over 'context'
        in_specs=(zl.local_compute(), *(batch_spec(zl.mesh),) * len(batch)),
        out_specs=(P(), sums.out_specs(zl), P()),
        axis_names=set(manual_axes(zl.mesh)),
        check_vma=False,
    )
    loss, grads, metrics = fn(params, *batch)
    return loss, zl.finish(grads), metrics


def _dp_sum(mesh: Mesh, x):
    """x summed over the live data-parallel axes (inside the loop's shard_map)."""
    live = tuple(a for a in MANUAL if mesh.shape.get(a, 1) > 1)
    return jax.lax.psum(x, live) if live else x


def _loss_share(fns: ModelFns, n_tok, n_seq, p, *mb):
    """One microbatch's share of the step's loss (the global token / sequence counts make shares add
    up) and its (loss sum, aux) sums."""
    loss_sum, _, aux = contract.forward_sums(fns, p, *mb)
    return contract.loss_share(fns, loss_sum, aux, n_tok, n_seq), (loss_sum, aux)


def _local_grads(fns: ModelFns, zl: ZeroShardings, sums: GradSums, m: int, params, *batch):
    """`accumulate_grads`' shard_map body: this data shard's microbatches scanned into the float32
    sums, then reduced (`reduce_local`). Returns (loss, local grads, metrics)."""
    mesh, tokens, labels = zl.mesh, batch[0], batch[1]
    fetch = use_layer_fetch(zl.layer_fetch())  # per layer: the layers fetched inside the scan
    with use_rules(mesh, compute_rules(fns.sequence_parallel), manual=MANUAL), fetch:
        n_tok = _dp_sum(mesh, contract.token_count(fns, params, tokens, labels))  # global counts
        n_seq = tokens.shape[0] * dp_degree(mesh)
        share = functools.partial(_loss_share, fns, n_tok, n_seq)
        sums = sums.bind(params)
        b = tokens.shape[0] // m
        shapes = jax.eval_shape(jax.grad(share, has_aux=True), params, *(a[:b] for a in batch))
        zeros = (sums.zeros(zl, shapes[0]), zeros_like_shapes(shapes[1]))
        micro = functools.partial(_microbatch, sums, functools.partial(sums.loss, share), m)
        (gsum, (loss_sum, aux)), _ = jax.lax.scan(micro, zeros, _microbatches(batch, m))
        loss, metrics = contract.finish(fns, _dp_sum(mesh, loss_sum), n_tok, _dp_sum(mesh, aux), n_seq)
        return loss, zl.reduce_local(gsum), metrics


def _microbatches(batch: tuple, m: int) -> tuple:
    """[rows, ...] -> [m, rows/m, ...]: microbatch j = local rows j, m+j, 2m+j, ... (as the pipeline
    executor splits): over the data shards that is global rows j, m+j, ... whatever the data-parallel
    degree, so a per-microbatch statistic (fp8's tensorwise amax) does not depend on the layout."""
    return tuple(a.reshape(a.shape[0] // m, m, *a.shape[1:]).swapaxes(0, 1) for a in batch)


def _microbatch(sums: GradSums, loss, m: int, acc, mb):
    """The scan step: microbatch `mb`'s gradient added into the sums `acc` = (grad sums, aux sums)."""
    if m == 1:  # nothing to accumulate: the gradient is the sum
        g, aux = jax.grad(loss, has_aux=True)(sums.primal(acc[0]), *mb)
        return sums.first(acc, sums.grads(g), aux), None
    # the backward's layer loop adds each layer's gradients into the float32 sums in place
    # (`bw_split.vjp_into`): no whole fresh gradient beside the sums
    out, vjp, aux = jax.vjp(lambda d: loss(d, *mb), sums.primal(acc[0]), has_aux=True)
    (g,) = bw_split.vjp_into(vjp, jnp.ones_like(out), (sums.diff(acc[0]),))
    return (sums.grads(g), jax.tree.map(jnp.add, acc[1], aux)), None


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
    check_packing(cfg, plan.model_fns)
    tx = make_optimizer(cfg, plan.model_fns.param_names)
    st = _StatePlacement.of(plan, tx)
    loss_and_grads = make_loss_and_grads(plan, mesh)
    if plan.zero.from_host:  # params, gradient sums and optimizer state cross to the device a layer at a time
        tx_streamed = layer_update.no_clip_optimizer(cfg, plan.model_fns.param_names)
        one_step = functools.partial(_streamed_step, plan, tx_streamed, loss_and_grads, st.state_sh)
    else:
        one_step = functools.partial(_device_step, plan, tx, loss_and_grads, st.state_sh)

    def train_step(state: TrainState, *batch):  # the name XLA's dumps carry (`explain` reads them)
        return one_step(state, *batch)

    batch_sh = NamedSharding(mesh, batch_spec(mesh, tokens=False))
    n_batch = 3 if cfg.data.pack_documents else 2  # tokens, labels[, segment_ids]
    step = jax.jit(
        train_step, in_shardings=(st.state_sh, *(batch_sh,) * n_batch), out_shardings=(st.state_sh, None),
        donate_argnums=(0,), compiler_options=step_compiler_options(plan, mesh),
    )  # fmt: skip
    ts = TrainStep(
        step=step,
        init=st.init,
        init_from=st.init_from,
        state_shardings=st.state_sh,
        batch_sharding=batch_sh,
        abstract_state=_with_shardings(st.abstract, st.model_sh),
        to_run=st.to_run,
        to_model=st.to_model,
        loss_and_grads=loss_and_grads,
        abstract_run=_with_shardings(st.abstract_run, st.state_sh),
        plan=plan,
        tx=tx,
    )
    tier = build_tier(ts, cfg)
    return ts if tier is None else with_tier(ts, tier)


def step_compiler_options(plan: StepPlan, mesh: Mesh) -> dict[str, Any] | None:
    """XLA options of the train step. The per-layer ZeRO variants (ZeRO-3 per layer, ZeRO-2 per
    microbatch) exist to save memory, so on XLA:CPU they take its memory-optimised scheduler (the
    default, concurrency-optimised one issues a layer's gathers and its gate/up stacking at the top
    of the backward's body, beside the down projection's weight and gradient). It orders the same
    operations: the numbers are the same."""
    if plan.zero.fsdp and mesh.devices.flat[0].platform == "cpu":
        return {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
    return None


def check_packing(cfg: RunConfig, fns: ModelFns) -> None:
    """data.pack_documents needs a model that takes segment ids."""
    if cfg.data.pack_documents and not fns.segments:
        raise ConfigError(
            "data.pack_documents",
            True,
            "use a model whose ModelFns has segments=True, or set it false",
            "the model cannot take segment ids",
        )


def _with_shardings(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


@dataclass(frozen=True)
class _StatePlacement:
    """The run state's shardings, in the placement the step runs on (`state_sh`) and in model order
    (`model_sh`, checkpoints), and the jitted maps that make and move it. Offloaded state rests in host
    memory: whatever computes on it moves it in and back out."""

    abstract: TrainState  # model order
    abstract_run: TrainState
    state_sh: TrainState
    model_sh: TrainState
    init: Callable[[], TrainState]
    init_from: Callable[[Params], TrainState]
    to_run: Callable[[TrainState], TrainState]
    to_model: Callable[[TrainState], TrainState]

    @classmethod
    def of(cls, plan: StepPlan, tx) -> _StatePlacement:
        zl, split = plan.zero, plan.split
        fresh = functools.partial(_fresh_state, tx)
        abstract = jax.eval_shape(fresh, plan.abstract_params)
        run_order = (lambda st: relayout(st, tx, split.to_pipeline)) if plan.relaid else (lambda st: st)
        abstract_run = jax.eval_shape(lambda prm: run_order(fresh(prm)), plan.abstract_params)
        state_sh = state_shardings(zl, tx, abstract_run)
        model_sh = state_shardings(plan.model_zero, tx, abstract) if plan.relaid else state_sh
        host = functools.partial(zl.to_host, shardings=state_sh)
        seeded = lambda: fresh(plan.family.init_params(plan.cfg.model, plan.cfg.train.seed))
        init = jax.jit(lambda: host(run_order(seeded())), out_shardings=state_sh)
        init_from = jax.jit(lambda prm: host(run_order(fresh(prm))), out_shardings=state_sh)
        if not plan.relaid:
            return cls(abstract, abstract_run, state_sh, model_sh, init, init_from, _same, _same)
        # checkpoints: model order, whose [L] layer axis may not divide over 'pipe' (uneven)
        to_run = jax.jit(lambda st: host(run_order(zl.to_device(st, model_sh))), out_shardings=state_sh)
        model_order = lambda st: relayout(zl.to_device(st, state_sh), tx, split.from_pipeline)
        to_model = jax.jit(lambda st: zl.to_host(model_order(st), model_sh), out_shardings=model_sh)
        return cls(abstract, abstract_run, state_sh, model_sh, init, init_from, to_run, to_model)


def _same(state: TrainState) -> TrainState:
    return state


def _fresh_state(tx, params) -> TrainState:
    """params with fresh optimizer state at step 0."""
    return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))


def _untrained_from_grads(fns, params, grads) -> tuple[Any, Any]:
    """(params with their untrained state set from the step's reduced gradients, the gradients with
    that state's zeroed): delayed fp8's amax histories, then the model's own state (MoE balance
    biases), so clipping, the logged norm and the optimizer never see them."""
    scaled, grads = fp8.update_state(params, grads)
    if fns.update_state is not None:
        scaled, grads = fns.update_state(scaled, grads)
    return scaled, grads


def _untrained_kept(fns, params, scaled) -> Any:
    """The optimizer's new `params` with the untrained state taken from `scaled` (its update discarded)."""
    params = fp8.with_state(params, scaled)
    return params if fns.keep_state is None else fns.keep_state(params, scaled)


def _streamed_step(plan: StepPlan, tx, loss_and_grads, state_sh, state: TrainState, *batch):
    """offload.params' step: the update streams layer by layer (`layer_update.update`, `tx` its
    no-clip optimizer)."""
    zl = plan.zero
    loss, grads, aux = loss_and_grads(state.params, *plan.lay_out(batch))
    scaled, grads = _untrained_from_grads(plan.model_fns, state.params, grads)
    cast = not isinstance(state.opt_state, MasterState)  # as `_device_step` does
    params, opt_state, g_norm = layer_update.update(
        tx, grads, state.opt_state, state.params, plan.cfg.optimizer.grad_clip, cast, zl
    )
    params = jax.tree.map(rest_like, _untrained_kept(plan.model_fns, params, scaled), state.params)
    state = TrainState(params, opt_state, state.step + 1)
    return zl.to_host(state, state_sh), {"loss": loss, "grad_norm": g_norm, **aux}


def _device_step(plan: StepPlan, tx, loss_and_grads, state_sh, state: TrainState, *batch):
    """The step on the device: offloaded moments / master weights come in, the optimizer updates the
    whole state, offloaded parts go back."""
    fns, zl = plan.model_fns, plan.zero
    state = zl.to_device(state, state_sh)
    loss, grads, aux = loss_and_grads(state.params, *plan.lay_out(batch))  # context axis: token layout
    scaled, grads = _untrained_from_grads(fns, state.params, grads)
    if not isinstance(state.opt_state, MasterState):  # master weights: Adam takes the fp32 sums as they are
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)  # fp32 sums -> param dtype
    params, opt_state = apply_optimizer(tx, grads, state.opt_state, state.params)
    params = _untrained_kept(fns, params, scaled)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux}
    return zl.to_host(TrainState(params, opt_state, state.step + 1), state_sh), metrics


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
