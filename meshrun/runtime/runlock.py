"""One run per run dir: `RUN_DIR/.meshrun.lock`, held for the whole run and removed at exit.

The lock is an flock(2) on the file, so the kernel drops it when the holder dies (SIGKILL, OOM, a
node reboot): a lock file left by a dead run is simply taken over. The file records the holder
(`pid host start-time`) for the message a second run prints. Where the filesystem has no flock
(ENOLCK, EOPNOTSUPP), the recorded pid decides: alive on this host, or on another host -> busy;
dead on this host -> taken over.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import sys
import time
from pathlib import Path

from meshrun.errors import ConfigError, DataError

LOCK_NAME = ".meshrun.lock"
RECORD_WAIT_S = 2.0  # how long a refused run waits for the new holder's record (written just after its flock)


def _holder(path: Path) -> tuple[int | None, str, str]:
    """(pid, host, text) recorded in a lock file; pid None when unreadable."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None, "", ""
    parts = text.split()
    pid = int(parts[0]) if parts and parts[0].isdigit() else None
    return pid, parts[1] if len(parts) > 1 else "", text


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunLock:
    """`acquire()` or ConfigError(train.run_dir) naming the run that holds it; `release()` at exit."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None
        self.took_over: str | None = None  # the stale holder's record, when one was taken over

    def _busy(self, pid, host, text) -> ConfigError:
        who = f"pid {pid} on {host}" if pid is not None else (text or "another process")
        return ConfigError(
            "train.run_dir",
            str(self.run_dir),
            f"wait for that run to finish, stop it, or use another train.run_dir (if it is gone, delete {self.path})",
            f"another meshrun run is using it ({who})",
        )

    def _recorded_holder(self) -> tuple[int | None, str, str]:
        """The holder's record. A run that has just taken the flock writes it a moment later (the
        file is empty in between): wait for it, bounded, so the message names the pid."""
        deadline = time.monotonic() + RECORD_WAIT_S
        while True:
            pid, host, text = _holder(self.path)
            if pid is not None or time.monotonic() >= deadline:
                return pid, host, text
            time.sleep(0.02)

    def acquire(self) -> RunLock:
        """Take the lock (ConfigError naming the run that holds it), keep a stale holder's record in
        `took_over`, and record this process in the file."""
        me = f"{os.getpid()} {socket.gethostname()} {time.strftime('%Y-%m-%dT%H:%M:%S')}\n"
        fd = self._open_locked()
        pid, _, text = _holder(self.path)
        if text and pid != os.getpid():
            self.took_over = text
        self._record(fd, me)
        self._fd = fd
        return self

    def _open_locked(self) -> int:
        """The lock file open with its flock held (`_flock`), opened again where the holder's release
        removed it meanwhile."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            self._flock(fd)
            try:  # the file may have been removed (and recreated) by the holder's release meanwhile
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)

    def _flock(self, fd: int) -> None:
        """flock `fd` without waiting, or close it and raise `_busy` naming the holder. Where the file
        system has no flock, the recorded pid decides (the module doc)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self._busy(*self._recorded_holder()) from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                os.close(fd)
                raise
            pid, host, text = _holder(self.path)  # no flock here: the recorded pid decides
            if pid is not None and pid != os.getpid() and (host != socket.gethostname() or _pid_alive(pid)):
                os.close(fd)
                raise self._busy(pid, host, text) from None

    def _record(self, fd: int, me: str) -> None:
        """This process's record `me` as the locked file's whole text, on disk; on a full disk the lock
        is released (no empty or half-written lock file is left behind) and a DataError raised."""
        try:
            os.ftruncate(fd, 0)
            if os.pwrite(fd, me.encode(), 0) != len(me.encode()):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            os.fsync(fd)
        except OSError as e:
            self._fd = fd
            self.release()
            raise DataError(
                f"cannot write the run lock {self.path} ({e.strerror or e}); free space on that file system "
                "or use another train.run_dir"
            ) from None

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink()  # while still holding it: a waiting opener re-checks the inode
        except OSError:
            pass
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def note_takeover(lock: RunLock) -> None:
    if lock.took_over:
        print(
            f"meshrun: note: took over the lock of a run that is gone ({lock.took_over}) in {lock.run_dir}",
            file=sys.stderr,
        )
