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
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import yaml

from meshrun.checkpoint import checksum
from meshrun.checkpoint.params import PARAMS, check_dir, save_params
from meshrun.checkpoint.state import path_key
from meshrun.checkpoint.store import scan
from meshrun.config import MeshConfig, ModelConfig, from_dict, saved_model, to_dict
from meshrun.errors import CheckpointError, ConfigError
from meshrun.family import registry
from meshrun.hf.convert import (
    TransposedTensor,
    adapter,
    expected_names,
    family_of,
    first_name,
    hf_config,
    hf_tensors,
    ignored,
    lazy_params,
    model_config,
)
from meshrun.hf.files import read_hf_dir
from meshrun.hf.safetensors_io import FormatError, SafeTensors, write_sharded
from meshrun.parallel.sharding import param_rules, tree_shardings
from meshrun.runtime.mesh import build_mesh

IMPORT_DIR = "hf_import"
EXTRA_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "generation_config.json",
)


def import_hf(model_dir: str | Path, run_dir: str | Path, *, mesh=None, vocab_multiple: int = 128) -> dict[str, Any]:
    """Convert MODEL_DIR into RUN_DIR (see the module docstring). `mesh`: where the weights are placed
    while converting (default: all devices on 'data', parameters sharded as under ZeRO-3)."""

    hf = read_hf_dir(model_dir)
    if vocab_multiple < 1:
        raise ConfigError("--vocab-multiple", vocab_multiple, "use a positive multiple, e.g. 128")
    cfg = model_config(hf, vocab_multiple)
    out = Path(run_dir) / IMPORT_DIR
    if out.exists():
        raise ConfigError(
            "RUN_DIR", str(run_dir), "use a new RUN_DIR or delete its hf_import/", "it already holds an import"
        )
    st = _checked_tensors(model_dir, cfg)
    _note_unused(hf)
    flat = _placed_params(cfg, st, hf, model_dir, mesh if mesh is not None else build_mesh(MeshConfig()))
    src_dtype = hf.get("torch_dtype") or hf.get("dtype")
    src_dtype = src_dtype if src_dtype in ("float32", "bfloat16", "float16") else "float32"
    meta = {
        "model": to_dict(cfg),
        "hf": {"config": hf, "vocab": hf["vocab_size"], "family": family_of(hf), "dtype": src_dtype},
    }
    save_params(out, nest_tree(flat), meta)
    yaml_path = Path(os.path.abspath(run_dir)) / "config.yaml"  # absolute paths inside: train from anywhere
    if jax.process_index() == 0:
        _copy_extra_files(model_dir, out / "hf_files")
        write_run_config(yaml_path, cfg, hf)
    return {
        "run_dir": str(run_dir),
        "config": str(yaml_path),
        "family": cfg.family,  # meshrun's model.family, as in config.yaml
        "architecture": meta["hf"]["family"],  # the checkpoint's own (mistral, qwen2, mixtral trained as llama)
        "vocab": cfg.vocab,
        "params": int(sum(int(np.prod(a.shape)) for a in flat.values())),
        "next": quick_check(yaml_path),
    }


def _note_unused(hf: dict) -> None:
    """One note on stderr for the checkpoint's layers meshrun does not import (DeepSeek-V3's MTP)."""
    mtp = hf.get("num_nextn_predict_layers") or 0
    if mtp and jax.process_index() == 0:
        first = hf["num_hidden_layers"]
        print(f"meshrun: note: num_nextn_predict_layers={mtp}: the multi-token-prediction layers' weights "
              f"(model.layers.{first}.* on) are not imported; meshrun trains next-token prediction",
              file=sys.stderr)  # fmt: skip


def _placed_params(cfg, st, hf, model_dir, mesh) -> dict:
    """{path: jax.Array}: every weight placed straight into its ZeRO-3 sharding on `mesh`, each
    device's shard read from the memory-mapped files on its own."""
    family = registry.get(cfg.family)
    family.check_mesh(cfg, dict(mesh.shape))
    shardings = flat_tree(tree_shardings(family.abstract_params(cfg), mesh, param_rules(zero=3)))
    abstract = flat_tree(family.abstract_params(cfg))
    lazies = _checked_lazies(cfg, st, hf, model_dir, {p: a.shape for p, a in abstract.items()})
    flat = {}
    for path, sh in shardings.items():  # each leaf in its own dtype (balance state: float32 always)
        lz, dtype = lazies[path], np.dtype(abstract[path].dtype)
        flat[path] = jax.make_array_from_callback(lz.shape, sh, lambda i, lz=lz, t=dtype: lz.read(i).astype(t))
    return flat


