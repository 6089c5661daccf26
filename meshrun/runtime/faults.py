"""Fault-injection hooks for tests and drills, set through the environment (off when unset):

- `MESHRUN_FAULT_STALL=P:N:T`: process P blocks for T seconds at the start of step N, holding the
  Python interpreter lock (as a rank wedged in native code: its own watchdog thread cannot run,
  jax's heartbeat threads go on). Only in the job's first attempt (`MESHRUN_ATTEMPT` unset or 1).
- `MESHRUN_FAULT_SLOW=P:T`: process P sleeps T seconds before every step (a host-side straggler).
- `MESHRUN_FAULT_SLOW_COMPILE=P:T`: process P sleeps T seconds before compiling the step.
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass

from meshrun.errors import ConfigError

ENV_STALL = "MESHRUN_FAULT_STALL"
ENV_SLOW = "MESHRUN_FAULT_SLOW"
ENV_SLOW_COMPILE = "MESHRUN_FAULT_SLOW_COMPILE"


def _fields(name: str, n: int) -> list[float] | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    form = "P:N:T (process, step, seconds)" if n == 3 else "P:T (process, seconds)"
    try:
        out = [float(x) for x in raw.split(":")]
    except ValueError:
        out = []
    if len(out) != n or any(x < 0 for x in out):
        raise ConfigError(name, raw, f"use {form} with numbers >= 0, or unset it", "not a fault hook setting")
    return out


@dataclass(frozen=True)
class Faults:
    """The hooks that apply to this process (read once, at the start of a run)."""

    stall_step: int | None = None
    stall_s: float = 0.0
    slow_s: float = 0.0
    slow_compile_s: float = 0.0

    @classmethod
    def from_env(cls, process: int) -> Faults:
        stall, slow, slow_compile = _fields(ENV_STALL, 3), _fields(ENV_SLOW, 2), _fields(ENV_SLOW_COMPILE, 2)
        first_attempt = os.environ.get("MESHRUN_ATTEMPT", "1") == "1"
        mine = lambda f: f is not None and int(f[0]) == process  # noqa: E731
        return cls(
            stall_step=int(stall[1]) if mine(stall) and first_attempt else None,
            stall_s=stall[2] if mine(stall) else 0.0,
            slow_s=slow[1] if mine(slow) else 0.0,
            slow_compile_s=slow_compile[1] if mine(slow_compile) else 0.0,
        )

    def before_step(self, step: int) -> None:
        """`step` is 1-based."""
        if self.slow_s:
            time.sleep(self.slow_s)
        if self.stall_step == step:
            # one libc sleep through PyDLL: the interpreter lock stays held for the whole call
            ctypes.PyDLL(None).sleep(ctypes.c_uint(int(round(self.stall_s))))

    def before_compile(self) -> None:
        if self.slow_compile_s:
            time.sleep(self.slow_compile_s)
