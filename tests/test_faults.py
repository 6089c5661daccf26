"""Faults injected for real, each bounded in time; after each, what survived ("data lost: none").

Single-process runs use test_reliability's tiny layout (pipe=1 x data=4, seq 16, synthetic data);
one killed run is shared by the damaged-checkpoint and full-disk tests. The supervisor's restart
policy runs with stand-in ranks (a shell script as PYTHON for launch/local.sh); the real 2-process
SIGKILL/restart run is in test_multiprocess.py. Also here: damaged files of test_reliability
(truncated arrays, corrupt metadata), the in-process run-dir lock, and NaN at step k (below).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from test_reliability import CONFIG, SMALL, metrics_steps, one_error_line

from meshrun.checkpoint.store import scan
from meshrun.cli.main import main

pytestmark = pytest.mark.serial  # real ranks with start-up timeouts: run alone (tasks.py test)

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 240  # every subprocess here is killed after this long (a hang fails the test, not the suite)


def _losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[r["step"]] = r["loss"]  # a resumed run logs its steps again: the last one counts
    return out


def _status(run_dir: Path) -> list[tuple[int, str]]:
    return [(e.step, e.status) for e in scan(run_dir)]


def _child(code: str, *train_args: str) -> subprocess.Popen:
    """`meshrun train` in a fresh interpreter after running `code` (the fault), stdout/stderr piped."""
    argv = ["train", "--quiet", CONFIG, *SMALL, *train_args]
    script = f"import sys\n{code}\nfrom meshrun.cli.main import main\nsys.exit(main({argv!r}))\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def _finish(p: subprocess.Popen, timeout: float = TIMEOUT) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"still running after {timeout} s:\n{err[-3000:]}")
    return p.returncode, out, err


# SIGKILL this process while orbax commits step 4 in its background thread: the array files are
# written, the STEP.orbax-checkpoint-tmp directory (orbax 0.12) is not yet renamed to STEP.
KILL_IN_ASYNC_COMMIT = """
import os, signal, threading
from orbax.checkpoint._src.path import atomicity

_finalize = atomicity.AtomicRenameTemporaryPath.finalize
async def finalize(self, *a, **k):
    if self.get_final().name == "4":
        assert threading.current_thread() is not threading.main_thread()  # the async writer
        os.kill(os.getpid(), signal.SIGKILL)
    return await _finalize(self, *a, **k)
atomicity.AtomicRenameTemporaryPath.finalize = finalize
"""


@pytest.fixture(scope="module")
def killed_in_async_save(tmp_path_factory):
    """4 steps, async checkpoints every step, SIGKILL during step 4's write: 1-3 complete, 4 partial."""
    d = tmp_path_factory.mktemp("killed") / "run"
    over = [f"train.run_dir={d}", "train.steps=4", "checkpoint.every=1", "checkpoint.keep=5"]
    rc, _, err = _finish(_child(KILL_IN_ASYNC_COMMIT, *over, "checkpoint.async_save=true"))
    assert rc == -signal.SIGKILL, err[-3000:]
    assert _status(d) == [(1, "complete"), (2, "complete"), (3, "complete"), (4, "partial")]
    losses = _losses(d)
    assert sorted(losses) == [1, 2, 3, 4]  # step 4 ran and was logged; only its checkpoint is lost
    return d, over, losses


