"""SPMD pipeline executor: GPipe, 1F1B and interleaved 1F1B as one `shard_map` over a tick loop.

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
  sends both ways does it in one collective-permute (a swap).
* Backward is an explicit per-stage `jax.vjp`. Residuals (default) : the activation-dependent leaves
  of the vjp pytree go into a fixed buffer of `slots` = max over stages of `max_in_flight` (+1 trash
  slot that idle ticks write to); weight-only leaves (found by tracing dependence through the
  model's layer scan) are rebuilt in the backward by a dummy forward XLA removes (`stage.py`). For
  1F1B the lockstep table keeps at most min(m, 2(p-1-s)+1) microbatches in flight on stage s, so the
  buffer has min(m, 2p-1) slots whatever m is. `residuals='recompute'` keeps only the stage input
  and re-runs the forward in the backward (one more TP all-reduce per layer; less memory).
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
  or an uneven split the executor moves them to the pipeline layout ([p, v, lmax], chunks padded to
  the largest count, `LayerSplit.to_pipeline`) inside the step, which moves weights across 'pipe' once
  per step; pass `layout='pipeline'` with params already stored that way (and get grads back that
  way) to avoid it. Uneven chunks skip their padding (`stage.uneven_apply`).
* What a tick costs (compiled HLO and timings on 8 simulated CPU devices; see bench/compare.py):
  a dynamic chunk index copied every weight of the stage and its gradient sums on every tick, so
  with v = 1 the stage's layers are used in place; idle stages ran the stage on dummy data, so
  forward and backward sit in a per-device `lax.cond` (its predicate is the same across a
  tensor/expert group, so collectives inside stay matched); two permutes per tick became one swap
  at p = 2. What is left per tick is one microbatch's residuals moved into/out of the slot buffer
  and the stage's weight-gradient sums (as in any gradient accumulation), checked in the tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshrun.config import PipelineConfig
from meshrun.errors import ConfigError
from meshrun.family import contract
from meshrun.family.contract import ModelFns
from meshrun.parallel.sharding import DP_AXES, MANUAL, compute_rules, use_rules
from meshrun.parallel.zero import ZeroLayout, accum_zeros
from meshrun.pipeline.program import tick_program
from meshrun.pipeline.split import LayerSplit, layer_split
from meshrun.pipeline.stage import activation_residuals, uneven_apply


class Pipeline:
    """A pipelined loss-and-grads step of a `ModelFns` model:
    `Pipeline(fns, pcfg, mesh)(params, tokens, labels) -> (loss, grads, metrics)` (jitted), or
    `loss_and_grads(...)` to trace it inside a caller's jit (the train step).

    params: nnx.State or a nested dict of arrays; its logical axis names come from `fns.param_names`.
    'layers' leaves are stacked [L, ...] in model order (unless layout='pipeline'); the other leaves
    (embedding, final norm, head) are replicated over 'pipe'. tokens, labels: [global batch, S] int.
    grads come back as the same container type, in the same layout, in the ZeRO grad layout
    (`zero`: a stage, or the step's `ZeroLayout`). metrics: `contract.finish`, as on one device."""

    def __init__(
        self,
        fns: ModelFns,
        pcfg: PipelineConfig,
        mesh: Mesh,
        *,
        zero: int | ZeroLayout = 0,
        residuals: str = "store",
        layout: str = "model",
        nan_bubbles: bool = False,
        skip_idle: bool = True,
        split: LayerSplit | None = None,
    ):
        if residuals not in ("store", "recompute"):
            raise ConfigError("residuals", residuals, "use 'store' or 'recompute'")
        if layout not in ("model", "pipeline"):
            raise ConfigError("layout", layout, "use 'model' or 'pipeline'")
        self.fns, self.pcfg, self.mesh = fns, pcfg, mesh
        self.zero = zero if isinstance(zero, ZeroLayout) else None
        self.zero_stage = zero.stage if isinstance(zero, ZeroLayout) else int(zero)
        self.residuals, self.layout, self.nan_bubbles = residuals, layout, nan_bubbles
        self.skip_idle = skip_idle
        self.p = int(mesh.shape.get("pipe", 1))
        self.dp = int(np.prod([mesh.shape.get(a, 1) for a in DP_AXES]))
        self.program = tick_program(pcfg, self.p)
        self.split = split
        self._model_zero: ZeroLayout | None = None
        self._jit = jax.jit(self.loss_and_grads)

    # ------------------------------------------------------------ checks and containers

    def check(self, params, tokens) -> None:
        n = jax.tree.leaves(params["layers"])[0].shape[0]
        if self.split is None:
            lps = self.pcfg.layers_per_stage
            units = sum(lps) if lps and self.layout == "pipeline" else n
            self.split = layer_split(self.pcfg, units, self.p)
        want = self.split.padded if self.layout == "pipeline" else self.split.n
        if n != want:
            raise ConfigError(
                "params['layers']",
                n,
                f"pass {want} stacked layers ({self.layout} layout of the split {list(self.split.counts)})",
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

    def _layout_for(self, params) -> ZeroLayout:
        """The step's ZeroLayout (of the pipeline layout); in model layout also the model-order one
        (`_model_zero`: an uneven split's [L] layer axis may not divide over 'pipe')."""
        if self.zero is None or (self._model_zero is None and self.layout == "model"):
            if self.fns.param_names is None:
                raise ConfigError("ModelFns.param_names", None, "give the logical axis names of the params tree")
            build = lambda t: ZeroLayout.build(self.fns.param_names, t, self.mesh, self.zero_stage)  # noqa: E731
            if self.layout == "model":
                self._model_zero = build(params)
                run = {**params, "layers": jax.eval_shape(self.split.to_pipeline, params["layers"])}
                self.zero = self.zero or build(run)
            else:
                self.zero = build(params)
        return self.zero

    def __call__(self, params, tokens, labels, segment_ids=None):
        from flax import nnx

        arrays = params.to_pure_dict() if isinstance(params, nnx.State) else dict(params)
        self.check(arrays, tokens)
        self._layout_for(arrays)
        loss, grads, metrics = self._jit(arrays, tokens, labels, segment_ids)
        if isinstance(params, nnx.State):
            out = jax.tree.map(lambda a: a, params)
            nnx.replace_by_pure_dict(out, grads)
            grads = out
        return loss, grads, metrics

    def lower(self, params, tokens, labels):
        from flax import nnx

        arrays = params.to_pure_dict() if isinstance(params, nnx.State) else dict(params)
        self.check(arrays, tokens)
        self._layout_for(arrays)
        return self._jit.lower(arrays, tokens, labels)

    # ------------------------------------------------------------ the step

    def loss_and_grads(self, params, tokens, labels, segment_ids=None):
        """(loss, grads in the ZeRO grad layout, metrics); traceable inside a caller's jit.
        `segment_ids` (packed documents) reach every stage's layers with the microbatch's tokens."""
        mesh, lsplit, zl = self.mesh, self.split, self._layout_for(params)
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
        if self.layout == "model":
            gl, gspec = lsplit.from_pipeline(gl), self._model_zero.grads
        grads = jax.tree.map(lambda g, a: g.astype(a.dtype), {**go, "layers": gl}, params)  # fp32 sums -> param dtype
        return loss, _wsc(mesh, grads, gspec), metrics

    def placed(self, params, tokens, labels, segment_ids=None):
        """(params in the padded pipeline layout, gathered; the batch arrays as [M, B, S] microbatches;
        their spec): what the shard_map over the tick loop takes (also `pipeline/forward.py`)."""
        mesh, m, lsplit = self.mesh, self.program.m, self.split
        if lsplit is None:
            raise ConfigError("Pipeline.split", None, "call the Pipeline (or .lower) once, or pass split=")
        zl = self._layout_for(params)
        if self.layout == "model":  # model order [L] -> padded pipeline layout [p*v*lmax] (moves weights)
            params = _wsc(mesh, params, self._model_zero.store)
            params = {**params, "layers": _wsc(mesh, lsplit.to_pipeline(params["layers"]), zl.sub("layers").store)}
        params = zl.gather(_wsc(mesh, params, zl.store))  # ZeRO-3: all-gather the DP-sharded dims once per step
        # Microbatch j = rows j, m+j, 2m+j, ...: each data shard's rows split into m local
        # microbatches without moving token ids between devices (row order does not change the sums).
        bspec = P(None, DP_AXES)
        split = lambda a: a.reshape(a.shape[0] // m, m, *a.shape[1:]).swapaxes(0, 1)  # noqa: E731
        batch = (tokens, labels) if segment_ids is None else (tokens, labels, segment_ids)
        return params, [lax.with_sharding_constraint(split(a), NamedSharding(mesh, bspec)) for a in batch], bspec

    def _body(self, layers, other, tok, lab, *seg, zl_l: ZeroLayout, zl_o: ZeroLayout):
        with use_rules(self.mesh, compute_rules(self.fns.sequence_parallel), manual=MANUAL):
            if self.program.per_op:  # zb-h1 (imported here: per_op builds on this module's _StageRun)
                from meshrun.pipeline.per_op import OpRun as run_cls
            else:
                run_cls = _StageRun
            run = run_cls(self, layers, other, tok, lab, seg[0] if seg else None)
            carry = run.ticks()
            # One data-parallel reduction per step, after the loop: psum here; leaves that ZeRO
            # scatters leave as per-rank partial sums for `ZeroLayout.finish`.
            gl = carry["g_layers"]
            if run.v > 1:
                gl = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), gl)
            gl = zl_l.reduce_local(gl)
            go = zl_o.reduce_local(carry["g_other"], extra=("pipe",))
            loss, metrics = contract.finish(
                self.fns, lax.psum(carry["loss"], MANUAL), run.n_tok, lax.psum(carry["aux"], MANUAL), run.n_seq
            )
            return loss, gl, go, metrics


class _StageRun:
    """One device's view of the tick loop inside the shard_map: its stage's chunks, the microbatches
    of its data shard, the carry (activations in flight, residual buffer, gradient sums)."""

    def __init__(self, pl: Pipeline, layers, other, tok, lab, seg=None):
        prog = pl.program
        self.pl, self.fns, self.prog, self.other, self.tok, self.lab = pl, pl.fns, prog, other, tok, lab
        self.seg = seg  # [M, B, S] segment ids (packed documents) or None
        self.p, self.v, self.m, self.split = pl.p, prog.v, prog.m, pl.split
        self.stage = lax.axis_index("pipe")
        self.fill = jnp.nan if pl.nan_bubbles else 0.0
        self.counts = jnp.asarray(self.split.counts, jnp.int32)  # per virtual stage
        lc = self.split.lmax
        # v = 1: the stage's layers are used as they are (a dynamic chunk index would copy every
        # weight, and its gradient accumulator, on every tick).
        self.layers_v = layers if self.v == 1 else jax.tree.map(lambda a: a.reshape(self.v, lc, *a.shape[1:]), layers)
        self.x_aval = jax.eval_shape(self.fns.embed, other, tok[0])
        self.x_zero = jnp.zeros(self.x_aval.shape, self.x_aval.dtype)

        # Total tokens first, from the labels alone: each head backward then uses the exact 1/N.
        flat = lambda a: a.reshape(-1, *a.shape[2:])  # noqa: E731
        n_local = contract.token_count(self.fns, other, flat(tok), flat(lab))
        self.n_tok = lax.psum(n_local, tuple(a for a in DP_AXES if a in pl.mesh.shape))
        self.n_seq = self.m * tok.shape[1] * pl.dp

        _, self.aux_aval = jax.eval_shape(self.fns.apply_layers, self.chunk(0), self.x_zero)
        weights = dict(self.fns.aux_weights(self.n_seq))
        self.aux_cot = {k: jnp.asarray(float(weights.get(k, 0.0)), a.dtype) for k, a in self.aux_aval.items()}
        if pl.residuals == "store":
            # segment ids are data, not activations: leaves that depend on them alone are rebuilt
            # in the backward from the same microbatch's ids, like the weight-only leaves
            stage0 = lambda lp, x, seg=None: self.apply(0, seg)(lp, x)  # noqa: E731
            self.mask, avals = activation_residuals(stage0, self.chunk(0), self.x_zero, self._seg(0))
            self.res_avals = [a for a, d in zip(avals, self.mask, strict=True) if d]
        else:
            self.mask, self.res_avals = None, [self.x_aval]
        self.nslot = prog.slots + 1  # the last slot takes idle ticks' writes

    # ------------------------------------------------------------ helpers

    def _seg(self, mb):
        return None if self.seg is None else _take(self.seg, mb)

    def apply(self, c, seg=None):
        """The stage function of chunk c (segment ids `seg` bound): the model's `apply_layers`, or with
        an uneven split one that skips the chunk's padding entries (its count is counts[c*p + stage])."""
        return stage_fn(self.pl, contract.layers_fn(self.fns, seg), c, self.stage)

    def chunk(self, c):
        if self.v == 1:
            return self.layers_v
        return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, c, 0, keepdims=False), self.layers_v)

    def add_grads(self, g_layers, d_p, ch):
        if self.v == 1:
            return jax.tree.map(lambda g, d: g + d.astype(g.dtype), g_layers, d_p)
        return jax.tree.map(lambda g, d: _put(g, ch, _take(g, ch) + d.astype(g.dtype)), g_layers, d_p)

    def full(self, shape, dtype):
        return jnp.full(shape, self.fill, dtype)

    def zeros_other(self):
        return jax.tree.map(jnp.zeros_like, self.other)

    def init_carry(self) -> dict:
        xs = self.x_aval
        carry = {
            "x_in": self.full(xs.shape, xs.dtype),
            "g_in": self.full(xs.shape, xs.dtype),
            # model.remat=offload: residuals the policy put in host memory keep their slots there too
            "res": [_placed(self.full((self.nslot, *a.shape), a.dtype), a) for a in self.res_avals],
            "g_layers": accum_zeros(self.layers_v),  # float32 sums, also for 16-bit params
            "g_other": accum_zeros(self.other),
            "loss": jnp.zeros((), jnp.float32),
            "aux": {k: jnp.zeros((), a.dtype) for k, a in self.aux_aval.items()},
        }
        if not self.prog.fused_head:
            carry["dy"] = self.full((self.nslot, *xs.shape), xs.dtype)
        return carry

    def cell(self, row, kind):
        """This stage's forward ('f') or backward ('b') task of a tick: idle cells (mb = -1) run on
        microbatch/chunk 0 into the trash slot and are masked out."""
        mb_raw = row[f"{kind}_mb"][self.stage]
        valid = mb_raw >= 0
        mb, ch = jnp.maximum(mb_raw, 0), jnp.maximum(row[f"{kind}_chunk"][self.stage], 0)
        slot = jnp.where(valid, row[f"{kind}_slot"][self.stage], self.nslot - 1)
        k = ch * self.p + self.stage  # virtual stage
        return valid, mb, ch, slot, valid & (k == 0), valid & (k == self.v * self.p - 1)

    # ------------------------------------------------------------ one forward / one backward

    def forward(self, c, row):
        """This tick's forward on this stage. With `skip_idle`, idle stages skip the compute (`lax.cond`
        on a predicate shared by the whole tensor/expert group, so collectives inside stay matched);
        either way an idle cell writes into the trash slot and adds nothing to the sums."""
        xs = self.x_aval
        valid, mb, ch, slot, first, last = self.cell(row, "f")
        x_in = c["x_in"]

        def run():
            return self.stage_forward(ch, mb, first, last, x_in)

        def idle():
            aux = {k: jnp.zeros(a.shape, a.dtype) for k, a in self.aux_aval.items()}
            keep = [_placed(self.full(a.shape, a.dtype), a) for a in self.res_avals]
            return (
                self.full(xs.shape, xs.dtype),
                keep,
                aux,
                jnp.zeros((), jnp.float32),
                self.zeros_other(),
                self.x_zero,
            )

        if self.pl.skip_idle:
            y, keep, aux, ls, d_o, dy = lax.cond(valid, run, idle)
        else:  # compute anyway on fill values: the residuals go to the trash slot, the sums are masked
            x_in = jnp.where(valid, x_in, self.fill)
            y, keep, aux, ls, d_o, dy = run()
            aux = {k: jnp.where(valid, a, 0) for k, a in aux.items()}
        c = dict(c, res=[_put(b, slot, r) for b, r in zip(c["res"], keep, strict=True)])
        c["aux"] = {k: c["aux"][k] + aux[k] for k in c["aux"]}
        c["loss"] = c["loss"] + ls
        c["g_other"] = jax.tree.map(jnp.add, c["g_other"], d_o)
        if not self.prog.fused_head:
            c["dy"] = _put(c["dy"], slot, dy)
        return c, y, dy

    def backward(self, c, row, dy_head):
        """This tick's backward on this stage (idle cells as in `forward`)."""
        valid, mb, ch, slot, first, last = self.cell(row, "b")
        if not self.prog.fused_head:
            dy_head = _take(c["dy"], slot)
        dy = jnp.where(last, dy_head, c["g_in"])
        chunk_aval = jax.eval_shape(lambda: self.chunk(ch))

        def run():  # reads its residuals itself: an operand slice taken outside the cond is a copy
            saved = [_take(b, slot) for b in c["res"]]
            d_p, dx = self.pullback(ch, mb, saved)((dy, self.aux_cot))
            return d_p, dx, self.embed_grad(first, mb, dx)

        def idle():
            d_p = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), chunk_aval)
            return d_p, self.full(self.x_aval.shape, self.x_aval.dtype), self.zeros_other()

        if self.pl.skip_idle:
            d_p, dx, d_o = lax.cond(valid, run, idle)
        else:  # compute anyway on fill values and mask the weight gradients
            dy = jnp.where(valid, dy, self.fill)
            d_p, dx, d_o = run()
            d_p = jax.tree.map(lambda d: jnp.where(valid, d, 0), d_p)
        c = dict(c)
        c["g_layers"] = self.add_grads(c["g_layers"], d_p, ch)
        c["g_other"] = jax.tree.map(jnp.add, c["g_other"], d_o)
        return c, dx

    def stage_forward(self, ch, mb, first, last, x_in):
        """Chunk `ch` forward on microbatch `mb` (stage input: its embedding on the first virtual
        stage, else `x_in`): (y, residuals to store, aux, loss sum, head param grads, dL/dy of the
        head), the last three from the head + loss on the last virtual stage (zeros elsewhere)."""
        fns, xs = self.fns, self.x_aval
        x = lax.cond(first, lambda: fns.embed(self.other, _take(self.tok, mb)).astype(xs.dtype), lambda: x_in)
        (y, aux), vjp = jax.vjp(self.apply(ch, self._seg(mb)), self.chunk(ch), x)
        keep = [x]
        if self.mask is not None:  # only the activation-dependent leaves of the vjp are stored
            keep = [r for r, d in zip(jax.tree.leaves(vjp), self.mask, strict=True) if d]

        def head():
            hl = lambda o, a: fns.head_loss(o, a, _take(self.lab, mb))  # noqa: E731
            ls, hvjp, _ = jax.vjp(hl, self.other, y, has_aux=True)
            d_o, dy = hvjp(jnp.asarray(1.0, ls.dtype) / self.n_tok.astype(ls.dtype))
            return ls.astype(jnp.float32), d_o, dy.astype(xs.dtype)

        head_out = lax.cond(last, head, lambda: (jnp.zeros((), jnp.float32), self.zeros_other(), self.x_zero))
        return (y, keep, aux, *head_out)

    def pullback(self, ch, mb, saved):
        """The vjp of chunk `ch` on microbatch `mb` from its saved residuals: the stored activation
        leaves plus the weight-only leaves rebuilt by a dummy forward XLA removes ('store'), or a
        forward re-run from the saved stage input ('recompute')."""
        if self.mask is None:
            return jax.vjp(self.apply(ch, self._seg(mb)), self.chunk(ch), saved[0])[1]
        _, tmpl = jax.vjp(self.apply(ch, self._seg(mb)), self.chunk(ch), self.x_zero)
        leaves, tdef = jax.tree.flatten(tmpl)
        it = iter(saved)
        return jax.tree.unflatten(tdef, [next(it) if d else lf for lf, d in zip(leaves, self.mask, strict=True)])

    def embed_grad(self, first, mb, dx):
        """The embedding's gradient from the first virtual stage's input gradient (zeros elsewhere)."""

        def run():
            _, evjp = jax.vjp(lambda o: self.fns.embed(o, _take(self.tok, mb)), self.other)
            return evjp(dx.astype(self.x_aval.dtype))[0]

        return lax.cond(first, run, self.zeros_other)

    # ------------------------------------------------------------ the tick loop

    def run_tick(self, c, row, kind):
        """This stage's work in one tick of a phase of `kind`: (carry, activation to send forward,
        gradient to send back)."""
        y = dx = dy = self.x_zero
        if "F" in kind:
            c, y, dy = self.forward(c, row)
        if "B" in kind:
            c, dx = self.backward(c, row, dy)
        return c, y, dx

    def ticks(self) -> dict:
        """Run every phase of the program (one `lax.scan` per run of same-kind ticks)."""
        p, v = self.p, self.v
        n = p if v > 1 else p - 1  # interleaved wraps: the last stage's chunk c feeds stage 0's chunk c+1
        fwd_perm = [(i, (i + 1) % p) for i in range(n)]
        bwd_perm = [((i + 1) % p, i) for i in range(n)]

        def tick(kind, send_f, send_b):
            def body(c, row):
                c, y, dx = self.run_tick(c, row, kind)
                if send_f and send_b and p == 2:
                    # Two stages: both directions are one swap, so activations and gradients travel in
                    # ONE collective-permute (one rendezvous of every device per tick, not two).
                    if v == 1:  # stage 0 sends only activations, stage 1 only gradients
                        c["x_in"] = c["g_in"] = lax.ppermute(jnp.where(self.stage == 0, y, dx), "pipe", SWAP)
                    else:
                        c["x_in"], c["g_in"] = lax.ppermute(jnp.stack([y, dx]), "pipe", SWAP)
                    return c, None
                if send_f:
                    c["x_in"] = lax.ppermute(y, "pipe", fwd_perm)
                if send_b:
                    c["g_in"] = lax.ppermute(dx, "pipe", bwd_perm)
                return c, None

            return body

        carry = self.init_carry()
        for kind, t0, t1, send_f, send_b in self.prog.phases:
            xs = {k: jnp.asarray(a[t0:t1]) for k, a in self.prog.tables.items()}
            carry, _ = lax.scan(tick(kind, send_f, send_b), carry, xs)
        return carry


SWAP = [(0, 1), (1, 0)]


def stage_fn(pl: Pipeline, apply, c, stage):
    """`apply` (layer_params, x) -> (x, aux) as chunk c of `stage` runs it: as is for an even split,
    else skipping the chunk's padding entries (`stage.uneven_apply`, count split.counts[c*p + stage])."""
    if pl.split.even:
        return apply
    n = jnp.asarray(pl.split.counts, jnp.int32)[c * pl.p + stage]
    return functools.partial(uneven_apply, apply, pl.split.lmin, n)


def _wsc(mesh, tree, specs):
    return jax.tree.map(lambda a, sp: lax.with_sharding_constraint(a, NamedSharding(mesh, sp)), tree, specs)


def _put(buf, i, x):
    return lax.dynamic_update_index_in_dim(buf, x, i, 0)


def _placed(x, aval):
    """x in the memory space of `aval` (host for residuals an offloading remat policy put there)."""
    space = getattr(aval, "memory_space", None)
    return x if space is None or space == jax.typeof(x).memory_space else jax.device_put(x, space)


def _take(buf, i):
    return lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)
