"""Qwen3-MoE / DeepSeek-V3 MoE shapes: fine-grained and shared experts, first dense layers, sigmoid
scores with top-k renormalisation and a routed scaling, bias balancing, group-limited routing.

The layer against a float64 numpy loop; the bias update; every layout against one device after 3
steps (the balance biases included: the loads are summed over every axis that splits the tokens);
bad input exits 2 with one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from meshrun_models import init_params, loss_fn, moe_ffn
from meshrun_models.layers import arrays, rope_freqs
from meshrun_models.llama.config import LlamaConfig
from meshrun_models.moe import update_balance
from meshrun_models.router import top_k_gates
from test_models import ATOL, RTOL, batch
from test_train import ONE_DEVICE, _cfg, assert_resume_gives_the_same_losses, assert_same, run_state, run_steps

from meshrun.errors import ConfigError

CONFIG = "tiny_deepseek_cpu.yaml"
DS = LlamaConfig(
    vocab=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, max_seq_len=16,
    n_experts=8, top_k=2, moe_d_ff=16, n_shared_experts=1, first_dense_layers=1, moe_dispatch="dropless",
    router_score="sigmoid", routed_scaling=2.5, balance="bias", route_groups=4, route_group_limit=2,
)  # fmt: skip


def numpy_router(logits, bias, cfg):
    """float64 loop: scores, biased choice inside the best groups, gates of the unbiased scores."""
    logits = np.asarray(logits, np.float64)
    if cfg.router_score == "sigmoid":
        s = 1 / (1 + np.exp(-logits))
    else:
        s = np.exp(logits - logits.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
    choose = s + np.asarray(bias, np.float64)
    top = np.zeros((*s.shape[:-1], cfg.top_k), int)
    e = cfg.n_experts
    for idx in np.ndindex(*s.shape[:-1]):
        c = choose[idx].copy()
        if cfg.route_groups > 1:
            per = e // cfg.route_groups
            groups = c.reshape(cfg.route_groups, per)
            score = np.sort(groups, -1)[:, -2:].sum(-1) if cfg.router_score == "sigmoid" else groups.max(-1)
            keep = np.argsort(-score, kind="stable")[: cfg.route_group_limit]
            c = np.where(np.isin(np.arange(e) // per, keep), c, -np.inf)
        top[idx] = np.argsort(-c, kind="stable")[: cfg.top_k]
    gates = np.take_along_axis(s, top, -1)
    if cfg.router_norm_topk and cfg.top_k > 1:
        gates = gates / gates.sum(-1, keepdims=True)
    return top, gates * cfg.routed_scaling


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"router_score": "softmax", "route_groups": 0, "route_group_limit": 0},
        {"router_norm_topk": False, "routed_scaling": 1.0, "route_group_limit": 1, "top_k": 2},
        {"route_groups": 2, "route_group_limit": 1, "top_k": 3},
    ],
)
def test_router_matches_numpy_and_limits_groups(changes):
    """Chosen experts and gates as the float64 loop picks them; each token's experts lie in at most
    route_group_limit groups; the bias moves the choice, never the gates."""
    cfg = dataclasses.replace(DS, **changes)
    logits = jax.random.normal(jax.random.key(0), (2, 16, cfg.n_experts))
    bias = 0.05 * jax.random.normal(jax.random.key(1), (cfg.n_experts,))
    _, top_i, gates = top_k_gates(logits, cfg, bias)
    ref_top, ref_gates = numpy_router(logits, bias, cfg)
    np.testing.assert_array_equal(np.sort(top_i, -1), np.sort(ref_top, -1))
    order = lambda t, g: np.take_along_axis(np.asarray(g), np.argsort(np.asarray(t), -1), -1)
    np.testing.assert_allclose(order(top_i, gates), order(ref_top, ref_gates), rtol=1e-6)
    if cfg.route_groups > 1:
        groups = np.asarray(top_i) // (cfg.n_experts // cfg.route_groups)
        assert max(len(set(row)) for row in groups.reshape(-1, cfg.top_k)) <= cfg.route_group_limit
    _, top_nb, gates_nb = top_k_gates(logits, cfg, None)
    assert not np.array_equal(top_nb, top_i)  # the bias did change some choices


def numpy_routed(p, h, cfg):
    """The routed experts' output (dropless) in float64."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items() if k != "balance"}
    h = np.asarray(h, np.float64)
    top, gates = numpy_router(h @ p["router"], np.zeros(cfg.n_experts), cfg)
    out = np.zeros_like(h)
    for ex in range(cfg.n_experts):
        gate = h @ p["gate"][ex]
        y = (gate / (1 + np.exp(-gate)) * (h @ p["up"][ex])) @ p["down"][ex]
        out += np.sum(np.where(top == ex, gates, 0.0), -1, keepdims=True) * y
    return out


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_fine_grained_layer_matches_expert_loop(dispatch):
    """Experts of width moe_d_ff, sigmoid gates renormalised and scaled, group-limited (capacity:
    large enough that nothing drops)."""
    cfg = dataclasses.replace(DS, init_std=0.2, moe_dispatch=dispatch, capacity_factor=4.0)
    _, params = init_params(cfg, 4)
    p = jax.tree.map(lambda w: w[0], arrays(params["layers"]["moe"]["moe"]))
    assert p["up"].shape == (8, 32, 16)
    h = jax.random.normal(jax.random.key(5), (4, 16, cfg.d_model))
    out, stats = jax.jit(lambda p, h: moe_ffn(p, h, cfg))(p, h)
    assert float(stats["dropped_tokens"]) == 0 and float(stats["moe_balance"]) == 0
    np.testing.assert_allclose(out, numpy_routed(p, h, cfg), rtol=RTOL, atol=ATOL)