def _copy_extra_files(model_dir, files: Path) -> None:
    """The tokenizer and generation files of MODEL_DIR, copied along into `files`."""
    files.mkdir(exist_ok=True)
    for name in EXTRA_FILES:
        if (Path(model_dir) / name).is_file():
            shutil.copyfile(Path(model_dir) / name, files / name)


def _checked_tensors(model_dir, cfg):
    """MODEL_DIR's safetensors under the family's canonical names; a missing, unknown or integer
    tensor is a ConfigError naming MODEL_DIR."""
    try:
        st = SafeTensors(model_dir)
    except (FileNotFoundError, FormatError) as e:
        raise ConfigError(
            "MODEL_DIR", str(model_dir), "give a directory with the model's *.safetensors files", str(e)
        ) from None
    rename = getattr(adapter(cfg), "canonical_name", None)
    st = _Renamed(st, rename) if rename is not None else st
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

    for name in sorted(need):
        kind = np.dtype(st.get(name).dtype).kind
        if kind in "iub":  # int, unsigned, bool: a quantized or broken file, never cast to float silently
            raise ConfigError(
                "MODEL_DIR",
                str(model_dir),
                "give a checkpoint with floating-point weights (quantized checkpoints are not supported)",
                f"{name} is stored as {np.dtype(st.get(name).dtype).name}, the model needs floating point",
            )
    return st


class _Renamed:
    """A checkpoint's tensors under the family's canonical names (`canonical_name` of its adapter:
    GPT-2 files saved from `GPT2Model` have no `transformer.` prefix)."""

    def __init__(self, st: SafeTensors, rename):
        self.st, self.names = st, {rename(k): k for k in st.keys()}

    def keys(self):
        return self.names.keys()

    def get(self, name: str):
        return self.st.get(self.names[name])


def _checked_lazies(cfg, st, hf: dict, model_dir, want: dict) -> dict:
    """lazy_params of the checkpoint, after checking every tensor's shape against config.json: a head
    count or size that contradicts the stored tensors is a ConfigError naming both, before anything
    is written."""

    fix = "give a config.json that matches the checkpoint's tensors (or the tensors its config.json describes)"
    try:
        lazies = lazy_params(cfg, st.get, hf["vocab_size"])
    except TransposedTensor as e:
        raise ConfigError(
            "MODEL_DIR", str(model_dir), "store every layer's tensor as transformers does", str(e)
        ) from None
    except ValueError as e:  # a per-head reshape that does not fit the stored tensor
        raise ConfigError(f"{model_dir}/config.json", str(e), fix, "contradicts the tensor shapes") from None
    ad = adapter(cfg)
    names = {p: first_name(v, cfg) for p, v in ad.layer_map(cfg).items()}
    names |= {p: t for p, (t, _) in ad.top_map(cfg).items()}

    for name, kind in ad.top_map(cfg).values():
        if kind in ("vocab", "vocab_t") and st.get(name).shape[0] != hf["vocab_size"]:
            raise ConfigError(
                f"{model_dir}/config.json: vocab_size",
                hf["vocab_size"],
                fix,
                f"{name} holds {st.get(name).shape[0]} rows",
            )
    for path, shape in want.items():
        got = tuple(lazies[path].shape)
        if got != tuple(shape):
            raise ConfigError(
                f"{model_dir}/config.json",
                "/".join(path),
                fix,
                f"config.json implies shape {tuple(shape)} for this weight, the safetensors' {names[path]} gives {got}",
            )
    return lazies


def quick_check(config_path: Path) -> str:
    """The command that trains an import as written: random tokens (data.kind=synthetic) need no
    tokenizer, where the default byte-level text needs a vocabulary of at least 256."""
    return f"meshrun train {config_path} data.kind=synthetic train.steps=10"


