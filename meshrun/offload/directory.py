"""The offload directory (offload.dir): `take_dir(template, process)` gives a process its
directory, checked to be writable and locked for it (one process per directory), with the data files
a killed run left there removed."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import threading
from pathlib import Path

from meshrun.checkpoint.store import write_error
from meshrun.errors import ConfigError

LOCK_NAME = "meshrun-offload.lock"
DATA_GLOB = "optimizer-state-*.bin"
_LOCKS: dict[str, tuple[int, int]] = {}  # directory -> (lock fd, users in this process)
_LOCKS_GUARD = threading.Lock()


def offload_dir(template: str, process: int) -> Path:
    """offload.dir with "{process}" replaced by the process index."""
    return Path(template.replace("{process}", str(process)))


def take_dir(template: str, process: int) -> Path:
    """The offload directory of process `process` (`offload_dir`), checked (`check_dir`) and taken for
    this process (`lock_dir`): the setup of every tier that keeps files there."""
    path = offload_dir(template, process)
    check_dir(path)
    lock_dir(path)
    return path


def check_dir(path: Path) -> None:
    """The directory exists and this process can create files in it (ConfigError otherwise; the probe
    file of `checkpoint.store.write_error`, which run_dir and checkpoint.local_dir use too)."""
    field = "offload.dir"
    if not path.is_dir():
        raise ConfigError(field, str(path), "create it (a local disk, one directory per process)",
                          "no such directory")  # fmt: skip
    if (why := write_error(path)) is not None:
        raise ConfigError(field, str(path), "use a directory this process can write (a local disk, one per process)",
                          f"not writable: cannot create a file in it ({why})")  # fmt: skip


def lock_dir(path: Path) -> None:
    """Take the directory for this process (shared by the steps this process builds); another process
    holding it -> ConfigError. Released when the process exits."""
    key = os.path.realpath(path)
    with _LOCKS_GUARD:
        if key in _LOCKS:
            fd, n = _LOCKS[key]
            _LOCKS[key] = (fd, n + 1)
            return
        try:
            fd = os.open(os.path.join(key, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError("offload.dir", str(path), "use a directory this process can write",
                              f"cannot create a file in it ({e.strerror})") from None  # fmt: skip
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ConfigError(
                "offload.dir", str(path), 'give each process its own directory (e.g. ".../{process}")',
                "another process of this or another run uses it",
            ) from None  # fmt: skip
        for stale in glob.glob(os.path.join(key, DATA_GLOB)):  # left by a killed run: nobody else holds the lock
            with contextlib.suppress(OSError):
                os.unlink(stale)
        _LOCKS[key] = (fd, 1)
