"""The checkpoints of a run dir, read from the files only (jax is not started).

Status of each entry of RUN_DIR/checkpoints:
- complete: STEP/ with its `state` and `meta` items and readable metadata: a run resumes from the
  newest of these. Array data is verified when a run restores it (a failure moves it aside).
- partial: an interrupted save (STEP.orbax-checkpoint-tmp[-*]) or a STEP/ lacking an item; ignored.
- damaged: moved aside after it failed to restore (STEP.damaged-TIME), or STEP/ whose metadata
  cannot be read (with --verify: or whose arrays cannot be read back). meshrun never deletes one; a
  run tries a damaged STEP/ (it fails and is moved aside), never a moved-aside one.
`state.verify_arrays` reads every array back onto one CPU device (`meshrun checkpoints --verify`).
The local tier's directories (`local.py`) are named here too, for the supervisor (`newest_local`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATE, META = "state", "meta"
DAMAGED_TAG = ".damaged-"
_TMP = re.compile(r"^(\d+)\.orbax-checkpoint-tmp(-.*)?$")  # orbax >= 0.12: no suffix
_DAMAGED = re.compile(r"^(\d+)" + re.escape(DAMAGED_TAG) + r".*$")


@dataclass(frozen=True)
class StepInfo:
    step: int
    status: str  # complete | partial | damaged
    name: str  # the entry's name in RUN_DIR/checkpoints
    model: dict[str, Any] | None  # the model config the checkpoint was written for (its meta), if readable
    note: str = ""


def write_error(directory: str | Path) -> str | None:
    """Why this process cannot create a file in `directory` (None: it can). It creates and removes a
    probe file: os.access passes any directory for root, whose writes can still fail (a read-only
    mount, NFS root squash, an immutable directory, /proc or /sys)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".meshrun-probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return e.strerror or str(e)
    return None


def read_json(path: Path) -> tuple[Any, str]:
    try:
        return json.loads(path.read_text()), ""
    except FileNotFoundError:
        return None, f"{path.parent.name}/{path.name} is missing"
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, f"{path.parent.name}/{path.name} is unreadable ({type(e).__name__})"


def _inspect(entry: Path, step: int) -> StepInfo:
    meta, why = read_json(entry / META / "metadata")
    model = meta.get("model") if isinstance(meta, dict) else None
    missing = [i for i in (STATE, META) if not (entry / i).is_dir()]
    if missing:
        return StepInfo(step, "partial", entry.name, model, f"no {' or '.join(missing)} item")
    if why:
        return StepInfo(step, "damaged", entry.name, model, why)
    _, why = read_json(entry / STATE / "_METADATA")
    if why:
        return StepInfo(step, "damaged", entry.name, model, why)
    return StepInfo(step, "complete", entry.name, model)


def scan(run_dir: str | Path, verify: Callable[[Path], str] | None = None) -> list[StepInfo]:
    """Every checkpoint entry of RUN_DIR/checkpoints, by step then name (see the module docstring).
    `verify(entry)`: '' or why a complete entry's arrays are unreadable (`state.verify_arrays`)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    out = []
    for entry in root.iterdir():
        if not entry.is_dir():
            continue
        if entry.name.isdigit():
            info = _inspect(entry, int(entry.name))
            if verify is not None and info.status == "complete" and (why := verify(entry)):
                info = StepInfo(info.step, "damaged", info.name, info.model, why)
            out.append(info)
        elif m := _TMP.match(entry.name):
            meta, _ = read_json(entry / META / "metadata")
            model = meta.get("model") if isinstance(meta, dict) else None
            out.append(StepInfo(int(m.group(1)), "partial", entry.name, model, "interrupted save"))
        elif m := _DAMAGED.match(entry.name):
            meta, _ = read_json(entry / META / "metadata")
            model = meta.get("model") if isinstance(meta, dict) else None
            out.append(StepInfo(int(m.group(1)), "damaged", entry.name, model, "failed to restore; moved aside"))
    return sorted(out, key=lambda s: (s.step, s.name))


def newest_complete(run_dir: str | Path) -> StepInfo | None:
    """The newest complete checkpoint of RUN_DIR (where a resume starts), or None."""
    complete = [e for e in scan(run_dir) if e.status == "complete" and e.name.isdigit()]
    return complete[-1] if complete else None  # scan sorts by step


def local_root(template: str, process: int) -> Path:
    """checkpoint.local_dir for `process`: "{process}" replaced, else a process-P subdirectory."""
    if "{process}" in template:
        return Path(os.path.abspath(template.replace("{process}", str(process))))
    return Path(os.path.abspath(template)) / f"process-{process}"


def run_key(run_dir: str | Path) -> str:
    """The run's directory inside a local dir: its base name + 8 hex digits of its absolute path."""
    path = os.path.abspath(run_dir)
    return f"{os.path.basename(path) or 'run'}-{hashlib.sha1(path.encode()).hexdigest()[:8]}"


def newest_local(template: str, run_dir: str | Path, processes: int) -> tuple[int | None, bool]:
    """(the newest local step that every process's directory holds, as seen from this host; whether
    every process's directory is here). Names only: the bytes are checked when a run restores it."""
    seen, every = [], True
    for p in range(processes):
        d = local_root(template, p) / run_key(run_dir)
        every = every and d.is_dir()
        seen.append({int(e.name) for e in d.iterdir() if e.name.isdigit()} if d.is_dir() else set())
    common = set.intersection(*seen) if seen else set()
    return (max(common) if common else None), every
