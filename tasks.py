#!/usr/bin/env python3
"""Bootstrap with nothing but Python 3.11+: `python3 tasks.py run` (tiny training run on 8 simulated
CPU devices) and `python3 tasks.py test` (lint + test suite). Each creates/uses `.venv` here."""

import hashlib
import os
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / "python"


def sh(*cmd: str | Path, env: dict | None = None) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    rc = subprocess.call([str(c) for c in cmd], cwd=ROOT, env=env)
    if rc:
        sys.exit(rc)


def ensure_env(extra: str) -> None:
    if sys.version_info < (3, 11):  # noqa: UP036 - tasks.py may be started by an older python3
        sys.exit(f"meshrun needs Python >= 3.11, this is {sys.version.split()[0]}")
    if not PY.exists():
        venv.create(VENV, with_pip=True)
    stamp = VENV / f".installed-{extra or 'base'}"
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if not stamp.exists() or stamp.read_text() != digest:
        sh(PY, "-m", "pip", "install", "-q", "--upgrade", "pip")
        sh(PY, "-m", "pip", "install", "-q", "-e", f".[{extra}]" if extra else ".")
        stamp.write_text(digest)


def compile_cache_env(folder: str) -> dict:
    """The parallel test run's environment: jax's persistent compilation cache in `folder` (fresh for
    each run), shared by the workers and the CLI processes they start, so that a program compiled once
    in the run (a one-device reference, the tiny configs the CLI and docs tests train) is not compiled
    again. Tests only: a user's run never sets it. The size cap turns on jax's file lock, so that no
    worker reads an entry another is still writing."""
    return os.environ | {
        "JAX_COMPILATION_CACHE_DIR": folder,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "JAX_COMPILATION_CACHE_MAX_SIZE": str(16 * 2**30),
    }


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "help"
    args = sys.argv[2:]
    if what == "run":
        ensure_env("plot")  # the docs' commands include `meshrun plot`
        if not any(a.startswith("train.run_dir=") for a in args):  # a fresh run each time, not a resume
            args = [*args, f"train.run_dir=runs/quickstart-{time.strftime('%Y%m%d-%H%M%S')}"]
        sh(BIN / "meshrun", "train", "configs/tiny_cpu.yaml", *args)
    elif what == "test":
        ensure_env("test")
        sh(PY, "-m", "ruff", "check", "meshrun", "models", "tests", "bench", "examples", "tasks.py")
        sh(BIN / "lint-imports")  # the import layering contracts in pyproject.toml
        if args:  # a selection (`-k`, a file): one plain pytest run
            sh(PY, "-m", "pytest", *args)
        else:
            # Single-process tests spread over one worker per core (the suite is compile-bound, one core
            # per XLA compile); the multi-process and fault-injection tests, which time their ranks'
            # start-up, then run alone so that no other worker starves them.
            # The default suite leaves out the tests marked slow (more layouts of the same parity checks,
            # longer fault and multi-process runs); MESHRUN_TEST_ALL=1 runs them too.
            workers = str(max(1, min(os.cpu_count() or 1, 8)))
            slow = "" if os.environ.get("MESHRUN_TEST_ALL") == "1" else " and not slow"
            # --durations: the slowest tests are named at the end, to keep the default suite short
            # The multi-process and fault tests compile as a user's run does: no cache.
            with tempfile.TemporaryDirectory(prefix="meshrun-test-xla-cache-") as cache:
                env = compile_cache_env(cache)
                sh(PY, "-m", "pytest", "-n", workers, "-m", "not serial" + slow, "--durations=30", env=env)
            sh(PY, "-m", "pytest", "-m", "serial" + slow, "--durations=10")
    elif what in ("help", "-h", "--help"):
        print(__doc__)
    else:
        print(f"tasks.py: unknown task {what!r}; use run, test or help", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
