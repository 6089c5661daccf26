"""SPMD pipeline executor: GPipe, 1F1B, interleaved 1F1B and ZB-H1 as one `shard_map` over a tick loop.

Shape legend: M microbatches, B local microbatch rows, S sequence, D model width, Lc layers per chunk.

How a step runs:
* `jax.shard_map` is manual over 'pipe' AND the dense data-parallel axes ('data', 'expert'); 'tensor'
  stays auto (GSPMD shards the weights inside a stage; the model's `constrain` calls run under
  `use_rules(..., manual=MANUAL)`). With only 'pipe' manual, GSPMD put the data-parallel gradient
  all-reduce inside the tick loop; here it is one psum (ZeRO >= 1: psum_scatter) after the loop.
* The schedule is data: `program.tick_program` turns the lockstep table into per-tick index arrays
  (scan xs; the stage reads its column with `lax.axis_index('pipe')`) grouped into phases of one
  kind (forward only / both / backward only), one `lax.scan` each, so a warm-up tick costs one
  forward and a cool-down tick one backward: 1F1B costs (p-1)·F + m·(F+B) + (p-1)·B, bubble
  (p-1)/(m+p-1), not the (2p-2)/(m+2p-2) of m+2(p-1) full ticks.
* Activations move with `ppermute` over 'pipe' (forward s -> s+1, gradients s -> s-1; interleaved
  wraps around: the last stage's chunk c feeds stage 0's chunk c+1). With two stages a tick that
  sends both ways does it in one collective-permute (a swap). The per-op executor, one op per stage
  per tick, sends each stage's one output in one collective-permute both ways at any p, its pairs
  static per tick (`program._send_phases`: a phase's scan body runs a period of a few ticks).
* Backward is an explicit per-stage `jax.vjp`. Residuals (default) : the activation-dependent leaves
  of the vjp pytree go into a fixed buffer of `slots` = max over stages of `max_in_flight` (+1 trash
  slot that idle ticks write to); weight-only leaves (found by tracing dependence through the
  model's layer scan) are rebuilt in the backward by a dummy forward XLA removes (`stage.py`). For
  1F1B the lockstep table keeps at most min(m, 2(p-1-s)+1) microbatches in flight on stage s, so the
  buffer has min(m, 2p-1) slots whatever m is. `pipeline.executor=per_op` runs 1F1B's own timeline
  instead (Megatron's order: p-1-s warm-up forwards, then forwards and backwards alternately), one op
  per stage per tick with each backward split into B (input gradient) and W (weight gradients) in
  consecutive ticks (`per_op.OpRun`, `schedules.one_f_one_b_split`): at most min(m, p-s) in flight
  on stage s, so min(m, p) slots plus one B's stash, 3m + 2(p-1) ticks of about one forward each
  (bubble 2(p-1)/(3m+2(p-1)): B reaches the previous stage before W runs). The planner keeps the
  faster of the two executors that fits. `residuals='recompute'` keeps only the stage input and re-runs the forward
  in the backward (one more TP all-reduce per layer; less memory).
* Embedding on entry: stage 0 embeds microbatch i when its first forward runs (token ids are step
  arguments; embedding all M up front would hold M activations). Head + loss run on the last
  virtual stage right after its forward (`lax.cond`, so other stages skip the vocab matmul); only
  the head's input gradient dL/dx (B·S·D) is kept, never the logits.
* Loss = sum(loss_sum) / sum(n_tokens) + sum_k w_k · sum(aux_k), sums over microbatches, stages and
  data-parallel shards, w = `ModelFns.aux_weights(global batch rows)` (`contract.finish`);
  the token count depends only on labels, so it is known before the loop and each head backward
  uses the exact cotangent 1/N (aux cotangents are w_k).
* Parameters: `params['layers']` leaves are stacked [L, ...] in model order. Stage s runs the counts
  of `split` (`split.LayerSplit`: even, `pipeline.layers_per_stage` or balance=auto); for interleaved
  or an uneven split the executor moves them to the pipeline placement ([p, v, lmax], chunks padded to
  the largest count, `LayerSplit.to_pipeline`) inside the step, which moves weights across 'pipe' once
  per step; pass `placement='pipeline'` with params already stored that way (and get grads back that
  way) to avoid it. Uneven chunks skip their padding (`stage.uneven_apply`).
* What a tick costs (compiled HLO and timings on 8 simulated CPU devices; see bench/compare.py):
  a dynamic chunk index copied every weight of the stage and its gradient sums on every tick, so
  with v = 1 the stage's layers are used in place; idle stages ran the stage on dummy data, so
  forward and backward sit in a per-device `lax.cond` (its predicate is the same across a
  tensor/expert group, so collectives inside stay matched); two permutes per tick became one swap
  at p = 2; an idle cell's `lax.cond` branch passes the residual buffer and the gradient sums
  through instead of writing fill values into the trash slot and adding zero gradients (GPipe p = 2:
  24.6 -> 17.4 kB copied per tick; per-op 1F1B, p = 2, 4, m = 8, 16, bench/memory_pipeline.py:
  1.13x the lockstep step before, 1.01-1.16x after, noisy on shared cores).
  What is left per tick is one microbatch's residuals moved into/out of the slot buffer and the
  stage's weight-gradient sums (as in any gradient accumulation), checked in the tests.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshrun.config import PipelineConfig
from meshrun.errors import ConfigError
from meshrun.family import contract
from meshrun.family.contract import ModelFns
from meshrun.parallel.sharding import CONTEXT, DP_AXES, MANUAL, compute_rules, use_rules
from meshrun.parallel.zero import ZeroShardings
from meshrun.pipeline.per_op import OpRun
from meshrun.pipeline.program import TickProgram, tick_program
from meshrun.pipeline.split import LayerSplit, layer_split
from meshrun.pipeline.stage_run import StageRun


class Pipeline:
    """A pipelined loss-and-grads step of a `ModelFns` model:
    `Pipeline(fns, pcfg, mesh, split, zero, ...)(params, tokens, labels) -> (loss, grads, metrics)`
    (jitted), or `loss_and_grads(...)` to trace it inside a caller's jit (the train step, which passes
    its `StepPlan`'s split, tick program and shardings). `Pipeline.for_params(fns, pcfg, mesh, params)`
    derives the split and the shardings from a params tree. Nothing is built lazily.

    params: nnx.State or a nested dict of arrays; its logical axis names come from `fns.param_names`.
    'layers' leaves are stacked [L, ...] in model order (unless placement='pipeline'); the other leaves
    (embedding, final norm, head) are replicated over 'pipe'. tokens, labels: [global batch, S] int.
    grads come back as the same container type, in the same placement, in the ZeRO grad sharding
    (`zero`: the run-order `ZeroShardings`; `model_zero`: the model-order ones). metrics:
    `contract.finish`, as on one device."""

    def __init__(
        self,
        fns: ModelFns,
        pcfg: PipelineConfig,
        mesh: Mesh,
        split: LayerSplit,
        zero: ZeroShardings,
        *,
        placement: str = "model",
        model_zero: ZeroShardings | None = None,
        program: TickProgram | None = None,
        residuals: str = "store",
        nan_bubbles: bool = False,
        skip_idle: bool = True,
    ):
        if residuals not in ("store", "recompute"):
            raise ConfigError("residuals", residuals, "use 'store' or 'recompute'")
        if placement not in ("model", "pipeline"):
            raise ConfigError("placement", placement, "use 'model' or 'pipeline'")
        if placement == "model" and model_zero is None:
            raise ConfigError("model_zero", None, "pass the model-order ZeroShardings with placement='model'")
        self.fns, self.pcfg, self.mesh, self.split = fns, pcfg, mesh, split
        self.zero, self.model_zero, self.zero_stage = zero, model_zero, zero.stage
        self.residuals, self.placement, self.nan_bubbles = residuals, placement, nan_bubbles
        self.skip_idle = skip_idle
        self.p = int(mesh.shape.get("pipe", 1))
        self.dp = int(np.prod([mesh.shape.get(a, 1) for a in DP_AXES]))
        self.program = program if program is not None else tick_program(pcfg, self.p)
        self._jit = jax.jit(self.loss_and_grads)

    @classmethod
    def for_params(cls, fns: ModelFns, pcfg: PipelineConfig, mesh: Mesh, params, *, zero: int = 0,
                   placement: str = "model", **kw) -> Pipeline:  # fmt: skip
        """A Pipeline for `params` (arrays or shapes; 'layers' stacked in `placement` order): its layer
        split (from the stacked count and `pcfg`) and ZeRO stage-`zero` shardings of both orders."""
        arrays = _pure(params)
        p = int(mesh.shape.get("pipe", 1))
        program = tick_program(pcfg, p)  # the schedule's errors first
        n = jax.tree.leaves(arrays["layers"])[0].shape[0]
        lps = pcfg.layers_per_stage
        split = layer_split(pcfg, sum(lps) if lps and placement == "pipeline" else n, p)
        if fns.param_names is None:
            raise ConfigError("ModelFns.param_names", None, "give the logical axis names of the params tree")
        build = lambda t: ZeroShardings.build(fns.param_names, t, mesh, zero)
        model_zero = None
        if placement == "model":
            model_zero = build(arrays)
            arrays = {**arrays, "layers": jax.eval_shape(split.to_pipeline, arrays["layers"])}
        return cls(fns, pcfg, mesh, split, build(arrays), placement=placement, model_zero=model_zero,
                   program=program, **kw)  # fmt: skip

    # ------------------------------------------------------------ checks and containers

    def check(self, params, tokens) -> None:
        n = jax.tree.leaves(params["layers"])[0].shape[0]
        want = self.split.padded if self.placement == "pipeline" else self.split.n
        if n != want:
            raise ConfigError(
                "params['layers']",
                n,
                f"pass {want} stacked layers ({self.placement} placement of the split {list(self.split.counts)})",
                "layer count does not match the split",
            )
        gb, m = tokens.shape[0], self.program.m
        if gb % (m * self.dp):
            raise ConfigError(
                "train.global_batch",
                gb,
                f"use a multiple of microbatches*data*expert = {m}*{self.dp} = {m * self.dp}",
                "global batch does not split into microbatches x data-parallel shards",
            )

    def __call__(self, params, tokens, labels, segment_ids=None):
        arrays = _pure(params)
        self.check(arrays, tokens)
        loss, grads, metrics = self._jit(arrays, tokens, labels, segment_ids)
        if isinstance(params, nnx.State):
            out = jax.tree.map(lambda a: a, params)
            nnx.replace_by_pure_dict(out, grads)
            grads = out
        return loss, grads, metrics

    def lower(self, params, tokens, labels):
        arrays = _pure(params)
        self.check(arrays, tokens)
        return self._jit.lower(arrays, tokens, labels)

    # ------------------------------------------------------------ the step

    def loss_and_grads(self, params, tokens, labels, segment_ids=None):
        """(loss, grads in the ZeRO grad sharding, metrics); traceable inside a caller's jit.
        `segment_ids` (packed documents) reach every stage's layers with the microbatch's tokens."""
        mesh, lsplit, zl = self.mesh, self.split, self.zero
        params, batch, bspec = self.placed(params, tokens, labels, segment_ids)
        layers, other = params["layers"], {k: a for k, a in params.items() if k != "layers"}
        zl_l, zl_o = zl.sub("layers"), zl.without("layers")
        f = jax.shard_map(
            functools.partial(self._body, zl_l=zl_l, zl_o=zl_o),
            mesh=mesh,
            in_specs=(zl_l.local_compute(), zl_o.local_compute(), *(bspec,) * len(batch)),
            out_specs=(P(), zl_l.partial_specs(), zl_o.partial_specs(), P()),
            axis_names=set(MANUAL),
            check_vma=False,
        )
        loss, gl, go, metrics = f(layers, other, *batch)
        gl, go = zl_l.finish(gl), zl_o.finish(go)  # ZeRO >= 1: one reduce-scatter per leaf
        gspec = zl.grads
        if self.placement == "model":
            gl, gspec = lsplit.from_pipeline(gl), self.model_zero.grads
        grads = jax.tree.map(lambda g, a: g.astype(a.dtype), {**go, "layers": gl}, params)  # fp32 sums -> param dtype
        return loss, _wsc(mesh, grads, gspec), metrics

    def placed(self, params, tokens, labels, segment_ids=None):
        """(params in the padded pipeline placement, gathered; the batch arrays as [M, B, S] microbatches;
        their spec): what the shard_map over the tick loop takes (also `pipeline/forward.py`)."""
        mesh, m, lsplit, zl = self.mesh, self.program.m, self.split, self.zero
        if self.placement == "model":  # model order [L] -> padded pipeline placement [p*v*lmax] (moves weights)
            params = _wsc(mesh, params, self.model_zero.store)
            params = {**params, "layers": _wsc(mesh, lsplit.to_pipeline(params["layers"]), zl.sub("layers").store)}
        params = zl.gather(_wsc(mesh, params, zl.store))  # ZeRO-3: all-gather the DP-sharded dims once per step
        # Microbatch j = rows j, m+j, 2m+j, ...: each data shard's rows split into m local
        # microbatches without moving token ids between devices (row order does not change the sums).
        bspec = P(None, DP_AXES, CONTEXT)  # [M, B, S]: rows over DP, tokens over 'context'
        split = lambda a: a.reshape(a.shape[0] // m, m, *a.shape[1:]).swapaxes(0, 1)
        batch = (tokens, labels) if segment_ids is None else (tokens, labels, segment_ids)
        return params, [lax.with_sharding_constraint(split(a), NamedSharding(mesh, bspec)) for a in batch], bspec

    def _body(self, layers, other, tok, lab, *seg, zl_l: ZeroShardings, zl_o: ZeroShardings):
        with use_rules(self.mesh, compute_rules(self.fns.sequence_parallel), manual=MANUAL):
            run_cls = OpRun if self.program.per_op else StageRun  # zb-h1: one op per stage per tick
            run = run_cls(self, layers, other, tok, lab, seg[0] if seg else None)
            carry = run.ticks()
            # One data-parallel reduction per step, after the loop: psum here; leaves that ZeRO
            # scatters leave as per-rank partial sums for `ZeroShardings.finish`.
            gl = carry["g_layers"]
            if run.v > 1:
                gl = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), gl)
            gl = zl_l.reduce_local(gl)
            go = zl_o.reduce_local(carry["g_other"], extra=("pipe",))
            loss, metrics = contract.finish(
                self.fns, lax.psum(carry["loss"], MANUAL), run.n_tok, lax.psum(carry["aux"], MANUAL), run.n_seq
            )
            return loss, gl, go, metrics


def _pure(params) -> dict:
    """A nested dict of the arrays (or shapes) of `params` (nnx.State or a dict)."""
    return params.to_pure_dict() if isinstance(params, nnx.State) else dict(params)


def _wsc(mesh, tree, specs):
    return jax.tree.map(lambda a, sp: lax.with_sharding_constraint(a, NamedSharding(mesh, sp)), tree, specs)
