"""`meshrun config [--section S] [--markdown | --json]`: every config key with its type, default and meaning."""

from __future__ import annotations

import argparse
import dataclasses
import json

from meshrun import config_ref
from meshrun.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser(
        "config",
        help="list every config key with its type, default and meaning",
        description="List every config key (section.key) with its type, default and one-line meaning, read "
        "from the config dataclasses.",
        epilog="examples:\n  meshrun config\n  meshrun config --section pipeline\n"
        f"  {config_ref.REGENERATE}   # regenerate the docs page",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--section", default=None, metavar="NAME", help="only this section (mesh, model, train, ...)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--markdown", action="store_true", help="print docs/configuration.md (all sections)")
    fmt.add_argument("--json", action="store_true", help="print one JSON list of {key, type, default, meaning}")
    p.set_defaults(func=run_config)


def run_config(args) -> int:
    if args.markdown:
        if args.section:
            raise ConfigError("--section", args.section, "leave it out with --markdown (the page lists all sections)")
        print(config_ref.markdown(), end="")
        return 0
    secs = config_ref.sections()
    if args.section is not None and args.section not in secs:
        raise ConfigError("--section", args.section, f"use one of {list(secs)}", "no such section")
    rows = config_ref.keys()
    if args.section:
        rows = [r for r in rows if r.key.startswith(args.section + ".")]
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows]))
    else:
        print(config_ref.text(rows))
    return 0
