"""The local checkpoint tier (`meshrun.checkpoint.local`): checkpoint.local_every / local_dir / local_keep.

One process (test_reliability's tiny layout, in this interpreter): a run cut short resumes from its
newest local step, newer than the persistent one, to the uninterrupted losses; a damaged or
half-written local step is never taken; bad settings exit 2 before anything is written.
Two processes (test_multiprocess's shrunken tiny_cpu, 2 x 4 CPU devices, gloo, `launch/local.sh`
under the supervisor): one rank SIGKILLed and its local dir deleted (a lost node) resumes from the
persistent tier; both ranks SIGKILLed resume from the local step. Both end at the uninterrupted
run's final loss, bit for bit (the same layout computes the same numbers).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_multiprocess import CONFIG as MP_CONFIG
from test_multiprocess import SMALL as MP_SMALL
from test_multiprocess import _base_env, _rank_pid
from test_reliability import CONFIG, SMALL, one_error_line

from meshrun.checkpoint.local import DATA, local_root, run_key
from meshrun.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


def _rows(run_dir: Path) -> dict[int, dict]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[row["step"]] = row  # a resumed run logs its steps again: the last row counts
    return out


def _losses(run_dir: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in _rows(run_dir).items()}


def _persistent(run_dir: Path) -> list[int]:
    ck = run_dir / "checkpoints"
    return sorted(int(d.name) for d in ck.iterdir() if d.name.isdigit()) if ck.is_dir() else []


def _local(local: Path, run_dir: Path, process: int = 0) -> list[int]:
    d = local_root(str(local), process) / run_key(str(run_dir))
    return sorted(int(e.name) for e in d.iterdir() if e.name.isdigit()) if d.is_dir() else []


def _train(capsys, run_dir: Path, *over: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["train", CONFIG, *SMALL, f"train.run_dir={run_dir}", "train.steps=6", *over])
    return rc, capsys.readouterr().err


# ------------------------------------------------------------------ one process

TIER = ["checkpoint.local_every=1"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: 6 steps."""
    run = tmp_path_factory.mktemp("ref") / "run"
    assert main(["train", "--quiet", CONFIG, *SMALL, f"train.run_dir={run}", "train.steps=6"]) == 0
    return _losses(run)


def _cut(run: Path, after: int, *over: str) -> None:
    """A run stopped after `after` steps without its final save (as if killed between steps)."""
    from meshrun.config import load_config
    from meshrun.train.loop import run as run_loop

    cfg = load_config(CONFIG, [*SMALL, f"train.run_dir={run}", "train.steps=6", *over])
    assert run_loop(cfg, quiet=True, stop_after=after)["step"] == after


def test_cut_run_resumes_from_the_local_step_newer_than_the_persistent_one(reference, tmp_path, capsys):
    """local_every=1 beside every=3, cut after step 5 (before its saves): persistent 3 and local 4
    (none at a persistent step; 2 is deleted at the end, older than persistent 3). The rerun resumes
    from local 4 and ends at the uninterrupted losses, exactly."""
    run, local = tmp_path / "run", tmp_path / "local"
    over = [*TIER, "checkpoint.every=3", f"checkpoint.local_dir={local}"]
    _cut(run, 5, *over)
    assert _persistent(run) == [3] and _local(local, run) == [4]
    rc, err = _train(capsys, run, *over)
    assert rc == 0, err
    resumed = [ln for ln in err.splitlines() if ln.startswith("resumed from")]
    assert resumed == [f"resumed from step 4 (local checkpoint {local}/process-0/{run_key(str(run))}/4)"]
    assert _losses(run) == reference
    assert "saved local checkpoint 5 (" in err and "saved local checkpoint 6" not in err  # the last: for good
    assert _persistent(run) == [3, 6] and _local(local, run) == []  # local steps go once 6 is on disk


@pytest.mark.slow
def test_cut_nvme_run_resumes_from_the_local_step(reference, tmp_path, capsys):
    """The same with the optimizer state on NVMe (the local steps stream the tier's file): the rerun
    resumes from local 4 into the tier's file and ends at the in-memory run's losses, exactly."""
    run, local, off = tmp_path / "run", tmp_path / "local", tmp_path / "off"
    off.mkdir()
    over = [*TIER, "checkpoint.every=3", f"checkpoint.local_dir={local}", "offload.optimizer=nvme",
            f"offload.dir={off}", "offload.budget_mb=0.5"]  # fmt: skip
    _cut(run, 5, *over)
    assert _persistent(run) == [3] and _local(local, run) == [4]
    rc, err = _train(capsys, run, *over)
    assert rc == 0, err
    assert [ln for ln in err.splitlines() if ln.startswith("resumed from")] == [
        f"resumed from step 4 (local checkpoint {local}/process-0/{run_key(str(run))}/4)"
    ]
    assert _losses(run) == reference


