"""Real multi-process runs on loopback: 2 processes x 4 simulated CPU devices (gloo collectives).

Every process is started with a deadline and killed in teardown if still alive. The training runs
use a shrunken tiny_cpu model (a few steps, seq 16) because each process compiles on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/tiny_cpu.yaml"
# tiny_cpu's mesh (data=2 pipe=2 tensor=2, 1F1B) with a smaller model. warmup_steps=8: the learning
# rate of steps 1..8 does not depend on train.steps, so runs of different lengths are comparable.
SMALL = [
    "model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=64",
    "model.max_seq_len=16", "train.seq_len=16", "train.global_batch=8", "pipeline.microbatches=2",
    "train.warmup_steps=8", "data.kind=synthetic",
]  # fmt: skip
RTOL = 1e-5  # fp32; the layouts differ only in which process owns a device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _base_env(devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHRUN_", "SLURM_", "OMPI_", "JAX_COORD"))}
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env.update(
        XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    return env


def _rank_env(i: int, n: int, k: int, port: int, **extra) -> dict[str, str]:
    env = _base_env(k)
    env.update(
        MESHRUN_COORDINATOR=f"127.0.0.1:{port}",
        JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}",
        MESHRUN_NUM_PROCESSES=str(n),
        MESHRUN_PROCESS_ID=str(i),
        MESHRUN_LOCAL_DEVICES=str(k),
        **{key: str(v) for key, v in extra.items()},
    )
    return env


class Procs:
    """Started processes; whatever is still alive at teardown gets SIGKILL."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            p = subprocess.Popen(args, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def kill_all(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


@pytest.fixture
def procs():
    ps = Procs()
    yield ps
    ps.kill_all()


