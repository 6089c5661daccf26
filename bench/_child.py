"""Run one measurement in its own process and read what it reports: the helper every bench/ script
that spawns children shares (levers, compare, gpu, grad_reduce, offload).

A child gets its own devices, XLA flags and peak memory; it reports either one JSON object as its
last stdout line (`run_json`, `last_json`) or a run dir's metrics.jsonl (`metrics`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Result:
    """A finished child: exit status (None when killed), its output, and an error line or None."""

    returncode: int | None
    stdout: str
    stderr: str
    error: str | None


def env(base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """`base` (default os.environ) with this checkout first on PYTHONPATH, so a child imports this
    tree's meshrun and models, plus `extra` variables."""
    base = dict(os.environ if base is None else base)
    path = os.pathsep.join([str(ROOT), *filter(None, [base.get("PYTHONPATH")])])
    return {**base, "PYTHONPATH": path, **extra}


def meshrun(*args: str) -> list[str]:
    """The command line of `meshrun ARGS` run by this interpreter."""
    return [sys.executable, "-m", "meshrun.cli.main", *args]


def tail(text: str, n: int = 400) -> str:
    """The last lines of a child's stderr in one line: an out-of-memory line if there is one."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    oom = [ln for ln in lines if "RESOURCE_EXHAUSTED" in ln or "out of memory" in ln.lower()]
    return (oom[-1] if oom else " | ".join(lines[-3:]))[-n:]


def run(
    cmd: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    on_interrupt: Callable[[Result], None] | None = None,
) -> Result:
    """Run `cmd` from the checkout's root and collect its output. A timeout kills it (error says so);
    any other exception here (Ctrl-C, a signal handler's) kills it, hands what it printed so far to
    `on_interrupt`, and propagates."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return Result(None, out, err, f"timed out after {timeout:.0f} s")
    except BaseException:
        proc.kill()
        out, err = proc.communicate()
        if on_interrupt is not None:
            on_interrupt(Result(None, out, err, "interrupted"))
        raise
    return Result(proc.returncode, out, err, None if proc.returncode == 0 else f"exit {proc.returncode}: {tail(err)}")


def last_json(stdout: str) -> dict:
    """The JSON object on a child's last non-empty stdout line."""
    return json.loads(stdout.strip().splitlines()[-1])


def run_json(cmd: Sequence[str], *, env: dict[str, str] | None = None) -> dict:
    """Run `cmd` and return its last stdout line's JSON; exit this script with the child's stderr
    when it fails (a benchmark row without its figure is not a row)."""
    r = run(cmd, env=env)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return last_json(r.stdout)


def metrics(run_dir: Path) -> list[dict]:
    """A run dir's metrics.jsonl rows in step order."""
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return sorted(rows, key=lambda row: row["step"])
