"""Dense transformer: mesh parity vs one device, golden PartitionSpecs, compiled-HLO collectives, validation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from meshrun_models import (
    Transformer,
    abstract_params,
    apply_layers,
    embed,
    head_loss,
    init_params,
    loss_fn,
    total_loss,
    validate_model_for_mesh,
)
from meshrun_models.llama.config import LlamaConfig

from meshrun.analysis.hlo import collectives
from meshrun.config import MeshConfig, ModelConfig
from meshrun.errors import ConfigError
from meshrun.parallel.sharding import compute_rules, param_rules, tree_shardings, tree_specs, use_rules
from meshrun.runtime.mesh import build_mesh

# heads/kv_heads/vocab/d_ff divisible by 8 so that every tensor degree up to 8 really shards; GQA (G=2).
DENSE = LlamaConfig(vocab=64, d_model=32, n_layers=2, n_heads=16, n_kv_heads=8, head_dim=4, d_ff=64, max_seq_len=16)
B, L = 8, 16
RTOL, ATOL = 1e-5, 1e-6


def batch(cfg: ModelConfig, b: int = B, seed: int = 1):
    tok = jax.random.randint(jax.random.key(seed), (b, L), 0, cfg.vocab)
    return tok, jnp.roll(tok, -1, axis=1)


def loss_and_grads(cfg, params, tok, lab, mesh=None, zero=0):
    fn = jax.value_and_grad(lambda p: loss_fn(p, tok, lab, cfg), has_aux=True)
    if mesh is None:
        return jax.jit(fn)(params)
    placed = jax.device_put(params, tree_shardings(params, mesh, param_rules(zero)))
    with use_rules(mesh, compute_rules(cfg.sequence_parallel)):
        return jax.jit(fn)(placed)


def assert_same(ref, got):
    (l0, aux0), g0 = ref
    (l1, aux1), g1 = got
    np.testing.assert_allclose(l1, l0, rtol=RTOL, atol=ATOL)
    for k in aux0:
        np.testing.assert_allclose(aux1[k], aux0[k], rtol=RTOL, atol=ATOL, err_msg=k)
    flat0, tree0 = jax.tree_util.tree_flatten_with_path(g0)
    flat1, tree1 = jax.tree_util.tree_flatten_with_path(g1)
    assert tree0 == tree1
    for (path, a), (_, b) in zip(flat0, flat1, strict=True):
        np.testing.assert_allclose(
            np.asarray(b), np.asarray(a), rtol=RTOL, atol=ATOL, err_msg=jax.tree_util.keystr(path)
        )


def mesh_of(data, tensor, expert):
    return build_mesh(MeshConfig(data=data, tensor=tensor, expert=expert, pipe=1))


@pytest.fixture(scope="module")
def dense():
    _, params = init_params(DENSE, 0)
    tok, lab = batch(DENSE)
    return params, tok, lab, loss_and_grads(DENSE, params, tok, lab)


def test_param_tree_and_stacking(dense):
    params = dense[0]
    assert set(params.keys()) == {"embed", "layers", "final_norm", "head"}
    for path, var in jax.tree_util.tree_flatten_with_path(
        params["layers"], is_leaf=lambda v: hasattr(v, "out_sharding")
    )[0]:
        assert var.shape[0] == DENSE.n_layers, path
        assert var.out_sharding[0] == "layers" and len(var.out_sharding) == var.ndim, path
    tied = init_params(dataclasses.replace(DENSE, tie_embeddings=True), 0)[1]
    assert "head" not in tied


def test_reference_loss_is_sane(dense):
    (loss, aux), grads = dense[3]
    # Small init: the model is near uniform over the vocabulary, loss ~ log V.
    assert abs(float(loss) - np.log(DENSE.vocab)) < 0.05
    assert float(aux["n_tokens"]) == B * L
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("shape", [(8, 1, 1), (4, 2, 1), (2, 4, 1), (1, 8, 1), (2, 2, 2)])
def test_dense_parity(dense, shape):
    params, tok, lab, ref = dense
    assert_same(ref, loss_and_grads(DENSE, params, tok, lab, mesh_of(*shape)))


@pytest.mark.parametrize(
    "shape,changes",
    [
        ((2, 4, 1), {"sequence_parallel": True}),
        ((1, 8, 1), {"sequence_parallel": True, "remat": "selective"}),
        ((4, 2, 1), {"remat": "full"}),
    ],
)
def test_dense_parity_sp_and_remat(dense, shape, changes):
    params, tok, lab, ref = dense
    assert_same(ref, loss_and_grads(dataclasses.replace(DENSE, **changes), params, tok, lab, mesh_of(*shape)))


def test_gpt_style_tied_parity():
    cfg = dataclasses.replace(DENSE, mlp="gelu", tie_embeddings=True)
    _, params = init_params(cfg, 3)
    assert set(params["layers"]["mlp"].keys()) == {"up", "down"}
    tok, lab = batch(cfg)
    assert_same(loss_and_grads(cfg, params, tok, lab), loss_and_grads(cfg, params, tok, lab, mesh_of(2, 4, 1)))


@pytest.mark.parametrize("changes", [{}, {"sequence_parallel": True, "tp_comm_overlap": True}])
def test_qk_norm_parity(changes):
    """model.qk_norm (Qwen3): a head_dim scale for q and one for k, replicated while the heads split
    over 'tensor'; random scales, so a scale applied to the wrong heads would show."""
    cfg = dataclasses.replace(DENSE, qk_norm=True, **changes)
    _, params = init_params(cfg, 3)
    attn = params["layers"]["attn"]
    assert attn["q_norm"].shape == attn["k_norm"].shape == (DENSE.n_layers, DENSE.head_dim)
    from meshrun_models.layers import arrays

    from meshrun.analysis.flops import param_counts

    assert param_counts(cfg)["total"] == sum(x.size for x in jax.tree.leaves(arrays(params)))
    for name, seed in (("q_norm", 1), ("k_norm", 2)):
        attn[name][...] = 1.0 + 0.3 * jax.random.normal(jax.random.key(seed), attn[name].shape)
    tok, lab = batch(cfg)
    assert_same(loss_and_grads(cfg, params, tok, lab), loss_and_grads(cfg, params, tok, lab, mesh_of(2, 4, 1), zero=3))


@pytest.mark.parametrize("moe", [False, True])
def test_functional_pieces_compose(dense, moe):
    """embed -> apply_layers on two slices -> head_loss, sums (loss, tokens AND aux) added over two
    microbatches -> total_loss == loss_fn on the whole batch. With MoE the aux sums are non-zero, so
    an aux term dropped from any slice or microbatch changes the loss."""
    cfg = dataclasses.replace(DENSE, n_experts=4, top_k=2, moe_every=1, aux_loss_coef=0.5) if moe else DENSE
    params = init_params(cfg, 0)[1] if moe else dense[0]
    tok, lab = batch(cfg)
    loss = loss_fn(params, tok, lab, cfg)[0] if moe else dense[3][0][0]

    def piecewise(p):
        sums, ntok, aux = 0.0, 0.0, None
        for mb in range(2):
            t, y = tok[mb * 4 : (mb + 1) * 4], lab[mb * 4 : (mb + 1) * 4]
            x = embed(p, t, cfg)
            x, a1 = apply_layers(jax.tree.map(lambda w: w[:1], p["layers"]), x, cfg)
            x, a2 = apply_layers(jax.tree.map(lambda w: w[1:], p["layers"]), x, cfg)
            s, n = head_loss(p, x, y, cfg)
            sums, ntok = sums + s, ntok + n
            both = jax.tree.map(lambda u, v: u + v, a1, a2)
            aux = both if aux is None else jax.tree.map(lambda u, v: u + v, aux, both)
        if moe:
            assert float(aux["moe_aux_loss"]) > 0
        return total_loss(sums, ntok, aux, B, cfg)

    np.testing.assert_allclose(piecewise(params), loss, rtol=RTOL, atol=ATOL)
    if moe:
        return
    # ignored labels (< 0) drop out of both the sum and the count
    s, n = jax.jit(
        lambda p: head_loss(p, apply_layers(p["layers"], embed(p, tok, DENSE), DENSE)[0], lab.at[:, -4:].set(-1), DENSE)
    )(params)
    assert float(n) == B * (L - 4) and float(s) > 0


def test_nnx_module_logits_match_functional(dense):
    params = dense[0]
    model = Transformer(DENSE, rngs=__import__("flax").nnx.Rngs(0))
    tok, lab = batch(DENSE)
    logits = model(tok)
    assert logits.shape == (B, L, DENSE.vocab)
    s, n = head_loss(params, apply_layers(params["layers"], embed(params, tok, DENSE), DENSE)[0], lab, DENSE)
    lse = jax.nn.logsumexp(logits, -1)
    ce = lse - jnp.take_along_axis(logits, lab[..., None], -1)[..., 0]
    np.testing.assert_allclose(jnp.sum(ce), s, rtol=RTOL)


def test_remat_policies_cut_activation_memory():
    """Compiled temp bytes of loss+grads on one device: none > selective (attention core recomputed) > full."""
    cfg = dataclasses.replace(DENSE, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=64)
    _, params = init_params(cfg, 0)
    tok = jax.random.randint(jax.random.key(1), (4, 64), 0, cfg.vocab)
    temp = {}
    for policy in ("none", "selective", "full"):
        c = dataclasses.replace(cfg, remat=policy)
        step = jax.jit(jax.value_and_grad(lambda p, c=c: loss_fn(p, tok, tok, c)[0]))
        temp[policy] = step.lower(params).compile().memory_analysis().temp_size_in_bytes
    assert temp["none"] > 1.5 * temp["selective"] > 1.5 * temp["full"], temp


def test_bfloat16_compute_and_cudnn_config_run_on_cpu(dense):
    """bf16 activations with f32 params (and attention_impl=cudnn, which falls back off-GPU) give a loss
    within bf16 rounding of the f32 one; params and grads stay f32."""
    params, tok, lab, ((ref, _), _) = dense
    cfg = dataclasses.replace(DENSE, dtype="bfloat16", attention_impl="cudnn")
    (loss, _), grads = jax.jit(jax.value_and_grad(lambda p: loss_fn(p, tok, lab, cfg), has_aux=True))(params)
    assert loss.dtype == jnp.float32 and abs(float(loss) - float(ref)) < 2e-2  # bf16 has 8 mantissa bits
    assert float(loss) != float(ref)  # the compute dtype really changed
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype("float32")}


def test_attention_matches_numpy_gqa_rope():
    """The fused-qkv GQA attention equals a float64 numpy version: RoPE (rotate-half), query head n
    uses kv head n // G, causal softmax, output projection."""
    from meshrun_models.attention import attention
    from meshrun_models.layers import arrays

    cfg = dataclasses.replace(DENSE, n_heads=4, n_kv_heads=2, head_dim=8, init_std=0.3)
    _, params = init_params(cfg, 2)
    p = jax.tree.map(lambda w: w[0], arrays(params["layers"]["attn"]))
    h = jax.random.normal(jax.random.key(3), (2, L, cfg.d_model))
    got = jax.jit(lambda p, h: attention(p, h, cfg))(p, h)

    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    hn = np.asarray(h, np.float64)
    half = cfg.head_dim // 2
    ang = np.arange(L)[:, None] * cfg.rope_theta ** (-np.arange(half) / half)
    cos, sin = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]

    def rot(x):
        return np.concatenate(
            [x[..., :half] * cos - x[..., half:] * sin, x[..., half:] * cos + x[..., :half] * sin], -1
        )

    q = rot(np.einsum("bld,dhk->blhk", hn, p["q"]))
    k = rot(np.einsum("bld,dhk->blhk", hn, p["k"]))
    v = np.einsum("bld,dhk->blhk", hn, p["v"])
    g = cfg.n_heads // cfg.n_kv_heads
    out = np.zeros_like(q)
    for n in range(cfg.n_heads):
        s = np.einsum("bqk,bsk->bqs", q[:, :, n], k[:, :, n // g]) / np.sqrt(cfg.head_dim)
        s = np.where(np.tril(np.ones((L, L), bool)), s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        out[:, :, n] = np.einsum("bqs,bsk->bqk", w / w.sum(-1, keepdims=True), v[:, :, n // g])
    ref = np.einsum("blhk,hkd->bld", out, p["o"])
    # float32 vs a float64 reference: absolute slack of 1e-6 of the output's scale (max |ref| ~ 6)
    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL * np.abs(ref).max())


# ---------------------------------------------------------------- golden PartitionSpecs

MOE_CFG = LlamaConfig(
    vocab=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, n_experts=4, top_k=2, moe_every=2
)
T, DE = "tensor", ("data", "expert")
GOLDEN_ZERO0 = {
    "embed/embedding": P(T),
    "final_norm/scale": P(),
    "head/kernel": P(None, T),
    "layers/dense/attn/q": P(None, None, None, T),
    "layers/dense/attn/k": P(None, None, None, T),
    "layers/dense/attn/v": P(None, None, None, T),
    "layers/dense/attn/o": P(None, None, T),
    "layers/dense/attn_norm/scale": P(),
    "layers/dense/mlp/gate": P(None, None, None, T),
    "layers/dense/mlp/up": P(None, None, None, T),
    "layers/dense/mlp/down": P(None, None, T),
    "layers/dense/mlp_norm/scale": P(),
    "layers/moe/attn/q": P(None, None, T),
    "layers/moe/attn/k": P(None, None, T),
    "layers/moe/attn/v": P(None, None, T),
    "layers/moe/attn/o": P(None, T),
    "layers/moe/attn_norm/scale": P(),
    "layers/moe/mlp_norm/scale": P(),
    "layers/moe/moe/router": P(),
    "layers/moe/moe/gate": P(None, "expert", None, T),
    "layers/moe/moe/up": P(None, "expert", None, T),
    "layers/moe/moe/down": P(None, "expert", T),
}
GOLDEN_ZERO3 = {
    "embed/embedding": P(T, DE),
    "final_norm/scale": P(),
    "head/kernel": P(DE, T),
    "layers/dense/attn/q": P(None, None, DE, T),
    "layers/dense/attn/k": P(None, None, DE, T),
    "layers/dense/attn/v": P(None, None, DE, T),
    "layers/dense/attn/o": P(None, None, T, None, DE),
    "layers/dense/attn_norm/scale": P(),
    "layers/dense/mlp/gate": P(None, None, DE, T),
    "layers/dense/mlp/up": P(None, None, DE, T),
    "layers/dense/mlp/down": P(None, None, T, DE),
    "layers/dense/mlp_norm/scale": P(),
    "layers/moe/attn/q": P(None, DE, T),
    "layers/moe/attn/k": P(None, DE, T),
    "layers/moe/attn/v": P(None, DE, T),
    "layers/moe/attn/o": P(None, T, None, DE),
    "layers/moe/attn_norm/scale": P(),
    "layers/moe/mlp_norm/scale": P(),
    "layers/moe/moe/router": P(None, DE),
    # 'expert' is taken by the expert dimension, so ZeRO-3 shards these 'embed' dims over 'data' only
    "layers/moe/moe/gate": P(None, "expert", "data", T),
    "layers/moe/moe/up": P(None, "expert", "data", T),
    "layers/moe/moe/down": P(None, "expert", T, "data"),
}


@pytest.mark.parametrize("zero,golden", [(0, GOLDEN_ZERO0), (3, GOLDEN_ZERO3)])
def test_golden_partition_specs(zero, golden):
    specs = tree_specs(abstract_params(MOE_CFG), param_rules(zero), mesh_of(2, 2, 2))
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda s: isinstance(s, P))[0]
    got = {"/".join(str(k.key) for k in path): spec for path, spec in flat}
    assert got == golden


# ---------------------------------------------------------------- compiled-HLO collectives


def _hlo_collectives(cfg, grad: bool):
    """Collectives of loss (or loss+grads) of a 2-layer dense model on (data=1, tensor=8)."""
    mesh = mesh_of(1, 8, 1)
    _, params = init_params(cfg, 0)
    tok, lab = batch(cfg, b=2)
    placed = jax.device_put(params, tree_shardings(params, mesh, param_rules(0)))
    fn = lambda p: loss_fn(p, tok, lab, cfg)[0]
    fn = jax.value_and_grad(fn) if grad else fn  # as a train step does: loss and grads
    with use_rules(mesh, compute_rules(cfg.sequence_parallel)):
        text = jax.jit(fn).lower(placed).compile().as_text()
    colls = collectives(text, dict(mesh.shape))
    assert all(c.axes == ("tensor",) for c in colls), colls
    return sorted((c.op, c.bytes, c.parts) for c in colls if c.in_loop), sorted(
        (c.op, c.bytes, c.parts) for c in colls if not c.in_loop
    )


BSD = 2 * L * 32 * 4  # one b·s·h activation, f32
BS = 2 * L * 4  # one b·s scalar field (loss-side reductions)
AR, AG = "all-reduce", "all-gather"


def test_hlo_tensor_parallel_dense_block():
    """Megatron TP: per layer 2 all-reduces of b·s·h forward (attn out, mlp down) and 2 backward
    (the fused q/k/v and gate/up input gradients). Outside the layer loop: 1 for the vocab-parallel
    embedding, max + (sum-exp, label logit) over b·s for the loss, 1 b·s·h for the head's dx."""
    cfg = dataclasses.replace(DENSE, n_heads=8, n_kv_heads=8)
    fwd_loop, fwd_rest = _hlo_collectives(cfg, grad=False)
    assert fwd_loop == [(AR, BSD, 1)] * 2
    assert fwd_rest == sorted([(AR, BSD, 1), (AR, BS, 1), (AR, 2 * BS, 2)])
    bwd_loop, bwd_rest = _hlo_collectives(cfg, grad=True)
    assert bwd_loop == [(AR, BSD, 1)] * 4  # forward loop 2 + backward loop 2
    assert bwd_rest == sorted([(AR, BSD, 1), (AR, BS, 1), (AR, 2 * BS, 2), (AR, BSD, 1)])


def test_hlo_sequence_parallel_dense_block():
    """Korthikanti et al. 2022: per layer 2 all-gathers + 2 reduce-scatters forward and the same
    backward. XLA:CPU keeps each reduce-scatter as all-reduce + dynamic-slice (GPU's
    ReduceScatterCreator fuses them), so they show as all-reduces of b·s·h. Backward also all-reduces
    the two norm-scale gradients (partial over the length shards) once per layer."""
    cfg = dataclasses.replace(DENSE, n_heads=8, n_kv_heads=8, sequence_parallel=True)
    fwd_loop, fwd_rest = _hlo_collectives(cfg, grad=False)
    assert fwd_loop == sorted([(AG, BSD, 1)] * 2 + [(AR, BSD, 1)] * 2)
    # embedding (reduce-scatter), final all-gather before the head, loss reductions
    assert fwd_rest == sorted([(AR, BSD, 1), (AG, BSD, 1), (AR, BS, 1), (AR, 2 * BS, 2)])
    bwd_loop, bwd_rest = _hlo_collectives(cfg, grad=True)
    assert bwd_loop == sorted([(AG, BSD, 1)] * 4 + [(AR, BSD, 1)] * 4 + [(AR, 2 * 32 * 4, 2)])
    extra_bwd = [(AR, BSD, 1), (AR, 32 * 4, 1), (AG, BSD, 1)]  # head dx, final-norm grad, embedding dx gather
    assert bwd_rest == sorted([(AR, BSD, 1), (AG, BSD, 1), (AR, BS, 1), (AR, 2 * BS, 2)] + extra_bwd)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "changes,mesh_shape,field",
    [
        ({"n_heads": 6, "n_kv_heads": 2}, {"tensor": 4}, "model.n_heads"),
        ({"n_heads": 8, "n_kv_heads": 2}, {"tensor": 4}, "model.n_kv_heads"),
        ({"vocab": 255}, {"tensor": 2}, "model.vocab"),
        ({"d_ff": 101}, {"tensor": 2}, "model.d_ff"),
        ({"n_experts": 6, "top_k": 2}, {"expert": 4}, "model.n_experts"),
    ],
)
def test_validate_rejects(changes, mesh_shape, field):
    cfg = dataclasses.replace(LlamaConfig(), **changes)
    with pytest.raises(ConfigError) as e:
        validate_model_for_mesh(cfg, {"data": 1, "tensor": 1, "expert": 1, **mesh_shape})
    assert e.value.field == field
    if field == "model.vocab":
        assert "pad" in str(e.value) and "256" in str(e.value)


def test_validate_top_k_and_accepts_good():
    with pytest.raises(ConfigError, match="top_k"):
        LlamaConfig(n_experts=2, top_k=3)
    validate_model_for_mesh(DENSE, {"data": 1, "tensor": 8, "expert": 1, "pipe": 1})
    validate_model_for_mesh(MOE_CFG, {"data": 2, "tensor": 2, "expert": 2, "pipe": 1})
