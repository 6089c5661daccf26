"""What the processes of a job share: process 0's lines on stderr, agreement on an outcome, the run-dir
lock, and telling a lost peer from any other error.

One process: every function here is the single-process answer (no collective is run)."""

from __future__ import annotations

import sys

import jax
import numpy as np
from jax.experimental import multihost_utils

from meshrun.errors import ConfigError
from meshrun.runtime.runlock import RunLock, note_takeover


def warn(msg: str) -> None:
    """`meshrun: warning: msg` on stderr, from process 0."""
    if jax.process_index() == 0:
        print(f"meshrun: warning: {msg}", file=sys.stderr, flush=True)


def say(msg: str, quiet: bool = False) -> None:
    """An informational line on stderr from process 0 (start-up block, lifecycle); none with --quiet."""
    if not quiet and jax.process_index() == 0:
        print(msg, file=sys.stderr, flush=True)


def agree(ok: bool) -> bool:
    """True when every process says ok (one process: `ok`)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.asarray(multihost_utils.process_allgather(np.array([ok], np.int32))).all())


def take_lock(run_dir: str) -> RunLock | None:
    """Process 0 locks the run dir (the other processes share it); all processes learn the outcome."""
    lock, err = None, None
    if jax.process_index() == 0:
        try:
            lock = RunLock(run_dir).acquire()
        except ConfigError as e:
            err = e
    if not agree(err is None):
        if err is not None:
            raise err
        raise ConfigError("train.run_dir", run_dir, "see process 0's message", "process 0 could not lock it")
    if lock is not None:
        note_takeover(lock)
    return lock


# What a collective or the coordination service says when another process of the job is gone.
PEER_GONE = ("Gloo", "NCCL", "Connection reset", "Connection closed", "Socket closed", "heartbeat",
             "coordination service", "UNAVAILABLE", "DEADLINE_EXCEEDED")  # fmt: skip


def lost_peer(e: BaseException) -> str | None:
    """A one-line description when `e` (raised in a multi-process job) says another process is gone:
    a collective failed (gloo: 'Connection reset by peer') or the coordination service lost a task.
    None otherwise (single process, or any other error)."""
    if isinstance(e, (ConfigError, KeyboardInterrupt)):
        return None
    if not jax.distributed.is_initialized() or jax.process_count() == 1:
        return None
    text = str(e)
    if not any(k in text for k in PEER_GONE):
        return None
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)
    return (
        f"process {jax.process_index()} of {jax.process_count()}: lost contact with another process "
        f"({type(e).__name__}: {first[:200]}); it probably died: see the launcher's report and that process's log"
    )
