"""The checkpoint saves of one run (`Saves`): started by the loop's save hooks, reported once on disk."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from meshrun.checkpoint.local import LocalTier
from meshrun.checkpoint.state import Checkpointer
from meshrun.runtime.processes import say


class Saves:
    """Checkpoint saves of one run: starts them (async where configured) and reports each one once it
    is on disk: `saved checkpoint N (size, seconds) in PATH` (process 0)."""

    def __init__(self, ckpt: Checkpointer, quiet: bool = False, tier: LocalTier | None = None):
        self.ckpt, self.quiet, self.tier = ckpt, quiet, tier
        self._pending: list[tuple[int, float]] = []  # (step, start time) of saves not reported yet
        self._local_said: int | None = None
        self._saved: int | None = None  # the newest persistent step this run saved

    def save_local(self, step: int, model_state: Any) -> None:
        """This process's shards to the local tier (the write goes on in the background; a streamed
        tier's state is written from its file before this returns)."""
        self.report()
        self.tier.save(step, model_state)

    def save(self, step: int, model_state: Any, force: bool) -> None:
        self.report()  # orbax finishes the previous async save before it starts this one
        t0 = time.perf_counter()
        if self.ckpt.save(step, model_state, force=force):
            self._pending.append((step, t0))
            self._saved = step

    def report(self) -> None:
        done = [(s, t0) for s, t0 in self._pending if (Path(self.ckpt.directory) / str(s)).is_dir()]
        for s, t0 in done:
            self._pending.remove((s, t0))
            path = Path(self.ckpt.directory) / str(s)
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            took = time.perf_counter() - t0
            say(f"saved checkpoint {s} ({size / 2**20:.1f} MiB, {took:.1f} s) in {path}", self.quiet)
        last = self.tier.last if self.tier is not None else None
        if last is not None and last[0] != self._local_said:
            self._local_said = last[0]
            say(f"saved local checkpoint {last[0]} ({last[1] / 2**20:.1f} MiB on process 0, {last[2]:.2f} s) "
                f"in {self.tier.directory / str(last[0])}", self.quiet)  # fmt: skip

    def finish(self) -> None:
        """Wait for the last async saves and report them. Then the local steps up to the last
        persistent one are deleted (a RAM disk keeps nothing a restart could prefer)."""
        self.ckpt.wait()
        if self.tier is not None:
            self.tier.wait_quietly()
            if self._saved is not None:
                self.tier.drop(lambda s: s > self._saved)
        self.report()