def test_damaged_or_half_written_local_step_is_never_taken(reference, tmp_path, capsys):
    """Local 3, 4 and no persistent step; one byte of 4 flipped, a half-written 5 (a killed save's
    temp directory) and a 5 without its data file: the rerun says why 4 cannot be restored, resumes
    from local 3, ends at the uninterrupted losses and deletes the leftovers."""
    run, local = tmp_path / "run", tmp_path / "{process}" / "ram"
    (tmp_path / "0").mkdir()
    over = [*TIER, f"checkpoint.local_dir={local}"]
    _cut(run, 5, *over)
    d = tmp_path / "0" / "ram" / run_key(str(run))  # "{process}" replaced, no process-P subdirectory
    assert _persistent(run) == [] and sorted(p.name for p in d.iterdir()) == ["3", "4"]
    data = d / "4" / DATA
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    shutil.copytree(d / "3", d / "5.tmp-12345")
    shutil.copytree(d / "3", d / "5")
    (d / "5" / DATA).unlink()
    rc, err = _train(capsys, run, *over)
    assert rc == 0, err
    (warning,) = [ln for ln in err.splitlines() if "local checkpoint step 4" in ln]
    assert warning.startswith("meshrun: warning: local checkpoint step 4 cannot be restored (")
    assert "does not match its CRC-32" in warning
    assert [ln for ln in err.splitlines() if ln.startswith("resumed from")] == [
        f"resumed from step 3 (local checkpoint {d}/3)"
    ]
    assert _losses(run) == reference
    assert list(d.iterdir()) == []  # the leftovers deleted; then the local steps, once step 6 is saved for good


@pytest.mark.parametrize(
    ("over", "field", "why"),
    [
        (["checkpoint.local_every=-1"], "checkpoint.local_every", "(got -1)"),
        (["checkpoint.local_every=2"], "checkpoint.local_dir", "required with checkpoint.local_every > 0"),
        (["checkpoint.local_keep=0"], "checkpoint.local_keep", "(got 0)"),
        (["checkpoint.local_every=2", "checkpoint.local_dir=NOPARENT/local"], "checkpoint.local_dir", "does not exist"),
        (["checkpoint.local_every=2", "checkpoint.local_dir=FILE"], "checkpoint.local_dir", "is not a directory"),
        (["checkpoint.local_every=2", "checkpoint.local_dir=LOCKED/local"], "checkpoint.local_dir", "is not writable"),
        (
            ["checkpoint.local_every=2", "checkpoint.local_dir=/proc/meshrun-local"],
            "checkpoint.local_dir",
            "/proc is not writable",
        ),  # os.access passes it for root; the probe file fails
    ],
)
def test_bad_local_tier_setting_exits_2_and_writes_nothing(tmp_path, capsys, over, field, why):
    if "LOCKED" in over[-1] and os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    (tmp_path / "FILE").write_text("x")
    (tmp_path / "LOCKED").mkdir(mode=0o500)
    over = [o.replace("NOPARENT", str(tmp_path / "nope")).replace("FILE", str(tmp_path / "FILE"))
            .replace("LOCKED", str(tmp_path / "LOCKED")) for o in over]  # fmt: skip
    if over[-1].endswith("/proc/meshrun-local") and not os.path.isdir("/proc"):
        pytest.skip("no /proc")
    before = sorted(tmp_path.rglob("*"))
    rc = main(["train", "--quiet", CONFIG, *SMALL, f"train.run_dir={tmp_path / 'run'}", *over])
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and line.startswith(f"meshrun train: error: {field}: ") and why in line, line
    assert sorted(tmp_path.rglob("*")) == before  # nothing written: no run dir, no local dir


# ------------------------------------------------------------------ two processes

MP_STEPS = ["train.steps=8", "checkpoint.every=4", "checkpoint.keep=2", "checkpoint.async_save=false"]


def _supervised(run: Path, local: Path, env_extra: dict, *over: str) -> subprocess.Popen:
    env = {**_base_env(4), "PYTHON": sys.executable, "GRACE_S": "5", "WALL_LIMIT_S": "300", "MAX_RESTARTS": "1",
           "MESHRUN_HEARTBEAT_S": "10", **env_extra}  # fmt: skip
    cmd = ["bash", "launch/local.sh", "2", "4", MP_CONFIG, *MP_SMALL, f"train.run_dir={run}", *MP_STEPS,
           "checkpoint.local_every=1", f"checkpoint.local_dir={local}", *over]  # fmt: skip
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen, timeout: float) -> tuple[str, str]:
    try:
        return p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
        pytest.fail(f"still running after {timeout} s:\n{err[-3000:]}")


@pytest.fixture(scope="module")
def mp_reference(tmp_path_factory):
    """2 processes x 4 devices, 8 steps, uninterrupted (the local tier on: it changes no number)."""
    base = tmp_path_factory.mktemp("mp_ref")
    p = _supervised(base / "run", base / "local", {})
    out, err = _finish(p, 400)
    assert p.returncode == 0, err[-3000:]
    return _losses(base / "run"), json.loads(out.strip().splitlines()[-1])["loss"]


