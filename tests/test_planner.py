"""Planner: the seed's numbers (corrected), Megatron's measured runs (leave-one-out), search, rules, bad input.

Pure Python, no JAX: the cost model is arithmetic, so these tests pin exact formulas where the
literature gives them and measured numbers (with the stated band) where it does not.
"""

import dataclasses
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from meshrun_models.llama.config import LlamaConfig

from meshrun.analysis import flops
from meshrun.config import ModelConfig, load_config
from meshrun.errors import ConfigError
from meshrun.planner import calibrate, cost, search, timing
from meshrun.planner.cost import Layout
from meshrun.planner.hardware import GB, parse_cluster

MEGA = dict(framework="megatron")
LAYOUT_FIELDS = {f.name for f in dataclasses.fields(cost.Layout)}


def predict_memory(model, **kw):
    """`cost.predict_memory` with the layout given field by field (remat and sequence parallelism: the
    model's unless given)."""
    lay = cost.model_layout(model, **{k: v for k, v in kw.items() if k in LAYOUT_FIELDS})
    return cost.predict_memory(model, lay, **{k: v for k, v in kw.items() if k not in LAYOUT_FIELDS})


ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "configs" / "models"
GPT3 = MODELS / "gpt3-175b.yaml"


@pytest.fixture(scope="module")
def gpt3() -> ModelConfig:
    return load_config(GPT3).model


def run_cli(argv, capsys):
    from meshrun.cli.main import main

    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


# ----------------------------------------------------------------------------- the seed, corrected


def test_gpt3_per_layer_params_and_tp8_bytes(gpt3):
    h = 12288
    per_layer = cost.layer_params(gpt3)
    assert per_layer == pytest.approx(12 * h**2, rel=1e-3)
    assert per_layer == pytest.approx(1.81e9, rel=2e-3)  # not the seed's "138M"
    fp16_per_gpu_tp8 = per_layer * 2 / 8
    assert fp16_per_gpu_tp8 == pytest.approx(453e6, rel=2e-3)  # not "34.5 MB"
    assert cost.param_counts(gpt3)["total"] == pytest.approx(174.6e9, rel=1e-3)


def test_dp_degree_and_global_batch(gpt3, capsys):
    cluster = parse_cluster("a100-80g:128x8")
    from meshrun.cli.plan import parse_evaluate

    plan = parse_evaluate("tensor=8,pipe=16", gpt3, cluster, 1536)
    assert plan.data == 8  # 1024 / (8 * 16), not the seed's 112
    assert plan.microbatches == 192 and plan.global_batch == 1536
    # global batch = micro_batch_size x m x DP; PP does not multiply it (the seed's "64x16x8x4" is wrong).
    p = Layout(tensor=8, pipe=16, data=8, microbatches=64, micro_batch_size=1)
    assert p.global_batch == 512
    bad = search.structural_violations(gpt3, p, cluster, 64 * 16 * 8 * 4)
    assert any("global batch 32768" in v and "= 512" in v for v in bad)


def test_model_states_bytes_per_param(gpt3):
    # Megatron: bf16 params 2 + fp32 gradient buffers 4 + (4 master + 8 Adam) = 18 B/param.
    prec = cost.precision_of(gpt3, "megatron")
    assert (prec.param, prec.grad, prec.opt) == (2, 4, 12)
    psi = cost.param_counts(gpt3)["total"]
    mem = predict_memory(gpt3, seq_len=2048, remat="full", **MEGA)
    states = mem["params"] + mem["grads"] + mem["optimizer"]
    assert states == pytest.approx(18 * psi, rel=1e-9)
    assert states * 16 / 18 == pytest.approx(2.8e12, rel=0.01)  # the seed's 2.8 TB at 16 B/param
    # meshrun: grads in the param dtype, fp32 master + Adam m, v (12 B, as Megatron); + the float32
    # update temporary. With m > 1 the float32 sums, into which the backward's layer loop adds each
    # layer's gradient in place: fresh bf16 gradients are one layer's and the embedding/head's.
    assert cost.precision_of(gpt3) == cost.Precision(param=2, grad=2, opt=12, act=2)
    one = predict_memory(gpt3, seq_len=2048, remat="full")
    acc = predict_memory(gpt3, seq_len=2048, remat="full", microbatches=4)
    assert one["params"] + one["grads"] + one["optimizer"] == pytest.approx(20 * psi, rel=1e-3)
    c = cost.param_counts(gpt3)
    fresh = c["embedding"] + c["head"] + gpt3.d_model + c["layers"] / gpt3.n_layers
    assert acc["grads"] == pytest.approx(4 * psi + 2 * fresh, rel=1e-3)  # zero.accum_zeros: fp32 sums
    assert acc["grads"] < 4.05 * psi


@pytest.mark.parametrize("zero,expect", [(0, lambda d: 18), (1, lambda d: 6 + 12 / d), (2, lambda d: 2 + 16 / d)])
def test_zero_stage_formulas(gpt3, zero, expect):
    psi = cost.param_counts(gpt3)["total"]
    for d in (2, 8, 64):
        mem = predict_memory(gpt3, data=d, zero=zero, seq_len=2048, **MEGA)
        assert mem["params"] + mem["grads"] + mem["optimizer"] == pytest.approx(expect(d) * psi, rel=1e-9)


