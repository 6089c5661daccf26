"""`meshrun supervise CONFIG --launcher CMD --processes N`: a thin shell over `meshrun.runtime.supervise`."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from meshrun.config import load_config
from meshrun.errors import ConfigError
from meshrun.runtime.supervise import Supervisor


def register(sub) -> None:
    p = sub.add_parser("supervise", help="restart a failed multi-process job from its newest intact checkpoint")
    p.add_argument("config", help="the job's YAML config")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="config overrides, e.g. mesh.tensor=2 train.steps=10 (keys: `meshrun config`)",
    )
    p.add_argument("--launcher", required=True, help="command of one attempt; {processes} = current process count")
    p.add_argument("--processes", type=int, required=True, help="processes of the first attempt")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts after the first attempt (default 3)")
    p.add_argument("--elastic", action="store_true", help="restart on fewer processes when a host stays down")
    p.add_argument("--min-processes", type=int, default=1, help="the fewest processes --elastic goes down to")
    p.add_argument("--fast-compile", action="store_true", help=argparse.SUPPRESS)  # passed on to meshrun train
    p.set_defaults(func=run_supervise)


def run_supervise(args) -> int:
    cfg = load_config(args.config, args.overrides)  # bad input: exit 2 before anything starts
    for name, v, lo in (("--processes", args.processes, 1), ("--max-restarts", args.max_restarts, 0),
                        ("--min-processes", args.min_processes, 1)):  # fmt: skip
        if v < lo:
            raise ConfigError(name, v, f"use a whole number >= {lo}")
    try:
        words = shlex.split(args.launcher)
    except ValueError as e:  # an unbalanced quote
        raise ConfigError("--launcher", args.launcher, "quote the command as a shell would", str(e)) from None
    if not words:
        raise ConfigError("--launcher", args.launcher, "give the command of one attempt, e.g. launch/local.sh")
    if args.processes > 65536:
        raise ConfigError("--processes", args.processes, "use a whole number in [1, 65536]")
    train_args = [args.config, *args.overrides, *(["--fast-compile"] if args.fast_compile else [])]
    sup = Supervisor(args.launcher, train_args, Path(cfg.train.run_dir), processes=args.processes,
                     max_restarts=args.max_restarts, elastic=args.elastic,
                     min_processes=min(args.min_processes, args.processes), cfg=cfg)  # fmt: skip
    return sup.run()
