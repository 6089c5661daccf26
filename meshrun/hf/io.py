"""`meshrun import-hf MODEL_DIR RUN_DIR` and `meshrun export-hf RUN_DIR OUT_DIR`: Hugging Face checkpoints in and out.

import-hf reads a local transformers model directory (config.json + *.safetensors, sharded index
included; never the network), places every weight straight into its sharding on the import mesh
(each device's shard read from the memory-mapped files on its own: the model is never whole on one
device) and writes RUN_DIR/hf_import (a parameter-only checkpoint, meshrun/checkpoint/params.py) and
RUN_DIR/config.yaml (the model section, `checkpoint.init_params` and `train.run_dir`), so that
`meshrun train RUN_DIR/config.yaml [overrides]` starts from those weights on any mesh with a fresh
optimizer state at step 0. export-hf writes the newest intact checkpoint of a run (or its import)
as config.json + safetensors shards that transformers loads; tokenizer files travel along.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from meshrun.errors import ConfigError

IMPORT_DIR = "hf_import"
EXTRA_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "generation_config.json",
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMG]?B)?$", re.IGNORECASE)


def read_hf_dir(model_dir: str | Path, field: str = "MODEL_DIR") -> dict[str, Any]:
    """config.json of a local model directory; a hub id or a missing directory is a ConfigError."""
    d = Path(model_dir)
    if not d.is_dir():
        if _HUB_ID.match(str(model_dir)) and not d.exists():
            raise ConfigError(
                field,
                str(model_dir),
                "download it first (e.g. `huggingface-cli download ID --local-dir DIR`) and give that directory",
                "a hub id, not a local directory: meshrun reads local files only, never the network",
            )
        raise ConfigError(
            field, str(model_dir), "give a model directory holding config.json and *.safetensors", "no such directory"
        )
    try:
        return json.loads((d / "config.json").read_text())
    except FileNotFoundError:
        raise ConfigError(
            field, str(model_dir), "give a transformers model directory", "no config.json in it"
        ) from None
    except ValueError as e:
        raise ConfigError(
            field, str(model_dir), "fix or replace config.json", f"config.json is not JSON ({e})"
        ) from None


def import_hf(model_dir: str | Path, run_dir: str | Path, *, mesh=None, vocab_multiple: int = 128) -> dict[str, Any]:
    """Convert MODEL_DIR into RUN_DIR (see the module docstring). `mesh`: where the weights are placed
    while converting (default: all devices on 'data', parameters sharded as under ZeRO-3)."""
    import jax

    from meshrun.checkpoint.params import save_params
    from meshrun.config import MeshConfig, to_dict
    from meshrun.family import registry
    from meshrun.hf.convert import expected_names, family_of, ignored, lazy_params, model_config
    from meshrun.hf.safetensors_io import FormatError, SafeTensors
    from meshrun.parallel.sharding import param_rules, tree_shardings
    from meshrun.runtime.mesh import build_mesh

    hf = read_hf_dir(model_dir)
    if vocab_multiple < 1:
        raise ConfigError("--vocab-multiple", vocab_multiple, "use a positive multiple, e.g. 128")
    cfg = model_config(hf, vocab_multiple)
    out = Path(run_dir) / IMPORT_DIR
    if out.exists():
        raise ConfigError(
            "RUN_DIR", str(run_dir), "use a new RUN_DIR or delete its hf_import/", "it already holds an import"
        )
    try:
        st = SafeTensors(model_dir)
    except (FileNotFoundError, FormatError) as e:
        raise ConfigError(
            "MODEL_DIR", str(model_dir), "give a directory with the model's *.safetensors files", str(e)
        ) from None
    need = expected_names(cfg)
    missing = sorted(need - set(st.keys()))
    if missing:
        raise ConfigError(
            "MODEL_DIR",
            str(model_dir),
            "give a complete checkpoint of this architecture",
            f"{len(missing)} tensors missing, e.g. {missing[:3]}",
        )
    extra = sorted(k for k in set(st.keys()) - need if not ignored(cfg, k))
    if extra:
        raise ConfigError(
            "MODEL_DIR",
            str(model_dir),
            f"give a checkpoint of the architecture its config.json names (model.family={cfg.family})",
            f"unknown tensors, e.g. {extra[:3]}",
        )

    mesh = mesh if mesh is not None else build_mesh(MeshConfig())
    family = registry.get(cfg.family)
    family.check_config(cfg)
    family.check_mesh(cfg, dict(mesh.shape))
    shardings = flat_tree(tree_shardings(family.abstract_params(cfg), mesh, param_rules(zero=3)))
    lazies = lazy_params(cfg, st.get, hf["vocab_size"])
    dtype = np.dtype(jax.numpy.dtype(cfg.param_dtype))
    flat = {}
    for path, sh in shardings.items():
        lz = lazies[path]
        flat[path] = jax.make_array_from_callback(lz.shape, sh, lambda idx, lz=lz: lz.read(idx).astype(dtype))
    src_dtype = hf.get("torch_dtype") or hf.get("dtype")
    src_dtype = src_dtype if src_dtype in ("float32", "bfloat16", "float16") else "float32"
    meta = {
        "model": to_dict(cfg),
        "hf": {"config": hf, "vocab": hf["vocab_size"], "family": family_of(hf), "dtype": src_dtype},
    }
    save_params(out, nest_tree(flat), meta)
    yaml_path = Path(run_dir) / "config.yaml"
    if jax.process_index() == 0:
        files = out / "hf_files"
        files.mkdir(exist_ok=True)
        for name in EXTRA_FILES:
            if (Path(model_dir) / name).is_file():
                shutil.copyfile(Path(model_dir) / name, files / name)
        write_run_config(yaml_path, cfg, hf)
    return {
        "run_dir": str(run_dir),
        "config": str(yaml_path),
        "family": meta["hf"]["family"],
        "vocab": cfg.vocab,
        "params": int(sum(int(np.prod(a.shape)) for a in flat.values())),
    }


def write_run_config(path: Path, cfg, hf: dict) -> None:
    """RUN_DIR/config.yaml: the model section, checkpoint.init_params and train.run_dir (+ a fine-tuning lr)."""
    import yaml

    from meshrun.config import to_dict

    run_dir = path.parent
    arch = (hf.get("architectures") or [hf.get("model_type")])[0]
    doc = {
        "model": to_dict(cfg),
        "train": {"run_dir": str(run_dir), "lr": 3.0e-5},
        "checkpoint": {"init_params": str(Path(run_dir) / IMPORT_DIR)},
    }
    head = (
        f"# {arch} imported by `meshrun import-hf`: the model section matches the checkpoint in\n"
        f"# checkpoint.init_params (weights, fresh optimizer, step 0). Add mesh/train/data settings here or\n"
        f"# on the command line: meshrun train {path} mesh.tensor=2 model.dtype=bfloat16 train.steps=100\n"
    )
    path.write_text(head + yaml.safe_dump(doc, sort_keys=False))


def flat_tree(tree, prefix=()) -> dict[tuple[str, ...], Any]:
    tree = tree.to_pure_dict() if hasattr(tree, "to_pure_dict") else tree
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out |= flat_tree(v, prefix + (str(k),))
        else:
            out[prefix + (str(k),)] = v
    return out


def nest_tree(flat: dict[tuple[str, ...], Any]) -> dict:
    out: dict = {}
    for path, v in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return out


# ---------------------------------------------------------------- export


def find_source(run_dir: str | Path) -> tuple[str, Path, dict[str, Any]]:
    """('step', STEP dir, meta) of the newest complete checkpoint, else ('import', hf_import dir, meta)."""
    from meshrun.checkpoint.store import newest_complete

    if not Path(run_dir).is_dir():
        raise ConfigError(
            "RUN_DIR", str(run_dir), "give the train.run_dir of a run or of `meshrun import-hf`", "no such directory"
        )
    e = newest_complete(run_dir)
    if e is not None:
        d = Path(run_dir) / "checkpoints" / e.name
        return "step", d, json.loads((d / "meta" / "metadata").read_text())
    if (Path(run_dir) / IMPORT_DIR).is_dir():
        from meshrun.checkpoint.params import check_dir

        d = Path(run_dir) / IMPORT_DIR
        return "import", d, check_dir(d, "RUN_DIR")
    raise ConfigError(
        "RUN_DIR", str(run_dir), "train it first or import a model into it", "no complete checkpoint in it"
    )


def _hf_meta(run_dir: Path, meta: dict) -> tuple[dict | None, Path | None]:
    """The import's meta ('hf' entry) and its hf_files dir, found beside the run or via init_params."""
    for d in (run_dir / IMPORT_DIR, Path(meta.get("init_params") or "/nonexistent")):
        if (d / "meta.json").is_file():
            return json.loads((d / "meta.json").read_text()).get("hf"), d / "hf_files"
    return None, None


