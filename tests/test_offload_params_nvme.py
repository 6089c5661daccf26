"""offload.params with offload.optimizer=nvme: the parameters and their gradient rest in host
memory, the stacked layers' optimizer state in the NVMe tier's file, and the update streams whole layers
through the device (meshrun/offload/param_tier.py). The run equals the same run with the state in memory
exactly (losses, params and the whole optimizer state after 3 steps, tolerance 0), the tier never holds
more host memory than its budget, and checkpoints move between the tiers exactly."""

import signal

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_offload_nvme import run
from test_reliability import one_error_line

from meshrun.checkpoint.state import Checkpointer
from meshrun.checkpoint.store import scan
from meshrun.data.datasets import global_batch_arrays, make_dataset
from meshrun.offload import directory
from meshrun.parallel.sharding import DP_AXES

OP = ["train.zero=3", "offload.params=true"]
DP8_M1 = ["mesh.pipe=1", "mesh.data=8", "mesh.tensor=1", "pipeline.microbatches=1", "model.n_layers=8"]
MB = 2**20


def nvme(path, budget_mb: float) -> list[str]:
    return ["offload.optimizer=nvme", f"offload.dir={path}", f"offload.budget_mb={budget_mb}"]


def same(got, want) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, w), g in zip(jax.tree.leaves_with_path(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(g, w, err_msg=jax.tree_util.keystr(path))


def assert_exact(config, over, reference, tmp_path, budget_mb):
    ref = run(config, [*over, *OP, f"offload.optimizer={reference}"])
    got = run(config, [*over, *OP, *nvme(tmp_path, budget_mb)])
    np.testing.assert_array_equal(got[0], ref[0])
    same(got[1], ref[1])
    return got[2]


def test_offload_params_nvme_equals_the_state_in_memory(tmp_path):
    """data 8, 8 layers, one microbatch: 8 chunks of one layer, each read and written with one call a
    step, never more than 3 chunks (the budget) held, the state 2.3x the budget."""
    ts = assert_exact("tiny_cpu.yaml", DP8_M1, "none", tmp_path, 1.5)
    f, lay = ts.tier.file, ts.tier.layout
    assert lay.per == 1 and lay.n_chunks == 8 and f.state_bytes > 2 * 1.5 * MB
    assert f.peak_resident == 3 * f.chunk_bytes <= 1.5 * MB
    assert f.bytes_read == f.bytes_written == 3 * f.state_bytes + f.state_bytes  # init / 3 steps / the read-back
    assert f.reads * f.chunk_bytes == f.bytes_read and f.writes * f.chunk_bytes == f.bytes_written
    assert f.streams == 3
    assert ts.tier.bytes_per_device() == {"host": 3 * f.chunk_bytes / 8, "nvme": f.state_bytes / 8}  # meshrun explain


def test_layer_tier_takes_its_directory_as_the_streamed_tiers_do(capsys, tmp_path):
    """The layer tier takes offload.dir with the streamed tiers' `directory.take_dir`: a missing
    one exits 2 with one line naming offload.dir, before anything is written."""
    from test_reliability import train

    status, _, err = train(capsys, tmp_path / "run", *DP8_M1, *OP, *nvme(tmp_path / "missing", 1.5))
    assert status == 2 and "offload.dir: no such directory" in one_error_line(err)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_layer_tier_tells_the_whole_state_from_its_own_by_structure(tmp_path):
    """`ParamTier.kept` tells the whole optimizer state from the tier's run state (its non-LAYER leaves
    as a tuple) by tree structure: a tuple as long as the kept leaves but of another structure is
    refused, not taken for them."""
    from meshrun.config import load_config
    from meshrun.runtime.mesh import build_mesh
    from meshrun.train.step import make_train_step

    cfg = load_config("configs/tiny_cpu.yaml", ["data.kind=synthetic", *DP8_M1, *OP, *nvme(tmp_path, 1.5)])
    tier = make_train_step(cfg, build_mesh(cfg.mesh, devices=jax.devices()[:8])).tier
    whole = tier.ts.abstract_run.opt_state
    kept = tier.kept(whole)
    assert len(kept) == len(tier.kept_def) == 8 and len(whole) == 2 and kept == tuple(tier.up.split(whole)[1])
    assert tier.kept(kept) is kept
    with pytest.raises(ValueError, match="neither"):
        tier.kept(tuple({"m": x} for x in kept))


LAYOUTS = {  # config, overrides, the in-memory tier compared with, budget (MiB)
    "data8-two-layers-a-chunk": ("tiny_cpu.yaml", DP8_M1, "none", 3.0),
    "data8-pieces-of-a-layer": ("tiny_cpu.yaml", DP8_M1, "none", 0.5),
    "data4-tensor2-m4-host": (
        "tiny_cpu.yaml", ["mesh.pipe=1", "mesh.data=4", "mesh.tensor=2", "pipeline.microbatches=4"], "host", 1.5
    ),
    "pipe2-data2-tensor2": ("tiny_cpu.yaml", [], "none", 2.5),
    "expert": ("tiny_moe_cpu.yaml", [], "none", 4.0),
    "bf16-master": (
        "tiny_cpu.yaml", [*DP8_M1, "model.param_dtype=bfloat16", "model.dtype=bfloat16"], "none", 2.5
    ),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_offload_params_nvme_layouts(name, tmp_path):
    """The same equality on more layouts: two layers a chunk, a layer cut into pieces (a budget below
    one layer's state), data 4 x tensor 2 with 4 microbatches against the host tier, a pipeline, MoE,
    and bf16 params with a float32 master."""
    config, over, reference, budget = LAYOUTS[name]
    ts = assert_exact(config, over, reference, tmp_path, budget)
    assert ts.tier.layout.n_chunks > 1 and ts.tier.file.peak_resident <= budget * MB
    if name == "data8-two-layers-a-chunk":
        assert ts.tier.layout.per == 2
    if name == "data8-pieces-of-a-layer":  # a layer's state is 1.2 MiB: each leaf cut along its first axis
        assert ts.tier.layout.split > 1 and ts.tier.layout.n_chunks == 8 * ts.tier.layout.split


def _steps(ts, cfg, mesh, state, steps):
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch)
    losses = []
    for i in steps:
        state, m = ts.step(state, *global_batch_arrays(ds, i, mesh, P(DP_AXES)))
        losses.append(float(m["loss"]))
    return state, losses


def test_offload_params_nvme_checkpoints_cross_tiers(tmp_path):
    """A checkpoint of the nvme tier (the file streamed, within the budget) restores on the in-memory
    tier and back, and training goes on from either with the same numbers (nvme -> none, none -> nvme)."""
    from test_offload_checkpoint import build

    budget = 1.5
    (tmp_path / "off").mkdir()
    over = [*DP8_M1, *OP, "train.zero=3"]
    cfg, mesh, ts = build([*over, *nvme(tmp_path / "off", budget)])
    state, _ = _steps(ts, cfg, mesh, ts.init(), range(2))
    with Checkpointer(tmp_path / "run", cfg.checkpoint, meta={}) as ck:
        assert ck.save(2, ts.to_save(state), force=True)
        ck.wait()
        assert ts.tier.file.peak_resident <= budget * MB
        whole = jax.device_get(ts.to_model(state))
        mcfg, _, mem = build(over)  # the in-memory tier
        in_memory = ck.restore(2, mem.abstract_state)
        same(jax.device_get(in_memory), whole)
        _, _, again = build([*over, *nvme(tmp_path / "off", budget)])
        restored = again.restore(ck, 2)
        same(jax.device_get(again.to_model(restored)), whole)
        on_nvme = _steps(again, cfg, mesh, restored, [2])
        on_mem = _steps(mem, mcfg, mesh, mem.to_run(in_memory), [2])
        assert on_nvme[1] == on_mem[1]
        same(jax.device_get(again.to_model(on_nvme[0])), jax.device_get(mem.to_model(on_mem[0])))
        assert ck.save(3, mem.to_model(on_mem[0]), force=True)  # the in-memory tier's checkpoint -> nvme
        ck.wait()
        same(jax.device_get(again.to_model(again.restore(ck, 3))), jax.device_get(mem.to_model(on_mem[0])))
        assert again.tier.file.peak_resident <= budget * MB


def _cli_nvme(tmp_path) -> list[str]:
    """`meshrun train` with the layers' state on NVMe: data 4 x tensor 2, 4 layers, 4 chunks a step."""
    return [*OP, *nvme(tmp_path, 1.5)]


@pytest.mark.slow
@pytest.mark.serial
def test_offload_params_nvme_sigkill_mid_swap_out_then_rerun(tmp_path):
    """SIGKILL while step 3 writes its layers' state back (the middle chunk of 4): the rerun resumes from
    checkpoint 2 and ends on the uninterrupted run's final loss exactly; the killed run's file is
    cleared when the rerun takes the directory."""
    from test_offload_nvme import _cli, _final_loss

    over = _cli_nvme(tmp_path)
    ref = _cli(tmp_path / "ref", *over)
    assert ref.returncode == 0, ref.stderr[-2000:]
    killed = _cli(tmp_path / "k", *over, MESHRUN_FAULT_OFFLOAD_KILL="3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert [e.step for e in scan(tmp_path / "k") if e.status == "complete"] == [2]
    assert len(list(tmp_path.glob(directory.DATA_GLOB))) == 1  # the killed run's half-written file
    rerun = _cli(tmp_path / "k", *over)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert _final_loss(tmp_path / "k") == _final_loss(tmp_path / "ref")
    assert not list(tmp_path.glob(directory.DATA_GLOB))


@pytest.mark.serial
def test_offload_params_nvme_full_disk_mid_swap_exit_4(tmp_path):
    """ENOSPC while step 3 writes its layers' state back: one line naming the directory, exit 4, and
    checkpoint 2 intact (complete, and the rerun resumes from it to the last step)."""
    from test_offload_nvme import _cli
    from test_reliability import metrics_steps

    r = _cli(tmp_path / "run", *_cli_nvme(tmp_path), MESHRUN_FAULT_OFFLOAD_ENOSPC="3")
    assert r.returncode == 4, r.stderr[-2000:]
    line = one_error_line(r.stderr)
    assert str(tmp_path) in line and "No space left on device" in line
    assert [(e.step, e.status) for e in scan(tmp_path / "run")] == [(2, "complete")]
    rerun = _cli(tmp_path / "run", *_cli_nvme(tmp_path))
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert metrics_steps(tmp_path / "run")[-2:] == [3, 4]
