"""bench/gpu.py --dry-run runs the GPU benchmark's code path on CPU; bench/compare.py's rows are valid."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshrun.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_gpu_dry_run_prints_one_json_line():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(
        [sys.executable, "bench/gpu.py", "--dry-run"], capture_output=True, text=True, timeout=240, cwd=ROOT, env=env
    )
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1, r.stdout + r.stderr[-2000:]
    out = json.loads(lines[0])
    assert r.returncode == 0 and out["error"] is None, out
    measured = ("step_time_s", "tokens_per_s", "tflops_per_device", "first_step_s")
    for res in (out, out["remat_full"]):
        assert all(res[k] > 0 for k in measured), res
        assert res["steps_run"] == 3 and res["error"] is None
        assert "mfu" in res and "peak_bytes_in_use" in res  # None on CPU: no peak FLOP/s, no memory stats
        assert res["tokens_per_s"] == pytest.approx(out["tokens_per_step"] / res["step_time_s"])
    assert out["platform"] == "cpu" and out["remat"] == "none" and out["n_params"] > 0
    assert out["jax"] and out["jaxlib"] and out["xla_flags"] == os.environ.get("XLA_FLAGS", "")
    assert out["tokens_per_step"] == out["global_batch"] * out["model"]["seq_len"] == 4 * 64
    # the parameters in host memory, crossing to the device layer by layer: the same losses on CPU
    off = out["offload_params"]
    assert off["error"] is None and off["loss_vs_none"] == pytest.approx(1, rel=1e-5), off
    # the streamed host tier's update on the device and on the host CPU: the in-memory run's losses exactly
    for name in ("offload_device", "offload_host"):
        assert out[name]["error"] is None and out[name]["loss_vs_none"] == 1, out[name]
    assert out["offload_host"]["step_ratio_vs_device"] > 0
    # ZeRO-3 per layer (no-op gathers on one device) and HSDP on 4 simulated devices in groups of 2
    layer, hsdp = out["zero3_layer"], out["hsdp"]
    assert layer["error"] is None and layer["loss_vs_none"] == pytest.approx(1, rel=1e-5), layer
    assert hsdp["error"] is None and hsdp["n_devices"] == 4 and hsdp["loss_vs_none"] == pytest.approx(1, rel=1e-5)
    # `meshrun plan --calibrate` on the one-device runs (fp8 on a GPU only): a profile of the device
    cal = out["calibration"]
    assert cal["error"] is None and cal["gpu"] == "cpu" and cal["cluster"] == "cpu:1x1", cal
    assert [r["run_dir"] for r in cal["runs"]] == ["none", "full"] and cal["fitted"], cal
    assert all(r["measured_s"] > 0 and r["predicted_s"] > 0 for r in cal["runs"]), cal


def test_gpu_failure_still_prints_json_with_error():
    """Not on a GPU and no --dry-run: one JSON line saying why, exit 1."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "bench/gpu.py"], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 1 and "no GPU" in out["error"] and out["step_time_s"] is None


def test_gpu_env_is_what_sourcing_gpu_env_sh_gives():
    gpu = _load("gpu")
    env = gpu.gpu_env({"PATH": os.environ["PATH"], "XLA_FLAGS": "--xla_dump_to=x", "NCCL_DEBUG": "INFO"})
    flags = env["XLA_FLAGS"].split()
    assert flags[0] == "--xla_dump_to=x" and "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
    assert env["NCCL_DEBUG"] == "INFO" and env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.90"  # exported first wins
    comm = gpu.comm_flags(env["XLA_FLAGS"])  # what bench/gpu.py records: overlap and bucket flags only
    assert comm["xla_gpu_enable_latency_hiding_scheduler"] == "true"
    assert comm["xla_gpu_all_reduce_combine_threshold_bytes"] == str(128 * 2**20)
    assert "xla_gpu_enable_pipelined_all_reduce" in comm and "xla_gpu_enable_triton_gemm" not in comm


def test_compare_rows_are_valid_layouts():
    """Every row of bench/compare.py is a valid config; a ratio compares layouts on the same devices."""
    compare = _load("compare")
    for quick in (False, True):
        plan = compare.groups(quick)
        seen = []
        for ref, members in plan:
            seen.append(ref)
            for lay, own_ref, _ in members:
                seen.append(lay)
                r = own_ref or ref
                assert r.devices == lay.devices and r.layers == lay.layers, (lay, r)
                assert lay.pipe > 1 or r.pipe > 1
        for lay in seen:
            cfg = load_config(compare.CONFIG, [*compare.MODEL, *lay.overrides()])
            dp = cfg.mesh.data * cfg.mesh.expert
            assert cfg.train.global_batch % (cfg.pipeline.microbatches * dp) == 0, lay
            assert cfg.model.n_layers % (cfg.mesh.pipe * cfg.pipeline.virtual) == 0, lay
            assert (cfg.model.d_model, cfg.train.seq_len, cfg.train.global_batch) == (256, 128, 32)
    full = [lay for _, m in compare.groups(False) for lay, _, _ in m]
    assert {(lay.pipe, lay.m, lay.v) for lay in full} >= {(2, 16, 1), (2, 8, 2), (4, 16, 2), (4, 16, 1)}