def test_params_shared_experts_and_first_dense_layers():
    """One dense first layer off the stacked axis (width d_ff), two MoE units with a shared expert of
    width n_shared_experts * moe_d_ff and a float32 balance state; the loss and its parts are finite."""
    _, params = init_params(dataclasses.replace(DS, param_dtype="bfloat16"), 0)
    p = arrays(params)
    assert p["first"]["mlp"]["up"].shape == (1, 32, 64)
    moe = p["layers"]["moe"]
    assert moe["shared"]["up"].shape == (2, 32, 16) and moe["moe"]["up"].shape == (2, 8, 32, 16)
    assert moe["moe"]["balance"]["bias"].dtype == jnp.float32 and moe["moe"]["balance"]["bias"].shape == (2, 8)
    tok, lab = batch(DS)
    loss, metrics = loss_fn(arrays(init_params(DS, 0)[1]), tok, lab, DS)
    assert np.isfinite(float(loss)) and float(metrics["moe_aux_loss"]) > 0


def test_bias_update_moves_towards_the_mean_load_and_is_not_trained():
    """bias += rate * sign(mean load - load); load reset; the gradients of both zeroed."""
    params = {"layers": {"moe": {"balance": {"bias": jnp.zeros((1, 4)), "load": jnp.zeros((1, 4))}, "w": jnp.ones(2)}}}
    grads = {"layers": {"moe": {"balance": {"bias": jnp.ones((1, 4)), "load": jnp.array([[6.0, 2.0, 4.0, 4.0]])},
                                "w": jnp.ones(2)}}}  # fmt: skip
    new, g = update_balance(params, grads, 0.01)
    np.testing.assert_array_equal(new["layers"]["moe"]["balance"]["bias"], np.float32([[-0.01, 0.01, 0.0, 0.0]]))
    assert not np.any(new["layers"]["moe"]["balance"]["load"])
    assert not any(np.any(x) for x in jax.tree.leaves(g["layers"]["moe"]["balance"]))
    assert float(g["layers"]["moe"]["w"][0]) == 1.0


