"""Context-parallel attention (`meshrun_models.context`) against one-device `attention_core`.

Outputs and gradients w.r.t. q, k, v of all-gather and ring attention, sequences split over 2, 4
and 8 simulated devices, zigzag and contiguous layouts, GQA, packed documents that cross chunk
boundaries, a sliding window, and the step's mesh shape (data, context manual; tensor auto).
The compiled HLO is audited for the collectives each kind must issue.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from meshrun_models.attention import attention_core
from meshrun_models.context import allgather_attention, local_index, ring_attention, zigzag_index

from meshrun.analysis.hlo import collectives, computations, multiplicity
from meshrun.parallel.sharding import use_rules

B, K, G, DH = 2, 2, 2, 8
KINDS = {"ring": ring_attention, "allgather": allgather_attention}


def _mesh(shape, names):
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def _inputs(length, b=B, seed=0):
    kq, kk, kv, kw = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (b, length, K, G, DH), jnp.float32)
    k = jax.random.normal(kk, (b, length, K, DH), jnp.float32)
    v = jax.random.normal(kv, (b, length, K, DH), jnp.float32)
    return q, k, v, jax.random.normal(kw, q.shape, jnp.float32)


def _segments(b, length):
    """Packed rows: documents of uneven lengths (prime-ish), so boundaries fall inside chunks."""
    rows = []
    for r in range(b):
        doc = 7 + 6 * r
        rows.append(np.arange(length) // doc + np.arange(length) // (3 * doc))
    return jnp.asarray(np.stack(rows).astype(np.int32))


def _reference(q, k, v, seg, window):
    mask = None if seg is None else seg[:, None, :, None] == seg[:, None, None, :]
    return attention_core(q, k, v, mask, None if window is None else (window, 0))


def _split(kind, mesh, zigzag, window, manual=("context",), tensor=False):
    """Whole-sequence q, k, v (and segment ids) -> attention computed with the sequence split over
    'context' (laid out, shard_map manual over `manual`, laid back). `tensor`: heads constrained
    over the auto 'tensor' axis inside, as the step's GSPMD does."""
    fn, c = KINDS[kind], mesh.shape["context"]
    batch = "data" if "data" in manual else None
    spec = P(batch, "context")

    def local(q, k, v, seg):
        if tensor:
            q = jax.lax.with_sharding_constraint(q, P(None, None, "tensor"))
            k = jax.lax.with_sharding_constraint(k, P(None, None, "tensor"))
            v = jax.lax.with_sharding_constraint(v, P(None, None, "tensor"))
        with use_rules(mesh, manual=manual):  # as the step's shard_map: 'tensor' left to GSPMD
            return fn(q, k, v, seg, axis="context", window=window, zigzag=zigzag)

    def attend(q, k, v, seg):
        idx = zigzag_index(q.shape[1], c) if zigzag else np.arange(q.shape[1])
        lay = lambda x: None if x is None else x[:, idx]
        f = jax.shard_map(
            local, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec, axis_names=set(manual), check_vma=False
        )
        return f(lay(q), lay(k), lay(v), lay(seg))[:, np.argsort(idx)]

    return attend


def _check(attend, q, k, v, w, seg, window):
    """Outputs and d(sum(out * w))/d(q, k, v) equal the one-device reference (fp32), one compile."""

    def with_grads(f):
        def run(q, k, v):
            out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, seg), q, k, v)
            return out, vjp(w)

        return run

    ref = lambda q, k, v, seg: _reference(q, k, v, seg, window)
    compiled = jax.jit(with_grads(attend)).lower(q, k, v).compile()
    (out, grads), (want, want_grads) = compiled(q, k, v), with_grads(ref)(q, k, v)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    # atol 2e-6: a few gradient elements are small differences of ~100 terms of size ~1 (float32
    # summation order differs from the reference's; measured worst 1.4e-6 at 0.005, c=4, L=512).
    for name, a, b in zip("qkv", grads, want_grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6, err_msg=f"d/d{name}")
    return compiled.as_text()