def load_params(run_dir: str | Path) -> tuple[Any, dict, dict[str, Any]]:
    """(ModelConfig, params on one device, checkpoint meta) of a run's newest weights: its newest
    complete step checkpoint, else its import."""
    from meshrun.config import ModelConfig, from_dict

    kind, directory, meta = find_source(run_dir)
    cfg = from_dict(ModelConfig, meta["model"], "model.")
    return cfg, _restore(kind, directory, cfg), meta


def _restore(kind: str, directory: Path, cfg) -> dict:
    """Params only, onto one device (host memory for the parameters; never the optimizer state)."""
    import jax
    import orbax.checkpoint as ocp

    from meshrun.checkpoint.params import PARAMS
    from meshrun.family import registry

    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    flat = {
        p: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=dev)
        for p, v in flat_tree(registry.get(cfg.family).abstract_params(cfg)).items()
    }
    target = nest_tree(flat)
    ckptr = ocp.PyTreeCheckpointer()
    try:
        if kind == "import":
            return ckptr.restore(directory / PARAMS, args=ocp.args.PyTreeRestore(target, restore_args=_rargs(target)))
        item = {"params": target}
        args = ocp.args.PyTreeRestore(item, restore_args=_rargs(item), partial_restore=True)
        return ckptr.restore(directory / "state", args=args)["params"]
    finally:
        ckptr.close()


