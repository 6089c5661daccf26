"""8 simulated CPU devices, set before jax is imported anywhere in the test session."""

import os
import re

_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
# Backend optimisation level 0: XLA:CPU compiles 3-5x faster (tests compile far more than they run);
# parity tests compare layouts compiled under the same flags.
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
