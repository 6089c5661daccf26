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

from meshrun.pipeline.executor import _placed, _put, _StageRun, _take


class OpRun(_StageRun):
    """`_StageRun` for a per-op program (zb-h1): `run_tick` is one op per stage."""

    def init_carry(self) -> dict:
        c = super().init_carry()  # a per-op program is never fused_head: c holds the dy buffer
        xs = self.x_aval
        fi, gi = self.prog.inbox
        c["f_box"] = self.full((fi + 1, *xs.shape), xs.dtype)  # last slot: the trash
        c["g_box"] = self.full((gi + 1, *xs.shape), xs.dtype)
        return c

    def run_tick(self, c, row, kind):
        del kind  # every tick of a per-op program may run any op
        at = lambda k: row[k][self.stage]  # noqa: E731
        fi, gi = self.prog.inbox
        trash = self.nslot - 1
        slot_or = lambda i, n: jnp.where(i >= 0, i, n)  # noqa: E731  (-1: the trash slot n)
        c = dict(c)
        c["f_box"] = _put(c["f_box"], slot_or(at("f_put"), fi), c["x_in"])
        c["g_box"] = _put(c["g_box"], slot_or(at("g_put"), gi), c["g_in"])
        op, mb = jnp.maximum(at("kind"), 0), jnp.maximum(at("mb"), 0)
        slot = jnp.where(op > 0, at("slot"), trash)
        first, last = self.stage == 0, self.stage == self.p - 1
        saved = [_take(b, slot) for b in c["res"]]
        dy_kept = _take(c["dy"], slot)
        x_in = _take(c["f_box"], slot_or(at("f_get"), fi))
        g_in = _take(c["g_box"], slot_or(at("g_get"), gi))

        xs = self.x_aval
        chunk_aval = jax.eval_shape(lambda: self.chunk(0))
        fill = lambda: self.full(xs.shape, xs.dtype)  # noqa: E731
        no_keep = lambda: [_placed(self.full(a.shape, a.dtype), a) for a in self.res_avals]  # noqa: E731
        no_dp = lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), chunk_aval)  # noqa: E731
        no_aux = lambda: {k: jnp.zeros(a.shape, a.dtype) for k, a in self.aux_aval.items()}  # noqa: E731
        zero = jnp.zeros((), jnp.float32)

        # every branch: (y, dx, residuals, dy to keep, weight grads, other grads, loss sum, aux)
        def idle():
            return fill(), fill(), no_keep(), fill(), no_dp(), self.zeros_other(), zero, no_aux()

        def forward():
            y, keep, aux, ls, d_o, dy = self.stage_forward(0, mb, first, last, x_in)
            return y, fill(), keep, dy, no_dp(), d_o, ls, aux

        def backward_input():
            dy = jnp.where(last, dy_kept, g_in)
            _, dx = self.pullback(0, mb, saved)((dy, self.aux_cot))
            return fill(), dx, no_keep(), dy, no_dp(), self.embed_grad(first, mb, dx), zero, no_aux()

        def backward_weights():
            d_p, _ = self.pullback(0, mb, saved)((dy_kept, self.aux_cot))
            return fill(), fill(), no_keep(), dy_kept, d_p, self.zeros_other(), zero, no_aux()

        y, dx, keep, dy, d_p, d_o, ls, aux = lax.switch(op, [idle, forward, backward_input, backward_weights])
        res_slot = jnp.where(op == 1, slot, trash)
        dy_slot = jnp.where(((op == 1) & last) | (op == 2), slot, trash)
        c["res"] = [_put(b, res_slot, r) for b, r in zip(c["res"], keep, strict=True)]
        c["dy"] = _put(c["dy"], dy_slot, dy)
        c["g_layers"] = self.add_grads(c["g_layers"], d_p, 0)
        c["g_other"] = jax.tree.map(jnp.add, c["g_other"], d_o)
        c["loss"] = c["loss"] + ls
        c["aux"] = {k: c["aux"][k] + aux[k] for k in c["aux"]}
        return c, y, dx
