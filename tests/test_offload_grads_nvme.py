"""offload.grads=nvme (with offload.params and the nvme tier): each layer's reduced float32
gradient goes from the backward to the tier's file, and the streamed update reads it there with the
layer's optimizer state (meshrun/offload/grad_file.py). The run equals the same run with everything
in memory exactly (losses, params and the whole optimizer state after 3 steps, tolerance 0), no
host-resident gradient exists, and the sink holds no more than a few layers' blocks at a time."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_offload_nvme import run
from test_offload_params_nvme import DP8_M1, MB, OP, nvme, same

from meshrun.cli.main import main
from meshrun.config import offload_params_refusals
from meshrun.data.datasets import global_batch_arrays, make_dataset
from meshrun.parallel.sharding import DP_AXES

GRADS = ["offload.grads=nvme"]
DP4_TP2_M1 = ["mesh.pipe=1", "mesh.data=4", "mesh.tensor=2", "pipeline.microbatches=1"]
BF16 = [*DP8_M1, "model.param_dtype=bfloat16", "model.dtype=bfloat16"]


def assert_exact(over, tmp_path, budget_mb, config="tiny_cpu.yaml"):
    """The run with the gradient on NVMe equals the in-memory run (offload_params, state on the device)."""
    ref = run(config, [*over, *OP, "offload.optimizer=none"])
    got = run(config, [*over, *OP, *nvme(tmp_path, budget_mb), *GRADS])
    np.testing.assert_array_equal(got[0], ref[0])
    same(got[1], ref[1])
    return got[2]


def check_resident(ts, budget_mb: float) -> None:
    """The tier's host memory: its chunk buffers (state and gradient rows) within the budget, and of the
    gradient only the blocks being written (one leaf of one layer per local device at most)."""
    tier, lay = ts.tier, ts.tier.layout
    f, sink = tier.file, tier.sink
    assert f.peak_resident <= budget_mb * MB and f.chunk[0] == tier.n_slots + 1
    block = max(4 * lay.sizes[j] * lay.split for j in range(len(lay.shapes)))  # one leaf of one layer
    assert 0 < sink.peak_resident <= len(lay.local) * block
    grad_bytes = f.n_chunks * f.chunk_bytes // f.chunk[0]  # the gradient slot of every chunk
    assert sink.peak_resident < grad_bytes / 4
    per_step = lay.layers * sum(4 * int(np.prod(s[1:])) for s in lay.shapes) * len(lay.first)  # every distinct row
    assert sink.bytes_written == 3 * per_step


def test_offload_grads_nvme_equals_in_memory(tmp_path):
    """data 8, 8 layers, one microbatch: bit for bit; each step writes the gradient once (every layer
    of every distinct row) and reads it once with the state."""
    ts = assert_exact(DP8_M1, tmp_path, 2.0)
    check_resident(ts, 2.0)
    f = ts.tier.file
    assert f.bytes_read == 3 * f.n_chunks * f.chunk_bytes + f.n_chunks * f.chunk_bytes  # 3 steps, the read-back
    assert ts.tier.bytes_per_device()["nvme"] == f.n_chunks * f.chunk_bytes / 8


@pytest.mark.slow
def test_offload_grads_nvme_keeps_no_gradient_in_memory(tmp_path):
    """The device part's outputs hold no gradient: their bytes are the other entries' params and state,
    the norm and the metrics; with the gradient in host memory they hold the layers' float32 gradient."""
    outs = {}
    for name, extra in (("host", []), ("nvme", GRADS)):
        d = tmp_path / name
        d.mkdir()
        _, _, ts = run("tiny_cpu.yaml", [*DP8_M1, *OP, *nvme(d, 2.0), *extra], steps=1)
        cfg = ts.plan.cfg
        t = cfg.train
        ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=t.seq_len, global_batch=t.global_batch)
        batch = global_batch_arrays(ds, 0, ts.plan.zero.mesh, P(DP_AXES))
        compiled = ts.step.lower(ts.init(), *batch).compile()
        outs[name] = compiled.memory_analysis().output_size_in_bytes
    layers = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(ts.abstract_run.params["layers"])) * 4 // 8
    assert outs["host"] - outs["nvme"] >= layers


@pytest.mark.slow
@pytest.mark.parametrize("name", ["data4-tensor2", "pieces-of-a-layer", "bf16-master"])
def test_offload_grads_nvme_layouts(name, tmp_path):
    """The same equality on data 4 x tensor 2 (the tensor axis auto inside the loop), a layer cut into
    pieces (its gradient written piece by piece), and bf16 params with a float32 master."""
    over, budget = {"data4-tensor2": (DP4_TP2_M1, 2.0), "pieces-of-a-layer": (DP8_M1, 0.6),
                    "bf16-master": (BF16, 2.5)}[name]  # fmt: skip
    ts = assert_exact(over, tmp_path, budget)
    check_resident(ts, budget)
    if name == "pieces-of-a-layer":
        assert ts.tier.layout.split > 1


@pytest.mark.parametrize(
    "over, what",
    [
        (["pipeline.microbatches=4", "mesh.pipe=1", "mesh.data=4", "mesh.tensor=2"], "one microbatch"),
        (["offload.optimizer=host"], "needs the nvme tier"),
    ],
)
def test_offload_grads_nvme_refusals(over, what, tmp_path, capsys):
    """Several microbatches, or the state not on NVMe: exit 2 with one line before compiling; the same
    rules (and the pipeline's) the planner asks."""
    argv = ["train", "configs/tiny_cpu.yaml", *OP, *nvme(tmp_path, 2.0), *over, *GRADS, "train.steps=1",
            f"train.run_dir={tmp_path / 'run'}"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert what in err and "offload.grads" in err and err.count("\n") == 1 and "Traceback" not in err
    kw = dict(fp8="none", offload_grads="nvme")
    assert offload_params_refusals(3, "nvme", **kw, pipe=1, microbatches=1) == []
    assert offload_params_refusals(3, "host", **kw, pipe=1, microbatches=1)
    assert offload_params_refusals(3, "nvme", **kw, pipe=1, microbatches=2)
    assert "without a pipeline only" in offload_params_refusals(3, "nvme", **kw, pipe=2, microbatches=1)[0][0]
