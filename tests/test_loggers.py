"""train.loggers: TensorBoard, Weights & Biases (offline) and MLflow (a local file store) get the run's
config once and every metrics.jsonl row's keys and values, read back from what each library wrote;
only process 0 logs; a logger whose library is missing exits 2 with the pip command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshrun.cli.main import main
from meshrun.config import load_config, to_dict
from meshrun.train import loggers, metrics

SMALL = [
    "model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=64",
    "model.max_seq_len=16", "train.seq_len=16", "train.global_batch=8", "pipeline.microbatches=2",
    "data.kind=synthetic", "mesh.pipe=1", "mesh.tensor=1", "mesh.data=2", "train.steps=2",
]  # fmt: skip


def _wandb_records(path: Path) -> list:
    """The protobuf records of an offline run's .wandb file (a LevelDB-style log of 32 KiB blocks
    after a 7-byte header; record header: checksum 4, length 2, type 1: full, first, middle, last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, chunks, buf = 7, [], b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if left < 7 or kind == 0:  # block trailer / padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            chunks.append(buf)
    out = []
    for c in chunks:
        r = pb.Record()
        r.ParseFromString(c)
        out.append(r)
    return out


def test_wandb_mlflow_and_tensorboard_get_the_config_and_the_rows(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboardX")
    from meshrun.train.loop import run

    for var in ("WANDB_MODE", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MESHRUN_WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    run_dir = tmp_path / "run"
    over = [*SMALL, f"train.run_dir={run_dir}", "train.loggers=[jsonl,tensorboard,wandb,mlflow]"]
    cfg = load_config("configs/tiny_cpu.yaml", over)
    import jax

    run(cfg, devices=jax.devices()[:2], quiet=True)
    rows = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    want = {r["step"]: loggers.numbers(r) for r in rows}
    assert sorted(want) == [1, 2] and "loss" in want[1] and "grad_norm" in want[1]

    # wandb: offline, in RUN_DIR/wandb; the config once (in the run record), each row as one history entry
    (wfile,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    recs = _wandb_records(wfile)
    (run_rec,) = [r.run for r in recs if r.WhichOneof("record_type") == "run"]
    logged = {i.key: json.loads(i.value_json) for i in run_rec.config.update if i.key != "_wandb"}
    assert logged == json.loads(json.dumps(to_dict(cfg)))
    hist = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in recs
        if r.WhichOneof("record_type") == "history"
    ]
    got = {h["_step"]: {k: v for k, v in h.items() if not k.startswith("_")} for h in hist}
    assert got == want

    # mlflow: a local file store RUN_DIR/mlruns; the config as dotted params, each key's history by step
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    (ml_run,) = client.search_runs([client.get_experiment_by_name("meshrun").experiment_id])
    assert ml_run.data.params["train.steps"] == "2" and ml_run.data.params["model.d_model"] == "32"
    assert ml_run.data.params == {k: str(v) for k, v in loggers.flat(to_dict(cfg)).items()}
    assert ml_run.info.status == "FINISHED"
    for key in want[1]:
        hist = {m.step: m.value for m in client.get_metric_history(ml_run.info.run_id, key)}
        assert hist == {s: float(want[s][key]) for s in want if key in want[s]}, key

    assert list((run_dir / "tb").glob("events.out.tfevents.*"))


def test_only_process_0_opens_the_loggers(tmp_path, monkeypatch):
    opened = []
    monkeypatch.setattr(metrics, "open_loggers", lambda *a: opened.append(a) or [])
    monkeypatch.setattr(metrics.jax, "process_index", lambda: 1)
    with metrics.MetricsLogger(tmp_path / "r1", total_steps=2, loggers=("wandb",), config={}) as log:
        log.log(1, {"loss": 1.0})
    assert opened == [] and not (tmp_path / "r1").exists()
    monkeypatch.setattr(metrics.jax, "process_index", lambda: 0)
    with metrics.MetricsLogger(tmp_path / "r0", total_steps=2, quiet=True, loggers=("wandb",), config={}) as log:
        log.log(1, {"loss": 1.0})
    assert len(opened) == 1 and (tmp_path / "r0" / "metrics.jsonl").is_file()


def test_a_missing_logger_library_exits_2_with_the_pip_command(tmp_path, monkeypatch, capsys):
    real = loggers.importlib.util.find_spec
    monkeypatch.setattr(loggers.importlib.util, "find_spec", lambda m, *a: None if m == "mlflow" else real(m, *a))
    run_dir = tmp_path / "run"
    over = [*SMALL, "mesh.data=8", f"train.run_dir={run_dir}"]  # the 8 devices of the CLI
    code = main(["train", "configs/tiny_cpu.yaml", *over, "train.loggers=[mlflow]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert (
        "train.loggers" in err[0] and "pip install 'meshrun[mlflow]'" in err[0] and "mlflow is not installed" in err[0]
    )
    assert not (run_dir / "metrics.jsonl").exists()
    assert main(["train", "configs/tiny_cpu.yaml", *over, "train.loggers=[neptune]"]) == 2
    assert "train.loggers: invalid value (got 'neptune')" in capsys.readouterr().err
