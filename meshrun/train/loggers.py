"""Where the metrics go besides RUN_DIR/metrics.jsonl (always written): `train.loggers` lists them.

tensorboard: event files in RUN_DIR/tb (tensorboardX). wandb: a Weights & Biases run in RUN_DIR/wandb,
offline unless WANDB_MODE says otherwise (`wandb sync RUN_DIR/wandb/offline-run-*` uploads it later);
project MESHRUN_WANDB_PROJECT or "meshrun", the run named after RUN_DIR. mlflow: an MLflow run in
MLFLOW_TRACKING_URI, else a local file store RUN_DIR/mlruns; experiment MLFLOW_EXPERIMENT_NAME or
"meshrun". Each gets the run's resolved config once at the start and, at every logged step, the
same keys and values as the metrics.jsonl row (numbers only: the step is the x axis). Only process
0 writes (`MetricsLogger`). A logger whose library is not installed is a ConfigError naming the pip
command, raised before the run writes anything (`check_installed`).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from meshrun.errors import ConfigError

# logger -> (the module it imports, the pyproject extra that installs it)
LIBRARIES = {
    "tensorboard": ("tensorboardX", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}


def check_installed(names: tuple[str, ...]) -> None:
    """ConfigError (exit 2) for the first logger of `names` whose library is missing, with its pip command."""
    for name in names:
        if name in LIBRARIES and importlib.util.find_spec(LIBRARIES[name][0]) is None:
            module, extra = LIBRARIES[name]
            raise ConfigError("train.loggers", name, f"pip install 'meshrun[{extra}]' (or drop it from the list)",
                              f"{module} is not installed")  # fmt: skip


def numbers(row: dict[str, Any]) -> dict[str, float]:
    """The metrics.jsonl row's numeric entries but the step and the wall-clock time."""
    return {
        k: v
        for k, v in row.items()
        if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'train.steps': 60, ...}: the config as one level of dotted keys (what mlflow's params take)."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, (list, tuple)) else v
    return out


class TensorBoard:
    def __init__(self, run_dir: Path, config: dict[str, Any]):
        from tensorboardX import SummaryWriter

        self.w = SummaryWriter(str(run_dir / "tb"))
        self.w.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```", 0)

    def log(self, step: int, row: dict[str, Any]) -> None:
        for k, v in numbers(row).items():
            self.w.add_scalar(k, v, step)

    def close(self) -> None:
        self.w.close()


class Wandb:
    def __init__(self, run_dir: Path, config: dict[str, Any]):
        import wandb

        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("MESHRUN_WANDB_PROJECT", "meshrun"), name=run_dir.resolve().name,
            dir=str(run_dir), config=config, mode=os.environ.get("WANDB_MODE", "offline"),
            settings=wandb.Settings(silent=True, console="off"), reinit="create_new",
        )  # fmt: skip

    def log(self, step: int, row: dict[str, Any]) -> None:
        self.run.log(numbers(row), step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    def __init__(self, run_dir: Path, config: dict[str, Any]):
        import mlflow

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # the local file store (mlflow 3 asks for this switch to write one)
            uri = (run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "meshrun")
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
        self.run_id = self.client.create_run(exp_id, run_name=run_dir.resolve().name).info.run_id
        params = [mlflow.entities.Param(k, str(v)) for k, v in flat(config).items()]
        for i in range(0, len(params), 100):  # mlflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, step: int, row: dict[str, Any]) -> None:
        import mlflow

        ms = int(row.get("time", 0) * 1000)
        metrics = [mlflow.entities.Metric(k, float(v), ms, step) for k, v in numbers(row).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


SINKS = {"tensorboard": TensorBoard, "wandb": Wandb, "mlflow": MLflow}


def open_loggers(names: tuple[str, ...], run_dir: Path, config: dict[str, Any] | None) -> list[Any]:
    """The sinks of `names` (jsonl: metrics.jsonl, written by the caller), each given `config` once."""
    check_installed(names)
    return [SINKS[n](run_dir, config or {}) for n in dict.fromkeys(names) if n in SINKS]
