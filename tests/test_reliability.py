"""What a new user's mistakes and a damaged run dir do: one line on stderr, a documented exit status
(meshrun/errors.py), nothing written before validation, damaged checkpoints moved aside, one run per
run dir. Tiny runs: pipe=1 x data=4, 16-token sequences, synthetic data, 1-4 steps."""

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
from test_train_cli import SMALL as TRAIN_CLI_SMALL

from meshrun.cli.main import main
from meshrun.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs/tiny_cpu.yaml")
SMALL = [*TRAIN_CLI_SMALL, "mesh.pipe=1", "mesh.data=4"]


def train(capsys, run_dir, *over, quiet=True):
    """`meshrun train` in this process -> (exit status, stdout, stderr)."""
    capsys.readouterr()
    argv = ["train", CONFIG, *SMALL, f"train.run_dir={run_dir}", *over] + (["--quiet"] if quiet else [])
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def one_error_line(err: str, command: str = "train") -> str:
    """The stderr of a failed command: exactly one `meshrun CMD: error:` line and no traceback."""
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith(f"meshrun {command}: error:")]
    assert len(lines) == 1, err
    return lines[0]


def metrics_steps(run_dir) -> list[int]:
    return [json.loads(x)["step"] for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def snapshot(d: Path) -> dict[str, int]:
    return {str(p.relative_to(d)): p.stat().st_mtime_ns for p in sorted(d.rglob("*"))}


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A run dir with complete checkpoints at steps 1 and 2 (and metrics for steps 1, 2)."""
    from meshrun.train.loop import run

    d = tmp_path_factory.mktemp("saved") / "run"
    over = [*SMALL, "train.steps=2", "checkpoint.every=1", "checkpoint.keep=3", f"train.run_dir={d}"]
    run(load_config(CONFIG, over), quiet=True)
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["1", "2"]
    return d


@pytest.fixture
def saved(two_checkpoints, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(two_checkpoints, d)
    return d


# ------------------------------------------------------------------ bad input: exit 2, nothing written


def test_layer_split_error_exits_2_before_the_run_dir_exists(tmp_path, capsys):
    """interleaved v=3 with 4 layers on pipe 2: the split check runs before a file or directory is made."""
    run_dir = tmp_path / "new" / "run"
    rc, _, err = train(
        capsys, run_dir, "mesh.pipe=2", "mesh.data=2", "pipeline.schedule=interleaved", "pipeline.virtual=3"
    )
    assert rc == 2, err
    line = one_error_line(err)
    assert "model.n_layers" in line and "6 virtual stages (pipe=2 x virtual=3)" in line and "or fewer stages" in line
    assert not (tmp_path / "new").exists()


def test_binary_config_file_exits_2(tmp_path):
    bad = tmp_path / "model.yaml"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
    cmd = [sys.executable, "-m", "meshrun.cli.main", "train", str(bad)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2, r.stderr
    line = one_error_line(r.stderr)
    assert "config: not UTF-8 text" in line and str(bad) in line
    # --debug (after the subcommand) shows the traceback, the same status
    r = subprocess.run([*cmd, "--debug"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "Traceback" in r.stderr and "not UTF-8 text" in r.stderr


@pytest.mark.parametrize("flag", ["--global-batch", "--seq-len"])
def test_plan_zero_is_refused_not_replaced(flag, capsys):
    rc = main(["plan", "--model", "gpt3-175b", "--cluster", "a100-80g:128x8", flag, "0"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert f"{flag}: invalid value (got 0); use a positive whole number" in one_error_line(err, "plan")


def test_resume_false_into_a_run_dir_with_checkpoints_is_refused(saved, capsys):
    before = snapshot(saved)
    rc, _, err = train(capsys, saved, "train.steps=3", "checkpoint.resume=false", "checkpoint.every=1")
    assert rc == 2, err
    line = one_error_line(err)
    assert "checkpoint.resume" in line and "already holds checkpoints" in line
    assert "new train.run_dir" in line and "checkpoint.resume=true" in line
    assert snapshot(saved) == before  # nothing written, nothing lost


def test_newest_checkpoint_past_train_steps_exits_2_without_saving(saved, capsys):
    before = snapshot(saved)
    rc, _, err = train(capsys, saved, "train.steps=1")
    assert rc == 2, err
    assert "train.steps" in one_error_line(err) and "step 2, past train.steps" in err
    assert snapshot(saved) == before
    assert sorted(p.name for p in (saved / "checkpoints").iterdir()) == ["1", "2"]


def test_pipeline_settings_on_pipe_1_warn(tmp_path, capsys):
    """Valid but without effect on pipe=1: a warning line (the same file runs pipelined elsewhere)."""
    rc, out, err = train(capsys, tmp_path / "r", "train.steps=1", "pipeline.schedule=gpipe", "pipeline.virtual=2")
    assert rc == 0, err
    warning = [ln for ln in err.splitlines() if ln.startswith("meshrun: warning:")]
    assert warning == [
        "meshrun: warning: pipeline.schedule=gpipe, pipeline.virtual=2 ignored: mesh.pipe is 1 (no pipeline); "
        "set mesh.pipe > 1 to use it, or drop it"
    ]
    assert json.loads(out.splitlines()[-1])["step"] == 1


def test_per_op_executor_on_pipe_1_warns():
    from meshrun.train.prepare import config_warnings

    cfg = load_config(CONFIG, [*SMALL, "pipeline.executor=per_op"])
    assert config_warnings(cfg, types.SimpleNamespace(shape={"pipe": 1})) == [
        "pipeline.executor=per_op ignored: mesh.pipe is 1 (no pipeline); set mesh.pipe > 1 to use it, or drop it"
    ]
    assert config_warnings(cfg, types.SimpleNamespace(shape={"pipe": 2})) == []


# ------------------------------------------------------------------ log_every


def test_log_every_thins_metrics_and_progress(tmp_path, capsys):
    """log_every=3 over 4 steps: the first, every 3rd and the last step, in metrics.jsonl and on stderr."""
    rc, out, err = train(capsys, tmp_path / "r", "train.steps=4", "train.log_every=3", quiet=False)
    assert rc == 0, err
    assert metrics_steps(tmp_path / "r") == [1, 3, 4]
    progress = [ln.split()[1] for ln in err.splitlines() if ln.startswith("step ")]
    assert progress == ["1/4", "3/4", "4/4"]
    assert json.loads(out.splitlines()[-1])["step"] == 4


# ------------------------------------------------------------------ damaged checkpoints


def _corrupt(step_dir: Path, what: str) -> None:
    if what == "arrays":  # every array data file of the state, truncated
        files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
        assert files
        for p in files:
            with open(p, "r+b") as f:
                f.truncate(5)
    else:  # the meta item's JSON
        (step_dir / "meta" / "metadata").write_text('{"model": {"d_model": 6')


@pytest.mark.parametrize("what", ["arrays", "metadata"])
def test_damaged_newest_checkpoint_is_moved_aside_and_the_older_one_used(saved, capsys, what):
    _corrupt(saved / "checkpoints" / "2", what)
    rc, out, err = train(capsys, saved, "train.steps=3", "checkpoint.every=1", "checkpoint.keep=3")
    assert rc == 0, err
    assert "Traceback" not in err and "Event loop is closed" not in err
    notes = [ln for ln in err.splitlines() if " is damaged " in ln]  # (the run dir's path says damaged too)
    assert len(notes) == 1 and notes[0].startswith("meshrun: warning: checkpoint step 2 is damaged"), err
    aside = [p.name for p in (saved / "checkpoints").iterdir() if ".damaged-" in p.name]
    assert len(aside) == 1 and aside[0].startswith("2.damaged-")
    # resumed from step 1: steps 2 and 3 trained again, and step 2 has the loss it had the first time
    rows = [json.loads(x) for x in (saved / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 2, 3]
    assert rows[2]["loss"] == pytest.approx(rows[1]["loss"], rel=1e-6)
    assert json.loads(out.splitlines()[-1])["step"] == 3
    # `meshrun checkpoints` shows what happened, with the model each was written for
    assert main(["checkpoints", str(saved), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["checkpoints"]
    want = [(1, "complete"), (2, "complete"), (2, "damaged"), (3, "complete")]
    assert [(c["step"], c["status"]) for c in listed] == want
    assert all(c["model"]["d_model"] == 64 for c in listed if c["status"] == "complete")


def test_no_intact_checkpoint_exits_5_and_keeps_them(saved, capsys):
    for step in ("1", "2"):
        _corrupt(saved / "checkpoints" / step, "arrays")
    rc, _, err = train(capsys, saved, "train.steps=3")
    assert rc == 5, err
    assert "no intact checkpoint" in one_error_line(err)
    names = sorted(p.name for p in (saved / "checkpoints").iterdir())
    assert [n.split(".")[0] for n in names] == ["1", "2"] and all(".damaged-" in n for n in names)
    # a rerun does not silently start over next to them
    rc, _, err = train(capsys, saved, "train.steps=3")
    assert rc == 5 and "no intact checkpoint" in one_error_line(err)


def test_checkpoints_command_lists_partial_and_damaged(saved, capsys):
    ck = saved / "checkpoints"
    shutil.copytree(ck / "2", ck / "7.orbax-checkpoint-tmp-1712345678")  # an interrupted save
    (ck / "2" / "state" / "_METADATA").write_text("{")
    shutil.copytree(ck / "1", ck / "5")
    _corrupt(ck / "5", "arrays")  # metadata intact: only --verify can tell
    assert main(["checkpoints", str(saved)]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [ln.split()[0] + " " + ln.split()[1] for ln in out[2:]]
    assert rows == ["1 complete", "2 damaged", "5 complete", "7 partial"]
    assert "d_model=64" in out[2] and "n_layers=4" in out[2]
    assert main(["checkpoints", str(saved), "--verify", "--json"]) == 5  # damaged STEP/ dirs: not intact
    listed = json.loads(capsys.readouterr().out)["checkpoints"]
    assert [(c["step"], c["status"]) for c in listed] == [
        (1, "complete"),
        (2, "damaged"),
        (5, "damaged"),
        (7, "partial"),
    ]
    assert listed[2]["note"].startswith("arrays unreadable")
    assert main(["checkpoints", str(saved / "nope")]) == 2


# ------------------------------------------------------------------ one run per run dir


def test_second_run_on_a_locked_run_dir_is_refused(saved, capsys):
    from meshrun.runtime.runlock import RunLock

    before = snapshot(saved / "checkpoints")
    with RunLock(saved):  # a run in progress (an flock held by this process)
        rc, _, err = train(capsys, saved, "train.steps=3")
    assert rc == 2, err
    line = one_error_line(err)
    assert f"another meshrun run is using it (pid {os.getpid()} on" in line
    assert snapshot(saved / "checkpoints") == before
    assert not (saved / ".meshrun.lock").exists()  # released


def test_stale_lock_of_a_dead_process_is_taken_over(saved, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (saved / ".meshrun.lock").write_text(f"{dead.pid} somehost 2026-01-01T00:00:00\n")
    rc, out, err = train(capsys, saved, "train.steps=2")  # resumes at 2 = train.steps: nothing to train
    assert rc == 0, err
    assert f"took over the lock of a run that is gone ({dead.pid} somehost" in err
    assert json.loads(out.splitlines()[-1])["step"] == 2
    assert not (saved / ".meshrun.lock").exists()


# ------------------------------------------------------------------ runtime failures: exit 4 / 6 / 1


def test_unreadable_data_file_exits_4(tmp_path, capsys, monkeypatch):
    import meshrun.data.datasets

    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(b"\x01\x00" * 64)

    def denied(path, *a, **k):  # chmod 000 does not stop root: inject the kernel's answer
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(meshrun.data.datasets.np, "memmap", denied)
    rc, _, err = train(capsys, tmp_path / "r", "data.kind=tokens", f"data.path={tokens}")
    assert rc == 4, err
    line = one_error_line(err)
    assert "data.path=" in line and f"cannot read {tokens} (Permission denied)" in line
    assert not (tmp_path / "r").exists()


def test_distributed_failure_after_preflight_exits_6(tmp_path, capsys, monkeypatch):
    import jax

    import meshrun.runtime.distributed as dist

    def fail(*a, **k):
        raise RuntimeError("UNAVAILABLE: failed to connect to all addresses\nmore detail")

    monkeypatch.setattr(jax.distributed, "initialize", fail)
    monkeypatch.setattr(dist, "_preflight", lambda *a: None)  # passed: the failure comes after it
    monkeypatch.setenv("MESHRUN_COORDINATOR", "127.0.0.1:1")
    monkeypatch.setenv("MESHRUN_NUM_PROCESSES", "2")
    monkeypatch.setenv("MESHRUN_PROCESS_ID", "0")
    rc, _, err = train(capsys, tmp_path / "r", "train.steps=1")
    assert rc == 6, err
    line = one_error_line(err)
    assert "process 0 of 2: jax.distributed could not start with the coordinator at 127.0.0.1:1" in line
    assert "UNAVAILABLE: failed to connect to all addresses" in line and "more detail" not in line


@pytest.mark.parametrize("debug", [False, True])
def test_internal_error_is_one_line_unless_debug(capsys, monkeypatch, debug):
    """An unexpected exception (a bug, e.g. a failed assert in explain) -> exit 1, one line; --debug
    adds the traceback."""
    import meshrun.cli.explain

    def broken(cfg):
        raise AssertionError("layout mismatch")

    monkeypatch.setattr(meshrun.cli.explain, "explain", broken)
    monkeypatch.delenv("MESHRUN_DEBUG", raising=False)
    rc = main(["explain", CONFIG, *SMALL, *(["--debug"] if debug else [])])
    err = capsys.readouterr().err
    assert rc == 1
    assert "meshrun explain: error: internal error: AssertionError: layout mismatch" in err
    assert ("Traceback" in err) == debug
    assert ("--debug for the traceback" in err) != debug


def test_out_of_device_memory_is_a_training_error_not_a_bug(capsys, monkeypatch):
    import meshrun.cli.explain

    def oom(cfg):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB\nBufferAssignment...")

    monkeypatch.setattr(meshrun.cli.explain, "explain", oom)
    rc = main(["explain", CONFIG, *SMALL])
    line = one_error_line(capsys.readouterr().err, "explain")
    assert rc == 3
    assert "out of device memory (RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB)" in line
    assert "model.remat=full" in line and "internal error" not in line


def test_explain_checks_a_layout_it_does_not_compile(capsys):
    """Meshes too large to compile here get the prediction only; the layout is still validated."""
    rc = main(["explain", CONFIG, "mesh.data=32"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert "train.global_batch" in one_error_line(err, "explain")  # 16 rows over 4 microbatches x 32 replicas
    interleaved_v3 = ["pipeline.schedule=interleaved", "pipeline.virtual=3"]
    rc = main(["explain", CONFIG, "mesh.data=32", "train.global_batch=128", *interleaved_v3])
    out, err = capsys.readouterr()
    assert rc == 2 and "6 virtual stages (pipe=2 x virtual=3)" in one_error_line(err, "explain")


def test_lock_without_flock_falls_back_to_the_recorded_pid(tmp_path, monkeypatch):
    """Filesystems without flock (ENOLCK): a live pid on this host holds the run dir, a dead one does not."""
    import errno
    import socket

    import meshrun.runtime.runlock as runlock
    from meshrun.errors import ConfigError

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(runlock.fcntl, "flock", no_flock)
    lock_file = tmp_path / runlock.LOCK_NAME
    lock_file.write_text(f"{os.getppid()} {socket.gethostname()} 2026-01-01T00:00:00\n")  # alive
    with pytest.raises(ConfigError, match=rf"another meshrun run is using it \(pid {os.getppid()} on"):
        runlock.RunLock(tmp_path).acquire()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock_file.write_text(f"{dead.pid} {socket.gethostname()} 2026-01-01T00:00:00\n")
    with runlock.RunLock(tmp_path) as lock:
        assert lock.took_over.startswith(str(dead.pid))
        assert lock_file.read_text().split()[0] == str(os.getpid())
    assert not lock_file.exists()


def test_a_run_refused_while_the_holder_writes_its_record_names_the_holder(tmp_path):
    """Two runs started together: the loser's flock can fail before the winner has written its pid
    into the lock file (empty until then). The loser waits for the record (bounded) and names it."""
    import fcntl
    import threading

    from meshrun.errors import ConfigError
    from meshrun.runtime.runlock import LOCK_NAME, RunLock

    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the winner holds the lock, its record not yet written
    writer = threading.Timer(0.3, lambda: os.pwrite(fd, b"4242 winnerhost 2026-12-05T07:00:00\n", 0))
    writer.start()
    try:
        with pytest.raises(ConfigError, match=r"another meshrun run is using it \(pid 4242 on winnerhost\)"):
            RunLock(tmp_path).acquire()
    finally:
        writer.join()
        os.close(fd)


@pytest.mark.parametrize(
    "over, want",
    [
        (["model.attention_impl=cudnn"], "model.attention_impl=cudnn ignored: no GPU (platform cpu)"),
        (["model.fp8_first_last_bf16=true"], "model.fp8_first_last_bf16=True ignored: model.fp8 is none"),
        (["model.fp8=tensorwise", "model.fp8_amax_history=32"], "model.fp8_amax_history=32 ignored: model.fp8 is"),
        (["checkpoint.local_keep=5"], "checkpoint.local_keep=5 ignored: checkpoint.local_every is 0"),
        (["checkpoint.local_dir=/tmp/x"], "checkpoint.local_dir=/tmp/x ignored: checkpoint.local_every is 0"),
    ],
)
def test_settings_without_effect_warn_once_each(over, want):
    """Valid keys that do nothing in this run: one warning line each, naming the key and why."""
    from meshrun.train.prepare import config_warnings

    mesh = types.SimpleNamespace(shape={"pipe": 2})
    (line,) = config_warnings(load_config(CONFIG, [*SMALL, *over]), mesh, platform="cpu")
    assert line.startswith(want), line
    assert config_warnings(load_config(CONFIG, SMALL), mesh, platform="cpu") == []
