"""Planner: the seed's numbers (corrected), Megatron's measured GPT-3 175B run, search, rules, bad input.

Pure Python, no JAX: the cost model is arithmetic, so these tests pin exact formulas where the
literature gives them and measured numbers (with the stated band) where it does not.
"""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshrun import flops
from meshrun.config import ModelConfig, load_config
from meshrun.errors import ConfigError
from meshrun.planner import cost, search
from meshrun.planner.cost import Layout
from meshrun.planner.hardware import GB, parse_cluster

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "configs" / "models"
GPT3 = MODELS / "gpt3-175b.yaml"


@pytest.fixture(scope="module")
def gpt3() -> ModelConfig:
    return load_config(GPT3).model


def run_cli(argv, capsys):
    from meshrun.cli import main

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
    from meshrun.planner.cli import parse_evaluate

    plan = parse_evaluate("tensor=8,pipe=16", gpt3, cluster, 1536)
    assert plan.data == 8  # 1024 / (8 * 16), not the seed's 112
    assert plan.microbatches == 192 and plan.global_batch == 1536
    # global batch = micro_batch_size x m x DP; PP does not multiply it (the seed's "64x16x8x4" is wrong).
    p = Layout(tensor=8, pipe=16, data=8, microbatches=64, micro_batch_size=1)
    assert p.global_batch == 512
    bad = search.structural_violations(gpt3, p, cluster, 64 * 16 * 8 * 4)
    assert any("global batch 32768" in v and "= 512" in v for v in bad)


def test_model_states_16_bytes_per_param(gpt3):
    prec = cost.precision_of(gpt3)  # bf16 params: 2 + 2 + (4 master + 8 Adam)
    assert (prec.param, prec.grad, prec.opt) == (2, 2, 12)
    psi = cost.param_counts(gpt3)["total"]
    mem = cost.predict_memory(gpt3, seq_len=2048, remat="full")
    states = mem["params"] + mem["grads"] + mem["optimizer"]
    assert states == pytest.approx(16 * psi, rel=1e-9)
    assert states == pytest.approx(2.8e12, rel=0.01)  # the seed's 2.8 TB


@pytest.mark.parametrize("zero,expect", [(0, lambda d: 16), (1, lambda d: 4 + 12 / d), (2, lambda d: 2 + 14 / d)])
def test_zero_stage_formulas(gpt3, zero, expect):
    psi = cost.param_counts(gpt3)["total"]
    for d in (2, 8, 64):
        mem = cost.predict_memory(gpt3, data=d, zero=zero, seq_len=2048)
        assert mem["params"] + mem["grads"] + mem["optimizer"] == pytest.approx(expect(d) * psi, rel=1e-9)


def test_zero3_shards_everything(gpt3):
    psi = cost.param_counts(gpt3)["total"]
    mem = cost.predict_memory(gpt3, data=64, zero=3, seq_len=2048)
    assert mem["grads"] + mem["optimizer"] == pytest.approx(14 * psi / 64, rel=1e-9)
    gather = 2 * 2 * cost.layer_params(gpt3)  # two layers of bf16 weights gathered at a time
    assert mem["params"] == pytest.approx(2 * psi / 64 + gather, rel=1e-9)


@pytest.mark.parametrize("p,m,expect", [(24, 8, 23 / 31), (16, 192, 15 / 207), (1, 4, 0.0)])
def test_bubble_fraction(gpt3, p, m, expect):
    cluster = parse_cluster("a100-80g:128x8")
    tm = cost.predict_time(gpt3, Layout(pipe=p, microbatches=m), cluster, 2048)
    assert tm["bubble_fraction"] == pytest.approx(expect, abs=1e-12)
    if (p, m) == (24, 8):
        assert tm["bubble_fraction"] == pytest.approx(0.742, abs=1e-3)  # the seed's 74%


