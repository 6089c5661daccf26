"""The B/W split: a stage's backward cut into B (input gradient) and W (weight gradients) without
redoing work (for ZB-H1 / ZB-V, which run W later, in a bubble).

* `split_jaxpr` walks the backward's jaxpr from the outputs B needs and those W needs. An equation
  only B needs runs in B, one only W needs in W; values B computes that W reads are the stash (per
  microbatch: the cotangents at each matmul output). A `scan` serving both is split into a B scan,
  which emits each iteration's stash, and a W scan that reads it; `jit` and remat calls are split
  through their bodies; any other shared equation runs in both, so no weight-sized value is stashed.
* `run_b` / `run_w` evaluate the split by binding each equation's primitive, re-creating split
  scans with `lax.scan`; their outputs match the unsplit backward's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jc

from meshrun.parallel.layer_fetch import add_slice, add_to

# calls split through their bodies (inlined in B and W): jit, and remat's checkpoint (its body in
# the backward is the recomputed forward plus the layer's backward; B runs the recompute, and what W
# needs of it, the weights' inputs, goes into the stash rather than being recomputed a second time)
CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "checkpoint": "jaxpr", "remat2": "jaxpr"}


@dataclass
class BWSplit:
    """Roles per equation of one jaxpr: None (dead), 'B', 'W', 'BW' (B, and again in W) or an `EqnSplit`."""

    roles: list
    stash: list  # vars B computes and W reads, in order
    in_b: list  # per invar: B reads it
    in_w: list  # per invar: W reads it


@dataclass
class EqnSplit:
    kind: str  # 'scan' or 'call'
    body: BWSplit
    b_out: list  # per eqn output: the B part produces it
    w_out: list  # per eqn output: the W part produces it
    b_car: list = field(default_factory=list)  # scan: carry indices B runs
    w_car: list = field(default_factory=list)  # scan: carry indices W runs
    car_stash: list = field(default_factory=list)  # scan: B carries whose per-iteration input W reads


def _is_var(v) -> bool:
    return isinstance(v, jc.Var) and not isinstance(v, jc.DropVar)


def _inner(eqn):
    j = eqn.params[CALLS[eqn.primitive.name]]
    return (j.jaxpr, list(j.consts)) if hasattr(j, "consts") else (j, [])


def split_jaxpr(jaxpr, need_b: list[bool], need_w: list[bool]) -> BWSplit:
    live_b = {v for v, n in zip(jaxpr.outvars, need_b, strict=True) if n and _is_var(v)}
    live_w = {v for v, n in zip(jaxpr.outvars, need_w, strict=True) if n and _is_var(v)}
    roles: list[Any] = [None] * len(jaxpr.eqns)
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        ob = [_is_var(v) and v in live_b for v in eqn.outvars]
        ow = [_is_var(v) and v in live_w for v in eqn.outvars]
        if not any(ob) and not any(ow):
            continue
        name = eqn.primitive.name
        split = None
        if any(ob) and any(ow):
            split = _split_scan(eqn, ob, ow) if name == "scan" else _split_call(eqn, ob, ow) if name in CALLS else None
        if split is not None:
            roles[i], (ib, iw) = split[0], split[1:]
        else:  # B computes it (W reads what it needs from the stash) unless W needs outputs B does not:
            # then W runs it again (a cond's weight gradients are never stashed)
            w_only = any(w and not b for b, w in zip(ob, ow, strict=True))
            roles[i] = ("BW" if w_only else "B") if any(ob) else "W"
            ib = iw = [True] * len(eqn.invars)
            ib, iw = (ib if "B" in roles[i] else [False] * len(ib)), (iw if "W" in roles[i] else [False] * len(iw))
        live_b.update(v for v, n in zip(eqn.invars, ib, strict=True) if n and _is_var(v))
        live_w.update(v for v, n in zip(eqn.invars, iw, strict=True) if n and _is_var(v))
    stash, seen = [], set()
    for eqn, r in zip(jaxpr.eqns, roles, strict=True):
        made = eqn.outvars if r == "B" else []
        if isinstance(r, EqnSplit):
            made = [v for v, n in zip(eqn.outvars, r.b_out, strict=True) if n]
        for v in made:
            if _is_var(v) and v in live_w and v not in seen:
                stash.append(v)
                seen.add(v)
    return BWSplit(roles, stash, [v in live_b for v in jaxpr.invars], [v in live_w for v in jaxpr.invars])


def _split_call(eqn, ob, ow):
    body, _ = _inner(eqn)
    bws = split_jaxpr(body, ob, ow)
    return EqnSplit("call", bws, ob, ow), bws.in_b, bws.in_w


def _split_scan(eqn, ob, ow):
    body = eqn.params["jaxpr"].jaxpr
    nc, ncar = eqn.params["num_consts"], eqn.params["num_carry"]
    b_car = {j for j in range(ncar) if ob[j]}
    w_car = {j for j in range(ncar) if ow[j]} - b_car
    while True:  # carries either part reads must be run by some part: B's if B reads them
        car_b, car_w = [j in b_car for j in range(ncar)], [j in w_car for j in range(ncar)]
        bws = split_jaxpr(body, car_b + ob[ncar:], car_w + ow[ncar:])
        nb = b_car | {j for j in range(ncar) if bws.in_b[nc + j]}
        nw = (w_car | {j for j in range(ncar) if bws.in_w[nc + j]}) - nb
        if (nb, nw) == (b_car, w_car):
            break
        b_car, w_car = nb, nw
    b_out = [j in b_car for j in range(ncar)] + ob[ncar:]
    w_out = [j in w_car for j in range(ncar)] + ow[ncar:]
    car_stash = sorted(j for j in b_car if bws.in_w[nc + j])
    sp = EqnSplit("scan", bws, b_out, w_out, sorted(b_car), sorted(w_car), car_stash)
    in_b = bws.in_b[:nc] + [j in b_car for j in range(ncar)] + bws.in_b[nc + ncar :]
    in_w = bws.in_w[:nc] + [j in w_car for j in range(ncar)] + bws.in_w[nc + ncar :]
    return sp, in_b, in_w


# ---------------------------------------------------------------- evaluation


def _bind(eqn, invals):
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = params if isinstance(params, tuple) else ([], params)  # older jax: (subfuns, params)
    ctx = getattr(eqn, "ctx", None)
    with contextlib.nullcontext() if ctx is None else ctx.manager:
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _env(jaxpr, consts, args):
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update((v, a) for v, a in zip(jaxpr.invars, args, strict=True) if a is not None)
    return env


def _read(env, v):
    return v.val if isinstance(v, jc.Literal) else env.get(v)


def run_b(jaxpr, bws: BWSplit, consts, args):
    """(outputs, None where B does not produce them; stash pytree) of the B part."""
    env, sub = _env(jaxpr, consts, args), {}
    for i, (eqn, r) in enumerate(zip(jaxpr.eqns, bws.roles, strict=True)):
        if r is None or r == "W":
            continue
        ins = [_read(env, v) for v in eqn.invars]
        if isinstance(r, EqnSplit) and r.kind == "scan":
            outs, sub[i] = _scan_b(eqn, r, ins)
        elif isinstance(r, EqnSplit):
            body, bc = _inner(eqn)
            outs, sub[i] = run_b(body, r.body, bc, ins)
        else:
            outs = _bind(eqn, ins)
        env.update((v, o) for v, o in zip(eqn.outvars, outs, strict=True) if o is not None and _is_var(v))
    return [_read(env, v) for v in jaxpr.outvars], {"v": [env[v] for v in bws.stash], "s": sub}


def run_w(jaxpr, bws: BWSplit, consts, args, stash, acc=None, keep=None):
    """Outputs of the W part (None where W does not produce them), given B's stash.

    `acc` (a list aligned with the outputs, None where not wanted): output k becomes acc[k] + its
    value in acc[k]'s dtype. An output that is the stacked ys of a split scan (the layer loop's weight
    gradients), or the sum of such ys padded along the stacked axis (an uneven pipeline split's head
    and padding tail, `_accumulable`), is added in place inside those scans, one iteration's slice at
    a time, so no stacked gradient of the whole stage is ever formed: gradient accumulation into the
    float32 sums needs the sums plus one layer's gradient, not the sums plus the stage's. `keep` (a
    scalar bool, or None): where false, zeros are added instead (a cell that computed on fill values)."""
    env = _env(jaxpr, consts, args)
    env.update(zip(bws.stash, stash["v"], strict=True))
    parts, skip = _accumulable(jaxpr, acc, bws.roles)
    cur = dict(enumerate(acc or []))  # output index -> its accumulator so far
    for i, (eqn, r) in enumerate(zip(jaxpr.eqns, bws.roles, strict=True)):
        if r is None or r == "B" or i in skip:
            continue
        ins = [_read(env, v) for v in eqn.invars]
        if isinstance(r, EqnSplit) and r.kind == "scan":
            ncar = eqn.params["num_carry"]
            mine = {k - ncar: parts[v] for k, v in enumerate(eqn.outvars) if k >= ncar and v in parts}
            outs = _scan_w(eqn, r, ins, stash["s"][i], {j: (cur[o], off) for j, (o, off) in mine.items()}, keep)
            cur.update((o, outs[ncar + j]) for j, (o, _) in mine.items())
        elif isinstance(r, EqnSplit):
            body, bc = _inner(eqn)
            outs = run_w(body, r.body, bc, ins, stash["s"][i])
        else:
            outs = _bind(eqn, ins)
        env.update((v, o) for v, o in zip(eqn.outvars, outs, strict=True) if o is not None and _is_var(v))
    outs = [_read(env, v) for v in jaxpr.outvars]
    inside = {o for o, _ in parts.values()}
    for k, a in enumerate(acc or []):
        if a is not None:
            outs[k] = cur[k] if k in inside else add_to(a, _kept(outs[k].astype(a.dtype), keep))
    return outs


def _kept(x, keep):
    return x if keep is None else jnp.where(keep, x, jnp.zeros_like(x))


def _accumulable(jaxpr, acc, roles) -> tuple[dict, set]:
    """Which accumulated outputs `run_w` adds inside their scans: ({ys var: (output index, offset of
    its first iteration along the stacked axis)}, indices of the equations then skipped). An output
    qualifies when it is the ys of a split scan, or an `add_any` of such ys each `pad`ded with zeros
    along the stacked axis only (an uneven pipeline split runs a chunk's first lmin layers as one call
    and the padding tail under a `cond`, `split.uneven_apply`: the slices transpose to pads), every
    value in it used once; otherwise it is added after."""
    if not acc:
        return {}, set()
    uses, made_by, ys = _sum_graph(jaxpr, roles)

    def walk(v, off):  # ([(ys var, offset)], equations to skip), or None
        if not _is_var(v) or uses.get(v) != 1:
            return None
        if v in ys:
            return [(v, off)], set()
        i = made_by.get(v)
        eqn = None if i is None else jaxpr.eqns[i]
        if eqn is None or roles[i] is None or roles[i] == "B":
            return None
        if eqn.primitive.name == "add_any":
            got = [walk(x, off) for x in eqn.invars]
            if any(g is None for g in got):
                return None
            return [pr for g, _ in got for pr in g], {i}.union(*(s for _, s in got))
        if eqn.primitive.name == "pad":
            lo = _stacked_zero_pad(eqn)
            got = None if lo is None else walk(eqn.invars[0], off + lo)
            return None if got is None else (got[0], got[1] | {i})
        return None

    parts, skip = {}, set()
    for k, (v, a) in enumerate(zip(jaxpr.outvars, acc, strict=True)):
        got = None if a is None else walk(v, 0)
        if got is not None:
            parts.update((y, (k, off)) for y, off in got[0])
            skip |= got[1]
    return parts, skip


def _sum_graph(jaxpr, roles) -> tuple[dict, dict, set]:
    """What `_accumulable` walks: each var's number of uses (outputs count), the index of the
    equation that makes each var, and the ys that the split scans' W parts make."""
    uses: dict = {}
    for v in [v for eqn in jaxpr.eqns for v in eqn.invars] + list(jaxpr.outvars):
        if _is_var(v):
            uses[v] = uses.get(v, 0) + 1
    made_by = {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars if _is_var(v)}
    ys = set()
    for eqn, r in zip(jaxpr.eqns, roles, strict=True):
        if eqn.primitive.name == "scan" and isinstance(r, EqnSplit) and r.kind == "scan":
            ncar = eqn.params["num_carry"]
            ys.update(v for v, w in zip(eqn.outvars[ncar:], r.w_out[ncar:], strict=True) if w)
    return uses, made_by, ys


