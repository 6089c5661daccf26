"""meshrun.runtime.distributed without starting jax.distributed, and the launch scripts (syntax, dry runs,
fail-fast orchestration with stand-in processes). Real multi-process runs: test_multiprocess.py."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshrun.errors import ConfigError
from meshrun.runtime.distributed import (
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    initialize,
    parse_coordinator,
    plan,
)

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["launch/local.sh", "launch/hosts.sh", "launch/slurm.sbatch", "launch/gpu_env.sh"]


def _env(**kw) -> dict[str, str]:
    return {k: str(v) for k, v in kw.items()}


def _slurm(ntasks: int, procid: int, per_node: str) -> dict[str, str]:
    return _env(
        SLURM_JOB_ID=42,
        SLURM_STEP_NODELIST="gpu[001-004]",
        SLURM_NTASKS=ntasks,
        SLURM_PROCID=procid,
        SLURM_LOCALID=0,
        SLURM_STEP_TASKS_PER_NODE=per_node,
    )


# ------------------------------------------------------------------ plan(): where the settings come from


def test_single_process_by_default():
    assert plan(env={}).mode == "single"
    assert plan(env=_env(MESHRUN_NUM_PROCESSES=1)).mode == "single"
    # a one-task SLURM job is a single process too
    assert plan(env=_slurm(1, 0, "1")).mode == "single"


def test_explicit_env_and_args():
    env = _env(
        MESHRUN_COORDINATOR="127.0.0.1:1234", MESHRUN_NUM_PROCESSES=4, MESHRUN_PROCESS_ID=3, MESHRUN_LOCAL_DEVICES=2
    )
    p = plan(env=env)
    assert (p.mode, p.coordinator, p.num_processes, p.process_id, p.local_devices) == (
        "explicit",
        "127.0.0.1:1234",
        4,
        3,
        2,
    )
    # arguments win over the environment
    p = plan("10.0.0.1:99", 2, 0, env=env)
    assert (p.coordinator, p.num_processes, p.process_id) == ("10.0.0.1:99", 2, 0)
    assert p.local_device_ids is None  # explicit: jax's cluster detection is switched off instead


def test_slurm_one_task_per_node_sees_all_gpus():
    p = plan(env=_slurm(4, 2, "1(x4)"))
    assert (p.mode, p.num_processes, p.process_id) == ("slurm", 4, 2)
    assert p.local_device_ids == []  # [] = every visible GPU; None would let jax pick GPU SLURM_LOCALID only
    p = plan(env=_slurm(16, 9, "8(x2)"))  # one task per GPU: jax's default (GPU = SLURM_LOCALID)
    assert (p.mode, p.local_device_ids) == ("slurm", None)


def test_open_mpi():
    env = _env(
        OMPI_COMM_WORLD_SIZE=2,
        OMPI_COMM_WORLD_RANK=1,
        OMPI_COMM_WORLD_LOCAL_SIZE=1,
        OMPI_MCA_orte_hnp_uri="1.0;tcp://10.0.0.1:5000",
    )
    p = plan(env=env)
    assert (p.mode, p.num_processes, p.process_id, p.local_device_ids) == ("ompi", 2, 1, [])
    del env["OMPI_MCA_orte_hnp_uri"]  # Open MPI 5: jax cannot find the coordinator by itself
    with pytest.raises(ConfigError, match="MESHRUN_COORDINATOR"):
        plan(env=env)
    p = plan(env={**env, ENV_COORDINATOR: "10.0.0.1:5000"})  # count and id come from OMPI_COMM_WORLD_*
    assert (p.mode, p.num_processes, p.process_id) == ("explicit", 2, 1)


def test_explicit_coordinator_with_slurm_ranks():
    p = plan(env={**_slurm(4, 3, "1(x4)"), ENV_COORDINATOR: "gpu001:7000"})
    assert (p.mode, p.num_processes, p.process_id) == ("explicit", 4, 3)


@pytest.mark.parametrize(
    "env, field, words",
    [
        (
            dict(MESHRUN_COORDINATOR="127.0.0.1", MESHRUN_NUM_PROCESSES=2, MESHRUN_PROCESS_ID=0),
            ENV_COORDINATOR,
            "HOST:PORT",
        ),
        (
            dict(MESHRUN_COORDINATOR="127.0.0.1:http", MESHRUN_NUM_PROCESSES=2, MESHRUN_PROCESS_ID=0),
            ENV_COORDINATOR,
            "1..65535",
        ),
        (
            dict(MESHRUN_COORDINATOR="127.0.0.1:70000", MESHRUN_NUM_PROCESSES=2, MESHRUN_PROCESS_ID=0),
            ENV_COORDINATOR,
            "1..65535",
        ),
        (
            dict(MESHRUN_COORDINATOR="h:1", MESHRUN_NUM_PROCESSES=2, MESHRUN_PROCESS_ID=2),
            ENV_PROCESS_ID,
            "out of range",
        ),
        (
            dict(MESHRUN_COORDINATOR="h:1", MESHRUN_NUM_PROCESSES=2, MESHRUN_PROCESS_ID=-1),
            ENV_PROCESS_ID,
            "out of range",
        ),
        (dict(MESHRUN_COORDINATOR="h:1", MESHRUN_NUM_PROCESSES=0, MESHRUN_PROCESS_ID=0), ENV_NUM_PROCESSES, ">= 1"),
        (
            dict(MESHRUN_COORDINATOR="h:1", MESHRUN_NUM_PROCESSES="two", MESHRUN_PROCESS_ID=0),
            ENV_NUM_PROCESSES,
            "not an integer",
        ),
        (dict(MESHRUN_COORDINATOR="h:1", MESHRUN_NUM_PROCESSES=2), ENV_PROCESS_ID, "0..1"),
        (dict(MESHRUN_COORDINATOR="h:1", MESHRUN_PROCESS_ID=1), ENV_NUM_PROCESSES, "number of processes"),
        (dict(MESHRUN_NUM_PROCESSES=2, MESHRUN_PROCESS_ID=1), ENV_COORDINATOR, "HOST:PORT"),
        (dict(MESHRUN_LOCAL_DEVICES=0), "MESHRUN_LOCAL_DEVICES", ">= 1"),
    ],
)
def test_bad_settings_are_config_errors(env, field, words):
    with pytest.raises(ConfigError) as e:
        plan(env=_env(**env))
    assert e.value.field == field and words in str(e.value)


def test_process_count_disagreeing_with_the_scheduler():
    env = {**_slurm(4, 0, "1(x4)"), ENV_COORDINATOR: "gpu001:7000", ENV_NUM_PROCESSES: "2"}
    with pytest.raises(ConfigError, match=r"MESHRUN_NUM_PROCESSES: disagrees with the slurm job's 4 tasks"):
        plan(env=env)


def test_parse_coordinator():
    assert parse_coordinator("127.0.0.1:1234") == ("127.0.0.1", 1234)
    assert parse_coordinator("[::1]:80") == ("::1", 80)
    assert parse_coordinator("node-7.cluster:61234") == ("node-7.cluster", 61234)
    for bad in ("::1:80", ":80", "host:", "host"):
        with pytest.raises(ConfigError):
            parse_coordinator(bad)


# ------------------------------------------------------------------ start-up failures caught before jax


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_coordinator_fails_within_the_timeout(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("MESHRUN_", "SLURM_", "OMPI_")):
            monkeypatch.delenv(k)
    port = _free_port()  # nobody listens there
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        initialize(f"127.0.0.1:{port}", 2, 1, timeout_s=1.5)
    took = time.monotonic() - t0
    assert e.value.field == ENV_COORDINATOR and f"127.0.0.1:{port}" in str(e.value)
    assert "cannot reach the coordinator within 1.5 s (Connection refused)" in str(e.value)
    assert 1.4 < took < 5, took


@pytest.mark.parametrize("bind", [None, "127.0.0.1"])
def test_coordinator_port_in_use(monkeypatch, bind):
    """jax segfaults when process 0 cannot bind the coordinator port; meshrun says why first."""
    monkeypatch.delenv("JAX_COORDINATOR_BIND_ADDRESS", raising=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        if bind:
            monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", f"{bind}:{port}")
        with pytest.raises(ConfigError, match=f"port already in use .got '127.0.0.1:{port}'.; choose a free port"):
            initialize(f"127.0.0.1:{port}", 2, 0, timeout_s=2)


# ------------------------------------------------------------------ launch scripts


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(ROOT / script)], check=True)


def _run(args, env=None, timeout=60, **kw):
    return subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})}, **kw
    )


def test_local_dry_run():
    r = _run(
        ["bash", "launch/local.sh", "2", "4", "configs/tiny_cpu.yaml", "train.steps=3", "train.run_dir=runs/x"],
        {"DRY_RUN": "1"},
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2
    for i, line in enumerate(lines):
        assert f"MESHRUN_PROCESS_ID={i} " in line and "MESHRUN_NUM_PROCESSES=2 " in line
        assert "MESHRUN_COORDINATOR=127.0.0.1:" in line and "JAX_COORDINATOR_BIND_ADDRESS=127.0.0.1:" in line
        assert "--xla_force_host_platform_device_count=4" in line and "JAX_PLATFORMS=cpu" in line
        assert line.split(" > ")[1] == f"runs/x/logs/rank{i}.log 2>&1"
        assert "-m meshrun.cli train configs/tiny_cpu.yaml train.steps=3 train.run_dir=runs/x" in line
    assert lines[0].split("MESHRUN_COORDINATOR=")[1].split()[0] == lines[1].split("MESHRUN_COORDINATOR=")[1].split()[0]


def test_local_bad_usage():
    assert _run(["bash", "launch/local.sh", "2"]).returncode == 2
    assert _run(["bash", "launch/local.sh", "x", "4", "configs/tiny_cpu.yaml"]).returncode == 2
    r = _run(["bash", "launch/local.sh", "2", "4", "configs/tiny_cpu.yaml", "mesh.tensr=2"])
    assert r.returncode == 2 and "did you mean 'tensor'" in r.stderr


def test_hosts_dry_run(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("node1 slots=8\n# spare: node9\n\nalice@node2\n")
    r = _run(
        ["bash", "launch/hosts.sh", str(hf), "configs/tiny_cpu.yaml", "train.steps=3"],
        {"DRY_RUN": "1", "PORT": "7000", "MESHRUN_HEARTBEAT_S": "45", "LOG_DIR": "L"},
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert [ln.split(" bash -c ")[0].split()[-1] for ln in lines] == ["node1", "alice@node2"]
    for i, line in enumerate(lines):
        assert f"MESHRUN_COORDINATOR=node1:7000 MESHRUN_NUM_PROCESSES=2 MESHRUN_PROCESS_ID={i} " in line
        assert "MESHRUN_HEARTBEAT_S=45" in line and "source launch/gpu_env.sh" in line
        assert "-m meshrun.cli train configs/tiny_cpu.yaml train.steps=3" in line
        assert line.endswith(f"> L/host{i}.log 2>&1")


def test_slurm_dry_run():
    r = _run(["bash", "launch/slurm.sbatch", "configs/tiny_cpu.yaml", "train.steps=3"], {"DRY_RUN": "1"})
    assert r.returncode == 0, r.stderr
    xla, srun = r.stdout.strip().splitlines()
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in xla
    assert srun.startswith("srun --kill-on-bad-exit=1 ")
    assert srun.endswith("-m meshrun.cli train configs/tiny_cpu.yaml train.steps=3")
    text = (ROOT / "launch/slurm.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=1" in text and "#SBATCH --gpus-per-node=8" in text


def test_gpu_env_flags_are_known_to_this_jaxlib():
    """XLA aborts on an unknown flag: every flag gpu_env.sh sets must parse (XLA:CPU parses them all)."""
    code = "import jax, jax.numpy as jnp; print(float(jnp.ones(3).sum()))"
    r = _run(
        ["bash", "-c", f'source launch/gpu_env.sh && JAX_PLATFORMS=cpu exec "{sys.executable}" -c "{code}"'],
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.strip() == "3.0", r.stderr[-2000:]


def _fake(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_local_stops_the_others_when_a_rank_fails(tmp_path):
    """Rank 1 exits 3 at once; rank 0 (a long sleep) must be stopped and local.sh exit 3 quickly."""
    py = _fake(
        tmp_path / "python",
        f"""[ "$1" = -c ] && exec "{sys.executable}" "$@"
