"""Hangs and stragglers: the step watchdog (`meshrun.runtime.watchdog`), the fault-injection hooks
(`meshrun.runtime.faults`) and straggler detection (`meshrun.runtime.stragglers`).

The 2-process runs use test_multiprocess's shrunken tiny_cpu (2 processes x 4 CPU devices, gloo)
through `launch/local.sh`. One of them, with a slow compile on one rank, is also the uninterrupted
reference of the hang test: its losses are what the restarted run must end with, bit for bit."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_multiprocess import CONFIG, SMALL, _base_env, _losses
from test_reliability import one_error_line

from meshrun.cli.main import main
from meshrun.errors import EXIT_HANG
from meshrun.runtime.stragglers import find_straggler
from meshrun.runtime.watchdog import AUTO_FLOOR_S, AUTO_MULTIPLE, Watchdog

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------ the watchdog alone

FIRE = """
import sys, time
from meshrun.runtime.watchdog import Watchdog
dog = Watchdog(sys.argv[1], timeout_s=0.5, compile_allowance_s=0, process=3, processes=4, known={"mesh": {"data": 4}},
               poll_s=0.05)
dog.phase("step", 1); dog.step_done(1, 0.1)
dog.phase("step", 2)
def stuck_in_a_collective():
    time.sleep(30)
