"""Straggler detection across the processes of a job, from host-side step times.

Each process times, per step, its own work before the step call (data, host code: `host_s`) and
its wait inside the step (`wait_s`, until the step's results are back). In a synchronous job the
others wait for the slowest one in the step's collectives, so a straggler shows as host time the
others do not have. Every log_every steps (at least MIN_WINDOW steps apart) the processes gather
the median host and wait times of the steps since the last check; a process whose host time
exceeds the median of the others' by more than `threshold` x the median step time is named.
A device that is slow (not its host) is not seen here: the steps of all processes end together.
"""

from __future__ import annotations

import socket
import statistics

import jax
import numpy as np
from jax.experimental import multihost_utils

from meshrun.runtime.processes import warn

MIN_WINDOW = 5  # steps per check at least: one slow step is not a straggler
_HOST_BYTES = 64


def _gather(x: np.ndarray) -> np.ndarray:
    """x from every process, stacked on a new first axis (process order)."""
    return np.asarray(multihost_utils.process_allgather(x))


def _hostnames() -> list[str]:
    name = socket.gethostname().encode()[:_HOST_BYTES].ljust(_HOST_BYTES, b"\0")
    rows = _gather(np.frombuffer(name, np.uint8))
    return [bytes(r.astype(np.uint8)).rstrip(b"\0").decode(errors="replace") for r in rows]


def find_straggler(host_s: np.ndarray, wait_s: np.ndarray, threshold: float) -> tuple[int, float] | None:
    """(process, seconds per step more than the others) for the process whose median host time
    exceeds the median of the others' by more than threshold x the median step time; else None."""
    step_s = float(np.median(host_s + wait_s))
    worst = int(np.argmax(host_s))
    others = np.delete(host_s, worst)
    excess = float(host_s[worst] - np.median(others))
    return (worst, excess) if excess > threshold * step_s and excess > 0 else None


class Stragglers:
    """`add(host_s, wait_s)` after each step; `check(step)` on every process at the same steps."""

    def __init__(self, threshold: float, log_every: int):
        self.threshold, self.log_every = threshold, log_every
        self.active = threshold > 0 and jax.process_count() > 1
        self.host_s: list[float] = []
        self.wait_s: list[float] = []
        self.first = 0  # first step of the current window
        self.hosts: list[str] | None = None

    def add(self, step: int, host_s: float, wait_s: float) -> None:
        if self.active:
            self.first = self.first or step
            self.host_s.append(host_s)
            self.wait_s.append(wait_s)

    def due(self, step: int) -> bool:
        return self.active and step % self.log_every == 0 and len(self.host_s) >= MIN_WINDOW

    def check(self, step: int) -> dict:
        """Gather this window's medians (a collective: all processes call it at the same step); the
        metrics fields naming the straggler ({} when there is none), with a warning."""
        mine = np.array([statistics.median(self.host_s), statistics.median(self.wait_s)], np.float64)
        first, self.host_s, self.wait_s, self.first = self.first, [], [], 0
        if self.hosts is None:
            self.hosts = _hostnames()
        table = _gather(mine)
        found = find_straggler(table[:, 0], table[:, 1], self.threshold)
        if found is None:
            return {}
        p, excess = found
        step_s = float(np.median(table.sum(axis=1)))
        warn(f"straggler: process {p} (host {self.hosts[p]}) spends {excess:.3f} s per step more than the "
             f"others before each step (median of steps {first}-{step}, step {step_s:.3f} s; the others "
             f"wait for it; train.straggler_threshold={self.threshold})")  # fmt: skip
        return {"straggler_process": p, "straggler_host": self.hosts[p], "straggler_excess_s": excess}