def test_meshrun_vs_megatron_zero_semantics(gpt3):
    """meshrun's ZeRO-1 and ZeRO-2 once per step accumulate locally and reduce once per step (the accumulator is
    full size during the loop); ZeRO-2 per microbatch (auto for this model) keeps the layers' (and, without a
    pipeline, the embedding's and head's) float32 sums as 1/DP shards, as DeepSpeed ZeRO-2 does. ZeRO-3 gathered
    once per step holds every weight; per layer (auto here) the embedding/head, a layer and the weight in use."""
    c = cost.param_counts(gpt3)
    psi = c["total"]
    kw = dict(seq_len=2048, data=8, microbatches=4)
    z0, z1, z3 = (predict_memory(gpt3, zero=z, **kw) for z in (0, 1, 3))
    z2s = predict_memory(gpt3, zero=2, zero2_reduce="step", **kw)
    z2 = predict_memory(gpt3, zero=2, **kw)
    assert z1["grads"] == pytest.approx(z0["grads"], rel=1e-9) == pytest.approx(z2s["grads"], rel=1e-9)
    edges = c["embedding"] + c["head"] + gpt3.d_model
    layer = c["layers"] / gpt3.n_layers
    # fresh: one layer's and the embedding/head's gradient in bf16; sums: float32, 1/8 of the layers' and
    # (no pipeline) of the embedding's and head's, the final norm's whole
    sums = (edges - gpt3.d_model) / 8 + gpt3.d_model + c["layers"] / 8
    assert z2["grads"] == pytest.approx(2 * (edges + layer) + 4 * sums, rel=1e-3)
    # fp32 master, m, v and the fp32 update temporary, all sharded over data
    assert z1["optimizer"] == pytest.approx(16 * psi / 8, rel=1e-3)
    z3s = predict_memory(gpt3, zero=3, zero3_gather="step", **kw)
    assert z3s["params"] == pytest.approx(2 * psi / 8 + 2 * psi, rel=1e-3)  # all weights gathered before the loop
    # per layer: the embedding/head, the next layer's gather in flight, and the weight in use (the MLP's
    # input projection, gathered and its transposed copy) with its backward's three cotangents
    assert z3["params"] == pytest.approx(2 * psi / 8 + 2 * (edges + layer), rel=1e-3)
    pair, cotangent = gpt3.d_model * gpt3.d_ff, 2048 * gpt3.d_ff  # gelu: fc1; one sequence per microbatch
    assert z3["working"] == pytest.approx(2 * 2 * pair + 3 * 2 * cotangent, rel=1e-9)
    cluster = parse_cluster("a100-80g:8x8")
    lay = Layout(tensor=8, pipe=1, data=8, microbatches=4, zero=2, zero2_reduce="step")
    mesh = timing.predict_time(gpt3, lay, cluster, 2048)
    mega = timing.predict_time(gpt3, lay, cluster, 2048, **MEGA)
    assert mesh["zero_comm"] == 0 < mesh["dp_sync"]
    assert mega["zero_comm"] > 0 and mega["dp_sync_full"] > mesh["dp_sync_full"]  # per micro-batch, fp32
    per_mb = timing.predict_time(gpt3, dataclasses.replace(lay, zero2_reduce="microbatch"), cluster, 2048)
    assert per_mb["dp_sync_full"] == pytest.approx(mega["dp_sync_full"], rel=1e-9)  # DeepSpeed's traffic


def test_hierarchical_allreduce_and_network():
    c = parse_cluster("a100-80g:4x8,ib=4x200")
    assert str(c) == "a100-80g:4x8,ib=4x200" and c.nic_bw_per_gpu == pytest.approx(4 * 200e9 / 8 / 8)
    assert parse_cluster("a100-80g:4x8").nic_bw_per_gpu == pytest.approx(25e9)
    assert c.split_group(32, 1) == (8, 4) and c.split_group(4, 8) == (1, 4) and c.split_group(8, 2) == (4, 2)
    nbytes, eff = 1e9, 0.8
    inside = c.allreduce_seconds(nbytes, 8)
    assert inside == pytest.approx(1e-5 + 2 * 7 / 8 * nbytes / (300e9 * eff))
    both = c.allreduce_seconds(nbytes, 32)
    inter = 2 * 3 / 4 * (nbytes / 8) / (c.nic_bw_per_gpu * eff)
    assert both == pytest.approx(inside + inter)
    pcie = parse_cluster("a100-80g-pcie:1x8")
    assert pcie.group_bw(8) == pytest.approx(32e9 * eff)


def test_zero3_shards_everything(gpt3):
    psi = cost.param_counts(gpt3)["total"]
    mem = predict_memory(gpt3, data=64, zero=3, seq_len=2048, **MEGA)
    assert mem["grads"] + mem["optimizer"] == pytest.approx(16 * psi / 64, rel=1e-9)
    gather = 2 * 2 * cost.layer_params(gpt3)  # two layers of bf16 weights gathered at a time
    assert mem["params"] == pytest.approx(2 * psi / 64 + gather, rel=1e-9)


