"""What every config section shares: the size bounds and the two checks that name a field."""

from __future__ import annotations

from meshrun.errors import ConfigError

# Upper bounds of sizes and counts (ConfigError past them): far above any real run, low enough that
# int32 indexing and per-element Python work stay bounded.
MAX_DIM = 2**24  # one dimension: vocab, d_model, d_ff, sequence length, batch rows, ...
MAX_DEVICES = 2**17  # a mesh degree, hosts, racks
MAX_MICROBATCHES = 2**16
MAX_STEPS = 2**40
MAX_SIMULATED_DEVICES = 1024  # --devices on CPU: XLA sets up ~250 simulated devices a second


def check_device_count(flag: str, n: int | None) -> None:
    """`--devices N` (None: not given): 1..MAX_SIMULATED_DEVICES, else a ConfigError (0 is not 'unset')."""
    if n is not None and not 1 <= n <= MAX_SIMULATED_DEVICES:
        raise ConfigError(
            flag, n, f"use 1..{MAX_SIMULATED_DEVICES} simulated devices (or leave it out)", "out of range"
        )


def _bounded(name: str, value: int, lo: int, hi: int) -> None:
    """ConfigError unless lo <= value <= hi: the upper bounds keep every command's work bounded (a size
    past them would overflow an int32 index or take hours before failing)."""
    if not lo <= value <= hi:
        raise ConfigError(name, value, f"use a whole number in [{lo}, {hi}]", "out of range")


def _choice(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(name, value, f"use one of {list(allowed)}")


bounded, choice = _bounded, _choice  # for the families' config classes