def write_run_config(path: Path, cfg, hf: dict) -> None:
    """RUN_DIR/config.yaml: the model section, checkpoint.init_params and train.run_dir (+ a fine-tuning
    optimizer.lr)."""
    run_dir = Path(os.path.abspath(path.parent))
    arch = (hf.get("architectures") or [hf.get("model_type")])[0]
    doc = {
        "model": to_dict(cfg),
        "train": {"run_dir": str(run_dir)},
        "optimizer": {"lr": 3.0e-5},
        "checkpoint": {"init_params": str(Path(run_dir) / IMPORT_DIR)},
    }
    files = path.parent / IMPORT_DIR / "hf_files"
    prepare = f"#   meshrun prepare-data --tokenizer {files} --glob 'corpus/**/*.jsonl' --out data/corpus\n"
    tok = prepare if (files / "tokenizer.json").is_file() else ""
    head = (
        f"# {arch} imported by `meshrun import-hf`: the model section matches the checkpoint in\n"
        f"# checkpoint.init_params (weights, fresh optimizer, step 0). Add mesh/train/data settings here or\n"
        f"# on the command line. A quick check that it trains (random tokens): {quick_check(path)}\n"
        f"# Fine-tune on your text, tokenized with the model's own tokenizer (`meshrun prepare-data`):\n{tok}"
        f"#   meshrun train {path} data.kind=prepared data.path=data/corpus train.steps=100\n"
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


def _candidates(run_dir: str | Path, step: int | None = None) -> list[tuple[str, Path]]:
    """(kind, dir) to export from, newest first: the complete step checkpoints (only `step` when
    given), else the import. Only damaged checkpoints -> CheckpointError (exit 5)."""

    if not Path(run_dir).is_dir():
        raise ConfigError(
            "RUN_DIR", str(run_dir), "give the train.run_dir of a run or of `meshrun import-hf`", "no such directory"
        )
    root = Path(os.path.abspath(run_dir))  # orbax takes absolute paths only
    entries = scan(root)
    steps = [e for e in entries if e.status == "complete" and e.name.isdigit()]
    if step is not None:
        chosen = [e for e in steps if e.step == step]
        if not chosen:
            have = ", ".join(e.name for e in steps) or "none"
            raise ConfigError("--step", step, f"use a complete step (complete: {have}), or leave --step out",
                              f"no complete checkpoint at that step in {root / 'checkpoints'}")  # fmt: skip
        return [("step", root / "checkpoints" / chosen[0].name)]
    if steps:
        return [("step", root / "checkpoints" / e.name) for e in reversed(steps)]
    if (root / IMPORT_DIR).is_dir():
        return [("import", root / IMPORT_DIR)]
    damaged = [e.name for e in entries if e.status == "damaged"]
    if damaged:
        raise CheckpointError(
            f"no intact checkpoint in {root / 'checkpoints'} (damaged: {', '.join(damaged)}); "
            "`meshrun checkpoints RUN_DIR --verify` lists them"
        )
    raise ConfigError(
        "RUN_DIR", str(run_dir), "train it first or import a model into it", "no complete checkpoint in it"
    )


def _read_meta(kind: str, directory: Path) -> dict[str, Any]:

    if kind == "import":
        return check_dir(directory, "RUN_DIR")
    return json.loads((directory / "meta" / "metadata").read_text())


def find_source(run_dir: str | Path, step: int | None = None) -> tuple[str, Path, dict[str, Any]]:
    """('step', STEP dir, meta) of the newest complete checkpoint (or of `step`), else ('import',
    hf_import dir, meta) (not read back: `load_params` verifies the arrays)."""
    kind, directory = _candidates(run_dir, step)[0]
    return kind, directory, _read_meta(kind, directory)


def _hf_meta(run_dir: Path, meta: dict) -> tuple[dict | None, Path | None]:
    """The import's meta ('hf' entry) and its hf_files dir, found beside the run or via init_params."""
    for d in (run_dir / IMPORT_DIR, Path(meta.get("init_params") or "/nonexistent")):
        if (d / "meta.json").is_file():
            return json.loads((d / "meta.json").read_text()).get("hf"), d / "hf_files"
    return None, None


def load_params(run_dir: str | Path, *, quiet: bool = False) -> tuple[Any, dict, dict[str, Any]]:
    """(ModelConfig, params on one device, checkpoint meta) of a run's newest *intact* weights: its
    newest complete step checkpoint whose arrays read back and match their checksums (a damaged one
    is reported on stderr and the next older one used, as `meshrun train` does; none is moved or
    deleted), else its import. CheckpointError (exit 5) when every step checkpoint is damaged."""
    cfg, params, meta, _ = load_params_from(run_dir, quiet=quiet)
    return cfg, params, meta


def load_params_from(
    run_dir: str | Path, *, quiet: bool = False, step: int | None = None
) -> tuple[Any, dict, dict[str, Any], Path]:
    """`load_params` plus the directory the weights came from; `step`: that checkpoint only."""
    cands = _candidates(run_dir, step)
    damaged = []
    for kind, directory in cands:
        try:
            meta = _read_meta(kind, directory)
            cfg = from_dict(ModelConfig, saved_model(meta["model"]), "model.")
            params = _restore(kind, directory, cfg, meta.get("checksums"))
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - orbax, TensorStore, JSON and OS errors all mean "unreadable"
            first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
            why = f"{type(e).__name__}: {first[:160]}"
            damaged.append(directory.name)
            if step is not None:  # that checkpoint or nothing: no older one is tried
                other = "export another --step (`meshrun checkpoints RUN_DIR --verify` lists the intact ones)"
                raise CheckpointError(f"checkpoint {directory} is damaged ({why}); {other}") from None
            if not quiet:
                print(f"meshrun: checkpoint {directory} is damaged ({why}); trying an older one", file=sys.stderr)
            continue
        if damaged and not quiet:
            print(f"meshrun: exporting checkpoint {directory.name} (newest intact)", file=sys.stderr)
        return cfg, params, meta, directory
    raise CheckpointError(
        f"no intact checkpoint in {Path(run_dir) / 'checkpoints'}: steps {', '.join(damaged)} are damaged "
        "(`meshrun checkpoints RUN_DIR --verify` lists them)"
    )


def _restore(kind: str, directory: Path, cfg, checksums: dict | None = None) -> dict:
    """Params only, onto one device (host memory for the parameters; never the optimizer state),
    checked against the step's saved checksums (`meshrun.checkpoint.checksum`)."""

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
        restored = ckptr.restore(directory / "state", args=args)
    finally:
        ckptr.close()
    if checksums:
        now = checksum.checksums(restored, path_key)
        unlisted = sorted(k for k in now if k not in checksums)
        if unlisted:
            raise ValueError(f"no checksum saved for {', '.join(unlisted[:3])}")
        bad = [k for k, v in now.items() if list(checksums[k]) != v]
        if bad:  # OCDBT reads overwritten chunk bytes without an error
            raise ValueError(f"array data does not match its checksum: {', '.join(bad[:3])}")
    return restored["params"]


def _rargs(tree):

    return jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype), tree)