def _stacked_zero_pad(eqn) -> int | None:
    """The low padding of a `pad` equation that adds zeros at the ends of the stacked (first) axis only
    (no interior padding, nothing cut off); None for any other pad."""
    fill = eqn.invars[1]
    (lo, hi, interior), *rest = eqn.params["padding_config"]
    zero = isinstance(fill, jc.Literal) and not np.any(np.asarray(fill.val))
    if not zero or lo < 0 or hi < 0 or interior or any(c != (0, 0, 0) for c in map(tuple, rest)):
        return None
    return int(lo)


def _scan_parts(eqn, ins):
    nc, ncar = eqn.params["num_consts"], eqn.params["num_carry"]
    return eqn.params["jaxpr"], nc, ncar, ins[:nc], ins[nc : nc + ncar], ins[nc + ncar :]


def _scan_b(eqn, sp: EqnSplit, ins):
    body, nc, ncar, consts, init, xs = _scan_parts(eqn, ins)
    xs = [x if n else None for x, n in zip(xs, sp.body.in_b[nc + ncar :], strict=True)]

    def step(carry, x):
        car = [None] * ncar
        for j, c in zip(sp.b_car, carry, strict=True):
            car[j] = c
        outs, st = run_b(body.jaxpr, sp.body, body.consts, consts + car + list(x))
        ys = [o for o, n in zip(outs[ncar:], sp.b_out[ncar:], strict=True) if n]
        return [outs[j] for j in sp.b_car], (ys, st, [car[j] for j in sp.car_stash])

    p = eqn.params
    last, (ys, st, cin) = lax.scan(step, [init[j] for j in sp.b_car], xs, length=p["length"], reverse=p["reverse"])
    return _scan_outs(len(eqn.outvars), ncar, sp.b_car, last, sp.b_out, ys), {"body": st, "carry_in": cin}


