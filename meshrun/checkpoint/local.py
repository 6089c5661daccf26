"""The local checkpoint tier: every `checkpoint.local_every` steps each process writes the shards it
holds to its own local disk or RAM disk, beside the rarer persistent orbax checkpoints.

Layout: LOCAL/RUN-KEY/STEP/{index.json, shards.bin}, where LOCAL is `checkpoint.local_dir` with
"{process}" replaced by the process index (without it: LOCAL_DIR/process-P) and RUN-KEY names the
run dir (its base name and a hash of its absolute path), so runs sharing a local dir never mix.
`shards.bin` holds the raw bytes of each distinct shard this process addresses; `index.json` says
where each one is, its global index and a CRC-32 of its bytes. A step is written as STEP.tmp-PID and
renamed when complete, and restoring checks every byte it uses against its CRC, so a half-written or
damaged step is never taken for a good one (it is skipped, the next older one or the persistent
tier is used). A step restores only with the process count it was written with, onto a layout whose
shards this process saved (the same mesh, typically); otherwise the persistent tier is used.

The tier itself runs no collective when it saves: the host copy happens in the train loop (the next step may donate the
arrays), the write in a background thread (`checkpoint.async_save`). Which step a run resumes from
is agreed by all processes (`agreed_steps`: an all-gather of each one's complete steps).
Why not orbax's emergency checkpoint manager: see docs/faults.md ("Two checkpoint tiers").
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from meshrun.checkpoint.state import path_key
from meshrun.checkpoint.store import local_root, run_key
from meshrun.config import CheckpointConfig
from meshrun.errors import ConfigError

__all__ = ["LocalTier", "LocalUnusable", "agreed_steps", "check_local_dir", "local_root", "run_key"]

INDEX, DATA = "index.json", "shards.bin"
FORMAT = 1
_MAX_LISTED = 16  # local steps each process reports when they agree (only the newest matter)


class LocalUnusable(Exception):
    """A local step this process cannot restore (missing, damaged, or another layout's shards)."""


def check_local_dir(cfg: CheckpointConfig, process: int) -> None:
    """ConfigError unless this process can write checkpoint.local_dir: it (with "{process}" replaced)
    is a writable directory, or does not exist yet and its parent is one. Creates nothing."""
    if cfg.local_every == 0:
        return
    field, value = "checkpoint.local_dir", cfg.local_dir
    configured = Path(os.path.abspath(cfg.local_dir.replace("{process}", str(process))))
    fix = "give a directory on a local disk or RAM disk whose parent exists and that this process can write"
    probe = configured
    if not configured.exists():
        probe = configured.parent
        if not probe.is_dir():
            raise ConfigError(field, value, fix, f"its parent {probe} does not exist")
    elif not configured.is_dir():
        raise ConfigError(field, value, fix, f"{configured} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(field, value, fix, f"{probe} is not writable")


def agreed_steps(mine: list[int]) -> tuple[list[int], list[list[int]]]:
    """(steps every process holds, oldest first; each process's newest `_MAX_LISTED` steps)."""
    mine = sorted(mine)[-_MAX_LISTED:]
    if jax.process_count() == 1:
        return mine, [mine]
    buf = np.full(_MAX_LISTED, -1, np.int64)
    buf[: len(mine)] = mine
    rows = np.asarray(multihost_utils.process_allgather(buf)).reshape(jax.process_count(), _MAX_LISTED)
    each = [sorted(int(s) for s in row if s >= 0) for row in rows]
    common = set(each[0]).intersection(*map(set, each[1:]))
    return sorted(common), each


def _index_of(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A shard's index (a tuple of slices) as ((start, stop), ...) over the global shape."""
    return tuple((s.start or 0, dim if s.stop is None else s.stop) for s, dim in zip(index, shape, strict=True))


class LocalTier:
    """This process's local checkpoints of one run (see the module docstring)."""

    def __init__(self, cfg: CheckpointConfig, run_dir: str, meta: dict[str, Any], *, process: int | None = None):
        self.cfg = cfg
        self.process = jax.process_index() if process is None else process
        self.directory = local_root(cfg.local_dir, self.process) / run_key(run_dir)
        self.meta = json.loads(json.dumps(meta))  # what a step must agree on (model, optimizer)
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self.last: tuple[int, int, float] | None = None  # (step, bytes, seconds) of the last finished save

    # ------------------------------------------------------------------ steps

    def should_save(self, step: int) -> bool:
        return self.cfg.local_every > 0 and step % self.cfg.local_every == 0

    def steps(self) -> list[int]:
        """Steps that look complete (renamed into place, an index that reads, a data file of the size it
        names) and were written for this model, oldest first. Bytes are checked when restoring."""
        if not self.directory.is_dir():
            return []
        out = []
        for entry in self.directory.iterdir():
            if entry.name.isdigit() and self._looks_complete(entry):
                out.append(int(entry.name))
        return sorted(out)

    def _looks_complete(self, entry: Path) -> bool:
        try:
            index = json.loads((entry / INDEX).read_text())
            return (
                index.get("format") == FORMAT
                and index.get("meta") == self.meta
                and index.get("processes") == jax.process_count()
                and (entry / DATA).stat().st_size == index["bytes"]
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False

    def drop(self, keep: Any) -> None:
        """Delete the steps (and leftover temp directories) for which `keep(step)` is false; a temp
        directory is always deleted (a save this process left half-written)."""
        if not self.directory.is_dir():
            return
        for entry in self.directory.iterdir():
            stale = not entry.name.isdigit() or not keep(int(entry.name))
            if stale and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: Any) -> None:
        """Copy this process's shards of `state` to host memory, then write them (in the background
        when checkpoint.async_save). A failed write is reported by `wait` as a warning line."""
        self.wait_quietly()
        t0 = time.perf_counter()
        leaves, buffers = self._host_copy(state)
        if self.cfg.async_save:
            self._thread = threading.Thread(target=self._write, args=(step, leaves, buffers, t0), daemon=True)
            self._thread.start()
        else:
            self._write(step, leaves, buffers, t0)

    def _host_copy(self, state: Any) -> tuple[list[dict], list[np.ndarray]]:
        """(index entries, host copies): each distinct shard this process addresses, copied (on CPU a
        device buffer may alias host memory that the next step reuses)."""
        leaves, shards = [], []
        for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
            if not isinstance(x, jax.Array):
                raise TypeError(f"local checkpoint: leaf {path_key(path)} is a {type(x).__name__}, not an array")
            seen, entry = set(), {"key": path_key(path), "dtype": str(x.dtype), "shape": list(x.shape), "shards": []}
            for s in x.addressable_shards:
                idx = _index_of(s.index, x.shape)
                if idx not in seen:
                    seen.add(idx)
                    entry["shards"].append({"index": [list(p) for p in idx]})
                    shards.append(s.data)
            leaves.append(entry)
        buffers = [np.array(b, copy=True, order="C") for b in jax.device_get(shards)]
        return leaves, buffers

    def _write(self, step: int, leaves: list[dict], buffers: list[np.ndarray], t0: float) -> None:
        final = self.directory / str(step)
        tmp = self.directory / f"{step}.tmp-{os.getpid()}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            offset, it = 0, iter(buffers)
            with open(tmp / DATA, "wb") as f:
                for leaf in leaves:
                    for shard in leaf["shards"]:
                        raw = memoryview(next(it)).cast("B")
                        f.write(raw)
                        shard.update(offset=offset, nbytes=raw.nbytes, crc32=zlib.crc32(raw))
                        offset += raw.nbytes
            index = {"format": FORMAT, "step": step, "process": self.process, "processes": jax.process_count(),
                     "bytes": offset, "meta": self.meta, "leaves": leaves}  # fmt: skip
            (tmp / INDEX).write_text(json.dumps(index))
            if final.exists():  # a step saved before, by an attempt that did not get past it
                shutil.rmtree(final)
            os.rename(tmp, final)
            newest = sorted(self.steps())[-self.cfg.local_keep :]
            self.drop(lambda s: s in newest)
            self.last = (step, offset, time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - a full RAM disk must not end the run: the persistent tier goes on
            shutil.rmtree(tmp, ignore_errors=True)
            self._error = f"local checkpoint step {step} in {self.directory} not saved ({type(e).__name__}: {e})"

    def wait(self) -> str | None:
        """Block until the background write is done; why it failed, or None."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        err, self._error = self._error, None
        return err

    def wait_quietly(self) -> None:
        err = self.wait()
        if err is not None:
            print(f"meshrun: warning: process {self.process}: {err}; the persistent checkpoints go on",
                  file=sys.stderr, flush=True)  # fmt: skip

    def close(self) -> None:
        self.wait_quietly()

    # ------------------------------------------------------------------ restore

    def restore(self, step: int, target: Any) -> Any:
        """Step `step` in the layout of `target` (ShapeDtypeStructs with shardings): every shard this
        process needs, read from its own files and checked against its CRC. LocalUnusable otherwise."""
        entry = self.directory / str(step)
        try:
            index = json.loads((entry / INDEX).read_text())
            if index.get("meta") != self.meta:
                raise LocalUnusable("written for another model or optimizer")
            saved = {leaf["key"]: leaf for leaf in index["leaves"]}
            flat, treedef = jax.tree_util.tree_flatten_with_path(target)
            with open(entry / DATA, "rb") as f:
                leaves = [self._leaf(f, saved, path_key(p), t) for p, t in flat]
        except LocalUnusable:
            raise
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise LocalUnusable(f"{type(e).__name__}: {str(e)[:200]}") from e
        return jax.tree_util.tree_unflatten(treedef, leaves)

    @staticmethod
    def _leaf(f, saved: dict[str, dict], key: str, target: Any) -> jax.Array:
        leaf = saved.get(key)
        if leaf is None:
            raise LocalUnusable(f"no {key} in it")
        if tuple(leaf["shape"]) != tuple(target.shape) or leaf["dtype"] != str(target.dtype):
            raise LocalUnusable(f"{key} is {leaf['dtype']}{leaf['shape']}, the state needs "
                                f"{target.dtype}{list(target.shape)}")  # fmt: skip
        shards = {tuple(tuple(p) for p in s["index"]): s for s in leaf["shards"]}
        dtype = np.dtype(target.dtype)

        def read(index: tuple) -> np.ndarray:
            idx = _index_of(index, target.shape)
            s = shards.get(idx)
            if s is None:
                raise LocalUnusable(f"{key}: this process did not save the shard {idx} (another layout)")
            f.seek(s["offset"])
            raw = f.read(s["nbytes"])
            if len(raw) != s["nbytes"] or zlib.crc32(raw) != s["crc32"]:
                raise LocalUnusable(f"{key}: shard {idx} does not match its CRC-32")
            return np.frombuffer(raw, dtype).reshape([b - a for a, b in idx])

        return jax.make_array_from_callback(tuple(target.shape), target.sharding, read)
