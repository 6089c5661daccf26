"""Which leaves of a stage's vjp depend on the activation (what the executor stores per microbatch).

`jax.vjp(f, params, x)` returns a pytree whose leaves are everything the backward
needs: values computed from the activation `x` AND the weights themselves (dx = dy @ W^T needs W).
Keeping whole weights per in-flight microbatch would multiply weight memory by the slot count, so
`activation_residuals` walks the traced jaxpr and marks which leaves depend on `x`. Only those go
into the fixed-size buffer; the backward re-traces `jax.vjp` on a dummy input to rebuild the
weight-only leaves (XLA removes the dead dummy forward: the audit in tests/test_pipeline.py
checks that no extra collectives stay in the tick loop).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.extend import core as jex_core


def activation_residuals(fn: Callable, params, x, extra=None) -> tuple[tuple[bool, ...], list]:
    """For the leaves of `jax.vjp(fn, params, x)[1]`: (True where the leaf depends on `x`, avals).
    `extra` (e.g. segment ids): a further input of `fn(params, x, extra)` that is not differentiated
    and counts as not dependent (the caller rebuilds such leaves from the same `extra`).

    Dependence is traced through nested jaxprs (jit, remat, custom_jvp/vjp, scan and while with a
    fixpoint over the carry, cond); any other equation with a dependent input makes all its outputs
    dependent (conservative: a leaf wrongly marked dependent is only stored, never wrong)."""

    def leaves(p, a, e):
        f = fn if e is None else (lambda p_, a_: fn(p_, a_, e))
        return jax.tree.leaves(jax.vjp(f, p, a)[1])

    closed = jax.make_jaxpr(leaves)(params, x, extra)
    n_p, n_x = len(jax.tree.leaves(params)), len(jax.tree.leaves(x))
    flags = [False] * n_p + [True] * n_x + [False] * (len(closed.jaxpr.invars) - n_p - n_x)
    return tuple(_dep(closed.jaxpr, flags)), list(closed.out_avals)


def _jaxpr(j):
    return j.jaxpr if hasattr(j, "jaxpr") and not isinstance(j, jex_core.Jaxpr) else j


def _dep(jaxpr, in_dep: Sequence[bool]) -> list[bool]:
    """Which outputs of `jaxpr` depend on the inputs flagged in `in_dep`."""
    dep = {v for v, d in zip(jaxpr.invars, in_dep) if d}
    is_dep = lambda v: isinstance(v, jex_core.Var) and v in dep
    for eqn in jaxpr.eqns:
        ins = [is_dep(v) for v in eqn.invars]
        if not any(ins):
            continue
        outs = _eqn_dep(eqn, ins)
        dep.update(v for v, d in zip(eqn.outvars, outs) if d)
    return [is_dep(v) for v in jaxpr.outvars]


def _eqn_dep(eqn, ins: list[bool]) -> list[bool]:
    name, prm, n_out = eqn.primitive.name, eqn.params, len(eqn.outvars)
    if name == "scan":
        body, nc, ncar = _jaxpr(prm["jaxpr"]), prm["num_consts"], prm["num_carry"]
        carry = ins[nc : nc + ncar]
        while True:
            out = _dep(body, ins[:nc] + carry + ins[nc + ncar :])
            new = [a or b for a, b in zip(carry, out[:ncar])]
            if new == carry:
                return carry + out[ncar:]
            carry = new
    if name == "while":
        cn, bn = prm["cond_nconsts"], prm["body_nconsts"]
        body, carry = _jaxpr(prm["body_jaxpr"]), ins[cn + bn :]
        while True:
            out = _dep(body, ins[cn : cn + bn] + carry)
            new = [a or b for a, b in zip(carry, out)]
            if new == carry:
                if any(_dep(_jaxpr(prm["cond_jaxpr"]), ins[:cn] + carry)):
                    return [True] * n_out  # the trip count depends on x
                return carry
            carry = new
    if name == "cond":
        if ins[0]:
            return [True] * n_out
        outs = [_dep(_jaxpr(b), ins[1:]) for b in prm["branches"]]
        return [any(col) for col in zip(*outs)]
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = prm.get(key)
        if sub is not None and not callable(sub):
            sub = _jaxpr(sub)
            if len(sub.invars) == len(ins) and len(sub.outvars) == n_out:
                return _dep(sub, ins)
    return [True] * n_out