def _kill_when(run: Path, local: Path, sup: subprocess.Popen, *, newer_than: int, deadline: float) -> tuple:
    """Once both processes hold a local step past the persistent step `newer_than`: freeze both
    ranks (so that the job is provably mid-run), return (pids, local step, persistent steps)."""
    r0, r1 = (_rank_pid(run, 1, i, deadline) for i in (0, 1))
    while True:
        both = set(_local(local, run, 0)) & set(_local(local, run, 1))
        if both and max(both) > newer_than and newer_than in _persistent(run):
            break
        assert sup.poll() is None and time.monotonic() < deadline, "attempt 1 made no progress"
        time.sleep(0.02)
    for pid in (r0, r1):
        os.kill(pid, signal.SIGSTOP)
    both = set(_local(local, run, 0)) & set(_local(local, run, 1))
    return (r0, r1), max(both), _persistent(run)


def _resumed_line(run: Path) -> str:
    log = (run / "logs" / "attempt2" / "rank0.log").read_text()
    (line,) = [ln for ln in log.splitlines() if ln.startswith("resumed from")]
    return line


# slow: each rank sleeps before every step, so that the test can stop the job between two steps
SLOW = {"MESHRUN_FAULT_SLOW": "0:0.4"}


def _killed_once(tmp_path, kill):
    """A supervised 2-process run, `kill(r0, r1, local)` once both ranks hold a local step newer than
    persistent step 4, then the restarted job to its end: (run, local, step, persistent steps, kill
    time, stdout, stderr, the supervisor's restart lines)."""
    run, local = tmp_path / "run", tmp_path / "local"
    sup = _supervised(run, local, SLOW)
    try:
        (r0, r1), step, persistent = _kill_when(run, local, sup, newer_than=4, deadline=time.monotonic() + 300)
        killed = time.time()
        kill(r0, r1, local)
        out, err = _finish(sup, 400)
    finally:
        if sup.poll() is None:
            sup.kill()
    assert sup.returncode == 0, err[-3000:]
    assert step > max(persistent) == 4
    restarts = [ln for ln in err.splitlines() if ln.startswith("meshrun supervise:")]
    return run, local, step, persistent, killed, out, err, restarts


@pytest.mark.serial
def test_both_ranks_killed_resume_from_the_local_step(mp_reference, tmp_path):
    """Both ranks SIGKILLed once they hold a local step newer than persistent step 4: the supervisor
    restarts the job, which resumes from that local step and ends at the uninterrupted final loss."""
    ref, ref_final = mp_reference

    def kill_both(r0, r1, local):
        for pid in (r0, r1):
            os.kill(pid, signal.SIGKILL)

    run, local, step, persistent, killed, out, err, restarts = _killed_once(tmp_path, kill_both)
    # both ranks die: the supervisor names whichever exit it sees first
    assert len(restarts) == 1 and re.fullmatch(
        rf"meshrun supervise: restart 1/1: rank [01] died \(signal KILL\); resuming from local checkpoint "
        rf"step {step} on 2 process\(es\)", restarts[0]), err[-3000:]  # fmt: skip
    assert _resumed_line(run).startswith(f"resumed from step {step} (local checkpoint {local}/process-0/")
    got = _losses(run)
    assert got == ref and json.loads(out.strip().splitlines()[-1])["loss"] == ref_final  # exactly
    resumed_s = _rows(run)[step + 1]["time"] - killed
    print(f"both killed at local step {step} (persistent {persistent}): step {step + 1} done {resumed_s:.1f} s later")


@pytest.mark.serial
@pytest.mark.slow  # another 2-process job with a restart; the both-killed case stays in the default suite
def test_lost_node_resumes_from_the_persistent_step(mp_reference, tmp_path):
    """Rank 1 SIGKILLed and its local dir deleted (its host is gone, with its disk): rank 0 exits 6,
    the restarted job finds local steps on process 0 only, says so, resumes from persistent step 4
    and ends at the uninterrupted final loss."""
    ref, ref_final = mp_reference

    def lose_node_1(r0, r1, local):
        os.kill(r1, signal.SIGKILL)
        shutil.rmtree(local / "process-1")
        os.kill(r0, signal.SIGCONT)

    run, local, step, persistent, killed, out, err, restarts = _killed_once(tmp_path, lose_node_1)
    assert len(restarts) == 1 and restarts[0].endswith(
        "resuming from checkpoint step 4 (or a newer local one, if every host holds it) on 2 process(es)"
    ), err[-3000:]
    survivor = (run / "logs" / "attempt1" / "rank0.log").read_text()
    assert "lost contact with another process" in survivor, survivor[-2000:]
    log = (run / "logs" / "attempt2" / "rank0.log").read_text()
    assert re.search(r"^meshrun: warning: local checkpoint step \d+ is not on every process \(missing on process 1\)",
                     log, re.M), log[-3000:]  # fmt: skip
    assert _resumed_line(run) == f"resumed from step 4 ({run}/checkpoints/4)"
    got = _losses(run)
    assert got == ref and json.loads(out.strip().splitlines()[-1])["loss"] == ref_final  # exactly
    detected = (run / "logs" / "attempt1" / "rank0.log").stat().st_mtime - killed
    resumed_s = _rows(run)[5]["time"] - killed
    print(f"lost node at local step {step}: survivor's last line {detected:.1f} s after the kill, "
          f"step 5 done {resumed_s:.1f} s after it")  # fmt: skip
