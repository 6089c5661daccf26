"""Checkpoint arrays written and read in slices, for state that never rests whole in memory (the NVMe
tier's optimizer state, `meshrun/offload/checkpoint_io.py`).

Saving: a `StreamedArray` leaf stands for an array whose data a `Source` hands over one file chunk at a
time, as boxes of the global array. `SliceArrayHandler`, an orbax `ArrayHandler` installed in
orbax's place for jax.Array (it saves jax.Arrays exactly as ArrayHandler does), writes such leaves
box by box with TensorStore into the same zarr/OCDBT files, sharding file and array metadata as
ArrayHandler would, with zarr chunks no larger than the source's chunk rows. The checkpoint is
therefore an ordinary orbax checkpoint that every tier restores. The writes finish before the save
returns (the source's file changes at the next step).
Restoring: `restore` reads every leaf with TensorStore, the ordinary ones whole into their shardings,
the streamed ones box by box into the source (`restore_pieces`), checking their content checksums
(`checksum.py`'s sums, computed here with numpy on the boxes) on the way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath
from jax.experimental import multihost_utils

# orbax internals the handler reuses to write exactly what ArrayHandler writes (orbax-checkpoint 0.11-0.12;
# tests/test_offload_checkpoint.py restores such a checkpoint with the plain orbax path)
from orbax.checkpoint._src.serialization import jax_array_handlers, ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

HASH = 2654435761  # checksum.py's weight multiplier


@dataclasses.dataclass(frozen=True)
class Piece:
    """One box of a streamed leaf: global [start, stop) per axis; `data` is a view into the source's
    chunk buffer (save: read from it; restore: filled); `primary`: this copy is counted and written
    (one per element over all processes, as orbax writes replica 0)."""

    key: str
    start: tuple
    stop: tuple
    data: np.ndarray
    primary: bool = True


class Source(Protocol):
    """What streams a set of leaves: `save_pieces` yields each file chunk's boxes (valid until the next
    one), `restore_pieces` each chunk's boxes to fill (written back when the next one is asked for)."""

    keys: frozenset
    shapes: dict  # key -> global shape
    zarr_chunk_bytes: int
    stamp: object  # changes whenever the data changes

    def save_pieces(self) -> Iterator[list[Piece]]: ...

    def restore_pieces(self) -> Iterator[list[Piece]]: ...


@dataclasses.dataclass(frozen=True)
class StreamedArray:
    """A checkpoint leaf whose data `source` streams (shape, dtype, sharding: the array it stands for)."""

    key: str
    shape: tuple
    dtype: Any
    sharding: jax.sharding.Sharding
    source: Any

    @property
    def local_shape(self) -> tuple:
        return tuple(self.sharding.shard_shape(self.shape))

    def sums(self) -> list[int]:
        return source_sums(self.source)[self.key]


class InFile:
    """A restored leaf that went into its source instead of memory."""


IN_FILE = InFile()


def flat_boxes(shape: tuple, a: int, b: int) -> list[tuple[tuple, tuple]]:
    """Boxes (start, stop) covering the row-major flat range [a, b) of an array of `shape`, in order
    (each box's elements are consecutive in the range): at most 2 * ndim + 1 boxes."""
    if a >= b:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    i0, r0 = divmod(a, inner)
    i1, r1 = divmod(b, inner)
    out: list = []
    if r0:
        end = b - i0 * inner if i1 == i0 else inner
        out += [((i0, *s), (i0 + 1, *e)) for s, e in flat_boxes(shape[1:], r0, end)]
        if i1 == i0:
            return out
        i0 += 1
    if i1 > i0:
        out.append(((i0, *(0,) * (len(shape) - 1)), (i1, *shape[1:])))
    if r1:
        out += [((i1, *s), (i1 + 1, *e)) for s, e in flat_boxes(shape[1:], 0, r1)]
    return out


def box_sums(shape: tuple, start: tuple, data: np.ndarray) -> np.ndarray:
    """checksum.py's two uint32 sums of one box of a float32 array of global `shape` (wrapping)."""
    w = np.ascontiguousarray(data).view(np.uint32)
    idx = np.zeros((), np.uint32)
    stride = 1
    for ax in reversed(range(len(shape))):
        n = w.shape[ax]
        pos = (np.arange(start[ax], start[ax] + n, dtype=np.uint64) * (stride % 2**32)) % 2**32
        idx = idx + pos.astype(np.uint32).reshape((n,) + (1,) * (len(shape) - 1 - ax))
        stride *= shape[ax]
    weight = idx * np.uint32(HASH) + np.uint32(1)
    return np.array([np.sum(w, dtype=np.uint32), np.sum(w * weight, dtype=np.uint32)], np.uint32)


