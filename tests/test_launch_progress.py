"""Rank 0's progress on the console under `launch/hosts.sh` and `launch/slurm.sbatch`, every rank's
progress in its own log (`launch/local.sh`: tests/test_run_output.py). Real 2-process runs on
loopback (2 processes x 4 CPU devices), with a stand-in `ssh` (runs the remote command here) and a
stand-in `srun` (starts the tasks here, one log per task as `--output=...%t...` asks)."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.serial, pytest.mark.slow]  # two real ranks each, ~40 s

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=64",
    "model.max_seq_len=16", "train.seq_len=16", "train.global_batch=8", "pipeline.microbatches=2",
    "data.kind=synthetic",
]  # fmt: skip
TIMEOUT = 240

SSH = """#!/bin/bash
shift  # the host
exec bash -c "$*"
"""

SRUN = """#!/bin/bash
# stand-in srun: options first (--output=PATTERN with %t), then the command; 2 tasks on loopback
out=/dev/null
while [[ "$1" == --* ]]; do case "$1" in --output=*) out=${1#--output=} ;; esac; shift; done
pids=()
for i in 0 1; do
  MESHRUN_COORDINATOR=127.0.0.1:$PORT JAX_COORDINATOR_BIND_ADDRESS=127.0.0.1:$PORT MESHRUN_NUM_PROCESSES=2 \\
    MESHRUN_PROCESS_ID=$i XLA_FLAGS="$XLA_FLAGS --xla_force_host_platform_device_count=4" "$@" >"${out//%t/$i}" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exe(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _env(tmp_path: Path, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHRUN_", "SLURM_", "OMPI_", "JAX_COORD"))}
    env.pop("XLA_FLAGS", None)
    env.update(JAX_PLATFORMS="cpu", PYTHON=sys.executable, PYTHONPATH=str(ROOT), PORT=str(_free_port()), **extra)
    return env


def _check(r: subprocess.CompletedProcess, logs: list[Path]) -> None:
    assert r.returncode == 0, r.stderr[-3000:]
    # rank 0's start-up block and progress on the console, once; not the other rank's
    assert "mesh      pipe2 x data2 x tensor2 = 8 devices on 2 host(s)" in r.stderr, r.stderr
    assert "step 1/2  loss" in r.stderr and r.stderr.count("step 2/2") == 1, r.stderr
    assert "(process 1)" not in r.stderr and "[Gloo]" not in r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["step"] == 2
    # every rank's log holds its progress
    assert "step 2/2  loss" in logs[0].read_text()
    assert "step 2/2  loss" in logs[1].read_text() and "(process 1)" in logs[1].read_text()


def test_hosts_sh_shows_host0_progress(tmp_path):
    ssh = _exe(tmp_path / "ssh", SSH)
    (tmp_path / "hosts").write_text("a\nb\n")
    env = _env(tmp_path, SSH=str(ssh), GPU_ENV="0", COORDINATOR="127.0.0.1", LOG_DIR=str(tmp_path / "logs"),
               XLA_FLAGS="--xla_force_host_platform_device_count=4", WALL_LIMIT_S="220", GRACE_S="5")  # fmt: skip
    cmd = ["bash", "launch/hosts.sh", str(tmp_path / "hosts"), "configs/tiny_cpu.yaml", *SMALL,
           f"train.run_dir={tmp_path / 'run'}", "train.steps=2"]  # fmt: skip
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    _check(r, [tmp_path / "logs" / f"host{i}.log" for i in (0, 1)])
    assert "REMOTE_PID=" not in r.stderr


def test_slurm_sbatch_shows_task0_progress(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _exe(bin_dir / "srun", SRUN)
    env = _env(tmp_path, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    run = tmp_path / "run"
    cmd = ["bash", "launch/slurm.sbatch", "configs/tiny_cpu.yaml", *SMALL, f"train.run_dir={run}", "train.steps=2"]
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    _check(r, [run / "logs" / f"rank{i}.log" for i in (0, 1)])
    assert f"logs in {run}/logs" in r.stderr
