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


# User pages speak of what a user sets and runs; meshrun's internals, issue numbers and "the seed" are
# for contributors (docs/development.md) and commit messages.
USER_PAGES = [p for p in PAGES if p.name != "development.md"]
FORBIDDEN_WORDS = [r"\bissues? #?\d+", r"\bthe seed\b"]
CONFIG_SECTIONS = {"mesh", "model", "train", "pipeline", "optimizer", "checkpoint", "data", "offload", "eval"}
# meshrun's public surface besides what `import meshrun` exports (meshrun.__all__): a family's contract
# and Hugging Face adapter, a schedule's and an optimizer's registry entry. A user writes against these.
PUBLIC = {"Schedule", "Task", "SCHEDULES", "OptimizerSpec", "contract.layers_fn", "contract.finish", "schedules.place",
          "place_split", "model_fns", "init_params", "abstract_params", "check_mesh", "flops_per_token",
          "model_config", "hf_config", "top_map", "layer_map"}  # fmt: skip
FILES = r"\.(py|json|jsonl|yaml|yml|txt|png|md|bin|npy|gz)$"


def _meshrun_names() -> tuple[set[str], set[str], set[str]]:
    """(module names, class names, function and method names as `name` and `Class.name`) of meshrun/;
    a name that is also a class's field (a config key, a contract's entry) is not a function here."""
    import ast

    modules, classes, functions, fields = set(), set(), set(), set()
    for path in (ROOT / "meshrun").rglob("*.py"):
        modules.add(path.parent.name if path.stem == "__init__" else path.stem)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                classes.add(node.name)
                defs = [n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
                functions |= {f"{node.name}.{n.name}" for n in defs}
                fields |= {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and hasattr(n.target, "id")}
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                functions.add(node.name)
    return modules, classes, functions - fields


def internal_names(text: str, names: tuple[set[str], set[str], set[str]]) -> list[str]:
    """Backticked names in `text` that are meshrun's internals: a private name (`_x`, `a._x`), a
    dotted name into a module or class that is not public (`swap_dir.stepping`, `Tier.step`), a
    non-public class, or a non-public function called or named in snake_case (`make_streamed(cfg)`)."""
    import meshrun

    modules, classes, functions = names
    public = PUBLIC | set(meshrun.__all__)
    out = []
    for span in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
        m = re.fullmatch(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(\(.*\))?", span.strip())
        if not m or re.search(FILES, m.group(1)):
            continue
        parts = m.group(1).split(".")
        if parts[0] == "meshrun":
            parts = parts[1:] or ["meshrun"]
        elif parts[0] in CONFIG_SECTIONS:
            continue
        name = ".".join(parts)
        private = any(p.startswith("_") and not p.endswith("__") for p in parts)
        suffixes = {".".join(parts[i:]) for i in range(len(parts))}  # meshrun.family.contract.finish: contract.finish
        if not private and (suffixes & public or parts[0] in public and parts[0] in classes):
            continue
        dotted = len(parts) > 1 and (parts[0] in modules or parts[0] in classes)
        called = name in functions and (m.group(2) or "_" in name)  # `make_streamed(cfg)`, `optimizer_tier.build`
        if private or dotted or name in classes or called:
            out.append(span)
    return out + _bare_internal_names(text, functions, public)


def _bare_internal_names(text: str, functions: set[str], public: set[str]) -> list[str]:
    """Names of meshrun's functions written in prose without backticks (`make_train_step`, `_x`):
    snake_case or private words, outside code blocks, inline code and link targets."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    prose = re.sub(r"\]\([^)]*\)|`[^`]*`|https?://\S+", " ", prose)
    own = {f.rsplit(".", 1)[-1] for f in functions} - public
    words = re.findall(r"(?<![\w./:#-])(_?[A-Za-z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)+|_[A-Za-z]\w*)(?![\w-])", prose)
    return [w for w in words if w in own or w.startswith("_") and not w.endswith("_")]


def test_internal_names_are_found():
    """The check below catches what it is for, and leaves config keys and public names alone."""
    names = ({"swap_dir", "streamed", "registry"}, {"Tier", "Schedule", "ModelFns"}, {"make_streamed", "Tier.step"})
    bad = ["_Stepper", "layer_tier._Stepper", "Tier.step", "make_streamed(cfg)", "swap_dir.stepping", "Tier"]
    bad += ["make_streamed"]
    good = ["train.steps", "offload.dir", "ModelFns", "Schedule.check", "meshrun train x", "8·N", "step", "val_loss"]
    text = " ".join(f"`{n}`" for n in bad + good) + "\n```bash\n`_hidden_in_a_block`\nmake_streamed\n```\n"
    prose = "Then make_streamed(cfg) runs _Stepper; a run_dir, [a link](x/make_streamed.md) and `make_streamed\n(x)`."
    assert internal_names(text + prose, names) == [*bad, "make_streamed", "_Stepper"]


def test_user_pages_are_a_manual():
    """README.md and docs/*.md (but docs/development.md, for contributors) name no issue numbers, no
    "the seed" and none of meshrun's internal names: only what a user sets, runs and imports."""
    names = _meshrun_names()
    bad = []
    for page in USER_PAGES:
        text = page.read_text()
        for pattern in FORBIDDEN_WORDS:
            bad += [f"{page.name}: '{w}'" for w in re.findall(pattern, text, re.I)]
        bad += [f"{page.name}: `{n}`" for n in internal_names(text, names)]
    assert not bad, "internal names in user pages (move them to docs/development.md or drop them):\n" + "\n".join(bad)
