"""offload.update_on: the streamed tier's chunk update on the devices (the copy path, a GPU's)
or on jax's CPU backend (`offload/host_update.py`) equals the in-memory run exactly: losses, params and
the whole optimizer state after 3 steps, tolerance 0, with the clip active; bad values exit 2."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_offload_checkpoint import assert_same
from test_reliability import one_error_line

from meshrun.cli.main import main
from meshrun.config import load_config
from meshrun.data.datasets import global_batch_arrays, make_dataset
from meshrun.offload.optimizer_tier import UPDATES
from meshrun.parallel.sharding import DP_AXES
from meshrun.runtime.mesh import build_mesh
from meshrun.train.step import make_train_step

SMALL = ["train.seq_len=16", "model.max_seq_len=16", "data.kind=synthetic", "train.global_batch=16",
         "optimizer.lr=0.01", "optimizer.warmup_steps=1", "optimizer.grad_clip=0.5"]  # fmt: skip
LAYOUTS = {
    "data8": ["mesh.data=8", "mesh.pipe=1", "mesh.tensor=1", "pipeline.microbatches=2", "train.zero=1"],
    "data4-tensor2": ["mesh.data=4", "mesh.pipe=1", "mesh.tensor=2", "train.zero=0"],
}


def run(over, n_devices=8, steps=3):
    cfg = load_config("configs/tiny_cpu.yaml", [*SMALL, *over])
    mesh = build_mesh(cfg.mesh, devices=jax.devices()[:n_devices])
    ts = make_train_step(cfg, mesh)
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch)
    state, losses, norms = ts.init(), [], []
    for i in range(steps):
        state, metrics = ts.step(state, *global_batch_arrays(ds, i, mesh, P(DP_AXES)))
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return np.array(losses), jax.device_get(ts.to_model(state)), ts, norms


def tier_over(tier, tmp_path):
    over = [f"offload.optimizer={tier}", "offload.budget_mb=0.5"]
    return [*over, f"offload.dir={tmp_path}"] if tier == "nvme" else over


def assert_exact(layout, tier, on, tmp_path):
    ref = run(LAYOUTS[layout])
    assert min(ref[3]) > 0.5  # the clip is active in every step
    got = run([*LAYOUTS[layout], *tier_over(tier, tmp_path), f"offload.update_on={on}"])
    np.testing.assert_array_equal(got[0], ref[0])
    assert_same(got[1], ref[1])  # params and the whole optimizer state (read back from the store)
    return got[2].tier


@pytest.mark.slow
@pytest.mark.parametrize("on", ["device", "host"])
@pytest.mark.parametrize("tier", ["nvme", "host"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_update_on_equals_in_memory(layout, tier, on, tmp_path):
    t = assert_exact(layout, tier, on, tmp_path)
    assert type(t.update) is UPDATES[on]  # not the in-place update of the CPU devices' own buffers
    assert t.layout.n_chunks >= 3 and t.file.peak_resident <= 0.5 * 2**20


def test_host_update_runs_on_the_cpu_backend_in_place(tmp_path):
    """data 4 x tensor 2, nvme: the update ran on the CPU backend's device (one the mesh of 4 devices
    leaves out), one call per chunk and step, each writing the new state into the ring buffer the
    store read the chunk into; the result equals the in-memory run exactly (the test above, here on 4
    devices, ZeRO-0: rows replicated over data, fetched once)."""
    over = ["mesh.data=2", "mesh.pipe=1", "mesh.tensor=2", "train.zero=0", "pipeline.microbatches=2"]
    ref = run(over, n_devices=4)
    cfg = load_config("configs/tiny_cpu.yaml", [*SMALL, *over, *tier_over("nvme", tmp_path),
                                                "offload.update_on=host"])  # fmt: skip
    mesh = build_mesh(cfg.mesh, devices=jax.devices()[:4])
    ts = make_train_step(cfg, mesh)
    host = ts.tier.update.host
    assert host.cpu not in set(mesh.devices.flat) and host.cpu.platform == "cpu"
    calls, update = [], host.update

    def spy(g, p, slots, *rest):
        before = [h.unsafe_buffer_pointer() for s in slots for h in s]
        out = update(g, p, slots, *rest)
        after = [h.unsafe_buffer_pointer() for s in out[0] for h in s]
        calls.append((before == after, {x.device for s in out[0] for x in s}, [x.device for x in g]))
        return out

    host.update = spy
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch)
    state, losses = ts.init(), []
    for i in range(3):
        state, metrics = ts.step(state, *global_batch_arrays(ds, i, mesh, P(DP_AXES)))
        losses.append(float(metrics["loss"]))
    assert len(calls) == 3 * ts.tier.layout.n_chunks >= 9
    assert all(aliased and devs == {host.cpu} and set(g) == {host.cpu} for aliased, devs, g in calls)
    assert len(calls[0][2]) == len(ts.tier.layout.first) == 2  # one gradient row per distinct local row
    np.testing.assert_array_equal(np.array(losses), ref[0])
    assert_same(jax.device_get(ts.to_model(state)), ref[1])


@pytest.mark.parametrize(
    ("over", "what"),
    [
        (["offload.update_on=gpu"], "offload.update_on: invalid value"),
        (["offload.update_on=host"], "no optimizer tier"),
        (["offload.optimizer=host", "offload.update=whole", "offload.update_on=host"], "whole"),
        (["offload.optimizer=host", "optimizer.name=muon", "offload.update_on=device"], "not elementwise"),
    ],
)
def test_bad_offload_update_on_exits_2(capsys, tmp_path, over, what):
    status = main(["train", "configs/tiny_cpu.yaml", f"train.run_dir={tmp_path}", *over])
    line = one_error_line(capsys.readouterr().err)
    assert status == 2 and line.startswith("meshrun train: error: offload.update_on") and what in line, line
    assert not (tmp_path / "checkpoints").exists()


def test_host_without_the_cpu_backend_is_a_config_error(monkeypatch):
    """JAX_PLATFORMS without cpu (e.g. cuda alone): host names the field and the fix instead of jax's error."""
    from meshrun.errors import ConfigError
    from meshrun.offload import host_update

    def no_cpu(backend=None):
        raise RuntimeError(f"Unknown backend {backend}")

    monkeypatch.setattr(jax, "local_devices", no_cpu)
    with pytest.raises(ConfigError, match=r"offload.update_on: jax.s CPU backend is not available .*JAX_PLATFORMS"):
        host_update.cpu_device(jax.devices())
