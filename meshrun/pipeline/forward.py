"""Forward-only pipeline (evaluation): loss sums of a batch on a pipelined mesh, no backward.

Same placement as the training step (`Pipeline.placed`: layers in pipeline placement sharded over
'pipe', microbatch j = local rows j, m+j, ...; a shard_map manual over 'pipe' and the data-parallel
axes). GPipe forward in v rounds, one per virtual chunk: in round c, stage s runs microbatch t - s
of chunk c at tick t (m + p - 1 ticks), activations move s -> s+1 by `ppermute`; with v > 1 the
last stage's output wraps to stage 0, which keeps it (an [M, B, S, D] buffer: one activation per
local row) for round c + 1. The last stage of the last round runs the head and sums the loss.
Idle cells skip the compute in a `lax.cond` whose predicate is shared by the tensor group.
v(m + p - 1) ticks, against v·m + p - 1 for a schedule that interleaves rounds: evaluation is rare.
Chunks placed in a V (two per stage, `split.placement == 'v'`): round 1 runs from stage p - 1 down to
stage 0, which runs the head; stage p - 1 keeps its own round-0 outputs for it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from meshrun.family import contract
from meshrun.parallel.layer_fetch import use_layer_fetch
from meshrun.parallel.sharding import GRAD_AXES, MANUAL, compute_rules, manual_axes, use_rules
from meshrun.parallel.zero import without_layers
from meshrun.pipeline.spec import PipelineSpec
from meshrun.pipeline.tick_loop import stage_fn, take


def forward_sums(pl, params, tokens, labels, segment_ids=None):
    """(loss_sum, n_tokens) over the global batch, through `Pipeline` `pl`'s stages (traceable)."""
    zl = pl.zero
    params, batch, bspec = pl.placed(params, tokens, labels, segment_ids)
    layers, other = params["layers"], without_layers(params)
    f = jax.shard_map(
        lambda lay, oth, *b: _body(pl.spec, lay, oth, *b, fetch=zl.sub("layers").layer_fetch()),
        mesh=pl.mesh,
        in_specs=(zl.sub("layers").local_compute(), zl.without("layers").local_compute(), *(bspec,) * len(batch)),
        out_specs=(P(), P()),
        axis_names=set(manual_axes(pl.mesh)),
        check_vma=False,
    )
    return f(layers, other, *batch)


def _body(spec: PipelineSpec, layers, other, tok, lab, seg=None, fetch=None):
    """One device's forward (inside shard_map): one round per chunk of its layers, each a scan of
    m + p - 1 ticks; (loss_sum, n_tokens) summed over the mesh."""
    fns, p, v, m = spec.fns, spec.p, spec.program.v, spec.program.m
    stage = lax.axis_index("pipe")
    with use_rules(spec.mesh, compute_rules(fns.sequence_parallel), manual=MANUAL), use_layer_fetch(fetch):
        lc = spec.split.lmax  # chunk c of this stage: entries [c*lmax, (c+1)*lmax) (padded when uneven)
        x_aval = jax.eval_shape(fns.embed, other, tok[0])
        x_zero = jnp.zeros(x_aval.shape, x_aval.dtype)
        buf = jnp.zeros((m, *x_aval.shape), x_aval.dtype) if v > 1 else None
        loss = jnp.zeros((), jnp.float32)
        for c in range(v):
            chunk = jax.tree.map(lambda a, c=c: a[c * lc : (c + 1) * lc], layers)
            tick = _round_tick(spec, c, chunk, stage, other, (tok, lab, seg), x_zero)
            (_, buf, loss), _ = lax.scan(tick, (x_zero, buf, loss), jnp.arange(m + p - 1))
        flat = lambda a: a.reshape(-1, *a.shape[2:])
        n_tok = contract.token_count(fns, other, flat(tok), flat(lab))
        live = manual_axes(spec.mesh)
        return lax.psum(loss, live), lax.psum(n_tok, tuple(a for a in GRAD_AXES if a in live))


def _round_tick(spec: PipelineSpec, c: int, chunk, stage, other, batch, x_zero):
    """The scan body of round c (chunk c of each stage): at tick t the stage runs microbatch t - pos
    when there is one, adds the head's loss on the round's last stage and sends its output on; rounds
    before the last keep their finished activations in `buf` for the next round's first stage."""
    fns, p, v, m = spec.fns, spec.p, spec.program.v, spec.program.m
    tok, lab, seg = batch
    vee = spec.split.placement == "v"
    down = vee and c % 2 == 1  # this round runs from stage p - 1 down to stage 0
    pos = p - 1 - stage if down else stage  # the stage's place in this round
    head_stage = 0 if down else p - 1
    entry = p - 1 if down else 0  # the stage that starts a round after the first
    if vee:
        perm = [(i + 1, i) if down else (i, i + 1) for i in range(p - 1)]
    else:
        perm = [(i, (i + 1) % p) for i in range(p if v > 1 else p - 1)]

    def run(x_in, buf, j):
        if c == 0:
            x0 = lax.cond(stage == 0, lambda: fns.embed(other, take(tok, j)).astype(x_zero.dtype), lambda: x_in)
        else:
            x0 = jnp.where(stage == entry, take(buf, j), x_in)
        apply = contract.layers_fn(fns, None if seg is None else take(seg, j))
        y, _ = stage_fn(spec.split, apply, c, stage)(chunk, x0)
        if c < v - 1:
            return y, jnp.zeros((), jnp.float32)
        head = lambda: fns.head_loss(other, y, take(lab, j))[0].astype(jnp.float32)
        return y, lax.cond(stage == head_stage, head, lambda: jnp.zeros((), jnp.float32))

    def tick(carry, t):
        x_in, buf, loss = carry
        j = jnp.clip(t - pos, 0, m - 1)
        valid = (t - pos >= 0) & (t - pos < m)
        y, ls = lax.cond(valid, lambda: run(x_in, buf, j), lambda: (x_zero, jnp.zeros((), jnp.float32)))
        x_next = lax.ppermute(y, "pipe", perm)
        if buf is not None and c < v - 1:  # the next round's first stage keeps what this one finished
            buf = _keep_for_next_round(buf, y if vee else x_next, t, stage, p, m, vee)  # a V's tip: its own output
        return (x_next, buf, loss + ls), None

    return tick


def _keep_for_next_round(buf, got, t, stage, p: int, m: int, vee: bool):
    """buf with microbatch t - (p - 1)'s finished activation `got` written into its row on the stage
    that starts the next round (stage p - 1 of a V, else stage 0); unchanged elsewhere and before."""
    jw = t - (p - 1)
    keep = (stage == (p - 1 if vee else 0)) & (jw >= 0)
    i = jnp.clip(jw, 0, m - 1)
    return lax.dynamic_update_index_in_dim(buf, jnp.where(keep, got, take(buf, i)), i, 0)