@pytest.mark.parametrize("p", [2, 4, 8, 16, 24])
def test_bubble_at_m_equals_4p(gpt3, p):
    cluster = parse_cluster("a100-80g:128x8")
    tm = cost.predict_time(gpt3, Layout(pipe=p, microbatches=4 * p), cluster, 2048)
    assert tm["bubble_fraction"] == pytest.approx((p - 1) / (5 * p - 1), abs=1e-12)
    if p >= 8:
        assert tm["bubble_fraction"] > 0.175  # still ~19% for large p: m = 4p is not "no bubble"
    busy = sum(tm[k] for k in ("compute", "tensor_comm", "pipe_comm", "expert_comm", "zero_comm"))
    assert tm["bubble"] / (tm["bubble"] + busy) == pytest.approx(tm["bubble_fraction"], rel=1e-9)
    v = 4
    tm = cost.predict_time(gpt3, Layout(pipe=p, microbatches=4 * p, virtual=v, schedule="interleaved"), cluster, 2048)
    assert tm["bubble_fraction"] == pytest.approx((p - 1) / (v * 4 * p + p - 1), abs=1e-12)


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
    common = dict(tensor=t, pipe=p, data=8, seq_len=s, dropout=True, zero=0, sequence_parallel=False)
    a = cost.predict_memory(gpt3, microbatches=64, remat="full", **common)
    b = cost.predict_memory(gpt3, microbatches=192, remat="full", **common)
    assert a["activations"] == b["activations"]  # 1F1B: peak does not grow with m
    working = cost.layer_activation_bytes(gpt3, 1, s, t, sp=False, remat="none", act=2, dropout=True, flash=False)
    embed = p * s * h * 3  # embedding output (bf16) + dropout mask, p micro-batches in flight
    assert a["activations"] == pytest.approx(96 / p * 2 * s * h * p + working + embed, rel=1e-12)
    g = cost.predict_memory(gpt3, microbatches=64, remat="full", schedule="gpipe", **common)
    assert g["activations"] - working == pytest.approx((a["activations"] - working) * 64 / p, rel=1e-12)


def test_fp32_cpu_mode_bytes_per_param():
    tiny = ModelConfig()  # the tiny CPU config: float32 params and compute, no master copy
    prec = cost.precision_of(tiny)
    assert (prec.param, prec.grad, prec.opt, prec.act) == (4, 4, 8, 4)
    psi = cost.param_counts(tiny)["total"]
    mem = cost.predict_memory(tiny, micro_batch_size=2, seq_len=64, remat="none")
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (4 * psi, 4 * psi, 8 * psi)
    assert mem["total"] == pytest.approx(sum(mem[k] for k in ("params", "grads", "optimizer", "activations", "logits")))
    assert mem["logits"] == 64 * 2 * tiny.vocab * (4 + 4) + 4 * 64 * 2 * tiny.d_model
    acc = cost.predict_memory(tiny, micro_batch_size=2, microbatches=4, seq_len=64, remat="none", accum_copy=True)
    assert acc["grads"] == 8 * psi


def test_moe_expert_params_divided_by_ep():
    mix = load_config(MODELS / "mixtral-8x7b.yaml").model
    counts = cost.param_counts(mix)
    assert counts["total"] == pytest.approx(46.7e9, rel=5e-3)
    one = cost.predict_memory(mix, data=8, expert=1, seq_len=4096)
    eight = cost.predict_memory(mix, data=1, expert=8, seq_len=4096)
    assert one["params"] - eight["params"] == pytest.approx(2 * counts["experts"] * (1 - 1 / 8), rel=1e-9)


# ----------------------------------------------------------------------------- Megatron's 175B run


