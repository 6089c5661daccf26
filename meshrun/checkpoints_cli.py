"""`meshrun checkpoints RUN_DIR [--json]`: the checkpoints of a run, their status and model config.

Status of each entry of RUN_DIR/checkpoints (read from the files only; jax is not started):
- complete: STEP/ with its `state` and `meta` items and readable metadata: a run resumes from the
  newest of these. Array data is verified when a run restores it (a failure moves it aside).
- partial: an interrupted save (STEP.orbax-checkpoint-tmp[-*]) or a STEP/ lacking an item; ignored.
- damaged: moved aside after it failed to restore (STEP.damaged-TIME), or STEP/ whose metadata
  cannot be read (with --verify: or whose arrays cannot be read back). meshrun never deletes one; a
  run tries a damaged STEP/ (it fails and is moved aside), never a moved-aside one.
--verify reads every array of each complete checkpoint back onto one CPU device (host memory for
the whole state: meant for small and medium models; a run verifies the one it restores anyway).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from meshrun.errors import ConfigError

STATE, META = "state", "meta"
DAMAGED_TAG = ".damaged-"
_TMP = re.compile(r"^(\d+)\.orbax-checkpoint-tmp(-.*)?$")  # orbax >= 0.12: no suffix
_DAMAGED = re.compile(r"^(\d+)" + re.escape(DAMAGED_TAG) + r".*$")
# ModelConfig fields shown in the table (all of them with --json)
SUMMARY_KEYS = ("vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len", "n_experts", "dtype")


@dataclass(frozen=True)
class StepInfo:
    step: int
    status: str  # complete | partial | damaged
    name: str  # the entry's name in RUN_DIR/checkpoints
    model: dict[str, Any] | None  # the model config the checkpoint was written for (its meta), if readable
    note: str = ""


def _read_json(path: Path) -> tuple[Any, str]:
    try:
        return json.loads(path.read_text()), ""
    except FileNotFoundError:
        return None, f"{path.parent.name}/{path.name} is missing"
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, f"{path.parent.name}/{path.name} is unreadable ({type(e).__name__})"


def _inspect(entry: Path, step: int) -> StepInfo:
    meta, why = _read_json(entry / META / "metadata")
    model = meta.get("model") if isinstance(meta, dict) else None
    missing = [i for i in (STATE, META) if not (entry / i).is_dir()]
    if missing:
        return StepInfo(step, "partial", entry.name, model, f"no {' or '.join(missing)} item")
    if why:
        return StepInfo(step, "damaged", entry.name, model, why)
    _, why = _read_json(entry / STATE / "_METADATA")
    if why:
        return StepInfo(step, "damaged", entry.name, model, why)
    return StepInfo(step, "complete", entry.name, model)


def verify_arrays(entry: Path) -> str:
    """'' when every array of STEP/state reads back (onto one CPU device), else why not."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax is imported: no accelerator needed
    import jax
    import orbax.checkpoint as ocp

    from meshrun.checkpoint import _quiet_absl, _quiet_leftover_reads

    is_array = lambda x: hasattr(x, "shape") and hasattr(x, "dtype")  # noqa: E731
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    try:
        with _quiet_absl():
            ck = ocp.StandardCheckpointer()
            meta = ck.metadata(entry / STATE)
            tree = getattr(meta, "item_metadata", meta)
            tree = getattr(tree, "tree", tree)
            target = jax.tree.map(
                lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=cpu), tree, is_leaf=is_array
            )
            state = jax.block_until_ready(ck.restore(entry / STATE, target))
    except Exception as e:  # noqa: BLE001 - TensorStore, JSON, orbax and OS errors all mean "unreadable"
        _quiet_leftover_reads()
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        return f"arrays unreadable ({type(e).__name__}: {first[:160]})"
    from meshrun import checksum
    from meshrun.checkpoint import _path_key

    meta, _ = _read_json(entry / META / "metadata")
    bad = checksum.mismatches((meta or {}).get("checksums", {}), state, _path_key)
    return f"array data does not match its checksum: {', '.join(bad[:3])}" if bad else ""


def scan(run_dir: str | Path, verify: bool = False) -> list[StepInfo]:
    """Every checkpoint entry of RUN_DIR/checkpoints, by step then name (see the module docstring).
    `verify`: read the arrays of each complete one back (`verify_arrays`)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    out = []
    for entry in root.iterdir():
        if not entry.is_dir():
            continue
        if entry.name.isdigit():
            info = _inspect(entry, int(entry.name))
            if verify and info.status == "complete" and (why := verify_arrays(entry)):
                info = StepInfo(info.step, "damaged", info.name, info.model, why)
            out.append(info)
        elif m := _TMP.match(entry.name):
            meta, _ = _read_json(entry / META / "metadata")
            model = meta.get("model") if isinstance(meta, dict) else None
            out.append(StepInfo(int(m.group(1)), "partial", entry.name, model, "interrupted save"))
        elif m := _DAMAGED.match(entry.name):
            meta, _ = _read_json(entry / META / "metadata")
            model = meta.get("model") if isinstance(meta, dict) else None
            out.append(StepInfo(int(m.group(1)), "damaged", entry.name, model, "failed to restore; moved aside"))
    return sorted(out, key=lambda s: (s.step, s.name))


def newest_complete(run_dir: str | Path) -> StepInfo | None:
    """The newest complete checkpoint of RUN_DIR (where a resume starts), or None."""
    complete = [e for e in scan(run_dir) if e.status == "complete" and e.name.isdigit()]
    return complete[-1] if complete else None  # scan sorts by step


def model_summary(model: dict[str, Any] | None) -> str:
    if not model:
        return "?"
    keys = [k for k in SUMMARY_KEYS if k in model and not (k == "n_experts" and not model[k])]
    return " ".join(f"{k}={model[k]}" for k in keys)


def format_table(run_dir: str, steps: list[StepInfo]) -> str:
    root = Path(run_dir) / "checkpoints"
    if not steps:
        return f"no checkpoints in {root}"
    rows = [(str(s.step), s.status, model_summary(s.model), s.name + (f": {s.note}" if s.note else "")) for s in steps]
    head = ("step", "status", "model", "entry")
    width = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
    lines = [f"checkpoints in {root} (a run resumes from the newest complete one)"]
    for r in [head, *rows]:
        lines.append("  ".join([r[0].rjust(width[0]), r[1].ljust(width[1]), r[2].ljust(width[2]), r[3]]).rstrip())
    return "\n".join(lines)


def register(sub) -> None:
    p = sub.add_parser("checkpoints", help="list a run's checkpoints: step, status, model config")
    p.add_argument("run_dir", help="the run's train.run_dir")
    p.add_argument("--json", action="store_true", help="print one JSON object with key `checkpoints`")
    p.add_argument("--verify", action="store_true", help="read every array back (one CPU device; slow)")
    p.set_defaults(func=run_checkpoints)


def run_checkpoints(args) -> int:
    if not Path(args.run_dir).is_dir():
        raise ConfigError("RUN_DIR", args.run_dir, "give a run's train.run_dir", "no such directory")
    steps = scan(args.run_dir, verify=args.verify)
    if args.json:
        print(json.dumps({"run_dir": args.run_dir, "checkpoints": [asdict(s) for s in steps]}))
    else:
        print(format_table(args.run_dir, steps))
    return 0