def test_kill_during_async_save_then_damaged_newest_checkpoints(killed_in_async_save, tmp_path, capsys):
    """Partial step 4 (SIGKILL mid-write) is ignored; step 3 has garbage in its array data (corrupt),
    step 2 lost its OCDBT manifest (deleted file): both are moved aside, the run resumes from step 1
    and recomputes steps 2-4 with the losses the killed run had. Truncated arrays and corrupt
    metadata: test_reliability."""
    src, over, ref = killed_in_async_save
    d = tmp_path / "run"
    shutil.copytree(src, d)
    over = [o.replace(str(src), str(d)) for o in over]
    data = max((d / "checkpoints/3/state").rglob("d/*"), key=lambda p: p.stat().st_size)
    with open(data, "r+b") as f:  # same size, garbage in the middle
        f.seek(data.stat().st_size // 2)
        f.write(os.urandom(4096))
    (d / "checkpoints/2/state/manifest.ocdbt").unlink()
    assert main(["train", "--quiet", CONFIG, *SMALL, *over]) == 0
    out, err = capsys.readouterr()
    notes = [ln for ln in err.splitlines() if "is damaged" in ln]
    assert len(notes) == 2 and "step 3 is damaged" in notes[0] and "step 2 is damaged" in notes[1], err
    assert "Traceback" not in err
    assert json.loads(out.splitlines()[-1])["step"] == 4
    got = _losses(d)
    for step in (2, 3, 4):
        assert got[step] == pytest.approx(ref[step], rel=1e-6), step
    listed = _status(d)
    assert [s for s, st in listed if st == "complete"] == [1, 2, 3, 4]
    assert sorted(s for s, st in listed if st == "damaged") == [2, 3]  # moved aside, kept


def _small_disk(limit: int) -> str:
    """A file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored): writes past `limit` bytes fail with EFBIG,
    as on a full disk (stderr is a pipe, not a file: it still works)."""
    return (
        "import resource, signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))"
    )


def test_full_disk_during_save_keeps_the_older_checkpoints(killed_in_async_save, tmp_path):
    """A 32 KiB file-size limit (the state's ~2.4 MB go to OCDBT files of 100 KB and more,
    metrics.jsonl stays far below): the async save of step 4 fails; it is found when step 5's save
    starts -> exit 5, one line naming step 4 (the save that failed, not the one starting), no absl
    ERROR lines or traceback around it; checkpoints 1-3 stay complete."""
    src, over, _ = killed_in_async_save
    d = tmp_path / "run"
    shutil.copytree(src, d)
    over = [o.replace(str(src), str(d)) for o in over if not o.startswith("train.steps=")]
    rc, _, err = _finish(_child(_small_disk(32 * 1024), *over, "train.steps=5", "checkpoint.async_save=true"))
    assert rc == 5, err[-3000:]
    line = one_error_line(err)
    assert "saving step 4 in" in line and "the checkpoints already there are intact" in line, line
    # no absl ERROR lines (before or after meshrun's), no asyncio repeats; orbax's one warning about
    # the killed run's partial step-4 directory is fine
    assert [ln for ln in err.splitlines() if not ln.startswith(("meshrun", "WARNING:absl:"))] == [], err
    assert [s for s, st in _status(d) if st == "complete"] == [1, 2, 3]


@pytest.mark.parametrize(("limit", "names"), [(0, ".meshrun.lock"), (100, "config.yaml")])
def test_full_disk_at_start_leaves_no_empty_or_temporary_file(tmp_path, limit, names):
    """A disk that is full at start: the run lock (limit 0) or RUN_DIR/config.yaml (100 bytes) cannot be
    written -> exit 4, one line naming the file; no 0-byte lock file and no half-written temp file left."""
    d = tmp_path / "run"
    rc, _, err = _finish(_child(_small_disk(limit), f"train.run_dir={d}", "train.steps=2"))
    assert rc == 4, err[-3000:]
    line = one_error_line(err)
    assert str(d / names) in line, line
    left = sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())
    assert left == [], left


# Two checkpoints of a larger state (about 75 MB each: many reads in flight when one fails).
BIG = ["model.d_model=512", "model.d_ff=1536", "model.n_heads=8", "model.n_kv_heads=8", "model.head_dim=64"]


