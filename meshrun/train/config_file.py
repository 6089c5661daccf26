"""The run dir's config.yaml: the resolved config a run writes, and how a resumed run's config differs.

`write_config` writes it once a run's state was accepted; `warn_config_differs` warns when a resume
changes fields (`config_diff`); `read_config` reads it back.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import jax
import yaml

from meshrun.config import RunConfig, to_dict
from meshrun.config.optimizer import OWN_KEYS
from meshrun.optim.optimizer import schedule_moved
from meshrun.runtime.processes import warn

CONFIG_FILE = "config.yaml"
DEVICES_FILE = "devices.json"  # the devices a run ran on: what `meshrun plan --calibrate` fits a cluster to
# Fields a resume routinely changes without changing the run (a run dir moved or copied): not worth a
# warning. A changed train.steps is listed: it moves the learning-rate schedule's end.
RESUME_FREE = frozenset({"train.run_dir"})


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_diff(old: dict, new: dict) -> list[str]:
    """`section.key old -> new` for every resolved field that differs between two config dicts
    (RESUME_FREE left out)."""
    a, b = _flat(old), _flat(new)
    old_default = lambda k, v: k in OWN_KEYS and OWN_KEYS[k][1] == v  # every run wrote it once
    a = {k: v for k, v in a.items() if k in b or not old_default(k, v)}
    keys = sorted((a.keys() | b.keys()) - RESUME_FREE)
    return [f"{k} {a.get(k)!r} -> {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


def read_config(run_dir: str) -> dict | None:
    """The config.yaml a previous run left in `run_dir` (a dict), None when there is none or it is unreadable."""
    old = None
    with contextlib.suppress(Exception):
        old = yaml.safe_load((Path(run_dir) / CONFIG_FILE).read_text())
    return old if isinstance(old, dict) else None


def write_config(cfg: RunConfig) -> None:
    """RUN_DIR/config.yaml: the resolved config, the one a rerun should use, and RUN_DIR/devices.json:
    the devices it runs on (`devices_record`), each atomic (a temp file renamed over it). Process 0 only."""
    if jax.process_index() != 0:
        return
    _write(Path(cfg.train.run_dir) / CONFIG_FILE, yaml.safe_dump(to_dict(cfg), sort_keys=False))
    _write(Path(cfg.train.run_dir) / DEVICES_FILE, json.dumps(devices_record()) + "\n")


def devices_record() -> dict:
    """The platform, device kind and counts of this run's devices, and the host cores this process may
    run on (a resume rewrites it)."""
    dev = jax.devices()[0]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"platform": dev.platform, "device_kind": dev.device_kind, "devices": jax.device_count(),
            "processes": jax.process_count(), "local_devices": jax.local_device_count(),
            "host_cores": cores}  # fmt: skip


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:  # a full disk: no half-written temp file left, the message names the file
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror, str(path)) from None


def warn_config_differs(cfg: RunConfig, steps: list[int]) -> None:
    """A resume whose config differs from the run dir's config.yaml: one warning listing the fields."""
    old = read_config(cfg.train.run_dir)
    if steps and old is not None and (diff := config_diff(old, to_dict(cfg))):
        warn(f"resuming with a config that differs from {Path(cfg.train.run_dir) / CONFIG_FILE}: " + "; ".join(diff))
        if (moved := schedule_moved(old, cfg, steps[-1] + 1)) is not None:
            warn(moved)