def _allsum(sums: dict[str, np.ndarray]) -> dict[str, list[int]]:
    keys = sorted(sums)
    if jax.process_count() > 1 and keys:
        got = np.asarray(multihost_utils.process_allgather(np.stack([sums[k] for k in keys])))
        total = np.sum(got.astype(np.uint64), axis=0) % 2**32
        return {k: [int(v) for v in total[i]] for i, k in enumerate(keys)}
    return {k: [int(v) for v in sums[k]] for k in keys}


def source_sums(source) -> dict[str, list[int]]:
    """Every streamed leaf's checksums, from one pass over the source (kept while `source.stamp`, which
    changes whenever its data does, stays the same)."""
    cached = getattr(source, "_sums", None)
    if cached is not None and cached[0] == source.stamp:
        return cached[1]
    stamp, shapes = source.stamp, source.shapes
    sums = {k: np.zeros(2, np.uint32) for k in source.keys}
    for pieces in source.save_pieces():
        for p in pieces:
            sums[p.key] += box_sums(shapes[p.key], p.start, p.data)
    source._sums = (stamp, _allsum(sums))
    return source._sums[1]


def _box(p: Piece):
    return tuple(slice(a, b) for a, b in zip(p.start, p.stop, strict=True))


class _WithExtra:
    """An orbax array-metadata store that adds the streamed leaves' entries to ArrayHandler's write."""

    def __init__(self, store, extra: list):
        self._store, self._extra = store, extra

    async def write(self, checkpoint_dir, array_metadatas, process_index):
        return await self._store.write(checkpoint_dir=checkpoint_dir, array_metadatas=[*array_metadatas, *self._extra],
                                       process_index=process_index)  # fmt: skip

    def __getattr__(self, name):
        return getattr(self._store, name)


async def _after_directories(coro) -> Any:
    """Run the writer coroutine `coro` once orbax has created the checkpoint's directories; return its
    result. An async save creates them in a background thread and first deletes whatever is already
    there, so a write that starts before (TensorStore creates missing parent directories) is lost.
    orbax's TypeHandler.serialize asks every storage write to wait through
    `CommitFutureAwaitingContractedSignals`; its pytree handler's metadata write waits this same way."""
    waiting = getattr(ocp.future, "CommitFutureAwaitingContractedSignals", None)
    if waiting is None:  # an older orbax without signal contracts: nothing to wait on
        return await coro
    return await asyncio.to_thread(waiting(coro, name="streamed_array_writer").result)


class SliceArrayHandler(ocp.type_handlers.ArrayHandler):
    """orbax's ArrayHandler, plus `StreamedArray` leaves written box by box (see the module docstring)."""

    async def serialize(self, values, infos, args=None):
        args = list(args or [ocp.type_handlers.SaveArgs()] * len(values))
        streamed = [(v, i, a) for v, i, a in zip(values, infos, args, strict=True) if isinstance(v, StreamedArray)]
        plain = [(v, i, a) for v, i, a in zip(values, infos, args, strict=True) if not isinstance(v, StreamedArray)]
        metas = await _after_directories(self._write_streamed(streamed)) if streamed else []
        store = self._array_metadata_store
        if plain:
            self._array_metadata_store = _WithExtra(store, metas) if store is not None and metas else store
            try:
                return list(await super().serialize(*map(list, zip(*plain, strict=True))))
            finally:
                self._array_metadata_store = store
        if store is not None and metas:
            await store.write(checkpoint_dir=infos[0].parent_dir, array_metadatas=metas,
                              process_index=jax.process_index())  # fmt: skip
        return []

    async def _write_streamed(self, streamed) -> list:
        sources = {id(v.source): v.source for v, _, _ in streamed}
        if len(sources) != 1:
            raise ValueError("one save streams one source")
        (source,) = sources.values()
        stores, metas, specs = {}, [], []
        for v, info, arg in streamed:
            await info.await_path_creation()
            arg = dataclasses.replace(arg, chunk_byte_size=source.zarr_chunk_bytes)
            spec = ts_utils.build_array_write_spec(
                info=info, arg=arg, global_shape=v.shape, local_shape=v.local_shape, dtype=np.dtype(v.dtype),
                use_ocdbt=bool(info.is_ocdbt_checkpoint), metadata_key=self._metadata_key,
                process_index=ocdbt_utils.get_process_index_for_subdir(bool(info.is_ocdbt_checkpoint)),
            )  # fmt: skip
            specs.append((v.key, ts.Spec(spec.json), info.ts_context))
            metas.append(spec.metadata)
        if self._primary_host is None or jax.process_index() == self._primary_host:
            txn = ts.Transaction()  # every array's metadata in one OCDBT commit: fewer manifest writes
            for _, spec, context in specs:
                await ts.open(spec, create=True, open=True, context=context, transaction=txn)
            await txn.commit_async()
        for key, spec, context in specs:
            stores[key] = await ts.open(spec, open=True, assume_metadata=True, context=context)
        for pieces in source.save_pieces():  # one file chunk at a time: its boxes written before the next read
            txn = ts.Transaction()  # one OCDBT commit per chunk, not one per box
            writes = [stores[p.key].with_transaction(txn)[_box(p)].write(p.data) for p in pieces if p.primary]
            for w in writes:
                await w
            await txn.commit_async()
        if self._enable_write_sharding_file:
            await jax_array_handlers._async_serialize_shardings(  # noqa: SLF001 - ArrayHandler's own writer
                shardings=[v.sharding for v, _, _ in streamed], infos=[i for _, i, _ in streamed],
                primary_host=self._primary_host,
            )  # fmt: skip
        return metas


