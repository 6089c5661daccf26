"""One device's view of the pipeline tick loop (`StageRun`), shared by the executor's lockstep
programs (`executor.Pipeline`) and the per-op zb-h1 program (`per_op.OpRun`, a subclass); the buffer
helpers `put` / `take` / `placed` and `stage_fn` (a chunk's layer function, uneven splits skipping
their padding) are used by the forward-only pipeline too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from meshrun.family import contract
from meshrun.parallel.layer_fetch import host_zeros, on_host, shadowed
from meshrun.parallel.sharding import GRAD_AXES
from meshrun.parallel.zero import accum_zeros, zeros_like_shapes
from meshrun.pipeline import bw_split, schedules
from meshrun.pipeline.residuals import activation_residuals
from meshrun.pipeline.spec import PipelineSpec
from meshrun.pipeline.split import LayerSplit, uneven_apply


class StageRun:
    """One device's view of the tick loop inside the shard_map: its stage's chunks, the microbatches
    of its data shard, the carry (activations in flight, residual buffer, gradient sums)."""

    flat_chunks = False  # v > 1: keep the stage's layers (and their sums) as [v*Lc, ...]

    def __init__(self, spec: PipelineSpec, layers, other, tok, lab, seg=None):
        prog = spec.program
        self.spec, self.fns, self.prog, self.other, self.tok, self.lab = spec, spec.fns, prog, other, tok, lab
        self.seg = seg  # [M, B, S] segment ids (packed documents) or None
        self.p, self.v, self.m, self.split = spec.p, prog.v, prog.m, spec.split
        self.stage = lax.axis_index("pipe")
        self.fill = jnp.nan if spec.nan_bubbles else 0.0
        self.counts = jnp.asarray(self.split.counts, jnp.int32)  # per virtual stage
        self.zl = spec.zero.sub("layers")  # the layers' ZeRO shardings (`drain`'s reductions)
        # v = 1: the stage's layers are used as they are (a dynamic chunk index would copy every
        # weight, and its gradient accumulator, on every tick). v > 1: [v, Lc, ...], or with
        # `flat_chunks` the stage's [v*Lc, ...] as it comes, a chunk a dynamic slice of it (a reshape
        # whose leading chunk axis changes the layout made XLA copy the stage's weights once per step).
        self.layers_v = self.chunked(layers)
        # ZeRO-2 per microbatch, per-layer bf16 layers: each layer's gradient goes to float32 arrays of its
        # grad layout (`layer_fetch.Shadowed`), which the stage's vjp differentiates in place of the weights
        self.sums_v = jax.eval_shape(self.zl.layer_sums, layers) if self.zl.shadows(layers) else None
        self.sums_v = None if self.sums_v is None else jax.eval_shape(self.chunked, self.sums_v)
        # per layer: the embedding's, head's and final norm's gradient goes every microbatch to 1/DP
        # float32 sums (`ZeroShardings.rest_fetch`), as in the microbatch scan; else whole sums
        self.rest = spec.zero.rest_fetch()
        self.other_sums = jax.eval_shape(accum_zeros, other if self.rest is None else spec.zero.rest_sums(other))
        self.x_aval = jax.eval_shape(self.fns.embed, other, tok[0])
        self.x_zero = jnp.zeros(self.x_aval.shape, self.x_aval.dtype)

        # Total tokens first, from the labels alone: each head backward then uses the exact 1/N.
        flat = lambda a: a.reshape(-1, *a.shape[2:])
        n_local = contract.token_count(self.fns, other, flat(tok), flat(lab))
        self.n_tok = lax.psum(n_local, tuple(a for a in GRAD_AXES if a in spec.mesh.shape))
        self.n_seq = self.m * tok.shape[1] * spec.dp

        _, self.aux_aval = jax.eval_shape(self.fns.apply_layers, self.chunk(0), self.x_zero)
        weights = dict(self.fns.aux_weights(self.n_seq))
        self.aux_cot = {k: jnp.asarray(float(weights.get(k, 0.0)), a.dtype) for k, a in self.aux_aval.items()}
        if spec.residuals == "store":
            # segment ids are data, not activations: leaves that depend on them alone are rebuilt
            # in the backward from the same microbatch's ids, like the weight-only leaves
            stage0 = lambda lp, x, seg=None: self.diff_apply(0, seg)(lp, x)
            self.mask, avals = activation_residuals(stage0, self.diff_chunk(0), self.x_zero, self._seg(0))
            self.res_avals = [a for a, d in zip(avals, self.mask, strict=True) if d]
        else:
            self.mask, self.res_avals = None, [self.x_aval]
        self.nslot = prog.slots + 1  # the last slot takes idle ticks' writes

    # ------------------------------------------------------------ helpers

    def _seg(self, mb):
        return None if self.seg is None else take(self.seg, mb)

    def apply(self, c, seg=None):
        """The stage function of chunk c (segment ids `seg` bound): the model's `apply_layers`, or with
        an uneven split one that skips the chunk's padding entries (its count is counts[c*p + stage])."""
        return stage_fn(self.split, contract.layers_fn(self.fns, seg), c, self.stage)

    def chunked(self, tree):
        """A stage's stacked [v*Lc, ...] tree as `layers_v` holds it."""
        if self.v == 1 or self.flat_chunks:
            return tree
        return jax.tree.map(lambda a: a.reshape(self.v, self.split.lmax, *a.shape[1:]), tree)

    def chunk(self, c):
        if self.v == 1:
            return self.layers_v
        return jax.tree.map(lambda a: self.chunk_of(a, c), self.layers_v)

    def diff_chunk(self, c):
        """What the stage's vjp differentiates for chunk c: its weights, or with `sums_v` float32 zeros
        of one chunk of the sums (the fetch's forward never reads them: only their shape matters)."""
        if self.sums_v is None:
            return self.chunk(c)
        one = lambda s: s.shape if self.v == 1 else (self.split.lmax, *s.shape[1 if self.flat_chunks else 2 :])
        return jax.tree.map(lambda s: jnp.zeros(one(s), s.dtype), self.sums_v)

    def diff_apply(self, c, seg=None):
        """`apply(c, seg)` as a function of `diff_chunk(c)` (and x)."""
        f = self.apply(c, seg)
        if self.sums_v is None:
            return f
        return lambda d, x: f(shadowed(self.chunk(c), d), x)

    def chunk_of(self, a, c):
        """Chunk c of a stacked per-stage array (the layers or their sums)."""
        if self.flat_chunks:
            return lax.dynamic_slice_in_dim(a, c * self.split.lmax, self.split.lmax, 0)
        return take(a, c)

    def put_chunk(self, a, c, x):
        """`a` with chunk c replaced by x."""
        if self.flat_chunks:
            return lax.dynamic_update_slice_in_dim(a, x, c * self.split.lmax, 0)
        return put(a, c, x)

    def layer_grads(self, g_layers):
        """The stage's layer gradient sums as [v*Lc, ...]."""
        if self.v == 1 or self.flat_chunks:
            return g_layers
        return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), g_layers)

    def pullback_into(self, vjp, dy, g_layers, ch, keep=None):
        """(g_layers + chunk ch's weight gradients, dx) from the chunk's vjp: the backward's layer
        loop adds each layer's gradients into the float32 sums in place (`bw_split.vjp_into`), so
        the chunk's whole fresh gradient (param dtype) is never held beside the sums. `keep`: a cell
        that computes when idle adds zeros where it is false (its gradients come from fill values)."""
        if self.v == 1:
            return bw_split.vjp_into(vjp, (dy, self.aux_cot), g_layers, keep)
        g, dx = bw_split.vjp_into(vjp, (dy, self.aux_cot), jax.tree.map(lambda a: self.chunk_of(a, ch), g_layers), keep)
        return jax.tree.map(lambda a, n: self.put_chunk(a, ch, n), g_layers, g), dx

    def layer_sums(self):
        """Zero float32 sums of the stage's layers, where the layers rest (host memory: made a slice at a
        time); with `sums_v` of their grad layout."""
        sums = self.layers_v if self.sums_v is None else self.sums_v
        if any(on_host(a) for a in jax.tree.leaves(self.layers_v)):
            return host_zeros(jax.eval_shape(accum_zeros, sums))
        return accum_zeros(sums)

    def full(self, shape, dtype):
        return jnp.full(shape, self.fill, dtype)

    def zeros_other(self):
        """A zero gradient of the entries but the layers: as `other`, per layer of their 1/DP sums."""
        if self.rest is None:
            return jax.tree.map(jnp.zeros_like, self.other)
        return zeros_like_shapes(self.other_sums)

    def vjp_other(self, f, *xs, **kw):
        """`jax.vjp` of f(other, *xs); per layer in the zeros of `other`'s 1/DP sums, whose cotangent is
        the gradient reduced onto them (`rest`)."""
        if self.rest is None:
            return jax.vjp(f, self.other, *xs, **kw)
        return jax.vjp(lambda z, *a: f(self.rest(self.other, z), *a), self.zeros_other(), *xs, **kw)

    def init_carry(self) -> dict:
        xs = self.x_aval
        carry = {
            "x_in": self.full(xs.shape, xs.dtype),
            "g_in": self.full(xs.shape, xs.dtype),
            # model.remat=offload: residuals the policy put in host memory keep their slots there too
            "res": [placed(self.full((self.nslot, *a.shape), a.dtype), a) for a in self.res_avals],
            # float32 sums, also for 16-bit params; in host memory where the layers rest there
            # (offload.params: each layer's gradient is added in as the backward makes it)
            "g_layers": self.layer_sums(),
            "g_other": zeros_like_shapes(self.other_sums),
            "loss": jnp.zeros((), jnp.float32),
            "aux": {k: jnp.zeros((), a.dtype) for k, a in self.aux_aval.items()},
        }
        if not self.prog.fused_head:
            carry["dy"] = self.full((self.nslot, *xs.shape), xs.dtype)
        if self.prog.grad_cuts:  # pipeline.overlap_grad_reduce: the tick count, the final chunks' reduced layers
            carry["tick"], carry["early"] = jnp.zeros((), jnp.int32), {}
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
        on a predicate shared by the whole tensor/expert group, so collectives inside stay matched)
        and the idle branch passes the residual buffer and the sums through (XLA keeps them in place;
        writing fill values into the trash slot cost a residual-sized copy per idle cell). Without
        it an idle cell computes on fill values into the trash slot and adds nothing to the sums."""
        xs = self.x_aval
        valid, mb, ch, slot, first, last = self.cell(row, "f")
        x_in = c["x_in"]

        def run():
            y, keep, aux, ls, d_o, dy = self.stage_forward(ch, mb, first, last, x_in)
            res = [put(b, slot, r) for b, r in zip(c["res"], keep, strict=True)]
            return y, res, aux, ls, jax.tree.map(jnp.add, c["g_other"], d_o), dy

        def idle():  # the residual buffer and the head's gradient sums pass through
            aux = {k: jnp.zeros(a.shape, a.dtype) for k, a in self.aux_aval.items()}
            return self.full(xs.shape, xs.dtype), c["res"], aux, jnp.zeros((), jnp.float32), c["g_other"], self.x_zero

        if self.spec.skip_idle:
            y, res, aux, ls, g_o, dy = lax.cond(valid, run, idle)
        else:  # compute anyway on fill values: the residuals go to the trash slot, the sums are masked
            x_in = jnp.where(valid, x_in, self.fill)
            y, res, aux, ls, g_o, dy = run()
            aux = {k: jnp.where(valid, a, 0) for k, a in aux.items()}
        c = dict(c, res=res, g_other=g_o)
        c["aux"] = {k: c["aux"][k] + aux[k] for k in c["aux"]}
        c["loss"] = c["loss"] + ls
        if not self.prog.fused_head:
            c["dy"] = put(c["dy"], slot, dy)
        return c, y, dy

    def backward(self, c, row, dy_head):
        """This tick's backward on this stage (idle cells as in `forward`: the gradient sums pass
        through, no zero gradients are made and added)."""
        valid, mb, ch, slot, first, last = self.cell(row, "b")
        if not self.prog.fused_head:
            dy_head = take(c["dy"], slot)
        dy = jnp.where(last, dy_head, c["g_in"])

        def run():  # reads its residuals itself: an operand slice taken outside the cond is a copy
            saved = [take(b, slot) for b in c["res"]]
            vjp = self.pullback(ch, mb, saved)
            if self.spec.skip_idle:  # the layer loop adds each layer's weight gradients into the sums
                g_l, dx = self.pullback_into(vjp, dy, c["g_layers"], ch)
            else:  # computed on fill values: each layer's weight gradients are masked as they are added
                g_l, dx = self.pullback_into(vjp, dy, c["g_layers"], ch, valid)
            d_o = self.embed_grad(first, mb, dx)
            return g_l, dx, jax.tree.map(jnp.add, c["g_other"], d_o)

        def idle():  # the sums pass through: no zero gradients made and added on idle ticks
            return c["g_layers"], self.full(self.x_aval.shape, self.x_aval.dtype), c["g_other"]

        if self.spec.skip_idle:
            g_l, dx, g_o = lax.cond(valid, run, idle)
        else:  # compute anyway on fill values
            dy = jnp.where(valid, dy, self.fill)
            g_l, dx, g_o = run()
        return dict(c, g_layers=g_l, g_other=g_o), dx

    def stage_forward(self, ch, mb, first, last, x_in):
        """Chunk `ch` forward on microbatch `mb` (stage input: its embedding on the first virtual
        stage, else `x_in`): (y, residuals to store, aux, loss sum, head param grads, dL/dy of the
        head), the last three from the head + loss on the last virtual stage (zeros elsewhere)."""
        fns, xs = self.fns, self.x_aval
        x = lax.cond(first, lambda: fns.embed(self.other, take(self.tok, mb)).astype(xs.dtype), lambda: x_in)
        (y, aux), vjp = jax.vjp(self.diff_apply(ch, self._seg(mb)), self.diff_chunk(ch), x)
        keep = [x]
        if self.mask is not None:  # only the activation-dependent leaves of the vjp are stored
            keep = [r for r, d in zip(jax.tree.leaves(vjp), self.mask, strict=True) if d]

        def head():
            hl = lambda o, a: fns.head_loss(o, a, take(self.lab, mb))
            ls, hvjp, _ = self.vjp_other(hl, y, has_aux=True)
            d_o, dy = hvjp(jnp.asarray(1.0, ls.dtype) / self.n_tok.astype(ls.dtype))
            return ls.astype(jnp.float32), d_o, dy.astype(xs.dtype)

        head_out = lax.cond(last, head, lambda: (jnp.zeros((), jnp.float32), self.zeros_other(), self.x_zero))
        return (y, keep, aux, *head_out)

    def pullback(self, ch, mb, saved):
        """The vjp of chunk `ch` on microbatch `mb` from its saved residuals: the stored activation
        leaves plus the weight-only leaves rebuilt by a dummy forward XLA removes ('store'), or a
        forward re-run from the saved stage input ('recompute')."""
        if self.mask is None:
            return jax.vjp(self.diff_apply(ch, self._seg(mb)), self.diff_chunk(ch), saved[0])[1]
        _, tmpl = jax.vjp(self.diff_apply(ch, self._seg(mb)), self.diff_chunk(ch), self.x_zero)
        leaves, tdef = jax.tree.flatten(tmpl)
        it = iter(saved)
        return jax.tree.unflatten(tdef, [next(it) if d else lf for lf, d in zip(leaves, self.mask, strict=True)])

    def embed_grad(self, first, mb, dx):
        """The embedding's gradient from the first virtual stage's input gradient (zeros elsewhere)."""

        def run():
            _, evjp = self.vjp_other(lambda o: self.fns.embed(o, take(self.tok, mb)))
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

        def tick(kind, send_f, send_b, draining):
            def body(c, row):
                c = self.drain(c, draining)
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
            for s0, s1, draining in self.segments(t0, t1):
                xs = {k: jnp.asarray(a[s0:s1]) for k, a in self.prog.tables.items()}
                carry, _ = lax.scan(tick(kind, send_f, send_b, draining), carry, xs)
            self.start_drain(carry, t1)
        return carry

    # ------------------------------------------------------------ pipeline.overlap_grad_reduce

    def start_drain(self, carry, t: int) -> None:
        """After the phase that ends at tick t: for each chunk whose gradients are final there
        (`TickProgram.grad_cuts`), a buffer for its reduced layers (their grad layout: ZeRO >= 1 a
        1/dp shard), which the ticks after the cut fill a few layers each (`drain`)."""
        for tick, chunks in self.prog.grad_cuts:
            if tick == t:
                for c in chunks:
                    row = jax.tree.map(lambda a, c=c: self.row_of(a, c, 0), carry["g_layers"])
                    red = jax.eval_shape(self.zl.reduce_rows, row)
                    carry["early"] = {
                        **carry["early"],
                        c: jax.tree.map(lambda r: jnp.zeros((self.split.lmax, *r.shape[1:]), r.dtype), red),
                    }

    def segments(self, t0: int, t1: int, u: int = 1) -> list[tuple[int, int, tuple]]:
        """The phase [t0, t1) (scan body of u ticks) as (start, end, draining) scans: `draining` holds
        (cut, chunks, k) for the chunks final at a cut <= start whose layers are not all reduced yet:
        k = ceil(Lc / ticks after the cut) layers per tick, over ceil(Lc / k) ticks from the cut (a
        scan ends there, rounded up to whole bodies)."""
        lc, plan, bounds = self.split.lmax, [], {t0, t1}
        for cut, chunks in self.prog.grad_cuts:
            k, n = schedules.drain(lc, self.prog.ticks - cut)
            end = cut + n
            plan.append((cut, chunks, k, end))
            if t0 < end < t1 and (e := t0 + -(-(end - t0) // u) * u) < t1:
                bounds.add(e)
        b = sorted(bounds)
        return [(s0, s1, tuple((cut, chunks, k) for cut, chunks, k, end in plan if cut <= s0 < end))
                for s0, s1 in zip(b, b[1:])]  # fmt: skip

    def drain(self, c, draining: tuple) -> dict:
        """The start of a tick: each chunk of `draining` (`segments`) reduces its next k layers
        (`ZeroShardings.reduce_rows`) into its buffer. The rows are read before the tick's ops and
        nothing the tick computes reads the result, so the reduction may run beside the tick's
        compute; it holds k layers' rows at a time. Counts the ticks."""
        if not self.prog.grad_cuts:
            return c
        c = dict(c, early=dict(c["early"]))
        n_layers = self.split.lmax
        for cut, chunks, k in draining:
            for ch in chunks:
                for i in range(k):
                    li = jnp.minimum((c["tick"] - cut) * k + i, n_layers - 1)
                    red = self.zl.reduce_rows(
                        jax.tree.map(lambda a, ch=ch, li=li: self.row_of(a, ch, li), c["g_layers"])
                    )
                    put_row = lambda b, r, li=li: lax.dynamic_update_slice_in_dim(b, r, li, 0)
                    c["early"][ch] = jax.tree.map(put_row, c["early"][ch], red)
        c["tick"] = c["tick"] + 1
        return c

    def row_of(self, a, c: int, li):
        """Row li (traced) of chunk c of the stacked layer sums, as [1, ...]."""
        if self.flat_chunks:
            return lax.dynamic_slice_in_dim(a, c * self.split.lmax + li, 1, 0)
        return lax.dynamic_slice_in_dim(take(a, c), li, 1, 0)

    def chunk_grads(self, g_layers, c: int):
        """Chunk c's gradient sums [Lc, ...] from the final carry's `g_layers`."""
        return jax.tree.map(lambda a: self.chunk_of(a, c), g_layers)


SWAP = [(0, 1), (1, 0)]


def stage_fn(split: LayerSplit, apply, c, stage):
    """`apply` (layer_params, x) -> (x, aux) as chunk c of `stage` runs it: as is for an even split,
    else skipping the chunk's padding entries (`split.uneven_apply`, its count `split.count(c, stage)`)."""
    if split.even:
        return apply
    n = split.count(c, stage)
    return functools.partial(uneven_apply, apply, split.lmin, n)


def put(buf, i, x):
    """buf[i] = x along the leading axis (traceable i)."""
    return lax.dynamic_update_index_in_dim(buf, x, i, 0)


def placed(x, aval):
    """x in the memory space of `aval` (host for residuals an offloading remat policy put there)."""
    space = getattr(aval, "memory_space", None)
    return x if space is None or space == jax.typeof(x).memory_space else jax.device_put(x, space)


def take(buf, i):
    """buf[i] along the leading axis (traceable i)."""
    return lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)
