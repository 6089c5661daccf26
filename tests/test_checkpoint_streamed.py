"""slices.SliceArrayHandler writes a save's streamed leaves only once orbax has created the save's
directories. An async save creates them in a background thread and first deletes what is already
there, so a streamed write that started before was lost (the plain leaves' writes then failed with
NOT_FOUND in the OCDBT database). Here that directory creation is made late on purpose."""

import asyncio

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint._src.path import atomicity

from meshrun.checkpoint import slices
from meshrun.checkpoint.state import Checkpointer
from meshrun.config import load_config

ROWS, COLS, CHUNK = 16, 32, 4  # each streamed leaf in 4 chunks of 4 rows


class ArraySource:
    """A `slices.Source` over numpy arrays, a chunk of rows at a time."""

    def __init__(self, arrays: dict):
        self.arrays, self.keys = arrays, frozenset(arrays)
        self.shapes = {k: a.shape for k, a in arrays.items()}
        self.zarr_chunk_bytes, self.stamp = CHUNK * COLS * 4, 0

    def save_pieces(self):
        for r in range(0, ROWS, CHUNK):
            yield [slices.Piece(k, (r, 0), (r + CHUNK, COLS), a[r : r + CHUNK]) for k, a in sorted(self.arrays.items())]

    def restore_pieces(self):
        raise NotImplementedError


@pytest.mark.parametrize("async_save", [True, False])
def test_streamed_leaves_written_after_late_directory_creation(tmp_path, monkeypatch, async_save):
    created = atomicity._create_tmp_directory  # noqa: SLF001 - the step the race was with

    async def late(*args, **kwargs):
        await asyncio.sleep(0.5)  # long after the streamed writer would have started
        return await created(*args, **kwargs)

    monkeypatch.setattr(atomicity, "_create_tmp_directory", late)
    slices.install()
    rng = np.random.default_rng(0)
    sharding = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",)), P())
    source = ArraySource({f"opt.{i}": rng.standard_normal((ROWS, COLS)).astype(np.float32) for i in range(6)})
    f32 = np.dtype(np.float32)
    state = {
        "opt": {str(i): slices.StreamedArray(f"opt.{i}", (ROWS, COLS), f32, sharding, source) for i in range(6)},
        "params": {str(i): jax.device_put(rng.standard_normal((ROWS, COLS)).astype(np.float32), sharding)
                   for i in range(3)},
    }  # fmt: skip
    cfg = load_config("configs/tiny_cpu.yaml", [f"checkpoint.async_save={async_save}"]).checkpoint
    with Checkpointer(tmp_path / "run", cfg, meta={}) as ck:
        assert ck.save(1, state, force=True)
        ck.wait()
        target = jax.tree.map(lambda _: jax.ShapeDtypeStruct((ROWS, COLS), f32, sharding=sharding), state)
        got = ck.restore(1, target)  # orbax's own restore, checksums checked
    for i in range(6):
        np.testing.assert_array_equal(np.asarray(got["opt"][str(i)]), source.arrays[f"opt.{i}"])
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(got["params"][str(i)]), np.asarray(state["params"][str(i)]))


def test_a_streamed_save_logs_no_orbax_chunk_size_warning(tmp_path, caplog):
    """The streamed leaves' zarr chunks are one row of a chunk, below orbax's 1 MiB advice: its warning
    (once per leaf, each save, even under --quiet) is dropped; its other warnings are not."""
    import logging

    from absl import logging as absl_logging

    slices.install()
    sharding = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",)), P())
    source = ArraySource({f"opt.{i}": np.full((ROWS, COLS), i, np.float32) for i in range(3)})
    f32 = np.dtype(np.float32)
    state = {"opt": {str(i): slices.StreamedArray(f"opt.{i}", (ROWS, COLS), f32, sharding, source) for i in range(3)}}
    cfg = load_config("configs/tiny_cpu.yaml", ["checkpoint.async_save=false"]).checkpoint
    with caplog.at_level(logging.WARNING), Checkpointer(tmp_path / "run", cfg, meta={}) as ck:
        assert ck.save(1, state, force=True)
        absl_logging.warning("another orbax warning")
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "target_byte_size" in m], said
    assert "another orbax warning" in said
