"""meshrun: train transformers in JAX with data x pipeline x tensor x expert x context parallelism.

The command line is a thin shell over the library: one module per command in meshrun/cli/.

Every failure is one line on stderr and an exit status from the table in `meshrun/errors.py` (bad
input 2, training 3, I/O 4, checkpoint 5, distributed 6, anything else 1); the traceback only with
`--debug` (anywhere on the command line) or MESHRUN_DEBUG=1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import textwrap
import traceback

from meshrun.errors import (
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_IO,
    EXIT_TRAINING,
    DistributedError,
    MeshrunError,
)

# Subcommand modules, each with `register(subparsers)`, all imported when the parser is built.
#
# Imports inside functions: the rule. Modules import at the top; an import inside a function is only
# for one of these reasons, never to hide an import cycle or a layering violation (`lint-imports`
# sees imports inside functions too and checks the contracts in pyproject.toml):
# - jax must not be imported before the devices are set up (simulated CPU devices are XLA flags read
#   when jax starts, and jax.distributed must start before any backend). Building the parser imports
#   every meshrun/cli/*.py module, so these import jax-using code only in their run functions, after
#   `setup_devices`/`start_command`; meshrun/runtime/devices.py and distributed.py, which set the
#   devices up, import jax inside the functions that run afterwards; `import meshrun` defers its
#   mesh/sharding helpers (meshrun/__init__.py).
# - optional dependencies, imported where used: matplotlib (`meshrun schedule --plot`), tensorboardX,
#   wandb and mlflow (train.loggers, meshrun/train/loggers.py).
# Check: `python -c "import sys, meshrun.cli.main as m; m.build_parser(); print('jax' in sys.modules)"`
# prints False (tests/test_imports.py).
COMMAND_MODULES = (
    "meshrun.cli.mesh",
    "meshrun.cli.schedule",
    "meshrun.cli.plan",
    "meshrun.cli.train",
    "meshrun.cli.prepare_data",
    "meshrun.cli.explain",
    "meshrun.cli.profile",
    "meshrun.cli.checkpoints",
    "meshrun.cli.supervise",
    "meshrun.cli.hf",
    "meshrun.cli.plot",
    "meshrun.cli.config",
)
DEBUG_FLAG, DEBUG_ENV = "--debug", "MESHRUN_DEBUG"
DESCRIPTION = """Train transformers in JAX with data x pipeline x tensor x expert x context parallelism,
plan layouts for a cluster, and check them against the compiled step. Every failure is one line and an
exit status (2 bad input, 3 training, 4 I/O, 5 checkpoint, 6 distributed, 1 internal)."""
EPILOG = """start here:
  meshrun train configs/tiny_cpu.yaml train.run_dir=runs/tiny   # 8 simulated CPU devices
  meshrun COMMAND --help                                         # a command's flags and examples
  meshrun config                                                 # every config key