# ModelConfig fields that change what the exported weights compute (the rest are how meshrun trains)
_RUNTIME_FIELDS = {
    "vocab",
    "vocab_used",
    "dtype",
    "param_dtype",
    "init_std",
    "attention_impl",
    "remat",
    "remat_every",
    "sequence_parallel",
    "capacity_factor",
    "moe_dispatch",
    "aux_loss_coef",
    "z_loss_coef",
    "fp8",  # fp8 is how the GEMMs ran: the master weights are ordinary weights (export_hf notes it)
    "fp8_amax_history",
    "fp8_first_last_bf16",
    "fp8_block",
    "bias_rate",  # balance=bias's update step: a training setting no config.json holds
}


def _arch(cfg) -> dict[str, Any]:

    d = {k: v for k, v in to_dict(cfg).items() if k not in _RUNTIME_FIELDS}
    if d.get("rope_scaling") == "none":  # the scaling parameters are unused then
        d = {k: v for k, v in d.items() if not k.startswith("rope_") or k in ("rope_theta", "rope_scaling")}
    if not d.get("n_experts"):
        d = {k: v for k, v in d.items() if k not in ("top_k", "moe_every")}
    elif "moe_d_ff" in d:  # 0 means d_ff: the width is what counts
        d["moe_d_ff"] = cfg.expert_d_ff
    if d.get("attention") == "mla":  # every head has its own k and v; head_dim is unused
        d = {k: v for k, v in d.items() if k not in ("n_kv_heads", "head_dim")}
    return d


def export_config(cfg, hf: dict | None, vocab: int, dtype: str) -> dict[str, Any]:
    """The config.json of the model that was trained: the import's own config.json when the trained
    model is the imported one (overrides of runtime settings aside), else one written from `cfg`; the
    result must read back as `cfg` (every field that changes the computation), else a ConfigError
    naming the fields that Hugging Face cannot express."""

    config, keep = None, {}
    if hf:
        config = dict(hf["config"])
        if _arch(model_config(config, cfg.vocab)) != _arch(cfg):
            keep = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
            config = None
    if config is None:
        config = hf_config(cfg, vocab, dtype) | keep
    if config.get("num_nextn_predict_layers"):  # DeepSeek-V3's MTP layer was not imported: none is written
        config["num_nextn_predict_layers"] = 0
    if "dtype" in config and "torch_dtype" not in config:
        config["dtype"] = dtype
    else:
        config["torch_dtype"] = dtype
    want, got = _arch(cfg), _arch(model_config(config, cfg.vocab))
    diff = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
    if diff:
        raise ConfigError(
            ", ".join(f"model.{k}" for k in diff),
            {k: want.get(k) for k in diff},
            "export a run trained with settings a transformers architecture has (Llama, Mistral, Qwen2, Mixtral, "
            "Qwen3-MoE, DeepSeek-V3)",
            "the trained model cannot be written as a Hugging Face config.json",
        )
    return config


