"""`meshrun train CONFIG [section.key=value ...]`: the main job.

The last line on stdout is one JSON object: step, loss, first_loss, tokens_per_s, run_dir.
"""

from __future__ import annotations

import json
import math
import os
import sys

from meshrun.errors import ConfigError

EXIT_TRAINING_ERROR = 3  # the run started but could not go on (NaN loss); bad input is 2


def register(sub) -> None:
    p = sub.add_parser("train", help="train a model (the main job)")
    p.add_argument("config", help="YAML config, e.g. configs/tiny_cpu.yaml")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    p.add_argument(
        "--devices",
        type=int,
        default=0,
        help="simulated CPU devices (default: the mesh's device count when it has no -1 axis, else 8)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_train)


def _needed_devices(cfg) -> int:
    sizes = [getattr(cfg.mesh, a) for a in ("data", "pipe", "expert", "tensor")]
    return 8 if -1 in sizes else math.prod(sizes)


def run_train(args) -> int:
    from meshrun.config import load_config
    from meshrun.devices import simulate_cpu_devices

    cfg = load_config(args.config, args.overrides)
    if args.devices < 0:
        raise ConfigError("--devices", args.devices, "use a positive device count")
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "") or args.devices:
        simulate_cpu_devices(args.devices or _needed_devices(cfg))
    from meshrun.distributed import initialize

    initialize()
    from meshrun.loop import TrainingError, run

    try:
        result = run(cfg, quiet=args.quiet)
    except TrainingError as e:
        print(f"meshrun train: error: {e}", file=sys.stderr)
        return EXIT_TRAINING_ERROR
    print(json.dumps({k: result[k] for k in ("step", "loss", "first_loss", "tokens_per_s", "run_dir")}))
    return 0