@pytest.mark.slow
def test_every_checkpoint_damaged_ends_with_its_line_and_nothing_after(tmp_path):
    """Both checkpoints have their largest array file cut in half: exit 5 and stderr is meshrun's own
    lines only (one warning per checkpoint, the error line). Without the filter in
    meshrun/checkpoint/state.py, orbax's read coroutines still pending when the restore failed print
    ~70 lines each when they are collected (thousands of lines, in most runs)."""
    d = tmp_path / "run"
    over = [*BIG, f"train.run_dir={d}", "checkpoint.every=1", "checkpoint.keep=3"]
    rc, _, err = _finish(_child("", *over, "train.steps=2"))
    assert rc == 0, err[-3000:]
    for step in ("1", "2"):
        files = [p for p in (d / "checkpoints" / step / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
        big = max(files, key=lambda p: p.stat().st_size)
        with open(big, "r+b") as f:
            f.truncate(big.stat().st_size // 2)
    rc, _, err = _finish(_child("", *over, "train.steps=3"))
    assert rc == 5, err[-3000:]
    assert "no intact checkpoint" in one_error_line(err)
    lines = err.splitlines()
    assert all(ln.startswith("meshrun") for ln in lines) and len(lines) <= 5, err[-3000:]
    damaged = [ln for ln in lines if " is damaged (" in ln]
    assert len(damaged) == 2 and "See full TensorStore details" not in err, damaged  # the reason, not the spec


def test_abandoned_orbax_read_is_dropped_and_anything_else_kept(monkeypatch):
    """The unraisable hook drops an orbax read coroutine that raised while being closed (GeneratorExit
    as the cause) and passes everything else on."""
    from orbax.checkpoint._src.serialization import serialization

    from meshrun.checkpoint import state

    seen = []
    monkeypatch.delenv("MESHRUN_DEBUG", raising=False)
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u))
    state._quiet_leftover_reads()

    def event(obj, exc):
        return types.SimpleNamespace(object=obj, exc_value=exc, exc_traceback=None, exc_type=type(exc))

    read = types.SimpleNamespace(cr_code=serialization._read_array_index_and_device_put.__code__)
    closed = Exception("Encountered error while reading array index")
    closed.__cause__ = GeneratorExit()
    sys.unraisablehook(event(read, closed))
    assert seen == []
    real = Exception("a real failure")  # no GeneratorExit: not a coroutine being closed
    sys.unraisablehook(event(read, real))
    mine = types.SimpleNamespace(cr_code=test_abandoned_orbax_read_is_dropped_and_anything_else_kept.__code__)
    sys.unraisablehook(event(mine, closed))  # not orbax's
    assert [u.exc_value for u in seen] == [real, closed]


def test_nan_at_step_k_stops_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    """lr=1e30: finite losses for a few steps, then NaN/Inf at step k: exit 3, one line naming step k
    and the last good checkpoint (k-1), which stays complete; nothing is saved at or after k."""
    over = ["train.steps=6", "checkpoint.every=1", "optimizer.lr=1e30", "optimizer.warmup_steps=1",
            f"train.run_dir={tmp_path}"]  # fmt: skip
    rc = main(["train", "--quiet", CONFIG, *SMALL, *over])
    line = one_error_line(capsys.readouterr().err)
    assert rc == 3, line
    k = max(metrics_steps(tmp_path)) + 1
    assert f"at step {k}; stopped without saving" in line and f"(step {k - 1})" in line
    assert ("loss is nan" in line) or ("loss is inf" in line)
    listed = _status(tmp_path)
    assert listed and all(st == "complete" for _, st in listed) and listed[-1][0] == k - 1  # keep=2: k-2, k-1


def test_two_runs_at_once_then_sigterm_during_compile(tmp_path):
    """Two runs started together on one new run dir: one takes the lock, the other exits 2 naming
    it. SIGTERM to the winner as soon as the loser is out (it is compiling its step): it finishes
    step 1, saves it and exits 0."""
    over = [f"train.run_dir={tmp_path}", "train.steps=50", "checkpoint.every=0"]
    ps = [_child("", *over) for _ in range(2)]
    deadline = time.monotonic() + TIMEOUT
    while all(p.poll() is None for p in ps):
        assert time.monotonic() < deadline, "neither run ended"
        time.sleep(0.05)
    loser = next(p for p in ps if p.poll() is not None)
    winner = next(p for p in ps if p is not loser)
    assert winner.poll() is None, "both ended"
    sent = time.time()
    winner.send_signal(signal.SIGTERM)
    rc, out, err = _finish(loser)
    assert rc == 2, err[-3000:]
    assert f"another meshrun run is using it (pid {winner.pid} on" in one_error_line(err)
    rc, out, err = _finish(winner)
    assert rc == 0, err[-3000:]
    assert json.loads(out.splitlines()[-1])["step"] == 1
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert row["step"] == 1 and row["time"] > sent  # the signal came before step 1 ended
    assert _status(tmp_path) == [(1, "complete")]
    assert not (tmp_path / ".meshrun.lock").exists()


# ------------------------------------------------------------------ the supervisor, with stand-in ranks

# Stand-in for PYTHON in launch/local.sh: real python for `-c` and `-m meshrun.cli supervise`; as a rank,
# it follows `plan`: one word per attempt: ok (rank 0 logs a metrics row, prints the result line,
# all exit 0), kill1 (rank 1 SIGKILLs itself, rank 0 logs a row), nan (rank 0
# exits 3), bad (exit 2), down (rank 1 SIGKILLs itself at once, no row). It records its arguments.
RANK = """#!/bin/sh
case "$1 $3" in "-c "*|"-m supervise") exec "{py}" "$@" ;; esac
plan=$(cut -d' ' -f"$MESHRUN_ATTEMPT" {dir}/plan)
echo "attempt $MESHRUN_ATTEMPT rank $MESHRUN_PROCESS_ID/$MESHRUN_NUM_PROCESSES: $*" >> {dir}/calls
row() {{ echo '{{"step": 1}}' >> {dir}/run/metrics.jsonl; }}
case "$plan.$MESHRUN_PROCESS_ID" in
  ok.0) row; echo '{{"step": 2, "loss": 1.0}}'; exit 0 ;;
  ok.*) exit 0 ;;
  kill1.1) kill -9 $$ ;;
  kill1.0) row ;;
  nan.0) row; exit 3 ;;
  bad.*) exit 2 ;;
  down.1) kill -9 $$ ;;
esac
exec sleep 30
"""


def _supervised(tmp_path, plan: str, *over: str, **env) -> subprocess.CompletedProcess:
    (tmp_path / "plan").write_text(plan + "\n")
    (tmp_path / "run").mkdir(exist_ok=True)
    rank = tmp_path / "python"
    rank.write_text(RANK.format(py=sys.executable, dir=tmp_path))
    rank.chmod(rank.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PYTHON": str(rank), "GRACE_S": "2", "PYTHONPATH": str(ROOT), **env}
    cmd = ["bash", "launch/local.sh", "2", "1", CONFIG, f"train.run_dir={tmp_path}/run", *over]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)


def _lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("meshrun supervise:")]


