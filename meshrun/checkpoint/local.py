"""The local checkpoint tier: every `checkpoint.local_every` steps each process writes the shards it
holds to its own local disk or RAM disk, beside the rarer persistent orbax checkpoints.

Layout: LOCAL/RUN-KEY/STEP/{index.json, shards.bin}: LOCAL is `checkpoint.local_dir` with "{process}"
replaced by the process index, RUN-KEY names the run dir. `index.json` says where each shard's bytes
are, its global index and a CRC-32. A step is written as STEP.tmp-PID and renamed when complete, and
restoring checks every byte against its CRC, so a damaged step is skipped (the next older one or the
persistent tier is used). A step restores only with the process count and layout it was written with.

Saving runs no collective: the host copy happens in the train loop, the write in a background thread
(`checkpoint.async_save`). Streamed optimizer state (`slices.StreamedArray`) is written box by box.
All processes agree on the step to resume from (`agreed_steps`). docs/faults.md compares this with
orbax's emergency checkpoint manager.
"""

from __future__ import annotations

import json
import math
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

from meshrun.checkpoint import slices
from meshrun.checkpoint.state import path_key
from meshrun.checkpoint.store import local_root, run_key, write_error
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
    if (why := write_error(probe)) is not None:
        raise ConfigError(field, value, fix, f"{probe} is not writable: creating a file in it fails ({why})")


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


