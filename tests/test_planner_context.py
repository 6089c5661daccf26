"""Planner with context parallelism (mesh.context = c): activation bytes, the K/V exchange's bytes
and time, all-gather vs ring, the search at long and short sequences, and bad `--evaluate` input.

Pure Python, no JAX. The numbers are the formulas written out by hand (Korthikanti et al. 2022's
count with s -> s/c; the all-gathered K/V 2 s b kv_heads head_dim / t), not read back from the code.
"""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshrun.config import RunConfig, from_dict, load_config
from meshrun.errors import ConfigError
from meshrun.planner import activations, kernels, search, step_model, timing
from meshrun.planner.cost import Layout, predict_memory
from meshrun.planner.hardware import COMM_EFFICIENCY, COMM_LATENCY_S, GPUS, parse_cluster
from meshrun.planner.layout import layout_of

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "configs" / "models"
S128K = 131072


@pytest.fixture(scope="module")
def llama70b():
    return load_config(MODELS / "llama-70b.yaml").model  # GQA: 64 heads, 8 kv heads; XLA attention


@pytest.fixture(scope="module")
def llama7b():
    return load_config(MODELS / "llama-7b.yaml").model


def flash(model):
    return dataclasses.replace(model, attention_impl="cudnn")


def run_cli(argv, capsys):
    from meshrun.cli.main import main

    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


# ----------------------------------------------------------------------------- activation memory


def korthikanti_none(m, b, s, t, c, act=2):
    """Megatron's no-recompute count (no dropout, SP) with the local s/c tokens and the all-gather
    kind's (s/c) x s scores and gathered K/V, written out tensor by tensor."""
    sl = s / c
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    repl = 4 * act * sl * b * m.d_model  # LN1 in, QKV in, LN2 in, MLP in
    split = act * sl * b * (q + 2 * kv) + act * sl * b * q + act * 3 * sl * b * m.d_ff  # Q K V, out-proj in, swiglu
    core = act * b * m.n_heads * sl * s  # softmax output, (s/c) x s per head
    gathered = act * 2 * s * b * kv if c > 1 else 0.0  # the whole sequence's K and V
    return (repl + split + core + gathered) / t


@pytest.mark.parametrize("c", [1, 2, 4, 8])
def test_activation_bytes_fall_as_one_over_c(llama70b, c):
    b, s, t = 1, 32768, 8
    kw = dict(sp=True, act=2, dropout=False, flash=False)
    for kind in ("allgather", "ring"):
        # selective: exactly 1/c of c = 1 (the ring scores blocks with an online softmax, keeping the
        # log-sum-exp of its queries as flash attention does)
        sel = activations.layer_activation_bytes(llama70b, b, s, t, remat="selective", context=c, kind=kind, **kw)
        like = dict(kw, flash=kind == "ring" and c > 1)
        base = activations.layer_activation_bytes(llama70b, b, s, t, remat="selective", **like)
        assert sel == pytest.approx(base / c, rel=1e-12)
        fl = dict(kw, flash=True)
        none_flash = activations.layer_activation_bytes(llama70b, b, s, t, remat="none", context=c, kind="ring", **fl)
        assert none_flash == pytest.approx(
            activations.layer_activation_bytes(llama70b, b, s, t, remat="none", **fl) / c
        )
    # all-gather on XLA attention: the (s/c) x s scores are 1/c of s x s too; the gathered K/V is not split
    got = activations.layer_activation_bytes(llama70b, b, s, t, remat="none", context=c, **kw)
    assert got == pytest.approx(korthikanti_none(llama70b, b, s, t, c), rel=1e-12)
    if c == 8:  # deterministic numbers: 70B-style layer, 32K tokens, TP 8 + SP
        assert got == pytest.approx(2_287_992_832 + 16_777_216, rel=1e-12)  # (s/c) x s scores: 94% of it
        ring = activations.layer_activation_bytes(llama70b, b, s, t, remat="none", context=c, kind="ring", **kw)
        sl = s // c
        assert got - ring == pytest.approx(
            (2 * 64 * sl * s - 4 * 64 * sl + 2 * 2 * s * 1024) / t, rel=1e-12
        )  # ring: no scores (an fp32 log-sum-exp per query and head), no gathered K/V


