"""Checkpoints with orbax: async save, keep-N, restore onto any mesh (resharding), SIGTERM handling.

Layout: RUN_DIR/checkpoints/STEP/{state, meta}. `state` is the training-state pytree (orbax
StandardSave: every process writes its own shards, OCDBT); `meta` is a JSON dict (model config etc.)
written with every checkpoint and compared with the current config before restoring.
Restoring is layout-independent: the target's shardings decide how the arrays are read back, so a
run saved on (data 2, pipe 2, tensor 2) resumes on (data 8) or (pipe 4, tensor 2).
`meta` also holds per-array content checksums (`checksum.py`: OCDBT does not detect bytes overwritten
inside an array chunk), checked after each restore.
A step that fails to restore (corrupt array files or metadata, a checksum mismatch) raises
CheckpointDamaged; the loop moves it aside (`move_aside`: STEP -> STEP.damaged-TIME, never deleted)
and tries the next older one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint._src.serialization.type_handler_registry import GLOBAL_TYPE_HANDLER_REGISTRY

from meshrun.checkpoint import checksum, slices
from meshrun.checkpoint.store import DAMAGED_TAG, META, STATE, read_json, write_error
from meshrun.config import EXECUTION_FIELDS, CheckpointConfig, saved_model
from meshrun.errors import CheckpointError, ConfigError


class CheckpointDamaged(CheckpointError):
    """Step `step` exists but cannot be restored (corrupt or missing array files / metadata)."""

    def __init__(self, step: int, directory: Path, cause: BaseException):
        self.step, self.directory = step, directory
        while _ORBAX_WRAPPER in str(cause) and cause.__cause__ is not None:
            cause = cause.__cause__  # orbax's "error while reading array index ..." wraps TensorStore's reason
        first = next((ln.strip() for ln in str(cause).splitlines() if ln.strip()), "")
        self.why = f"{type(cause).__name__}: {first[:200]}" if first else type(cause).__name__
        super().__init__(f"checkpoint step {step} in {directory} cannot be restored ({self.why})")


_ORBAX_WRAPPER = "See full TensorStore details"  # orbax's read error: the reason is its __cause__
_ORBAX_DIR = os.path.dirname(ocp.__file__)
# orbax's per-fragment write coroutines (serialization.async_serialize_from_host and its kin)
_UNSCHEDULED_WRITES = r"coroutine 'async_serialize\w*\.<locals>\.\w+' was never awaited"


def _abandoned_read(u) -> bool:
    """An orbax read coroutine left pending by a failed restore, closed when it is garbage collected
    (at the latest at exit): its `except BaseException` turns the GeneratorExit into a new exception
    with the whole TensorStore spec (~70 lines each, thousands of lines for a large state)."""
    code = getattr(u.object, "cr_code", None)
    return (
        code is not None
        and code.co_filename.startswith(_ORBAX_DIR)
        and isinstance(getattr(u.exc_value, "__cause__", None) or getattr(u.exc_value, "__context__", None),
                       GeneratorExit)
    )  # fmt: skip


def _quiet_leftover_reads() -> None:
    """After a failed restore orbax closes its event loop while TensorStore still completes the other
    reads; each completion then reports 'Event loop is closed' as an unraisable exception, and each
    read coroutine still pending reports its GeneratorExit when it is collected (a screen of
    tracebacks, harmless: the restore already failed and said why). Drop exactly those (not with
    MESHRUN_DEBUG=1); anything else goes through."""
    previous = sys.unraisablehook
    if getattr(previous, "_meshrun", False) or os.environ.get("MESHRUN_DEBUG", "") not in ("", "0"):
        return

    def hook(u):
        tb, last = u.exc_traceback, None
        while tb is not None:
            last, tb = tb, tb.tb_next
        if (
            isinstance(u.exc_value, RuntimeError)
            and str(u.exc_value) == "Event loop is closed"
            and last is not None
            and last.tb_frame.f_code.co_filename.endswith(os.path.join("asyncio", "base_events.py"))
        ) or _abandoned_read(u):
            return
        previous(u)

    hook._meshrun = True
    sys.unraisablehook = hook


class _NoWriterTraceback(logging.Filter):
    """A failed async save (disk full, permissions): orbax's writer threads log the exception with
    its traceback (absl ERROR, also after meshrun's own line from threads still winding down), and
    asyncio reports each failed write task once more. Drop orbax's ERROR records and the asyncio
    repeats: meshrun's CheckpointError line names the step, the directory and the cause
    (MESHRUN_DEBUG=1 keeps them all). Other records keep one line, without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "asyncio" and "exception was never retrieved" in str(record.msg):
            return False
        if record.levelno >= logging.ERROR and record.pathname.startswith(_ORBAX_DIR):
            return False
        record.exc_info, record.exc_text = None, None
        return True


class _NoChunkSizeAdvice(logging.Filter):
    """Orbax advises against zarr chunks under 1 MiB once per array written with a smaller
    chunk_byte_size; the streamed leaves' chunks are one row of a tier chunk on purpose (a save writes
    them as they stream), so it said so for every leaf of every save. Only that record is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.pathname.startswith(_ORBAX_DIR) and str(record.msg).startswith(_CHUNK_ADVICE))


_CHUNK_ADVICE = "Setting the target_byte_size too small"


def _quiet_writer_failures() -> None:
    absl_log = logging.getLogger("absl")
    if not any(isinstance(f, _NoChunkSizeAdvice) for f in absl_log.filters):
        absl_log.addFilter(_NoChunkSizeAdvice())
    if os.environ.get("MESHRUN_DEBUG", "") not in ("", "0"):
        return
    for name in ("absl", "asyncio"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _NoWriterTraceback) for f in log.filters):
            log.addFilter(_NoWriterTraceback())
    # the failed save's other fragment writes were created but never scheduled; Python reports each
    # one when it is collected, often at exit ('sys:1: RuntimeWarning: coroutine ... never awaited')
    warnings.filterwarnings("ignore", message=_UNSCHEDULED_WRITES, category=RuntimeWarning)
    _quiet_leftover_reads()  # the writer's other TensorStore futures complete on a closed event loop


@contextlib.contextmanager
def _quiet_absl():
    """Reading one item of a composite makes orbax warn that the other item was skipped."""
    absl_log = logging.getLogger("absl")
    level = absl_log.level
    absl_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl_log.setLevel(level)


_MIN_REPLICA_SLICE = 4 << 20  # bytes: a replicated array written by one replica below this


def _whole_small_replicas() -> None:
    """Orbax writes a replicated array in parallel from its replicas, each slicing off its part with
    an eager jax op: one XLA compile per array shape and replica count, about 7 s of the quickstart
    model's 7.5 s first save. Arrays under 4 MiB a replica are written whole by one replica instead
    (the jax.Array handler registered now: orbax's, or slices.SliceArrayHandler)."""
    handler = GLOBAL_TYPE_HANDLER_REGISTRY.get(jax.Array)
    if getattr(handler, "_min_slice_bytes_for_replica_parallel", 0) is None:
        handler._min_slice_bytes_for_replica_parallel = _MIN_REPLICA_SLICE  # noqa: SLF001 - no public setter


def _is_resource_error(e: BaseException) -> bool:
    """Out of memory while restoring says nothing about the files: not a reason to move them aside."""
    return isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e)


def check_run_dir_writable(run_dir: str | Path) -> None:
    """Create `run_dir` and write a probe file in it, or raise ConfigError naming train.run_dir."""
    try:
        os.makedirs(run_dir, exist_ok=True)
        why = write_error(run_dir)
    except OSError as e:
        why = e.strerror or str(e)
    if why is not None:
        raise ConfigError(
            "train.run_dir",
            str(run_dir),
            "choose a directory you can create and write, e.g. train.run_dir=runs/NAME",
            f"cannot create or write it ({why})",
        )


def _json_roundtrip(x: Any) -> Any:
    return json.loads(json.dumps(x))  # tuples -> lists, as the saved copy reads back


def path_key(path) -> str:
    """Tree path as 'a.b.0', independent of the container types (dict, nnx.State, list)."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def tree_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """{'a.b.0': shape} of every leaf with a shape: arrays, ShapeDtypeStructs, orbax array metadata."""
    return {
        path_key(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0] if hasattr(x, "shape")
    }


def tree_dtypes(tree: Any) -> dict[str, str]:
    """{'a.b.0': dtype name} of every leaf with a dtype (as `tree_shapes`)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {path_key(p): np.dtype(x.dtype).name for p, x in flat if getattr(x, "dtype", None) is not None}


def _dtype_refusal(step: int, run_dir: str, key: str, saved: str, want: str) -> ConfigError:
    """The optimizer's moments in another dtype: optimizer.state_dtype; any other array: train.run_dir."""
    held = f"checkpoint step {step} holds {key} as {saved}, the state needs {want}"
    if key.startswith("opt"):
        fix = f"use optimizer.state_dtype={saved} to resume it, or a new train.run_dir"
        return ConfigError("optimizer.state_dtype", want, fix, held)
    return ConfigError("train.run_dir", run_dir, "use a new train.run_dir or the settings it was written with", held)


def _abstract(x: Any) -> Any:
    """Array leaf -> ShapeDtypeStruct with its sharding (what StandardRestore reads into)."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x


class Checkpointer:
    """Save/restore the training state under RUN_DIR/checkpoints (see the module docstring)."""

    def __init__(self, run_dir: str | Path, cfg: CheckpointConfig, *, meta: dict[str, Any]):
        check_run_dir_writable(run_dir)
        self.run_dir, self.cfg = str(run_dir), cfg
        self.meta = _json_roundtrip(meta)  # fails here, not in a background thread, if not JSON-able
        self.directory = Path(os.path.abspath(run_dir)) / "checkpoints"
        options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save)
        state_handler = ocp.StandardCheckpointHandler()
        # slices.StreamedArray leaves (the nvme tier's optimizer state) are saved by slices.SliceArrayHandler
        if hasattr(state_handler, "_supported_types"):
            state_handler._supported_types = (*state_handler._supported_types, slices.StreamedArray)  # noqa: SLF001
        handlers = {STATE: state_handler, META: ocp.JsonCheckpointHandler()}
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        _quiet_writer_failures()
        self._started: set[int] = set()  # steps saved by this object (an async one may not be listed yet)
        self._pending: int | None = None  # the step of the async save in flight (not waited for yet)

    # ------------------------------------------------------------------ steps

    def all_steps(self) -> list[int]:
        """Complete checkpoints, oldest first. Orbax lists only finalized steps (an interrupted save
        leaves a STEP.orbax-checkpoint-tmp[-*] directory that it skips); a step directory that also
        lacks the state or meta item is skipped too."""
        self.manager.reload()
        return sorted(
            s for s in self.manager.all_steps() if all((self.directory / str(s) / i).is_dir() for i in (STATE, META))
        )

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        return self.cfg.every > 0 and step % self.cfg.every == 0

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: Any, force: bool = False) -> bool:
        """Save when `should_save(step)` or `force` (the last step, preemption); async when configured.
        Returns whether a save started. Arrays are copied to host before this returns, so the caller
        may donate `state` to the next step."""
        if not (force or self.should_save(step)) or step in self._started:
            return False
        if step in self.manager.all_steps():
            if step in self.all_steps():
                return False  # already on disk (a resumed run's last step)
            self.move_aside(step)  # an unusable STEP/ (no state or meta): orbax would skip the save
        meta = {**self.meta, "checksums": checksum.checksums(state, path_key)}  # checked on restore
        args = ocp.args.Composite(**{STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta)})
        self.wait()  # the previous async save: a failure there names its own step, not this one
        _whole_small_replicas()
        self._started.add(step)
        with self._saving(step):
            started = bool(self.manager.save(step, args=args, force=True))
        self._pending = step if started and self.cfg.async_save else None
        return started

    @contextlib.contextmanager
    def _saving(self, step: int | None):
        """A failed (async) save -> CheckpointError naming the directory; the older steps stay."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - orbax/TensorStore/OS errors of the writer
            which = f"step {step}" if step is not None else "a checkpoint"
            first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
            raise CheckpointError(
                f"saving {which} in {self.directory} failed ({type(e).__name__}: {first[:200]}); the "
                "checkpoints already there are intact; check free space and permissions"
            ) from e

    def wait(self) -> None:
        """Block until the pending async save is on disk; CheckpointError naming its step if it failed."""
        with self._saving(self._pending):
            self.manager.wait_until_finished()
        self._pending = None

    def close(self) -> None:
        try:
            self.wait()
        except BaseException:
            with contextlib.suppress(Exception):  # orbax's close waits again and re-raises the same failure
                self.manager.close()
            raise
        self.manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ restore

    def saved_meta(self, step: int) -> dict[str, Any]:
        with _quiet_absl():
            return self.manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]

    def _check_optimizer(self, meta: dict[str, Any]) -> None:
        """ConfigError when the checkpoint was written by another optimizer (its state would not fit;
        checkpoints from before the `optimizer:` section were written by adamw)."""
        saved = (meta.get("optimizer") or {}).get("name", "adamw")
        current = (self.meta.get("optimizer") or {}).get("name")
        if current is not None and saved != current:
            raise ConfigError(
                "optimizer.name",
                current,
                f"use a new train.run_dir, or optimizer.name={saved} to resume it",
                f"checkpoint in {self.run_dir} was written by optimizer.name={saved!r}",
            )

    def check_compatible(self, step: int, target: Any, meta: dict[str, Any] | None = None) -> None:
        """ConfigError when the saved model config or the saved array shapes differ from the current ones
        (`meta`: the step's saved meta when the caller has read it already)."""
        meta = self.saved_meta(step) if meta is None else meta
        self._check_optimizer(meta)
        saved, current = meta.get("model"), self.meta.get("model")
        if saved is not None:
            saved = saved_model(saved)
        if saved is not None and current is not None:  # how the step runs may change (EXECUTION_FIELDS)
            saved = {k: v for k, v in saved.items() if k not in EXECUTION_FIELDS}
            current = {k: v for k, v in current.items() if k not in EXECUTION_FIELDS}
        if saved is not None and current is not None and saved != current:
            keys = [k for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
            fields = [f"model.{k}" for k in keys]
            was = ", ".join(f"model.{k}={saved.get(k)!r}" for k in keys)
            now = ", ".join(repr(current.get(k)) for k in keys)
            raise ConfigError(
                ", ".join(fields),
                now if len(keys) > 1 else current.get(keys[0]),
                "use a new train.run_dir or matching model settings",
                f"checkpoint in {self.run_dir} was written for {was}, config has {now}",
            )
        self._check_arrays(step, target)

    def _check_arrays(self, step: int, target: Any) -> None:
        """ConfigError when the saved arrays' names, shapes or dtypes differ from `target`'s: a restore
        would fail or cast, and its checksums (of the saved bytes) would then call an intact step damaged."""
        try:
            with _quiet_absl():
                tree = self.manager.item_metadata(step)[STATE]
        except Exception:  # noqa: BLE001 - metadata is a courtesy check; orbax reports what it can't read
            return
        tree = getattr(tree, "tree", tree)
        saved_shapes, want = tree_shapes(tree), tree_shapes(target)
        fix = "use a new train.run_dir or the settings the checkpoint was written with"
        missing = sorted(set(want) - set(saved_shapes))
        if missing and set(saved_shapes):
            raise ConfigError(
                "train.run_dir", self.run_dir, fix, f"checkpoint step {step} has no {missing[:3]} (the state needs it)"
            )
        for k, shape in want.items():
            if k in saved_shapes and saved_shapes[k] != shape:
                raise ConfigError(
                    "train.run_dir",
                    self.run_dir,
                    fix,
                    f"checkpoint step {step} holds {k} with shape {saved_shapes[k]}, the state needs {shape}",
                )
        saved_types, want_types = tree_dtypes(tree), tree_dtypes(target)
        other = [k for k, t in want_types.items() if saved_types.get(k, t) != t]
        if other:
            raise _dtype_refusal(step, self.run_dir, other[0], saved_types[other[0]], want_types[other[0]])

    def restore(self, step: int, target: Any, streamed: slices.Source | None = None) -> Any:
        """Restore step `step` into the layout of `target`: a pytree of jax.ShapeDtypeStruct with
        shardings, or of arrays (their shardings are used). Any mesh works (resharding). `streamed`:
        the leaves it names go into it slice by slice (slices.restore) and come back as IN_FILE.
        ConfigError: written for another model / shapes; CheckpointDamaged: the files cannot be read."""
        try:
            meta = self.saved_meta(step)
            self.check_compatible(step, target, meta)
            abstract = jax.tree.map(_abstract, target)
            if streamed is not None:
                state = slices.restore(self.directory / str(step) / STATE, abstract, streamed,
                                       meta.get("checksums", {}), path_key)  # fmt: skip
            else:
                args = ocp.args.Composite(**{STATE: ocp.args.StandardRestore(abstract)})
                state = self.manager.restore(step, args=args)[STATE]
            bad = checksum.mismatches(meta.get("checksums", {}), state, path_key)
            if bad:  # OCDBT reads overwritten chunk bytes without an error
                raise ValueError(f"array data does not match its checksum: {', '.join(bad[:3])}")
            return state
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - TensorStore, JSON, orbax and OS errors all mean "unreadable"
            _quiet_leftover_reads()
            if _is_resource_error(e):
                raise CheckpointError(
                    f"restoring checkpoint step {step} in {self.directory} ran out of memory ({type(e).__name__}); "
                    "the checkpoint is left as it is"
                ) from e
            raise CheckpointDamaged(step, self.directory, e) from e

    def move_aside(self, step: int) -> Path:
        """Rename STEP to STEP.damaged-TIME inside the checkpoints directory (process 0 only; never
        deleted): orbax no longer lists it, `meshrun checkpoints` shows it as damaged."""
        src = self.directory / str(step)
        stamp = time.strftime("%Y%m%dT%H%M%S")
        dst, n = self.directory / f"{step}{DAMAGED_TAG}{stamp}", 1
        while dst.exists():
            n += 1
            dst = self.directory / f"{step}{DAMAGED_TAG}{stamp}-{n}"
        if jax.process_index() == 0:
            os.rename(src, dst)
        if jax.process_count() > 1:  # the others name process 0's choice (theirs may see its rename: -2)
            buf = np.zeros(256, np.uint8)
            buf[: len(dst.name.encode())] = np.frombuffer(dst.name.encode()[:256], np.uint8)
            got = np.asarray(multihost_utils.broadcast_one_to_all(buf))
            dst = self.directory / bytes(got[got != 0]).decode()
            multihost_utils.sync_global_devices(f"meshrun-move-aside-{step}")
        self.manager.reload()
        return dst


class PreemptionFlag:
    """Sets a flag on SIGTERM (cluster preemption, `scancel`) instead of dying. The train loop checks
    `should_stop()` at each step boundary, saves a checkpoint and exits 0. `close()` restores the
    previous handlers. Installed only from the main thread (Python allows signal handlers nowhere else)."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)):
        self._event = threading.Event()
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for s in signals:
                self._previous[s] = signal.signal(s, self._handler)

    def _handler(self, signum, frame) -> None:
        self.signum = signum
        self._event.set()

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        self._event.set()

    def should_stop(self) -> bool:
        """True when any process got the signal. Multi-process: an all-gather, so every process must
        call it at the same step (the scheduler may signal hosts at slightly different times)."""
        if jax.process_count() == 1:
            return self.is_set()
        flags = multihost_utils.process_allgather(np.array([self.is_set()], np.int32))
        return bool(np.asarray(flags).any())

    def close(self) -> None:
        for s, prev in self._previous.items():
            signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        self._previous = {}

    def __enter__(self) -> PreemptionFlag:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def verify_arrays(entry: Path) -> str:
    """'' when every array of STEP/state reads back (onto one CPU device), else why not."""
    is_array = lambda x: hasattr(x, "shape") and hasattr(x, "dtype")
    entry = Path(os.path.abspath(entry))  # orbax takes absolute paths only (`checkpoints runs/x --verify`)
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    try:
        with _quiet_absl():
            ck = ocp.StandardCheckpointer()
            meta = ck.metadata(entry / STATE)
            tree = getattr(meta, "item_metadata", meta)
            tree = getattr(tree, "tree", tree)
            target = jax.tree.map(
                lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=cpu), tree, is_leaf=is_array
            )
            state = jax.block_until_ready(ck.restore(entry / STATE, target))
    except Exception as e:  # noqa: BLE001 - TensorStore, JSON, orbax and OS errors all mean "unreadable"
        _quiet_leftover_reads()
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        return f"arrays unreadable ({type(e).__name__}: {first[:160]})"
    meta, _ = read_json(entry / META / "metadata")
    bad = checksum.mismatches((meta or {}).get("checksums", {}), state, path_key)
    return f"array data does not match its checksum: {', '.join(bad[:3])}" if bad else ""
