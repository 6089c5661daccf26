"""SPMD pipeline executor: GPipe, 1F1B, interleaved 1F1B and ZB-H1 as one `shard_map` over a tick loop.

Shape legend: M microbatches, B local microbatch rows, S sequence, D model width, Lc layers per chunk.

* Manual over 'pipe', 'data' and 'expert', auto over 'tensor'; the data-parallel gradient reduction
  is one psum (ZeRO >= 1: psum_scatter) after the loop; per layer (`ZeroShardings.per_layer`) every
  gradient, the embedding's and head's included, is reduce-scattered each microbatch inside it.
* The schedule is data: `program.tick_program` turns its table into per-tick index arrays, grouped
  into phases with one `lax.scan` each; activations and gradients move with `ppermute` over 'pipe'.
* Backward is an explicit per-stage `jax.vjp`; in-flight residuals live in a fixed slot buffer, so
  memory does not grow with m. `pipeline.executor=per_op` runs `per_op.py` (backward split B / W).
* Head and loss run on the last virtual stage only; the loss is linear in the per-microbatch sums
  of `ModelFns`, so any split gives the single-device loss. Uneven or interleaved splits run in the
  pipeline placement (`split.LayerSplit.to_pipeline`). docs/pipeline.md is the user's guide.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshrun.errors import ConfigError
from meshrun.family import contract
from meshrun.parallel.layer_fetch import use_layer_fetch
from meshrun.parallel.sharding import CONTEXT, MANUAL, batch_axes, compute_rules, manual_axes, use_rules
from meshrun.parallel.zero import ZeroShardings, without_layers
from meshrun.pipeline.per_op import OpRun
from meshrun.pipeline.spec import PipelineSpec, pure
from meshrun.pipeline.tick_loop import StageRun


class Pipeline:
    """A pipelined loss-and-grads step of a `ModelFns` model:
    `Pipeline(spec)(params, tokens, labels) -> (loss, grads, metrics)` (jitted), or
    `loss_and_grads(...)` to trace it inside a caller's jit. `spec` (`PipelineSpec`: the model, the
    tick program, the layer split, the mesh, the params' ZeRO shardings) is built once: by the step
    plan for training (`StepPlan.pipeline_spec`), by `pipeline_spec(fns, pcfg, mesh, params)` from a
    params tree. With `spec.model_zero` the step takes 'layers' in model order and returns their
    gradients so (else it takes the pipeline placement as training stores it). Nothing is built lazily.

    params: nnx.State or a nested dict of arrays; its logical axis names come from `fns.param_names`.
    'layers' leaves are stacked [L, ...]; the other leaves (embedding, final norm, head) are replicated
    over 'pipe'. tokens, labels: [global batch, S] int. grads come back as the same container type, in
    the same placement, in the ZeRO grad sharding. metrics: `contract.finish`, as on one device."""

    def __init__(self, spec: PipelineSpec):
        self.spec, self.zero, self.model_zero, self.placement = spec, spec.zero, spec.model_zero, spec.placement
        self.fns, self.mesh, self.split, self.program = spec.fns, spec.mesh, spec.split, spec.program
        self.p, self.dp = spec.p, spec.dp
        self._jit = jax.jit(self.loss_and_grads)

    def place(self, params) -> dict:
        """`params` (nnx.State or a dict) as a dict of arrays laid out as the step takes them (its
        placement's ZeRO store shardings): pass the result, or the step re-lays them out each call and
        compiles for their first layout too."""
        store = self.model_zero.store if self.placement == "model" else self.zero.store
        return jax.tree.map(lambda a, spec: jax.device_put(a, NamedSharding(self.mesh, spec)), pure(params), store)

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
        arrays = pure(params)
        self.check(arrays, tokens)
        loss, grads, metrics = self._jit(arrays, tokens, labels, segment_ids)
        if isinstance(params, nnx.State):
            out = jax.tree.map(lambda a: a, params)
            nnx.replace_by_pure_dict(out, grads)
            grads = out
        return loss, grads, metrics

    def lower(self, params, tokens, labels):
        arrays = pure(params)
        self.check(arrays, tokens)
        return self._jit.lower(arrays, tokens, labels)

    # ------------------------------------------------------------ the step

    def loss_and_grads(self, params, tokens, labels, segment_ids=None):
        """(loss, grads in the ZeRO grad sharding, metrics); traceable inside a caller's jit.
        `segment_ids` (packed documents) reach every stage's layers with the microbatch's tokens."""
        mesh, lsplit, zl = self.mesh, self.split, self.zero
        params, batch, bspec = self.placed(params, tokens, labels, segment_ids)
        layers, other = params["layers"], without_layers(params)
        zl_l, zl_o = zl.sub("layers"), zl.without("layers")
        if zl.per_layer:  # the embedding's and head's gradient left the ticks reduced, as the layers'
            zl_o = dataclasses.replace(zl_o, rest_reduced=True)
        # pipeline.overlap_grad_reduce: chunks final before the last tick leave the loop reduced, the others
        # as partial sums (one reduction per chunk)
        early = {c for _, cs in self.program.grad_cuts for c in cs}
        by_chunk = bool(early)
        gl_specs = tuple(zl_l.reduced_specs() if c in early else zl_l.partial_specs() for c in range(self.program.v)) \
            if by_chunk else zl_l.partial_specs()  # fmt: skip
        f = jax.shard_map(
            functools.partial(self._body, zl_l=zl_l, zl_o=zl_o),
            mesh=mesh,
            in_specs=(zl_l.local_compute(), zl_o.local_compute(), *(bspec,) * len(batch)),
            out_specs=(P(), gl_specs, zl_o.partial_specs(), P()),
            axis_names=set(manual_axes(mesh)),
            check_vma=False,
        )
        loss, gl, go, metrics = f(layers, other, *batch)
        # ZeRO >= 1: one reduce-scatter per leaf (per chunk and leaf: a chunk's depends on no tick
        # after its grad cut, so it can run beside them)
        if by_chunk:
            gl = _join_chunks(mesh, [g if c in early else zl_l.finish(g) for c, g in enumerate(gl)], zl_l.grads)
        else:
            gl = zl_l.finish(gl)
        go = zl_o.finish(go)
        gspec = zl.grads
        if self.placement == "model":
            gl, gspec = lsplit.from_pipeline(gl), self.model_zero.grads
        # the float32 sums, as the microbatch scan leaves them: the step casts them to the param dtype
        # unless the optimizer keeps a float32 master (then Adam takes them as they are)
        return loss, _wsc(mesh, {**go, "layers": gl}, gspec), metrics

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
        bspec = P(None, batch_axes(mesh), CONTEXT)  # [M, B, S]: rows over DP, tokens over 'context'
        split = lambda a: a.reshape(a.shape[0] // m, m, *a.shape[1:]).swapaxes(0, 1)
        batch = (tokens, labels) if segment_ids is None else (tokens, labels, segment_ids)
        return params, [lax.with_sharding_constraint(split(a), NamedSharding(mesh, bspec)) for a in batch], bspec

    def _body(self, layers, other, tok, lab, *seg, zl_l: ZeroShardings, zl_o: ZeroShardings):
        fetch = use_layer_fetch(zl_l.layer_fetch())  # offload.params: layers fetched inside the scan
        with use_rules(self.mesh, compute_rules(self.fns.sequence_parallel), manual=MANUAL), fetch:
            run_cls = OpRun if self.program.per_op else StageRun  # zb-h1: one op per stage per tick
            run = run_cls(self.spec, layers, other, tok, lab, seg[0] if seg else None)
            carry = run.ticks()
            # One data-parallel reduction per step, after the loop: psum here; leaves that ZeRO
            # scatters leave as per-rank partial sums for `ZeroShardings.finish`.
            if self.program.grad_cuts:  # the final chunks reduced in the ticks after their cut, the others here
                early = carry["early"]
                gl = tuple(early[c] if c in early else zl_l.reduce_local(run.chunk_grads(carry["g_layers"], c))
                           for c in range(self.program.v))  # fmt: skip
            else:
                gl = zl_l.reduce_local(run.layer_grads(carry["g_layers"]))
            go = zl_o.reduce_local(carry["g_other"], extra=("pipe",))
            live = manual_axes(self.mesh)
            loss, metrics = contract.finish(
                self.fns, lax.psum(carry["loss"], live), run.n_tok, lax.psum(carry["aux"], live), run.n_seq
            )
            return loss, gl, go, metrics


def _join_chunks(mesh, chunks: list, specs):
    """A stage's reduced chunk gradients [Lc, ...] each (leading axis over 'pipe') -> its [v*Lc, ...] in
    the pipeline placement: a local concatenation on every device, no data moved between them."""
    body = lambda *cs: jax.tree.map(lambda *xs: jnp.concatenate(xs, 0), *cs)
    return jax.shard_map(body, mesh=mesh, in_specs=(specs,) * len(chunks), out_specs=specs, check_vma=False)(*chunks)


def _wsc(mesh, tree, specs):
    return jax.tree.map(lambda a, sp: lax.with_sharding_constraint(a, NamedSharding(mesh, sp)), tree, specs)
