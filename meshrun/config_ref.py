"""The configuration reference, read from the config dataclasses themselves (no jax).

One source: a field's meaning is the comment on its line in the dataclass, or the comment lines
right above it (the convention of `meshrun/config/`). `meshrun config` prints the rows and
`meshrun config --markdown > docs/configuration.md` writes the docs page that a test compares.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass, replace

from meshrun.config import ModelConfig, OptimizerConfig, RunConfig
from meshrun.family import registry
from meshrun.optim import registry as optimizers

REGENERATE = "meshrun config --markdown > docs/configuration.md"


@dataclass(frozen=True)
class Key:
    key: str  # section.name
    type: str
    default: str
    meaning: str


def _comments(source: str) -> dict[int, str]:
    """Line number (1-based) -> comment text on that line (without '#')."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def field_meanings(cls) -> dict[str, str]:
    """Each annotated field of dataclass `cls` -> its comment: the block just above it, then the one on its line."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments = _comments(source)
    lines = source.splitlines()
    out = {}
    (node,) = ast.parse(source).body
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above, ln = [], stmt.lineno - 1
        while ln >= 1 and lines[ln - 1].strip().startswith("#"):
            above.insert(0, comments[ln])
            ln -= 1
        out[stmt.target.id] = " ".join(" ".join([*above, comments.get(stmt.lineno, "")]).split())
    return out


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, str):
        return v if v else '""'
    return repr(v)


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def keys(cls=RunConfig, prefix: str = "", own_only: bool = False) -> list[Key]:
    """Every leaf key of `cls` (sections recursed into), in declaration order; the `model` section
    also lists each family's own fields (`family_keys`). `own_only`: the fields `cls` declares itself."""
    hints = typing.get_type_hints(cls)
    meanings = field_meanings(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if own_only and f.name not in meanings:
            continue
        if dataclasses.is_dataclass(tp):
            out.extend(keys(tp, f"{prefix}{f.name}."))
            if tp is ModelConfig:
                out.extend(k for rows in family_keys(f"{prefix}{f.name}.").values() for k in rows)
            if tp is OptimizerConfig:
                out.extend(k for rows in optimizer_keys(f"{prefix}{f.name}.").values() for k in rows)
        else:
            out.append(Key(f"{prefix}{f.name}", _type_name(tp), _value(_default(f)), meanings.get(f.name, "")))
    return out


def family_keys(prefix: str = "model.") -> dict[str, list[Key]]:
    """Each registered family -> the model keys its config class adds or changes (`family` aside)."""
    out = {}
    for name in registry.FAMILIES:
        rows = keys(registry.config_class(name), prefix, own_only=True)
        out[name] = [replace(k, meaning=f"({name}) {k.meaning}") for k in rows if k.key != f"{prefix}family"]
    return out


def optimizer_keys(prefix: str = "optimizer.") -> dict[str, list[Key]]:
    """Each registered optimizer with options of its own -> the keys its config class adds."""
    out = {}
    for name, spec in optimizers.OPTIMIZERS.items():
        if spec.config is not OptimizerConfig:
            rows = keys(spec.config, prefix, own_only=True)
            out[name] = [replace(k, meaning=f"({name}) {k.meaning}") for k in rows if k.key != f"{prefix}name"]
    return out


def sections(cls=RunConfig) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])}


def text(rows: list[Key]) -> str:
    """Plain rows for a terminal: key, type, default, then the meaning wrapped below."""
    out = []
    for r in rows:
        out.append(f"{r.key}: {r.type} = {r.default}")
        out.extend(textwrap.wrap(r.meaning, 96, initial_indent="    ", subsequent_indent="    "))
    return "\n".join(out)


def _cell(s: str) -> str:
    return s.replace("|", "\\|")


def _table(rows: list[Key]) -> list[str]:
    out = ["| key | type | default | meaning |", "|---|---|---|---|"]
    return out + [f"| `{r.key}` | {_cell(r.type)} | `{_cell(r.default)}` | {_cell(r.meaning)} |" for r in rows]


def markdown(cls=RunConfig) -> str:
    """docs/configuration.md: one table per section."""
    head = [
        "# Configuration reference",
        "",
        f"<!-- Generated from the config dataclasses: `{REGENERATE}`. Do not edit by hand. -->",
        "",
        "Every key of a run's YAML file and of `section.key=value` overrides, with its type, default",
        "and meaning, generated from the dataclasses in `meshrun/config/` (a field's meaning is the",
        f"comment beside it). `meshrun config` prints the same; regenerate this page with `{REGENERATE}`.",
        "How configs and overrides work: [Getting started](getting_started.md#configuration-and-overrides).",
    ]
    body = []
    for name, sec in sections(cls).items():
        body += ["", f"## {name}", ""]
        doc = inspect.getdoc(sec)
        if doc and not doc.startswith(sec.__name__ + "("):
            body += [" ".join(doc.split()), ""]
        body += _table(keys(sec, f"{name}."))
        if sec is ModelConfig:
            for fam, rows in family_keys(f"{name}.").items():
                title = f"{name}.family={fam}: its own keys (anything else is refused naming {fam})"
                body += ["", f"### {title}", "", *_table(rows)]
        if sec is OptimizerConfig:
            for opt, rows in optimizer_keys(f"{name}.").items():
                title = f"{name}.name={opt}: its own keys (another optimizer refuses them)"
                body += ["", f"### {title}", "", *_table(rows)]
    return "\n".join(head + body) + "\n"
