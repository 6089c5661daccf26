"""Step watchdog: a process whose step makes no progress in time dumps its thread stacks and exits
EXIT_HANG, so that the launcher ends the job and `meshrun supervise` restarts it from its newest
checkpoint, instead of the job hanging forever (a rank stuck alive in a collective still sends
jax's coordination heartbeats).

The loop names each phase as it enters it (`compile`, `step`, `eval`, `save`, ...). A phase that
may compile or write a checkpoint gets `compile_allowance` seconds on top of the step timeout.
The step timeout is `train.step_timeout` seconds, or (0, auto) max(AUTO_FLOOR_S, AUTO_MULTIPLE x the
median of the recent step times). On a hang: one line on stderr naming the step and the phase,
RUN_DIR/logs/hang-<process>.txt (a JSON record, then every thread's stack from faulthandler), and
os._exit(EXIT_HANG): the main thread is stuck and cannot unwind.
"""

from __future__ import annotations

import collections
import faulthandler
import json
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

from meshrun.errors import EXIT_HANG

AUTO_FLOOR_S = 600.0  # never less: NCCL's own default collective timeout is 10 minutes
AUTO_MULTIPLE = 10.0  # x the median step time of the last MEDIAN_OF steps
MEDIAN_OF = 50
SLOW_PHASES = frozenset({"compile", "first step", "eval", "save", "restore"})  # + compile_allowance


class Watchdog:
    """`phase(name, step)` on entering each phase, `step_done(step, seconds)` after each step;
    `close()` at the end. timeout_s < 0: off (a no-op object)."""

    def __init__(self, run_dir: str, *, timeout_s: float, compile_allowance_s: float, process: int = 0,
                 processes: int = 1, known: dict | None = None, poll_s: float = 0.5):  # fmt: skip
        self.run_dir, self.timeout_s, self.allowance_s = Path(run_dir), timeout_s, compile_allowance_s
        self.process, self.processes, self.known = process, processes, dict(known or {})
        self._times: collections.deque = collections.deque(maxlen=MEDIAN_OF)
        self._phase, self._step, self._since = "start-up", 0, time.monotonic()
        self.last_done = 0
        self._stop = threading.Event()
        self._thread = None
        if timeout_s >= 0:
            self._thread = threading.Thread(target=self._watch, args=(poll_s,), name="meshrun-watchdog", daemon=True)
            self._thread.start()

    def phase(self, name: str, step: int) -> None:
        """Entering phase `name` of 1-based `step`: the clock starts again."""
        self._phase, self._step, self._since = name, step, time.monotonic()

    def step_done(self, step: int, seconds: float) -> None:
        self._times.append(seconds)
        self.last_done = step
        self._since = time.monotonic()

    def limit(self, phase: str | None = None) -> float:
        """Seconds the current (or the named) phase may take."""
        base = self.timeout_s
        if base == 0:
            median = statistics.median(self._times) if self._times else 0.0
            base = max(AUTO_FLOOR_S, AUTO_MULTIPLE * median)
        return base + (self.allowance_s if (phase or self._phase) in SLOW_PHASES else 0.0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _watch(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            phase, step, since = self._phase, self._step, self._since
            waited, limit = time.monotonic() - since, self.limit(phase)
            if waited > limit and not self._stop.is_set():
                self._fire(phase, step, waited, limit)

    def record(self, phase: str, step: int, waited: float, limit: float) -> dict:
        """What the watchdog knows about the hang (the hang file's first line)."""
        return {"event": "hang", "process": self.process, "processes": self.processes,
                "host": socket.gethostname(), "pid": os.getpid(), "step": step, "phase": phase,
                "last_completed_step": self.last_done, "waited_s": round(waited, 1), "timeout_s": round(limit, 1),
                "time": time.time(), **self.known}  # fmt: skip

    def _fire(self, phase: str, step: int, waited: float, limit: float) -> None:
        path = self.run_dir / "logs" / f"hang-{self.process}.txt"
        where = f"; thread stacks in {path}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                f.write(json.dumps(self.record(phase, step, waited, limit)) + "\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError as e:  # the line below still goes out, and the exit code
            where = f"; could not write {path} ({e.strerror or e})"
        print(f"meshrun: watchdog: process {self.process} of {self.processes}: step {step} made no progress "
              f"for {waited:.0f} s in phase '{phase}' (last completed step {self.last_done}, timeout "
              f"{limit:.0f} s){where}; exiting with {EXIT_HANG}", file=sys.stderr, flush=True)  # fmt: skip
        sys.stdout.flush()
        os._exit(EXIT_HANG)
