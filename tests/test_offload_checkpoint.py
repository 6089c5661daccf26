"""train.offload_optimizer=nvme: init, checkpoint save and restore stream the optimizer state chunk by
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


def test_nvme_init_save_restore_stream_within_budget_and_cross_tier(tmp_path):
    """data 2 x pipe 2 x tensor 2, ZeRO-0 (the optimizer state replicated over data: each element is
    written once, every replica's row is filled on restore)."""
    (tmp_path / "off").mkdir()
    nvme = ["train.offload_optimizer=nvme", f"train.offload_dir={tmp_path / 'off'}",
            f"train.offload_budget_mb={BUDGET_MB}"]  # fmt: skip
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
    nvme = ["train.offload_optimizer=nvme", f"train.offload_dir={tmp_path / 'off'}",
            f"train.offload_budget_mb={BUDGET_MB}", *RELAID[name]]  # fmt: skip
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
