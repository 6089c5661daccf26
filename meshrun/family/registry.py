"""The model families meshrun knows, by `model.family` name: the one place the framework names a family.

A family is a package with two modules, imported on first use: `config` (plain Python, no jax), whose
`CONFIG` is its `meshrun.config.ModelConfig` subclass, and `family`, whose `FAMILY` is a
`meshrun.family.contract.Family`. Config loading and `meshrun plan` read only the first.

A family outside meshrun needs no entry here: `model.family: package.module:FAMILY` names its
`Family` object (whose `config` is its config class, with `family` defaulting to that same string).
"""

from __future__ import annotations

import importlib
import os
from functools import cache
from typing import TYPE_CHECKING

from meshrun import config
from meshrun.errors import ConfigError

if TYPE_CHECKING:
    from meshrun.family.contract import Family

FAMILIES = {
    "llama": "meshrun_models.llama",
    "gpt2": "meshrun_models.gpt2",
}
DEFAULT = "llama"  # model.family when a config leaves it out


def _package(name: str) -> str:
    if name not in FAMILIES:
        raise ConfigError(
            "model.family", name, f"use one of {', '.join(sorted(FAMILIES))}, or your own as package.module:FAMILY"
        )
    return FAMILIES[name]


def _shadowing_folder() -> str | None:
    """The folder `import meshrun` found when it is not this package's own (a folder named meshrun
    earlier on sys.path, such as a checkout beside the user's package); None when it is."""
    import meshrun

    own = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = [os.path.abspath(p) for p in getattr(meshrun, "__path__", [])]
    return None if own in found else (found[0] if found else repr(meshrun))


def _import(module: str, name: str):
    """The user's family module; any failure to import it is a ConfigError naming it and the error."""
    if not module:
        raise ConfigError("model.family", name, "write it as package.module:FAMILY", "no module before ':'")
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - the user's module may raise anything on import
        if (folder := _shadowing_folder()) is not None:
            raise ConfigError("model.family", name, "rename that folder or take its parent off PYTHONPATH",
                              f"meshrun is imported from {folder}, not the installed package") from None  # fmt: skip
        if isinstance(e, ModuleNotFoundError):
            raise ConfigError(
                "model.family", name, f"make {e.name!r} importable (pip install its package, or add its folder to "
                "PYTHONPATH)", "no such module",
            ) from None  # fmt: skip
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        raise ConfigError("model.family", name, f"fix the module (python -c 'import {module}' shows the traceback)",
                          f"importing {module} failed ({type(e).__name__}: {first[:200]})") from None  # fmt: skip


def _external(name: str) -> Family:
    """`package.module:ATTR`: the Family object ATTR of an importable module (the user's own family)."""
    module, _, attr = name.partition(":")
    try:
        obj = getattr(_import(module, name), attr)
    except AttributeError:
        raise ConfigError("model.family", name, f"name the Family object of module {module}", f"no {attr}") from None
    if not hasattr(obj, "config") or getattr(obj.config, "__dataclass_fields__", {}).get("family") is None:
        raise ConfigError("model.family", name, "point at a meshrun.Family whose config is a ModelConfig subclass")
    return obj


@cache
def config_class(name: str = "") -> type[config.ModelConfig]:
    """The config class of family `name` ("": the default one), without importing jax (a built-in
    family; a user's `package.module:FAMILY` imports its module)."""
    if ":" in name:
        return _external(name).config
    return importlib.import_module(_package(name or DEFAULT) + ".config").CONFIG


@cache
def get(name: str) -> Family:
    """The family registered as `name`, or a user's `package.module:FAMILY`; a ConfigError naming
    `model.family` for an unknown one."""
    if ":" in name:
        return _external(name)
    return importlib.import_module(_package(name or DEFAULT) + ".family").FAMILY


config.use_model_classes(config_class)
