"""MoE: routing/capacity vs a numpy reference, expert-parallel parity, all-to-all-only HLO, caller shard_map."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from meshrun_models import apply_layers, capacity, init_params, loss_fn, moe_ffn
from meshrun_models.layers import arrays
from meshrun_models.llama.config import LlamaConfig
from test_models import ATOL, RTOL, assert_same, batch, loss_and_grads, mesh_of

from meshrun.analysis.flops import dropless_exchange
from meshrun.analysis.hlo import collectives
from meshrun.parallel.sharding import compute_rules, param_rules, tree_shardings, tree_specs, use_rules
from meshrun.planner.layout import Layout
from meshrun.planner.step_model import predict_collective_bytes

# Groups of (1 dense + 1 MoE), top-2 with capacity factor 1.0: tokens do get dropped.
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
    capacity_factor=1.0,
    moe_every=2,
)
# Switch-style: every layer MoE, top-1.
SWITCH = dataclasses.replace(MOE, n_layers=2, moe_every=1, top_k=1, capacity_factor=1.25)


@pytest.fixture(scope="module")
def moe_ref():
    _, params = init_params(MOE, 0)
    tok, lab = batch(MOE)
    return params, tok, lab, loss_and_grads(MOE, params, tok, lab)


def test_reference_reports_drops(moe_ref):
    (loss, aux), _ = moe_ref[3]
    assert float(aux["dropped_tokens"]) > 0
    assert 0.9 < float(aux["moe_aux_loss"]) < 1.5  # ~1 when balanced (Switch normalisation)
    np.testing.assert_allclose(loss, aux["ce_loss"] + 0.01 * aux["moe_aux_loss"] + 0.001 * aux["moe_z_loss"], rtol=RTOL)


@pytest.mark.parametrize(
    "shape,changes",
    [
        ((2, 2, 2), {}),
        ((1, 2, 4), {}),
        ((1, 2, 4), {"sequence_parallel": True, "remat": "full"}),
        ((2, 2, 2), {"remat": "selective", "zero": 3}),  # params FSDP-sharded (ZeRO-3) too
    ],
)
def test_moe_parity(moe_ref, shape, changes):
    params, tok, lab, ref = moe_ref
    changes = dict(changes)
    zero = changes.pop("zero", 0)
    got = loss_and_grads(dataclasses.replace(MOE, **changes), params, tok, lab, mesh_of(*shape), zero=zero)
    assert_same(ref, got)


# ---------------------------------------------------------------- routing vs numpy


def numpy_moe(p, h, cfg):
    """Loop over experts in float64: top-k, GShard priority (choice-major), capacity, renormalised gates."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    h = np.asarray(h, np.float64)
    g, s, _ = h.shape
    k, e, cap = cfg.top_k, cfg.n_experts, capacity(cfg, s)
    logits = h @ p["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1)[..., :k]
    gates = np.take_along_axis(probs, top, -1)
    gates = gates / gates.sum(-1, keepdims=True) if k > 1 else gates
    weight = np.zeros((g, s, e))
    dropped = 0
    for gi in range(g):
        fill = np.zeros(e, int)
        for j in range(k):
            for si in range(s):
                ex = top[gi, si, j]
                if fill[ex] < cap:
                    fill[ex] += 1
                    weight[gi, si, ex] += gates[gi, si, j]
                else:
                    dropped += 1
    out = np.zeros_like(h)
    for ex in range(e):
        gate = h @ p["gate"][ex]
        a = gate / (1 + np.exp(-gate)) * (h @ p["up"][ex])
        out += weight[..., ex : ex + 1] * (a @ p["down"][ex])
    frac = np.stack([(top == ex).sum((1, 2)) / (s * k) for ex in range(e)], -1)
    aux = e * np.sum(frac * probs.mean(1))
    lse = np.log(np.exp(logits).sum(-1))
    return out, {"dropped_tokens": dropped, "moe_aux_loss": aux, "moe_z_loss": np.sum(np.mean(lse**2, 1))}


@pytest.mark.parametrize(
    "dispatch,cf,expect_drops", [("capacity", 2.0, False), ("capacity", 0.5, True), ("dropless", 0.5, False)]
)
def test_moe_layer_matches_expert_loop(dispatch, cf, expect_drops):
    """cf = E/k: capacity = S, nothing can drop; cf = 0.5: exact drop count and the dropped
    assignments are missing from the output; dropless ignores the capacity: nothing dropped."""
    cfg = dataclasses.replace(MOE, capacity_factor=cf, init_std=0.2, moe_dispatch=dispatch)
    _, params = init_params(cfg, 4)
    p = jax.tree.map(lambda w: w[0], arrays(params["layers"]["moe"]["moe"]))
    h = jax.random.normal(jax.random.key(5), (4, 16, cfg.d_model))
    out, stats = jax.jit(lambda p, h: moe_ffn(p, h, cfg))(p, h)
    no_cap = dataclasses.replace(cfg, capacity_factor=cfg.n_experts / cfg.top_k)
    ref, ref_stats = numpy_moe(p, h, no_cap if dispatch == "dropless" else cfg)
    assert (ref_stats["dropped_tokens"] > 0) == expect_drops
    assert float(stats["dropped_tokens"]) == ref_stats["dropped_tokens"]
    np.testing.assert_allclose(out, ref, rtol=RTOL, atol=ATOL)
    for k in ("moe_aux_loss", "moe_z_loss"):
        np.testing.assert_allclose(stats[k], ref_stats[k], rtol=RTOL, err_msg=k)


# ---------------------------------------------------------------- compiled HLO: all-to-all, no weight movement


def test_hlo_expert_parallel_moves_tokens_not_weights():
    """(data 2, expert 4), Switch model (top-1, every layer MoE): per MoE layer one all_to_all there
    and one back (forward), the same two in backward, all over 'expert'; no all-gather anywhere;
    expert-weight gradients are reduced over 'data' only (their data-parallel replicas), never over
    'expert'. The same compiled step also matches one device (Switch parity)."""
    cfg, b = SWITCH, 8
    mesh = mesh_of(2, 1, 4)
    _, params = init_params(cfg, 1)
    tok, lab = batch(cfg, b=b, seed=2)
    placed = jax.device_put(params, tree_shardings(params, mesh, param_rules(0)))
    step = jax.value_and_grad(lambda p: loss_fn(p, tok, lab, cfg), has_aux=True)
    with use_rules(mesh, compute_rules(False)):
        fwd = jax.jit(lambda p: loss_fn(p, tok, lab, cfg)[0]).lower(placed).compile().as_text()
        compiled = jax.jit(step).lower(placed).compile()
    assert_same(jax.jit(step)(params), compiled(placed))
    both = compiled.as_text()
    cap = capacity(cfg, 16)
    local_groups = b // 8  # batch over data x expert
    a2a_bytes = cfg.n_experts * local_groups * cap * cfg.d_model * 4  # [E, G, C, D] f32, either direction
    expert_w_bytes = 3 * (cfg.n_experts // 4) * cfg.d_model * cfg.d_ff * 4  # local gate+up+down
    dense_bytes = 4 * (2 * cfg.d_model * cfg.n_heads * cfg.head_dim + 2 * cfg.d_model * cfg.n_kv_heads * cfg.head_dim)
    dense_bytes += 4 * (2 * cfg.d_model + cfg.d_model * cfg.n_experts)  # norms + router

    f = collectives(fwd, dict(mesh.shape))
    assert (
        sorted((c.op, c.axes, c.bytes, c.in_loop) for c in f if c.op != "all-reduce")
        == [("all-to-all", ("expert",), a2a_bytes, True)] * 2
    )
    # forward all-reduces: aux + z-loss sums (2 scalars; the drop count is dead here) per layer, the loss sum
    assert sorted((c.axes, c.bytes, c.in_loop) for c in f if c.op == "all-reduce") == [
        (("data", "expert"), 4, False),
        (("data", "expert"), 8, True),
    ]

    c = collectives(both, dict(mesh.shape))
    assert not [x for x in c if x.op in ("all-gather", "reduce-scatter", "collective-permute")]
    a2a = [(x.axes, x.bytes, x.in_loop) for x in c if x.op == "all-to-all"]
    assert a2a == [(("expert",), a2a_bytes, True)] * 4
    loop_ar = sorted((x.axes, x.bytes) for x in c if x.op == "all-reduce" and x.in_loop)
    # per layer: 3 router stats (fwd), expert-weight grads over 'data', dense grads over the DP group
    assert loop_ar == sorted([(("data", "expert"), 12), (("data",), expert_w_bytes), (("data", "expert"), dense_bytes)])


# ---------------------------------------------------------------- inside a caller's shard_map (pipeline executors)


def _manual_specs(specs, manual):
    def one(spec):
        dims = []
        for d in spec:
            axes = tuple(a for a in (d if isinstance(d, tuple) else (d,)) if a in manual) if d is not None else ()
            dims.append(axes[0] if len(axes) == 1 else (axes or None))
        return P(*dims)

    return jax.tree.map(one, specs, is_leaf=lambda s: isinstance(s, P))


@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
def test_apply_layers_inside_caller_shard_map(moe_ref, dispatch):
    """A caller manual over ('data','expert') (as a pipeline executor is) gets the direct all_to_all
    path, with either dispatch: same outputs and gradients as one device; aux comes back as local
    sums (psum them)."""
    params, cfg = moe_ref[0], dataclasses.replace(MOE, moe_dispatch=dispatch)
    mesh = mesh_of(2, 2, 2)
    manual = ("data", "expert")
    x = jax.random.normal(jax.random.key(2), (8, 16, MOE.d_model))
    layers = jax.device_put(params["layers"], tree_shardings(params["layers"], mesh, param_rules(0)))
    in_specs = _manual_specs(tree_specs(params["layers"], param_rules(0), mesh), manual)

    def body(lp, xl):
        with use_rules(mesh, compute_rules(False), manual=manual):
            y, aux = apply_layers(lp, xl, cfg)
        return y, jax.lax.psum(aux, manual)

    sm = jax.shard_map(
        body, mesh=mesh, in_specs=(in_specs, P(manual)), out_specs=(P(manual), P()), axis_names=set(manual)
    )

    def objective(run):
        def f(lp, x):
            y, aux = run(lp, x)
            return jnp.mean(y**2) + aux["moe_aux_loss"] + aux["moe_z_loss"], aux

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))

    ref = objective(lambda lp, x: apply_layers(lp, x, cfg))(params["layers"], x)
    with use_rules(mesh, compute_rules(False)):
        got = objective(sm)(layers, x)
    (v0, a0), g0 = ref
    (v1, a1), g1 = got
    np.testing.assert_allclose(v1, v0, rtol=RTOL)
    assert float(a1["dropped_tokens"]) == float(a0["dropped_tokens"])
    assert (float(a0["dropped_tokens"]) > 0) == (dispatch == "capacity")
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(b, a, rtol=RTOL, atol=ATOL)

    if dispatch == "dropless":
        return
    # Only 'data' manual: a nested expert shard_map cannot be differentiated (Shardy), so it is refused.
    only_data = jax.shard_map(
        lambda lp, xl: _in_rules(mesh, ("data",), lambda: apply_layers(lp, xl, MOE)[0]),
        mesh=mesh,
        in_specs=(_manual_specs(tree_specs(params["layers"], param_rules(0), mesh), ("data",)), P("data")),
        out_specs=P("data"),
        axis_names={"data"},
    )
    with use_rules(mesh, compute_rules(False)), pytest.raises(ValueError, match="make 'expert' manual"):
        jax.jit(only_data)(layers, x)


