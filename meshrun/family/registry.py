"""The model families meshrun knows, by `model.family` name: the one place the framework names a family.

A family is a package with two modules, imported on first use: `config` (plain Python, no jax), whose
`CONFIG` is its `meshrun.config.ModelConfig` subclass, and `family`, whose `FAMILY` is a
`meshrun.family.contract.Family`. Config loading and `meshrun plan` read only the first.

A family outside meshrun needs no entry here: `model.family: package.module:FAMILY` names its
`Family` object (whose `config` is its config class, with `family` defaulting to that same string).
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import TYPE_CHECKING

from meshrun import config
from meshrun.config.user_code import import_object
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


def _external(name: str) -> Family:
    """`package.module:ATTR`: the Family object ATTR of an importable module (the user's own family)."""
    obj = import_object("model.family", name, "FAMILY", "Family")
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
