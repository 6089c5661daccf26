"""`meshrun supervise`: restart a failed multi-process job from its newest intact checkpoint.

docs/faults.md ("Restarting failed jobs") describes its use. One attempt is one run of the launcher command
(`{processes}` replaced by the current process count) followed by CONFIG and the overrides; the
launcher ends the whole job when one rank fails and the supervisor starts it again, up to
`--max-restarts` times, naming on stderr the rank that died and the step the job resumes from.
Restarted: a rank killed by a signal, NaN/Inf loss (3), I/O (4), a lost peer (6), a hang that a step
watchdog ended (7), an internal error (1).
Not restarted: 0, 2, 5, the launcher's wall-clock limit (124), an interrupt (130), a SIGTERM/SIGINT
to the supervisor (passed on to the job). `--elastic`: an attempt that failed before a new row in
metrics.jsonl is followed by one on one process fewer (`mesh.data` shrinks in proportion).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from meshrun.checkpoint.store import newest_complete, newest_local
from meshrun.errors import EXIT_CHECKPOINT, EXIT_CONFIG, EXIT_HANG, EXIT_INTERRUPTED, EXIT_TRAINING

NO_RESTART = {0: "done", EXIT_CONFIG: "bad input", EXIT_CHECKPOINT: "no intact checkpoint",
              124: "wall-clock limit", EXIT_INTERRUPTED: "interrupted"}  # fmt: skip
# How the launchers report the rank that failed first (local.sh, hosts.sh, srun).
_RANK_LINES = (
    re.compile(r"\brank (\d+) \(pid \d+\) failed with (.+?);"),
    re.compile(r"\bhost (\d+) \(\S+\) failed with (status \d+)"),
    re.compile(r"srun: error: \S+: tasks? (\d+)[\d,-]*: (.+)$"),
)


def _log(msg: str) -> None:
    print(f"meshrun supervise: {msg}", file=sys.stderr, flush=True)


@dataclass
class Attempt:
    """The outcome of one launch: exit status, the launcher's 'rank i failed with X', progress made."""

    status: int
    rank: int | None = None
    why: str = ""
    progressed: bool = False

    def describe(self) -> str:
        if self.rank is not None:
            verb = "failed" if self.why.startswith("status") or "exit code" in self.why else "died"
            why = _status_text(EXIT_HANG) if self.why == f"status {EXIT_HANG}" else self.why
            return f"rank {self.rank} {verb} ({why})"
        return f"the job failed with {_status_text(self.status)}"


def _status_text(status: int) -> str:
    if status == EXIT_HANG:
        return f"status {EXIT_HANG}: its step watchdog saw a hang"
    if status < 0 or status > 128:  # Popen: -SIG; a shell: 128 + SIG
        num = -status if status < 0 else status - 128
        try:
            return f"signal {signal.Signals(num).name.removeprefix('SIG')}"
        except ValueError:
            return f"status {status}"
    return f"status {status}"


def _exit_status(status: int) -> int:
    return 128 - status if status < 0 else status  # killed by signal N -> 128 + N, as a shell reports it


