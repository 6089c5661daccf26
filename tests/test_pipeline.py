"""Pipeline executor on 8 simulated CPU devices (float32).

Parity: loss and every gradient equal the single-device reference (rtol 1e-5) for GPipe, 1F1B (on
the lockstep and the per-op executor), interleaved 1F1B and zb-h1, p in {2, 4}, m in {p, 2p, 4p},
with data / tensor / expert parallelism inside the stages, ZeRO-2/3 and recompute. A tiny stacked
tanh-MLP ("toy", vocab-parallel head, an aux sum) covers the wide matrix because it compiles in
seconds; the meshrun_models transformer (dense and MoE) covers the key layouts. Also: NaN-filled
bubbles never leak, 1F1B temp memory does not grow with m (per-op: p slots, less temp than
lockstep), collective-permute bytes per step equal the schedule's, the data-parallel reduction runs
once after the tick loop, and bad input raises ConfigError.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import meshrun_models as mm
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from meshrun_models.llama.config import LlamaConfig

from meshrun.analysis import hlo
from meshrun.config import ModelConfig, PipelineConfig
from meshrun.errors import ConfigError
from meshrun.family.contract import ModelFns
from meshrun.parallel.sharding import constrain
from meshrun.pipeline import registry, schedules
from meshrun.pipeline.executor import Pipeline
from meshrun.pipeline.residuals import activation_residuals
from meshrun.pipeline.spec import pipeline_spec
from meshrun.pipeline.split import layer_split
from meshrun.runtime.mesh import build_mesh

RTOL = 1e-5

# ---------------------------------------------------------------- toy model (stand-in stage function)

V, D, F, L, S = 32, 16, 32, 8, 8
TOY_NAMES = {
    "embed": ("vocab", "embed"),
    "head": ("embed", "vocab"),
    "layers": {"w1": ("layers", "embed", "mlp"), "w2": ("layers", "mlp", "embed")},
}


def toy_embed(prm, tok):
    return constrain(prm["embed"][tok], ("batch", "length", "embed"))


def toy_layers(lp, x):
    def body(x, w):
        h = constrain(jnp.tanh(jnp.einsum("bsd,df->bsf", x, w["w1"])), ("batch", "length", "mlp"))
        x = x + jnp.einsum("bsf,fd->bsd", h, w["w2"])
        return x, jnp.sum(jnp.mean(x**2, axis=(1, 2)))  # per-sequence sums: exact over any split

    x, sq = jax.lax.scan(body, x, lp)
    return x, {"sq": jnp.sum(sq)}


def toy_head(prm, x, lab):
    logits = constrain(jnp.einsum("bsd,dv->bsv", x, prm["head"]), ("batch", "length", "vocab"))
    mask = lab >= 0
    tgt = jnp.take_along_axis(logits, jnp.maximum(lab, 0)[..., None], -1)[..., 0]
    xent = jax.nn.logsumexp(logits, -1) - tgt
    return jnp.sum(jnp.where(mask, xent, 0.0)), jnp.sum(mask).astype(jnp.float32)


TOY = ModelFns(toy_embed, toy_layers, toy_head, aux_weights=lambda n_seq: {"sq": 0.1 / n_seq}, param_names=TOY_NAMES)


def toy_loss(prm, tok, lab):
    x, aux = toy_layers(prm["layers"], toy_embed(prm, tok))
    ls, n = toy_head(prm, x, lab)
    return ls / n + 0.1 * aux["sq"] / tok.shape[0], aux


@functools.cache
def toy_params():
    k = jax.random.split(jax.random.key(0), 4)
    return {
        "embed": jax.random.normal(k[0], (V, D)) * 0.5,
        "head": jax.random.normal(k[1], (D, V)) * 0.3,
        "layers": {"w1": jax.random.normal(k[2], (L, D, F)) * 0.3, "w2": jax.random.normal(k[3], (L, F, D)) * 0.3},
    }


@functools.cache
def batch(b: int, vocab: int, seed: int = 1):
    tok = jax.random.randint(jax.random.key(seed), (b, S), 0, vocab)
    lab = jax.random.randint(jax.random.key(seed + 1), (b, S), 0, vocab)
    return tok, lab.at[0, :3].set(-1)  # ignored labels: n_tokens must come from the labels


@functools.cache
def toy_ref(b: int):
    tok, lab = batch(b, V)
    (loss, aux), g = jax.jit(jax.value_and_grad(toy_loss, has_aux=True))(toy_params(), tok, lab)
    return float(loss), g, aux


@functools.cache
def mesh_of(pipe, data, expert, tensor):
    return build_mesh(pipe=pipe, data=data, expert=expert, tensor=tensor)


@functools.cache
def toy_compiled(dims, schedule, m, v, b, **kw):
    """(pipeline, compiled step, args) for the toy model; cached so tests share compiles."""
    kw = dict(kw)
    placement = kw.get("placement", "model")
    pc = PipelineConfig(schedule=schedule, microbatches=m, virtual=v, executor=kw.pop("executor", "auto"),
                        overlap_grad_reduce=kw.pop("overlap_grad_reduce", False))  # fmt: skip
    params = toy_params()
    if placement == "pipeline":
        params = {**params, "layers": layer_split(pc, L, dims[0]).to_pipeline(params["layers"])}
    pl = Pipeline(pipeline_spec(TOY, pc, mesh_of(*dims), params, **kw))
    args = (params, *batch(b, V))
    return pl, pl.lower(*args).compile(), args


def assert_tree_close(got, ref):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(ref), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        scale = float(np.max(np.abs(b)))
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL * scale, err_msg=jax.tree_util.keystr(path))


# ---------------------------------------------------------------- parity (toy)

# (mesh pipe, data, expert, tensor), schedule, m, v, global batch, options. Batches match the memory
# and HLO tests' (1 sequence per microbatch and shard) where they can, so those reuse these compiles.
OVERLAP = ("overlap_grad_reduce", True)
TOY_CASES = {
    "p2d2t2-1f1b-m4": ((2, 2, 1, 2), "1f1b", 4, 1, 8, ()),
    "p2d2t2-gpipe-m16": ((2, 2, 1, 2), "gpipe", 16, 1, 32, ()),
    "p2d2t2-interleaved-m8": ((2, 2, 1, 2), "interleaved", 8, 2, 32, ()),
    "p4t2-1f1b-m8": ((4, 1, 1, 2), "1f1b", 8, 1, 8, ()),
    "p4t2-1f1b-m32": ((4, 1, 1, 2), "1f1b", 32, 1, 32, ()),
    "p4t2-gpipe-m8": ((4, 1, 1, 2), "gpipe", 8, 1, 8, ()),
    "p4t2-interleaved-m4": ((4, 1, 1, 2), "interleaved", 4, 2, 8, ()),
    "p2d4-1f1b-m2": ((2, 4, 1, 1), "1f1b", 2, 1, 8, ()),
    "p4d2-1f1b-m16": ((4, 2, 1, 1), "1f1b", 16, 1, 32, ()),
    "p2d2t2-1f1b-m4-zero2": ((2, 2, 1, 2), "1f1b", 4, 1, 8, (("zero", 2),)),
    "p2d2t2-1f1b-m4-zero3": ((2, 2, 1, 2), "1f1b", 4, 1, 8, (("zero", 3),)),
    "p2d2t2-1f1b-m4-recompute": ((2, 2, 1, 2), "1f1b", 4, 1, 8, (("residuals", "recompute"),)),
    "p4t2-1f1b-m8-no-skip": ((4, 1, 1, 2), "1f1b", 8, 1, 8, (("skip_idle", False),)),
    "p2d2t2-interleaved-m4-pipeline-layout": ((2, 2, 1, 2), "interleaved", 4, 2, 8, (("placement", "pipeline"),)),
    # zb-h1 (B and W split) for p in {2, 4}, m in {p, 2p, 4p}
    "p2d2t2-zb-h1-m2": ((2, 2, 1, 2), "zb-h1", 2, 1, 4, ()),
    "p2d2t2-zb-h1-m4": ((2, 2, 1, 2), "zb-h1", 4, 1, 8, ()),
    "p2d2t2-zb-h1-m8": ((2, 2, 1, 2), "zb-h1", 8, 1, 16, ()),
    "p4t2-zb-h1-m4": ((4, 1, 1, 2), "zb-h1", 4, 1, 4, ()),
    "p4t2-zb-h1-m8": ((4, 1, 1, 2), "zb-h1", 8, 1, 8, ()),
    "p4t2-zb-h1-m16": ((4, 1, 1, 2), "zb-h1", 16, 1, 16, ()),
    # 1F1B's per-op timeline (Megatron's: p - s microbatches in flight on stage s)
    "p2d2t2-1f1b-per-op-m4": ((2, 2, 1, 2), "1f1b", 4, 1, 8, (("executor", "per_op"),)),
    "p2d2t2-1f1b-per-op-m8": ((2, 2, 1, 2), "1f1b", 8, 1, 16, (("executor", "per_op"),)),
    "p4t2-1f1b-per-op-m4": ((4, 1, 1, 2), "1f1b", 4, 1, 4, (("executor", "per_op"),)),
    "p4t2-1f1b-per-op-m8": ((4, 1, 1, 2), "1f1b", 8, 1, 8, (("executor", "per_op"),)),
    "p4-1f1b-per-op-m8-no-skip": ((4, 1, 1, 2), "1f1b", 8, 1, 8, (("executor", "per_op"), ("skip_idle", False))),
    # ZB-V: two chunks per stage in a V (stage s holds virtual stages s and 2p-1-s), B/W split
    "p2d2t2-zb-v-m4": ((2, 2, 1, 2), "zb-v", 4, 2, 8, ()),
    "p4t2-zb-v-m8": ((4, 1, 1, 2), "zb-v", 8, 2, 8, ()),
    "p4d2-zb-v-m4": ((4, 2, 1, 1), "zb-v", 4, 2, 8, ()),
    "p2d2t2-zb-v-m8-zero2": ((2, 2, 1, 2), "zb-v", 8, 2, 16, (("zero", 2),)),
    # pipeline.overlap_grad_reduce: each chunk reduced (ZeRO-1: reduce-scattered) from its sums at its grad cut
    "p2d2t2-zb-v-m4-zero1-overlap": ((2, 2, 1, 2), "zb-v", 4, 2, 8, (("zero", 1), OVERLAP)),
    "p4d2-zb-v-m8-zero1-overlap": ((4, 2, 1, 1), "zb-v", 8, 2, 16, (("zero", 1), OVERLAP)),
    "p2d2t2-interleaved-m4-overlap": ((2, 2, 1, 2), "interleaved", 4, 2, 8, (("placement", "pipeline"), OVERLAP)),
    "p2d2t2-interleaved-m4-zero1-overlap": ((2, 2, 1, 2), "interleaved", 4, 2, 8, (("zero", 1), OVERLAP)),
    "p2d2t2-zb-v-m8-zero2-overlap": ((2, 2, 1, 2), "zb-v", 8, 2, 16, (("zero", 2), OVERLAP)),
}
SLOW_TOY = {"p4t2-zb-v-m8", "p4d2-zb-v-m4", "p2d2t2-zb-v-m8-zero2", "p4d2-zb-v-m8-zero1-overlap"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_TOY else c for c in TOY_CASES])
def test_toy_parity(case):
    dims, schedule, m, v, b, kw = TOY_CASES[case]
    pl, compiled, args = toy_compiled(dims, schedule, m, v, b=b, **dict(kw))
    loss, grads, aux = compiled(*args)
    ref_loss, ref_grads, ref_aux = toy_ref(b)
    # Layer grads stay stage-sharded and tensor-parallel; ZeRO-2/3 shard them over data on 'embed'.
    spec = grads["layers"]["w1"].sharding.spec
    want = P("pipe", "data" if pl.zero.stage >= 1 else None, "tensor" if dims[3] > 1 else None)
    assert tuple(spec) + (None,) * (3 - len(spec)) == tuple(want), spec
    if pl.placement == "pipeline":
        grads = {**grads, "layers": pl.split.from_pipeline(grads["layers"])}
    np.testing.assert_allclose(float(loss), ref_loss, rtol=RTOL)
    np.testing.assert_allclose(float(aux["sq"]), float(ref_aux["sq"]), rtol=RTOL)
    assert_tree_close(grads, ref_grads)


def test_pipeline_layout_moves_no_weights_across_pipe():
    """Interleaved with model-order params permutes layers over 'pipe' (all-to-all) each step;
    params stored in pipeline order do not."""
    dims = (2, 2, 1, 2)
    ops = {}
    for layout, (pl, c, _) in {
        "model": toy_compiled(dims, "interleaved", 8, 2, b=32),
        "pipeline": toy_compiled(dims, "interleaved", 4, 2, b=8, placement="pipeline"),
    }.items():
        ops[layout] = {(x.op, x.axes) for x in hlo.collectives(c.as_text(), dict(pl.mesh.shape))}
    assert ("all-to-all", ("pipe",)) in ops["model"]
    assert not any("pipe" in axes for op, axes in ops["pipeline"] if op in ("all-to-all", "all-gather"))


# ---------------------------------------------------------------- parity (meshrun_models transformer)

DENSE = LlamaConfig(vocab=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, max_seq_len=16)
MOE = LlamaConfig(
    vocab=64,
    d_model=32,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    d_ff=64,
    max_seq_len=16,
    n_experts=4,
    top_k=2,
    moe_every=2,
)  # 2 stacked units (dense block + MoE block each); default capacity 1.25 drops some tokens


MOE_KEYS = {"moe_aux_loss", "moe_z_loss", "dropped_tokens"}


@functools.cache
def model_ref(cfg: ModelConfig, b: int):
    _, params = mm.init_params(cfg, 0)
    tok, lab = batch(b, cfg.vocab, seed=3)
    fn = jax.jit(jax.value_and_grad(lambda p, t, y: mm.loss_fn(p, t, y, cfg), has_aux=True))
    (loss, aux), g = fn(params, tok, lab)
    return params, (tok, lab), float(loss), g.to_pure_dict(), aux


MODEL_CASES = {
    "dense-p2d2t2-1f1b-m4-state": (DENSE, (2, 2, 1, 2), "1f1b", 4, 1, True),
    "dense-p2d2t2-interleaved-m4-dict": (DENSE, (2, 2, 1, 2), "interleaved", 4, 2, False),
    "dense-p4t2-gpipe-m8-dict": (DENSE, (4, 1, 1, 2), "gpipe", 8, 1, False),
    "moe-p2e2t2-1f1b-m4-state": (MOE, (2, 1, 2, 2), "1f1b", 4, 1, True),
    "dense-p2d2t2-zb-h1-m4-dict": (DENSE, (2, 2, 1, 2), "zb-h1", 4, 1, False),
    "dense-p4t2-1f1b-per-op-m8-dict": (DENSE, (4, 1, 1, 2), "1f1b", 8, 1, False, "per_op"),
    "dense-p2d2t2-zb-v-m4-state": (DENSE, (2, 2, 1, 2), "zb-v", 4, 1, True),
    "moe8-p2e2t2-zb-v-m4-dict": (dataclasses.replace(MOE, n_layers=8), (2, 1, 2, 2), "zb-v", 4, 1, False),
}
SLOW_MODEL = {"dense-p2d2t2-zb-v-m4-state", "moe8-p2e2t2-zb-v-m4-dict"}


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_MODEL else c for c in MODEL_CASES]
)
def test_model_parity(case):
    cfg, dims, schedule, m, v, as_state, *executor = MODEL_CASES[case]
    params, (tok, lab), ref_loss, ref_grads, ref_aux = model_ref(cfg, 16)
    pc = PipelineConfig(schedule=schedule, microbatches=m, virtual=v, executor=(*executor, "auto")[0])
    pl = Pipeline(pipeline_spec(mm.model_fns(cfg), pc, mesh_of(*dims), params))
    loss, grads, aux = pl(params if as_state else params.to_pure_dict(), tok, lab)
    if as_state:
        assert type(grads) is type(params)
        grads = grads.to_pure_dict()
    np.testing.assert_allclose(float(loss), ref_loss, rtol=RTOL)
    assert set(aux) == set(ref_aux) == {"ce_loss", "n_tokens"} | (MOE_KEYS if cfg.is_moe else set())
    for k in ref_aux:
        np.testing.assert_allclose(float(aux[k]), float(ref_aux[k]), rtol=RTOL, atol=1e-7, err_msg=k)
    assert_tree_close(grads, ref_grads)
    if cfg.is_moe:
        assert float(ref_aux["dropped_tokens"]) > 0  # the capacity path is exercised
        assert float(ref_aux["moe_aux_loss"]) > 0


def test_residual_buffer_holds_activations_not_weights():
    """The vjp pytree of a stage also holds its weights (dx = dy @ W^T needs W); only leaves that
    depend on the activation go into the per-microbatch buffer (through the model's layer scan)."""
    lp = jax.tree.map(lambda a: a[:2], mm.init_params(DENSE, 0)[1].to_pure_dict()["layers"])
    x = jnp.zeros((3, S, DENSE.d_model))  # batch 3: no weight dimension is 3
    mask, avals = activation_residuals(lambda p, a: mm.apply_layers(p, a, DENSE), lp, x)
    stored = [a for a, d in zip(avals, mask) if d]
    rebuilt = [a for a, d in zip(avals, mask) if not d]
    assert stored and all(3 in a.shape for a in stored)
    weight_elems = sum(a.size for a in jax.tree.leaves(lp))
    assert sum(a.size for a in rebuilt) >= weight_elems // 2  # the stacked q/k/v/o, gate/up/down


# ---------------------------------------------------------------- bubbles never leak


@pytest.mark.parametrize(
    "dims,schedule,m,v,skip",
    [
        ((4, 1, 1, 2), "1f1b", 8, 1, True),
        ((4, 1, 1, 2), "1f1b", 8, 1, False),  # idle cells really run on the NaN fill
        ((2, 2, 1, 2), "interleaved", 4, 2, True),
        ((2, 2, 1, 2), "gpipe", 4, 1, True),
        ((4, 1, 1, 2), "zb-h1", 8, 1, True),  # inbox and dy trash slots too
        ((4, 1, 1, 2), "1f1b/per_op", 8, 1, True),
        ((4, 1, 1, 2), "1f1b/per_op", 8, 1, False),
    ],
)
def test_nan_bubbles_do_not_leak(dims, schedule, m, v, skip):
    schedule, *ex = schedule.split("/")
    kw = {"executor": ex[0]} if ex else {}
    pl, compiled, args = toy_compiled(dims, schedule, m, v, b=32, nan_bubbles=True, skip_idle=skip, **kw)
    assert re.search(r"f32\[\]\s+constant\(nan\)", compiled.as_text())  # the NaN fill is really there
    loss, grads, _ = compiled(*args)
    assert np.isfinite(float(loss)) and all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    ref_loss, ref_grads, _ = toy_ref(32)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=RTOL)
    assert_tree_close(grads, ref_grads)


