"""Device set-up: XLA's default flags for user runs, simulated CPU devices only on the CPU platform."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshrun.config import load_config
from meshrun.runtime.devices import (
    DEVICE_COUNT_FLAG,
    FAST_COMPILE_FLAG,
    default_platform,
    needed_devices,
    setup_devices,
    xla_flags,
)

ROOT = Path(__file__).resolve().parents[1]
LEVEL = "xla_backend_optimization_level"

# Runs `meshrun train ARGS` as `python -m meshrun.cli.main` does and, at exit, reports the XLA_FLAGS the
# process ended with and the devices jax saw.
HOOK = """
import atexit, os, runpy, sys

def report():
    jax = sys.modules.get("jax")
    try:
        n = len(jax.devices()) if jax else -1
    except Exception:
        n = -1
    print("XLA_FLAGS=" + os.environ.get("XLA_FLAGS", "<unset>"), file=sys.stderr)
    print(f"DEVICES={n}", file=sys.stderr)

atexit.register(report)
sys.argv = ["meshrun", *sys.argv[1:]]
runpy.run_module("meshrun.cli.main", run_name="__main__")
"""


def _meshrun(args, env_extra, timeout=240, unset=()):
    env = {**os.environ, "XLA_FLAGS": "--xla_cpu_enable_fast_math=false", **env_extra}
    for k in unset:
        env.pop(k, None)
    r = subprocess.run(
        [sys.executable, "-c", HOOK, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )
    lines = r.stderr.splitlines()
    flags = [ln.split("=", 1)[1] for ln in lines if ln.startswith("XLA_FLAGS=")]
    devices = [int(ln.split("=", 1)[1]) for ln in lines if ln.startswith("DEVICES=")]
    assert flags and devices, r.stderr[-3000:]
    return r, flags[-1], devices[-1]


TINY = [
    "configs/tiny_cpu.yaml",
    "mesh.pipe=1",
    "mesh.data=2",
    "mesh.tensor=1",
    "model.n_layers=2",
    "model.d_model=32",
    "model.d_ff=64",
    "model.head_dim=8",
    "train.seq_len=16",
    "model.max_seq_len=16",
    "train.global_batch=4",
    "pipeline.microbatches=1",
    "data.kind=synthetic",
    "train.steps=1",
    "checkpoint.async_save=false",
    "--quiet",
]


@pytest.mark.parametrize("fast", [False, True])
def test_train_on_cpu_runs_at_xla_defaults_unless_fast_compile(tmp_path, fast):
    """A real `meshrun train` on CPU, started without any level flag in XLA_FLAGS: it simulates the
    mesh's 2 devices and keeps XLA's default optimisation level; `--fast-compile` adds level 0."""
    args = [*TINY, f"train.run_dir={tmp_path}", *(["--fast-compile"] if fast else [])]
    r, flags, devices = _meshrun(["train", *args], {"JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{DEVICE_COUNT_FLAG}=2" in flags.split() and devices == 2
    assert "--xla_cpu_enable_fast_math=false" in flags.split()  # the user's flags stay
    assert (FAST_COMPILE_FLAG in flags.split()) is fast
    if not fast:
        assert LEVEL not in flags


def test_train_on_another_platform_sets_nothing_cpu_specific(tmp_path):
    """JAX_PLATFORMS=cuda on a machine without GPUs: jax then fails to start, but the flags the
    process set up before that are what a GPU run would get: the user's own, nothing added."""
    args = [*TINY, f"train.run_dir={tmp_path}", "--fast-compile", "--devices", "4"]
    r, flags, _ = _meshrun(["train", *args], {"JAX_PLATFORMS": "cuda"}, timeout=120)
    assert flags == "--xla_cpu_enable_fast_math=false", r.stderr[-3000:]


@pytest.mark.parametrize("fast", [False, True])
def test_explain_runs_at_xla_defaults_unless_fast_compile(fast):
    """`meshrun explain` compiles on simulated CPU devices at XLA's default level; --fast-compile: level 0."""
    args = ["explain", *[a for a in TINY if a != "--quiet"], "--json", *(["--fast-compile"] if fast else [])]
    r, flags, devices = _meshrun(args, {}, unset=["JAX_PLATFORMS"])  # explain picks CPU itself
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{DEVICE_COUNT_FLAG}=2" in flags.split() and devices == 2
    assert (FAST_COMPILE_FLAG in flags.split()) is fast
    if not fast:
        assert LEVEL not in flags


