"""`meshrun train | plan | mesh | schedule | explain`: a thin shell over the library.

Bad input (ConfigError) -> one line on stderr, exit status 2, no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import warnings

from meshrun.errors import ConfigError

# Subcommand modules, each with `register(subparsers)`; imported lazily so `--devices` can act before jax.
COMMAND_MODULES = ("meshrun.pipeline.cli", "meshrun.planner.cli", "meshrun.train_cli", "meshrun.explain")


def _mesh_register(sub) -> None:
    p = sub.add_parser("mesh", help="build and describe a device mesh")
    p.add_argument("--devices", type=int, default=0, help="simulate N CPU devices (CPU runs)")
    p.add_argument("--hosts", type=int, default=None, help="split devices into H (pretend) hosts")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("overrides", nargs="*", metavar="mesh.KEY=VALUE")
    p.set_defaults(func=_mesh_run)


def _mesh_run(args) -> int:
    from meshrun.config import MeshConfig, load_section
    from meshrun.devices import simulate_cpu_devices

    over = list(args.overrides) + ([f"mesh.hosts={args.hosts}"] if args.hosts is not None else [])
    cfg = load_section(MeshConfig, over, "mesh")
    if args.devices < 0:
        raise ConfigError("--devices", args.devices, "use a positive device count")
    if args.devices:
        simulate_cpu_devices(args.devices)
    from meshrun.devices import cpu_devices
    from meshrun.mesh import build_mesh, describe, describe_dict

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshrun", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _mesh_register(sub)
    for name in COMMAND_MODULES:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    # `section.key=value` overrides may come after flags (argparse stops filling positionals there)
    if rest and hasattr(args, "overrides") and all("=" in r and not r.startswith("-") for r in rest):
        args.overrides = [*args.overrides, *rest]
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"meshrun {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