# ---------------------------------------------------------------- memory and collectives


PER_OP = {"executor": "per_op"}


def temp_bytes(dims, schedule, m, **kw):
    dp = dims[1] * dims[2]
    _, c, _ = toy_compiled(dims, schedule, m, 1, b=m * dp, **kw)  # microbatch of 1 sequence per shard
    return c.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("dims", [(2, 2, 1, 2), (4, 1, 1, 2)])
def test_1f1b_temp_memory_does_not_grow_with_m(dims):
    p = dims[0]
    small, large = temp_bytes(dims, "1f1b", 2 * p), temp_bytes(dims, "1f1b", 8 * p)
    print(f"1F1B p={p}: temp {small} B at m={2 * p}, {large} B at m={8 * p}")
    assert large <= 1.15 * small
    # The measure can tell: GPipe keeps all m microbatches' residuals.
    g_small, g_large = temp_bytes(dims, "gpipe", 2 * p), temp_bytes(dims, "gpipe", 8 * p)
    assert g_large > 2 * g_small
    # Residual slots = max in-flight per stage: min(m, 2p-1) for lockstep 1F1B, m for GPipe.
    for m in (2 * p, 8 * p):
        assert toy_compiled(dims, "1f1b", m, 1, b=m * dims[1] * dims[2])[0].program.slots == min(m, 2 * p - 1)