stuck_in_a_collective()
"""


def test_watchdog_fires_with_one_line_a_stack_file_and_exit_7(tmp_path):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", FIRE, str(tmp_path)], capture_output=True, text=True, timeout=60,
                       env={**_base_env(1)})  # fmt: skip
    assert r.returncode == EXIT_HANG == 7, r.stderr
    assert time.monotonic() - t0 < 20  # not the 30 s sleep
    (line,) = r.stderr.strip().splitlines()
    hang = tmp_path / "logs" / "hang-3.txt"
    assert line.startswith("meshrun: watchdog: process 3 of 4: step 2 made no progress for ")
    assert f"in phase 'step' (last completed step 1, timeout 0 s); thread stacks in {hang}; exiting with 7" in line
    first, *stacks = hang.read_text().splitlines()
    rec = json.loads(first)
    assert (rec["step"], rec["phase"], rec["last_completed_step"], rec["process"]) == (2, "step", 1, 3)
    assert rec["mesh"] == {"data": 4} and rec["timeout_s"] == 0.5
    text = "\n".join(stacks)
    assert "in stuck_in_a_collective" in text and "in _watch" in text  # the main thread's and its own


def test_watchdog_limits_auto_floor_multiple_and_compile_allowance(tmp_path):
    dog = Watchdog(str(tmp_path), timeout_s=0, compile_allowance_s=100)
    try:
        assert dog.limit("step") == AUTO_FLOOR_S and dog.limit("first step") == AUTO_FLOOR_S + 100
        for i in range(9):
            dog.step_done(i + 1, 1.0 if i % 3 else 500.0)  # median 1 s: the floor still rules
        assert dog.limit("step") == AUTO_FLOOR_S
        for i in range(20):
            dog.step_done(i + 10, 100.0)
        assert dog.limit("step") == AUTO_MULTIPLE * 100 and dog.limit("compile") == AUTO_MULTIPLE * 100 + 100
    finally:
        dog.close()
    off = Watchdog(str(tmp_path), timeout_s=-1, compile_allowance_s=5)  # off: no thread
    assert off._thread is None
    fixed = Watchdog(str(tmp_path), timeout_s=30, compile_allowance_s=5)
    try:
        assert fixed.limit("save") == 35 and fixed.limit("step") == 30
    finally:
        fixed.close()
    assert not fixed._thread.is_alive()


@pytest.mark.parametrize(
    ("env", "value"),
    [("MESHRUN_FAULT_STALL", "1:5"), ("MESHRUN_FAULT_SLOW", "one:2"), ("MESHRUN_FAULT_SLOW_COMPILE", "0:-3")],
)
def test_bad_fault_hook_setting_exits_2_before_anything_is_written(tmp_path, capsys, monkeypatch, env, value):
    monkeypatch.setenv(env, value)
    rc = main(["train", "--quiet", CONFIG, *SMALL, f"train.run_dir={tmp_path / 'run'}"])
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and f"{env}: not a fault hook setting (got {value!r})" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("key", "value"),
    [("step_timeout", "-2"), ("step_timeout", "nan"), ("compile_allowance", "-1"), ("straggler_threshold", "inf")],
)
def test_bad_watchdog_or_straggler_setting_exits_2(tmp_path, capsys, key, value):
    rc = main(["train", "--quiet", CONFIG, *SMALL, f"train.run_dir={tmp_path / 'run'}", f"train.{key}={value}"])
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and f"train.{key}: " in line and f"(got {value if value == '-2' else ''}" in line
    assert not (tmp_path / "run").exists()


def test_find_straggler_names_the_slow_host_and_not_an_even_run():
    wait = np.array([0.30, 0.10, 0.30, 0.31])
    host = np.array([0.01, 0.21, 0.01, 0.012])
    assert find_straggler(host, wait, 0.2) == (1, pytest.approx(0.2))
    assert find_straggler(np.array([0.01, 0.012, 0.011, 0.01]), wait, 0.2) is None
    assert find_straggler(host, wait, 0.9) is None  # 0.2 s is less than 90% of the 0.31 s step


# ------------------------------------------------------------------ 2 processes: a slow compile, a hang

# synchronous saves: checkpoint 4 is on disk before step 5 (an async one would need the stalled rank)
STEPS = ["train.steps=6", "checkpoint.every=2", "checkpoint.keep=3", "checkpoint.async_save=false",
         "train.step_timeout=12"]  # fmt: skip
STALL_S = 600  # longer than the test may take: the stalled rank must be ended
SLOW_COMPILE_S = 20  # > step_timeout: only the compile allowance keeps the watchdogs quiet


def _launch(run: Path, env_extra: dict, *over: str, timeout: float = 400) -> tuple[subprocess.CompletedProcess, float]:
    env = {**_base_env(4), "PYTHON": sys.executable, "GRACE_S": "5", "WALL_LIMIT_S": str(int(timeout) - 30),
           **env_extra}  # fmt: skip
    cmd = ["bash", "launch/local.sh", "2", "4", CONFIG, *SMALL, f"train.run_dir={run}", *STEPS, *over]
    t0 = time.monotonic()
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return r, time.monotonic() - t0


@pytest.fixture(scope="module")
def slow_compile_run(tmp_path_factory):
    """Rank 1 sleeps SLOW_COMPILE_S before compiling: rank 0 waits for it in step 1 (a first step,
    with the compile allowance). Uninterrupted, 6 steps."""
    run = tmp_path_factory.mktemp("slow_compile") / "run"
    r, took = _launch(run, {"MESHRUN_FAULT_SLOW_COMPILE": f"1:{SLOW_COMPILE_S}"})
    return run, r, took


@pytest.mark.serial
def test_slow_compile_on_one_rank_does_not_trip_the_watchdog(slow_compile_run):
    run, r, took = slow_compile_run
    logs = "".join((run / "logs" / f"rank{i}.log").read_text()[-2000:] for i in range(2))
    assert r.returncode == 0, r.stderr[-2000:] + logs
    assert took > SLOW_COMPILE_S and "watchdog" not in logs
    assert not list((run / "logs").glob("hang-*"))
    assert sorted(_losses(run)) == [1, 2, 3, 4, 5, 6]


@pytest.mark.serial
def test_rank_stalled_alive_is_ended_and_the_job_restarts_to_the_same_loss(slow_compile_run, tmp_path):
    """MESHRUN_FAULT_STALL=1:5:600: rank 1 blocks at step 5 holding its interpreter lock (alive: jax's
    heartbeats go on; its own watchdog cannot run). Rank 0 waits for it in step 5's collectives; its
    watchdog fires after train.step_timeout, exit 7; the launcher ends rank 1 (SIGTERM, then
    SIGKILL); the supervisor restarts from checkpoint 4 and the job ends at the uninterrupted loss."""
    ref_run, ref_r, _ = slow_compile_run
    assert ref_r.returncode == 0
    run = tmp_path / "run"
    r, took = _launch(run, {"MAX_RESTARTS": "1", "MESHRUN_FAULT_STALL": f"1:5:{STALL_S}"}, timeout=STALL_S - 30)
    logs = "".join(p.read_text()[-2000:] for p in sorted((run / "logs").rglob("rank*.log")))
    assert r.returncode == 0, r.stderr[-3000:] + logs
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("meshrun supervise:")]
    assert lines == ["meshrun supervise: restart 1/1: rank 0 failed (status 7: its step watchdog saw a hang); "
                     "resuming from checkpoint step 4 on 2 process(es)"], r.stderr[-3000:]  # fmt: skip
    rank0 = (run / "logs" / "attempt1" / "rank0.log").read_text()
    assert "meshrun: watchdog: process 0 of 2: step 5 made no progress for " in rank0, rank0[-2000:]
    hang = (run / "logs" / "hang-0.txt").read_text().splitlines()
    rec = json.loads(hang[0])
    assert (rec["step"], rec["phase"], rec["last_completed_step"]) == (5, "step", 4)
    assert 12 <= rec["waited_s"] < 20
    restarted = (run / "logs" / "attempt2").stat().st_ctime - rec["time"]  # its rank logs are made at once
    assert restarted < 60, restarted  # launcher: 5 s for the others to end, SIGTERM, 5 s, SIGKILL
    assert rec["mesh"] == {"pipe": 2, "data": 2, "tensor": 2}
    assert any("loop.py" in ln for ln in hang[1:])  # the main thread's stack, inside the train loop
    assert not (run / "logs" / "hang-1.txt").exists()  # the stalled rank could not notice itself
    got, ref = _losses(run), _losses(ref_run)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    assert got == ref  # exactly: the same layout resumes the same computation
    assert json.loads(r.stdout.strip().splitlines()[-1])["loss"] == ref[6]


@pytest.mark.serial
def test_even_run_names_no_straggler(slow_compile_run):
    """The slow-compile run is even after step 1 (step 1 is never timed): its checks name no one."""
    run, r, _ = slow_compile_run
    assert r.returncode == 0
    logs = "".join((run / "logs" / f"rank{i}.log").read_text() for i in range(2))
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert "straggler" not in logs and not any("straggler_process" in row for row in rows)


@pytest.mark.serial
@pytest.mark.slow  # another 2-process run; the even case and find_straggler stay in the default suite
def test_slow_rank_is_named_as_a_straggler(tmp_path):
    """MESHRUN_FAULT_SLOW=1:0.5: process 1 sleeps 0.5 s before every step; the check at step 8
    (steps 2-8) names process 1 and its host, in a warning and in metrics.jsonl."""
    run = tmp_path / "run"
    r, _ = _launch(run, {"MESHRUN_FAULT_SLOW": "1:0.5"}, "train.steps=8", "train.log_every=4")
    logs = "".join((run / "logs" / f"rank{i}.log").read_text() for i in range(2))
    assert r.returncode == 0, r.stderr[-2000:] + logs[-3000:]
    rows = {row["step"]: row for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == [1, 4, 8] and "straggler_process" not in rows[4]  # 3 timed steps: too few to judge
    host = socket.gethostname()
    assert (rows[8]["straggler_process"], rows[8]["straggler_host"]) == (1, host)
    assert 0.4 < rows[8]["straggler_excess_s"] < 1.0
    warning = [ln for ln in logs.splitlines() if "straggler:" in ln]
    assert len(warning) == 1 and warning[0].startswith(f"meshrun: warning: straggler: process 1 (host {host}) ")
    assert "(median of steps 2-8," in warning[0]
