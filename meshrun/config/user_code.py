"""`package.module:NAME`: an object from the user's own package (a model family, an optimizer), named
in the config and imported on first use. Every failure is one ConfigError naming the key, the module
and the error, never a traceback."""

from __future__ import annotations

import importlib
import os
import sys

from meshrun.errors import ConfigError


def _shadowing_folder() -> str | None:
    """The folder `import meshrun` found when it is not this package's own (a folder named meshrun
    earlier on sys.path, such as a checkout beside the user's package); None when it is."""
    meshrun = sys.modules["meshrun"]  # the package this module was imported from (its parent)
    own = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = [os.path.abspath(p) for p in getattr(meshrun, "__path__", [])]
    return None if own in found else (found[0] if found else repr(meshrun))


def _import(field: str, name: str, module: str):
    """The user's module; any failure to import it is a ConfigError naming it and the error."""
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - the user's module may raise anything on import
        if (folder := _shadowing_folder()) is not None:
            raise ConfigError(field, name, "rename that folder or take its parent off PYTHONPATH",
                              f"meshrun is imported from {folder}, not the installed package") from None  # fmt: skip
        if isinstance(e, ModuleNotFoundError):
            raise ConfigError(
                field, name, f"make {e.name!r} importable (pip install its package, or add its folder to "
                "PYTHONPATH)", "no such module",
            ) from None  # fmt: skip
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        raise ConfigError(field, name, f"fix the module (python -c 'import {module}' shows the traceback)",
                          f"importing {module} failed ({type(e).__name__}: {first[:200]})") from None  # fmt: skip


def import_object(field: str, name: str, placeholder: str, kind: str):
    """The object `name` = "package.module:ATTR" points at, for config key `field`; `placeholder` and
    `kind` word the errors (FAMILY and Family, SPEC and OptimizerSpec)."""
    module, _, attr = name.partition(":")
    if not module:
        raise ConfigError(field, name, f"write it as package.module:{placeholder}", "no module before ':'")
    if not attr:
        raise ConfigError(field, name, f"write it as package.module:{placeholder}", "no name after ':'")
    try:
        return getattr(_import(field, name, module), attr)
    except AttributeError:
        raise ConfigError(field, name, f"name the {kind} object of module {module}",
                          f"module {module} has no {attr}") from None  # fmt: skip
