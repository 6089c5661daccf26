"""The model families meshrun knows, by `model.family` name: the one place the framework names a family.

A family is a module (imported on first use) whose `FAMILY` is a `meshrun.family.contract.Family`.
"""

from __future__ import annotations

import importlib
from functools import cache

from meshrun.errors import ConfigError
from meshrun.family.contract import Family

FAMILIES = {
    "llama": "meshrun_models.llama",
    "gpt2": "meshrun_models.gpt2",
}


@cache
def get(name: str) -> Family:
    """The family registered as `name`; a ConfigError naming `model.family` for an unknown one."""
    if name not in FAMILIES:
        raise ConfigError("model.family", name, f"use one of {', '.join(sorted(FAMILIES))}")
    return importlib.import_module(FAMILIES[name]).FAMILY
