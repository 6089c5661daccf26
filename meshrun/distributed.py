"""jax.distributed start-up (single process when nothing is configured)."""

from __future__ import annotations


def initialize() -> None:
    """Single-process default; multi-process settings are read by the multi-host launcher."""
    return None
