"""offload.optimizer=nvme: init, checkpoint save and restore stream the optimizer state chunk by
chunk (never more than the tier's budget resident, counted by the tier), and the checkpoint is an
ordinary orbax one: the in-memory tier restores it exactly, and the tier restores an in-memory
tier's checkpoint exactly."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshrun.checkpoint.state import Checkpointer
from meshrun.config import load_config
from meshrun.data.datasets import global_batch_arrays, make_dataset
from meshrun.parallel.sharding import DP_AXES
from meshrun.runtime.mesh import build_mesh
from meshrun.train.step import make_train_step

SMALL = ["train.seq_len=16", "model.max_seq_len=16", "data.kind=synthetic", "train.global_batch=16",
         "optimizer.lr=0.01", "optimizer.warmup_steps=1", "train.zero=0"]  # fmt: skip
BUDGET_MB = 0.5


def build(over):
    cfg = load_config("configs/tiny_cpu.yaml", [*SMALL, *over])
    mesh = build_mesh(cfg.mesh, devices=jax.devices()[:8])
    return cfg, mesh, make_train_step(cfg, mesh)


def assert_same(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, w), g in zip(jax.tree.leaves_with_path(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(g, w, err_msg=jax.tree_util.keystr(path))


def test_a_chunk_meets_the_runs_a_walk_over_every_run_finds():
    """`checkpoint_io.Runs.within` (bisection on the runs' offsets) gives each chunk of a layer-major row (3
    leaves, 6 layers cut in 2 pieces padded to 24 elements, chunks not aligned to the pieces) the runs,
    in row order, that walking every run of the row and keeping those the chunk overlaps gives."""
    from meshrun.offload.checkpoint_io import Runs
    from meshrun.offload.layer_layout import LayerLayout

    shapes, split, row = ((6, 4, 3), (6, 4), (6, 8, 2)), 2, 24  # a piece: 6 + 2 + 8 elements, 8 of padding
    lay = LayerLayout(None, (), shapes, (0, 6, 8), 288, 288, 10, (), (), (), layers=6, split=split, row=row)
    runs, n = Runs(lay.segments), 0
    for chunk in (1, 7, 10, 24, 40, 288):
        for c0 in range(0, lay.length, chunk):
            c1 = c0 + chunk
            want = [r for r in lay.segments if max(r[2], c0) < min(r[2] + r[3], c1)]
            assert runs.within(c0, c1) == want, (chunk, c0)
            n += len(want)
    assert n > len(lay.segments) * 6


def test_nvme_init_save_restore_stream_within_budget_and_cross_tier(tmp_path):
    """data 2 x pipe 2 x tensor 2, ZeRO-0 (the optimizer state replicated over data: each element is
    written once, every replica's row is filled on restore)."""
    (tmp_path / "off").mkdir()
    nvme = ["offload.optimizer=nvme", f"offload.dir={tmp_path / 'off'}",
            f"offload.budget_mb={BUDGET_MB}"]  # fmt: skip
    cfg, mesh, ts = build(nvme)
    state = ts.init()
    f = ts.tier.file
    assert f.n_chunks >= 4 and f.state_bytes >= 4 * BUDGET_MB * 2**20
    assert f.peak_resident <= BUDGET_MB * 2**20 and f.bytes_written == f.state_bytes and f.bytes_read == 0
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch)
    for i in range(2):
        state, _ = ts.step(state, *global_batch_arrays(ds, i, mesh, P(DP_AXES)))
    with Checkpointer(tmp_path / "run", cfg.checkpoint, meta={}) as ck:
        read = f.bytes_read
        assert ck.save(2, ts.to_save(state), force=True)
        ck.wait()
        assert f.bytes_read - read == 2 * f.state_bytes  # the checksums' pass, then the write's
        assert f.peak_resident <= BUDGET_MB * 2**20
        whole = jax.device_get(ts.to_model(state))  # the state read back whole from the file
        _, _, mem = build([])
        in_memory = jax.device_get(ck.restore(2, mem.abstract_state))  # orbax's own restore
        assert_same(in_memory, whole)
        _, _, again = build(nvme)
        restored = again.restore(ck, 2)
        g = again.tier.file
        assert g.peak_resident <= BUDGET_MB * 2**20 and g.bytes_written == g.state_bytes
        assert_same(jax.device_get(again.to_model(restored)), whole)
        placed = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), in_memory, mem.abstract_state)
        assert ck.save(3, placed, force=True)  # the in-memory tier's checkpoint -> nvme
        ck.wait()
        assert_same(jax.device_get(again.to_model(again.restore(ck, 3))), whole)


RELAID = {
    "uneven": ["train.zero=3", "pipeline.layers_per_stage=[3,1]"],
    "interleaved": ["pipeline.schedule=interleaved", "pipeline.virtual=2", "mesh.tensor=1", "mesh.data=2",
                    "mesh.pipe=2", "mesh.context=2", "model.n_layers=8", "train.zero=1"],
}  # fmt: skip


