"""`meshrun train CONFIG [section.key=value ...]`: the main job.

The last line on stdout is one JSON object: step, loss, first_loss, val_loss (with train.eval_every),
tokens_per_s, run_dir.
Failures: one line on stderr and the exit status of `meshrun/errors.py` (2 bad input, 3 NaN/Inf
loss, 4 I/O, 5 checkpoint, 6 distributed), reported by `meshrun.cli.main`.
"""

from __future__ import annotations

import json

from meshrun.config import check_device_count, load_config, load_mesh
from meshrun.runtime.devices import add_fast_compile_flag
from meshrun.runtime.distributed import start_command


def register(sub) -> None:
    p = sub.add_parser("train", help="train a model (the main job)")
    p.add_argument("config", help="YAML config, e.g. configs/tiny_cpu.yaml")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="config overrides, e.g. mesh.tensor=2 train.steps=10 (keys: `meshrun config`)",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="simulated CPU devices on the CPU platform (default: the mesh's device count when it has no "
        "-1 axis, else 8)",
    )
    add_fast_compile_flag(p)
    p.add_argument(
        "--quiet",
        action="store_true",
        help="only warnings, errors and the final JSON line (no start-up block, progress or lifecycle lines)",
    )
    p.set_defaults(func=run_train)


def run_train(args) -> int:
    check_device_count("--devices", args.devices)  # 0 is a value, not "not given"
    args.devices = args.devices or 0
    start_command(load_mesh(args.config, args.overrides), args, "train")  # before a family's module imports jax
    cfg = load_config(args.config, args.overrides)
    from meshrun.report.startup import startup_lines  # imports jax: only once the devices are set up
    from meshrun.train.loop import run

    result = run(cfg, quiet=args.quiet, startup=startup_lines)
    keys = ("step", "loss", "first_loss", "val_loss", "tokens_per_s", "run_dir")
    print(json.dumps({k: result[k] for k in keys if k in result}))
    return 0