def test_load_gradient_is_the_expert_loads():
    """The 'load' leaf's gradient of the loss is each MoE layer's assignment counts (B*L*k per layer)."""
    _, params = init_params(DS, 0)
    tok, lab = batch(DS)
    g = jax.jit(jax.grad(lambda p: loss_fn(p, tok, lab, DS)[0]))(arrays(params))
    load = np.asarray(g["layers"]["moe"]["moe"]["balance"]["load"])
    assert load.shape == (2, 8) and np.all(load == np.round(load))
    np.testing.assert_array_equal(load.sum(-1), [tok.size * DS.top_k] * 2)
    assert not np.any(np.asarray(g["layers"]["moe"]["moe"]["balance"]["bias"]))


# ---------------------------------------------------------------- layouts: 3 steps vs one device

_REF = {}


def reference(over=()):
    key = tuple(over)
    if key not in _REF:
        _REF[key] = run_steps(_cfg(CONFIG, [*over, *ONE_DEVICE]), n_devices=1)
    return _REF[key]


NO_TP = ["mesh.tensor=1"]
SLOW = pytest.mark.slow
# YaRN (DeepSeek-V3's factor and betas; the attention factor derived, 1.37, and a softmax correction)
YARN = dict(rope_scaling="yarn", rope_scaling_factor=40.0, rope_original_max_seq_len=4096,
            rope_mscale_all_dim=0.8)  # fmt: skip


def _over(fields: dict) -> list[str]:
    return [f"model.{k}={v}" for k, v in fields.items()]


PIPE2_V2 = ["mesh.pipe=2", *NO_TP, "pipeline.virtual=2", "pipeline.microbatches=4"]
LAYOUTS = [
    pytest.param([], [], id="data2-expert2-tensor2-dropless", marks=pytest.mark.slow),
    pytest.param(
        ["model.moe_dispatch=capacity", "model.capacity_factor=1.0"], [], id="capacity-drops", marks=pytest.mark.slow
    ),  # fmt: skip
    pytest.param([], ["mesh.pipe=2", *NO_TP], id="pipe2-data2-expert2", marks=pytest.mark.slow),
    # two chunks per stage: 4 MoE layers after the first dense one (which runs on the first stage)
    pytest.param(["model.n_layers=5"], [*PIPE2_V2, "pipeline.schedule=zb-v"], id="zb-v-pipe2", marks=pytest.mark.slow),
    pytest.param(
        ["model.n_layers=5"],
        [*PIPE2_V2, "pipeline.schedule=interleaved"],
        id="interleaved-pipe2",
        marks=pytest.mark.slow,
    ),  # fmt: skip
    pytest.param([], ["mesh.context=2", *NO_TP], id="context2-data2-expert2", marks=pytest.mark.slow),
    pytest.param([], ["mesh.context=2", "mesh.data=1"], id="context2-expert2-tensor2", marks=pytest.mark.slow),
    pytest.param(
        ["model.context_parallel=ring"],
        ["mesh.context=2", "mesh.data=1"],
        id="ring2-expert2-tensor2",
        marks=pytest.mark.slow,
    ),  # fmt: skip
    pytest.param(
        ["model.q_lora_rank=0"], ["mesh.tensor=4", "mesh.data=1"], id="mla-no-q-latent-tensor4", marks=pytest.mark.slow
    ),
    # YaRN with the sequence split over 'context' (positions from the chunk) and the heads over 'tensor'
    pytest.param(_over(YARN), ["mesh.context=2", "mesh.data=1"], id="yarn-context2-tensor2", marks=SLOW),
    pytest.param(
        [*_over(YARN), "model.context_parallel=ring"],
        ["mesh.context=2", "mesh.data=1"],
        id="yarn-ring2-tensor2",
        marks=SLOW,
    ),  # fmt: skip
    pytest.param([], ["train.zero=1"], id="zero1", marks=pytest.mark.slow),
    pytest.param([], ["mesh.data=4", *NO_TP, "train.zero=2"], id="zero2-data4", marks=pytest.mark.slow),
    pytest.param([], ["train.zero=3"], id="zero3", marks=pytest.mark.slow),
]


# ---------------------------------------------------------------- multi-head latent attention

MLA = dataclasses.replace(
    DS, attention="mla", q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6
)


