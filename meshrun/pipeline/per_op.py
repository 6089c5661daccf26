"""The per-op executor: a per-op timeline run as is, one op per stage per tick (zb-h1, ZB-V, and 1F1B
under `pipeline.executor=per_op`).

A stage's backward is split (`bw_split`, after Qi et al. 2023) into B, the input gradient on the
critical path, and W, the weight gradients; B + W is the unsplit backward's FLOPs. zb-h1 defers W's
into the bubbles; 1F1B runs each W in the tick after its B.

A tick runs one two-way `cond` per op kind (F, B, W), so every stage of a tensor/expert group takes
the same branch and collectives stay matched. A stage then sends its op's one output (F's activation
forward, B's input gradient back) with static sends (`TickProgram.sends`), mostly one
collective-permute both ways. Values arrive a tick later in an inbox slot (`program._per_op_program`).
Residual slots live from F to W; B's stash (what W reads of B's work) reuses the residual leaves that
only B reads, so deferring W costs no extra buffer where the shapes match.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshrun.pipeline import bw_split
from meshrun.pipeline.tick_loop import StageRun, put, take

OP_SCOPES = {"F": "per_op_F", "B": "per_op_B", "W": "per_op_W"}  # name scopes of a tick's three ops
IN = {"f": "x_in", "g": "g_in"}  # the carry's last received activation / gradient (unboxed directions)
# a tick's table entries (`program._per_op_program`), then the inbox slots of what it sends
TABLE_KEYS = ("kind", "mb", "chunk", "slot", "stash", "head", "f_put", "f_get", "g_put", "g_get", "f_next", "g_next",
              "s_next")  # fmt: skip


class _TickOp(NamedTuple):
    """One tick's op on this stage (`OpRun._tick_op`): thunks for its microbatch, residual, stash and
    head slots, chunk and (chunk, microbatch) ids; whether it runs the first / last virtual stage."""

    mb: Callable
    slot: Callable
    sslot: Callable
    hslot: Callable
    ch: Callable
    ids: Callable
    first: Any
    last: Any


class OpRun(StageRun):
    """`StageRun` for a per-op program (zb-h1, per-op 1F1B, ZB-V): `run_tick` is one op per stage."""

    flat_chunks = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Each op writes its buffers inside its own branch, so idle ticks write nothing: the residual,
        # dy and stash buffers need no trash slot (the inbox, written on every tick that sends, keeps one).
        self.nslot = self.prog.slots
        self._split = self._inbox = None  # `split_backward`'s (B, W), `inbox_layout`
        self.w_reads = ()  # per input of B and W (at leaves, saved residuals, dy): whether W reads it

    def split_backward(self):
        """(B, W): B(at, saved, dy) -> (dx, stash), W(at, saved, dy, stash, sums) -> the float32
        weight-gradient sums plus the op's weight gradients, added layer by layer inside W's layer
        loop (`bw_split.run_w`'s acc), from one split of the stage backward's jaxpr, traced once (`at`:
        (microbatch,), or (chunk, microbatch) with two chunks per stage, inputs of it) and shared by
        every tick's B and W."""
        if self._split is not None:
            return self._split
        chunk_def = jax.tree.structure(jax.eval_shape(lambda: self.diff_chunk(0)))

        def bwd(at, saved, dy):
            ch, mb = at if self.v > 1 else (0, *at)
            return jax.tree.leaves(self.pullback(ch, mb, saved)((dy, self.aux_cot)))

        i32 = jax.ShapeDtypeStruct((), jnp.int32)
        cj = jax.make_jaxpr(bwd)((i32,) * (2 if self.v > 1 else 1), self.res_structs(), self.x_aval)
        n = len(cj.jaxpr.outvars) - 1  # weight-gradient leaves, then dx
        bws = bw_split.split_jaxpr(cj.jaxpr, [False] * n + [True], [True] * n + [False])
        self.w_reads = tuple(bws.in_w[len(cj.jaxpr.invars) - len(self.res_avals) - 1 :])  # saved..., dy
        flat = lambda at, saved, dy: jax.tree.leaves((at, saved, dy))

        def b(at, saved, dy):
            outs, stash = bw_split.run_b(cj.jaxpr, bws, cj.consts, flat(at, saved, dy))
            return outs[-1], stash

        def w(at, saved, dy, stash, sums):
            acc = [*jax.tree.leaves(sums), None]
            outs = bw_split.run_w(cj.jaxpr, bws, cj.consts, flat(at, saved, dy), stash, acc)
            return jax.tree.unflatten(chunk_def, outs[:n])

        self._split = (b, w)
        return self._split

    def res_structs(self) -> list:
        """Shapes and dtypes of one microbatch's stored residuals (what B and W are traced on)."""
        return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self.res_avals]

    def inbox_layout(self) -> tuple[dict, int]:
        """The inbox: one buffer for received activations ('f') and gradients ('g') that wait for
        their consumer, then one trash slot. ({direction: its first slot}, trash slot); a direction
        whose every value is consumed in its arrival tick (1F1B's gradients) has none: it is read
        straight from the permute's result, carried in x_in / g_in."""
        if self._inbox is None and self.prog.placement != "loop":  # one inbox, absolute slots
            self._inbox = {"f": 0, "g": 0}, self.prog.inbox[0]
        if self._inbox is None:
            t, first, n = self.prog.tables, {}, 0
            for pre, slots in zip("fg", self.prog.inbox, strict=True):
                if not np.array_equal(t[f"{pre}_put"], t[f"{pre}_get"]):
                    first[pre], n = n, n + slots
            self._inbox = first, n
        return self._inbox

    def init_carry(self) -> dict:
        c = super().init_carry()  # a per-op program is never fused_head: c holds the dy buffer
        xs = self.x_aval
        box, trash = self.inbox_layout()
        if box:  # a received value goes straight into its slot (`ticks`)
            c["inbox"] = self.full((trash + 1, *xs.shape), xs.dtype)
        for pre in box:
            del c[IN[pre]]
        # the head's output gradient, from F to B on the last virtual stage (W reads dy from the stash)
        c["dy"] = self.full((max(self.prog.head_slots, 1), *xs.shape), xs.dtype)
        # B's stash (what W reads of B's work: per layer, the cotangents at the weights' uses; and dy
        # where W reads it). A stash leaf shaped as a residual leaf that only B reads goes into that
        # leaf's residual slot (it lives from F to W, so the stash needs no slots of its own there):
        # B's residuals and W's stash share the memory, as in Qi et al.'s accounting.
        b, _ = self.split_backward()
        at = (jnp.int32(0),) * (2 if self.v > 1 else 1)
        stash = jax.eval_shape(lambda r, d: b(at, r, d)[1], self.res_structs(), self.x_aval)
        leaves, self.stash_def = jax.tree.flatten(stash)
        self.n_stash = len(leaves)
        leaves += [self.x_aval] if self.w_reads[-1] else []
        free = [j for j, r in enumerate(self.w_reads[:-1]) if not r]  # residual leaves W does not read
        self.stash_at = []  # per stash leaf: ('res', residual leaf) or ('stash', its own buffer)
        own = []
        for a in leaves:
            j = next((j for j in free if _same(self.res_avals[j], a)), None)
            if j is not None:
                free.remove(j)
                self.stash_at.append(("res", j))
            else:
                self.stash_at.append(("stash", len(own)))
                own.append(self.full((self.prog.stash_slots, *a.shape), a.dtype))
        c["stash"] = own
        c["w_runs"] = jnp.zeros((), jnp.int32)  # W ops run so far (orders a W before the next F: `run_tick`)
        return c

    def run_tick(self, c, row, kind):
        """This stage's op of one tick: (carry, what it sends: F's activation, B's input gradient,
        else the fill). `row`: the tick's table entries of this stage, [len(TABLE_KEYS)]."""
        del kind  # every tick of a per-op program may run any op
        at = lambda k: row[TABLE_KEYS.index(k)]
        box, trash = self.inbox_layout()
        c = dict(c)
        x_in, g_in = (
            take(c["inbox"], jnp.where(at(f"{pre}_get") >= 0, at(f"{pre}_get") + box[pre], trash))
            if pre in box
            else c[IN[pre]]
            for pre in "fg"
        )
        op = at("kind")
        t = self._tick_op(at)
        # One two-way `cond` per op, in turn: the op's branch reads the buffers it needs and writes its
        # results into them, the other passes them through, so XLA updates every buffer in place (a
        # four-way switch whose branches write different buffers made XLA copy them each tick).
        # F's and B's predicates read W's count (never negative): where a scan body runs several
        # ticks, the previous tick's W, which reads the residual and stash buffers, then runs before
        # this F or B writes them in place. Without that order XLA copied six residual buffers per tick.
        y = self._forward_op(c, t, (op == 1) & (c["w_runs"] >= 0), x_in)
        dx = self._backward_input_op(c, t, (op == 2) & (c["w_runs"] >= 0), g_in)
        out = jnp.where(op == 1, y, dx)  # what the stage sends
        self._backward_weights_op(c, t, op == 3)
        return c, out

    def _tick_op(self, at) -> _TickOp:
        """The op's microbatch, slots, chunk and ends, read inside the op's branch (as operands of
        all three conds they were three more small kernels per tick)."""
        mb, slot, sslot, hslot = (lambda k=k: jnp.maximum(at(k), 0) for k in ("mb", "slot", "stash", "head"))
        if self.v == 1:
            ch, ids = (lambda: 0), (lambda: (mb(),))
            first, last = self.stage == 0, self.stage == self.p - 1
        else:  # the op's chunk and virtual stage (the V: chunk 0 of stage s is s, chunk 1 2p-1-s)
            ch = lambda: jnp.maximum(at("chunk"), 0)
            ids = lambda: (ch(), mb())
            k = jnp.where(at("chunk") > 0, 2 * self.p - 1 - self.stage, self.stage)
            first, last = k == 0, k == self.v * self.p - 1
        return _TickOp(mb, slot, sslot, hslot, ch, ids, first, last)

    def _fill(self):
        return self.full(self.x_aval.shape, self.x_aval.dtype)

    def _forward_op(self, c, t: _TickOp, run_f, x_in):
        """F under its cond (writes c's res, dy, g_other, loss and aux); returns the activation sent."""

        def forward():  # on the last stage F also gives the head's dL/dy (zeros elsewhere)
            y, keep, aux, ls, d_o, dy = self.stage_forward(t.ch(), t.mb(), t.first, t.last, x_in)
            res = [put(b, t.slot(), r) for b, r in zip(c["res"], keep, strict=True)]
            dyb = lax.cond(t.last, lambda: put(c["dy"], t.hslot(), dy), lambda: c["dy"])
            return y, res, dyb, _add(c["g_other"], d_o), _add((c["loss"], c["aux"]), (ls, aux))

        def no_forward():
            return self._fill(), c["res"], c["dy"], c["g_other"], (c["loss"], c["aux"])

        with jax.named_scope(OP_SCOPES["F"]):  # the profile's timeline reads the op from these names
            y, c["res"], c["dy"], c["g_other"], (c["loss"], c["aux"]) = lax.cond(run_f, forward, no_forward)
        return y

    def _backward_input_op(self, c, t: _TickOp, run_b, g_in):
        """B under its cond (writes c's stash and g_other, and the stash leaves kept in residual
        slots); returns the input gradient sent."""
        b_part, _ = self.split_backward()

        def backward_input():
            dy = jnp.where(t.last, take(c["dy"], t.hslot()), g_in)
            dx, stash = b_part(t.ids(), _at_slot(c["res"], t.slot), dy)
            d_o = self.embed_grad(t.first, t.mb(), dx)
            vals = [*jax.tree.leaves(stash), dy][: len(self.stash_at)]
            st = list(c["stash"])
            for (where, i), x in zip(self.stash_at, vals, strict=True):
                if where == "stash":
                    st[i] = put(st[i], t.sslot(), x)
            mine = [x for (where, _), x in zip(self.stash_at, vals, strict=True) if where == "res"]
            return dx, mine, st, _add(c["g_other"], d_o)

        def no_backward_input():
            mine = [jnp.zeros(self.res_avals[i].shape, self.res_avals[i].dtype) for w, i in self.stash_at if w == "res"]
            return self._fill(), mine, c["stash"], c["g_other"]

        with jax.named_scope(OP_SCOPES["B"]):
            dx, mine, c["stash"], c["g_other"] = lax.cond(run_b, backward_input, no_backward_input)

        # The stash leaves that go over residual leaves B reads are written by a cond of their own,
        # after B's: inside B's, XLA could not order the reads (fused into several kernels) before
        # the write and copied the residual buffer on every B.
        def stash_over_residuals():
            res, it = list(c["res"]), iter(mine)
            for where, i in self.stash_at:
                if where == "res":
                    res[i] = put(res[i], t.slot(), next(it))
            return res

        if mine:
            with jax.named_scope(OP_SCOPES["B"]):
                c["res"] = lax.cond(run_b, stash_over_residuals, lambda: c["res"])
        return dx

    def _backward_weights_op(self, c, t: _TickOp, run_w) -> None:
        """W under its cond: adds the op's weight gradients into c's g_layers, counts c's w_runs."""
        _, w_part = self.split_backward()

        def backward_weights():
            got = [take(c["res"][i], t.slot()) if where == "res" else take(c["stash"][i], t.sslot())
                   for where, i in self.stash_at]  # fmt: skip
            stash = jax.tree.unflatten(self.stash_def, got[: self.n_stash])
            dy = got[-1] if self.w_reads[-1] else self.x_zero
            sums = c["g_layers"] if self.v == 1 else jax.tree.map(lambda a: self.chunk_of(a, t.ch()), c["g_layers"])
            g = w_part(t.ids(), _at_slot(c["res"], t.slot), dy, stash, sums)
            if self.v > 1:
                g = jax.tree.map(lambda a, n: self.put_chunk(a, t.ch(), n), c["g_layers"], g)
            return g, c["w_runs"] + 1

        with jax.named_scope(OP_SCOPES["W"]):
            c["g_layers"], c["w_runs"] = lax.cond(run_w, backward_weights, lambda: (c["g_layers"], c["w_runs"]))

    def ticks(self) -> dict:
        """Run the program's phases, one `lax.scan` each over its periods: the scan body runs the
        period's u ticks in turn, each followed by its static sends (`TickProgram.sends`). Mostly one
        collective-permute: no stage receives twice, and what a stage receives goes into its inbox
        slot (a tick later's `f_put` / `g_put`, here `f_next` / `g_next`: that of whichever it is,
        else the trash) or, unboxed, into x_in / g_in; two (activations, then gradients) where some
        stage receives both, none where nothing is sent."""
        tables = dict(self.prog.tables)
        for pre in "fgs":  # the inbox slot of what a tick sends, on its receiver (its put a tick later)
            tables[f"{pre}_next"] = np.concatenate([tables[f"{pre}_put"][1:], tables[f"{pre}_put"][:1] * 0 - 1])
        # one array [ticks, p, keys], this stage's column taken once: a tick reads one row of it
        stacked = jnp.asarray(np.stack([tables[k] for k in TABLE_KEYS], axis=-1))
        mine = lax.dynamic_index_in_dim(stacked, self.stage, 1, keepdims=False)
        box, trash = self.inbox_layout()
        carry = self.init_carry()
        for (kind, t0, t1, _, _), period in zip(self.prog.phases, self.prog.sends, strict=True):
            u = len(period)
            for s0, s1, draining in self.segments(t0, t1, u):
                carry = self._scan(carry, mine[s0:s1].reshape((s1 - s0) // u, u, len(TABLE_KEYS)), kind, period,
                                   draining, box, trash)  # fmt: skip
            self.start_drain(carry, t1)
        return carry

    def _scan(self, carry, xs, kind, period, draining, box, trash):
        """One scan over a phase's periods (`ticks`)."""

        def body(c, rows):
            for j, perms in enumerate(period):
                row = rows[j]
                c = self.drain(c, draining)
                c, out = self.run_tick(c, row, kind)
                if self.prog.placement != "loop":  # a V's tip: its own output into its inbox
                    i = row[TABLE_KEYS.index("s_next")]
                    c["inbox"] = put(c["inbox"], jnp.where(i >= 0, i, trash), out)
                got = [lax.ppermute(out, "pipe", list(pairs)) for pairs in perms]
                # one permute: a stage receives at most one value, so one put (of it, into its slot)
                for x, dirs in zip(got, ["fg"] if len(got) == 1 else ["f", "g"], strict=False):
                    slot = trash
                    for pre in dirs:
                        if pre in box:
                            i = row[TABLE_KEYS.index(f"{pre}_next")]
                            slot = jnp.where(i >= 0, i + box[pre], slot)
                        else:
                            c[IN[pre]] = x
                    if any(pre in box for pre in dirs):
                        c["inbox"] = put(c["inbox"], slot, x)
            return c, None

        carry, _ = lax.scan(body, carry, xs)
        return carry


def _add(g, d):
    return jax.tree.map(jnp.add, g, d)


def _at_slot(bufs, slot):
    return jax.tree.map(lambda b: take(b, slot()), bufs)


def _same(a, b) -> bool:
    """Whether a buffer of `a`'s slots can hold `b` (shape, dtype and memory space)."""
    host = lambda x: str(getattr(x, "memory_space", None) or "Device").endswith("Host")
    return a.shape == b.shape and a.dtype == b.dtype and not host(a) and not host(b)
