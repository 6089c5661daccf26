"""tasks.py and the Makefile: help exits 0, an unknown task exits 2, and `make lint` checks the
folders `tasks.py test` checks."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("arg", ["--help", "-h", "help"])
def test_help_exits_0(arg):
    r = subprocess.run([sys.executable, "tasks.py", arg], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "python3 tasks.py run" in r.stdout, (r.returncode, r.stderr)


def test_an_unknown_task_exits_2_with_one_line():
    r = subprocess.run([sys.executable, "tasks.py", "bogus"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "bogus" in line and "run" in line and "test" in line, line


def test_make_lint_checks_what_tasks_test_checks():
    tasks = re.search(r'"ruff", "check", ((?:"[^"]+", )*"[^"]+"\))', (ROOT / "tasks.py").read_text())
    folders = re.findall(r'"([^"]+)"', tasks.group(1))
    lint = next(ln for ln in (ROOT / "Makefile").read_text().splitlines() if "ruff check" in ln)
    for cmd in ("ruff check", "ruff format --check"):
        checked = re.search(rf"{cmd} ([^&]+)", lint).group(1).split()
        assert checked == folders, (cmd, checked, folders)