def test_evaluate_megatron_gpt3_175b(capsys):
    argv = ["--model", str(GPT3), "--cluster", "a100-80g:128x8", "--global-batch", "1536", "--seq-len", "2048"]
    ev = "tensor=8,pipe=16,data=8,micro_batch_size=1,remat=full,sequence_parallel=false,zero=0"
    rc, out, err = run_cli([*argv, "--evaluate", ev, "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    (cfg,) = doc["configs"]
    assert (cfg["tensor"], cfg["pipe"], cfg["data"], cfg["microbatches"]) == (8, 16, 8, 192)
    assert abs(cfg["tflops_per_device"] - 138) <= 0.15 * 138, cfg["tflops_per_device"]
    assert cfg["violations"] == []
    assert cfg["memory_gb"] < 0.9 * 80
    assert cfg["bubble_fraction"] == pytest.approx(15 / 207, abs=1e-4)
    # MFU counts model FLOPs only: below the hardware-FLOP utilisation by the recompute share (3/4).
    hfu = cfg["tflops_per_device"] / 312
    model = load_config(GPT3).model
    share = flops.model_flops(model, 1536, 2048) / flops.hardware_flops(model, 1536, 2048, "full")
    assert cfg["mfu"] == pytest.approx(hfu * share, rel=1e-3)
    for key in ("memory_gb", "step_time_s", "tflops_per_device", "mfu", "bubble_fraction", "violations"):
        assert key in cfg


def test_efficiency_constant_is_the_table1_fit():
    assert search.fit_efficiency() == pytest.approx(cost.GEMM_EFFICIENCY, abs=0.002)
    for size, pred, measured in search.table1_predictions(cost.GEMM_EFFICIENCY):
        assert abs(pred - measured) <= 0.15 * measured, (size, pred, measured)


def test_top_plan_175b(gpt3, capsys):
    rc, out, err = run_cli(["--model", str(GPT3), "--cluster", "a100-80g:128x8", "--global-batch", "1536",
                            "--seq-len", "2048", "--top", "5", "--json"], capsys)  # fmt: skip
    assert rc == 0, err
    configs = json.loads(out)["configs"]
    assert len(configs) == 5
    best = configs[0]
    assert best["tensor"] <= 8 and best["bubble_fraction"] < 0.10 and best["violations"] == []
    assert best["memory_gb"] <= 0.9 * 80
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
    assert any(re.search(r"memory [\d.]+ GB > 72.0 GB usable", v) for v in r.violations)
    r = search.evaluate(gpt3, Layout(tensor=8, pipe=1, data=128, microbatches=12), cluster, 1536, 2048)
    assert any("memory" in v for v in r.violations)
    small = load_config(MODELS / "megatron-1.7b.yaml").model
    # tensor 8 fills each node, so the DP group has one GPU per node and its ring runs on the NICs alone
    r = search.evaluate(small, Layout(tensor=8, pipe=1, data=128, microbatches=1), cluster, 128, 2048)
    assert any(re.search(r"data-parallel gradient sync [\d.]+ s > compute [\d.]+ s", v) for v in r.violations)
    llama = load_config(MODELS / "llama-70b.yaml").model
    r = search.evaluate(llama, Layout(tensor=5, pipe=3, data=2, expert=2, virtual=2), cluster, 7, 4096)
    text = " | ".join(r.violations)
    for frag in (
        "n_heads=64 is not divisible by tensor=5",
        "n_kv_heads=8",
        "n_layers=80 is not divisible by pipe*virtual=6",
        "expert=2 > 1 on a dense model",
        "= 60 != 1024 devices",
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
    with pytest.raises(ConfigError) as e:
        search.search(gpt3, parse_cluster("a100-80g:1x8"), 64, 2048, name="gpt3-175b")
    need = float(re.search(r"at least ([\d.]+) GB", str(e.value)).group(1))
    psi = cost.param_counts(gpt3)["total"]
    assert need * GB >= 16 * psi / 8  # the model states alone, spread over 8 GPUs
    assert need * GB == pytest.approx(16 * psi / 8, rel=0.02)
    assert e.value.field == "--model"


@pytest.mark.parametrize(
    "argv,frag",
    [
        (["--cluster", "v100:16x8"], "--cluster: unknown GPU 'v100'"),
        (["--cluster", "a100-80g"], "--cluster: malformed cluster"),
        (["--cluster", "a100-80g:1x8"], "it needs at least"),
        (["--cluster", "a100-80g:128x8", "--evaluate", "tensr=8"], "did you mean 'tensor'"),
        (["--cluster", "a100-80g:128x8", "--evaluate", "remat=some"], "--evaluate remat"),
    ],
)
def test_cli_errors_exit_2(argv, frag, capsys):
    rc, out, err = run_cli(["--model", "gpt3-175b", "--global-batch", "1536", *argv], capsys)
    assert rc == 2 and frag in err and "Traceback" not in err and out == ""


def test_cli_subprocess_exit_2():
    cmd = [sys.executable, "-m", "meshrun.cli", "plan", "--model", str(GPT3), "--cluster", "tpu:4x4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert "--cluster" in proc.stderr and "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- configs


MEGATRON_SIZES = {"1.7b": 1.7, "3.6b": 3.6, "7.5b": 7.5, "18b": 18.4, "39b": 39.1, "76b": 76.1, "145b": 145.6,
                  "310b": 310.1, "530b": 529.6, "1t": 1008.0}  # fmt: skip


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
