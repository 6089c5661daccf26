"""Parameter-only checkpoints: what `meshrun import-hf` writes and `checkpoint.init_params` starts from.

Layout: DIR/params (orbax StandardSave of the params pytree, model layer order, every process
writing its own shards) and DIR/meta.json ({"model": ModelConfig dict, "hf": what export needs to
write the Hugging Face config back}). Restoring reads each array straight into the target sharding,
so a param-only start works on any mesh. A run that starts from one gets a fresh optimizer state
and step 0 (`TrainStep.init_from`); its own step checkpoints take precedence once written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from meshrun.checkpoint.state import path_key, tree_shapes
from meshrun.errors import ConfigError

PARAMS, META_FILE = "params", "meta.json"
FIELD = "checkpoint.init_params"


def save_params(directory: str | Path, params: Any, meta: dict[str, Any]) -> None:
    """Write params (arrays of any sharding) and meta.json into `directory` (must not hold params yet)."""
    d = Path(os.path.abspath(directory))
    d.mkdir(parents=True, exist_ok=True)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(d / PARAMS, params)
    ckptr.wait_until_finished()
    ckptr.close()
    if jax.process_index() == 0:
        (d / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")


def check_dir(directory: str | Path, field: str = FIELD) -> dict[str, Any]:
    """meta.json of a param-only checkpoint, or ConfigError naming `field`."""
    d = Path(directory)
    if not (d / PARAMS).is_dir() or not (d / META_FILE).is_file():
        raise ConfigError(
            field,
            str(directory),
            "give a directory written by `meshrun import-hf` (it holds params/ and meta.json)",
            "not a parameter checkpoint",
        )
    try:
        return json.loads((d / META_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(field, str(directory), "re-run `meshrun import-hf`", f"meta.json unreadable ({e})") from None


def _saved_shapes(directory: str | Path) -> dict[str, tuple[int, ...]]:
    ckptr = ocp.StandardCheckpointer()
    try:
        saved = ckptr.metadata(Path(os.path.abspath(directory)) / PARAMS)
    finally:
        ckptr.close()
    saved = getattr(saved, "item_metadata", saved)
    return tree_shapes(getattr(saved, "tree", saved))


def missing_params(directory: str | Path, target: Any, field: str = FIELD) -> list[str]:
    """The keys ('a.b.c') of `target`'s leaves that the parameter checkpoint in `directory` lacks."""
    check_dir(directory, field)
    have = _saved_shapes(directory)
    return [k for k in tree_shapes(target) if k not in have]


def check_params(
    directory: str | Path, target: Any, field: str = FIELD, family: str | None = None, fresh: Collection[str] = ()
) -> None:
    """ConfigError unless `directory` is a parameter checkpoint whose shapes equal `target`'s (reads
    metadata only: what `meshrun train` checks before it writes anything). `family`: the config's
    model.family, named in the error when the checkpoint holds another family's model. `fresh`: keys
    the checkpoint may lack (made fresh at the restore: `meshrun.family.fresh`)."""
    meta = check_dir(directory, field)
    saved_family = (meta.get("model") or {}).get("family") if isinstance(meta, dict) else None
    if family is not None and saved_family is not None and saved_family != family:
        raise ConfigError(
            field,
            str(directory),
            f"set model.family={saved_family} with the model section written with it (its config.yaml)",
            f"it holds a {saved_family} model, the config's model.family is {family}",
        )
    have, want = _saved_shapes(directory), tree_shapes(target)
    bad = [k for k in want if have.get(k) != want[k] and not (k not in have and k in fresh)]
    if bad:
        k = bad[0]
        raise ConfigError(
            field,
            str(directory),
            "use the model section written with it (its config.yaml) or a matching config",
            f"it holds {k} with shape {have[k]}, the model needs {want[k]}"
            if k in have
            else f"it has no {k} (shape {want[k]}), which the {family or 'configured'} model needs",
        )


def restore_params(
    directory: str | Path, target: Any, field: str = FIELD, fresh: Mapping[str, Any] | None = None
) -> Any:
    """Params from `directory` into the layout of `target` (ShapeDtypeStructs with shardings, model
    order); shapes checked first (`check_params`). `fresh`: {key: array} for leaves the checkpoint
    lacks (`meshrun.family.fresh.seed_free`), put in as they are."""
    fresh = dict(fresh or {})
    check_params(directory, target, field, fresh=fresh)
    ckptr = ocp.StandardCheckpointer()
    try:
        restored = ckptr.restore(Path(os.path.abspath(directory)) / PARAMS, _without(target, fresh))
    finally:
        ckptr.close()
    if not fresh:
        return restored
    got = {path_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(restored)[0]} | fresh
    return jax.tree_util.tree_map_with_path(lambda p, _: got[path_key(p)], target)


def _without(tree: Any, keys: Collection[str], prefix: str = "") -> Any:
    """`tree` (nested mappings) without the leaves at `keys`."""
    if not keys or not isinstance(tree, Mapping):
        return tree
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if key in keys:
            continue
        sub = _without(v, keys, key + ".")
        if not (isinstance(sub, Mapping) and not sub and isinstance(v, Mapping) and v):
            out[k] = sub
    return out
