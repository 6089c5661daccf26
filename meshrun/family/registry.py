"""The model families meshrun knows, by `model.family` name: the one place the framework names a family.

A family is a package with two modules, imported on first use: `config` (plain Python, no jax), whose
`CONFIG` is its `meshrun.config.ModelConfig` subclass, and `family`, whose `FAMILY` is a
`meshrun.family.contract.Family`. Config loading and `meshrun plan` read only the first.
"""

from __future__ import annotations

import importlib
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
        raise ConfigError("model.family", name, f"use one of {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


@cache
def config_class(name: str = "") -> type[config.ModelConfig]:
    """The config class of family `name` ("": the default one), without importing jax."""
    return importlib.import_module(_package(name or DEFAULT) + ".config").CONFIG


@cache
def get(name: str) -> Family:
    """The family registered as `name`; a ConfigError naming `model.family` for an unknown one."""
    return importlib.import_module(_package(name or DEFAULT) + ".family").FAMILY


config.use_model_classes(config_class)