[ "$MESHRUN_PROCESS_ID" = 1 ] && {{ echo boom >&2; exit 3; }}
echo "rank $MESHRUN_PROCESS_ID sleeping"; exec sleep 60
""",
    )
    t0 = time.monotonic()
    r = _run(
        ["bash", "launch/local.sh", "2", "1", "configs/tiny_cpu.yaml", f"train.run_dir={tmp_path}/run"],
        {"PYTHON": py, "GRACE_S": "5"},
    )
    assert r.returncode == 3, r.stderr
    assert "rank 1 (pid" in r.stderr and "failed with status 3" in r.stderr and "boom" in r.stderr
    assert time.monotonic() - t0 < 20
    assert (tmp_path / "run/logs/rank0.log").read_text().startswith("rank 0 sleeping")


def test_local_wall_clock_limit(tmp_path):
    py = _fake(tmp_path / "python", f'[ "$1" = -c ] && exec "{sys.executable}" "$@"\nexec sleep 60\n')
    t0 = time.monotonic()
    r = _run(
        ["bash", "launch/local.sh", "2", "1", "configs/tiny_cpu.yaml", f"train.run_dir={tmp_path}/run"],
        {"PYTHON": py, "WALL_LIMIT_S": "2", "GRACE_S": "2"},
    )
    assert r.returncode == 124 and "WALL_LIMIT_S=2" in r.stderr
    assert time.monotonic() - t0 < 15


def test_hosts_stops_the_others_when_a_host_fails(tmp_path):
    """Stand-in ssh: 'bad' fails, 'good' runs a sleep; hosts.sh must kill the remote pid it logged."""
    ssh = _fake(
        tmp_path / "ssh",
        """host=$1; shift
case "$*" in kill*) exec sh -c "$*" ;; esac
[ "$host" = bad ] && { echo "bad host" >&2; exit 5; }
echo REMOTE_PID=$$; exec sleep 60
""",
    )
    hf = tmp_path / "hosts"
    hf.write_text("good\nbad\n")
    t0 = time.monotonic()
    r = _run(
        ["bash", "launch/hosts.sh", str(hf), "configs/tiny_cpu.yaml"],
        {"SSH": ssh, "LOG_DIR": str(tmp_path / "logs"), "GRACE_S": "3"},
    )
    assert r.returncode == 5, r.stderr
    assert "host 1 (bad) failed with status 5" in r.stderr
    assert time.monotonic() - t0 < 20
    pid = int((tmp_path / "logs/host0.log").read_text().split("REMOTE_PID=")[1].split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_local_unknown_config_key_is_one_line_exit_2():
    r = _run(["bash", "launch/local.sh", "2", "4", "configs/tiny_cpu.yaml", "train.stepz=3"], {"DRY_RUN": "1"})
    assert r.returncode == 2 and r.stdout == ""
    assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    assert "train.stepz" in r.stderr and "steps" in r.stderr