def test_step_memory_activations_and_logits_divide_by_c(llama70b):
    """meshrun's own step (full remat, no pipeline): kept layer inputs and logits fall as 1/c; the
    rebuilt layer's working set keeps the all-gather kind's (s/c) x s scores and gathered K/V."""
    s, lay = 65536, Layout(tensor=8, data=1, remat="full", sequence_parallel=True)
    one = step_model.predict_memory_jax(llama70b, lay, seq_len=s)
    for c in (2, 4, 8):
        got = step_model.predict_memory_jax(llama70b, dataclasses.replace(lay, context=c), seq_len=s)
        assert got["logits"] == pytest.approx(one["logits"] / c, rel=1e-12)
        kept = 2 * (s / c) * 8192 / 8 * 80  # each layer's input, bf16, SP over 8
        rebuilt = activations.autodiff_bytes(llama70b, 1, s, 8, act=2, flash=False, context=c)
        assert got["activations"] == pytest.approx(kept + rebuilt, rel=1e-12)
        assert got["activations"] < one["activations"] / c * 1.01


def test_zero_and_gradient_group_is_data_expert_context(llama70b):
    """ZeRO shards over data x expert x context (Megatron's dp x cp); the batch is split over data only."""
    base = Layout(tensor=8, data=2, microbatches=4, zero=1)
    cp = dataclasses.replace(base, context=4)
    assert cp.n_devices == 64 and cp.global_batch == base.global_batch == 8 and cp.grad_group == 8
    m1 = step_model.predict_memory_jax(llama70b, base, seq_len=8192)
    m4 = step_model.predict_memory_jax(llama70b, cp, seq_len=8192)
    # norm scales have no `embed` dimension: ZeRO leaves them whole (fp32 master, m, v + the update temporary)
    norms = 16 * (2 * llama70b.d_model * llama70b.n_layers + llama70b.d_model)
    assert m4["optimizer"] == pytest.approx((m1["optimizer"] - norms) / 4 + norms, rel=1e-12)
    assert m4["opt_elems"] * 4 == pytest.approx(m1["opt_elems"] + 3 * norms / 16, rel=1e-12)
    meg1 = predict_memory(llama70b, base, seq_len=8192, framework="megatron")
    meg4 = predict_memory(llama70b, cp, seq_len=8192, framework="megatron")
    assert meg4["optimizer"] == pytest.approx(meg1["optimizer"] / 4, rel=1e-12)
    comm = step_model.predict_collective_bytes(llama70b, cp, seq_len=8192)["bytes"]
    assert comm["context"] > 0 and comm["data"] == pytest.approx(comm["context"] - _context_kv_comm(llama70b, cp))


def _context_kv_comm(m, lay, s=8192):
    g = activations.context_kv_bytes(m, lay.micro_batch_size, s, lay.tensor, lay.context, act=2)
    layers, m_ = m.n_layers, lay.microbatches
    redo = lay.remat in ("full", "selective")
    return layers * m_ * (g * (1 + redo) + g / lay.context)


# ----------------------------------------------------------------------------- the K/V exchange


