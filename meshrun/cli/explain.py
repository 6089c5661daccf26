"""`meshrun explain CONFIG [section.key=value ...] [--json] [--cluster C]`: a thin shell over
`meshrun.report.explain` (compile the train step, never run it)."""

from __future__ import annotations

import json
import os
import re
import sys

from meshrun.config import load_config, load_mesh
from meshrun.errors import ConfigError
from meshrun.report.explain import MAX_SIMULATED, check_cluster, explain, format_report, step_time
from meshrun.runtime.devices import add_fast_compile_flag, needed_devices, simulate_cpu_devices


def register(sub) -> None:
    p = sub.add_parser("explain", help="compile (do not run) the train step: predicted vs compiled memory, comms")
    p.add_argument("config", help="YAML config, e.g. configs/tiny_cpu.yaml")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="config overrides, e.g. mesh.tensor=2 train.steps=10 (keys: `meshrun config`)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (memory, collectives)")
    p.add_argument("--cluster", help="also predict the step time on this cluster, e.g. h100-80g:1x8 (`meshrun plan`)")
    add_fast_compile_flag(p)
    p.set_defaults(func=run_explain)


def run_explain(args) -> int:
    n = needed_devices(load_mesh(args.config, args.overrides))  # before a family's module imports jax
    if n <= MAX_SIMULATED:
        if "jax" in sys.modules:
            import jax

            have = len(jax.devices("cpu"))
            if have < n:
                raise ConfigError(
                    "mesh", n, f"this process has {have} CPU devices; run `meshrun explain` in a fresh process"
                )
        else:  # explain compiles for simulated CPU devices, whatever machine it runs on
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
            simulate_cpu_devices(max(n, _flag_devices()), fast_compile=args.fast_compile)
    cfg = load_config(args.config, args.overrides)
    if args.cluster:
        check_cluster(cfg, args.cluster)  # before compiling
    rep = explain(cfg)
    rep["config"] = str(args.config)
    if args.cluster:
        rep["step_time_s"] = {"cluster": args.cluster, "predicted": step_time(cfg, rep["mesh"], args.cluster)}
    if args.json:
        print(json.dumps(rep))
    else:
        print(format_report(rep, str(args.config)))
    return 0


def _flag_devices() -> int:
    m = re.search(r"xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(m.group(1)) if m else 1
