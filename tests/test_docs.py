"""README.md and docs/*.md: links resolve, and the commands in ```bash blocks run as written.

```bash blocks are run from a scratch directory holding links to the checkout's configs/, launch/,
tests/ and bench/, with `train.steps` capped at MAX_STEPS; a command followed by `# exit N` must exit N.
```sh blocks are shown only (GPUs, a cluster, a download). docs/development.md describes the convention.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_STEPS = 10
FAST = ("mesh", "schedule", "plan", "config")  # meshrun commands quick enough for the default suite
LINKED = ("configs", "launch", "tests", "bench", "examples", ".venv")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    out = {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
    return out | set(re.findall(r'<a id="([^"]+)">', text))


def _links(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_links_resolve():
    bad = []
    for page in PAGES:
        text = page.read_text()
        for link in _links(text):
            if re.match(r"[a-z]+://", link) or link.startswith("mailto:"):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                bad.append(f"{page.name}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target.read_text()):
                bad.append(f"{page.name}: {link} (no heading #{anchor} in {target.name})")
    assert not bad, "broken links:\n" + "\n".join(bad)


def _commands(block: str) -> list[tuple[str, int]]:
    """(command, expected exit status) per logical line of a bash block; comment lines dropped."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        code, _, comment = line.partition("  #")
        m = re.match(r"\s*exit (\d+)", comment)
        out.append((" ".join(code.split()), int(m.group(1)) if m else 0))
    return out


def _blocks() -> list[tuple[str, list[tuple[str, int]]]]:
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in re.finditer(r"^```bash\n(.*?)^```", text, re.S | re.M):
            line = text[: m.start()].count("\n") + 1
            out.append((f"{page.relative_to(ROOT)}:{line}", _commands(m.group(1))))
    return out


BLOCKS = _blocks()


def _is_run(cmd: str) -> bool:
    return bool(re.search(r"(^|\s)(meshrun (train|profile)|launch/local\.sh)\s", cmd))


def _short(cmd: str) -> str:
    """Cap train.steps at MAX_STEPS (add it where missing) in commands that train."""
    if not re.search(r"(^|\s)(meshrun train|launch/local\.sh)\s", cmd):
        return cmd
    m = re.search(r"train\.steps=(\d+)", cmd)
    if m:
        return cmd.replace(m.group(0), f"train.steps={min(int(m.group(1)), MAX_STEPS)}")
    return f"{cmd} train.steps=3"


def test_pipeline_docs_list_the_registry():
    """docs/pipeline.md's schedule tables have one row per entry of the schedule registry, in its order,
    the page says how to add your own, and the README's row for the page names every entry."""
    from meshrun.pipeline import registry

    page = (ROOT / "docs" / "pipeline.md").read_text()
    first = re.findall(r"^\| `([^`]+)`", page.split("\n## ", 1)[0], re.M)
    table = re.findall(r"^\| `([^`]+)` \|", page.split("\n## The schedule registry", 1)[1].split("\n## ", 1)[0], re.M)
    assert first[1:] == table == list(registry.SCHEDULES)  # first[0]: the header's `pipeline.schedule`
    assert "\n## Your own schedule\n" in page
    row = next(r for r in (ROOT / "README.md").read_text().splitlines() if "(docs/pipeline.md)" in r)
    assert re.findall(r"`([^`]+)`", row) == list(registry.SCHEDULES)


def test_train_commands_name_their_run_dir():
    """Every training command names its own train.run_dir (or trains a run dir's config.yaml); a run
    dir shared by two blocks would make the second one resume the first."""
    owner, bad = {}, []
    for where, cmds in BLOCKS:
        for cmd, _ in cmds:
            if not _is_run(cmd) or re.search(r"\sruns/[^ ]+/config\.yaml", cmd):
                continue
            m = re.search(r"train\.run_dir=(\S+)", cmd)
            if not m:
                bad.append(f"{where}: no train.run_dir in `{cmd}`")
            elif owner.setdefault(m.group(1), where) != where:
                bad.append(f"{where}: train.run_dir={m.group(1)} is also used at {owner[m.group(1)]}")
    assert not bad, "\n".join(bad)


def _scratch(tmp_path: Path) -> Path:
    for name in LINKED:
        if (ROOT / name).exists():
            (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env.pop("XLA_FLAGS", None)  # each command sets up its own simulated devices
    return env


def _run_script(cmds: list[tuple[str, int]], cwd: Path, timeout: float) -> None:
    lines = []
    for cmd, want in cmds:
        q = shlex.quote(cmd)
        check = f'if [ "$rc" != {want} ]; then echo "FAILED (exit $rc, want {want}): "{q} >&2; exit 1; fi'
        lines.append(f"{cmd}\nrc=$?; {check}")
    r = subprocess.run(
        ["bash", "-c", "\n".join(lines)], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, f"{r.stderr[-3000:]}\n--- stdout ---\n{r.stdout[-2000:]}"


FAST_CMDS = [
    (where, cmd, want)
    for where, cmds in BLOCKS
    for cmd, want in cmds
    if re.match(rf"meshrun ({'|'.join(FAST)})\s", cmd) and "--png" not in cmd
]


@pytest.mark.parametrize("where,cmd,want", FAST_CMDS, ids=[f"{w} {c[:60]}" for w, c, _ in FAST_CMDS])
def test_fast_commands_run(where, cmd, want, tmp_path):
    _run_script([(cmd, want)], _scratch(tmp_path), timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("where,cmds", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_block_runs(where, cmds, tmp_path):
    """Every command of one block, in order, in one shell (a block may set a variable or resume a run)."""
    _run_script([(_short(c), want) for c, want in cmds], _scratch(tmp_path), timeout=1800)


def test_every_command_has_a_description_examples_and_argument_help():
    import argparse

    from meshrun.cli.main import build_parser

    parser = build_parser()
    assert "parallelism" in parser.description and "meshrun train" in parser.epilog
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    bad = []
    for name, p in sub.choices.items():
        if not p.description or f"meshrun {name}" not in (p.epilog or ""):
            bad.append(f"{name}: no description or no example")
        bad += [f"{name}: {a.dest} has no help" for a in p._actions if not a.help]
    assert not bad, "\n".join(bad)