@pytest.mark.parametrize("p,m,expect", [(24, 8, 23 / 31), (16, 192, 15 / 207), (1, 4, 0.0)])
def test_bubble_fraction(gpt3, p, m, expect):
    cluster = parse_cluster("a100-80g:128x8")
    tm = timing.predict_time(gpt3, Layout(pipe=p, microbatches=m), cluster, 2048)
    assert tm["bubble_fraction"] == pytest.approx(expect, abs=1e-12)
    if (p, m) == (24, 8):
        assert tm["bubble_fraction"] == pytest.approx(0.742, abs=1e-3)  # the seed's 74%


@pytest.mark.parametrize("p", [2, 4, 8, 16, 24])
def test_bubble_at_m_equals_4p(gpt3, p):
    cluster = parse_cluster("a100-80g:128x8")
    tm = timing.predict_time(gpt3, Layout(pipe=p, microbatches=4 * p), cluster, 2048)
    assert tm["bubble_fraction"] == pytest.approx((p - 1) / (5 * p - 1), abs=1e-12)
    if p >= 8:
        assert tm["bubble_fraction"] > 0.175  # still ~19% for large p: m = 4p is not "no bubble"
    busy = sum(tm[k] for k in ("compute", "tensor_comm", "pipe_comm", "expert_comm", "zero_comm"))
    assert tm["bubble"] / (tm["bubble"] + busy) == pytest.approx(tm["bubble_fraction"], rel=1e-9)
    v = 4
    tm = timing.predict_time(gpt3, Layout(pipe=p, microbatches=4 * p, virtual=v, schedule="interleaved"), cluster, 2048)
    assert tm["bubble_fraction"] == pytest.approx((p - 1) / (v * 4 * p + p - 1), abs=1e-12)
    zb = timing.predict_time(gpt3, Layout(pipe=p, microbatches=4 * p, schedule="zb-h1"), cluster, 2048)
    assert zb["bubble_fraction"] == pytest.approx((p - 1) / (3 * 4 * p + p - 1), abs=1e-12)
    one = timing.predict_time(gpt3, Layout(pipe=p, microbatches=4 * p), cluster, 2048)
    assert zb["compute"] == one["compute"] and zb["bubble"] == pytest.approx(one["bubble"] / 3, rel=1e-9)
    busy = sum(zb[k] for k in ("compute", "tensor_comm", "pipe_comm", "expert_comm", "zero_comm"))
    assert zb["bubble"] / (zb["bubble"] + busy) == pytest.approx(zb["bubble_fraction"], rel=1e-9)


# ----------------------------------------------------------------------------- formulas


def test_flops_match_megatron(gpt3):
    B, s, L, h, V = 1536, 2048, 96, 12288, 51200
    no_remat = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
    full = 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    assert flops.model_flops(gpt3, B, s) == pytest.approx(no_remat, rel=1e-12)
    assert flops.hardware_flops(gpt3, B, s, "none") == pytest.approx(no_remat, rel=1e-12)
    assert flops.hardware_flops(gpt3, B, s, "full") == pytest.approx(full, rel=1e-12)
    sel = no_remat + L * 4 * B * s * s * h  # selective recomputes QK^T and A.V only
    assert flops.hardware_flops(gpt3, B, s, "selective") == pytest.approx(sel, rel=1e-12)


def test_activation_bytes_match_korthikanti(gpt3):
    s, b, h, a = 2048, 1, 12288, 96
    sbh = s * b * h
    kw = dict(act=2, dropout=True, flash=False)
    one = cost.layer_activation_bytes(gpt3, b, s, 1, sp=False, remat="none", **kw)
    assert one == pytest.approx(sbh * (34 + 5 * a * s / h), rel=1e-12)
    for t in (2, 4, 8):
        tp = cost.layer_activation_bytes(gpt3, b, s, t, sp=False, remat="none", **kw)
        assert tp == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)
        sp = cost.layer_activation_bytes(gpt3, b, s, t, sp=True, remat="none", **kw)
        assert sp == pytest.approx(sbh / t * (34 + 5 * a * s / h), rel=1e-12)
        sel = cost.layer_activation_bytes(gpt3, b, s, t, sp=True, remat="selective", **kw)
        assert sel == pytest.approx(sbh / t * 34, rel=1e-12)


def test_full_remat_keeps_2sbh_per_layer_and_1f1b_holds_p_microbatches(gpt3):
    s, h, t, p = 2048, 12288, 8, 16
    common = dict(tensor=t, pipe=p, data=8, seq_len=s, dropout=True, zero=0, sequence_parallel=False, **MEGA)
    a = predict_memory(gpt3, microbatches=64, remat="full", **common)
    b = predict_memory(gpt3, microbatches=192, remat="full", **common)
    assert a["activations"] == b["activations"]  # 1F1B: peak does not grow with m
    working = cost.layer_activation_bytes(gpt3, 1, s, t, sp=False, remat="none", act=2, dropout=True, flash=False)
    embed = p * s * h * 3  # embedding output (bf16) + dropout mask, p micro-batches in flight
    assert a["activations"] == pytest.approx(96 / p * 2 * s * h * p + working + embed, rel=1e-12)
    g = predict_memory(gpt3, microbatches=64, remat="full", schedule="gpipe", **common)
    assert g["activations"] - working == pytest.approx((a["activations"] - working) * 64 / p, rel=1e-12)