documentation: README.md and docs/ in the checkout"""
# Each command's description and examples for `meshrun COMMAND --help` (a command that sets its own
# description in its module keeps it).
COMMAND_HELP = {
    "mesh": (
        "Build a device mesh from mesh.* degrees and print which device holds which coordinate, its host "
        "and rack, and the groups of each axis; a tensor group across hosts is an error.",
        "meshrun mesh --devices 8 --hosts 2 mesh.pipe=2 mesh.data=2 mesh.tensor=2\n"
        "  meshrun mesh --devices 8 mesh.tensor=2 --json",
    ),
    "schedule": (
        "Print a pipeline schedule as a text chart (what each stage runs at each tick) with its bubble "
        "fraction; --json for the table, --png for a Gantt chart.",
        "meshrun schedule --pipe 4 --microbatches 8 --schedule 1f1b\n"
        "  meshrun schedule --pipe 4 --microbatches 8 --schedule interleaved --virtual 2",
    ),
    "plan": (
        "Rank every valid layout (TP/PP/DP/EP/CP, ZeRO, remat, microbatches) of a model on a cluster by "
        "predicted step time and memory per device, or cost one layout with --evaluate. No jax needed.",
        "meshrun plan --model gpt3-175b --cluster a100-80g:128x8 --top 3\n"
        "  meshrun plan --model configs/models/llama-7b.yaml --cluster h100-80g:1x8 --evaluate tensor=8,pipe=1",
    ),
    "train": (
        "Train a model from a YAML config plus section.key=value overrides. A rerun into the same "
        "train.run_dir resumes from its newest intact checkpoint. The last stdout line is one JSON object.",
        "meshrun train configs/tiny_cpu.yaml train.run_dir=runs/tiny\n"
        "  meshrun train configs/tiny_cpu.yaml mesh.pipe=1 mesh.data=4 train.zero=3 train.run_dir=runs/zero3",
    ),
    "prepare-data": (
        "Tokenize local text or JSONL files into token shards with a validation split and document "
        "boundaries, for data.kind=prepared. Rerunning it skips finished shards.",
        "meshrun prepare-data --train-bpe 8192 --glob 'corpus/**/*.txt' --out data/corpus\n"
        "  meshrun prepare-data --tokenizer path/to/model --glob 'corpus/**/*.jsonl' --out data/corpus",
    ),
    "explain": (
        "Compile the train step without running it and print the planner's predicted memory and "
        "collectives beside the compiled program's.",
        "meshrun explain configs/tiny_cpu.yaml\n"
        "  meshrun explain configs/llama7b_h100.yaml --cluster h100-80g:1x8 --json",
    ),
    "profile": (
        "Trace a few train steps with jax.profiler and print, per pipeline stage, busy, idle and "
        "collective time and the measured bubble next to the schedule's.",
        "meshrun profile configs/tiny_cpu.yaml --steps 3\n"
        "  meshrun profile configs/tiny_cpu.yaml mesh.data=1 mesh.pipe=4 mesh.tensor=2 pipeline.microbatches=8",
    ),
    "checkpoints": (
        "List a run's checkpoints (step, status, model config); --verify reads every array back and "
        "checks its checksums.",
        "meshrun checkpoints runs/tiny\n  meshrun checkpoints runs/tiny --verify --json",
    ),
    "supervise": (
        "Run a multi-process job through a launcher command and restart it from its newest intact "
        "checkpoint when a rank dies (launch/local.sh and launch/slurm.sbatch use it with MAX_RESTARTS).",
        "meshrun supervise --processes 2 --max-restarts 3 --launcher 'launch/local.sh {processes} 4' "
        "configs/tiny_cpu.yaml",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshrun", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        DEBUG_FLAG, action="store_true", help=f"print tracebacks (also {DEBUG_ENV}=1); may follow the subcommand"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    for name, (description, examples) in COMMAND_HELP.items():
        p = sub.choices[name]
        if p.description is None:
            p.description, p.epilog = textwrap.fill(description, 100), f"examples:\n  {examples}"
            p.formatter_class = argparse.RawDescriptionHelpFormatter
    return parser


def debug_enabled(argv_flag: bool = False) -> bool:
    return argv_flag or os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def report(command: str, exc: BaseException, debug: bool) -> int:
    """One line on stderr for `exc` (the traceback above it when `debug`); returns the exit status."""
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    if isinstance(exc, MeshrunError):
        line, code = str(exc), exc.exit_code
    elif isinstance(exc, KeyboardInterrupt):
        line, code = "interrupted", EXIT_INTERRUPTED
    elif "RESOURCE_EXHAUSTED" in str(exc):  # XLA: out of device memory (compile or run)
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
        line = (
            f"out of device memory ({first[:200]}); try model.remat=full, a higher train.zero, more "
            "pipeline.microbatches or a smaller train.global_batch (`meshrun plan`/`explain` estimate memory)"
        )
        code = EXIT_TRAINING
    elif isinstance(exc, OSError):  # a file we read or write: permissions, disk full, vanished
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        line, code = f"I/O error{where}: {exc.strerror or exc}", EXIT_IO
    else:
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
        hint = "" if debug else f"; rerun with {DEBUG_FLAG} for the traceback"
        line, code = f"internal error: {type(exc).__name__}: {first[:300]}{hint} (please report it)", EXIT_INTERNAL
    print(f"meshrun {command}: error: {line}", file=sys.stderr, flush=True)
    return code


def _distributed_started() -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and jax.distributed.is_initialized()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    flag = DEBUG_FLAG in argv  # a global flag, accepted after the subcommand too
    argv = [a for a in argv if a != DEBUG_FLAG]
    debug = debug_enabled(flag)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    # `section.key=value` overrides may come after flags (argparse stops filling positionals there)
    if rest and hasattr(args, "overrides") and all("=" in r and not r.startswith("-") for r in rest):
        args.overrides = [*args.overrides, *rest]
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.debug = debug
    saved_env = os.environ.get(DEBUG_ENV)
    if flag:
        os.environ[DEBUG_ENV] = "1"  # library code reads it too (e.g. which warnings to keep quiet)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `meshrun ... --json | head`: the reader left; end quietly (Python's recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - the CLI's one place that reports failures
        code = report(args.command, e, debug)
        if isinstance(e, DistributedError) and _distributed_started():
            sys.stdout.flush()
            os._exit(code)  # skip jax's exit-time shutdown barrier: it would wait for the dead peer
        return code
    finally:
        if flag and saved_env is None:
            os.environ.pop(DEBUG_ENV, None)
        elif flag:
            os.environ[DEBUG_ENV] = saved_env


if __name__ == "__main__":
    sys.exit(main())