def test_allgather_bytes_and_seconds(llama70b):
    b, s, t, c = 1, S128K, 1, 8
    g = activations.context_kv_bytes(llama70b, b, s, t, c, act=2)
    assert g == 2 * S128K * 8 * 128 * 2 == 536_870_912  # K and V of 8 kv heads x 128, bf16
    assert activations.context_kv_bytes(llama70b, b, s, 8, c, act=2) == g / 8
    cluster = parse_cluster("h100-80g:2x8")
    nvlink = GPUS["h100-80g"].nvlink_bw / 2 * COMM_EFFICIENCY
    one = COMM_LATENCY_S + (c - 1) / c * g / nvlink  # per device: receive (c-1)/c of G
    cal = timing.CALIBRATION
    for remat in ("none", "selective", "full"):  # AG fwd + RS bwd + the backward's re-gather (measured: always)
        n = 3
        lay = Layout(tensor=t, data=2, context=c, remat=remat)
        assert timing.context_seconds(llama70b, lay, cluster, s, cal, 2.0) == pytest.approx(n * one, rel=1e-12)
    # t x c beyond a node: the group's ranks sit on different nodes, the NICs carry it
    wide = Layout(tensor=8, data=1, pipe=1, context=2, remat="none")
    g8 = g / 8
    nic = cluster.nic_bw_per_gpu * COMM_EFFICIENCY
    assert timing.context_seconds(llama70b, wide, cluster, s, cal, 2.0) == pytest.approx(
        3 * (COMM_LATENCY_S + g8 / 2 / nic), rel=1e-12
    )
    # the step's collective tally: AG result G per forward (and recompute), RS result G/c per backward,
    # beside the gradient reduction that 'context' shares with 'data'
    lay = Layout(tensor=1, data=2, context=8, remat="full")
    got = step_model.predict_collective_bytes(llama70b, lay, seq_len=s)["bytes"]
    assert got["context"] - got["data"] == pytest.approx(80 * (2 * g + g / 8), rel=1e-12)


def test_ring_vs_allgather(llama70b):
    m = flash(llama70b)
    gpu, cal = GPUS["h100-80g"], timing.CALIBRATION
    for c in (2, 4, 8):
        ag = kernels.attention_core_seconds(m, 1, S128K, 8, gpu, cal, flash=True, dropout=False, act=2, context=c)
        ring = kernels.attention_core_seconds(
            m, 1, S128K, 8, gpu, cal, flash=True, dropout=False, act=2, context=c, kind="ring"
        )
        whole = kernels.attention_core_seconds(m, 1, S128K, 8, gpu, cal, flash=True, dropout=False, act=2)
        assert ring[0] == pytest.approx(whole[0] / c, rel=1e-12)  # zigzag: the causal work split evenly
        assert ag[0] == pytest.approx(ring[0] * (2 * c - 1) / c, rel=1e-12)  # contiguous: the last shard's
    one_node = parse_cluster("h100-80g:1x8")
    lay = Layout(tensor=1, data=1, context=8, remat="none")
    ag_s = timing.context_seconds(m, lay, one_node, S128K, cal, 2.0)
    ring_s = timing.context_seconds(m, dataclasses.replace(lay, context_kind="ring"), one_node, S128K, cal, 2.0)
    assert 0 < ring_s < ag_s  # long blocks on NVLink: the ring's steps hide behind the block's attention
    # short blocks on a slow network: each ring step waits for its transfer (exposed = xfer - block compute)
    slow = parse_cluster("h100-80g:8x1,ib=1x100")
    lay = Layout(tensor=1, data=1, context=8, remat="none", context_kind="ring")
    s = 8 * 4096
    f, bwd = kernels.attention_core_seconds(
        m, 1, s, 1, slow.gpu, cal, flash=True, dropout=False, act=2, context=8, kind="ring"
    )
    block = activations.context_kv_bytes(m, 1, s, 1, 8, act=2) / 8
    xfer = COMM_LATENCY_S + block / slow.group_bw(8)
    assert xfer > f / 8
    assert timing.context_seconds(m, lay, slow, s, cal, 2.0) >= 7 * (xfer - f / 8)
    # memory: no (s/c) x s scores nor gathered K/V kept for the ring
    kw = dict(seq_len=S128K, overheads=True)
    ag_mem = predict_memory(llama70b, Layout(tensor=8, data=1, context=8, remat="none"), **kw)
    ring_mem = predict_memory(llama70b, Layout(tensor=8, data=1, context=8, remat="none", context_kind="ring"), **kw)
    assert ring_mem["activations"] < ag_mem["activations"] / 10


