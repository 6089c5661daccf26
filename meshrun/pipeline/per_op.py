"""ZB-H1 on the executor: the per-op timeline run as is, one op per stage per tick.

Qi et al. (2023) split a stage's backward into B (the input gradient, on the critical path) and W
(the weight gradients, needed only by the optimizer) and schedule W's into the bubbles. Here both
are pullbacks of the same forward residuals: B runs `vjp((dy, aux))` keeping dx, W runs it again
keeping the weight gradients, from the residuals stored in F (no forward is recomputed) and dy kept
from B. XLA drops what each one does not use (B never forms a weight gradient; W never forms the
stage's input gradient), but W re-derives the activation cotangents inside the stage from dy, so
B + W costs more than one fused backward: the price of splitting at the stage boundary rather than
at every matmul (see the bench's per-op times).

A tick is a `lax.switch` on this stage's op code (idle, F, B, W): every stage of a tensor/expert
group takes the same branch, so collectives inside stay matched. Values sent at tick t arrive at
t+1 and go into an inbox slot (`program._per_op_program`); their consumer reads the slot when it
runs. Residual slots live from F to W; the dy buffer holds each microbatch's output gradient from B
(on the last stage from F's head) to W.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from meshrun.pipeline import zb_split
from meshrun.pipeline.stage_run import StageRun, placed, put, take


class OpRun(StageRun):
    """`StageRun` for a per-op program (zb-h1): `run_tick` is one op per stage."""

    def split_backward(self, mb, saved, dy):
        """(B, W) for microbatch `mb`: B(saved, dy) -> (dx, stash), W(saved, dy, stash) -> weight
        grads, from one split of the stage backward's jaxpr (`zb_split`)."""
        chunk_def = jax.tree.structure(jax.eval_shape(lambda: self.chunk(0)))

        def bwd(saved, dy):
            return jax.tree.leaves(self.pullback(0, mb, saved)((dy, self.aux_cot)))

        cj = jax.make_jaxpr(bwd)(saved, dy)
        n = len(cj.jaxpr.outvars) - 1  # weight-gradient leaves, then dx
        plan = zb_split.make_plan(cj.jaxpr, [False] * n + [True], [True] * n + [False])
        flat = lambda saved, dy: jax.tree.leaves((saved, dy))

        def b(saved, dy):
            outs, stash = zb_split.run_b(cj.jaxpr, plan, cj.consts, flat(saved, dy))
            return outs[-1], stash

        def w(saved, dy, stash):
            return jax.tree.unflatten(chunk_def, zb_split.run_w(cj.jaxpr, plan, cj.consts, flat(saved, dy), stash)[:n])

        return b, w

    def res_structs(self) -> list:
        """Shapes and dtypes of one microbatch's stored residuals (what B and W are traced on)."""
        return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self.res_avals]

    def init_carry(self) -> dict:
        c = super().init_carry()  # a per-op program is never fused_head: c holds the dy buffer
        xs = self.x_aval
        fi, gi = self.prog.inbox
        c["f_box"] = self.full((fi + 1, *xs.shape), xs.dtype)  # last slot: the trash
        c["g_box"] = self.full((gi + 1, *xs.shape), xs.dtype)
        # B's stash (what W reads of B's work: per layer, the cotangents at the weights' uses)
        res = self.res_structs()
        b, _ = self.split_backward(0, res, self.x_aval)
        self.stash_avals = jax.eval_shape(lambda r, d: b(r, d)[1], res, self.x_aval)
        c["stash"] = jax.tree.map(lambda a: self.full((self.nslot, *a.shape), a.dtype), self.stash_avals)
        return c

    def run_tick(self, c, row, kind):
        del kind  # every tick of a per-op program may run any op
        at = lambda k: row[k][self.stage]
        fi, gi = self.prog.inbox
        trash = self.nslot - 1
        slot_or = lambda i, n: jnp.where(i >= 0, i, n)  # -1: the trash slot n
        c = dict(c)
        c["f_box"] = put(c["f_box"], slot_or(at("f_put"), fi), c["x_in"])
        c["g_box"] = put(c["g_box"], slot_or(at("g_put"), gi), c["g_in"])
        op, mb = jnp.maximum(at("kind"), 0), jnp.maximum(at("mb"), 0)
        slot = jnp.where(op > 0, at("slot"), trash)
        first, last = self.stage == 0, self.stage == self.p - 1
        x_in = take(c["f_box"], slot_or(at("f_get"), fi))
        g_in = take(c["g_box"], slot_or(at("g_get"), gi))
        b_part, w_part = self.split_backward(mb, self.res_structs(), self.x_aval)

        # Branches read the buffers they need themselves and return one microbatch's values, written
        # below into the op's slot or the trash slot: (y, dx, residuals, dy to keep, B's stash,
        # layer grad sums, other grad sums, loss sum, aux). The gradient sums go through the switch
        # (W adds into them, the others pass them on) instead of every op making zero gradients to
        # add (bench/memory_pipeline.py, p = 4, m = 8: temp bytes unchanged, step 1.47x lockstep
        # 1F1B's before, 1.34-1.49x after in runs on shared cores). Passing the residual, dy and
        # stash buffers through the same way copied them on every tick (temp 3.4 -> 5.0 MiB, 2.6x).
        xs = self.x_aval
        at_slot = lambda bufs: jax.tree.map(lambda b: take(b, slot), bufs)
        fill = lambda: self.full(xs.shape, xs.dtype)
        no_keep = lambda: [placed(self.full(a.shape, a.dtype), a) for a in self.res_avals]
        no_stash = lambda: jax.tree.map(lambda a: self.full(a.shape, a.dtype), self.stash_avals)
        no_aux = lambda: {k: jnp.zeros(a.shape, a.dtype) for k, a in self.aux_aval.items()}
        zero = jnp.zeros((), jnp.float32)
        add = lambda g, d: jax.tree.map(jnp.add, g, d)

        def idle():
            return fill(), fill(), no_keep(), fill(), no_stash(), c["g_layers"], c["g_other"], zero, no_aux()

        def forward():  # on the last stage F also gives the head's dL/dy (zeros elsewhere)
            y, keep, aux, ls, d_o, dy = self.stage_forward(0, mb, first, last, x_in)
            return y, fill(), keep, dy, no_stash(), c["g_layers"], add(c["g_other"], d_o), ls, aux

        def backward_input():
            dy = jnp.where(last, take(c["dy"], slot), g_in)
            dx, stash = b_part(at_slot(c["res"]), dy)
            d_o = self.embed_grad(first, mb, dx)
            return fill(), dx, no_keep(), dy, stash, c["g_layers"], add(c["g_other"], d_o), zero, no_aux()

        def backward_weights():
            d_p = w_part(at_slot(c["res"]), take(c["dy"], slot), at_slot(c["stash"]))
            g_l = self.add_grads(c["g_layers"], d_p, 0)
            return fill(), fill(), no_keep(), fill(), no_stash(), g_l, c["g_other"], zero, no_aux()

        branches = [idle, forward, backward_input, backward_weights]
        y, dx, keep, dy, stash, c["g_layers"], c["g_other"], ls, aux = lax.switch(op, branches)
        at_op = lambda *ops: jnp.where(jnp.isin(op, jnp.asarray(ops)), slot, trash)
        c["res"] = [put(b, at_op(1), r) for b, r in zip(c["res"], keep, strict=True)]
        c["dy"] = put(c["dy"], at_op(1, 2), dy)
        c["stash"] = jax.tree.map(lambda b, v: put(b, at_op(2), v), c["stash"], stash)
        c["loss"] = c["loss"] + ls
        c["aux"] = {k: c["aux"][k] + aux[k] for k in c["aux"]}
        return c, y, dx
