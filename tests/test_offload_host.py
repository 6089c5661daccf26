"""offload.optimizer=host: the update streams chunk by chunk through the device, as the nvme
tier's does (the chunks come from host memory, `chunk_store.HostStore`), and equals the in-memory step and
the whole-shard update (offload.update=whole) exactly: losses and params after 3 steps,
tolerance 0. The device holds a few chunks of the state, never the whole shard (compiled bytes), and
checkpoints are the other tiers' orbax ones (host -> none, host -> nvme, host -> whole)."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_offload_checkpoint import assert_same, build
from test_offload_nvme import LAYOUTS, run

from meshrun.analysis.memory import memory_spaces
from meshrun.checkpoint.state import Checkpointer
from meshrun.cli.main import main
from meshrun.data.datasets import global_batch_arrays, make_dataset
from meshrun.offload import chunk_store
from meshrun.parallel.sharding import DP_AXES

BUDGET_MB = 0.5
HOST = ["offload.optimizer=host", f"offload.budget_mb={BUDGET_MB}"]
WHOLE = ["offload.optimizer=host", "offload.update=whole"]


def assert_three_equal(config, over):
    """none, host (streamed) and host (whole shard): the same losses and params, bit for bit."""
    ref = run(config, over)
    got = run(config, [*over, *HOST])
    whole = run(config, [*over, *WHOLE])
    for other in (got, whole):
        np.testing.assert_array_equal(other[0], ref[0])
        assert_same(other[1], ref[1])
    return got[2], whole[2]


def test_host_streamed_equals_none_and_whole_shard():
    """data 2 x pipe 2 x tensor 2, ZeRO-1: the host tier's update ran in several chunks from host
    memory (no file), within its budget, and equals both other updates exactly."""
    ts, whole = assert_three_equal("tiny_cpu.yaml", ["train.zero=1"])
    f = ts.tier.file
    assert isinstance(f, chunk_store.HostStore) and ts.tier.directory is None
    assert ts.tier.layout.n_chunks >= 3 and f.peak_resident <= BUDGET_MB * 2**20
    assert f.streams == 3 and f.bytes_read == f.bytes_written == 4 * f.state_bytes  # 3 steps + the read-back
    assert whole.tier is None  # the whole-shard update: one jitted step, the state in pinned host memory


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_host_streamed_equals_none_and_whole_shard_layouts(name):
    config, over = LAYOUTS[name]
    assert_three_equal(config, over)


def _opt_bytes(ts) -> int:
    """One device's bytes of the optimizer state's parameter-shaped leaves."""
    sh = jax.tree.leaves(ts.state_shardings.opt_state, is_leaf=lambda x: isinstance(x, NamedSharding))
    return sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
               for a, s in zip(jax.tree.leaves(ts.abstract_run.opt_state), sh, strict=True) if a.ndim)  # fmt: skip


def test_streamed_update_holds_chunks_not_the_shard_on_the_device():
    """Compiled bytes per device (memory_analysis, split by memory space). The whole-shard update
    passes the whole state shard through its one program (XLA:CPU keeps it in host memory; a GPU
    brings it to the device for the update). The streamed update's programs: the device part (forward,
    backward, the flat rows) takes and gives no optimizer state (its flat rows land in the last
    step's, donated); the chunk update's state arguments are one chunk of every slot, a sixth of the
    budget."""
    over = ["mesh.data=8", "mesh.pipe=1", "mesh.tensor=1", "train.zero=1", "pipeline.microbatches=2"]
    cfg, mesh, whole = build([*over, *WHOLE])
    _, _, ts = build([*over, *HOST])
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch)
    batch = global_batch_arrays(ds, 0, mesh, P(DP_AXES))
    state = _opt_bytes(whole)
    w = memory_spaces(whole.step.lower(whole.abstract_run, *batch).compile())
    assert w["host_argument"] == state  # the whole shard, in one program
    compiled = ts.step.lower(ts.abstract_run, *batch).compile()  # the device part
    d, tier = memory_spaces(compiled), ts.tier
    # params, batch and the spare flat rows it writes its own into (donated: aliased with its outputs)
    spare = sum(tier.layout.length * dt.itemsize for dt in tier.row_dtypes)
    assert compiled.memory_analysis().alias_size_in_bytes == spare
    assert d["host"] == 0 and d["device_argument"] - spare <= w["device_argument"]
    lay, slots = tier.layout, tier.pattern.n_slots
    row = lambda n, dt=jnp.float32: jax.ShapeDtypeStruct(lay.shape(n), dt, sharding=lay.sharding)
    scalar = lambda dt: jax.ShapeDtypeStruct((), dt, sharding=NamedSharding(mesh, P()))
    _, scalars = tier.pattern.split(jax.tree.leaves(ts.abstract_run.opt_state))
    args = (row(lay.length), row(lay.length, tier.param_dtypes[0]), (row(lay.chunk),) * slots, tuple(scalars),
            scalar(jnp.float32), scalar(jnp.int32))  # fmt: skip
    c = memory_spaces(tier.chunk_part.lower(*args).compile())
    flat_rows = 2 * lay.length * 4  # the gradient and param rows (float32 params)
    chunk = slots * lay.chunk * 4
    scalar_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in scalars)
    assert c["host"] == 0 and c["device_argument"] == flat_rows + chunk + scalar_bytes + 8
    assert 3 * chunk <= BUDGET_MB * 2**20 and lay.n_chunks * chunk >= state  # one chunk of many


@pytest.mark.slow
def test_host_checkpoint_resumes_on_none_nvme_and_whole(tmp_path):
    """data 2 x pipe 2 x tensor 2, ZeRO-0: init and the save stream chunk by chunk within the budget;
    the checkpoint restores exactly on the in-memory tier (orbax's own path), on nvme and on the
    whole-shard host update, and one more step from it gives the same loss on all of them."""
    (tmp_path / "off").mkdir()
    cfg, mesh, ts = build(HOST)
    state = ts.init()
    f = ts.tier.file
    assert f.n_chunks >= 4 and f.peak_resident <= BUDGET_MB * 2**20 and f.bytes_written == f.state_bytes
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch)
    batches = [global_batch_arrays(ds, i, mesh, P(DP_AXES)) for i in range(3)]
    for b in batches[:2]:
        state, _ = ts.step(state, *b)
    with Checkpointer(tmp_path / "run", cfg.checkpoint, meta={}) as ck:
        assert ck.save(2, ts.to_save(state), force=True)
        ck.wait()
        assert f.peak_resident <= BUDGET_MB * 2**20
        want = jax.device_get(ts.to_model(state))
        _, _, mem = build([])
        _, _, nvme = build(["offload.optimizer=nvme", f"offload.dir={tmp_path / 'off'}",
                            f"offload.budget_mb={BUDGET_MB}"])  # fmt: skip
        _, _, whole = build(WHOLE)
        resumed = {
            "none": mem.to_run(ck.restore(2, mem.abstract_state)),
            "nvme": nvme.restore(ck, 2),
            "whole": whole.to_run(ck.restore(2, whole.abstract_state)),
            "host": ts.restore(ck, 2),
        }
        steps = {"none": mem, "nvme": nvme, "whole": whole, "host": ts}
        losses = {}
        for k, st in resumed.items():
            assert_same(jax.device_get(steps[k].to_model(st)), want)
            losses[k] = float(steps[k].step(st, *batches[2])[1]["loss"])
        assert len(set(losses.values())) == 1, losses


def test_offload_update_needs_the_host_tier(capsys):
    assert main(["train", "configs/tiny_cpu.yaml", "offload.update=whole"]) == 2
    err = capsys.readouterr().err
    assert "offload.update" in err and "offload.optimizer=host" in err and "Traceback" not in err
    over = ["offload.optimizer=host", "offload.update=streamed", "optimizer.name=muon"]
    assert main(["train", "configs/tiny_cpu.yaml", *over]) == 2
    err = capsys.readouterr().err
    assert "offload.update" in err and "not elementwise" in err and "Traceback" not in err


def test_explain_and_run_header_report_each_tier_where_it_rests(tmp_path, capsys):
    """`meshrun explain` and the run header put the host tier's state in host memory and the nvme
    tier's in NVMe files (not host memory): predicted, the state's bytes; compiled, the tier's own
    count (its store per device, plus its chunk buffers in host memory), since the state is no
    argument of the compiled device part."""
    from meshrun.report.startup import startup_lines

    over = ["train.zero=1", "train.seq_len=16", "model.max_seq_len=16", "train.global_batch=16"]
    tiers = {"host": [], "nvme": [f"offload.dir={tmp_path}"]}
    for tier, extra in tiers.items():
        cfg, mesh, ts = build([*over, f"offload.optimizer={tier}", *extra])
        store, lay = ts.tier.ensure_file(), ts.tier.layout
        n = len(lay.local)
        state, buffers = store.state_bytes / n, chunk_store.SLOTS_IN_FLIGHT * store.chunk_bytes / n
        assert main(["explain", "configs/tiny_cpu.yaml", *over, f"offload.optimizer={tier}", *extra,
                     "--json"]) == 0  # fmt: skip
        mem = json.loads(capsys.readouterr().out)["memory"]
        pm, cm = mem["predicted"], mem["compiled"]
        where, other = ("host", "nvme") if tier == "host" else ("nvme", "host")
        # the store pads each row to whole chunks (multiples of 1024 elements): 2% here
        assert pm[where] > 0 and pm[other] == 0 and pm[where] == pytest.approx(state, rel=0.05)
        assert cm[where] == (state + buffers if tier == "host" else state)
        assert cm[other] == (0 if tier == "host" else buffers)
        assert cm["device"] + cm["host"] + cm["nvme"] == cm["total"]
        (line,) = [x for x in startup_lines(cfg, mesh, ts.plan) if x.startswith("memory")]
        assert f"host memory {pm['host'] / 2**20:.1f} MiB" in line
        assert ("NVMe files" in line) == (tier == "nvme"), line
