"""Loading: YAML files and `section.key=value` overrides to the checked, frozen config classes."""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from meshrun.config.mesh import MeshConfig
from meshrun.config.model import ModelConfig, model_class
from meshrun.config.optimizer import OWN_KEYS, OptimizerConfig, optimizer_class
from meshrun.config.run import MOVED_KEYS, RunConfig
from meshrun.errors import ConfigError

# other frameworks' names for a key, too far from it for difflib (optax, PyTorch, HF Trainer)
_ALIASES = {"learning_rate": "lr", "epsilon": "eps", "max_steps": "steps", "num_steps": "steps"}


def _suggest(key: str, options) -> str:
    if _ALIASES.get(key) in options:
        return f"did you mean '{_ALIASES[key]}'?"
    close = difflib.get_close_matches(key, list(options), n=1, cutoff=0.5)
    return f"did you mean '{close[0]}'?" if close else f"valid keys: {sorted(options)}"


def _coerce(name: str, tp, value):
    """Check/convert one value against a field's type hint: an optional or union (the value as it is
    when already one of the members, else as the first), a scalar (`_SCALARS`) or a tuple."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        if any(type(value) is a for a in args):  # already one of the members (e.g. `str | bool`)
            return value
        return _coerce(name, args[0], value)
    if (scalar := _SCALARS.get(tp)) is not None:
        return scalar(name, value)
    if origin is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(name, value, "use a list, e.g. [a, b] or a,b", "not a list")
        (inner, *_rest) = typing.get_args(tp)
        return tuple(_coerce(name, inner, v) for v in value)
    raise TypeError(f"unsupported config type {tp} for {name}")


def _to_bool(name: str, value) -> bool:
    """A bool field: a YAML boolean, or true/false, 1/0, yes/no in any case."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ConfigError(name, value, "use true or false", "not a boolean")


def _to_int(name: str, value) -> int:
    """An int field: a whole number (a float with no fraction too, not a bool), at most 2**62 in size."""
    if isinstance(value, bool) or not isinstance(value, int):
        if not (isinstance(value, float) and value.is_integer()):
            raise ConfigError(name, value, "use a whole number, e.g. 2", "not an integer")
        value = int(value)
    if abs(value) > 2**62:
        raise ConfigError(name, value, "use a whole number of a sensible size", "out of range")
    return value


def _to_float(name: str, value) -> float:
    """A float field: a finite number (an int, or a string that reads as one; not a bool)."""
    if isinstance(value, str):  # YAML 1.1 reads "1e-6" (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(name, value, "use a number, e.g. 0.5", "not a number")
    try:
        value = float(value)
    except OverflowError:  # an int past float range
        value = math.inf
    if not math.isfinite(value):
        raise ConfigError(name, value, "use a finite number, e.g. 0.5", "not a finite number")
    return value


def _to_str(name: str, value) -> str:
    """A str field: a string, or a number written as one (not a bool, list or mapping)."""
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise ConfigError(name, value, "use a string", "not a string")
    return str(value)


_SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}  # a scalar type hint -> its check


def from_dict(cls, data: dict[str, Any] | None, prefix: str = ""):
    """Build dataclass `cls` from a (nested) dict, checking keys and types (ModelConfig: the family's
    class, `model_from_dict`; OptimizerConfig: the optimizer's, `optimizer_from_dict`)."""
    if cls is ModelConfig:
        return model_from_dict(data or {}, prefix)
    if cls is OptimizerConfig:
        return optimizer_from_dict(data or {}, prefix)
    return _build(cls, data, prefix)


def _build(cls, data: dict[str, Any] | None, prefix: str):
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if full in MOVED_KEYS:
            new = MOVED_KEYS[full]
            raise ConfigError(full, value, f"write it as {new} (its `{new.split('.')[0]}:` section)", f"moved to {new}")
        if key not in names:
            raise ConfigError(full, value, _suggest(key, names), "unknown key")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(full, value, f"give a mapping of {tp.__name__} keys", "not a section")
            kwargs[key] = from_dict(tp, value, f"{full}.")
        else:
            kwargs[key] = _coerce(full, tp, value)
    return cls(**kwargs)


def model_from_dict(data: dict[str, Any], prefix: str = "model."):
    """The `model:` section -> its family's config class. A key the family does not have is refused
    naming the family; a fact it fixes may be stated with the value it fixes (older configs did)."""
    data = dict(data)
    name = _coerce(f"{prefix}family", str, data.get("family", ""))
    cls = model_class(name)
    fam = name or cls.__dataclass_fields__["family"].default
    names, fixed = {f.name for f in dataclasses.fields(cls)}, cls.fixed()
    for key, value in list(data.items()):
        if key in names:
            continue
        full = f"{prefix}{key}"
        if key in fixed:
            if _coerce(full, type(fixed[key]), value) == fixed[key]:
                del data[key]
                continue
            raise ConfigError(
                full, value, f"remove it ({fam}'s {key} is always {fixed[key]!r})", f"{fam} has no such field"
            )
        if difflib.get_close_matches(key, list(names), n=1, cutoff=0.75):
            raise ConfigError(full, value, _suggest(key, names), "unknown key")
        raise ConfigError(full, value, "remove it", f"{fam} has no such field")
    return from_dict(cls, data, prefix)


