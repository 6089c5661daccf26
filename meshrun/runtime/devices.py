"""Device set-up before jax is imported: which platform jax will use, simulated CPU devices, XLA flags.

Nothing here imports jax or starts a backend (a GPU backend must not start before jax.distributed).
On the CPU platform `meshrun train` asks XLA:CPU for as many devices as the mesh needs; on GPU/TPU it
leaves XLA_FLAGS alone. XLA's default optimisation level is kept unless `fast_compile` is asked for:
`--xla_backend_optimization_level=0` compiles XLA:CPU programs a few times faster but runs them about
2x slower, which suits checks (tests, CI) and not training.
"""

from __future__ import annotations

import glob
import importlib.util
import math
import os
import re
import sys
from collections.abc import Callable, Mapping, MutableMapping

from meshrun.config import AXES

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"
DEFAULT_DEVICES = 8  # simulated devices for a mesh with a -1 axis

# jaxlib GPU/TPU plugins (jax[cuda12], jax[cuda13], jax[rocm], jax[tpu]) and the device files their
# hardware shows up as. A plugin without its device (e.g. jax[cuda12] on a laptop) falls back to CPU.
# The last field: a variable that hides every device of that kind when set to "" or "-1".
_ACCELERATORS = (
    ("gpu", ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"),
     ("/dev/nvidiactl", "/dev/nvidia[0-9]*"), "CUDA_VISIBLE_DEVICES"),
    ("gpu", ("jax_rocm7_plugin", "jax_rocm60_plugin", "jax_plugins.xla_rocm7", "jax_plugins.xla_rocm60"),
     ("/dev/kfd",), "HIP_VISIBLE_DEVICES"),
    ("tpu", ("libtpu",), ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*"), None),
)  # fmt: skip


def needed_devices(cfg) -> int:
    """Devices the config's mesh needs (`cfg` a RunConfig or MeshConfig); 8 when one axis is -1."""
    mesh = getattr(cfg, "mesh", cfg)
    sizes = [getattr(mesh, a) for a in AXES]
    return DEFAULT_DEVICES if -1 in sizes else math.prod(sizes)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


def _exists(pattern: str) -> bool:
    return bool(glob.glob(pattern))


def default_platform(
    environ: Mapping[str, str] | None = None,
    *,
    installed: Callable[[str], bool] = _installed,
    exists: Callable[[str], bool] = _exists,
) -> str:
    """The platform jax will pick by default ('cpu', 'gpu' or 'tpu'), decided without starting jax.

    JAX_PLATFORMS (its first entry) decides when set; else an installed GPU/TPU plugin whose device is
    present and not hidden (CUDA_VISIBLE_DEVICES="" or "-1"); else 'cpu'."""
    env = os.environ if environ is None else environ
    chosen = (env.get("JAX_PLATFORMS") or env.get("JAX_PLATFORM_NAME") or "").split(",")[0].strip().lower()
    if chosen:
        return {"cuda": "gpu", "rocm": "gpu"}.get(chosen, chosen)
    for platform, plugins, devices, visible in _ACCELERATORS:
        if visible and env.get(visible) in ("", "-1"):
            continue
        if any(installed(m) for m in plugins) and any(exists(d) for d in devices):
            return platform
    return "cpu"


def xla_flags(current: str, *, devices: int | None, fast_compile: bool, cpu: bool) -> str:
    """XLA_FLAGS for a run: `current` plus `devices` simulated CPU devices (replacing a count already
    there; None keeps it) and, with `fast_compile`, backend optimisation level 0 unless a level is set.
    Not on the CPU platform: `current` unchanged (both flags are about XLA:CPU)."""
    if not cpu:
        return current
    flags = current
    if devices:
        flags = re.sub(rf"{DEVICE_COUNT_FLAG}=\d+", "", flags)
    if fast_compile and "xla_backend_optimization_level" not in flags:
        flags += f" {FAST_COMPILE_FLAG}"
    if devices:
        flags += f" {DEVICE_COUNT_FLAG}={devices}"
    return " ".join(flags.split())


def simulate_cpu_devices(n: int, fast_compile: bool = False) -> None:
    """Ask XLA:CPU for `n` devices (no effect on GPUs). Call before `import jax`.
    `fast_compile`: also backend optimisation level 0 (compiles faster, runs ~2x slower)."""
    if "jax" in sys.modules:
        import jax

        have = len(jax.devices("cpu"))
        if have < n:
            raise RuntimeError(f"jax was imported with {have} CPU devices; set up {n} before importing jax")
        return
    os.environ["XLA_FLAGS"] = xla_flags(os.environ.get("XLA_FLAGS", ""), devices=n, fast_compile=fast_compile, cpu=True)


def setup_devices(
    n: int, *, force: bool = False, fast_compile: bool = False, environ: MutableMapping[str, str] | None = None
) -> str:
    """`meshrun train`'s device set-up, before jax is imported; returns the platform.

    On the CPU platform: `n` simulated devices unless XLA_FLAGS already asks for a count (`force`
    replaces it), plus level 0 with `fast_compile`. On any other platform XLA_FLAGS is left alone."""
    env = os.environ if environ is None else environ
    platform = default_platform(env)
    if platform != "cpu":
        return platform
    current = env.get("XLA_FLAGS", "")
    keep = DEVICE_COUNT_FLAG in current and not force
    if "jax" in sys.modules:  # too late to set flags: check that jax has enough devices
        if not keep:
            simulate_cpu_devices(n)
        return platform
    env["XLA_FLAGS"] = xla_flags(current, devices=None if keep else n, fast_compile=fast_compile, cpu=True)
    return platform


def add_fast_compile_flag(parser) -> None:
    """`--fast-compile` for a command that compiles on simulated CPU devices."""
    parser.add_argument(
        "--fast-compile",
        action="store_true",
        help="CPU only: XLA backend optimisation level 0, compiles a few times faster, steps run about 2x "
        "slower (CI-like checks, not training)",
    )


def cpu_devices(n: int) -> list:
    """The first `n` simulated CPU devices."""
    import jax

    devs = jax.devices("cpu")
    if len(devs) < n:
        raise RuntimeError(f"{n} CPU devices requested, jax has {len(devs)}")
    return devs[:n]
