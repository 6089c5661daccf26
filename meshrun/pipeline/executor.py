"""SPMD pipeline executor: GPipe, 1F1B and interleaved 1F1B as one `shard_map` over a tick loop.

Shape legend: M microbatches, B local microbatch rows, S sequence, D model width, Lc layers per chunk.

How a step runs (see DESIGN §5):
* `jax.shard_map` is manual over 'pipe' AND the dense data-parallel axes ('data', 'expert'); 'tensor'
  stays auto (GSPMD shards the weights inside a stage; the model's `constrain` calls run under
  `use_rules(..., manual=MANUAL)`). With only 'pipe' manual, GSPMD put the data-parallel gradient
  all-reduce inside the tick loop; here it is one psum (ZeRO-2/3: psum_scatter) after the loop.
* The schedule is data: `schedules.lockstep(build(...))` gives per tick and stage at most one forward
  and one backward (`Task(kind, mb, chunk)`) plus a residual slot; the executor indexes those tables
  by tick (scan xs) and stage (`lax.axis_index('pipe')`). Ticks are grouped into phases of the same
  kind (forward only / both / backward only), one `lax.scan` each, so a warm-up tick costs one
  forward and a cool-down tick one backward: 1F1B costs (p-1)·F + m·(F+B) + (p-1)·B, bubble
  (p-1)/(m+p-1), not the (2p-2)/(m+2p-2) of m+2(p-1) full ticks. A phase sends activations
  (gradients) iff some tick of it feeds a forward (backward) next tick: `Plan.permutes()`.
* Activations move with `ppermute` over 'pipe' (forward s -> s+1, gradients s -> s-1; interleaved
  wraps around: the last stage's chunk c feeds stage 0's chunk c+1).
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
  data-parallel shards, w = `StageFns.aux_weights(global batch rows)` (the model's `total_loss`);
  the token count depends only on labels, so it is known before the loop and each head backward
  uses the exact cotangent 1/N (aux cotangents are w_k).
* Parameters: `params['layers']` leaves are stacked [L, ...] in model order and sharded P('pipe', ...).
  For interleaved (v > 1) the executor permutes them to pipeline order ([v, p, Lc] -> [p, v, Lc],
  `stage.to_pipeline_layout`) inside the step, which moves weights across 'pipe' once per step;
  pass `layout='pipeline'` with params already stored that way (and get grads back that way) to avoid it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshrun.config import ModelConfig, PipelineConfig
from meshrun.errors import ConfigError
from meshrun.pipeline import schedules
from meshrun.pipeline.stage import (
    StageFns,
    activation_residuals,
    from_pipeline_layout,
    model_fns,
    restrict,
    to_pipeline_layout,
)
from meshrun.sharding import DP_AXES, compute_rules, logical_names, logical_to_spec, param_rules, use_rules
from meshrun.zero import MANUAL, finish_reduction, gather_params, partial_specs, reduce_grads_local


def _phases(lock, v: int) -> list[tuple[str, int, int, bool, bool]]:
    """Maximal runs of ticks of one kind: 'F' (forwards only), 'B' (backwards only), 'FB' (both),
    each with whether its ticks send activations / gradients (some tick of the run has a consumer
    next tick). One scan per run keeps the tick body specialised (a warm-up tick costs a forward
    only) while the HLO holds few copies of the stage (compile time)."""
    p = len(lock[0])
    kinds, sf, sb = [], [], []
    for t, row in enumerate(lock):
        f, b = any(c.fwd for c in row), any(c.bwd for c in row)
        kinds.append("FB" if f and b else "F" if f else "B")
        nxt = lock[t + 1] if t + 1 < len(lock) else []
        sf.append(any(c.fwd is not None and c.fwd.chunk * p + s > 0 for s, c in enumerate(nxt)))
        sb.append(any(c.bwd is not None and c.bwd.chunk * p + s < v * p - 1 for s, c in enumerate(nxt)))
    out, t0 = [], 0
    for t in range(1, len(kinds) + 1):
        if t == len(kinds) or kinds[t] != kinds[t0]:
            out.append((kinds[t0], t0, t, any(sf[t0:t]), any(sb[t0:t])))
            t0 = t
    return out


@dataclass(frozen=True)
class Plan:
    """Everything static about one pipelined step (from the schedule table)."""

    schedule: str
    p: int
    m: int
    v: int
    ticks: int
    slots: int  # residual buffer slots (max in-flight (mb, chunk) pairs on any stage)
    fused_head: bool  # every last-virtual-stage backward runs in its forward's tick
    phases: tuple[tuple[str, int, int, bool, bool], ...]  # (kind, first tick, end tick, send fwd, send bwd)
    tables: Mapping[str, np.ndarray]  # [ticks, p] int32: f_mb f_chunk f_slot b_mb b_chunk b_slot

    @property
    def bubble(self) -> float:
        """Idle fraction from the per-op table (F = 1, B = 2)."""
        return schedules.bubble_fraction(schedules.build(self.schedule, self.p, self.m, self.v))

    def permutes(self) -> tuple[int, int]:
        """(forward, backward) `ppermute`s over 'pipe' per step: one per tick of a phase that sends."""
        f = sum(t1 - t0 for _, t0, t1, sf, _ in self.phases if sf)
        b = sum(t1 - t0 for _, t0, t1, _, sb in self.phases if sb)
        return f, b


def make_plan(pcfg: PipelineConfig, p: int) -> Plan:
    v = pcfg.virtual if pcfg.schedule == "interleaved" else 1
    if pcfg.schedule != "interleaved" and pcfg.virtual != 1:
        raise ConfigError("pipeline.virtual", pcfg.virtual, "use schedule=interleaved, or virtual=1")
    lock = schedules.lockstep(schedules.build(pcfg.schedule, p, pcfg.microbatches, v))
    arrs = {k: np.asarray(a, np.int32) for k, a in schedules.lockstep_arrays(lock).items()}
    slots = max(schedules.max_in_flight(lock, s) for s in range(p))
    last = p - 1
    fused = all(
        row[last].bwd is None
        or row[last].bwd.chunk != v - 1
        or (row[last].fwd is not None and (row[last].fwd.mb, row[last].fwd.chunk) == (row[last].bwd.mb, v - 1))
        for row in lock
    )
    return Plan(pcfg.schedule, p, pcfg.microbatches, v, len(lock), slots, fused, tuple(_phases(lock, v)), arrs)


def _specs(names, params, mesh: Mesh, zero: int):
    """Per leaf: (storage spec, compute spec, grad spec) over the whole mesh."""

    def one(nm, a, rules):
        nm = tuple(nm) + (None,) * (a.ndim - len(nm))
        return logical_to_spec(nm, rules, mesh, a.shape)

    is_names = lambda x: isinstance(x, tuple) and all(isinstance(n, str | type(None)) for n in x)
    mk = lambda rules: jax.tree.map(lambda nm, a: one(nm, a, rules), names, params, is_leaf=is_names)
    return mk(param_rules(zero, "params")), mk(param_rules(0, "params")), mk(param_rules(zero, "grads"))


class Pipeline:
    """A jitted pipelined loss-and-grads step: `Pipeline(...)(params, tokens, labels) -> (loss, grads, aux)`.

    params: nnx.State (logical names read from its Params) or a nested dict of arrays with `names`, the
    same tree of logical-axis-name tuples. 'layers' leaves are stacked [L, ...] in model order (unless
    layout='pipeline'); the other leaves (embedding, final norm, head) are replicated over 'pipe'.
    tokens, labels: [global batch, S] int. grads come back as the same container type, in the same
    layout, with the ZeRO grad sharding (stage >= 2: sharded over ('data', 'expert') on 'embed').
    aux: the model's metrics (`StageFns.finish`), equal to its single-device `loss_fn` aux."""

    def __init__(
        self,
        cfg: ModelConfig,
        pcfg: PipelineConfig,
        mesh: Mesh,
        names=None,
        *,
        zero: int = 0,
        fns: StageFns | None = None,
        residuals: str = "store",
        layout: str = "model",
        nan_bubbles: bool = False,
    ):
        if residuals not in ("store", "recompute"):
            raise ConfigError("residuals", residuals, "use 'store' or 'recompute'")
        if layout not in ("model", "pipeline"):
            raise ConfigError("layout", layout, "use 'model' or 'pipeline'")
        self.cfg, self.pcfg, self.mesh, self.names, self.zero = cfg, pcfg, mesh, names, zero
        self._custom_fns = fns is not None
        self.fns = fns or model_fns(cfg)
        self.residuals, self.layout, self.nan_bubbles = residuals, layout, nan_bubbles
        self.p = int(mesh.shape.get("pipe", 1))
        self.dp = int(np.prod([mesh.shape.get(a, 1) for a in DP_AXES]))
        self.plan = make_plan(pcfg, self.p)
        self._jit = jax.jit(self._step)

    # ------------------------------------------------------------ checks

    def check(self, params, tokens) -> None:
        pv = self.p * self.plan.v
        n = jax.tree.leaves(params["layers"])[0].shape[0]
        if n % pv:
            raise ConfigError(
                "model.n_layers",
                n,
                f"use a multiple of pipe*virtual={pv} stacked layers",
                f"{n} stacked layers do not split into {self.p} stages x {self.plan.v} chunks",
            )
        gb, m = tokens.shape[0], self.plan.m
        if gb % (m * self.dp):
            raise ConfigError(
                "train.global_batch",
                gb,
                f"use a multiple of microbatches*data*expert = {m}*{self.dp} = {m * self.dp}",
                "global batch does not split into microbatches x data-parallel shards",
            )

    def _canon(self, params):
        from flax import nnx

        if isinstance(params, nnx.State):
            if self.names is None:
                self.names = jax.tree.map(logical_names, params, is_leaf=lambda x: isinstance(x, nnx.Variable))
                self.names = self.names.to_pure_dict()
            return params.to_pure_dict()
        if self.names is None:
            if self._custom_fns:
                raise ConfigError("names", None, "pass the logical axis names of a plain-dict params tree")
            import meshrun_models as mm

            state = mm.abstract_params(self.cfg)
            names = jax.tree.map(logical_names, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
            self.names = names.to_pure_dict()
        return dict(params)

    def __call__(self, params, tokens, labels):
        from flax import nnx

        pure = self._canon(params)
        self.check(pure, tokens)
        loss, grads, aux = self._jit(pure, tokens, labels)
        if isinstance(params, nnx.State):
            out = jax.tree.map(lambda a: a, params)
            nnx.replace_by_pure_dict(out, grads)
            grads = out
        return loss, grads, aux

    def lower(self, params, tokens, labels):
        pure = self._canon(params)
        self.check(pure, tokens)
        return self._jit.lower(pure, tokens, labels)

    # ------------------------------------------------------------ the step

    def _step(self, params, tokens, labels):
        mesh, plan, m = self.mesh, self.plan, self.plan.m
        store, comp, gspec = _specs(self.names, params, mesh, self.zero)
        wsc = lambda t, s: jax.tree.map(lambda a, sp: lax.with_sharding_constraint(a, NamedSharding(mesh, sp)), t, s)
        params = wsc(params, store)
        if self.zero >= 3:  # all-gather the data-sharded weight dims once per step, before the loop
            params = gather_params(params, store, comp, mesh)
        layers, other = params["layers"], {k: a for k, a in params.items() if k != "layers"}
        if self.layout == "model":
            layers = wsc(to_pipeline_layout(layers, self.p, plan.v), comp["layers"])
        split = lambda t: (t["layers"], {k: a for k, a in t.items() if k != "layers"})
        (c_l, c_o), (g_l, g_o) = split(comp), split(gspec)
        # Microbatch j = rows j, m+j, 2m+j, ...: each data shard's rows split into m local
        # microbatches without moving token ids between devices (row order does not change the sums).
        tok = tokens.reshape(tokens.shape[0] // m, m, *tokens.shape[1:]).swapaxes(0, 1)
        lab = labels.reshape(labels.shape[0] // m, m, *labels.shape[1:]).swapaxes(0, 1)
        bspec = P(None, DP_AXES)
        tok = lax.with_sharding_constraint(tok, NamedSharding(mesh, bspec))
        lab = lax.with_sharding_constraint(lab, NamedSharding(mesh, bspec))
        nd = lambda t: jax.tree.map(lambda a: a.ndim, t)
        man = lambda specs, t: jax.tree.map(lambda sp, d: restrict(sp, d, MANUAL), specs, nd(t))
        in_specs = (man(c_l, layers), man(c_o, other), bspec, bspec)
        out_specs = (P(), partial_specs(c_l, g_l, mesh), partial_specs(c_o, g_o, mesh), P())
        body = functools.partial(self._body, scatters=(g_l, c_l, g_o, c_o))
        f = jax.shard_map(
            body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=set(MANUAL), check_vma=False
        )
        loss, gl, go, aux = f(layers, other, tok, lab)
        # ZeRO >= 1: reduce-scatter the per-rank partial sums (meshrun.zero; one collective per leaf)
        gl, go = finish_reduction(gl, c_l, g_l, mesh), finish_reduction(go, c_o, g_o, mesh)
        if self.layout == "model":
            gl = from_pipeline_layout(gl, self.p, plan.v)
        grads = wsc({**go, "layers": gl}, gspec)
        return loss, grads, aux

    def _body(self, layers, other, tok, lab, *, scatters):
        with use_rules(self.mesh, compute_rules(self.cfg.sequence_parallel), manual=MANUAL):
            return self._pipeline(layers, other, tok, lab, scatters)

    def _pipeline(self, layers, other, tok, lab, scatters):
        fns, plan = self.fns, self.plan
        p, v, m, V = self.p, plan.v, plan.m, self.p * plan.v
        dp_axes = tuple(a for a in DP_AXES if a in self.mesh.shape)
        stage = lax.axis_index("pipe")
        fill = jnp.nan if self.nan_bubbles else 0.0

        lc = jax.tree.leaves(layers)[0].shape[0] // v
        layers_v = jax.tree.map(lambda a: a.reshape(v, lc, *a.shape[1:]), layers)
        chunk = lambda c: jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, c, 0, keepdims=False), layers_v)
        stage_fn = fns.apply_layers

        x_aval = jax.eval_shape(fns.embed, other, tok[0])
        x_zero = jnp.zeros(x_aval.shape, x_aval.dtype)
        full = lambda shape, dt: jnp.full(shape, fill, dt)

        # Total tokens first (labels only; the head matmul on zeros is dead code XLA removes).
        n_local = fns.head_loss(
            other, jnp.zeros((m * x_aval.shape[0], *x_aval.shape[1:]), x_aval.dtype), lab.reshape(-1, *lab.shape[2:])
        )[1]
        n_tok = lax.psum(jnp.asarray(n_local, jnp.float32), dp_axes)

        (_, aux_aval) = jax.eval_shape(stage_fn, chunk(0), x_zero)
        n_seq = m * tok.shape[1] * self.dp
        weights = dict(fns.aux_weights(n_seq))
        aux_w = {k: float(weights.get(k, 0.0)) for k in aux_aval}
        aux_cot = {k: jnp.asarray(aux_w[k], aux_aval[k].dtype) for k in aux_aval}
        if self.residuals == "store":
            mask, res_avals = activation_residuals(stage_fn, chunk(0), x_zero)
            res_avals = [a for a, d in zip(res_avals, mask) if d]
        else:
            mask, res_avals = None, [x_aval]
        nslot = plan.slots + 1  # the last slot takes idle ticks' writes
        carry = {
            "x_in": full(x_aval.shape, x_aval.dtype),
            "g_in": full(x_aval.shape, x_aval.dtype),
            "res": [full((nslot, *a.shape), a.dtype) for a in res_avals],
            "g_layers": jax.tree.map(jnp.zeros_like, layers_v),
            "g_other": jax.tree.map(jnp.zeros_like, other),
            "loss": jnp.zeros((), jnp.float32),
            "aux": {k: jnp.zeros((), a.dtype) for k, a in aux_aval.items()},
        }
        if not plan.fused_head:
            carry["dy"] = full((nslot, *x_aval.shape), x_aval.dtype)

        put = lambda buf, i, x: lax.dynamic_update_index_in_dim(buf, x, i, 0)
        take = lambda buf, i: lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)
        zeros_other = lambda: jax.tree.map(jnp.zeros_like, other)

        def cell(row, kind):
            """This stage's forward ('f') or backward ('b') task of a tick: idle cells (mb = -1) run on
            microbatch/chunk 0 into the trash slot and are masked out."""
            mb_raw = row[f"{kind}_mb"][stage]
            valid = mb_raw >= 0
            mb, ch = jnp.maximum(mb_raw, 0), jnp.maximum(row[f"{kind}_chunk"][stage], 0)
            slot = jnp.where(valid, row[f"{kind}_slot"][stage], nslot - 1)
            k = ch * p + stage  # virtual stage
            return valid, mb, ch, slot, valid & (k == 0), valid & (k == V - 1)

        def forward(c, row):
            valid, mb, ch, slot, first, last = cell(row, "f")
            x = lax.cond(first, lambda: fns.embed(other, take(tok, mb)).astype(x_aval.dtype), lambda: c["x_in"])
            x = jnp.where(valid, x, fill)
            (y, aux), vjp = jax.vjp(stage_fn, chunk(ch), x)
            if self.residuals == "store":
                keep = [r for r, d in zip(jax.tree.leaves(vjp), mask) if d]
            else:
                keep = [x]
            c = dict(c, res=[put(b, slot, r) for b, r in zip(c["res"], keep)])
            c["aux"] = {k_: c["aux"][k_] + jnp.where(valid, aux[k_], 0) for k_ in c["aux"]}

            def head():
                hl = lambda o, a: fns.head_loss(o, a, take(lab, mb))
                ls, hvjp, _ = jax.vjp(hl, other, y, has_aux=True)
                d_o, dy = hvjp(jnp.asarray(1.0, ls.dtype) / n_tok.astype(ls.dtype))
                return ls.astype(jnp.float32), d_o, dy.astype(x_aval.dtype)

            ls, d_o, dy = lax.cond(last, head, lambda: (jnp.zeros((), jnp.float32), zeros_other(), x_zero))
            c["loss"] = c["loss"] + ls
            c["g_other"] = jax.tree.map(jnp.add, c["g_other"], d_o)
            if not plan.fused_head:
                c["dy"] = put(c["dy"], slot, dy)
            return c, y, dy

        def backward(c, row, dy_head):
            valid, mb, ch, slot, first, last = cell(row, "b")
            if not plan.fused_head:
                dy_head = take(c["dy"], slot)
            dy = jnp.where(last, dy_head, c["g_in"])
            dy = jnp.where(valid, dy, fill)
            saved = [take(b, slot) for b in c["res"]]
            if self.residuals == "store":
                _, tmpl = jax.vjp(stage_fn, chunk(ch), x_zero)
                leaves, tdef = jax.tree.flatten(tmpl)
                it = iter(saved)
                leaves = [next(it) if d else lf for lf, d in zip(leaves, mask)]
                vjp = jax.tree.unflatten(tdef, leaves)
            else:
                _, vjp = jax.vjp(stage_fn, chunk(ch), saved[0])
            d_p, dx = vjp((dy, aux_cot))
            c = dict(c)
            c["g_layers"] = jax.tree.map(
                lambda g, d: put(g, ch, take(g, ch) + jnp.where(valid, d, 0).astype(g.dtype)), c["g_layers"], d_p
            )

            def embed_grad():
                _, evjp = jax.vjp(lambda o: fns.embed(o, take(tok, mb)), other)
                return evjp(dx.astype(x_aval.dtype))[0]

            d_o = lax.cond(first, embed_grad, zeros_other)
            c["g_other"] = jax.tree.map(jnp.add, c["g_other"], d_o)
            return c, dx

        fwd_perm = [(i, (i + 1) % p) for i in range(p if v > 1 else p - 1)]
        bwd_perm = [((i + 1) % p, i) for i in range(p if v > 1 else p - 1)]

        def tick(kind, send_f, send_b):
            def body(c, row):
                dy = x_zero
                if "F" in kind:
                    c, y, dy = forward(c, row)
                if "B" in kind:
                    c, dx = backward(c, row, dy)
                if send_f:
                    c["x_in"] = lax.ppermute(y, "pipe", fwd_perm)
                if send_b:
                    c["g_in"] = lax.ppermute(dx, "pipe", bwd_perm)
                return c, None

            return body

        for kind, t0, t1, send_f, send_b in plan.phases:
            xs = {k: jnp.asarray(a[t0:t1]) for k, a in plan.tables.items()}
            carry, _ = lax.scan(tick(kind, send_f, send_b), carry, xs)

        # One data-parallel reduction per step, after the loop: psum here; leaves that ZeRO
        # scatters leave as per-rank partial sums for `finish_reduction` (meshrun/zero.py).
        g_l, cg_l, g_o, cg_o = scatters
        gl = jax.tree.map(lambda a: a.reshape(v * lc, *a.shape[2:]), carry["g_layers"])
        gl = reduce_grads_local(gl, cg_l, g_l, self.mesh)
        go = reduce_grads_local(carry["g_other"], cg_o, g_o, self.mesh, extra=("pipe",))
        loss_sum = lax.psum(carry["loss"], MANUAL)
        sums = lax.psum(carry["aux"], MANUAL)
        if fns.finish is not None:
            loss, metrics = fns.finish(loss_sum, n_tok, sums, n_seq)
        else:
            loss = loss_sum / n_tok + sum((aux_w[k] * sums[k] for k in sums), jnp.zeros((), jnp.float32))
            metrics = sums
        return loss, gl, go, metrics


def _axes(spec: P) -> list[tuple[str, ...]]:
    return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]


_CACHE: dict[Any, Pipeline] = {}


def pipeline_loss_and_grads(
    params, tokens, labels, cfg: ModelConfig, pcfg: PipelineConfig, mesh: Mesh, *, zero: int = 0, names=None, **kw
):
    """(loss, grads, aux) of one pipelined step of the meshrun_models transformer (or `fns=`);
    builds and caches one jitted `Pipeline` per configuration."""
    key = (cfg, pcfg, mesh, zero, repr(names), tuple(sorted((k, repr(v)) for k, v in kw.items())))
    if key not in _CACHE:
        _CACHE[key] = Pipeline(cfg, pcfg, mesh, names, zero=zero, **kw)
    return _CACHE[key](params, tokens, labels)