def test_fp32_cpu_mode_bytes_per_param():
    tiny = LlamaConfig()  # the tiny CPU config: float32 params and compute, no master copy
    for fw in ("megatron", "meshrun"):
        prec = cost.precision_of(tiny, fw)
        assert (prec.param, prec.opt, prec.act) == (4, 8, 4)
    psi = cost.param_counts(tiny)["total"]
    mem = predict_memory(tiny, micro_batch_size=2, seq_len=64, remat="none", **MEGA)
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (4 * psi, 4 * psi, 8 * psi)
    assert mem["total"] == pytest.approx(sum(mem[k] for k in ("params", "grads", "optimizer", "activations", "logits")))
    assert mem["logits"] == 64 * 2 * tiny.vocab * (4 + 4) + 4 * 64 * 2 * tiny.d_model


def test_memory_overheads_and_stage_breakdown(gpt3):
    kw = dict(tensor=8, pipe=16, data=8, microbatches=192, seq_len=2048, remat="full", **MEGA)
    bare = predict_memory(gpt3, **kw)
    full = predict_memory(gpt3, **kw, overheads=True)
    assert set(full["stages"]) == {"first", "middle", "last"}
    first = full["stages"]["first"]
    frag = cost.FRAGMENTATION * (first["activations"] + first["logits"])
    assert first["overheads"] == pytest.approx(cost.CUDA_CONTEXT_BYTES + 3 * cost.COMM_BUFFER_BYTES + frag)
    assert full["total"] - bare["total"] == pytest.approx(first["overheads"])  # 1F1B: stage 0 is fullest
    assert full["stages"]["last"]["logits"] > 0 == full["stages"]["first"]["logits"]
    # Dropout masks: one byte per masked element (Korthikanti 2022's 34 vs 2 x 11 + 2 x 5 + ...).
    drop = predict_memory(gpt3, **kw, dropout=True)
    assert drop["activations"] > bare["activations"]


def test_moe_expert_params_divided_by_ep():
    mix = load_config(MODELS / "mixtral-8x7b.yaml").model
    counts = cost.param_counts(mix)
    assert counts["total"] == pytest.approx(46.7e9, rel=5e-3)
    one = predict_memory(mix, data=8, expert=1, seq_len=4096, **MEGA)
    eight = predict_memory(mix, data=1, expert=8, seq_len=4096, **MEGA)
    assert one["params"] - eight["params"] == pytest.approx(2 * counts["experts"] * (1 - 1 / 8), rel=1e-9)


# ----------------------------------------------------------------------------- Megatron's measured runs


