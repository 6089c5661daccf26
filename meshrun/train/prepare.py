"""Everything a run can check before it writes a file: the mesh, the step (with its cross-component
checks), the data, and the settings that have no effect on this mesh."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax.sharding import Mesh

from meshrun.checkpoint.params import check_params
from meshrun.config import PipelineConfig, RunConfig
from meshrun.data.datasets import make_dataset
from meshrun.errors import ConfigError
from meshrun.runtime.mesh import build_mesh
from meshrun.runtime.processes import warn
from meshrun.train.loggers import check_installed
from meshrun.train.restore import fresh_params
from meshrun.train.step import TrainStep, make_train_step


class Prepared(NamedTuple):
    """What `prepare` built: the mesh, the train step and the dataset."""

    mesh: Mesh
    train_step: TrainStep
    ds: Any


def config_warnings(cfg: RunConfig, mesh, platform: str | None = None) -> list[str]:
    """Settings that are valid but have no effect in this run (on this mesh, on `platform`, default
    jax's backend): one line each. `pipeline.schedule`/`virtual`/`executor` (and the layer split:
    `layers_per_stage`, `balance`) with mesh.pipe = 1 warn rather than fail: the same config file is
    often run with `mesh.pipe=1` to debug, and they take effect again as soon as pipe > 1
    (`pipeline.microbatches` still counts: gradient accumulation)."""
    out = []
    if mesh.shape["pipe"] == 1:
        default = PipelineConfig()
        keys = ("schedule", "virtual", "layers_per_stage", "balance", "executor")
        keys = [k for k in keys if getattr(cfg.pipeline, k) != getattr(default, k)]
        if keys:
            given = ", ".join(f"pipeline.{k}={getattr(cfg.pipeline, k)}" for k in keys)
            out.append(f"{given} ignored: mesh.pipe is 1 (no pipeline); set mesh.pipe > 1 to use it, or drop it")
    return out + [f"{k}={v} ignored: {why}; {fix}" for k, v, why, fix in _without_effect(cfg, platform)]


def _without_effect(cfg: RunConfig, platform: str | None) -> list[tuple[str, Any, str, str]]:
    """(key, value, why, fix) of the model and checkpoint settings this run does not use."""
    m, c, out = cfg.model, cfg.checkpoint, []
    platform = platform or jax.default_backend()
    if m.attention_impl == "cudnn" and platform != "gpu":
        out.append(("model.attention_impl", "cudnn", f"no GPU (platform {platform}): XLA's attention runs",
                    "it takes effect on a GPU"))  # fmt: skip
    fp8, history = m.fp8, m.fp8_amax_history
    if m.fp8_first_last_bf16 and fp8 == "none":
        out.append(("model.fp8_first_last_bf16", True, "model.fp8 is none", "set model.fp8, or drop it"))
    if history != type(m).fp8_amax_history and fp8 != "delayed":
        out.append(("model.fp8_amax_history", history, f"model.fp8 is {fp8} (only delayed keeps a history)",
                    "set model.fp8=delayed, or drop it"))  # fmt: skip
    if m.fp8_block != type(m).fp8_block and fp8 != "blockwise":
        out.append(("model.fp8_block", m.fp8_block, f"model.fp8 is {fp8} (only blockwise has tiles)",
                    "set model.fp8=blockwise, or drop it"))  # fmt: skip
    if c.local_every == 0:
        for k in ("local_keep", "local_dir"):
            if getattr(c, k) != getattr(type(c), k):
                out.append((f"checkpoint.{k}", getattr(c, k), "checkpoint.local_every is 0 (no local tier)",
                            "set checkpoint.local_every > 0, or drop it"))  # fmt: skip
    return out


def prepare(cfg: RunConfig, devices: list | None = None) -> Prepared:
    """Everything that can be checked before a file is written: the mesh, the cross-component checks
    (`build_plan`, inside make_train_step, which builds no arrays), the data."""
    mesh = build_mesh(cfg.mesh, devices=devices)
    for msg in config_warnings(cfg, mesh):
        warn(msg)
    check_installed(cfg.train.loggers)  # a logger's missing library: exit 2 before a file is written
    train_step = make_train_step(cfg, mesh)
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch,
                      vocab_used=cfg.model.vocab_used)  # fmt: skip
    if cfg.train.eval_every and ds.val is None:
        raise ConfigError(
            "train.eval_every",
            cfg.train.eval_every,
            "hold out documents with data.kind=prepared and data.val_fraction > 0, or set train.eval_every=0",
            "there is no validation split",
        )
    if cfg.checkpoint.init_params:
        fresh = fresh_params(cfg, train_step)  # state the model's init makes without random numbers
        check_params(cfg.checkpoint.init_params, train_step.abstract_state.params, family=cfg.model.family,
                     fresh=fresh)  # fmt: skip
    return Prepared(mesh, train_step, ds)
