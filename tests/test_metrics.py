"""Model FLOPs against Megatron's closed form and a GEMM count, MFU arithmetic, peak table, JSONL
logger, profiler."""

import dataclasses
import io
import json

import jax
import pytest
from meshrun_models.llama.config import LlamaConfig

from meshrun.analysis.flops import model_flops
from meshrun.analysis.profiler import profile_trace
from meshrun.train.metrics import MetricsLogger, peak_flops, throughput


def gpt(h, L, heads, V, s):
    return LlamaConfig(
        vocab=V, d_model=h, n_layers=L, n_heads=heads, n_kv_heads=heads, head_dim=h // heads, d_ff=4 * h,
        max_seq_len=s, mlp="gelu",
    )  # fmt: skip


def megatron(B, s, L, h, V, attn_div=6):
    """Narayanan et al. 2021 (sec. 5.1), no recompute: 72 B s L h^2 (1 + s/(6h) + V/(12 L h))."""
    return 72 * B * s * L * h**2 * (1 + s / (attn_div * h) + V / (12 * L * h))


@pytest.mark.parametrize(
    "h, L, heads, V, s, B",
    [
        (12288, 96, 96, 51200, 2048, 1536),  # GPT-3 175B as Megatron ran it
        (64, 4, 4, 256, 64, 16),  # the tiny CPU shape
        (4096, 32, 32, 50257, 4096, 8),
    ],
)
def test_flops_equal_megatron_formula(h, L, heads, V, s, B):
    cfg = gpt(h, L, heads, V, s)
    assert model_flops(cfg, B, s) == pytest.approx(megatron(B, s, L, h, V), rel=1e-12)
    # halved attention (causal kernels skip masked blocks) is the s/(12h) variant
    assert model_flops(cfg, B, s, causal_skip=True) == pytest.approx(megatron(B, s, L, h, V, attn_div=12), rel=1e-12)


def test_gpt3_numbers():
    cfg = gpt(12288, 96, 96, 51200, 2048)
    f = model_flops(cfg, 1536, 2048)
    assert f == pytest.approx(3.3862e18, rel=1e-4)  # ~6 x 175e9 x 3.1M tokens = 3.30e18 + attention
    # Megatron-LM: 1024 A100s at ~138 TFLOP/s each -> 23.96 s per step; MFU = 138/312 = 44%
    t = f / (1024 * 138e12)
    assert t == pytest.approx(23.96, abs=0.01)
    r = throughput(
        t, flops_per_step=f, tokens_per_step=1536 * 2048, n_devices=1024, peak=peak_flops("NVIDIA A100-SXM4-80GB")
    )
    assert r["tflops_per_device"] == pytest.approx(138.0)
    assert r["mfu"] == pytest.approx(138 / 312)
    assert r["tokens_per_s"] == pytest.approx(1536 * 2048 / t)


def test_flops_count_the_gemms_of_a_gqa_moe_model():
    """Training FLOPs = 3 x 2 x the forward's multiply-adds, counted here GEMM by GEMM from the weight
    shapes of d_model=64, 4 query heads and 2 kv heads of 16, swiglu d_ff=128, vocab 256: MoE layers
    run the router and only the top_k=2 of their 8 experts."""
    dense = LlamaConfig(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128, vocab=256)
    moe = dataclasses.replace(dense, n_experts=8, top_k=2, moe_every=2)  # layers 1 and 3 are MoE
    B, s = 16, 64
    attn = [(64, 64), (64, 32), (64, 32), (64, 64)]  # Wq, Wk, Wv, Wo as (in, out)
    swiglu = [(64, 128), (64, 128), (128, 64)]  # gate, up, down
    macs = lambda gemms: sum(i * o for i, o in gemms)
    dense_layer, moe_layer = macs(attn + swiglu), macs(attn + [(64, 8)] + 2 * swiglu)  # router, 2 experts
    scores = 4 * (s * 16 + s * 16)  # per token and layer: QK^T and A.V over s positions, 4 heads of 16
    logits = macs([(64, 256)])
    per_token = {
        dense: 4 * dense_layer + 4 * scores + logits,
        moe: 2 * dense_layer + 2 * moe_layer + 4 * scores + logits,
    }
    for cfg, fwd_macs in per_token.items():
        assert model_flops(cfg, B, s) == pytest.approx(3 * 2 * fwd_macs * B * s, rel=1e-12)


def test_peak_table():
    assert peak_flops("NVIDIA A100-SXM4-40GB") == 312e12
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("cpu") is None
    assert peak_flops(jax.devices()[0]) is None  # the test devices are CPUs
    assert "mfu" not in throughput(1.0, flops_per_step=1e12, tokens_per_step=10, n_devices=2)


class _Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self._tty = tty

    def isatty(self):
        return self._tty


def test_metrics_jsonl_and_plain_progress(tmp_path):
    err = _Stream(tty=False)
    with MetricsLogger(tmp_path / "run", total_steps=10, stream=err) as log:
        log.log(1, {"loss": jax.numpy.float32(5.5), "tokens_per_s": 1000.0, "note": "warm"})
        # the file is flushed line by line: readable before close
        assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text())["loss"] == 5.5
        log.log(2, {"loss": 5.25, "tokens_per_s": 2000.0, "mfu": 0.5, "bad": float("nan")})
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["note"] == "warm" and rows[1]["loss"] == 5.25 and rows[1]["bad"] == "nan"
    lines = err.getvalue().splitlines()
    assert lines[0].startswith("step 1/10  loss 5.5000  1,000 tok/s  ETA --")
    assert lines[1].startswith("step 2/10  loss 5.2500  2,000 tok/s  MFU 50.0%  ETA ")
    assert "\r" not in err.getvalue()


def test_progress_bar_on_tty_and_quiet(tmp_path):
    tty = _Stream(tty=True)
    log = MetricsLogger(tmp_path, total_steps=4, stream=tty)
    log.log(0, {"loss": 1.0})
    log.log(2, {"loss": 0.5})
    log.close()
    out = tty.getvalue()
    assert out.count("\r") == 2 and out.endswith("\n")
    assert "[###############...............] step 2/4  loss 0.5000" in out
    quiet = _Stream(tty=False)
    log = MetricsLogger(tmp_path, total_steps=4, quiet=True, stream=quiet)
    log.log(3, {"loss": 0.25})
    log.close()
    assert quiet.getvalue() == ""
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3  # appended


def test_profile_trace(tmp_path):
    with profile_trace(tmp_path, enabled=False) as p:
        assert p is None
    assert not (tmp_path / "profile").exists()
    with profile_trace(tmp_path, enabled=True) as p:
        jax.numpy.ones(4).sum().block_until_ready()
    assert any(f.name.endswith(".xplane.pb") for f in p.rglob("*"))
