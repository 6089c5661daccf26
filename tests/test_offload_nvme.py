"""train.offload_optimizer=nvme: the streamed update equals the in-memory step exactly (losses and
params after several steps, tolerance 0) on every layout kind, and the tier holds no more host
memory than its budget."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshrun.config import load_config
from meshrun.data.datasets import global_batch_arrays, make_dataset
from meshrun.parallel.sharding import DP_AXES
from meshrun.runtime.mesh import build_mesh
from meshrun.train.step import make_train_step

SMALL = ["train.seq_len=16", "model.max_seq_len=16", "data.kind=synthetic", "train.global_batch=16",
         "optimizer.lr=0.01", "optimizer.warmup_steps=1"]  # fmt: skip
BUDGET = "train.offload_budget_mb=0.5"  # several chunks per step on the tiny models


def run(config, over, steps=3):
    cfg = load_config(f"configs/{config}", [*SMALL, *over])
    mesh = build_mesh(cfg.mesh, devices=jax.devices()[:8])
    ts = make_train_step(cfg, mesh)
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch)
    state, losses = ts.init(), []
    for i in range(steps):
        state, metrics = ts.step(state, *global_batch_arrays(ds, i, mesh, P(DP_AXES)))
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(ts.to_model(state)), ts


def assert_exact(config, over, tmp_path, steps=3):
    ref = run(config, over, steps)
    got = run(config, [*over, "train.offload_optimizer=nvme", f"train.offload_dir={tmp_path}", BUDGET], steps)
    np.testing.assert_array_equal(got[0], ref[0])
    leaves = jax.tree.leaves_with_path(ref[1])
    assert jax.tree.structure(got[1]) == jax.tree.structure(ref[1])
    for (path, r), g in zip(leaves, jax.tree.leaves(got[1]), strict=True):
        np.testing.assert_array_equal(g, r, err_msg=jax.tree_util.keystr(path))
    return got[2]


def test_nvme_equals_in_memory_data_pipe_tensor(tmp_path):
    """data 2 x pipe 2 x tensor 2, ZeRO-1: losses, params and the whole optimizer state (read back from
    the files) equal the in-memory step's bit for bit after 3 steps; the update ran in several chunks
    and the tier never held more host memory than its budget."""
    ts = assert_exact("tiny_cpu.yaml", ["train.zero=1"], tmp_path)
    f = ts.tier.file
    assert ts.tier.layout.n_chunks >= 3
    assert f.peak_resident <= 0.5 * 2**20
    assert f.bytes_read == f.bytes_written == 3 * f.state_bytes + f.state_bytes  # 3 steps + the read-back


LAYOUTS = {
    "data8-zero0": ("tiny_cpu.yaml", ["mesh.data=8", "mesh.pipe=1", "mesh.tensor=1", "pipeline.microbatches=2"]),
    "data4-tensor2-zero2": ("tiny_cpu.yaml", ["mesh.data=4", "mesh.pipe=1", "train.zero=2"]),
    "pipe2-data2-tensor2-zero3-uneven": ("tiny_cpu.yaml", ["train.zero=3", "pipeline.layers_per_stage=[3,1]"]),
    "interleaved": (
        "tiny_cpu.yaml",
        [
            "pipeline.schedule=interleaved",
            "pipeline.virtual=2",
            "mesh.tensor=1",
            "mesh.data=2",
            "mesh.pipe=2",
            "mesh.context=2",
            "model.n_layers=8",
        ],
    ),
    "expert": ("tiny_moe_cpu.yaml", ["train.zero=1"]),
    "context": ("tiny_cpu.yaml", ["mesh.data=2", "mesh.pipe=1", "mesh.tensor=2", "mesh.context=2", "train.zero=1"]),
    "bf16-master": (
        "tiny_cpu.yaml",
        ["model.param_dtype=bfloat16", "model.dtype=bfloat16", "mesh.pipe=1", "mesh.data=4", "train.zero=1"],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_nvme_equals_in_memory_layouts(name, tmp_path):
    config, over = LAYOUTS[name]
    assert_exact(config, over, tmp_path)