@pytest.mark.parametrize(
    "env, platform",
    [
        ({"JAX_PLATFORMS": "cuda"}, "gpu"),
        ({"JAX_PLATFORMS": "cuda,cpu"}, "gpu"),
        ({"JAX_PLATFORMS": "rocm"}, "gpu"),
        ({"JAX_PLATFORMS": "tpu"}, "tpu"),
        ({"JAX_PLATFORMS": "cpu"}, "cpu"),
        ({"JAX_PLATFORMS": "cpu,cuda"}, "cpu"),
        ({"JAX_PLATFORM_NAME": "gpu"}, "gpu"),
    ],
)
def test_platform_from_jax_platforms(env, platform):
    # JAX_PLATFORMS decides before any probe: a GPU machine with JAX_PLATFORMS=cpu is a CPU run.
    assert default_platform(env, installed=lambda m: True, exists=lambda p: True) == platform


@pytest.mark.parametrize(
    "plugins, files, env, platform",
    [
        ({"jax_cuda12_plugin"}, {"/dev/nvidiactl"}, {}, "gpu"),
        ({"jax_cuda13_plugin"}, {"/dev/nvidia[0-9]*"}, {}, "gpu"),
        ({"jax_plugins.xla_cuda12"}, {"/dev/nvidiactl"}, {}, "gpu"),
        ({"jax_cuda12_plugin"}, set(), {}, "cpu"),  # jax[cuda12] on a machine without a GPU
        (set(), {"/dev/nvidiactl"}, {}, "cpu"),  # a GPU, but a CPU-only jaxlib
        ({"jax_cuda12_plugin"}, {"/dev/nvidiactl"}, {"CUDA_VISIBLE_DEVICES": ""}, "cpu"),
        ({"jax_cuda12_plugin"}, {"/dev/nvidiactl"}, {"CUDA_VISIBLE_DEVICES": "0,1"}, "gpu"),
        ({"jax_rocm60_plugin"}, {"/dev/kfd"}, {}, "gpu"),
        ({"libtpu"}, {"/dev/accel[0-9]*"}, {}, "tpu"),
        (set(), set(), {}, "cpu"),
    ],
)
def test_platform_from_installed_plugins_and_devices(plugins, files, env, platform):
    assert default_platform(env, installed=plugins.__contains__, exists=files.__contains__) == platform


def test_platform_of_this_test_session_is_cpu():
    assert default_platform() == "cpu"  # conftest sets JAX_PLATFORMS=cpu


def test_xla_flags():
    base = "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=3"
    assert xla_flags(base, devices=8, fast_compile=False, cpu=True) == (
        "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=8"
    )
    assert xla_flags(base, devices=None, fast_compile=True, cpu=True) == (
        "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=3 --xla_backend_optimization_level=0"
    )
    assert xla_flags("--xla_backend_optimization_level=2", devices=2, fast_compile=True, cpu=True) == (
        "--xla_backend_optimization_level=2 --xla_force_host_platform_device_count=2"
    )
    assert xla_flags("", devices=2, fast_compile=False, cpu=True) == "--xla_force_host_platform_device_count=2"
    for fast in (False, True):
        assert xla_flags(base, devices=8, fast_compile=fast, cpu=False) == base
        assert xla_flags("", devices=8, fast_compile=fast, cpu=False) == ""


def test_setup_devices_on_each_platform(monkeypatch):
    monkeypatch.delitem(sys.modules, "jax", raising=False)  # as before `import jax` in a fresh `meshrun train`
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_dump_to=d"}
    assert setup_devices(4, environ=env) == "cpu"
    assert env["XLA_FLAGS"] == "--xla_dump_to=d --xla_force_host_platform_device_count=4"
    setup_devices(2, environ=env)  # a count already there stays unless forced (launch/local.sh sets it)
    assert env["XLA_FLAGS"].endswith("count=4")
    setup_devices(2, force=True, fast_compile=True, environ=env)
    assert env["XLA_FLAGS"] == f"--xla_dump_to=d {FAST_COMPILE_FLAG} --xla_force_host_platform_device_count=2"
    for plat in ("cuda", "tpu"):
        env = {"JAX_PLATFORMS": plat, "XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}
        assert setup_devices(8, force=True, fast_compile=True, environ=env) != "cpu"
        assert env == {"JAX_PLATFORMS": plat, "XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}
        env = {"JAX_PLATFORMS": plat}
        setup_devices(8, fast_compile=True, environ=env)
        assert "XLA_FLAGS" not in env


@pytest.mark.parametrize(
    "over, n",
    [
        ([], 8),
        (["mesh.data=4", "mesh.pipe=1"], 8),
        (["mesh.data=1", "mesh.pipe=1", "mesh.tensor=1"], 1),
        (["mesh.data=-1"], 8),
        (["mesh.data=3", "mesh.pipe=1", "mesh.tensor=1", "mesh.expert=2"], 6),
    ],
)
def test_needed_devices(over, n):
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", over)
    assert needed_devices(cfg) == n and needed_devices(cfg.mesh) == n