def test_supervisor_restarts_on_a_dead_rank_and_on_nan_then_gives_up(tmp_path):
    r = _supervised(tmp_path, "kill1 ok", MAX_RESTARTS="1")
    assert r.returncode == 0, r.stderr
    assert _lines(r.stderr) == [
        "meshrun supervise: restart 1/1: rank 1 died (signal KILL); resuming from the start (no checkpoint yet) "
        "on 2 process(es)"
    ]
    assert json.loads(r.stdout.splitlines()[-1])["step"] == 2
    assert (tmp_path / "run/logs/attempt1/rank1.log").exists() and (tmp_path / "run/logs/attempt2/rank0.log").exists()
    r = _supervised(tmp_path, "nan nan", MAX_RESTARTS="1")
    assert r.returncode == 3
    assert _lines(r.stderr) == [
        "meshrun supervise: restart 1/1: rank 0 failed (status 3); resuming from the start (no checkpoint yet) "
        "on 2 process(es)",
        "meshrun supervise: rank 0 failed (status 3); no restarts left (MAX_RESTARTS=1), giving up",
    ]


def test_supervisor_elastic_restart_on_fewer_processes_and_no_restart_on_bad_input(tmp_path):
    """Rank 1 dies before training gets going -> the next attempt runs on 1 process with mesh.data
    halved (tiny_cpu: data 2 -> 1; global batch 16 stays)."""
    r = _supervised(tmp_path, "down ok", MAX_RESTARTS="1", ELASTIC="1")
    assert r.returncode == 0, r.stderr
    assert _lines(r.stderr) == [
        "meshrun supervise: restart 1/1: rank 1 died (signal KILL); resuming from the start (no checkpoint yet) "
        "on 1 process(es) (elastic: the failed host did not get going; mesh.data=1)"
    ]
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[-1].startswith("attempt 2 rank 0/1: ") and calls[-1].endswith("mesh.data=1")
    r = _supervised(tmp_path, "bad ok", MAX_RESTARTS="3")
    assert r.returncode == 2
    # both stand-in ranks exit 2 at once: the supervisor names whichever it saw end first
    (line,) = _lines(r.stderr)
    want = r"meshrun supervise: rank [01] failed \(status 2\): bad input, not restarting \(see the line above\)"
    assert re.fullmatch(want, line), line


# ------------------------------------------------------------------ the supervisor, for real

# One attempt of `meshrun supervise --launcher`: `meshrun train --quiet` in this checkout; attempt 1
# SIGKILLs itself right after checkpoint 3 is on disk (a synchronous save), mid-run.
ATTEMPT = """import os, signal, sys
if os.environ.get("MESHRUN_ATTEMPT") == "1":
    from meshrun.checkpoint import state

    _save = state.Checkpointer.save

    def save(self, step, st, force=False):
        started = _save(self, step, st, force)
        if step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return started

    state.Checkpointer.save = save
from meshrun.cli.main import main
sys.exit(main(["train", "--quiet", *sys.argv[1:]]))
"""


@pytest.mark.slow  # ~30 s: two compiles
def test_supervised_restart_reports_the_runs_first_loss(tmp_path):
    """A real supervised run (one process, CPU): attempt 1 is killed after step 3's checkpoint, the
    supervisor restarts it, attempt 2 resumes at step 3 and finishes step 5. The final JSON's
    first_loss is step 1's loss (attempt 1's), not step 4's (attempt 2's first); loss is step 5's."""
    script = tmp_path / "attempt.py"
    script.write_text(ATTEMPT)
    run = tmp_path / "run"
    over = [*SMALL, f"train.run_dir={run}", "train.steps=5", "checkpoint.every=1", "checkpoint.keep=5"]
    cmd = [sys.executable, "-m", "meshrun.cli", "supervise", CONFIG, *over, "--processes", "1",
           "--max-restarts", "1", "--launcher", f"{sys.executable} {script}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("meshrun supervise:")]
    assert lines == ["meshrun supervise: restart 1/1: the job failed with signal KILL; resuming from "
                     "checkpoint step 3 on 1 process(es)"], r.stderr[-3000:]  # fmt: skip
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["step"] == 5 and result["loss"] == rows[4]["loss"]
    assert result["first_loss"] == rows[0]["loss"] and result["first_loss"] != rows[3]["loss"]
