"""Import hygiene: building the CLI parser must not import jax (see the rule in meshrun/cli/main.py)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cli_parser_does_not_import_jax():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    code = "import sys, meshrun.cli.main as m; m.build_parser(); sys.exit('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, env=env).returncode == 0
