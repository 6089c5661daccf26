"""Simulated CPU devices: must be set up before jax is imported."""

from __future__ import annotations

import os
import re
import sys


def simulate_cpu_devices(n: int, fast_compile: bool = True) -> None:
    """Ask XLA:CPU for `n` devices (no effect on GPUs). Call before `import jax`."""
    if "jax" in sys.modules:
        import jax

        have = len(jax.devices("cpu"))
        if have < n:
            raise RuntimeError(f"jax was imported with {have} CPU devices; set up {n} before importing jax")
        return
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    if fast_compile and "xla_backend_optimization_level" not in flags:
        # Simulated devices check layouts, not speed: XLA:CPU compiles 3-5x faster at level 0.
        flags += " --xla_backend_optimization_level=0"
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def cpu_devices(n: int) -> list:
    """The first `n` simulated CPU devices."""
    import jax

    devs = jax.devices("cpu")
    if len(devs) < n:
        raise RuntimeError(f"{n} CPU devices requested, jax has {len(devs)}")
    return devs[:n]
