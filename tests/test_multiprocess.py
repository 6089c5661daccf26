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

pytestmark = pytest.mark.serial  # real ranks with start-up timeouts: run alone (tasks.py test)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/tiny_cpu.yaml"
# tiny_cpu's mesh (data=2 pipe=2 tensor=2, 1F1B) with a smaller model. warmup_steps=8: the learning
# rate of steps 1..8 does not depend on train.steps, so runs of different lengths are comparable.
SMALL = [
    "model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=64",
    "model.max_seq_len=16", "train.seq_len=16", "train.global_batch=8", "pipeline.microbatches=2",
    "optimizer.warmup_steps=8", "data.kind=synthetic",
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
    return [sys.executable, "-m", "meshrun.cli.main", "train", "--quiet", CONFIG, *SMALL, *overrides]


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
from meshrun.runtime.distributed import initialize
info = initialize(timeout_s=60, heartbeat_s=10)
again = initialize()  # a second call reports the running job instead of failing
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from meshrun.config import MeshConfig
from meshrun.runtime.mesh import build_mesh, describe, describe_dict
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
    # the axes of size > 1 (size-1 axes, e.g. expert and context, may be listed too)
    assert {a: n for a, n in d["shape"].items() if n != 1} == {"pipe": 2, "data": 2, "tensor": 2} and d["hosts"] == 2
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
    """1 process x 8 devices, 8 steps, checkpoints at steps 2, 4, 6, 8: the losses every layout must
    match (steps 1-8 are warmup: their learning rate does not depend on train.steps)."""
    run = tmp_path_factory.mktemp("ref") / "run"
    _one_process_train(run, "train.steps=8", "checkpoint.every=2", "checkpoint.keep=4")
    losses = _losses(run)
    assert sorted(losses) == list(range(1, 9)) and _complete_steps(run) == [2, 4, 6, 8]
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


def _rank_pid(run: Path, attempt: int, rank: int, deadline: float) -> int:
    """pid of `meshrun train` rank `rank` of supervisor attempt `attempt` on `run` (from /proc)."""
    want = {f"MESHRUN_ATTEMPT={attempt}".encode(), f"MESHRUN_PROCESS_ID={rank}".encode()}
    while time.monotonic() < deadline:
        for d in Path("/proc").iterdir():
            try:
                cmd = (d / "cmdline").read_bytes()
                if b"meshrun.cli\0train" in cmd and f"train.run_dir={run}".encode() in cmd:
                    if want <= set((d / "environ").read_bytes().split(b"\0")):
                        return int(d.name)
            except (OSError, ValueError):
                continue
        time.sleep(0.05)
    pytest.fail(f"rank {rank} of attempt {attempt} never started")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the ranks through /proc")
def test_supervised_job_restarts_after_sigkill_then_elastic(reference, tmp_path):
    """`MAX_RESTARTS=2 ELASTIC=1 launch/local.sh 2 4`, resuming the 1-process reference's step-2
    checkpoint. Attempt 1 (2 processes): once a checkpoint past step 3 is complete, rank 1 gets
    SIGKILL (both frozen first, so the job is provably mid-run): rank 0 ends with a meshrun line,
    exit 6. Attempt 2 (2 processes): rank 1 is killed again before any step (a host that stays
    down). Attempt 3: 1 process x 4 devices, mesh.data=1, same global batch; it finishes with the
    reference's losses (the 1-process checkpoint also restored on 2 processes in attempt 1)."""
    ref_run, ref = reference
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(ref_run / "checkpoints" / "2", run / "checkpoints" / "2")
    env = {**_base_env(4), "PYTHON": sys.executable, "MAX_RESTARTS": "2", "ELASTIC": "1", "GRACE_S": "5",
           "WALL_LIMIT_S": "200", "MESHRUN_HEARTBEAT_S": "10"}  # fmt: skip
    cmd = ["bash", "launch/local.sh", "2", "4", CONFIG, *SMALL, f"train.run_dir={run}", "train.steps=8",
           "checkpoint.every=1", "checkpoint.keep=3"]  # fmt: skip
    sup = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 400
    try:
        r0, r1 = (_rank_pid(run, 1, i, deadline) for i in (0, 1))
        while not (_complete_steps(run) and _complete_steps(run)[-1] >= 4):
            assert sup.poll() is None and time.monotonic() < deadline, "attempt 1 made no progress"
            time.sleep(0.05)
        for pid in (r0, r1):
            os.kill(pid, signal.SIGSTOP)
        assert max(_losses(run)) < 8  # mid-run
        os.kill(r1, signal.SIGKILL)
        os.kill(r0, signal.SIGCONT)
        os.kill(_rank_pid(run, 2, 1, deadline), signal.SIGKILL)
        out, err = sup.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if sup.poll() is None:
            sup.send_signal(signal.SIGTERM)
            sup.communicate(timeout=60)
    assert sup.returncode == 0, err[-4000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("meshrun supervise:")]
    assert len(lines) == 2, err[-4000:]
    first, second = (ln.removeprefix("meshrun supervise: ") for ln in lines)
    assert first.startswith("restart 1/2: rank 1 died (signal KILL); resuming from checkpoint step")
    assert first.endswith("on 2 process(es)")
    assert second.startswith("restart 2/2: rank 1 died (signal KILL);")
    assert second.endswith("on 1 process(es) (elastic: the failed host did not get going; mesh.data=1)")
    survivor = (run / "logs" / "attempt1" / "rank0.log").read_text()
    print(survivor[-1500:])
    assert "meshrun train: error: process 0 of 2: lost contact with another process" in survivor, survivor[-3000:]
    got = _losses(run)
    assert sorted(got) == list(range(3, 9))  # resumed at step 2; the last row of each step counts
    for s in range(3, 9):
        assert got[s] == pytest.approx(ref[s], rel=RTOL), (s, got[s], ref[s])
    assert json.loads(out.strip().splitlines()[-1])["loss"] == pytest.approx(ref[8], rel=RTOL)
    assert sorted(p.name for p in (run / "logs" / "attempt3").iterdir()) == ["rank0.log"]  # one process


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