def export_hf(
    run_dir: str | Path,
    out_dir: str | Path,
    *,
    max_shard_bytes: int = 5 * 10**9,
    dtype: str | None = None,
    quiet: bool = False,
    step: int | None = None,
) -> dict[str, Any]:
    """Write RUN_DIR's newest intact weights (or checkpoint `step`'s) as a transformers model directory
    (see the module docstring): the trained model's config (overrides included), its weights, and the
    tokenizer (the import's files; a run on `meshrun prepare-data` shards: that data's tokenizer.json).
    "source" in the result is the checkpoint actually exported."""

    run_dir, out = Path(run_dir), Path(out_dir)
    _, directory, meta = find_source(run_dir, step)
    cfg = from_dict(ModelConfig, saved_model(meta["model"]), "model.")
    hf, files = _hf_meta(run_dir, meta)
    vocab = hf["vocab"] if hf else (cfg.vocab_used or cfg.vocab)
    dtype = dtype or (hf["dtype"] if hf else "float32")
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}.get(dtype)
    if np_dtype is None:
        raise ConfigError("--dtype", dtype, "use float32, bfloat16 or float16")
    if max_shard_bytes < 1:
        raise ConfigError("--max-shard-size", max_shard_bytes, "use a positive size, e.g. 5GB")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError("OUT_DIR", str(out), "give a new or empty directory", "it is not empty")
    config = export_config(cfg, hf, vocab, dtype)
    tokenizer = _data_tokenizer(meta)
    cfg, params, meta, directory = load_params_from(run_dir, quiet=quiet, step=step)
    config = export_config(cfg, hf, vocab, dtype)  # the checkpoint used may be an older one
    if cfg.fp8 != "none" and not quiet:
        print(f"meshrun: note: model.fp8={cfg.fp8}: exporting the master weights as {dtype}; transformers "
              "computes it without fp8 (the fp8 scaling state is not written)", file=sys.stderr)  # fmt: skip
    leaf = lambda path: _get(params, path)
    tensors = ((k, v.astype(np_dtype)) for k, v in hf_tensors(cfg, leaf, vocab))
    names = write_sharded(out, tensors, max_shard_bytes)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _copy_tokenizer(out, files, tokenizer)
    return {"out_dir": str(out), "source": str(directory), "files": names, "dtype": dtype, "vocab": vocab}


def _copy_tokenizer(out: Path, files: Path | None, tokenizer: Path | None) -> None:
    """The import's extra files, then the training data's tokenizer.json (and its config), into `out`."""
    if files is not None and files.is_dir():
        for f in files.iterdir():
            shutil.copyfile(f, out / f.name)
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / "tokenizer.json")
        _write_tokenizer_config(out, tokenizer.parent)


def _data_tokenizer(meta: dict) -> Path | None:
    """tokenizer.json of the `meshrun prepare-data` directory the run trained on (checkpoint meta
    `data`: {"kind", "path"}), if any."""
    data = meta.get("data") if isinstance(meta.get("data"), dict) else {}
    if data.get("kind") != "prepared" or not data.get("path"):
        return None
    tok = Path(data["path"]) / "tokenizer.json"
    return tok if tok.is_file() else None


def _write_tokenizer_config(out: Path, data_dir: Path) -> None:
    """tokenizer_config.json naming the data's end-of-document token, unless the import brought one."""
    if (out / "tokenizer_config.json").is_file():
        return
    try:
        manifest = json.loads((data_dir / "manifest.json").read_text())
        eos = manifest.get("eos")
    except (OSError, ValueError, AttributeError):
        eos = None
    doc = {"tokenizer_class": "PreTrainedTokenizerFast"} | ({"eos_token": eos} if isinstance(eos, str) else {})
    (out / "tokenizer_config.json").write_text(json.dumps(doc, indent=2) + "\n")


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


# ---------------------------------------------------------------- CLI