def numpy_mla(p, h, cfg):
    """Multi-head latent attention in float64, head by head, from the DeepSeek-V2 paper's equations."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    h = np.asarray(h, np.float64)
    norm = lambda x, g: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * g
    n, dr, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    length = h.shape[1]
    ang = np.arange(length)[:, None] * cfg.rope_theta ** (-np.arange(dr // 2) / (dr // 2))
    a_rope, a_softmax = cfg.yarn_scales()  # YaRN: cos/sin and softmax scale factors (1.0 without)
    if cfg.rope_scaling == "yarn":  # its frequencies are checked against transformers' in test_hf.py
        ang = np.arange(length)[:, None] * np.asarray(rope_freqs(cfg, dr), np.float64)

    def rot(x):  # [.., L, dr], rotate-half
        c, s_ = a_rope * np.cos(ang), a_rope * np.sin(ang)
        a, b = x[..., : dr // 2], x[..., dr // 2 :]
        return np.concatenate([a * c - b * s_, b * c + a * s_], -1)

    if cfg.q_lora_rank:
        q = np.einsum("blr,rhk->blhk", norm(h @ p["q_down"], p["q_norm"]), p["q_up"])
    else:
        q = np.einsum("bld,dhk->blhk", h, p["q"])
    ckv = h @ p["kv_down"]
    kv = np.einsum("blr,rhk->blhk", norm(ckv[..., :r], p["kv_norm"]), p["kv_up"])
    k_pe = rot(ckv[..., r:])  # one RoPE key per token, every head's
    out = np.zeros((*h.shape[:2], cfg.n_heads, cfg.v_head_dim))
    for head in range(cfg.n_heads):
        qh = np.concatenate([q[:, :, head, :n], rot(q[:, :, head, n:])], -1)
        kh = np.concatenate([kv[:, :, head, :n], k_pe], -1)
        s = np.einsum("bld,bsd->bls", qh, kh) / np.sqrt(n + dr) * a_softmax
        s = np.where(np.tril(np.ones((length, length), bool)), s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        out[:, :, head] = np.einsum("bls,bsd->bld", a / a.sum(-1, keepdims=True), kv[:, :, head, n:])
    return np.einsum("blhk,hkd->bld", out, p["o"])


@pytest.mark.parametrize("changes", [{}, {"q_lora_rank": 0}, {"remat": "full"}, YARN, {**YARN, "remat": "full"}])
def test_mla_matches_numpy(changes):
    """The layer (its own XLA core under remat=none, jax's kernel otherwise) against the float64 loop;
    weights of the documented shapes; with YaRN, its RoPE factor and softmax correction."""
    from meshrun_models.attention import attention

    cfg = dataclasses.replace(MLA, init_std=0.2, **changes)
    _, params = init_params(cfg, 3)
    p = jax.tree.map(lambda w: w[0], arrays(params["layers"]["moe"]["attn"]))
    shapes = {"kv_down": (32, 12), "kv_norm": (8,), "kv_up": (8, 4, 14), "o": (4, 6, 32)}
    shapes |= {"q_down": (32, 12), "q_norm": (12,), "q_up": (12, 4, 12)} if cfg.q_lora_rank else {"q": (32, 4, 12)}
    assert {k: v.shape for k, v in p.items()} == shapes
    h = jax.random.normal(jax.random.key(5), (2, 16, cfg.d_model))
    out = jax.jit(lambda p, h: attention(p, h, cfg))(p, h)
    np.testing.assert_allclose(out, numpy_mla(p, h, cfg), rtol=RTOL, atol=ATOL)


def test_mla_param_and_flop_counts():
    """analysis.flops counts MLA's params as the model has them (latent norms included) and its
    attention core as a (nope + rope + v) multiply-adds per query-key pair."""
    from meshrun.analysis.flops import attn_core_fwd_flops, param_counts

    _, params = init_params(MLA, 0)
    have = sum(x.size for path, x in jax.tree.leaves_with_path(arrays(params)) if "balance" not in str(path))
    assert param_counts(MLA)["total"] == have
    assert attn_core_fwd_flops(MLA, 10, 16) == 2 * 10 * 16 * 4 * (8 + 4 + 6)


@pytest.mark.slow
def test_step_gradients_and_loads_match_full_batch():
    """The fast representative case: data 2 x expert 2 x tensor 2 with 2 microbatches, one step's
    loss and every gradient against a one-device full-batch value_and_grad; the 'load' gradients,
    which the bias update reads, are the whole batch's expert loads exactly."""
    from test_train import SMALL, assert_grads_close, first_grads, full_batch_reference

    from meshrun.config import load_config

    cfg = load_config(f"configs/{CONFIG}", [x for x in SMALL if "optimizer.eps" not in x])
    loss, grads, _, (tok, lab) = first_grads(cfg)
    ref_loss, ref, _ = full_batch_reference(cfg, tok, lab)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    load = lambda g: np.asarray(g["layers"]["moe"]["moe"]["balance"]["load"])
    np.testing.assert_array_equal(load(grads), load(ref))
    assert load(grads).sum() == tok.size * cfg.model.top_k * cfg.model.n_units
    assert_grads_close(grads, ref)


@pytest.mark.parametrize("model, layout", LAYOUTS)
def test_layouts_match_one_device(model, layout):
    """Losses and every parameter after 3 steps, the balance biases included, equal one device."""
    got = run_steps(_cfg(CONFIG, [*model, *layout]))
    ref = reference(model)
    biases = got[1]["layers"]["moe"]["moe"]["balance"]["bias"]
    assert np.any(biases)  # the biases did move
    np.testing.assert_array_equal(biases, ref[1]["layers"]["moe"]["moe"]["balance"]["bias"])
    assert_same(got, ref)


def run_master(cfg, n_devices=8, steps=3):
    """run_steps' losses and the optimizer's float32 master weights (bf16 params)."""
    losses, state = run_state(cfg, n_devices, steps)
    return losses, state.params, state.opt_state.master


# bf16 params across layouts. The step's float32 reduction order differs by a few ulp between layouts;
# a master weight that lies that close to a bf16 rounding boundary rounds one bf16 step (2^-8 relative)
# apart, the next step's gradients move with it and Adam (eps 1e-4 here) amplifies small-gradient
# differences. Measured after 3 steps, data 2 x expert 2 x tensor 2 ZeRO-1 vs one device: losses within 6.2e-6,
# about a fifth of the bf16 params one step apart, the master within 1.5e-3 of its norm per tensor;
# the dense configs/tiny_cpu.yaml on data 4 x tensor 2 ZeRO-1 shows the same (1.7e-6, 1.6e-3): the
# rounding, not the MoE. After 1 step (warmup: lr 0) everything is bit-identical. So: the losses at
# rtol 1e-5, the balance biases (sums of integer loads) exactly, each master tensor by its norm.
MASTER_NORM_RTOL = 5e-3


@pytest.mark.slow
def test_bf16_params_with_float32_master_match_one_device():
    """bf16 params, float32 master, data 2 x expert 2 x tensor 2 with ZeRO-1 against one device after 3 steps."""
    bf16 = ["model.param_dtype=bfloat16"]
    ref = run_master(_cfg(CONFIG, [*bf16, *ONE_DEVICE]), n_devices=1)
    got = run_master(_cfg(CONFIG, [*bf16, "train.zero=1"]))
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    bias = lambda p: p["layers"]["moe"]["moe"]["balance"]["bias"]
    assert bias(got[1]).dtype == np.float32 and np.any(bias(got[1]))
    np.testing.assert_array_equal(bias(got[1]), bias(ref[1]))
    for (path, g), r in zip(jax.tree.leaves_with_path(got[2]), jax.tree.leaves(ref[2]), strict=True):
        name = jax.tree_util.keystr(path)
        if "balance" not in name:  # the optimizer's copy of the biases is never read
            assert np.linalg.norm(g - r) <= MASTER_NORM_RTOL * np.linalg.norm(r), name


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "changes, line",
    [
        ({"n_experts": 0, "n_shared_experts": 1},
         "model.n_shared_experts: a dense model has no routed experts (got 1); set model.n_experts > 0"),
        ({"route_group_limit": 5}, "model.route_group_limit: invalid value (got 5); use 1..model.route_groups=4"),
        ({"route_groups": 3}, "model.route_groups: invalid value (got 3); use a divisor of model.n_experts=8"),
        ({"bias_rate": -0.1}, "model.bias_rate: invalid value (got -0.1); use a number >= 0"),
        ({"router_score": "tanh"}, "model.router_score: invalid value (got 'tanh'); use one of"),
        ({"balance": "loss"}, "model.balance: invalid value (got 'loss'); use one of"),
        ({"first_dense_layers": 3}, "model.first_dense_layers: invalid value (got 3); use fewer than model.n_layers=3"),
        ({"route_group_limit": 1, "top_k": 3}, "model.route_group_limit: invalid value (got 1); allow at least 2"),
        ({"routed_scaling": 0.0}, "model.routed_scaling: invalid value (got 0.0); use a positive factor"),
        ({"attention": "mha"}, "model.attention: invalid value (got 'mha'); use one of"),
        ({"kv_lora_rank": 8}, "model.kv_lora_rank: invalid value (got 8); set model.attention=mla with it, or use 0"),
        ({"attention": "mla", "kv_lora_rank": 0, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8},
         "model.kv_lora_rank: invalid value (got 0); use a positive size with model.attention=mla"),
        ({"attention": "mla", "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 5, "v_head_dim": 8},
         "model.qk_rope_head_dim: invalid value (got 5); use an even size (RoPE rotates pairs)"),
        ({"attention": "mla", "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 16},
         "model.v_head_dim: invalid value (got 16); use at most qk_nope_head_dim + qk_rope_head_dim = 12"),
        ({"attention": "mla", "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
          "q_lora_rank": -1}, "model.q_lora_rank: out of range (got -1)"),
    ],
)  # fmt: skip
def test_config_errors_name_field_value_and_fix(changes, line):
    with pytest.raises(ConfigError) as e:
        dataclasses.replace(DS, **changes)
    assert str(e.value).startswith(line), str(e.value)


def test_tensor_split_of_expert_width_is_checked():
    from meshrun_models.transformer import validate_model_for_mesh

    with pytest.raises(ConfigError, match=r"model.moe_d_ff: .*got 16.*mesh.tensor=32"):
        validate_model_for_mesh(dataclasses.replace(DS, d_ff=64, n_heads=32, n_kv_heads=32, vocab=64), {"tensor": 32})


@pytest.mark.parametrize(
    "over, text",
    [
        (["model.bias_rate=-1"], "model.bias_rate: invalid value (got -1"),
        (["model.route_group_limit=9"], "model.route_group_limit: invalid value (got 9)"),
        (["model.n_experts=0", "model.moe_d_ff=0", "model.first_dense_layers=0", "model.route_groups=0",
          "model.route_group_limit=0", "model.balance=aux_loss", "model.router_score=softmax"],
         "model.n_shared_experts: a dense model has no routed experts (got 1)"),
        (["data.pack_documents=true", "data.kind=synthetic"], "data.pack_documents"),
        (["model.kv_lora_rank=0"], "model.kv_lora_rank: invalid value (got 0); use a positive size"),
        (["model.qk_rope_head_dim=7"], "model.qk_rope_head_dim: invalid value (got 7); use an even size"),
        (["mesh.tensor=8", "mesh.data=1", "mesh.expert=1"], "model.n_heads: n_heads not divisible by the tensor"),
        (["model.n_experts=12", "model.route_groups=3"],
         "model.route_groups: expert groups straddle expert-parallel ranks (got 3); use a multiple or a divisor of"),
    ],
)  # fmt: skip
def test_cli_bad_input_exits_2_with_one_line(capsys, over, text):
    from meshrun.cli.main import main

    config = str(Path(__file__).resolve().parents[1] / "configs" / CONFIG)
    rc = main(["train", config, *over, "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert text in err and len(err.strip().splitlines()) == 1, err


def test_param_counts_cover_fine_grained_shared_and_first_dense():
    """analysis.flops (MFU, the planner's memory) counts the params the model has (balance state aside),
    and a token's active matmul params: top_k narrow experts + the shared one + the router."""
    from meshrun.analysis.flops import _matmul_active, attn_params, param_counts

    _, params = init_params(DS, 0)
    have = sum(x.size for path, x in jax.tree.leaves_with_path(arrays(params)) if "balance" not in str(path))
    assert param_counts(DS)["total"] == have
    assert _matmul_active(DS, True) == attn_params(DS) + 3 * 32 * 16 * (2 + 1) + 32 * 8


@pytest.mark.slow
def test_balance_biases_are_checkpointed_and_resume_gives_the_same_losses(tmp_path):
    """The biases are in the train state: a run stopped after step 3 (checkpoint at step 2) and resumed
    logs the losses of an uninterrupted run (step 3 again, then 4)."""
    over = ["mesh.tensor=1", "mesh.data=4", "train.seq_len=16", "model.max_seq_len=16", "data.kind=synthetic",
            "checkpoint.every=2", "checkpoint.async_save=false", "train.steps=4", "model.bias_rate=0.05"]  # fmt: skip
    assert_resume_gives_the_same_losses(tmp_path, f"configs/{CONFIG}", over)


def test_family_without_the_fields_exits_2(capsys):
    from meshrun.cli.main import main

    config = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_gpt2_cpu.yaml")
    assert main(["train", config, "model.balance=bias", "--quiet"]) == 2
    assert "model.balance: gpt2 has no such field (got 'bias'); remove it" in capsys.readouterr().err


def test_hugging_face_exchange_refuses_the_new_shapes():
    """export-hf writes DeepSeek-V3's MoE shapes as DeepSeek-V3, which has latent attention: with
    grouped-query attention they are refused with one line naming the field, as is a dense model
    with latent attention; a DeepSeek-V3 config with routing it cannot express names the fields."""
    from meshrun_models.llama import hf

    from meshrun.hf.io import export_config

    with pytest.raises(ConfigError, match=r"^model.attention: .*got 'gqa'.*use attention=mla .*DeepseekV3ForCausalLM"):
        export_config(DS, None, 64, "float32")
    mla = dataclasses.replace(MLA, norm_eps=1e-6)  # transformers' DeepSeek-V3 latent norms: 1e-6
    assert export_config(mla, None, 64, "float32")["architectures"] == ["DeepseekV3ForCausalLM"]
    with pytest.raises(ConfigError, match=r"^model.router_score: .*got {'router_score': 'softmax'}"):
        export_config(dataclasses.replace(mla, router_score="softmax"), None, 64, "float32")
    dense_mla = dataclasses.replace(MLA, n_experts=0, **{**hf.MIXTRAL_ROUTING, "route_group_limit": 0})
    with pytest.raises(ConfigError, match=r"^model.attention: .*latent attention.*got 'mla'.*use attention=gqa"):
        hf.layer_map(dense_mla)


# ---------------------------------------------------------------- the planner


def test_planner_counts_deepseek_v3():
    """configs/models/deepseek-v3.yaml: 671B parameters, 37B active per token (DeepSeek-V3's report,
    the multi-token prediction module aside); MLA's GEMMs in the kernel model are its weights."""
    from meshrun.analysis.flops import active_params, attn_params, param_counts
    from meshrun.cli.plan import load_model
    from meshrun.planner.kernels import mla_gemms

    m = load_model("deepseek-v3")[0]
    assert param_counts(m)["total"] == pytest.approx(671e9, rel=2e-3)
    assert active_params(m) == pytest.approx(37e9, rel=2e-2)
    assert sum(k * n for k, n in mla_gemms(m, 1)) == attn_params(m)
    down = 7168 * (1536 + 512 + 64)  # the down projections, replicated over tensor; the rest split by heads
    assert sum(k * n for k, n in mla_gemms(m, 8)) == down + (attn_params(m) - down) / 8


def test_planner_costs_expert_width_and_shared_experts():
    """A layer's expert GEMMs and kept activations follow moe_d_ff and the shared experts."""
    from meshrun.planner.activations import layer_activation_bytes
    from meshrun.planner.constants import calibration_for
    from meshrun.planner.hardware import GPUS
    from meshrun.planner.kernels import layer_seconds
    from meshrun.planner.layout import Layout

    lay, kw = Layout(), dict(sp=False, remat="none", act=2.0, dropout=False, flash=True, moe=True)
    sec = lambda m: sum(layer_seconds(m, lay, 4096, GPUS["h800"], calibration_for("h800"), moe=True).values())
    wide, no_shared = dataclasses.replace(MLA, moe_d_ff=64), dataclasses.replace(MLA, n_shared_experts=0)
    assert sec(no_shared) < sec(MLA) < sec(wide)
    act = lambda m: layer_activation_bytes(m, 1, 4096, 1, **kw)
    assert act(no_shared) < act(MLA) < act(wide)


def test_planner_group_limited_all_to_all():
    """Device-limited routing (route_group_limit M of route_groups): a dispatch sending a token once per
    group it reaches moves min(top_k, M) / top_k of the unlimited top_k copies (Megatron's semantics:
    DeepSeek-V3's 4 of 8); meshrun's exchange, an all-gather of the group's tokens and a
    reduce-scatter of the sums, does not shrink (ep rows each, the gathered ones float32)."""
    from meshrun.cli.plan import load_model
    from meshrun.planner.hardware import parse_cluster
    from meshrun.planner.layout import Layout
    from meshrun.planner.timing import _expert_seconds, a2a_rows

    m = load_model("deepseek-v3")[0]
    free = dataclasses.replace(m, route_groups=0, route_group_limit=0)
    for limit in (1, 4, 8):
        lim = dataclasses.replace(m, route_group_limit=limit)
        assert a2a_rows(lim, 64, "megatron") == a2a_rows(free, 64, "megatron") * min(8, limit) / 8
        gathered = 64 * (7168 + 16) / 7168 * 4 / 2  # float32 rows of d_model + 2 top_k, in bf16 rows
        assert a2a_rows(lim, 64, "meshrun") == a2a_rows(free, 64, "meshrun") == (gathered + 64) / 2
    cluster, lay = parse_cluster("h800:256x8,ib=8x400"), Layout(expert=64, data=2, pipe=16)
    sec = lambda model: _expert_seconds(model, lay, cluster, 2.0 * 4096 * 7168, 4, "megatron")
    assert sec(m) < sec(free)


def test_plan_evaluates_deepseek_v3_published_layout(capsys):
    """DeepSeek-V3's layout (PP16, EP64, ZeRO-1, TP1 on 2048 H800) fits under Megatron's semantics and
    meshrun's; meshrun's dropless exchange all-gathers the group's tokens (ep = 64 rows per token, in
    float32 with gates and ids) and reduce-scatters the sums (64 rows), 96 bf16 rows a collective on
    average against Megatron's 4 (top_k = 8 copies, once per group reached: at most 4 of the 8
    groups), so its expert communication takes 24x as long."""
    import json

    from meshrun.cli.main import main
    from meshrun.planner.hardware import GPUS

    assert GPUS["h800"].peak_flops == GPUS["h100-80g"].peak_flops and GPUS["h800"].nvlink_bw == 400e9
    argv = ["plan", "--model", "deepseek-v3", "--cluster", "h800:256x8,ib=8x400", "--json", "--evaluate",
            "tensor=1,pipe=16,data=2,expert=64,zero=1,remat=full"]  # fmt: skip
    expert_comm = {}
    for framework in ("megatron", "meshrun"):
        assert main([*argv, "--framework", framework]) == 0
        doc = json.loads(capsys.readouterr().out)
        (cfg,) = doc["configs"]
        assert doc["active_params"] == pytest.approx(37.6e9, rel=1e-2) and doc["devices"] == 2048
        assert (cfg["pipe"], cfg["expert"], cfg["zero"]) == (16, 64, 1)
        assert cfg["memory_gb"] < 80 and not cfg["violations"], cfg
        expert_comm[framework] = cfg["time_parts_s"]["expert_comm"]
    assert expert_comm["meshrun"] == pytest.approx(24.04 * expert_comm["megatron"], rel=0.02)