def test_search_picks_ring_for_flash_attention_and_both_kinds_are_tried(llama7b):
    cluster = parse_cluster("h100-80g:1x8")
    kinds = {(lay.context, lay.context_kind) for lay in search.candidates(llama7b, cluster, 4, S128K)}
    assert {(2, "allgather"), (2, "ring"), (8, "ring"), (1, "allgather")} <= kinds
    # Among the context-parallel layouts the ring kind wins. (Overall, TP8 with model.tp_comm_overlap's
    # rings, no context parallelism, is ahead: 26.01 s against CP2 ring's 26.62 s.)
    ranked = search.search(flash(llama7b), cluster, 4, S128K, top=50)
    best = [r for r in ranked if r.layout.context > 1]
    assert best[0].layout.context_kind == "ring" and not best[0].hard
    assert ranked[0].layout.tp_comm_overlap or ranked[0] is best[0]


# ----------------------------------------------------------------------------- the search


def test_search_proposes_cp_for_128k_that_does_not_fit_without(llama70b):
    """Llama-70B-style, 128K tokens x 32 sequences on 16 x 8 H100: without context parallelism no
    layout fits, not even with offloading (the host-offloaded activations would need 2.2 TB of host
    memory per node, more than a DGX H100's 2 TB); with it the best layout fits."""
    cluster = parse_cluster("h100-80g:16x8")
    with pytest.raises(ConfigError, match="fits on no layout"):
        search.search(llama70b, cluster, 32, S128K, top=3, max_context=1)
    roomy = parse_cluster("h100-80g:16x8,host=4TB")  # with the host memory, offloading proposals
    without = search.search(llama70b, roomy, 32, S128K, top=3, max_context=1)
    assert all(r.layout.context == 1 for r in without)
    assert all(any("offload" in v for v in r.violations) for r in without)
    best = search.search(llama70b, cluster, 32, S128K, top=3)
    top = best[0]
    assert top.layout.context > 1 and not top.hard
    assert not any("offload" in v for v in top.violations)
    assert top.memory["total"] <= cluster.usable_memory
    assert top.layout.n_devices == 128 and top.layout.global_batch == 32
    assert top.step_time < without[0].step_time * 1.05


def test_no_cp_at_short_sequences(llama7b):
    cluster = parse_cluster("h100-80g:2x8")
    assert all(lay.context == 1 for lay in search.candidates(llama7b, cluster, 64, 2048))
    best = search.search(llama7b, cluster, 64, 2048, top=5)
    assert all(r.layout.context == 1 for r in best)
    # CP starts where each device keeps MIN_CONTEXT_TOKENS of the sequence
    cs = {lay.context for lay in search.candidates(llama7b, cluster, 64, 2 * search.MIN_CONTEXT_TOKENS)}
    assert cs == {1, 2}


def test_context_one_is_unchanged(llama7b):
    cluster = parse_cluster("h100-80g:2x8")
    lay = Layout(tensor=8, pipe=1, data=2, microbatches=8, zero=1, remat="selective", sequence_parallel=True)
    a = search.evaluate(llama7b, lay, cluster, 16, 4096)
    b = search.evaluate(llama7b, dataclasses.replace(lay, context_kind="ring"), cluster, 16, 4096)
    assert a.step_time == b.step_time and a.memory["total"] == b.memory["total"]
    assert a.time["context_comm"] == 0


def test_structural_rules_for_context(llama7b):
    cluster = parse_cluster("h100-80g:2x8")
    bad = search.structural_violations(
        llama7b, Layout(tensor=8, context=2, context_kind="ring"), cluster, 1, seq_len=4098
    )
    assert any("not divisible by 2 x context" in v for v in bad)
    bad = search.structural_violations(llama7b, Layout(tensor=4, context=2, context_kind="rng"), cluster, 1, 4096)
    assert any("context_kind='rng'" in v for v in bad)
    r = search.evaluate(llama7b, Layout(tensor=8, context=2, context_kind="ring"), cluster, 1, S128K)
    assert any("tensor*context=16 > 8 GPUs per node" in v for v in r.violations)