class _Job:
    """One step's save: the index entries, the host copies still to write, and the data file being
    written (STEP.tmp-PID, renamed into place once complete)."""

    def __init__(self, step: int, tmp: Path, leaves: list[dict], buffers: list[np.ndarray], t0: float):
        self.step, self.tmp, self.leaves, self.buffers, self.t0 = step, tmp, leaves, buffers, t0
        self.file: Any = None
        self.offset = 0

    def open(self) -> None:
        if self.file is None:
            self.tmp.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp.mkdir()
            self.file = open(self.tmp / DATA, "wb")  # noqa: SIM115 - closed by _write or discard

    def put(self, shard: dict, data: np.ndarray) -> None:
        """`data`'s bytes appended; `shard` (an index entry) says where, and their CRC-32."""
        raw = memoryview(np.ascontiguousarray(data)).cast("B")
        self.file.write(raw)
        shard.update(offset=self.offset, nbytes=raw.nbytes, crc32=zlib.crc32(raw))
        self.offset += raw.nbytes

    def discard(self) -> None:
        if self.file is not None:
            self.file.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


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
        self.host_bytes = 0  # bytes of the last save's host copies (streamed leaves: none)
        self.restored_bytes = 0  # bytes of the last restore's in-memory leaves (streamed ones: none)

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
        when checkpoint.async_save); streamed leaves are written first, chunk by chunk, before this
        returns. A failed write is reported by `wait` as a warning line."""
        self.wait_quietly()
        t0 = time.perf_counter()
        leaves, buffers, streamed = self._host_copy(state)
        job = _Job(step, self.directory / f"{step}.tmp-{os.getpid()}", leaves, buffers, t0)
        if streamed and not self._stream(job, streamed):
            return
        if self.cfg.async_save:
            self._thread = threading.Thread(target=self._write, args=(job,), daemon=True)
            self._thread.start()
        else:
            self._write(job)

    def _host_copy(self, state: Any) -> tuple[list[dict], list[np.ndarray], list[slices.StreamedArray]]:
        """(index entries, host copies, streamed leaves): each distinct shard this process addresses,
        copied (on CPU a device buffer may alias host memory that the next step reuses); a streamed
        leaf's entry is filled by `_stream`. `host_bytes`: the copies' bytes."""
        leaves, shards, streamed = [], [], []
        for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
            entry = {"key": path_key(path), "dtype": str(np.dtype(x.dtype)), "shape": list(x.shape), "shards": []}
            leaves.append(entry)
            if isinstance(x, slices.StreamedArray):
                streamed.append(x)
                continue
            if not isinstance(x, jax.Array):
                raise TypeError(f"local checkpoint: leaf {path_key(path)} is a {type(x).__name__}, not an array")
            seen = set()
            for s in x.addressable_shards:
                idx = _index_of(s.index, x.shape)
                if idx not in seen:
                    seen.add(idx)
                    entry["shards"].append({"index": [list(p) for p in idx]})
                    shards.append(s.data)
        buffers = [np.array(b, copy=True, order="C") for b in jax.device_get(shards)]
        self.host_bytes = sum(b.nbytes for b in buffers)
        return leaves, buffers, streamed

    def _stream(self, job: _Job, streamed: list[slices.StreamedArray]) -> bool:
        """The streamed leaves' boxes (every one this process holds, once) into the step's data file, one
        source chunk at a time; False (the step not saved, the reason kept for `wait`) on a write error."""
        entries = {e["key"]: e for e in job.leaves}
        sources = list({id(x.source): x.source for x in streamed}.values())
        try:
            job.open()
            for source in sources:
                seen = set()
                for pieces in source.save_pieces(primary_only=False):
                    for p in pieces:
                        if (p.key, p.start, p.stop) in seen or p.key not in entries:
                            continue
                        seen.add((p.key, p.start, p.stop))
                        shard = {"index": [[a, b] for a, b in zip(p.start, p.stop, strict=True)]}
                        entries[p.key]["shards"].append(shard)
                        job.put(shard, p.data)
        except OSError as e:  # a full RAM disk must not end the run (the source's own errors do)
            job.discard()
            self._error = f"local checkpoint step {job.step} in {self.directory} not saved ({type(e).__name__}: {e})"
            return False
        return True

    def _write(self, job: _Job) -> None:
        final = self.directory / str(job.step)
        try:
            job.open()
            it = iter(job.buffers)
            for leaf in job.leaves:
                for shard in leaf["shards"]:
                    if "offset" not in shard:
                        job.put(shard, next(it))
            job.file.close()
            index = {"format": FORMAT, "step": job.step, "process": self.process, "processes": jax.process_count(),
                     "bytes": job.offset, "meta": self.meta, "leaves": job.leaves}  # fmt: skip
            (job.tmp / INDEX).write_text(json.dumps(index))
            if final.exists():  # a step saved before, by an attempt that did not get past it
                shutil.rmtree(final)
            os.rename(job.tmp, final)
            newest = sorted(self.steps())[-self.cfg.local_keep :]
            self.drop(lambda s: s in newest)
            self.last = (job.step, job.offset, time.perf_counter() - job.t0)
        except Exception as e:  # noqa: BLE001 - a full RAM disk must not end the run: the persistent tier goes on
            job.discard()
            self._error = f"local checkpoint step {job.step} in {self.directory} not saved ({type(e).__name__}: {e})"

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

    def restore(self, step: int, target: Any, streamed: slices.Source | None = None) -> Any:
        """Step `step` in the layout of `target` (ShapeDtypeStructs with shardings): every shard this
        process needs, read from its own files and checked against its CRC. `streamed`: the leaves it
        names go into it box by box (`restore_pieces`) and come back as IN_FILE, as from
        `Checkpointer.restore`. LocalUnusable otherwise."""
        entry = self.directory / str(step)
        try:
            index = json.loads((entry / INDEX).read_text())
            if index.get("meta") != self.meta:
                raise LocalUnusable("written for another model or optimizer")
            saved = {leaf["key"]: leaf for leaf in index["leaves"]}
            flat, treedef = jax.tree_util.tree_flatten_with_path(target)
            with open(entry / DATA, "rb") as f:
                boxes = _Boxes(f, saved)
                into = streamed.keys if streamed is not None else frozenset()
                leaves = [slices.IN_FILE if path_key(p) in into else boxes.array(path_key(p), t) for p, t in flat]
                if streamed is not None:
                    for key in streamed.keys:
                        boxes.check(key, streamed.shapes[key], np.float32)
                    for pieces in streamed.restore_pieces():
                        for p in pieces:
                            p.data[...] = boxes.box(p.key, p.start, p.stop, p.data.dtype)
                self.restored_bytes = boxes.in_memory
        except LocalUnusable:
            raise
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise LocalUnusable(f"{type(e).__name__}: {str(e)[:200]}") from e
        return jax.tree_util.tree_unflatten(treedef, leaves)


class _Boxes:
    """The saved entries of one local step (whole shards, or a streamed tier's boxes) and reads of any
    box of a leaf from them: an entry that is the box itself is read and checked against its CRC;
    other boxes are cut from the entries they overlap (each checked once, in blocks, then mapped)."""

    BLOCK = 8 << 20  # bytes read at a time when an entry is checked before it is cut

    def __init__(self, f, saved: dict[str, dict]):
        self.f, self.saved, self.checked = f, saved, set()
        self.built: set = set()  # distinct boxes read for in-memory leaves
        self.in_memory = 0  # their bytes
        self.exact = {(leaf["key"], tuple(tuple(p) for p in s["index"])): s
                      for leaf in saved.values() for s in leaf["shards"]}  # fmt: skip

    def check(self, key: str, shape: tuple, dtype) -> dict:
        leaf = self.saved.get(key)
        if leaf is None:
            raise LocalUnusable(f"no {key} in it")
        if tuple(leaf["shape"]) != tuple(shape) or leaf["dtype"] != str(np.dtype(dtype)):
            raise LocalUnusable(f"{key} is {leaf['dtype']}{leaf['shape']}, the state needs "
                                f"{np.dtype(dtype)}{list(shape)}")  # fmt: skip
        return leaf

    def array(self, key: str, target: Any) -> jax.Array:
        self.check(key, target.shape, target.dtype)

        def read(index: tuple) -> np.ndarray:
            idx = _index_of(index, target.shape)
            out = self.box(key, tuple(a for a, _ in idx), tuple(b for _, b in idx), target.dtype)
            if (key, idx) not in self.built:
                self.built.add((key, idx))
                self.in_memory += out.nbytes
            return out

        return jax.make_array_from_callback(tuple(target.shape), target.sharding, read)

    def box(self, key: str, start: tuple, stop: tuple, dtype) -> np.ndarray:
        """Elements [start, stop) of leaf `key`, from the entries that hold them."""
        dtype, want = np.dtype(dtype), tuple(zip(start, stop, strict=True))
        shape = tuple(b - a for a, b in want)
        s = self.exact.get((key, want))
        if s is not None:
            self.f.seek(s["offset"])
            raw = self.f.read(s["nbytes"])
            if len(raw) != s["nbytes"] or zlib.crc32(raw) != s["crc32"]:
                raise LocalUnusable(f"{key}: box {want} does not match its CRC-32")
            return np.frombuffer(raw, dtype).reshape(shape)
        out, covered = np.empty(shape, dtype), 0
        for s in self.saved[key]["shards"]:
            have = [tuple(p) for p in s["index"]]
            lo = [max(a, h[0]) for a, h in zip(start, have, strict=True)]
            hi = [min(b, h[1]) for b, h in zip(stop, have, strict=True)]
            if any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            src = self._mapped(key, s, dtype, tuple(h[1] - h[0] for h in have))
            out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, start, strict=True))] = \
                src[tuple(slice(a - h[0], b - h[0]) for a, b, h in zip(lo, hi, have, strict=True))]  # fmt: skip
            covered += math.prod(b - a for a, b in zip(lo, hi, strict=True))
        if covered != math.prod(shape):
            raise LocalUnusable(f"{key}: this process did not save the shard {want} (another layout)")
        return out

    def _mapped(self, key: str, s: dict, dtype, shape: tuple) -> np.ndarray:
        """Entry `s` mapped from the data file, its CRC checked the first time (in blocks)."""
        if s["offset"] not in self.checked:
            self.f.seek(s["offset"])
            crc, left = 0, s["nbytes"]
            while left:
                raw = self.f.read(min(left, self.BLOCK))
                if not raw:
                    raise LocalUnusable(f"{key}: a saved box is cut short")
                crc, left = zlib.crc32(raw, crc), left - len(raw)
            if crc != s["crc32"]:
                raise LocalUnusable(f"{key}: a saved box does not match its CRC-32")
            self.checked.add(s["offset"])
        return np.memmap(self.f.name, dtype, "r", offset=s["offset"], shape=shape)