def _wait(ps: list[subprocess.Popen], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in ps:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in ps:
                q.kill()
            pytest.fail(f"processes still running after {timeout} s")
    return codes


def _train_cmd(*overrides: str) -> list[str]:
    return [sys.executable, "-m", "meshrun.cli", "train", "--quiet", CONFIG, *SMALL, *overrides]


def _losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


def _complete_steps(run_dir: Path) -> list[int]:
    ck = run_dir / "checkpoints"
    if not ck.is_dir():
        return []
    return sorted(
        int(d.name) for d in ck.iterdir() if d.name.isdigit() and (d / "state").is_dir() and (d / "meta").is_dir()
    )


def _one_process_train(run_dir: Path, *overrides: str, timeout: float = 200) -> dict:
    r = subprocess.run(_train_cmd(f"train.run_dir={run_dir}", *overrides), env=_base_env(8), cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _local_sh_train(run_dir: Path, *overrides: str, timeout: float = 240) -> dict:
    env = {**_base_env(8), "PYTHON": sys.executable, "WALL_LIMIT_S": str(int(timeout) - 20), "GRACE_S": "5"}
    cmd = ["bash", "launch/local.sh", "2", "4", CONFIG, *SMALL, f"train.run_dir={run_dir}", *overrides]
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    logs = "".join(
        (run_dir / "logs" / f"rank{i}.log").read_text()[-2000:] for i in range(2) if (run_dir / "logs").is_dir()
    )
    assert r.returncode == 0, r.stderr[-2000:] + logs
    assert f"logs in {run_dir}/logs" in r.stderr
    for i in range(2):
        assert f"meshrun: process {i}/2 " in (run_dir / "logs" / f"rank{i}.log").read_text()
    return json.loads(r.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ a psum over 2 processes

PSUM_WORKER = """
import json
from meshrun.distributed import initialize
info = initialize(timeout_s=60, heartbeat_s=10)
again = initialize()  # a second call reports the running job instead of failing
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from meshrun.config import MeshConfig
from meshrun.mesh import build_mesh, describe, describe_dict
mesh = build_mesh(MeshConfig(data=2, pipe=2, tensor=2))
axes = mesh.axis_names
# position j of the flattened mesh holds j + 1; a psum over every axis gives 1 + ... + 8 = 36 everywhere
x = jax.make_array_from_callback((8,), NamedSharding(mesh, P(axes)), lambda idx: np.arange(1, 9, dtype=np.float32)[idx])
f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, axes), mesh=mesh, in_specs=P(axes), out_specs=P()))
total = f(x)
g = jax.shard_map(lambda v: jax.lax.psum(v, "tensor"), mesh=mesh, in_specs=P(axes), out_specs=P(axes))
tensor_sum = jax.jit(g)(x)
mine = {int(s.index[0].start): float(s.data[0]) for s in tensor_sum.addressable_shards}
print(json.dumps({"info": info, "again": again, "sum": float(total[0]), "tensor_sums": mine,
                  "mesh": describe_dict(mesh), "text": describe(mesh),
                  "process_of": {str(d.id): d.process_index for d in jax.devices()}}))
"""


@pytest.mark.parametrize("via", ["env", "slurm", "ompi"])
def test_psum_across_two_processes(procs, tmp_path, via):
    """2 processes x 4 devices = one 8-device mesh; each process sees the same mesh and the psum."""
    port = _free_port()
    ps = []
    for i in range(2):
        if via == "env":
            env = _rank_env(i, 2, 4, port)
        else:  # what srun / mpirun export for task i of 2 on one node; jax finds the coordinator itself
            env = {**_base_env(4), "MESHRUN_LOCAL_DEVICES": "4", "JAX_COORDINATOR_PORT": str(port)}
            if via == "slurm":
                env.update(SLURM_JOB_ID="7", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
                           SLURM_PROCID=str(i), SLURM_LOCALID=str(i), SLURM_STEP_TASKS_PER_NODE="2")  # fmt: skip
            else:
                env.update(OMPI_MCA_orte_hnp_uri="4096.0;tcp://127.0.0.1:1", OMPI_COMM_WORLD_SIZE="2",
                           OMPI_COMM_WORLD_RANK=str(i), OMPI_COMM_WORLD_LOCAL_RANK=str(i),
                           OMPI_COMM_WORLD_LOCAL_SIZE="2")  # fmt: skip
        ps.append(procs.start([sys.executable, "-c", PSUM_WORKER], env, tmp_path / f"rank{i}.log"))
    codes = _wait(ps, 90)
    logs = [(tmp_path / f"rank{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], "\n".join(x[-2000:] for x in logs)
    outs = [json.loads([ln for ln in log.splitlines() if ln.startswith("{")][-1]) for log in logs]
    for i, (out, log) in enumerate(zip(outs, logs)):
        info = out["info"]
        assert (info["mode"], info["process_id"], info["num_processes"]) == (via if via != "env" else "explicit", i, 2)
        assert (info["local_devices"], info["global_devices"]) == (4, 8)
        again = out["again"]
        assert (again["mode"], again["process_id"], again["num_processes"], again["global_devices"]) == (
            "initialized",
            i,
            2,
            8,
        )
        assert re.search(rf"^meshrun: process {i}/2 host=\S+ local_devices=4 \(cpu\) global_devices=8 "
                         rf"coordinator=\S+:{port} via=", log, re.M)  # fmt: skip
        assert out["sum"] == 36.0
        assert "(2 host(s), 8 devices)" in out["text"]
    assert outs[0]["mesh"] == outs[1]["mesh"]
    d, proc = outs[0]["mesh"], outs[0]["process_of"]
    assert d["shape"] == {"pipe": 2, "data": 2, "expert": 1, "tensor": 2} and d["hosts"] == 2
    assert {k: v for k, v in d["host_of"].items()} == proc  # describe's host = the owning process
    assert sorted(proc.values()) == [0] * 4 + [1] * 4
    for g in d["groups"]["tensor"]:
        assert len({proc[str(i)] for i in g}) == 1  # tensor groups stay inside a process (NVLink)
    for g in d["groups"]["pipe"]:
        assert len({proc[str(i)] for i in g}) == 2  # pipe crosses processes (the outer axis)
    # tensor psum: positions (2j, 2j+1) are one tensor group -> both hold (2j+1) + (2j+2)
    for out in outs:
        assert len(out["tensor_sums"]) == 4
        for pos, v in out["tensor_sums"].items():
            j = int(pos) // 2
            assert v == (2 * j + 1) + (2 * j + 2)


# ------------------------------------------------------------------ training: 2 processes == 1 process


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """1 process x 8 devices, 4 steps, checkpoints at steps 2 and 4: the losses every layout must match."""
    run = tmp_path_factory.mktemp("ref") / "run"
    _one_process_train(run, "train.steps=4", "checkpoint.every=2")
    losses = _losses(run)
    assert sorted(losses) == [1, 2, 3, 4] and _complete_steps(run) == [2, 4]
    return run, losses


@pytest.mark.slow
def test_two_processes_match_one_and_checkpoint_restores_on_one(reference, tmp_path):
    ref_run, ref = reference
    run = tmp_path / "two"
    out = _local_sh_train(run, "train.steps=2")
    got = _losses(run)
    assert sorted(got) == [1, 2] and _complete_steps(run) == [2]
    for s in (1, 2):
        assert got[s] == pytest.approx(ref[s], rel=RTOL), (s, got[s], ref[s])
    assert out["loss"] == pytest.approx(ref[2], rel=RTOL)
    # the 2-process checkpoint resumes in 1 process and continues with the reference losses
    out = _one_process_train(run, "train.steps=4")
    got = _losses(run)
    assert out["step"] == 4 and sorted(got) == [1, 2, 3, 4]
    for s in (3, 4):
        assert got[s] == pytest.approx(ref[s], rel=RTOL), (s, got[s], ref[s])


@pytest.mark.slow
def test_one_process_checkpoint_restores_on_two_then_sigkill_ends_the_survivor(reference, procs, tmp_path):
    """Resume a 1-process checkpoint on 2 processes (same losses), then SIGKILL rank 1: rank 0 must
    exit non-zero within 60 s naming the lost task, and the newest checkpoint must survive."""
    ref_run, ref = reference
    run = tmp_path / "two"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(ref_run / "checkpoints" / "2", run / "checkpoints" / "2")
    port = _free_port()
    args = _train_cmd(f"train.run_dir={run}", "train.steps=1000", "checkpoint.every=1", "checkpoint.keep=3")
    ps = [procs.start(args, _rank_env(i, 2, 4, port, MESHRUN_HEARTBEAT_S=10), run / f"rank{i}.log") for i in range(2)]
    deadline = time.monotonic() + 180
    while True:  # until steps 3, 4 are logged and a checkpoint past step 4 is complete
        assert all(p.poll() is None for p in ps), "a rank ended early:\n" + (run / "rank0.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no progress:\n" + (run / "rank0.log").read_text()[-3000:]
        steps = _complete_steps(run)
        if (run / "metrics.jsonl").exists() and steps and steps[-1] >= 5:
            break
        time.sleep(0.25)
    saved = _complete_steps(run)[-1]
    got = _losses(run)
    for s in (3, 4):
        assert got[s] == pytest.approx(ref[s], rel=RTOL), (s, got[s], ref[s])

    ps[1].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    try:
        code = ps[0].wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("rank 0 still running 60 s after rank 1 was killed")
    took = time.monotonic() - t0
    log = (run / "rank0.log").read_text()
    print(f"rank 0 exited with {code} {took:.1f} s after SIGKILL of rank 1")
    assert code != 0
    assert re.search(r"tasks are unhealthy \(stopped sending heartbeats\):\s*\n?\s*1\b", log), log[-3000:]
    assert _complete_steps(run)[-1] >= saved  # the newest complete checkpoint is still there
    meta = json.loads((run / "checkpoints" / str(saved) / "meta" / "metadata").read_text())
    assert meta["model"]["d_model"] == 32


# ------------------------------------------------------------------ bad input


def test_unreachable_coordinator_cli(tmp_path):
    port = _free_port()
    env = _rank_env(1, 2, 4, port, MESHRUN_INIT_TIMEOUT_S=3)
    t0 = time.monotonic()
    r = subprocess.run(_train_cmd(f"train.run_dir={tmp_path}/run"), env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    took = time.monotonic() - t0
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert (f"meshrun train: error: MESHRUN_COORDINATOR: process 1 cannot reach the coordinator within 3 s "
            f"(Connection refused) (got '127.0.0.1:{port}')") in r.stderr  # fmt: skip
    assert took < 3 + 15, took  # start-up time-out + interpreter/import time


@pytest.mark.parametrize("counts", [(2, 3), (3, 2)])
def test_inconsistent_process_counts(procs, tmp_path, counts):
    """(2, 3): both join a 2-process coordinator, the handshake reports the disagreement at once.
    (3, 2): the coordinator waits for a 3rd process that never comes: both end at the time-out."""
    port = _free_port()
    ps = [procs.start(_train_cmd(f"train.run_dir={tmp_path}/run"),
                      _rank_env(i, counts[i], 4, port, MESHRUN_INIT_TIMEOUT_S=8), tmp_path / f"rank{i}.log")
          for i in range(2)]  # fmt: skip
    t0 = time.monotonic()
    codes = _wait(ps, 60)
    took = time.monotonic() - t0
    logs = [(tmp_path / f"rank{i}.log").read_text() for i in range(2)]
    assert codes == [2, 2], logs
    for log in logs:
        assert "Traceback" not in log
        if counts == (2, 3):
            assert ("MESHRUN_NUM_PROCESSES: processes disagree on the process count "
                    "(got 'process 0: 2, process 1: 3'); give every process the same count") in log  # fmt: skip
        else:
            assert "start-up timed out after 8 s" in log and f"coordinator at 127.0.0.1:{port}" in log
    assert took < 8 + 20, took