def test_layout_of_reads_context():
    cfg = from_dict(
        RunConfig,
        {"mesh": {"data": 2, "context": 2, "tensor": 2}, "model": {"context_parallel": "ring"},
         "train": {"global_batch": 8}},
    )  # fmt: skip
    lay = layout_of(cfg, {"data": 2, "pipe": 1, "expert": 1, "context": 2, "tensor": 2})
    assert (lay.context, lay.context_kind, lay.n_devices, lay.micro_batch_size) == (2, "ring", 8, 4)
    lay = layout_of(from_dict(RunConfig, {"train": {"global_batch": 8}}), {"data": 2, "pipe": 1, "expert": 1,
                                                                           "tensor": 2})  # fmt: skip
    assert (lay.context, lay.context_kind) == (1, "allgather")


# ----------------------------------------------------------------------------- the CLI


def test_cli_evaluate_and_table(capsys):
    argv = ["--model", "llama-70b", "--cluster", "h100-80g:16x8", "--global-batch", "32", "--seq-len", str(S128K)]
    ev = "tensor=8,pipe=2,context=8,context_kind=ring,remat=full,sequence_parallel=true,zero=2"
    rc, out, err = run_cli([*argv, "--evaluate", ev], capsys)
    assert rc == 0, err
    assert " 8 ring " in out and "context_comm" in out
    rc, out, err = run_cli([*argv, "--evaluate", ev, "--json"], capsys)
    (cfg,) = json.loads(out)["configs"]
    assert (cfg["context"], cfg["context_kind"], cfg["data"]) == (8, "ring", 1)
    assert cfg["time_parts_s"]["context_comm"] > 0


@pytest.mark.parametrize(
    "ev,frag",
    [
        ("tensor=100000", "--evaluate tensor: too large (got 100000)"),
        ("tensor=8,pipe=16,data=16", "product is not the device count (got 2048)"),
        ("tensor=8,context=3", "--evaluate tensor*context: does not divide the device count (got 24)"),
        ("tensor=8,context=256", "--evaluate context: too large"),
        ("tensor=8,context=2,context_kind=rign", "did you mean 'ring'"),
        ("tensor=8,context=4,context_kind=ring", "not divisible by 2 x context"),
        ("microbatches=99999999999", "--evaluate microbatches: too large"),
    ],
)
def test_bad_evaluate_exits_2(ev, frag, capsys):
    argv = ["--model", "llama-70b", "--cluster", "h100-80g:16x8", "--global-batch", "32", "--seq-len", "131068"]
    rc, out, err = run_cli([*argv, "--evaluate", ev], capsys)
    assert rc == 2 and frag in err and "Traceback" not in err and out == ""
    assert len(err.strip().splitlines()) == 1


def test_bad_evaluate_subprocess_exit_2():
    cmd = [sys.executable, "-m", "meshrun.cli.main", "plan", "--model", "llama-70b", "--cluster", "h100-80g:16x8",
           "--global-batch", "32", "--evaluate", "tensor=100000,pipe=4"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--evaluate tensor" in proc.stderr and "100000" in proc.stderr and "divides the 128 devices" in proc.stderr


def test_parse_evaluate_errors_name_the_field(llama7b):
    from meshrun.cli.plan import parse_evaluate

    cluster = parse_cluster("h100-80g:2x8")
    lay = parse_evaluate("tensor=4,context=2", llama7b, cluster, 8, 8192)
    assert (lay.data, lay.context, lay.n_devices, lay.global_batch) == (2, 2, 16, 8)
    with pytest.raises(ConfigError) as e:
        parse_evaluate("tensor=4,context=3", llama7b, cluster, 8, 8192)
    assert e.value.field == "--evaluate tensor*context" and e.value.value == 12