_INSTALLED: list = []


def install() -> None:
    """Put SliceArrayHandler in ArrayHandler's place (for jax.Array and StreamedArray); idempotent."""
    if _INSTALLED:
        return
    from orbax.checkpoint._src.metadata import array_metadata_store
    from orbax.checkpoint._src.serialization.type_handler_registry import GLOBAL_TYPE_HANDLER_REGISTRY

    handler = SliceArrayHandler(array_metadata_store=array_metadata_store.Store())
    for ty in (jax.Array, StreamedArray):  # one handler: one batch, one array-metadata write per save
        GLOBAL_TYPE_HANDLER_REGISTRY.add(ty, handler, override=True, ignore_warnings=True)
    _INSTALLED.append(handler)


def _uses_zarr3(state_dir: Path) -> bool:
    try:
        return bool(json.loads((state_dir / "_METADATA").read_text()).get("use_zarr3", False))
    except (OSError, ValueError):
        return False


def restore(state_dir: Path, target: Any, source, saved_sums: dict, key_fn) -> Any:
    """`target` (ShapeDtypeStructs with shardings) read from the orbax state directory `state_dir`:
    leaves whose key is in `source.keys` go into `source` box by box (their checksums checked against
    `saved_sums`) and come back as IN_FILE; the others come back as arrays."""
    state_dir = Path(state_dir)
    use_ocdbt = ocp.type_handlers.is_ocdbt_checkpoint(epath.Path(state_dir))
    context = ts_utils.get_ts_context(use_ocdbt=use_ocdbt)
    zarr3 = _uses_zarr3(state_dir)
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    stores = {}
    for path, _ in flat:
        name = key_fn(path)
        info = ocp.type_handlers.ParamInfo(name=name, parent_dir=epath.Path(state_dir), is_ocdbt_checkpoint=use_ocdbt,
                                           use_zarr3=zarr3, ts_context=context)  # fmt: skip
        stores[name] = ts.open(ts.Spec(ts_utils.get_json_tspec_read(info, use_ocdbt=use_ocdbt)), open=True,
                               context=context)  # fmt: skip
    stores = {k: f.result() for k, f in stores.items()}
    leaves = []
    for path, x in flat:
        key = key_fn(path)
        if key in source.keys:
            leaves.append(IN_FILE)
            continue
        t, idx = stores[key], x.sharding.addressable_devices_indices_map(x.shape)
        reads = {d: t[i].read() for d, i in idx.items()}
        arrays = [jax.device_put(np.asarray(r.result(), x.dtype), d) for d, r in reads.items()]
        leaves.append(jax.make_array_from_single_device_arrays(x.shape, x.sharding, arrays))
    shapes = source.shapes
    sums = {k: np.zeros(2, np.uint32) for k in source.keys}
    for pieces in source.restore_pieces():
        reads = [(p, stores[p.key][_box(p)].read()) for p in pieces]
        for p, r in reads:
            p.data[...] = r.result()
            if p.primary:
                sums[p.key] += box_sums(shapes[p.key], p.start, p.data)
    got = _allsum(sums)
    bad = [k for k in sorted(got) if k in saved_sums and list(saved_sums[k]) != got[k]]
    if bad:
        raise ValueError(f"array data does not match its checksum: {', '.join(bad[:3])}")
    return jax.tree_util.tree_unflatten(treedef, leaves)
