"""`meshrun import-hf MODEL_DIR RUN_DIR` and `meshrun export-hf RUN_DIR OUT_DIR`: a thin shell over `meshrun.hf.io`."""

from __future__ import annotations

import argparse
import json
import math

from meshrun.config import AXES, MAX_DIM, MeshConfig, check_device_count, load_section
from meshrun.errors import ConfigError
from meshrun.hf.files import parse_size, read_hf_dir
from meshrun.runtime.devices import setup_devices


def register(sub) -> None:
    p = sub.add_parser(
        "import-hf",
        help="convert a local Hugging Face model directory into a run dir",
        description="Convert a local transformers model directory (config.json + *.safetensors; Llama 2/3/3.1, "
        "Mistral, Qwen2, Mixtral, GPT-2) into RUN_DIR/hf_import (parameters) and RUN_DIR/config.yaml, which "
        "`meshrun train` starts from. Never touches the network. Prints one JSON object.",
        epilog="examples:\n  meshrun import-hf path/to/Meta-Llama-3.1-8B runs/llama31\n"
        "  meshrun train runs/llama31/config.yaml data.kind=synthetic train.steps=10   # a quick check",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model_dir", help="directory with config.json and *.safetensors (local only)")
    p.add_argument("run_dir", help="run directory to create (hf_import/ and config.yaml)")
    p.add_argument(
        "--vocab-multiple", type=int, default=128, help="pad the vocabulary to a multiple of this (default 128)"
    )
    p.add_argument("--devices", type=int, default=None, help="CPU only: simulate N devices to place the weights on")
    p.add_argument(
        "overrides", nargs="*", metavar="mesh.KEY=VALUE", help="the mesh the weights are placed on while converting"
    )
    p.set_defaults(func=_import_cmd)
    q = sub.add_parser(
        "export-hf",
        help="write a run's newest weights as a Hugging Face model directory",
        description="Write the newest intact checkpoint of RUN_DIR (else its import) as config.json + safetensors "
        "shards that transformers loads, with the tokenizer files. Prints one JSON object.",
        epilog="example:\n  meshrun export-hf runs/llama31 out/llama31-tuned",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    q.add_argument("run_dir", help="a train.run_dir with checkpoints, or an import-hf run dir")
    q.add_argument("out_dir", help="directory to write config.json, *.safetensors and tokenizer files into")
    q.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default 5GB)")
    q.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the imported model's)")
    q.add_argument("--step", type=int, default=None, help="checkpoint step to export (default: the newest intact)")
    q.set_defaults(func=_export_cmd)


def _import_cmd(args) -> int:
    mesh_cfg = load_section(MeshConfig, args.overrides, "mesh")
    check_device_count("--devices", args.devices)
    if args.vocab_multiple < 1 or args.vocab_multiple > MAX_DIM:
        raise ConfigError("--vocab-multiple", args.vocab_multiple, f"use a multiple in 1..{MAX_DIM}, e.g. 128")
    read_hf_dir(args.model_dir)  # a hub id fails before jax starts
    if args.devices:
        setup_devices(args.devices, force=True)
    from meshrun.hf.io import import_hf  # imports jax: after the devices
    from meshrun.runtime.mesh import build_mesh

    if not args.devices:
        _check_enough_devices(mesh_cfg)
    result = import_hf(args.model_dir, args.run_dir, mesh=build_mesh(mesh_cfg), vocab_multiple=args.vocab_multiple)
    print(json.dumps(result))
    return 0


def _check_enough_devices(mesh_cfg: MeshConfig) -> None:
    """Mesh degrees whose product does not divide the devices here (no --devices): name --devices."""
    import jax

    given = {ax: getattr(mesh_cfg, ax) for ax in AXES if getattr(mesh_cfg, ax) not in (1, -1)}
    need, n = math.prod(given.values()), jax.device_count()
    if n % need:
        asked = " ".join(f"mesh.{ax}={v}" for ax, v in given.items())
        raise ConfigError("--devices", None, f"give --devices {need} (CPU: simulated devices) or smaller mesh degrees",
                          f"{asked} needs a multiple of {need} devices, {n} here")  # fmt: skip


def _export_cmd(args) -> int:
    max_shard = parse_size(args.max_shard_size)
    from meshrun.hf.io import export_hf  # imports jax

    result = export_hf(args.run_dir, args.out_dir, max_shard_bytes=max_shard, dtype=args.dtype, step=args.step)
    print(json.dumps(result))
    return 0