def _in_rules(mesh, manual, fn):
    with use_rules(mesh, compute_rules(False), manual=manual):
        return fn()


# ---------------------------------------------------------------- dropless dispatch

DROPLESS = dataclasses.replace(MOE, n_layers=2, moe_every=1, moe_dispatch="dropless")  # capacity_factor 1.0 ignored


def test_dropless_parity_and_gathered_exchange():
    """Dropless on one device == capacity routing with capacity S (nothing can drop) == dropless on
    data2 x expert2 x tensor2 (loss, aux, grads); dropped_tokens 0 although capacity_factor=1.0
    drops in capacity routing. The compiled step exchanges rows over 'expert' by one all-gather of
    the group's T local tokens each, float32 [ep*T, D + 2k] with their gates and ids, and one
    reduce-scatter of the gated sums [ep*T, D] per MoE layer, each transposed in the backward; no
    all_to_all, and the step model predicts the same bytes."""
    cfg = DROPLESS
    _, params = init_params(cfg, 0)
    tok, lab = batch(cfg)
    ref = loss_and_grads(cfg, params, tok, lab)
    assert float(ref[0][1]["dropped_tokens"]) == 0
    no_drop = dataclasses.replace(cfg, moe_dispatch="capacity", capacity_factor=cfg.n_experts / cfg.top_k)
    assert_same(ref, loss_and_grads(no_drop, params, tok, lab))

    mesh = mesh_of(2, 2, 2)
    placed = jax.device_put(params, tree_shardings(params, mesh, param_rules(0)))
    step = jax.value_and_grad(lambda p: loss_fn(p, tok, lab, cfg), has_aux=True)
    with use_rules(mesh, compute_rules(False)):
        compiled = jax.jit(step).lower(placed).compile()
    assert_same(ref, compiled(placed))

    ep, t, d, k = 2, tok.size // 4, cfg.d_model, cfg.top_k  # tokens over data x expert
    c = collectives(compiled.as_text(), dict(mesh.shape))
    assert not [x for x in c if x.op == "all-to-all"]
    rows = sorted((x.op, x.bytes, x.in_loop) for x in c if x.axes == ("expert",))
    fwd = [("all-gather", ep * t * (d + 2 * k) * 4, True), ("reduce-scatter", t * d * 4, True)]
    bwd = [("reduce-scatter", t * (d + 2 * k) * 4, True), ("all-gather", ep * t * d * 4, True)]
    assert rows == sorted(fwd + bwd)
    # the step model's bytes (`flops.dropless_exchange`) and counts, 2 MoE layers
    gathered, packed = dropless_exchange(cfg, ep, 4)
    moved = sum(x.bytes * x.per_step for x in c if x.axes == ("expert",))
    assert moved == pytest.approx(cfg.n_moe_layers * t * d * 4 * (gathered + 1 + packed + ep), rel=1e-6)
    pred = predict_collective_bytes(cfg, Layout(tensor=2, data=2, expert=2, micro_batch_size=2), seq_len=tok.shape[1])
    ops = ("all-gather", "reduce-scatter")
    counted = {op: sum(x.per_step for x in c if x.op == op and x.axes == ("expert",)) for op in ops}
    assert counted == {op: pred["count"][op] for op in counted} == {"all-gather": 4, "reduce-scatter": 4}
    assert "all-to-all" not in pred["count"]


