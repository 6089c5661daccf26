"""`meshrun checkpoints RUN_DIR [--json] [--verify]`: the checkpoints of a run, their status and model config.

Statuses: `meshrun.checkpoint.store`. Exit status 0; with --verify 5 when a STEP/ a run would try is
damaged. --verify reads every array of each complete checkpoint back onto
one CPU device (host memory for the whole state: meant for small and medium models; a run verifies the
one it restores anyway).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from meshrun.checkpoint.store import StepInfo, scan
from meshrun.config import ModelConfig, model_class
from meshrun.errors import EXIT_CHECKPOINT, ConfigError


def summary_keys(family: str) -> list[str]:
    """The fields the table shows for a saved model of `family` (all of them with --json): the
    family's `summary` then its own fields; the transformer's when its class cannot be imported here."""
    try:
        cls = model_class(family)
    except ConfigError:
        return ["family", *ModelConfig.summary]
    base = {f.name for f in fields(ModelConfig)}
    return [*(["family"] if family else []), *cls.summary, *(f.name for f in fields(cls) if f.name not in base)]


def model_summary(model: dict[str, Any] | None) -> str:
    if not model:
        return "?"
    keys = [k for k in summary_keys(model.get("family", "")) if k in model]
    return " ".join(f"{k}={model[k]}" for k in keys if not (k == "n_experts" and not model[k]))


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
    return "\n".join(lines + _unimportable(s.model.get("family", "") for s in steps if s.model))


def _unimportable(families) -> list[str]:
    """One note per saved family whose class cannot be imported here (its fields are then not shown)."""
    notes = []
    for family in sorted(set(families)):
        try:
            model_class(family)
        except ConfigError as e:
            notes.append(f"model.family {family}: could not import it here ({e.what or 'unknown family'}), so "
                         "the shared fields are shown; add its folder to PYTHONPATH to see its own")  # fmt: skip
    return notes


def register(sub) -> None:
    p = sub.add_parser("checkpoints", help="list a run's checkpoints: step, status, model config; --verify")
    p.add_argument("run_dir", help="the run's train.run_dir")
    p.add_argument("--json", action="store_true", help="print one JSON object with key `checkpoints`")
    p.add_argument("--verify", action="store_true", help="read every array back (one CPU device; slow)")
    p.set_defaults(func=run_checkpoints)


def run_checkpoints(args) -> int:
    if not Path(args.run_dir).is_dir():
        raise ConfigError("RUN_DIR", args.run_dir, "give a run's train.run_dir", "no such directory")
    verify = None
    if args.verify:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax is imported: no accelerator needed
        from meshrun.checkpoint.state import verify_arrays as verify
    steps = scan(args.run_dir, verify=verify)
    # --verify answers "is this run's data intact?": a STEP/ a run would try that does not read back
    # is a failure (5); one already moved aside (STEP.damaged-TIME) is history, not a failure
    bad = [s.step for s in steps if s.status == "damaged" and s.name.isdigit()]
    checked = [s.step for s in steps if s.name.isdigit() and s.status in ("complete", "damaged")]
    if args.json:
        out: dict[str, Any] = {"run_dir": args.run_dir, "checkpoints": [asdict(s) for s in steps]}
        if args.verify:
            out["verified"] = {"steps": checked, "damaged": bad, "ok": not bad}
        print(json.dumps(out))
    else:
        print(format_table(args.run_dir, steps))
        if args.verify:
            print(verify_summary(checked, bad))
    return EXIT_CHECKPOINT if args.verify and bad else 0


def verify_summary(checked: list[int], bad: list[int]) -> str:
    """The last line of --verify: what was read back, and ok or which steps are damaged."""
    if not checked:
        return "verify: no checkpoint to verify"
    what = f"verify: read back every array of step(s) {', '.join(map(str, checked))} and compared its checksums"
    return f"{what}: damaged {', '.join(map(str, bad))}" if bad else f"{what}: ok"