def metrics_rows(run_dir: Path) -> int:
    try:
        with open(run_dir / "metrics.jsonl", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def newest_intact(run_dir: Path) -> int | None:
    newest = newest_complete(run_dir)
    return newest.step if newest else None


def shrink(cfg, processes: int, to: int) -> list[str] | None:
    """Overrides for `to` < `processes` processes: `mesh.data` scaled by to/processes (None when it is
    not a whole number or the global batch no longer divides); [] when an axis is -1 (it fills)."""
    m = cfg.mesh
    if -1 in (m.data, m.pipe, m.tensor, m.expert):
        return []
    data, rem = divmod(m.data * to, processes)
    if rem or data < 1 or cfg.train.global_batch % (data * m.expert * cfg.pipeline.microbatches):
        return None
    return [f"mesh.data={data}"]


class Supervisor:
    """Runs attempts until one succeeds, a failure is not worth restarting, or K restarts are used."""

    def __init__(self, launcher: str, train_args: list[str], run_dir: Path, *, processes: int,
                 max_restarts: int, elastic: bool = False, min_processes: int = 1, cfg=None):  # fmt: skip
        self.launcher, self.train_args, self.run_dir = launcher, train_args, run_dir
        self.processes, self.max_restarts = processes, max_restarts
        self.elastic, self.min_processes, self.cfg = elastic, min_processes, cfg
        self.extra: list[str] = []  # overrides of an elastic restart
        self._child: subprocess.Popen | None = None
        self._stopping = False
        self.attempts = 0

    def command(self) -> list[str]:
        words = [w.replace("{processes}", str(self.processes)) for w in shlex.split(self.launcher)]
        return [*words, *self.train_args, *self.extra]

    def _forward(self, signum, frame) -> None:
        """SIGTERM/SIGINT/SIGHUP: pass on to the job (it saves and exits), then stop; no restart."""
        self._stopping = True
        if self._child is not None and self._child.poll() is None:
            self._child.send_signal(signum)

    def attempt(self) -> Attempt:
        self.attempts += 1
        rows = metrics_rows(self.run_dir)
        found: list[tuple[int, str]] = []
        env = {**os.environ, "MESHRUN_ATTEMPT": str(self.attempts)}  # launchers keep each attempt's logs apart
        self._child = subprocess.Popen(self.command(), stderr=subprocess.PIPE, text=True, errors="replace", env=env)

        def pump():  # pass the launcher's stderr through; keep the first "rank i failed" report
            for line in self._child.stderr:
                sys.stderr.write(line)
                sys.stderr.flush()
                for rx in _RANK_LINES:
                    hit = rx.search(line)
                    if hit and not found:
                        found.append((int(hit.group(1)), hit.group(2).strip()))

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        status = self._child.wait()
        reader.join(timeout=5)
        rank, why = found[0] if found else (None, "")
        return Attempt(status, rank, why, progressed=metrics_rows(self.run_dir) > rows)

    def run(self) -> int:
        previous = {s: signal.signal(s, self._forward) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            return self._loop()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def _loop(self) -> int:
        restarts = 0
        while True:
            a = self.attempt()
            if a.status == 0 or self._stopping:
                return _exit_status(a.status)
            if a.status in NO_RESTART:
                _log(f"{a.describe()}: {NO_RESTART[a.status]}, not restarting (see the line above)")
                return _exit_status(a.status)
            if restarts >= self.max_restarts:
                _log(f"{a.describe()}; no restarts left (MAX_RESTARTS={self.max_restarts}), giving up")
                return _exit_status(a.status)
            restarts += 1
            note = self._maybe_shrink(a)
            where = self._resume_point()
            _log(f"restart {restarts}/{self.max_restarts}: {a.describe()}; resuming from {where} on "
                 f"{self.processes} process(es){note}")  # fmt: skip
            time.sleep(0.5)  # let the kernel release the old job's sockets

    def _resume_point(self) -> str:
        """Where the next attempt resumes: the newest persistent checkpoint, or a newer local step that
        every process's local dir holds (as far as this host can see them; the run checks their bytes)."""
        step = newest_intact(self.run_dir)
        where = f"checkpoint step {step}" if step is not None else "the start (no checkpoint yet)"
        ck = getattr(self.cfg, "checkpoint", None)
        if ck is None or not ck.local_every or self.extra:  # fewer processes: their local steps hold too little
            return where
        local, every = newest_local(ck.local_dir, self.run_dir, self.processes)
        if local is not None and (step is None or local > step):
            return f"local checkpoint step {local}"
        return where if every else f"{where} (or a newer local one, if every host holds it)"

    def _maybe_shrink(self, a: Attempt) -> str:
        """--elastic: a rank death before any training step -> one process fewer (when the layout allows)."""
        if not self.elastic or a.progressed or a.status == EXIT_TRAINING or self.processes <= self.min_processes:
            return ""
        for n in range(self.processes - 1, self.min_processes - 1, -1):
            extra = shrink(self.cfg, self.processes, n) if self.cfg is not None else []
            if extra is not None:
                self.processes, self.extra = n, extra
                return f" (elastic: the failed host did not get going; {' '.join(extra) or 'mesh fills'})"
        return " (elastic: no smaller layout keeps train.global_batch divisible; same size)"
