"""The per-op executor: a per-op timeline run as is, one op per stage per tick (zb-h1, and 1F1B under
`pipeline.executor=per_op`).

Qi et al. (2023) split a stage's backward into B (the input gradient, on the critical path) and W
(the weight gradients, needed only by the optimizer). Both come from one split of the stage
backward's jaxpr (`zb_split`): B runs the chain of activation cotangents from the residuals F stored
and stashes, per layer, the cotangents at the weights' uses; W runs the weight-gradient matmuls from
that stash and the same residuals. B + W is the unsplit backward's FLOPs. zb-h1 defers W's into the
bubbles; 1F1B runs each W in the tick after its B (`schedules.one_f_one_b_split`), so every op is
about one forward long and a tick, which waits for its slowest op, wastes nothing.

A tick runs one two-way `cond` per op kind (F, B, W): every stage of a tensor/expert group takes the
same branch, so collectives inside stay matched. Values sent at tick t arrive at t+1 and go into an
inbox slot (`program._per_op_program`); their consumer reads the slot when it runs. Residual slots
live from F to W; the dy buffer holds each microbatch's output gradient from B (on the last stage
from F's head) to W; B's stash has its own slots, from B to W.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from meshrun.pipeline import zb_split
from meshrun.pipeline.stage_run import StageRun, put, take

OP_SCOPES = {"F": "per_op_F", "B": "per_op_B", "W": "per_op_W"}  # name scopes of a tick's three ops


class OpRun(StageRun):
    """`StageRun` for a per-op program (zb-h1, per-op 1F1B): `run_tick` is one op per stage."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Each op writes its buffers inside its own branch, so idle ticks write nothing: the residual,
        # dy and stash buffers need no trash slot (the inboxes, written every tick, keep theirs).
        self.nslot = self.prog.slots

    def split_backward(self, mb, saved, dy):
        """(B, W) for microbatch `mb`: B(saved, dy) -> (dx, stash), W(saved, dy, stash, sums) -> the
        float32 weight-gradient sums plus this microbatch's weight gradients, added layer by layer
        inside W's layer loop (`zb_split.run_w`'s acc), from one split of the stage backward's jaxpr."""
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

        def w(saved, dy, stash, sums):
            acc = [*jax.tree.leaves(sums), None]
            outs = zb_split.run_w(cj.jaxpr, plan, cj.consts, flat(saved, dy), stash, acc)
            return jax.tree.unflatten(chunk_def, outs[:n])

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
        n = self.prog.stash_slots  # 1F1B's W follows its B: one slot
        c["stash"] = jax.tree.map(lambda a: self.full((n, *a.shape), a.dtype), self.stash_avals)
        return c

    def run_tick(self, c, row, kind):
        del kind  # every tick of a per-op program may run any op
        at = lambda k: row[k][self.stage]
        fi, gi = self.prog.inbox
        slot_or = lambda i, n: jnp.where(i >= 0, i, n)  # -1: the trash slot n
        c = dict(c)
        c["f_box"] = put(c["f_box"], slot_or(at("f_put"), fi), c["x_in"])
        c["g_box"] = put(c["g_box"], slot_or(at("g_put"), gi), c["g_in"])
        op, mb = jnp.maximum(at("kind"), 0), jnp.maximum(at("mb"), 0)
        slot = jnp.maximum(at("slot"), 0)  # (idle ticks read and write nothing)
        sslot = jnp.maximum(at("stash"), 0)  # B's stash slot, read by its W
        first, last = self.stage == 0, self.stage == self.p - 1
        x_in = take(c["f_box"], slot_or(at("f_get"), fi))
        g_in = take(c["g_box"], slot_or(at("g_get"), gi))
        b_part, w_part = self.split_backward(mb, self.res_structs(), self.x_aval)

        # One two-way `cond` per op, in turn: the op's branch reads the buffers it needs and writes its
        # results into them, the other passes them through. XLA then updates every buffer in place. A
        # four-way switch whose branches write different buffers made XLA copy them each tick (and
        # returning fill values for what an op does not produce, put into a trash slot, wrote a
        # residual set and a stash set per tick): zb-h1 cost 1.31x lockstep 1F1B's CPU time at equal
        # FLOPs (bench/memory_pipeline.py, d_model 256, p = 4, m = 8), now (see the bench) about 1.0x.
        xs = self.x_aval
        at_slot = lambda bufs: jax.tree.map(lambda b: take(b, slot), bufs)
        fill = lambda: self.full(xs.shape, xs.dtype)
        no_aux = lambda: {k: jnp.zeros(a.shape, a.dtype) for k, a in self.aux_aval.items()}
        zero = jnp.zeros((), jnp.float32)
        add = lambda g, d: jax.tree.map(jnp.add, g, d)

        def forward():  # on the last stage F also gives the head's dL/dy (zeros elsewhere)
            y, keep, aux, ls, d_o, dy = self.stage_forward(0, mb, first, last, x_in)
            res = [put(b, slot, r) for b, r in zip(c["res"], keep, strict=True)]
            return y, res, put(c["dy"], slot, dy), add(c["g_other"], d_o), ls, aux

        def no_forward():
            return fill(), c["res"], c["dy"], c["g_other"], zero, no_aux()

        with jax.named_scope(OP_SCOPES["F"]):  # the profile's timeline reads the op from these names
            y, c["res"], c["dy"], c["g_other"], ls, aux = lax.cond(op == 1, forward, no_forward)

        def backward_input():
            dy = jnp.where(last, take(c["dy"], slot), g_in)
            dx, stash = b_part(at_slot(c["res"]), dy)
            d_o = self.embed_grad(first, mb, dx)
            st = jax.tree.map(lambda b, v: put(b, sslot, v), c["stash"], stash)
            return dx, put(c["dy"], slot, dy), st, add(c["g_other"], d_o)

        def no_backward_input():
            return fill(), c["dy"], c["stash"], c["g_other"]

        with jax.named_scope(OP_SCOPES["B"]):
            dx, c["dy"], c["stash"], c["g_other"] = lax.cond(op == 2, backward_input, no_backward_input)

        def backward_weights():
            stash = jax.tree.map(lambda b: take(b, sslot), c["stash"])
            return w_part(at_slot(c["res"]), take(c["dy"], slot), stash, c["g_layers"])  # per-op: v = 1

        with jax.named_scope(OP_SCOPES["W"]):
            c["g_layers"] = lax.cond(op == 3, backward_weights, lambda: c["g_layers"])
        c["loss"] = c["loss"] + ls
        c["aux"] = {k: c["aux"][k] + aux[k] for k in c["aux"]}
        return c, y, dx