@pytest.mark.parametrize("name", [pytest.param("uneven"), pytest.param("interleaved", marks=pytest.mark.slow)])
def test_relaid_pipelines_save_and_restore_chunk_by_chunk(name, tmp_path):
    """Pipelines whose layers run in another order than the checkpoint keeps them (uneven: padded;
    interleaved: chunk order): the save and the restore stream the file's chunks, each layer's piece
    moved to its model-order index, within the budget; orbax's plain restore equals the state read
    back whole, and so does the tier's own restore."""
    (tmp_path / "off").mkdir()
    nvme = ["offload.optimizer=nvme", f"offload.dir={tmp_path / 'off'}",
            f"offload.budget_mb={BUDGET_MB}", *RELAID[name]]  # fmt: skip
    cfg, mesh, ts = build(nvme)
    assert ts.plan.relaid
    state = ts.init()
    f = ts.tier.file
    assert f.n_chunks >= 3
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch)
    state, _ = ts.step(state, *global_batch_arrays(ds, 0, mesh, P(DP_AXES)))
    with Checkpointer(tmp_path / "run", cfg.checkpoint, meta={}) as ck:
        read = f.bytes_read
        assert ck.save(1, ts.to_save(state), force=True)
        ck.wait()
        assert f.bytes_read - read == 2 * f.state_bytes and f.peak_resident <= BUDGET_MB * 2**20  # chunk by chunk
        whole = jax.device_get(ts.to_model(state))
        _, _, mem = build(RELAID[name])
        assert_same(jax.device_get(ck.restore(1, mem.abstract_state)), whole)  # orbax's own restore
        _, _, again = build(nvme)
        restored = again.restore(ck, 1)
        g = again.tier.file
        assert g.bytes_written == g.state_bytes and g.bytes_read == 0 and g.peak_resident <= BUDGET_MB * 2**20
        assert_same(jax.device_get(again.to_model(restored)), whole)


def test_local_tier_streams_the_nvme_state_within_budget(tmp_path):
    """The local checkpoint tier (checkpoint.local_every) saves and restores the nvme tier's state one
    file chunk at a time: the save reads the file once, within the tier's budget, and copies only the
    params and counters to host memory (the state, 4x the budget, is written box by box from the
    tier's buffers); the restore writes the file once, within the budget, and builds only the params
    and counters in memory; the round trip gives back the state bit for bit; and the local steps
    cross tiers both ways (the in-memory tier assembles its shards from the nvme tier's boxes, the
    nvme tier cuts its boxes from the in-memory tier's shards)."""
    from meshrun.checkpoint.local import LocalTier

    (tmp_path / "off").mkdir()
    budget = BUDGET_MB * 2**20
    nvme = ["offload.optimizer=nvme", f"offload.dir={tmp_path / 'off'}",
            f"offload.budget_mb={BUDGET_MB}", "checkpoint.local_every=1",
            f"checkpoint.local_dir={tmp_path / 'local'}"]  # fmt: skip
    cfg, mesh, ts = build(nvme)
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch)
    state = ts.init()
    for i in range(2):
        state, _ = ts.step(state, *global_batch_arrays(ds, i, mesh, P(DP_AXES)))
    f = ts.tier.file
    assert f.state_bytes >= 4 * budget
    local = LocalTier(cfg.checkpoint, str(tmp_path / "run"), meta={})
    read = f.bytes_read
    local.save(2, ts.to_save(state))
    assert local.wait() is None and local.last[0] == 2
    assert f.bytes_read - read == f.state_bytes and f.peak_resident <= budget
    n_params = sum(x.size for x in jax.tree.leaves(state.params))  # float32: one copy over pipe x tensor
    params = local.host_bytes
    assert 4 * n_params <= params < 4 * n_params + 1024  # + the step counters
    assert local.last[1] == params + 2 * 4 * n_params  # the data file: the copies, Adam's m and v once each
    whole = jax.device_get(ts.to_model(state))

    _, _, again = build(nvme)
    restored = again.restore(local, 2)
    g = again.tier.file
    assert g.bytes_written == g.state_bytes and g.peak_resident <= budget and local.restored_bytes == params
    assert_same(jax.device_get(again.to_model(restored)), whole)

    _, _, mem = build([])
    in_memory = local.restore(2, mem.abstract_state)  # the nvme tier's boxes -> the in-memory tier's shards
    assert_same(jax.device_get(in_memory), whole)
    local.save(3, in_memory)  # the in-memory tier's shards -> the nvme tier's boxes
    assert local.wait() is None
    assert_same(jax.device_get(again.to_model(again.restore(local, 3))), whole)