def test_bad_moe_dispatch_exits_2(capsys):
    from meshrun.cli.main import main

    config = str(Path(__file__).resolve().parents[1] / "configs/tiny_moe_cpu.yaml")
    rc = main(["train", config, "model.moe_dispatch=sorted", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert "model.moe_dispatch: invalid value (got 'sorted'); use one of ['capacity', 'dropless']" in err


@pytest.mark.parametrize("tile,cap", [(1, 0), (4, 0), (32, 0), (64, 0), (4, 5), (32, 5), (4, 20)])
def test_cpu_expert_tile_loop_matches_ragged_dot(tile, cap):
    """models/gmm.py's tile loop (dropless experts on XLA:CPU) equals ragged_dots, output and the
    gradients of x and the three weights: empty groups, partial tiles, a last window moved back to
    end at the last row (tile 32) and 17 padding rows past the groups (zero out, zero gradient),
    which the loop never visits; with `cap` the first cap rows of each group run batched, the rest
    (groups of 17 and 9 rows past cap 5; none past 20) in the loop."""
    from meshrun_models.gmm import ffn

    k = jax.random.split(jax.random.key(0), 5)
    sizes = jnp.array([3, 0, 17, 9, 4])
    x, dy = jax.random.normal(k[0], (50, 8)), jax.random.normal(k[3], (50, 8))
    w = jax.random.normal(k[1], (5, 8, 6)), jax.random.normal(k[4], (5, 8, 6)), jax.random.normal(k[2], (5, 6, 8))
    act = lambda g, u: jax.nn.silu(g) * u
    rd = lambda x, w: jax.lax.ragged_dot(x, w, sizes)
    ref = lambda x, a, b, c: rd(act(rd(x, a), rd(x, b)), c)
    got = lambda x, a, b, c: ffn(x, (a, b), c, sizes, act, tile, cap)
    vg = lambda f: jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a) * dy), (0, 1, 2, 3)))(x, *w)
    (v0, g0), (v1, g1) = vg(ref), vg(got)
    np.testing.assert_allclose(v1, v0, rtol=1e-5)
    for a, b in zip(g0, g1, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(a))))
    assert not np.any(np.asarray(got(x, *w))[33:]) and not np.any(np.asarray(g1[0])[33:])
