"""`meshrun mesh [--devices N] [--hosts H] [--json] mesh.KEY=VALUE ...`: build and describe a device mesh."""

from __future__ import annotations

import json
import sys
import warnings

from meshrun.config import MeshConfig, check_device_count, load_section
from meshrun.errors import ConfigError
from meshrun.runtime.devices import cpu_devices, simulate_cpu_devices


def register(sub) -> None:
    p = sub.add_parser("mesh", help="build and describe a device mesh")
    p.add_argument("--devices", type=int, default=None, help="simulate N CPU devices (CPU runs)")
    p.add_argument("--hosts", type=int, default=None, help="split devices into H (pretend) hosts")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "overrides", nargs="*", metavar="mesh.KEY=VALUE", help="mesh degrees, e.g. mesh.pipe=2 mesh.tensor=2"
    )
    p.set_defaults(func=run_mesh)


def run_mesh(args) -> int:
    if args.hosts is not None and args.hosts < 1:  # 0 is mesh.hosts' "one host per process": not a flag value
        raise ConfigError("--hosts", args.hosts, "use a positive host count (or leave it out)")
    over = list(args.overrides) + ([f"mesh.hosts={args.hosts}"] if args.hosts is not None else [])
    cfg = load_section(MeshConfig, over, "mesh")
    check_device_count("--devices", args.devices)
    if args.devices:
        simulate_cpu_devices(args.devices)
    from meshrun.runtime.mesh import build_mesh, describe, describe_dict  # imports jax: after the devices

    devices = cpu_devices(args.devices) if args.devices else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mesh = build_mesh(cfg, devices=devices)
    msgs = [str(w.message) for w in caught if "mesh." in str(w.message)]
    if args.json:
        print(json.dumps({**describe_dict(mesh), "warnings": msgs}))
    else:
        print(describe(mesh))
        for m in msgs:
            print(f"warning: {m}", file=sys.stderr)
    return 0