def test_zigzag_layout():
    np.testing.assert_array_equal(zigzag_index(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
    np.testing.assert_array_equal(zigzag_index(12, 3), [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7])
    assert sorted(zigzag_index(64, 4)) == list(range(64))
    mesh = _mesh((4,), ("context",))
    for zigzag in (False, True):
        f = jax.shard_map(
            lambda x, z=zigzag: local_index(x.shape[0], "context", z), mesh=mesh, in_specs=P("context"),
            out_specs=P("context"), check_vma=False,
        )  # fmt: skip
        want = zigzag_index(64, 4) if zigzag else np.arange(64)
        np.testing.assert_array_equal(f(jnp.zeros(64)), want)


CASES = [  # (c, length, packed, window, zigzag)
    pytest.param(2, 64, False, None, True, id="c2-L64"),
    pytest.param(4, 128, True, None, True, id="c4-L128-packed"),
    pytest.param(4, 512, True, 100, True, id="c4-L512-packed-window"),
    pytest.param(4, 128, True, 19, False, id="c4-L128-packed-window-contiguous"),
    pytest.param(8, 256, True, 37, True, id="c8-L256-packed-window", marks=pytest.mark.slow),
    pytest.param(8, 128, False, None, False, id="c8-L128-contiguous", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kind", ["ring", "allgather"])
@pytest.mark.parametrize(("c", "length", "packed", "window", "zigzag"), CASES)
def test_matches_one_device(kind, c, length, packed, window, zigzag):
    q, k, v, w = _inputs(length)
    seg = _segments(B, length) if packed else None
    _check(_split(kind, _mesh((c,), ("context",)), zigzag, window), q, k, v, w, seg, window)


@pytest.mark.parametrize("kind", ["ring", "allgather"])
def test_data_context_tensor_mesh(kind):
    """The step's arrangement: manual over {data, context}, heads over the auto 'tensor' axis."""
    mesh = _mesh((2, 2, 2), ("data", "context", "tensor"))
    q, k, v, w = _inputs(64, b=4, seed=1)
    attend = _split(kind, mesh, kind == "ring", 11, manual=("data", "context"), tensor=True)
    text = _check(attend, q, k, v, w, _segments(4, 64), 11)
    colls = collectives(text, dict(mesh.shape))
    # K/V (and dK/dV) travel with their heads still split over 'tensor': no tensor collective. (A
    # plain all_gather over the manual 'context' axis made the partitioner gather the heads over
    # 'tensor' first: `gather_kv` runs it manual over 'tensor' as well.)
    assert not [x for x in colls if "tensor" in x.axes]
    if kind == "ring":
        assert {x.dims for x in colls if x.op == "collective-permute"} == {((2, 32, 2, K // 2, DH),)}
    else:
        assert {x.dims for x in colls if x.op == "all-gather" and x.axes == ("context",)} >= {((2, 64, 2, K // 2, DH),)}
        assert {x.dims for x in colls if x.op == "reduce-scatter"} == {((2, 32, 2, K // 2, DH),)}


@pytest.mark.parametrize("kind", ["ring", "allgather"])
def test_bfloat16_runs_close(kind):
    """bf16 inputs: output in bf16, within bf16 rounding of the float32 reference."""
    q, k, v, _ = _inputs(64)
    attend = jax.jit(_split(kind, _mesh((2,), ("context",)), kind == "ring", None))
    out = attend(*(x.astype(jnp.bfloat16) for x in (q, k, v)), None)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), _reference(q, k, v, None, None), atol=5e-2)


# ---------------------------------------------------------------- compiled HLO


def _layers(h_BxLxD, ws, seg, attend, policy=None):
    """`len(ws)` scanned layers: a q/k/v projection, attention, a residual add."""

    def layer(h_BxLxD, w_DxKxGxDh):
        qkv = jnp.einsum("bld,dkgh->blkgh", h_BxLxD, w_DxKxGxDh)  # G + 2 "groups": q heads, k, v
        o = attend(qkv[:, :, :, :G], qkv[:, :, :, G], qkv[:, :, :, G + 1], seg)
        return h_BxLxD + o.reshape(h_BxLxD.shape), None

    return jax.lax.scan(layer if policy is None else jax.checkpoint(layer, policy=policy), h_BxLxD, ws)[0]


def _layers_inputs(c, n_layers, packed):
    length, d = 32 * c, K * G * DH
    h = jax.random.normal(jax.random.key(1), (B, length, d))
    ws = 0.1 * jax.random.normal(jax.random.key(0), (n_layers, d, K, G + 2, DH))
    return h, ws, _segments(B, length) if packed else None


@functools.cache
def _layers_reference(c, n_layers, packed):
    """d sum(sin(layers)) / d(h, ws) on one device, the whole sequence (no remat)."""
    h, ws, seg = _layers_inputs(c, n_layers, packed)
    whole = lambda q, k, v, seg: _reference(q, k, v, seg, None)
    return jax.jit(jax.grad(lambda h, ws: jnp.sum(jnp.sin(_layers(h, ws, seg, whole))), (0, 1)))(h, ws)


def _layers_grad_hlo(kind, c, n_layers, saved, packed=False):
    """Compiled HLO of the gradient of `n_layers` scanned layers (each a projection then context
    attention), each layer under jax.checkpoint saving only the names in `saved` (the step's remat).
    Runs it too: the gradients w.r.t. the input and the weights equal the same layers on one device
    (the sequence laid out for the ring, so its input gradient is compared laid back)."""
    length = 32 * c
    mesh = _mesh((c,), ("context",))
    policy = jax.checkpoint_policies.save_only_these_names(*saved)
    idx = zigzag_index(length, c) if kind == "ring" else np.arange(length)
    split = lambda q, k, v, seg: KINDS[kind](q, k, v, seg, axis="context")
    f = jax.shard_map(
        functools.partial(_layers, attend=split, policy=policy), mesh=mesh,
        in_specs=(P(None, "context"), P(), P(None, "context")), out_specs=P(None, "context"), check_vma=False,
    )  # fmt: skip
    h, ws, seg = _layers_inputs(c, n_layers, packed)
    laid = None if seg is None else seg[:, idx]
    compiled = jax.jit(jax.grad(lambda h, ws: jnp.sum(jnp.sin(f(h, ws, laid))), (0, 1))).lower(h[:, idx], ws).compile()
    dh, dws = compiled(h[:, idx], ws)
    want_dh, want_dws = _layers_reference(c, n_layers, packed)
    # Relative to each gradient's largest element: the weight gradient sums 2 x 128 tokens with
    # cancellation, so float32 summation order alone moves small elements (measured 7.5e-7 x max,
    # the all-gather kind as much as the ring).
    for got, want in ((dh[:, np.argsort(idx)], want_dh), (dws, want_dws)):
        assert float(jnp.max(jnp.abs(got - want))) <= 2e-6 * float(jnp.max(jnp.abs(want)))
    return compiled.as_text(), dict(mesh.shape), length // c


def _ops_per_step(colls, op):
    return sum(x.per_step for x in colls if x.op == op)


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_ring_hlo_permutes(packed):
    """Per layer: the forward ring's c - 1 K/V permutes; the backward ring's c - 1 K/V permutes
    plus c dK/dV permutes (c - 1 with the block, one to bring it home). K and V travel stacked as
    one array, dK and dV as one float32 array: one op each. Segment ids are all-gathered once,
    never permuted. Saving `ring_out`/`ring_lse` leaves the backward one conditional (half-block)
    per ring step; without them it also re-runs the forward ring's c - 1 conditionals, whose K/V
    permutes XLA merges with the backward ring's (same operands), so the permute count is equal."""
    c, n_layers = 4, 3
    per_layer = {}
    for saved in [(), ("ring_out", "ring_lse")]:
        text, shape, n = _layers_grad_hlo("ring", c, n_layers, saved, packed)
        colls = [x for x in collectives(text, shape) if x.op == "collective-permute"]
        assert _ops_per_step(colls, "collective-permute") == n_layers * ((c - 1) + (c - 1) + c)
        assert {x.axes for x in colls} == {("context",)}
        kv_bytes = B * n * 2 * K * DH * 4  # one K/V block, f32 (dK/dV accumulate in f32: the same bytes)
        assert {x.bytes for x in colls} == {kv_bytes}
        # Conditionals in the layer loops (XLA hoists the loop-invariant mask computations to the entry).
        mult, bodies = multiplicity(text), set(re.findall(r"\bbody=%?([\w.\-]+)", text))
        comps = computations(text)
        per_layer[saved] = sum(mult[b] * len(re.findall(r" conditional\(", comps[b])) for b in bodies) / n_layers
    assert per_layer == {(): 3 * (c - 1), ("ring_out", "ring_lse"): 2 * (c - 1)}


@pytest.mark.parametrize("saved", [("probs",), ("probs", "kv_gathered")])
def test_allgather_hlo_bytes(saved):
    """Per layer: one all-gather of K and V (stacked: c x the local K/V bytes) in the forward; in the
    backward its transpose, one reduce-scatter of dK, dV (the local bytes), and, unless the remat
    policy saves `kv_gathered`, a second all-gather (K/V re-gathered for the backward). The one
    all-reduce is the replicated weights' gradient over 'context'."""
    c, n_layers = 4, 2
    text, shape, n = _layers_grad_hlo("allgather", c, n_layers, saved)
    colls = collectives(text, shape)
    kv_local = B * n * 2 * K * DH * 4
    gathers = [x for x in colls if x.op == "all-gather"]
    scatters = [x for x in colls if x.op == "reduce-scatter"]
    (reduce,) = [x for x in colls if x.op == "all-reduce"]
    assert {x.op for x in colls} == {"all-gather", "reduce-scatter", "all-reduce"}
    assert {x.axes for x in colls} == {("context",)}
    assert {x.bytes for x in gathers} == {c * kv_local}
    assert {x.bytes for x in scatters} == {kv_local}
    assert reduce.bytes == n_layers * K * G * DH * K * (G + 2) * DH * 4 and reduce.per_step == 1
    assert _ops_per_step(scatters, "reduce-scatter") == n_layers
    assert _ops_per_step(gathers, "all-gather") == (1 if "kv_gathered" in saved else 2) * n_layers
