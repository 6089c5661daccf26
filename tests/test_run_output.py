"""What `meshrun train` tells its user: the start-up block, lifecycle lines (resume, init_params,
saves), RUN_DIR/config.yaml, the progress line; `meshrun plot` and a quiet broken pipe."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from meshrun.config import load_config, to_dict
from meshrun.report.startup import startup_lines
from meshrun.train import loop

ROOT = Path(__file__).resolve().parents[1]
# tiny_cpu's mesh (data2 x pipe2 x tensor2, 1F1B) with a smaller model: compiles in seconds.
SMALL = [
    "model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=64",
    "model.max_seq_len=16", "train.seq_len=16", "train.global_batch=8", "pipeline.microbatches=2",
    "data.kind=synthetic",
]  # fmt: skip


def _cfg(run_dir: Path, *over: str):
    return load_config("configs/tiny_cpu.yaml", [*SMALL, f"train.run_dir={run_dir}", *over])


def test_startup_block_config_yaml_and_saves(tmp_path, capsys):
    run_dir = tmp_path / "run"
    cfg = _cfg(run_dir, "train.steps=2", "checkpoint.async_save=false")
    out = loop.run(cfg, startup=startup_lines)
    err = capsys.readouterr().err
    lines = err.splitlines()
    want = [
        r"^model +llama: 0\.\d+M params \(2 layers, d_model 32\)$",
        r"^mesh +pipe2 x data2 x tensor2 = 8 devices on 1 host\(s\)$",
        r"^zero +stage 0: params, gradients and optimizer state whole on each of 2 data-parallel rank\(s\)$",
        r"^batch +8 sequences x 16 tokens = 128 tokens/step$",
        r"^pipeline +2 microbatches, 1f1b, bubble \d+\.\d%$",
        r"^layers +per device \[1, 1\] \(pipeline.balance=even\)$",
        r"^dtypes +compute float32, params float32, gradient reduction float32$",
        r"^optimizer adamw, lr 3\.00e-03, warmup 4 steps, cosine to 3\.00e-04 at step 5; weight decay 0\.01, "
        r"grad clip 1; state float32$",
        r"^memory +predicted \d+\.\d+ [MG]iB per device \(params .*optimizer .*activations .*\)$",
        r"^saves +every 20 steps and at the end, newest 2 kept, blocking$",
        r"^compiling \.\.\.$",
        r"^compiled in \d+\.\d s$",
        r"^step 1/2  loss \d\.\d{4}  [\d,]+ tok/s  \d+ ms/step  lr .*  gnorm \d+\.\d{3}  ETA \d+:\d\d$",
        rf"^saved checkpoint 2 \(\d+\.\d MiB, \d+\.\d s\) in {re.escape(str(run_dir.resolve()))}/checkpoints/2$",
    ]
    found = [next((i for i, ln in enumerate(lines) if re.match(w, ln)), None) for w in want]
    assert None not in found, (want[found.index(None)], err)
    assert found == sorted(found), err  # the block comes before compiling, compiling before step 1
    # the planner's prediction is what the block prints
    from meshrun.planner import predict_memory_jax

    plan = loop.prepare(cfg)[1].plan
    mib = predict_memory_jax(cfg.model, plan.layout, seq_len=16)["total"] / 2**20
    assert f"memory    predicted {mib:.1f} MiB per device" in err
    # config.yaml: the resolved config, one that loads back to the same run
    assert load_config(run_dir / "config.yaml") == cfg
    assert out["step"] == 2


def _block(*over: str) -> dict[str, str]:
    """The start-up block of tiny_cpu (SMALL) with `over`, by label (built, not compiled)."""
    from meshrun.train.plan import build_plan

    cfg = _cfg(Path("unused"), *over)
    shape = {"pipe": cfg.mesh.pipe, "data": cfg.mesh.data, "expert": 1, "context": 1, "tensor": cfg.mesh.tensor}
    mesh = jax.make_mesh(tuple(shape.values()), tuple(shape), devices=jax.devices()[: cfg.mesh.pipe * cfg.mesh.data
                                                                                   * cfg.mesh.tensor])  # fmt: skip
    return {ln[:10].strip(): ln[10:] for ln in startup_lines(cfg, mesh, build_plan(cfg, mesh))}


def test_startup_block_says_what_decides_the_run(tmp_path):
    """ZB-V on pipe=2: layers per device (and each device's two chunks), not the 4 virtual stages; the
    ZeRO stage; dtypes, the fp8 recipe, the optimizer's schedule and state dtype; each offload tier
    and where it rests; the checkpoint policy."""
    zbv = _block("model.n_layers=8", "pipeline.schedule=zb-v", "train.zero=1", "optimizer.decay_steps=50")
    assert zbv["layers"] == "per device [4, 4] in chunks 2+2 2+2 (pipeline.balance=even)"
    assert zbv["zero"] == "stage 1: optimizer state sharded over 2 data-parallel rank(s)"
    assert "cosine to 3.00e-04 at step 50" in zbv["optimizer"] and "offload" not in zbv and "fp8" not in zbv
    (tmp_path / "off").mkdir()
    b = _block("mesh.pipe=1", "mesh.data=4", "train.zero=3", "model.param_dtype=bfloat16", "model.dtype=bfloat16",
               "train.grad_reduce_dtype=bfloat16", "model.fp8=tensorwise", "model.fp8_first_last_bf16=true",
               "optimizer.name=adamw", "optimizer.state_dtype=float32", "offload.optimizer=nvme",
               f"offload.dir={tmp_path / 'off'}", "offload.budget_mb=64", "checkpoint.every=5", "checkpoint.keep=3",
               "checkpoint.local_every=2", f"checkpoint.local_dir={tmp_path / 'local'}")  # fmt: skip
    assert b["zero"] == ("stage 3: params, gradients and optimizer state sharded over 4 data-parallel rank(s) "
                         "(weights gathered once per step; train.zero3_gather=auto)")  # fmt: skip
    assert b["dtypes"] == "compute bfloat16, params bfloat16 (float32 master), gradient reduction bfloat16"
    assert b["fp8"] == "tensorwise scaling; first and last layers in bfloat16"
    delayed = _block("mesh.pipe=1", "mesh.data=4", "model.fp8=delayed")
    assert delayed["fp8"] == "delayed scaling, amax history 16 steps"
    assert b["optimizer"].startswith("adamw, lr ") and b["optimizer"].endswith("; state float32")
    assert b["offload"] == (f"optimizer state + float32 master in NVMe files in {tmp_path / 'off'} (update streamed "
                            "through 64 MiB of host buffers, in place)")  # fmt: skip
    assert b["saves"] == "every 5 steps and at the end, newest 3 kept, async; local every 2 steps, newest 2 kept"
    host = _block("mesh.pipe=1", "mesh.data=4", "train.zero=3", "offload.optimizer=host", "offload.params=true")
    assert host["offload"] == ("optimizer state in host memory (whole-shard update on the device); params in host "
                               "memory, fetched layer by layer; their gradients in host memory")  # fmt: skip


def test_resume_says_from_where_and_what_differs(tmp_path, capsys):
    run_dir = tmp_path / "run"
    first = loop.run(_cfg(run_dir, "train.steps=2", "checkpoint.async_save=false"), quiet=True)
    assert capsys.readouterr().err == ""  # quiet: no block, no progress, no lifecycle lines
    cfg = _cfg(run_dir, "train.steps=3", "mesh.pipe=1", "mesh.data=4")
    second = loop.run(cfg)
    assert second["first_loss"] == first["first_loss"]  # the run's first loss, not this attempt's
    err = capsys.readouterr().err
    ckpt = run_dir.resolve() / "checkpoints" / "2"
    assert f"resumed from step 2 ({ckpt})" in err
    diff = next(ln for ln in err.splitlines() if "differs from" in ln)
    assert "mesh.data 2 -> 4" in diff and "mesh.pipe 2 -> 1" in diff
    assert "model." not in diff and "train.steps 2 -> 3" in diff  # the schedule's end moved
    assert load_config(run_dir / "config.yaml") == cfg  # the rerun's config replaces the old one
    assert "step 3/3" in err and "step 1/" not in err


def test_nan_before_any_checkpoint_says_none_was_saved(tmp_path, capsys):
    from meshrun.cli.main import main

    over = ["train.steps=6", "checkpoint.every=0", "optimizer.lr=1e30", "optimizer.warmup_steps=1",
            f"train.run_dir={tmp_path}"]  # fmt: skip
    assert main(["train", "--quiet", "configs/tiny_cpu.yaml", *SMALL, *over]) == 3
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "stopped without saving. No checkpoint was saved in" in line and "None" not in line, line


def test_start_from_init_params_is_said(tmp_path, capsys):
    from meshrun.checkpoint.params import save_params

    cfg = _cfg(tmp_path / "run", "train.steps=1", "checkpoint.async_save=false")
    _, train_step, _ = loop.prepare(cfg)
    params = jax.device_get(train_step.to_model(train_step.init()).params)
    save_params(tmp_path / "init", params, {"model": to_dict(cfg.model)})
    loop.run(load_config("configs/tiny_cpu.yaml", [*SMALL, f"train.run_dir={tmp_path / 'run'}", "train.steps=1",
                                                  f"checkpoint.init_params={tmp_path / 'init'}"]))  # fmt: skip
    assert f"starting from parameters in {tmp_path / 'init'}" in capsys.readouterr().err


def _metrics(run_dir: Path) -> None:
    run_dir.mkdir()
    rows = [{"step": s, "loss": 5.0 - s / 10, "lr": 1e-3, "tokens_per_s": 1000.0 + s} for s in range(1, 11)]
    rows.append({"step": 10, "val_loss": 4.2})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="meshrun plot needs matplotlib (the plot extra)")
    from meshrun.cli.main import main

    _metrics(tmp_path / "run")
    assert main(["plot", str(tmp_path / "run"), "--out", str(tmp_path / "m.png")]) == 0
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "metrics.png").stat().st_size > 1000
    _metrics(tmp_path / "run2")  # several runs (`meshrun plot runs/quickstart-*`): one figure
    assert main(["plot", str(tmp_path / "run"), str(tmp_path / "run2")]) == 0
    assert (tmp_path / "run" / "metrics-compare.png").stat().st_size > 1000


def test_plot_without_metrics_exits_2(tmp_path, capsys):
    from meshrun.cli.main import main

    assert main(["plot", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_broken_pipe_ends_quietly():
    cmd = f"{sys.executable} -m meshrun.cli schedule --schedule 1f1b --pipe 4 --microbatches 64 | head -n 1"
    r = subprocess.run(["bash", "-c", cmd], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.stdout.count("\n") == 1
    assert "Broken pipe" not in r.stderr and "Traceback" not in r.stderr and "error" not in r.stderr


@pytest.mark.serial
@pytest.mark.slow
def test_rank0_progress_under_local_sh(tmp_path):
    import os

    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHON": sys.executable, "WALL_LIMIT_S": "220", "GRACE_S": "5"}
    env.pop("XLA_FLAGS", None)
    cmd = ["bash", "launch/local.sh", "2", "4", "configs/tiny_cpu.yaml", *SMALL, f"train.run_dir={run_dir}",
           "train.steps=2"]  # fmt: skip
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step 1/2  loss" in r.stderr and "step 2/2  loss" in r.stderr, r.stderr  # rank 0's progress
    assert "mesh      pipe2 x data2 x tensor2 = 8 devices on 2 host(s)" in r.stderr
    assert r.stderr.count("step 2/2") == 1  # rank 0's lines only
    assert json.loads(r.stdout.strip().splitlines()[-1])["step"] == 2
    assert "Terminated" not in r.stderr and "Killed" not in r.stderr


def test_plan_top_shows_distinct_layouts(capsys):
    """`plan --top N`: N different layouts; ZeRO variants of one layout fold into its best row."""
    from meshrun.cli.main import main

    argv = ["plan", "--model", "configs/llama7b_h100.yaml", "--cluster", "h100-80g:1x8", "--top", "4", "--json"]
    assert main(argv) == 0
    configs = json.loads(capsys.readouterr().out)["configs"]
    assert len(configs) == 4
    keys = [tuple(sorted((k, v) for k, v in c.items() if k in LAYOUT_KEYS)) for c in configs]
    assert len(set(keys)) == 4, configs
    assert [c["step_time_s"] for c in configs] == sorted(c["step_time_s"] for c in configs)


LAYOUT_KEYS = ("tensor", "pipe", "data", "expert", "virtual", "microbatches", "micro_batch_size", "remat",
               "sequence_parallel", "schedule")  # fmt: skip