def _scan_w(eqn, sp: EqnSplit, ins, stash, acc=None, keep=None):
    """The W part of a split scan; `acc` {ys index: (accumulator, offset)}: those ys are added into
    their accumulator's slice offset + iteration (carried, updated in place) instead of being stacked."""
    body, nc, ncar, consts, init, xs = _scan_parts(eqn, ins)
    xs = [x if n else None for x, n in zip(xs, sp.body.in_w[nc + ncar :], strict=True)]
    acc = acc or {}
    keys = sorted(acc)

    def step(carry, x):
        carry, sums = carry
        xv, st, cin, i = x
        car = [None] * ncar
        for j, c in zip(sp.w_car, carry, strict=True):
            car[j] = c
        for j, c in zip(sp.car_stash, cin, strict=True):
            car[j] = c
        outs = run_w(body.jaxpr, sp.body, body.consts, consts + car + list(xv), st)
        ys = outs[ncar:]
        # sums in host memory (offload.params): each slice comes to the device and goes back
        sums = [add_slice(a, i + acc[k][1], _kept(ys[k].astype(a.dtype), keep))
                for k, a in zip(keys, sums, strict=True)]  # fmt: skip
        made = [o if k not in acc else None for k, (o, n) in enumerate(zip(ys, sp.w_out[ncar:], strict=True)) if n]
        return ([outs[j] for j in sp.w_car], sums), made

    p = eqn.params
    xs_all = (xs, stash["body"], stash["carry_in"], lax.iota("int32", p["length"]))
    init_all = ([init[j] for j in sp.w_car], [acc[k][0] for k in keys])
    (last, sums), ys = lax.scan(step, init_all, xs_all, length=p["length"], reverse=p["reverse"])
    outs = _scan_outs(len(eqn.outvars), ncar, sp.w_car, last, sp.w_out, ys)
    for k, a in zip(keys, sums, strict=True):
        outs[ncar + k] = a
    return outs