def _rargs(tree):
    import jax
    import orbax.checkpoint as ocp

    return jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype), tree)


def parse_size(text: str) -> int:
    """'5GB', '500MB', '1e9' -> bytes (decimal units, as transformers' max_shard_size)."""
    m = _SIZE.match(text.strip())
    if not m:
        try:
            return int(float(text))
        except ValueError:
            raise ConfigError("--max-shard-size", text, "use e.g. 5GB, 500MB or a byte count") from None
    unit = (m.group(2) or "B").upper()
    return int(float(m.group(1)) * {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}[unit])


def export_hf(
    run_dir: str | Path, out_dir: str | Path, *, max_shard_bytes: int = 5 * 10**9, dtype: str | None = None
) -> dict[str, Any]:
    """Write RUN_DIR's newest weights as a transformers model directory (see the module docstring)."""
    import ml_dtypes

    from meshrun.config import ModelConfig, from_dict
    from meshrun.hf.convert import hf_config, hf_tensors
    from meshrun.hf.safetensors_io import write_sharded

    run_dir, out = Path(run_dir), Path(out_dir)
    _, directory, meta = find_source(run_dir)
    cfg = from_dict(ModelConfig, meta["model"], "model.")
    hf, files = _hf_meta(run_dir, meta)
    vocab = hf["vocab"] if hf else cfg.vocab
    dtype = dtype or (hf["dtype"] if hf else "float32")
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}.get(dtype)
    if np_dtype is None:
        raise ConfigError("--dtype", dtype, "use float32, bfloat16 or float16")
    config = dict(hf["config"]) if hf else hf_config(cfg, vocab, dtype)
    if "dtype" in config and "torch_dtype" not in config:
        config["dtype"] = dtype
    else:
        config["torch_dtype"] = dtype
    if max_shard_bytes < 1:
        raise ConfigError("--max-shard-size", max_shard_bytes, "use a positive size, e.g. 5GB")
    if out.exists() and any(out.iterdir()):
        raise ConfigError("OUT_DIR", str(out), "give a new or empty directory", "it is not empty")
    cfg, params, _ = load_params(run_dir)
    leaf = lambda path: _get(params, path)
    tensors = ((k, v.astype(np_dtype)) for k, v in hf_tensors(cfg, leaf, vocab))
    names = write_sharded(out, tensors, max_shard_bytes)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if files is not None and files.is_dir():
        for f in files.iterdir():
            shutil.copyfile(f, out / f.name)
    return {"out_dir": str(out), "source": str(directory), "files": names, "dtype": dtype, "vocab": vocab}


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


# ---------------------------------------------------------------- CLI