def test_evaluate_megatron_gpt3_175b(capsys):
    argv = ["--model", str(GPT3), "--cluster", "a100-80g:128x8,ib=8x200", "--global-batch", "1536", "--seq-len", "2048"]
    ev = "tensor=8,pipe=16,data=8,micro_batch_size=1,remat=full,sequence_parallel=false,zero=0"
    rc, out, err = run_cli([*argv, "--framework", "megatron", "--dropout", "0.1", "--evaluate", ev, "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    (cfg,) = doc["configs"]
    assert (cfg["tensor"], cfg["pipe"], cfg["data"], cfg["microbatches"]) == (8, 16, 8, 192)
    assert abs(cfg["tflops_per_device"] - 138) <= 0.10 * 138, cfg["tflops_per_device"]
    assert cfg["violations"] == []
    assert cfg["memory_gb"] < 80
    assert set(cfg["memory_stages_gb"]) == {"first", "middle", "last"} and cfg["layers_per_stage"] == [6] * 16
    assert cfg["bubble_fraction"] == pytest.approx(15 / 207, abs=1e-4)
    # MFU counts model FLOPs only: below the hardware-FLOP utilisation by the recompute share (3/4).
    hfu = cfg["tflops_per_device"] / 312
    model = load_config(GPT3).model
    share = flops.model_flops(model, 1536, 2048) / flops.hardware_flops(model, 1536, 2048, "full")
    assert cfg["mfu"] == pytest.approx(hfu * share, rel=1e-3)
    rc, text, _ = run_cli([*argv, "--framework", "megatron", "--evaluate", ev], capsys)
    assert rc == 0 and "first (0)" in text and "middle (8)" in text and "last (15)" in text


def test_calibration_is_the_fit_and_leave_one_out():
    """Every Table 1 row, predicted by a calibration fitted on the other nine, is within +-15%;
    the mean |error| is at most 8% (the table in docs/benchmarks.md)."""
    assert calibrate.fit_calibration() == timing.CALIBRATION
    loo = calibrate.leave_one_out()
    assert len(loo) == 10
    for size, measured, pred, err in loo:
        assert abs(err) <= 0.15, (size, measured, pred)
    assert sum(abs(e) for *_, e in loo) / len(loo) <= 0.08
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert calibrate.loo_table() in page


def test_gemm_efficiency_depends_on_shape():
    from meshrun.planner.hardware import GPUS
    from meshrun.planner.kernels import gemm_seconds

    a100, cal = GPUS["a100-80g"], timing.CALIBRATION

    def eff(m, n, k):
        return 2 * m * n * k / gemm_seconds(m, n, k, a100, cal) / a100.peak_flops

    assert eff(8192, 8192, 8192) > 0.7 > eff(2048, 1536, 12288)  # whole waves vs 1.8 waves of tiles
    assert eff(2048, 2048, 64) < 0.5  # thin inner dimension: memory bound
    nbytes = 2 * (2048 * 64 * 2 + 2048 * 2048)
    assert gemm_seconds(2048, 2048, 64, a100, cal) == pytest.approx(nbytes / (a100.hbm_bw * cal.hbm))
    assert eff(2048, 4608, 12288) == pytest.approx(cal.gemm * 288 / 324, rel=1e-6)  # 288 tiles in 3 waves of 108


def test_top_plan_175b(gpt3, capsys):
    rc, out, err = run_cli(["--model", str(GPT3), "--cluster", "a100-80g:128x8", "--global-batch", "1536",
                            "--seq-len", "2048", "--top", "5", "--json"], capsys)  # fmt: skip
    assert rc == 0, err
    configs = json.loads(out)["configs"]
    assert len(configs) == 5
    best = configs[0]
    assert best["tensor"] <= 8 and best["bubble_fraction"] < 0.10 and best["violations"] == []
    assert best["memory_gb"] <= 80
    assert [c["step_time_s"] for c in configs] == sorted(c["step_time_s"] for c in configs)
    for c in configs:
        assert c["tensor"] * c["pipe"] * c["data"] * c["expert"] == 1024
        assert c["micro_batch_size"] * c["microbatches"] * c["data"] * c["expert"] == 1536
    # The search is exhaustive (each layout is arithmetic, well under a millisecond), so the number of
    # candidates bounds its run time without a wall clock.
    n = sum(1 for _ in search.candidates(gpt3, parse_cluster("a100-80g:128x8"), 1536))
    assert n <= 10_000, n


def test_human_table(capsys):
    rc, out, _ = run_cli(["--model", "gpt3-175b", "--cluster", "a100-80g:128x8", "--top", "3"], capsys)
    assert rc == 0
    assert "TFLOP/s" in out and "MFU" in out and "bubble" in out
    assert len([ln for ln in out.splitlines() if re.match(r"^\s+[123]\s+\d", ln)]) == 3


# ----------------------------------------------------------------------------- rules


def test_rules_are_reported_with_numbers(gpt3):
    cluster = parse_cluster("a100-80g:128x8")
    r = search.evaluate(gpt3, Layout(tensor=16, pipe=8, data=8, microbatches=192), cluster, 1536, 2048)
    assert r.hard and any("tensor=16 > 8 GPUs per node" in v for v in r.violations)
    r = search.evaluate(
        gpt3, Layout(tensor=8, pipe=16, data=8, microbatches=8, micro_batch_size=24), cluster, 1536, 2048
    )
    assert any("microbatches=8 < 4*pipe=64: pipeline bubble 65.2%" in v for v in r.violations)
    assert any(re.search(r"memory [\d.]+ GB on stage 0 > 80.0 GB of a100-80g", v) for v in r.violations)
    r = search.evaluate(gpt3, Layout(tensor=8, pipe=1, data=128, microbatches=12), cluster, 1536, 2048)
    assert any("memory" in v for v in r.violations)
    small = load_config(MODELS / "megatron-1.7b.yaml").model
    slow_net = parse_cluster("a100-80g:128x8,ib=1x100")  # one 100 Gb/s NIC per node
    r = search.evaluate(small, Layout(tensor=1, pipe=1, data=1024, microbatches=1), slow_net, 1024, 2048)
    assert any(re.search(r"data-parallel gradient sync [\d.]+ s > compute [\d.]+ s", v) for v in r.violations)
    llama = load_config(MODELS / "llama-70b.yaml").model
    r = search.evaluate(llama, Layout(tensor=5, pipe=48, data=2, expert=2, virtual=2), cluster, 7, 4096)
    text = " | ".join(r.violations)
    for frag in (
        "n_heads=64 is not divisible by tensor=5",
        "n_kv_heads=8",
        "n_layers=80 < pipe*virtual=96",
        "expert=2 > 1 on a dense model",
        "= 960 != 1024 devices",
        "global batch 7",
    ):
        assert frag in text


# ----------------------------------------------------------------------------- bad input


def test_bad_cluster_strings():
    with pytest.raises(ConfigError) as e:
        parse_cluster("v100:16x8")
    assert e.value.field == "--cluster" and "a100-80g" in e.value.fix and "h200" in e.value.fix
    for bad in ("a100-80g", "a100-80g:128", "a100-80g:0x8", "a100-80g:8*8", ""):
        with pytest.raises(ConfigError) as e:
            parse_cluster(bad)
        assert e.value.field == "--cluster" and e.value.value == bad


def test_model_that_fits_nowhere_says_smallest_memory(gpt3):
    # a node with 512 GB of host memory: with 2 TB (the DGX default) offload.params with the
    # state on NVMe fits it (test_planner_params); here its bf16 params and fp32 gradients (1.05 TB) do not
    with pytest.raises(ConfigError) as e:
        search.search(gpt3, parse_cluster("a100-80g:1x8,host=512GB"), 64, 2048, name="gpt3-175b")
    assert "host memory 1045 GB per node > 461 GB usable of 512 GB" in str(e.value), e.value
    need = float(re.search(r"at least ([\d.]+) GB", str(e.value)).group(1))
    psi = cost.param_counts(gpt3)["total"]
    # meshrun's model states, spread over 8 GPUs: bf16 params 2, the fp32 gradient sums 4, fp32 master,
    # Adam m, v 12 + the fp32 update temporary 4; the smallest layout is a per-op pipeline, whose fresh
    # bf16 gradients are one layer's (W adds in place), not a whole stage's (+2 per parameter)
    assert 22 * psi / 8 <= need * GB < 24 * psi / 8
    assert e.value.field == "--model"


def test_layout_that_fits_nowhere_keeps_its_smallest_variant(gpt3):
    """Where no executor variant of a layout fits, the search keeps the one needing the least memory
    (the figure "fits on no layout" quotes), not the fastest: on 4 x 8 A100 GPT-3 175B's TP1 PP2 1F1B
    layouts break the memory rule on both executors, and on some the per-op one is faster but larger."""
    cluster = parse_cluster("a100-80g:4x8,host=256GB")
    seen = 0
    for lay in search.candidates(gpt3, cluster, 64, 2048, 1, "meshrun"):
        if (lay.tensor, lay.pipe, lay.schedule, lay.chunks) != (1, 2, "1f1b", 1):
            continue
        variants = [search.evaluate(gpt3, dataclasses.replace(lay, executor=ex), cluster, 64, 2048)
                    for ex in lay.sched.executors]  # fmt: skip
        assert len(variants) == 2 and all(r.hard for r in variants)
        fastest = min(variants, key=lambda r: r.step_time)
        smallest = min(variants, key=lambda r: r.memory["total"])
        if fastest.memory["total"] == smallest.memory["total"]:
            continue
        kept = search._best_executor(gpt3, lay, cluster, 64, 2048, {})
        assert kept.memory["total"] == smallest.memory["total"] < fastest.memory["total"]
        seen += 1
        if seen == 3:
            break
    assert seen == 3  # the case this test is about exists


@pytest.mark.parametrize(
    "argv,frag",
    [
        (["--cluster", "v100:16x8"], "--cluster: unknown GPU 'v100'"),
        (["--cluster", "a100-80g"], "--cluster: malformed cluster"),
        (["--cluster", "a100-80g:1x8,host=512GB"], "it needs at least"),
        (["--cluster", "a100-80g:128x8", "--evaluate", "tensr=8"], "did you mean 'tensor'"),
        (["--cluster", "a100-80g:128x8", "--evaluate", "remat=some"], "--evaluate remat"),
        (["--cluster", "a100-80g:128x8", "--framework", "deepspeed"], "--framework: invalid value"),
        (["--cluster", "a100-80g:128x8", "--dropout", "0.1"], "--dropout"),
        (["--cluster", "a100-80g:128x8,ib=4"], "--cluster: malformed network"),
        (["--cluster", "a100-80g:128x8,nvl=4"], "--cluster: unknown field 'nvl=4'"),
    ],
)
def test_cli_errors_exit_2(argv, frag, capsys):
    rc, out, err = run_cli(["--model", "gpt3-175b", "--global-batch", "1536", *argv], capsys)
    assert rc == 2 and frag in err and "Traceback" not in err and out == ""


def test_cli_subprocess_exit_2():
    cmd = [sys.executable, "-m", "meshrun.cli.main", "plan", "--model", str(GPT3), "--cluster", "tpu:4x4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert "--cluster" in proc.stderr and "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- configs


MEGATRON_SIZES = {"1.7b": 1.7, "3.6b": 3.6, "7.5b": 7.5, "18b": 18.4, "39b": 39.1, "76b": 76.1, "145b": 145.6,
                  "310b": 310.1, "530b": 529.6, "1t": 1008.0}  # fmt: skip


def test_cached_counts_are_the_callers_own(gpt3):
    """param_counts is cached for the search: each call still returns a dict of its own, and
    precision_of's cache keys on every field it reads (the optimizer's state bytes per layout)."""
    counts = cost.param_counts(gpt3)
    counts["total"] = 0
    assert cost.param_counts(gpt3)["total"] == pytest.approx(175e9, rel=0.01)
    adam, muon = (cost.precision_of(gpt3, layout=Layout(optimizer=o)) for o in ("adamw", "muon"))
    assert adam.opt != muon.opt and cost.precision_of(gpt3, layout=Layout(optimizer="adamw")) == adam
    assert cost.precision_of(gpt3, layout=Layout(grad_reduce_dtype="bfloat16")).reduce == 2 != adam.reduce


@pytest.mark.parametrize("path", sorted(MODELS.glob("*.yaml")), ids=lambda p: p.stem)
def test_model_configs_load(path):
    cfg = load_config(path)
    n = cost.param_counts(cfg.model)["total"] / 1e9
    size = MEGATRON_SIZES.get(path.stem.removeprefix("megatron-"))
    if size is not None:
        assert n == pytest.approx(size, rel=0.035), n  # Table 1 rounds 1.7B / 3.6B loosely
        assert cfg.model.mlp == "gelu" and cfg.model.d_ff == 4 * cfg.model.d_model
    assert cfg.train.seq_len <= cfg.model.max_seq_len
    assert math.isfinite(n) and n > 1


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_pipeline_slots_closed_form_matches_the_tables(schedule, v):
    """The closed form the planner uses for big tables equals the executor's tables: max in-flight
    (mb, chunk) pairs of the lockstep view; zb-h1 (per-op) its in-flight count from F to W, and its
    stash slots (B to W) the most deferred W's."""
    from meshrun.pipeline import registry, schedules
    from meshrun.planner.step_model import pipeline_slots_formula, stash_slots_formula

    for p in (2, 3, 4):
        for m in (p, 2 * p, 4 * p):
            table = registry.get(schedule).table(p, m, v)
            if schedule == "zb-h1":
                want = max(schedules.max_in_flight(table, s) for s in range(p))
                stash = max(1 + max(schedules.assign_slots(schedules.stash_intervals(table, s)).values())
                            for s in range(p))  # fmt: skip
                assert stash_slots_formula(schedule, p, m) == stash == min(m, p)
            else:
                lock = schedules.lockstep(table)
                want = max(schedules.max_in_flight(lock, s) for s in range(p))
            assert pipeline_slots_formula(schedule, p, m, v) == want, (p, m)


@pytest.mark.parametrize("schedule", ["interleaved", "zb-v"])
def test_grad_final_closed_form_matches_the_tables(schedule):
    """The ticks and per-chunk last gradient ticks the planner's overlap_grad_reduce reads in closed form
    (the registry entry's `grad_final`) equal those of the timeline the executor plays (the lockstep
    view for interleaved), for every p >= 2, m and v the schedule accepts in a grid."""
    from meshrun.pipeline import registry, schedules
    from meshrun.planner.step_model import grad_final

    sched, n = registry.get(schedule), 0
    for p in range(2, 7):
        for v in (2, 3, 4) if sched.chunks is None else (2,):
            for m in range(1, 3 * p + 1):
                try:
                    sched.check(p, m, v)
                except ConfigError:
                    continue
                table = sched.table(p, m, v)
                table = schedules.lockstep(table) if sched.executor("auto") == "lockstep" else table
                want = (len(table), schedules.grad_final_ticks(table, sched.chunks_of(v)))
                assert sched.grad_final(p, m, sched.chunks_of(v), sched.executor("auto")) == want, (p, m, v)
                assert grad_final(schedule, p, m, v, "auto") == want
                n += 1
    assert n >= 30


def test_per_op_1f1b_slots_and_time_match_its_table():
    """pipeline.executor=per_op: the planner's slots (p on the first stage), stash slots (one) and
    tick time (one-op ticks, F = B = W: 3m + 2(p - 1) of them) equal the per-op executor's program."""
    from meshrun.config import PipelineConfig
    from meshrun.pipeline.program import tick_program
    from meshrun.planner import timing
    from meshrun.planner.step_model import pipeline_slots_formula, stash_slots_formula

    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 4 * p):
            prog = tick_program(PipelineConfig(schedule="1f1b", microbatches=m, executor="per_op"), p)
            assert pipeline_slots_formula("1f1b", p, m, 1, "per_op") == prog.slots == min(m, p)
            assert stash_slots_formula("1f1b", p, m) == prog.stash_slots == 1
            lay = Layout(pipe=p, microbatches=m, executor="per_op")
            idle, frac = timing._bubble(lay)
            assert (m + idle) * 3 == pytest.approx(prog.ticks)
            assert frac == pytest.approx(prog.bubble)


def test_per_op_1f1b_holds_less_and_idles_less(gpt3):
    """The per-op executor's 1F1B (backward split into B and W) keeps p microbatches (+ one stash)
    against lockstep's 2p - 1, and its one-op ticks idle 2(p - 1) op-ticks against 3(p - 1); the
    search keeps the faster of the two executors."""
    cluster = parse_cluster("a100-80g:16x8")
    lay = Layout(tensor=8, pipe=8, data=2, microbatches=32, zero=1, remat="selective", sequence_parallel=True)
    lock = search.evaluate(gpt3, lay, cluster, 64, 2048)
    per_op = search.evaluate(gpt3, dataclasses.replace(lay, executor="per_op"), cluster, 64, 2048)
    assert per_op.memory["activations"] < lock.memory["activations"]
    assert per_op.time["bubble_fraction"] == pytest.approx(2 * 7 / (3 * 32 + 2 * 7))
    assert lock.time["bubble_fraction"] == pytest.approx(7 / (32 + 7))
    assert per_op.step_time < lock.step_time


# ----------------------------------------------------------------------------- ZeRO variants in --evaluate

FSDP_70B = ["--model", "llama-70b", "--cluster", "h100-80g:8x8", "--global-batch", "512", "--seq-len", "4096"]


def test_evaluate_costs_the_named_zero3_variant(capsys):
    """zero3_gather=step gathers every weight before the loop (the whole 70B model on each device), layer
    gathers per layer (what auto picks here); the JSON answer carries the variant."""
    got = {}
    for variant in ("auto", "layer", "step"):
        layout = f"tensor=1,pipe=1,zero=3,remat=full,micro_batch_size=1,zero3_gather={variant}"
        rc, out, err = run_cli([*FSDP_70B, "--evaluate", layout, "--json"], capsys)
        assert rc == 0, err
        got[variant] = json.loads(out)["configs"][0]
    assert got["step"]["zero3_gather"] == "step"
    assert got["auto"]["memory_gb"] == got["layer"]["memory_gb"] < 80 < got["step"]["memory_gb"]


@pytest.mark.parametrize(
    "layout, words",
    [
        ("zero=1,zero3_gather=layer", ["zero3_gather", "set zero=3"]),
        ("zero=3,zero2_reduce=microbatch", ["zero2_reduce", "set zero=2"]),
        ("zero=3,zero3_gather=sometimes", ["zero3_gather", "use one of"]),
        ("pipe=4,virtual=4,schedule=interleaved,zero=3,zero3_gather=layer,overlap_grad_reduce=true",
         ["zero3_gather", "overlap_grad_reduce=false"]),
        ("pipe=4,virtual=4,schedule=interleaved,zero=2,zero2_reduce=microbatch,overlap_grad_reduce=true",
         ["zero2_reduce", "overlap_grad_reduce=false"]),
        ("zero=3,zero3_gather=step,offload_params=true", ["zero3_gather", "leave it auto"]),
    ],
)  # fmt: skip
def test_evaluate_refuses_a_zero_variant_the_layout_cannot_run(layout, words, capsys):
    rc, out, err = run_cli([*FSDP_70B, "--evaluate", f"tensor=8,{layout}"], capsys)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, (rc, out, err)
    assert all(w in err for w in words), err
    rc, _, err = run_cli([*FSDP_70B, "--framework", "megatron", "--evaluate", "zero=3,zero3_gather=layer"], capsys)
    assert rc == 2 and "meshrun variant" in err, err


def _best_of(text: str):
    """The search's pick among the variants of one 70B layout (`search._best_executor`)."""
    from meshrun.cli.plan import load_model, parse_evaluate

    model, cluster = load_model("llama-70b")[0], parse_cluster("h100-80g:8x8")
    layout = parse_evaluate(text, model, cluster, 512, 4096)
    best = search._best_executor(model, layout, cluster, 512, 4096, {})
    field, per_layer = ("zero3_gather", "layer") if layout.zero == 3 else ("zero2_reduce", "microbatch")
    both = [search.evaluate(model, dataclasses.replace(best.layout, overlap_grad_reduce=False, **{field: v}),
                            cluster, 512, 4096) for v in (per_layer, "step")]  # fmt: skip
    return model, best, both


def test_search_picks_zero2_once_per_step_where_it_fits_and_is_faster():
    """TP8 PP4 v4 ZeRO-2 with full remat: both variants fit; reducing once per step is faster than per
    microbatch (what the run's auto rule picks without overlap_grad_reduce), so the search names step, and
    the table says so."""
    from meshrun.cli.plan import format_table

    model, best, (per_mb, per_step) = _best_of("tensor=8,pipe=4,virtual=4,schedule=interleaved,zero=2,remat=full")
    assert (per_mb.layout.zero2_reduce, per_step.layout.zero2_reduce) == ("microbatch", "step")
    assert not per_mb.hard and not per_step.hard
    assert per_step.step_time < per_mb.step_time and per_mb.memory["total"] < per_step.memory["total"]
    assert best.layout.zero2_reduce == "step" and best.step_time <= per_step.step_time
    cluster = parse_cluster("h100-80g:8x8")
    table = format_table("llama-70b", 70e9, cluster, 512, 4096, [best], model=model)
    assert "  2S " in table and "#1 ZeRO-2: train.zero2_reduce=step" in table
    table = format_table("llama-70b", 70e9, cluster, 512, 4096, [per_step], model=model)
    assert "#1 ZeRO-2: train.zero2_reduce=step (auto would pick microbatch: set it in the config)" in table


@pytest.mark.parametrize(
    "text, field, kept",
    [
        ("tensor=1,pipe=1,zero=3,remat=full,micro_batch_size=1", "zero3_gather", "layer"),
        ("tensor=8,pipe=1,zero=2,remat=selective,micro_batch_size=4,sequence_parallel=true", "zero2_reduce",
         "microbatch"),
    ],
)  # fmt: skip
def test_search_keeps_the_per_layer_variant_where_once_per_step_does_not_fit(text, field, kept):
    """Pure FSDP at 70B: gathering every weight once per step is faster but holds the whole model (no
    fit); ZeRO-2 on TP8 DP8 at micro-batch 4: whole float32 gradient sums do not fit. The search keeps
    the per-layer / per-microbatch variant, named."""
    _, best, (per_layer, per_step) = _best_of(text)
    assert per_step.hard and any(v.startswith("memory ") for v in per_step.violations)
    assert not per_layer.hard and getattr(per_layer.layout, field) == kept
    assert getattr(best.layout, field) == kept and not best.hard