def test_per_op_1f1b_holds_p_slots_and_less_temp_than_lockstep():
    """1F1B on the per-op executor (Megatron's timeline, backward split into B and W) holds
    min(m, p - s) microbatches on stage s: a buffer of p slots (+ one B's stash), not the lockstep
    table's min(m, 2p - 1), with one-op ticks (bubble 2(p - 1)/(3m + 2(p - 1)) against lockstep's
    (p - 1)/(m + p - 1)); the compiled temp bytes are smaller at p = 4, m = 8 and do not grow with m."""
    dims, p = (4, 1, 1, 2), 4
    lock, per_op = (toy_compiled(dims, "1f1b", 2 * p, 1, b=2 * p, **kw)[0].program for kw in ({}, PER_OP))
    assert (lock.slots, per_op.slots, per_op.stash_slots) == (2 * p - 1, p, 1)
    assert per_op.stage_slots() == tuple(p - s for s in range(p))
    assert lock.bubble == pytest.approx((p - 1) / (2 * p + p - 1))
    assert per_op.bubble == pytest.approx(2 * (p - 1) / (3 * 2 * p + 2 * (p - 1)))
    t_lock, t_small = temp_bytes(dims, "1f1b", 2 * p), temp_bytes(dims, "1f1b", 2 * p, **PER_OP)
    t_large = temp_bytes(dims, "1f1b", 8 * p, **PER_OP)
    print(f"1F1B p={p} m={2 * p}: temp lockstep {t_lock} B, per-op {t_small} B ({t_large} B at m={8 * p})")
    assert t_small < t_lock and t_large <= 1.15 * t_small
    # of the 3 residual slots saved, at least one's bytes remain after the per-op executor's own
    # buffers (B's stash: one slot and its trash slot; the activation and gradient inboxes)
    _, c, _ = toy_compiled(dims, "1f1b", 2 * p, 1, b=2 * p, **PER_OP)
    lp = jax.tree.map(lambda a: a[: L // p], toy_params()["layers"])
    mask, avals = activation_residuals(toy_layers, lp, jnp.zeros((1, S, D)))
    residuals = sum(a.size * 4 for a, d in zip(avals, mask, strict=True) if d)
    assert t_lock - t_small >= residuals


@pytest.mark.parametrize("dims", [(2, 2, 1, 2), (4, 1, 1, 2)])
def test_per_op_1f1b_permutes_one_activation_per_send(dims):
    """The per-op 1F1B program's sends, as compiled: every collective-permute carries one microbatch
    activation over 'pipe' and the count is the program's (one per tick of a sending phase)."""
    dp, m = dims[1] * dims[2], 2 * dims[0]
    pl, c, _ = toy_compiled(dims, "1f1b", m, 1, b=m * dp, **PER_OP)
    perms = [(x, k) for x, k in executed(c.as_text(), pl.mesh) if x.op == "collective-permute"]
    assert perms and all(x.axes == ("pipe",) and x.bytes == S * D * 4 * x.parts for x, k in perms)
    assert (sum(k for _, k in perms), sum(x.parts * k for x, k in perms)) == pl.program.permute_counts()


def test_zb_h1_temp_memory_flat_in_m():
    """ZB-H1 holds at most p microbatches whose W has not run (1F1B's peak), so its buffers do not
    grow with m: compiled temp bytes within +15% from m = 2p to m = 8p."""
    dims, p = (4, 1, 1, 2), 4
    small, large = temp_bytes(dims, "zb-h1", 2 * p), temp_bytes(dims, "zb-h1", 8 * p)
    print(f"zb-h1 p={p}: temp {small} B at m={2 * p}, {large} B at m={8 * p}")
    assert large <= 1.15 * small
    assert toy_compiled(dims, "zb-h1", 8 * p, 1, b=8 * p)[0].program.slots == p


def test_zb_h1_w_reruns_neither_forward_nor_chain():
    """W reads what B stashed: with residuals recomputed (`residuals='recompute'`) only B re-runs the
    forward (the toy MLP's one tensor all-reduce per layer, in the B branch of each per-op tick;
    each branch of the switch counts once per tick in the HLO): W takes the activations it needs
    from B's stash too, and never forms an activation cotangent (no all-reduce at all)."""
    count, ticks = {}, None
    for res in ("store", "recompute"):
        kw = {} if res == "store" else {"residuals": res}
        pl, c, args = toy_compiled((4, 1, 1, 2), "zb-h1", 8, 1, b=8, **kw)
        count[res] = sum(k for x, k in executed(c.as_text(), pl.mesh) if x.op == "all-reduce" and x.axes == ("tensor",))
        ticks = pl.program.ticks
        loss, grads, _ = c(*args)
        np.testing.assert_allclose(float(loss), toy_ref(8)[0], rtol=RTOL)
        assert_tree_close(grads, toy_ref(8)[1])
    assert count["recompute"] - count["store"] == ticks * (L // 4)


def _count(jaxpr, prim: str) -> int:
    """Equations named `prim` in a jaxpr and the jaxprs nested in it (each body once)."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == prim
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += _count(inner, prim)
    return n


def toy_layers_remat(lp, x):
    """toy_layers with each layer under jax.checkpoint (the backward recomputes its forward)."""

    def body(x, w):
        h = jnp.tanh(jnp.einsum("bsd,df->bsf", x, w["w1"]))
        x = x + jnp.einsum("bsf,fd->bsd", h, w["w2"])
        return x, jnp.sum(jnp.mean(x**2, axis=(1, 2)))

    x, sq = jax.lax.scan(jax.checkpoint(body), x, lp)
    return x, {"sq": jnp.sum(sq)}


@pytest.mark.parametrize("remat", [False, True])
def test_bw_split_b_is_the_chain_and_w_the_weight_matmuls(remat):
    """`bw_split` cuts the stage backward's jaxpr: B keeps the activation-cotangent chain (2 matmuls
    per toy layer: through w2 and w1; with remat also the recomputed forward's 2), W only the
    weight-gradient matmuls (2 per layer), where the unsplit backward has 4 (6). The stash is
    per-layer activation-sized values, never a weight; B's dx and W's grads equal the unsplit
    backward's."""
    from meshrun.pipeline import bw_split

    lp = toy_params()["layers"]
    x = jax.random.normal(jax.random.key(5), (2, S, D))
    (y, aux), vjp = jax.vjp(toy_layers_remat if remat else toy_layers, lp, x)
    leaves, tdef = jax.tree.flatten(vjp)
    cot = (jnp.ones_like(y), {"sq": jnp.asarray(0.1)})
    full = lambda lv, ct: jax.tree.leaves(jax.tree.unflatten(tdef, lv)(ct))
    cj = jax.make_jaxpr(full)(leaves, cot)
    n = len(cj.jaxpr.outvars) - 1
    bws = bw_split.split_jaxpr(cj.jaxpr, [False] * n + [True], [True] * n + [False])
    args = jax.tree.leaves((leaves, cot))
    b = lambda a: bw_split.run_b(cj.jaxpr, bws, cj.consts, a)
    w = lambda a, st: bw_split.run_w(cj.jaxpr, bws, cj.consts, a, st)[:n]
    dx_and_stash = b(args)
    dx, stash = dx_and_stash[0][-1], dx_and_stash[1]
    ref = full(leaves, cot)
    for got, want in zip([*w(args, stash), dx], ref, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL, atol=1e-6)
    assert _count(cj.jaxpr, "dot_general") == 4 + 2 * remat
    assert _count(jax.make_jaxpr(lambda a: b(a))(args).jaxpr, "dot_general") == 2 + 2 * remat
    assert _count(jax.make_jaxpr(w)(args, stash).jaxpr, "dot_general") == 2
    shapes = {a.shape for a in jax.tree.leaves(stash)}
    assert shapes <= {(L, 2, S, D), (L, 2, S, F)} and len(shapes) == 2, shapes


@pytest.mark.parametrize("uneven", [False, True])
def test_bw_split_w_adds_into_the_sums_layer_by_layer(uneven):
    """`run_w(..., acc=sums)` returns sums + the weight gradients (float32 sums, bf16 gradients), adding
    each layer's slice inside W's layer loop: the compiled W holds the sums and one layer's gradient,
    so its temp bytes are below the plain W + add by the stacked gradients less one layer's gradient
    and its float32 slice. Uneven: a stage of an uneven split (`split.uneven_apply`: L - 3 layers as
    one call, then the padding tail under a `cond`, 2 of its 3 entries run) whose gradients are the
    two loops' ys padded and summed; they are added in place too, each loop into its own rows."""
    from meshrun.pipeline import bw_split
    from meshrun.pipeline.split import uneven_apply

    lp = jax.tree.map(lambda a: a.astype(jnp.bfloat16), toy_params()["layers"])
    x = jax.random.normal(jax.random.key(5), (2, S, D), jnp.bfloat16)
    layers = functools.partial(uneven_apply, toy_layers, L - 3, jnp.int32(L - 1)) if uneven else toy_layers
    (y, aux), vjp = jax.vjp(layers, lp, x)
    leaves, tdef = jax.tree.flatten(vjp)
    cot = (jnp.ones_like(y), {"sq": jnp.asarray(0.1, aux["sq"].dtype)})
    full = lambda lv, ct: jax.tree.leaves(jax.tree.unflatten(tdef, lv)(ct))
    cj = jax.make_jaxpr(full)(leaves, cot)
    n = len(cj.jaxpr.outvars) - 1
    bws = bw_split.split_jaxpr(cj.jaxpr, [False] * n + [True], [True] * n + [False])
    args = jax.tree.leaves((leaves, cot))
    _, stash = bw_split.run_b(cj.jaxpr, bws, cj.consts, args)
    sums = [jax.random.normal(jax.random.key(k), a.shape, jnp.float32) for k, a in enumerate(jax.tree.leaves(lp))]

    def plain(a, st, g):
        return [s + d.astype(jnp.float32) for s, d in zip(g, bw_split.run_w(cj.jaxpr, bws, cj.consts, a, st)[:n])]

    def inplace(a, st, g):
        return bw_split.run_w(cj.jaxpr, bws, cj.consts, a, st, [*g, None])[:n]

    for got, want in zip(inplace(args, stash, sums), plain(args, stash, sums), strict=True):
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    if uneven:  # the padding entry's gradient is zero: its sums rows come back as they went in
        for got, s in zip(inplace(args, stash, sums), sums, strict=True):
            np.testing.assert_array_equal(np.asarray(got)[L - 1], np.asarray(s)[L - 1])
    parts, _ = bw_split._accumulable(cj.jaxpr, [*sums, None], bws.roles)
    assert sorted({k for k, _ in parts.values()}) == list(range(n))  # every weight gradient, in place
    temp = lambda f: live_temp_bytes(jax.jit(f, donate_argnums=2).lower(args, stash, sums))
    stacked = sum(a.size * 2 for a in jax.tree.leaves(lp))  # the stage's bf16 gradients, all layers
    if uneven:  # W runs the padding tail's cond again (B's and W's parts of a cond are not split),
        # so it also holds the tail's weights: only the order is asserted here
        assert temp(inplace) < temp(plain)
    else:  # in place, W still holds one layer's bf16 gradient and the float32 slice it is added to
        assert temp(plain) - temp(inplace) >= stacked - 3 * stacked // L
    # keep=False (an idle cell that computed on fill values): nothing is added, NaNs included
    nan_cot = (jnp.full_like(y, jnp.nan), cot[1])
    nan_args = jax.tree.leaves((leaves, nan_cot))
    _, nan_stash = bw_split.run_b(cj.jaxpr, bws, cj.consts, nan_args)
    for keep, a, st, want in ((False, nan_args, nan_stash, sums), (True, args, stash, inplace(args, stash, sums))):
        got = bw_split.run_w(cj.jaxpr, bws, cj.consts, a, st, [*sums, None], keep=jnp.asarray(keep))[:n]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def live_temp_bytes(lowered) -> int:
    """The most temp bytes live at once in the compiled program (`analysis.memory.live_temp_peak`, from
    XLA's dumps of this compile): unlike `memory_analysis().temp`, no heap-packing holes."""
    import glob
    import tempfile

    from meshrun.analysis.memory import live_temp_peak

    with tempfile.TemporaryDirectory() as d:
        lowered.compile(compiler_options={"xla_dump_to": d, "xla_dump_hlo_as_text": True})
        read = lambda kind: open(max(glob.glob(f"{d}/*after_optimizations-{kind}.txt"), key=len)).read()
        return live_temp_peak(read("buffer-assignment"), read("live-range"))["peak"]


def executed(text: str, mesh) -> list[tuple[hlo.Collective, int]]:
    """(collective, runs per step) for every collective in compiled HLO text."""
    return [(c, c.per_step) for c in hlo.collectives(text, dict(mesh.shape))]


def expected_sends(schedule: str, p: int, m: int, v: int = 1) -> tuple[int, int, int]:
    """Per step (forward, backward) activation transfers implied by the lockstep table: every tick
    moves one microbatch activation across each stage boundary forward (one gradient backward) when
    its run of same-kind ticks (forward-only / both / backward-only) feeds a consumer next tick; and
    how many of those ticks send both ways (with two stages that is one swap, one collective)."""
    lock = schedules.lockstep(registry.get(schedule).table(p, m, v, "lockstep"))
    kind = ["".join(k for k, ops in (("F", [c.fwd for c in r]), ("B", [c.bwd for c in r])) if any(ops)) for r in lock]
    need_f = [any(c.fwd and c.fwd.chunk * p + s > 0 for s, c in enumerate(r)) for r in lock[1:]] + [False]
    need_b = [any(c.bwd and c.bwd.chunk * p + s < v * p - 1 for s, c in enumerate(r)) for r in lock[1:]] + [False]
    runs, t0 = [], 0
    for t in range(1, len(lock) + 1):
        if t == len(lock) or kind[t] != kind[t0]:
            runs.append((t0, t))
            t0 = t
    f = sum(t1 - t0 for t0, t1 in runs if any(need_f[t0:t1]))
    b = sum(t1 - t0 for t0, t1 in runs if any(need_b[t0:t1]))
    both = sum(t1 - t0 for t0, t1 in runs if any(need_f[t0:t1]) and any(need_b[t0:t1]))
    return f, b, both


@pytest.mark.parametrize("dims", [(2, 2, 1, 2), (4, 1, 1, 2)])
def test_hlo_permute_bytes_and_single_dp_reduction(dims):
    p, dp = dims[0], dims[1] * dims[2]
    act = 1 * S * D * 4  # one microbatch activation (1 sequence per shard) b*s*h*4 bytes
    dp_ops = {}
    for m in (2 * p, 8 * p):
        pl, c, _ = toy_compiled(dims, "1f1b", m, 1, b=m * dp)
        ex = executed(c.as_text(), pl.mesh)
        perms = [(x, k) for x, k in ex if x.op == "collective-permute"]
        assert perms and all(x.axes == ("pipe",) and x.bytes == act * x.parts for x, k in perms)
        f, b, both = expected_sends("1f1b", p, m)
        if p > 2:  # warm-up p-1 + steady m ticks; the cool-down's p-1 ticks send gradients
            assert (f, b) == (m + p - 1, m + p - 1)
        # p = 2: stage 0 only sends activations and stage 1 only gradients, so a tick that sends both
        # ways is one swap of one activation per device; p > 2: two collectives per such tick.
        ops = f + b - (both if p == 2 else 0)
        got = sum(x.bytes * k for x, k in perms)
        print(f"1F1B p={p} m={m}: collective-permute {got} B/step, expected {ops}*{act}")
        assert got == ops * act and (sum(k for _, k in perms), ops) == pl.program.permute_counts()
        # Data-parallel gradient reduction: outside the loop, same count whatever m is.
        dp_colls = [x for x, _ in ex if "data" in x.axes and x.op in ("all-reduce", "reduce-scatter")]
        assert not [x for x in dp_colls if x.in_loop]
        # Inside the tick loop only what a tick needs: the stage's TP all-reduces and the sends.
        assert {(x.op, x.axes) for x, _ in ex if x.in_loop} <= {
            ("all-reduce", ("tensor",)),
            ("collective-permute", ("pipe",)),
        }
        dp_ops[m] = sorted((x.op, x.axes, x.bytes) for x in dp_colls)
    assert dp_ops[2 * p] == dp_ops[8 * p]


def test_stored_residuals_save_one_tensor_all_reduce_per_layer():
    """Keeping vjp residuals: 1 TP all-reduce per layer forward, 1 backward (toy MLP); recomputing
    the forward in the backward adds one per layer per backward tick. Weight-only residuals are
    rebuilt by a dead dummy forward that XLA removes (else it would add all-reduces too)."""
    dims, m = (2, 2, 1, 2), 4
    count = {}
    for res in ("store", "recompute"):
        pl, c, _ = toy_compiled(dims, "1f1b", m, 1, b=m * 2, **({} if res == "store" else {"residuals": res}))
        count[res] = sum(k for x, k in executed(c.as_text(), pl.mesh) if x.op == "all-reduce" and x.axes == ("tensor",))
    layers_per_stage = L // dims[0]
    backward_ticks = sum(t1 - t0 for kind, t0, t1, _, _ in pl.program.phases if "B" in kind)
    assert count["recompute"] - count["store"] == layers_per_stage * backward_ticks


def test_zero2_reduce_scatters_once():
    pl, c, _ = toy_compiled((2, 2, 1, 2), "1f1b", 4, 1, b=8, zero=2)
    colls = hlo.collectives(c.as_text(), dict(pl.mesh.shape))
    rs = [x for x in colls if x.op == "reduce-scatter" and "data" in x.axes]
    assert rs and not any(x.in_loop for x in rs)
    assert not any(x.in_loop and "data" in x.axes for x in colls)


# ---------------------------------------------------------------- bad input


def test_config_errors():
    mesh4 = mesh_of(4, 1, 1, 2)
    mesh2 = mesh_of(2, 2, 1, 2)
    mk = lambda mesh, prm=None, **pc: Pipeline(pipeline_spec(TOY, PipelineConfig(**pc), mesh, prm or toy_params()))
    with pytest.raises(ConfigError, match="m >= p") as e:
        mk(mesh4, schedule="1f1b", microbatches=2)
    assert e.value.field == "pipeline.microbatches"
    with pytest.raises(ConfigError, match="m % p") as e:
        mk(mesh4, schedule="interleaved", microbatches=6, virtual=2)
    assert e.value.field == "pipeline.microbatches"
    with pytest.raises(ConfigError) as e:
        mk(mesh2, schedule="1f1b", microbatches=4, virtual=2)
    assert e.value.field == "pipeline.virtual"
    tok, lab = batch(32, V)
    six = {**toy_params(), "layers": jax.tree.map(lambda a: a[:6], toy_params()["layers"])}
    with pytest.raises(ConfigError, match="stacked layers") as e:
        mk(mesh4, six, schedule="1f1b", microbatches=4)(six, tok, lab)
    assert e.value.field == "model.n_layers"
    with pytest.raises(ConfigError, match="stacked layers"):  # 8 layers, 2 stages x 8 chunks
        mk(mesh2, schedule="interleaved", microbatches=8, virtual=8)(toy_params(), tok, lab)
    with pytest.raises(ConfigError, match="global batch") as e:  # 12 rows, m=4 x data 2
        mk(mesh2, schedule="1f1b", microbatches=4)(toy_params(), tok[:12], lab[:12])
    assert e.value.field == "train.global_batch"


def test_tick_copies_are_one_microbatch_not_the_buffer():
    """GPipe keeps all m microbatches' residuals, so its buffer grows with m; what the compiled tick
    loop copies per tick must not: buffer updates are in place, the carried state is not copied, and
    what is left is one microbatch's residuals (the layer scan's fresh buffers and their move into
    the slot) plus the stage's weight-gradient buffers (as in any gradient accumulation)."""
    dims, dp = (2, 2, 1, 2), 2
    seen = {}
    for m in (4, 16):
        pl, c, _ = toy_compiled(dims, "gpipe", m, 1, b=m * dp)
        seen[m] = (hlo.op_bytes_per_step(c.as_text(), loops_only=True), pl.program.ticks)
    per_tick = (seen[16][0] - seen[4][0]) / (seen[16][1] - seen[4][1])
    lp = jax.tree.map(lambda a: a[: L // dims[0]], toy_params()["layers"])
    mask, avals = activation_residuals(toy_layers, lp, jnp.zeros((1, S, D)))
    residuals = sum(a.size * 4 for a, d in zip(avals, mask, strict=True) if d)  # one microbatch, one stage
    weights = sum(a.size * 4 for a in jax.tree.leaves(lp)) // dims[3]  # the stage's tensor shard
    act = 1 * S * D * 4
    buffer = (pl.program.slots + 1) * residuals
    print(f"GPipe: {per_tick:.0f} B copied per tick; residuals {residuals} B, weights {weights} B, buffer {buffer} B")
    assert per_tick <= 2 * (residuals + act) + 2 * weights
    assert per_tick < buffer / 4


# ---------------------------------------------------------------- uneven stages

# (mesh pipe, data, expert, tensor), schedule, m, v, layers, layers per virtual stage (model order)
UNEVEN_CASES = {
    "p2-5-layers-1f1b": ((2, 2, 1, 2), "1f1b", 4, 1, 5, (3, 2)),
    "p4-7-layers-1f1b": ((4, 1, 1, 2), "1f1b", 8, 1, 7, (1, 2, 2, 2)),
    "p2v2-7-layers-interleaved": ((2, 2, 1, 2), "interleaved", 4, 2, 7, (2, 2, 1, 2)),
    "p2-5-layers-zb-h1": ((2, 2, 1, 2), "zb-h1", 4, 1, 5, (3, 2)),  # the padding's cond: B, and W again
    # ZB-V: counts per virtual stage in model order; stage 0 holds virtual stages 0 and 3
    "p2-5-layers-zb-v": ((2, 2, 1, 2), "zb-v", 4, 2, 5, (2, 1, 1, 1)),
}


@functools.cache
def uneven_compiled(case):
    dims, schedule, m, v, n, counts = UNEVEN_CASES[case]
    pc = PipelineConfig(schedule=schedule, microbatches=m, virtual=v, layers_per_stage=counts)
    prm = {**toy_params(), "layers": jax.tree.map(lambda a: a[:n], toy_params()["layers"])}
    pl = Pipeline(pipeline_spec(TOY, pc, mesh_of(*dims), prm))
    args = (prm, *batch(8, V))
    return pl, pl.lower(*args).compile(), args


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if "zb-v" in c else c for c in UNEVEN_CASES])
def test_uneven_parity(case):
    """Stages holding different layer counts run one SPMD program (chunks padded to the largest,
    padding skipped); loss and grads (model order) equal one device's."""
    dims, _, _, v, _, counts = UNEVEN_CASES[case]
    pl, compiled, (prm, tok, lab) = uneven_compiled(case)
    (ref_loss, ref_aux), ref_grads = jax.jit(jax.value_and_grad(toy_loss, has_aux=True))(prm, tok, lab)
    loss, grads, aux = compiled(prm, tok, lab)
    assert pl.split.counts == counts and pl.split.padded == dims[0] * v * max(counts)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=RTOL)
    np.testing.assert_allclose(float(aux["sq"]), float(ref_aux["sq"]), rtol=RTOL)
    assert_tree_close(grads, ref_grads)


def test_uneven_stage_runs_lmax_layers_and_no_dummy_forward():
    """A tick runs lmax units (the padding one under a `lax.cond`): per step, the 5-layer split
    (3, 2) has exactly one TP all-reduce per F and per B tick fewer than 8 layers as (4, 4) on the
    same schedule, so the vjp rebuilt in the backward leaves no dead forward behind (toy MLP: one
    all-reduce per layer forward, one backward)."""
    pl, c, _ = uneven_compiled("p2-5-layers-1f1b")
    pe, ce, _ = toy_compiled((2, 2, 1, 2), "1f1b", 4, 1, b=8)
    tp = lambda pl, c: sum(
        k for x, k in executed(c.as_text(), pl.mesh) if x.op == "all-reduce" and x.axes == ("tensor",)
    )
    ticks = sum((t1 - t0) * len(kind) for kind, t0, t1, _, _ in pl.program.phases)  # F ticks + B ticks
    assert pl.program.phases == pe.program.phases
    assert tp(pe, ce) - tp(pl, c) == (L // 2 - pl.split.lmax) * ticks


def test_split_layouts_round_trip_across_splits():
    """Checkpoints hold model order: any split's padded layout maps back to it exactly, padding is
    zeros, and a state saved under one split restores into another."""
    from meshrun.pipeline.split import LayerSplit

    x = {"w": jnp.arange(7 * 3, dtype=jnp.float32).reshape(7, 3)}
    splits = [LayerSplit((1, 2, 2, 2), 4, 1), LayerSplit((2, 2, 1, 2), 2, 2), LayerSplit((4, 3), 2, 1)]
    for a in splits:
        pa = a.to_pipeline(x)["w"]
        assert pa.shape == (a.padded, 3)
        idx = a.pipeline_index()
        np.testing.assert_array_equal(np.asarray(pa)[idx < 0], 0)
        np.testing.assert_array_equal(np.asarray(pa)[idx >= 0], np.asarray(x["w"])[idx[idx >= 0]])
        for b in splits:
            back = b.from_pipeline(b.to_pipeline(a.from_pipeline(a.to_pipeline(x))))
            np.testing.assert_array_equal(back["w"], x["w"])
    # stage 0 of (2, 2, 1, 2) on p=2, v=2 holds virtual stages 0 and 2: layers 0-1, then 4 + padding
    assert LayerSplit((2, 2, 1, 2), 2, 2).pipeline_index().tolist() == [0, 1, 4, -1, 2, 3, 5, 6]
    # an even V (a reshape and a flip, no gather): the same as its index
    y = jnp.arange(16 * 3, dtype=jnp.float32).reshape(16, 3)
    for lc in (1, 2):
        v = LayerSplit((lc,) * 8, 4, 2, "v")
        got = v.to_pipeline(y[: 8 * lc])
        np.testing.assert_array_equal(got, np.asarray(y[: 8 * lc])[v.pipeline_index()])
        np.testing.assert_array_equal(v.from_pipeline(got), y[: 8 * lc])


def test_bad_splits_name_the_fix():
    from meshrun.pipeline.split import layer_split
    from meshrun.train.plan import unit_costs

    pc = lambda **k: PipelineConfig(microbatches=4, **k)
    with pytest.raises(ConfigError, match=r"sum 6 != 7.*e\.g\. \[2, 2, 2, 1\]"):
        layer_split(pc(layers_per_stage=(3, 1, 1, 1)), 7, 4)
    with pytest.raises(ConfigError, match="one count per stage: 4 numbers"):
        layer_split(pc(layers_per_stage=(3, 4)), 7, 4)
    with pytest.raises(ConfigError, match="empty stage"):
        pc(layers_per_stage=(7, 0))
    with pytest.raises(ConfigError, match="balance=auto"):
        layer_split(pc(), 7, 4)
    with pytest.raises(ConfigError, match="leave a stage empty"):
        layer_split(pc(balance="auto"), 3, 4, unit_costs(DENSE))
    assert layer_split(pc(balance="auto"), 7, 4, unit_costs(DENSE)).n == 7


def test_balance_auto_gives_the_ends_fewer_layers():
    """Llama-3.1-405B shape (126 layers, 16 stages, vocab 128256): the last stage carries the head and
    gets fewer layers; the slowest stage is no slower than any other split's."""
    from meshrun.planner.balance import split_layers, stage_cost, stage_costs

    big = LlamaConfig(vocab=128256, d_model=16384, n_layers=126, n_heads=128, n_kv_heads=8, head_dim=128,
                      d_ff=53248, max_seq_len=8192)  # fmt: skip
    c = dict(zip(("layer_cost", "first_cost", "last_cost"), stage_costs(big, 8192), strict=True))
    counts = split_layers(126, 16, **c)
    assert sum(counts) == 126 and min(counts) >= 1 and counts[-1] < max(counts)
    cost = lambda cs: max(stage_cost(cs, **c))
    assert cost(counts) <= cost((8,) * 14 + (7, 7)) and cost(counts) <= cost((7, 7) + (8,) * 14)
    assert split_layers(8, 4, layer_cost=1.0) == (2, 2, 2, 2)
    assert split_layers(7, 4, layer_cost=1.0, last_cost=1.5) == (2, 2, 2, 1)


@pytest.mark.slow
def test_zb_v_slots_bubble_and_temp_against_per_op_1f1b():
    """ZB-V (two chunks per stage in a V, the backward split into B and W): at most p microbatches'
    worth in flight on any stage (2p chunks of half a stage's layers), its bubble from the table it
    plays ((p - 1)/(6m + p - 1) with F = B = W per chunk), and compiled temp bytes flat in m and no
    more than per-op 1F1B's at the same p and m, in the layers' pipeline placement (as training runs
    it). B's stash goes over the residual leaves only B reads, in their slots (they live from F to W),
    so 2p - 1 half-stage stashes cost no buffer of their own. `memory_analysis().temp` is compared at
    4 sequences per microbatch; at 1 its extent is mostly heap-packing holes of the per-tick scalars
    (ZB-V compiles more ticks), so there the most temp bytes live at once are compared."""
    dims, p, m = (4, 1, 1, 2), 4, 8
    prog = toy_compiled(dims, "zb-v", m, 1, b=m)[0].program
    assert prog.v == 2 and max(prog.stage_slots()) <= 2 * p and prog.stash_slots == 2 * p - 1
    assert prog.bubble == pytest.approx((p - 1) / (6 * m + p - 1))
    assert prog.head_slots == 1  # the head's dy waits from F to B on the last virtual stage only

    def compiled(schedule, m, seqs, **kw):
        pc = PipelineConfig(schedule=schedule, microbatches=m, **kw)
        params = {**toy_params(), "layers": layer_split(pc, L, p).to_pipeline(toy_params()["layers"])}
        pl = Pipeline(pipeline_spec(TOY, pc, mesh_of(*dims), params, placement="pipeline"))
        return pl.lower(params, *batch(m * seqs, V))

    temp = lambda *a, **kw: compiled(*a, **kw).compile().memory_analysis().temp_size_in_bytes
    t_v, t_1f1b, t_large = temp("zb-v", m, 4), temp("1f1b", m, 4, **PER_OP), temp("zb-v", 4 * m, 4)
    live_v, live_1f1b = live_temp_bytes(compiled("zb-v", m, 1)), live_temp_bytes(compiled("1f1b", m, 1, **PER_OP))
    print(f"p={p} m={m}, 4 sequences per microbatch: temp ZB-V {t_v} B ({t_large} B at m={4 * m}), per-op 1F1B "
          f"{t_1f1b} B; 1 sequence, live peak: ZB-V {live_v} B, per-op 1F1B {live_1f1b} B")  # fmt: skip
    assert t_v <= t_1f1b and live_v <= live_1f1b
    assert t_large <= 1.15 * t_v


@pytest.mark.parametrize("schedule,v", [("zb-v", 1), pytest.param("interleaved", 2, marks=pytest.mark.slow)])
def test_forward_sums_match_one_device(schedule, v):
    """The forward-only pipeline (evaluation) over chunks in a V (round 1 runs from the last stage
    down to stage 0, which runs the head) and in Megatron's loop: one device's loss sum and tokens."""
    from meshrun.pipeline.forward import forward_sums

    pl = toy_compiled((2, 2, 1, 2), schedule, 4, v, b=8)[0]
    tok, lab = batch(8, V)
    got, n = jax.jit(lambda prm, t, y: forward_sums(pl, prm, t, y))(toy_params(), tok, lab)
    ref, ref_n = toy_head(toy_params(), toy_layers(toy_params()["layers"], toy_embed(toy_params(), tok))[0], lab)
    np.testing.assert_allclose(float(got), float(ref), rtol=RTOL)
    assert float(n) == float(ref_n)


@pytest.mark.slow
def test_overlap_grad_reduce_runs_beside_the_last_ticks():
    """pipeline.overlap_grad_reduce (zb-v p = 4, m = 8, ZeRO-1, data 2): the up-leg chunk's gradients are
    final at tick 48 of 51; its reduce-scatters (w1, w2; one layer per chunk here, so one tick reduces
    it) run in tick 48, where neither that tick's op conditionals (F, B, W) nor the later ticks feed
    them or read them; the other chunk's and the embedding/head's follow every tick, as all do
    without it. Each runs once per step: the same bytes over 'data'. Temp bytes: at most one layer's
    sums more."""
    dims, out = (4, 2, 1, 1), {}
    for on in (False, True):
        pl, c, _ = toy_compiled(dims, "zb-v", 8, 2, b=16, zero=1, overlap_grad_reduce=on)
        text = c.as_text()
        rs = [x for x in hlo.collectives(text, dict(pl.mesh.shape)) if x.op == "reduce-scatter"]
        out[on] = (hlo.overlappable(text), sum(x.bytes * x.per_step for x in rs), pl.program.grad_cuts,
                   c.memory_analysis().temp_size_in_bytes, len(rs))  # fmt: skip
    assert out[False][0] and not any(out[False][0]), out
    assert out[True][2] == ((48, (1,)),)
    free = sorted(out[True][0])
    assert free[:4] == [0] * 4 and min(free[4:]) >= 3 and len(free) == 6, out
    assert out[True][1] == out[False][1] and out[True][4] == out[False][4] + 2, out
    assert out[True][3] - out[False][3] <= 2 * 16 * 16 * 4, out


def test_overlap_grad_reduce_refusals():
    with pytest.raises(ConfigError, match="pipeline.overlap_grad_reduce: .*nothing to overlap"):
        toy_compiled((2, 2, 1, 2), "1f1b", 4, 1, b=8, overlap_grad_reduce=True)
    with pytest.raises(ConfigError, match="pipeline.overlap_grad_reduce"):
        PipelineConfig(overlap_grad_reduce="yes")