def _scan_outs(n_out: int, ncar: int, car: list, last, made: list, ys) -> list:
    """A split scan's results in the original scan's output order (None where this part made none)."""
    outs, it = [None] * n_out, iter(ys)
    for j, c in zip(car, last, strict=True):
        outs[j] = c
    for k, n in enumerate(made[ncar:]):
        if n:
            outs[ncar + k] = next(it)
    return outs


# ---------------------------------------------------------------- whole backward, accumulating


def _whole_w(jaxpr) -> tuple[BWSplit, dict]:
    """A B/W split that runs all of `jaxpr` as W, its top-level scans re-created (so `run_w`'s acc can add
    their ys in place), and the empty stash it reads."""
    roles, stash = [], {}
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name != "scan":
            roles.append("W")
            continue
        body = eqn.params["jaxpr"].jaxpr
        n_in, ncar, n_out = len(body.invars), eqn.params["num_carry"], len(eqn.outvars)
        bp = BWSplit(["W"] * len(body.eqns), [], [False] * n_in, [True] * n_in)
        roles.append(EqnSplit("scan", bp, [False] * n_out, [True] * n_out, [], list(range(ncar)), []))
        stash[i] = {"body": {"v": [], "s": {}}, "carry_in": []}
    n = len(jaxpr.invars)
    return BWSplit(roles, [], [False] * n, [True] * n), {"v": [], "s": stash}


def vjp_into(vjp_fn, cot, sums, keep=None):
    """`vjp_fn(cot)` = (weight cotangents, *others) with the weight cotangents added into `sums` (a
    pytree like them, e.g. float32 gradient sums): ys of the backward's layer loop are added slice by
    slice inside the loop (`run_w`'s acc), so the stage's whole fresh gradient is never formed.
    `keep` (scalar bool or None): where false the sums come back unchanged (the cotangents are
    computed but not added). Returns (sums + weight cotangents, *others)."""
    leaves, tdef = jax.tree.flatten(vjp_fn)
    out_tree = []

    def bwd(lv, ct):
        out = jax.tree.unflatten(tdef, lv)(ct)
        out_tree.append(jax.tree.structure(out))
        return jax.tree.leaves(out)

    cj = jax.make_jaxpr(bwd)(leaves, cot)
    bws, stash = _whole_w(cj.jaxpr)
    acc = jax.tree.leaves(sums)
    acc = acc + [None] * (len(cj.jaxpr.outvars) - len(acc))
    outs = run_w(cj.jaxpr, bws, cj.consts, jax.tree.leaves((leaves, cot)), stash, acc, keep)
    return jax.tree.unflatten(out_tree[0], outs)