def optimizer_from_dict(data: dict[str, Any], prefix: str = "optimizer."):
    """The `optimizer:` section -> its optimizer's config class. Another optimizer's own option is
    refused naming its owner, unless it states the default every run used to write (OWN_KEYS)."""
    data = dict(data)
    name = _coerce(f"{prefix}name", str, data.get("name", OptimizerConfig.name))
    cls = optimizer_class(name)
    names = {f.name for f in dataclasses.fields(cls)}
    for key, value in list(data.items()):
        full = f"{prefix}{key}"
        if key in names or full not in OWN_KEYS:
            continue
        owner, old = OWN_KEYS[full]
        if value == old:  # a config.yaml written when every optimizer had the key
            del data[key]
            continue
        raise ConfigError(full, value, f"remove it, or set optimizer.name={owner}", f"{owner}'s option, not {name}'s")
    return _build(cls, data, prefix)


def saved_model(saved: dict[str, Any]) -> dict[str, Any]:
    """A model config written by an older meshrun (a checkpoint's meta) as its family's class writes
    it today: a field added since has its default; a field the family does not have is dropped
    (checkpoints from when every family shared one config recorded every family's fields)."""
    defaults = {f.name: f.default for f in dataclasses.fields(model_class(saved.get("family", "")))}
    return {**defaults, **{k: v for k, v in saved.items() if k in defaults}}


def to_dict(cfg) -> dict[str, Any]:
    out = dataclasses.asdict(cfg)

    def fix(d):
        return {k: (fix(v) if isinstance(v, dict) else list(v) if isinstance(v, tuple) else v) for k, v in d.items()}

    return fix(out)


_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`section.key=value` strings -> nested dict (values parsed as YAML scalars)."""
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                item, item, "write overrides as section.key=value, e.g. mesh.tensor=2", "not a key=value override"
            )
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) < 2 or not all(_KEY.match(p) for p in parts):
            raise ConfigError(
                key or item,
                item,
                "write overrides as section.key=value, e.g. mesh.tensor=2",
                "not a section.key name",
            )
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = tree
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(key, raw, "do not set a section and one of its keys together")
        node[parts[-1]] = value
    return tree


def merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                dup = key in seen
            except TypeError:  # an unhashable key: the base class reports it
                dup = False
            if dup:
                raise ConfigError(
                    "config",
                    key,
                    "give each key once (the later value would silently win)",
                    f"duplicate key on line {key_node.start_mark.line + 1}",
                )
            seen.add(key) if not isinstance(key, (list, dict)) else None
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(
            "config", str(path), "give the path of a YAML file, e.g. configs/tiny_cpu.yaml", "a directory"
        )
    if not p.is_file():
        raise ConfigError("config", str(path), "give the path of an existing YAML file", "no such file")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            "config",
            str(path),
            "give a YAML text file (UTF-8), e.g. configs/tiny_cpu.yaml",
            f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}; a binary file?)",
        ) from None
    except OSError as e:
        raise ConfigError(
            "config", str(path), "give a YAML file you can read", f"cannot read it ({e.strerror or e})"
        ) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except ConfigError as e:
        raise ConfigError("config", str(path), e.fix, f"{e.what}: {e.value!r}") from None
    except yaml.YAMLError as e:
        why = " ".join(str(e).split())  # one line
        raise ConfigError("config", str(path), f"fix the YAML syntax ({why})", "not valid YAML") from None
    if not isinstance(data, dict):
        raise ConfigError("config", str(path), "the top level must be a mapping of sections")
    return data


def load_config(path: str | Path | None = None, overrides: list[str] = (), cls=RunConfig):
    """YAML file (optional) + overrides -> validated config of type `cls`."""
    data = load_yaml(path) if path else {}
    return from_dict(cls, merge(data, parse_overrides(list(overrides))))


def load_mesh(path: str | Path | None, overrides: list[str] = ()) -> MeshConfig:
    """Only the mesh of a run's YAML + overrides: commands set up their devices from it before the
    whole config loads (a user's model family may import jax with its module)."""
    data = merge(load_yaml(path) if path else {}, parse_overrides(list(overrides)))
    mesh = data.get("mesh") or {}
    if not isinstance(mesh, dict):
        raise ConfigError("mesh", mesh, "give a mapping of mesh keys", "not a section")
    return from_dict(MeshConfig, mesh, "mesh.")


def load_section(cls, overrides: list[str], section: str):
    """Only `section.*` overrides -> `cls` (e.g. MeshConfig for `meshrun mesh`)."""
    tree = parse_overrides(list(overrides))
    for k, v in tree.items():
        if k != section:
            raise ConfigError(k, v, f"only {section}.KEY=VALUE overrides apply here", "unknown section")
    return from_dict(cls, tree.get(section, {}), f"{section}.")
