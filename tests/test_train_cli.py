"""`meshrun train`: resume after SIGKILL, restore onto other meshes, bad input (NaN stop: test_faults)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from meshrun.cli.main import main
from meshrun.config import load_config
from meshrun.train.loop import run

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "train.seq_len=16",
    "model.max_seq_len=16",
    "data.kind=synthetic",
    "train.global_batch=16",
    "optimizer.warmup_steps=1",
    "checkpoint.async_save=false",
]


def losses(run_dir) -> dict[int, float]:
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[r["step"]] = r["loss"]  # a resumed run logs the steps after its checkpoint again
    return out


def test_sigkill_then_restart_continues_with_the_same_losses(tmp_path):
    over = [*SMALL, "mesh.pipe=1", "mesh.data=4", "train.steps=6", "checkpoint.every=2"]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "killed"
    run(load_config(ROOT / "configs/tiny_cpu.yaml", [*over, f"train.run_dir={ref_dir}"]), quiet=True)
    cmd = [
        sys.executable,
        "-m",
        "meshrun.cli.main",
        "train",
        str(ROOT / "configs/tiny_cpu.yaml"),
        *over,
        f"train.run_dir={run_dir}",
        "--quiet",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    deadline = time.time() + 240
    try:
        while time.time() < deadline and proc.poll() is None:
            if (run_dir / "checkpoints" / "4").exists() or len(
                losses(run_dir) if (run_dir / "metrics.jsonl").exists() else {}
            ) >= 5:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "run finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed_at = max(losses(run_dir))
    assert killed_at < 6
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["step"] == 6
    ref, got = losses(ref_dir), losses(run_dir)
    assert sorted(got) == list(range(1, 7))
    for step, loss in got.items():
        assert loss == pytest.approx(ref[step], rel=1e-6), step


@pytest.mark.parametrize(
    "new_mesh",
    [
        ["mesh.data=8", "mesh.pipe=1", "mesh.tensor=1", "pipeline.microbatches=2"],
        pytest.param(["mesh.data=1", "mesh.pipe=4", "mesh.tensor=2"], marks=pytest.mark.slow),
        pytest.param(["pipeline.schedule=interleaved", "pipeline.virtual=2"], marks=pytest.mark.slow),
        pytest.param(
            ["SAVED_INTERLEAVED", "mesh.pipe=1", "mesh.data=4", "pipeline.schedule=1f1b", "pipeline.virtual=1"],
            marks=pytest.mark.slow,
        ),
    ],
    ids=["data8", "pipe4_tensor2", "into_interleaved", "from_interleaved"],
)
def test_checkpoint_restores_onto_another_mesh(tmp_path, new_mesh):
    """Saved on (data2, pipe2, tensor2) at step 2 (1F1B, or interleaved v2 whose run layout keeps the
    layers in pipeline order); continuing on another layout gives step 3's loss."""
    over = [*SMALL, "checkpoint.every=2"]
    if new_mesh[0] == "SAVED_INTERLEAVED":
        over, new_mesh = [*over, "pipeline.schedule=interleaved", "pipeline.virtual=2"], new_mesh[1:]
    base = tmp_path / "base"
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", [*over, "train.steps=3", f"train.run_dir={base}"])
    first = run(cfg, quiet=True, stop_after=2)  # checkpoint at step 2, then stop
    assert first["step"] == 2
    moved = tmp_path / "moved"
    shutil.copytree(base, moved)
    ref = run(cfg, quiet=True)  # the same layout continues
    cont = run(
        load_config(ROOT / "configs/tiny_cpu.yaml", [*over, *new_mesh, "train.steps=3", f"train.run_dir={moved}"]),
        quiet=True,
    )
    assert cont["step"] == 3 and ref["step"] == 3
    assert cont["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    # Loss alone cannot catch a layer-order mix-up (near-identity residual blocks almost commute):
    # the step-3 checkpoints must hold the same weights, layer by layer, in model order.
    a, b = _saved_params(cfg, base, 3), _saved_params(cfg, moved, 3)
    for (path, x), y in zip(jax.tree.leaves_with_path(a), jax.tree.leaves(b), strict=True):
        rel = np.linalg.norm(np.asarray(x) - np.asarray(y)) / np.linalg.norm(np.asarray(y))
        assert rel < 1e-4, (jax.tree_util.keystr(path), rel)


def _saved_params(cfg, run_dir, step):
    from meshrun.checkpoint.state import Checkpointer
    from meshrun.runtime.mesh import build_mesh
    from meshrun.train.loop import checkpoint_meta
    from meshrun.train.step import make_train_step

    train_step = make_train_step(cfg, build_mesh(cfg.mesh))
    with Checkpointer(str(run_dir), cfg.checkpoint, meta=checkpoint_meta(cfg)) as ck:
        return jax.device_get(ck.restore(step, train_step.abstract_state).params)


def _snapshot(d: Path) -> dict[str, float]:
    return {str(p.relative_to(d)): p.stat().st_mtime_ns for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "over, words",
    [
        (["data.kind=tokens", "data.path=missing.bin"], "data.path"),
        (["data.kind=text", "data.glob=nothing/**/*.txt"], "data.glob"),
        (["train.global_batch=12"], "train.global_batch"),
        (["train.run_dir=RUNFILE/sub"], "train.run_dir"),
        (["model.n_heads=3", "model.n_kv_heads=3"], "model.n_heads"),
        (["pipeline.layers_per_stage=[3,2]"], "sum to the 4 stacked layers"),
        (["pipeline.layers_per_stage=[4,0]"], "at least one layer"),
        (["pipeline.layers_per_stage=[1,1,2]"], "one count per stage"),
        (["model.n_layers=5"], "pipeline.balance=auto"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(tmp_path, capsys, over, words):
    (tmp_path / "RUNFILE").write_text("a file, not a directory")
    over = [o.replace("RUNFILE", str(tmp_path / "RUNFILE")) for o in over]
    rc = main(
        ["train", str(ROOT / "configs/tiny_cpu.yaml"), *SMALL, f"train.run_dir={tmp_path / 'r'}", *over, "--quiet"]
    )
    err = capsys.readouterr().err
    assert rc == 2, err
    assert words in err and "Traceback" not in err


def test_incompatible_checkpoint_is_refused_and_kept(tmp_path, capsys):
    over = ["--quiet", *SMALL, "mesh.pipe=1", "mesh.data=4", "train.steps=1", f"train.run_dir={tmp_path}"]
    assert main(["train", str(ROOT / "configs/tiny_cpu.yaml"), *over]) == 0
    before = _snapshot(tmp_path / "checkpoints")
    capsys.readouterr()
    over.remove("--quiet")  # the refusal comes first and alone: no start-up block, no resume warning
    rc = main(["train", str(ROOT / "configs/tiny_cpu.yaml"), *over, "model.d_model=32", "train.steps=2"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line.startswith("meshrun train: error: model.d_model: checkpoint in ") and "was written for" in line
    assert _snapshot(tmp_path / "checkpoints") == before


def test_cli_main_job_prints_json_last_line(tmp_path):
    env = {**os.environ}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshrun.cli.main",
            "train",
            str(ROOT / "configs/tiny_cpu.yaml"),
            *SMALL,
            "train.steps=3",
            f"train.run_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(last) == {"step", "loss", "first_loss", "tokens_per_s", "run_dir"}
    assert last["step"] == 3 and last["tokens_per_s"] > 0
    assert "step 3/3" in done.stderr  # progress


def test_sigterm_saves_at_the_next_step_boundary_and_exits_0(tmp_path):
    over = [*SMALL, "mesh.pipe=1", "mesh.data=4", "train.steps=200", "checkpoint.every=0"]
    cmd = [
        sys.executable,
        "-m",
        "meshrun.cli.main",
        "train",
        str(ROOT / "configs/tiny_cpu.yaml"),
        *over,
        f"train.run_dir={tmp_path}",
        "--quiet",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            if (tmp_path / "metrics.jsonl").exists() and len(losses(tmp_path)) >= 2:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    last = json.loads(out.strip().splitlines()[-1])
    assert 2 <= last["step"] < 200
    saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == [last["step"]]


def test_other_state_dtype_is_refused_and_the_checkpoints_kept(tmp_path, capsys):
    """A resume with another optimizer.state_dtype is a config mismatch: exit 2 naming the field,
    never a checksum failure that moves the intact checkpoints aside."""
    over = ["--quiet", *SMALL, "mesh.pipe=1", "mesh.data=4", "train.steps=1", f"train.run_dir={tmp_path}"]
    assert main(["train", str(ROOT / "configs/tiny_cpu.yaml"), *over]) == 0
    before = _snapshot(tmp_path / "checkpoints")
    capsys.readouterr()
    rc = main(["train", str(ROOT / "configs/tiny_cpu.yaml"), *over, "optimizer.state_dtype=bfloat16", "train.steps=2"])
    err = capsys.readouterr().err
    assert rc == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith("meshrun train: error: optimizer.state_dtype: ") and "float32" in line, line
    assert _snapshot(tmp_path / "checkpoints") == before
    assert main(["train", str(ROOT / "configs/tiny_cpu.yaml"), *over, "train.steps=2"]) == 0  # the original resumes


def _lrs(run_dir) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_resume_with_more_steps_says_the_schedule_moved_and_decay_steps_keeps_it(tmp_path, capsys):
    """A larger train.steps at resume stretches the cosine: one warning line says so and names
    optimizer.decay_steps, which keeps the original horizon (the lr stays at its floor after it)."""
    cfg = str(ROOT / "configs/tiny_cpu.yaml")
    over = ["--quiet", *SMALL, "mesh.pipe=1", "mesh.data=4", "train.steps=4", "optimizer.lr=1e-3"]
    for name in ("a", "b"):
        assert main(["train", cfg, *over, f"train.run_dir={tmp_path / name}"]) == 0
    capsys.readouterr()
    assert main(["train", cfg, *over, f"train.run_dir={tmp_path / 'a'}", "train.steps=6"]) == 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "learning-rate schedule" in ln]
    assert len(lines) == 1 and "ends at step 6 (was 4)" in lines[0] and "optimizer.decay_steps=4" in lines[0], lines
    assert _lrs(tmp_path / "a")[5] > 1e-4  # stretched: back up from the floor
    assert main(["train", cfg, *over, f"train.run_dir={tmp_path / 'b'}", "train.steps=6",
                 "optimizer.decay_steps=4"]) == 0  # fmt: skip
    assert not [ln for ln in capsys.readouterr().err.splitlines() if "learning-rate schedule" in ln]
    lrs = _lrs(tmp_path / "b")
    assert lrs[5] == lrs[6] == pytest.approx(1e-4, rel=1e-6)  # min_lr_ratio 0.1 of lr, from step 4 on
