"""The planner's three optimizer tiers (device, host memory, NVMe): the cluster's host memory and
NVMe, each tier's bytes, traffic and time, the rule that NVMe is proposed only when device + host
memory do not fit, and the answer when nothing fits (the 405B-on-one-node case). Planner only (no
jax), except the one test that checks the planner's bytes against the runtime's NVMe tier."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrun.cli.main import main
from meshrun.cli.plan import load_model
from meshrun.errors import ConfigError
from meshrun.planner import search, step_model, tiers
from meshrun.planner.cost import Layout
from meshrun.planner.hardware import GB, GPUS, NODES, TB, Cluster, parse_cluster

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def model(name: str):
    return load_model(name)[0]


def run_cli(argv, capsys):
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


# ----------------------------------------------------------------------------- the cluster spec


def test_every_gpu_has_node_defaults_scaled_to_the_node():
    assert set(NODES) == set(GPUS)
    dgx = parse_cluster("h100-80g:2x8").storage  # DGX H100: 2 TB, 8 x 3.84 TB
    assert (dgx.host_bytes, dgx.nvme_drives, dgx.nvme_drive_bytes) == (2 * TB, 8, 3.84 * TB)
    assert (dgx.nvme_read_bw, dgx.nvme_write_bw) == (6.4 * GB, 3.8 * GB)
    half = parse_cluster("a100-80g:4x4").storage  # half a DGX A100 640 GB per node
    assert (half.host_bytes, half.nvme_drives) == (1 * TB, 4)
    assert parse_cluster("a100-40g:1x8").storage.host_bytes == 1 * TB  # DGX A100 320 GB


def test_cluster_overrides_and_round_trip():
    c = parse_cluster("h100-80g:2x8,ib=8x400,host=1TB,nvme=4x7.68TB,nvme_bw=7/4")
    s = c.storage
    assert (s.host_bytes, s.nvme_drives, s.nvme_drive_bytes) == (1 * TB, 4, 7.68 * TB)
    assert (s.nvme_read_bw, s.nvme_write_bw) == (7 * GB, 4 * GB)
    assert parse_cluster(str(c)) == c
    assert str(parse_cluster("h100-80g:1x8")) == "h100-80g:1x8"  # defaults print nothing extra
    none = parse_cluster("h100-80g:1x8,nvme=0,host=512gb")
    assert none.storage.nvme_drives == 0 and none.storage.host_bytes == 512 * GB
    assert parse_cluster(str(none)) == none


BAD = [
    ("h100-80g:1x8,host=2", "malformed host memory"),
    ("h100-80g:1x8,host=0TB", "malformed host memory"),
    ("h100-80g:1x8,host=-1TB", "malformed host memory"),
    ("h100-80g:1x8,host=2PB", "malformed host memory"),
    ("h100-80g:1x8,nvme=8", "malformed nvme"),
    ("h100-80g:1x8,nvme=8x", "malformed nvme"),
    ("h100-80g:1x8,nvme=0x3.84TB", "malformed nvme"),
    ("h100-80g:1x8,nvme=8x0TB", "malformed nvme"),
    ("h100-80g:1x8,nvme_bw=6.4", "malformed nvme_bw"),
    ("h100-80g:1x8,nvme_bw=0/3", "malformed nvme_bw"),
    ("h100-80g:1x8,nvme_bw=a/b", "malformed nvme_bw"),
    ("h100-80g:1x8,disk=8x3.84TB", "unknown field"),
]


@pytest.mark.parametrize("text,what", BAD)
def test_bad_storage_fields(text, what):
    with pytest.raises(ConfigError) as e:
        parse_cluster(text)
    assert e.value.field == "--cluster" and e.value.value == text and what in str(e.value)
    assert "\n" not in str(e.value) and ("e.g." in e.value.fix or what == "unknown field")


@pytest.mark.parametrize("text,what", BAD[::4])
def test_bad_storage_fields_exit_2(text, what, capsys):
    rc, out, err = run_cli(["--model", "llama-7b", "--cluster", text, "--global-batch", "16"], capsys)
    assert rc == 2 and f"--cluster: {what}" in err and "Traceback" not in err and out == ""


FIELD_VALUES = st.sampled_from(["2TB", "512GB", "8x3.84TB", "0", "1/1", "6.4/3.8", "", "x", "-1", "1e9TB", "8x", "nan"])
CLUSTER_TEXT = st.builds(
    lambda head, fields: head + "".join(f",{k}={v}" for k, v in fields),
    st.sampled_from(["h100-80g:1x8", "a100-40g:2x4", "gh200:4x1"]),
    st.lists(st.tuples(st.sampled_from(["host", "nvme", "nvme_bw", "ib", "hots"]), FIELD_VALUES), max_size=3),
)


@settings(max_examples=200, deadline=None)
@given(CLUSTER_TEXT)
def test_any_cluster_string_parses_or_names_the_field(text):
    """Whatever a user types after the GPU count: a Cluster whose storage is positive, or one
    ConfigError naming --cluster and the text."""
    try:
        c = parse_cluster(text)
    except ConfigError as e:
        assert e.value == text and str(e).startswith("--cluster: ") and "\n" not in str(e)
        return
    s = c.storage
    assert s.host_bytes > 0 and s.nvme_drives >= 0 and s.nvme_read_bw > 0 and s.nvme_write_bw > 0
    assert parse_cluster(str(c)).storage == s


# ----------------------------------------------------------------------------- tier bytes and time


def test_tier_bytes_traffic_and_time_by_hand():
    """llama-70b, TP 4 PP 2 DP 2 ZeRO-1 on 2 DGX H100: the state is 12 bytes (fp32 master, m, v) per
    element of the optimizer's shard; the whole-shard host update moves it twice over the host link
    and waits for it; NVMe holds it in chunks sized as the runtime sizes them, reads and writes it
    once a step; the streamed host update (the default) holds nvme's chunks in host memory and moves
    them as nvme's, over the host link only."""
    m, c = model("llama-70b"), parse_cluster("h100-80g:2x8")
    lay = Layout(
        tensor=4,
        pipe=2,
        data=2,
        virtual=4,
        microbatches=8,
        zero=1,
        remat="selective",
        sequence_parallel=True,
        schedule="interleaved",
    )
    r = search.evaluate(m, lay, c, 16, 4096)
    mem, t_upd = r.memory, r.time["optimizer"]
    elems = mem["opt_elems"]
    assert mem["opt_state"] == pytest.approx(12 * elems)
    host = tiers.optimizer_tier(mem, m, replace(lay, offload_update="whole"), c, "host", t_upd)
    assert not host.streamed and host.chunk == 0
    assert host.host == pytest.approx(12 * elems) and host.pcie == pytest.approx(24 * elems)
    assert host.exposed_s == pytest.approx(24 * elems / (64 * GB * 0.8))
    fixed = 0.8e9 + mem["overhead_comm_buffers"]  # CUDA context, communicators
    assert host.update == pytest.approx(mem["stored"] + 4 * elems + mem["optimizer"] + fixed)
    nv = tiers.optimizer_tier(mem, m, lay, c, "nvme", t_upd)
    budget = 256 * 2**20
    chunk = int(budget // (3 * 3 * 8 * 4)) // 1024 * 1024  # 3 buffers x 3 slots x 8 rows (GPUs) x fp32
    assert nv.chunk == chunk and nv.n_chunks == math.ceil(elems / chunk)
    assert nv.nvme == nv.nvme_read == nv.nvme_write == nv.n_chunks * chunk * 12
    assert nv.pcie == 2 * nv.nvme and nv.host == budget / 8
    node = 8 * nv.nvme  # the 8 GPUs' files on the node's 8 drives at 70% of 6.4 / 3.8 GB/s each
    assert nv.io_s == pytest.approx(node / (8 * 0.7 * 6.4 * GB) + node / (8 * 0.7 * 3.8 * GB))
    assert nv.exposed_s == pytest.approx(nv.io_s - t_upd)
    # on the device: flat fp32 gradient + bf16 param rows instead of the 16 bytes of state + temporaries
    assert nv.update == pytest.approx(host.update - mem["optimizer"] + 6 * elems + 2 * 3 * 3 * 4 * chunk)
    assert nv.device < c.usable_memory < host.device
    streamed = tiers.optimizer_tier(mem, m, lay, c, "host", t_upd)  # offload_update=auto streams adamw
    assert streamed.streamed and (streamed.chunk, streamed.n_chunks) == (nv.chunk, nv.n_chunks)
    assert streamed.host == nv.nvme + budget / 8 and streamed.nvme == streamed.nvme_read == streamed.nvme_write == 0
    assert streamed.pcie == nv.pcie and streamed.update == nv.update
    assert streamed.io_s == pytest.approx(nv.pcie / (64 * GB * 0.8))
    assert streamed.exposed_s == pytest.approx(max(0.0, streamed.io_s - t_upd))


def test_update_on_the_device_or_the_host_cpu_by_hand():
    """Where the streamed update runs (`offload.update_on`): on the host CPU the link carries the
    gradient down and the new params up (6 bytes per element with bf16 params and a float32 master, 12
    with float32 params), and the CPU's Adam pass moves 30 (28) bytes per element in host memory at 70%
    of the node's host memory bandwidth (DGX H100: 2 x 8 channels of DDR5-4800), shared by its 8 GPUs;
    the faster place wins, a tie keeps the device."""
    assert NODES["h100-80g"].host_mem_bw == pytest.approx(614.4 * GB)
    assert NODES["a100-80g"].host_mem_bw == pytest.approx(409.6 * GB)
    assert tiers.host_adam_bytes(3, 2) == 4 + 24 + 2 and tiers.host_adam_bytes(2, 4) == 4 + 16 + 8
    m, c = model("llama-70b"), parse_cluster("h100-80g:2x8")
    lay = Layout(tensor=4, pipe=2, data=2, virtual=4, microbatches=8, zero=1, remat="selective",
                 sequence_parallel=True, schedule="interleaved")  # fmt: skip
    r = search.evaluate(m, lay, c, 16, 4096)
    mem, t_upd = r.memory, r.time["optimizer"]
    host = tiers.optimizer_tier(mem, m, lay, c, "host", t_upd)
    padded = host.chunk * host.n_chunks
    cpu = padded * 30 / (0.7 * 614.4 * GB / 8)
    assert host.cpu_s == pytest.approx(cpu)
    assert host.device_s == pytest.approx(max(0.0, 24 * padded / (64 * GB * 0.8) - t_upd))
    assert host.host_s == pytest.approx(max(0.0, max(6 * padded / (64 * GB * 0.8), cpu) - t_upd))
    assert host.update_on == "device" and host.device_s < host.host_s and host.exposed_s == host.device_s
    slow = replace(c, gpu=replace(c.gpu, pcie_bw=16 * GB))  # a slower link: the host CPU wins
    on_host = tiers.optimizer_tier(mem, m, lay, slow, "host", t_upd)
    assert on_host.update_on == "host" and on_host.pcie == pytest.approx(6 * padded)
    assert on_host.exposed_s == on_host.host_s < on_host.device_s
    nv = tiers.optimizer_tier(mem, m, lay, slow, "nvme", t_upd)  # the drives bound both places: a tie
    assert nv.update_on == "device" and nv.host_s == nv.device_s == nv.exposed_s


def test_plan_says_where_the_update_runs(capsys):
    """llama-70b on 2 DGX H100 keeps the update on the device; gpt3-175b at 16K on 4 DGX A100 (a PCIe 4
    link) puts it on the host CPU and says so with the switch to set."""
    argv = ["--model", "llama-70b", "--cluster", "h100-80g:2x8", "--global-batch", "16", "--seq-len", "4096", "--top",
            "1"]  # fmt: skip
    rc, out, _ = run_cli(argv, capsys)
    assert rc == 0 and "update on the device: +1.98 s against +2.37 s on the host CPU" in out, out
    rc, out, _ = run_cli([*GPT3_LONG[:-1], "1", "--cluster", "a100-80g:4x8"], capsys)
    assert rc == 0 and "update on the host CPU (offload.update_on=host): +4.54 s against +5.09 s" in out, out


def test_chunks_match_the_runtime_rule():
    from meshrun.offload import chunk_store, swap_file

    for budget in (0.5, 16, 256, 4096):
        for slots, rows, row_len in ((2, 1, 10**6), (3, 8, 123_457), (3, 8, 10**10), (2, 4, 100)):
            want = swap_file.chunk_elems(budget * 2**20, slots, rows, row_len)
            assert tiers.chunk_elems(budget * 2**20, slots, rows, row_len) == want
    assert tiers.SLOTS_IN_FLIGHT == chunk_store.SLOTS_IN_FLIGHT and tiers.ALIGN == swap_file.ALIGN
    from meshrun.config import OffloadConfig

    assert OffloadConfig().budget_mb == tiers.DEFAULT_BUDGET_MB


@pytest.mark.parametrize("kind", ["nvme", "host"])
def test_planner_state_bytes_equal_the_runtime_tiers(kind, tmp_path):
    """The tiny model on 8 CPU devices, offload.optimizer=nvme or host (streamed): the planner's
    elements per rank, state slots, chunk and store bytes (the file, or the host tier's chunks in
    host memory) equal what the runtime's tier lays out, and a step reads and writes exactly the
    store: for nvme from the drives, and over the host link for both (the planner's pcie bytes)."""
    import jax
    from jax.sharding import PartitionSpec as P

    from meshrun.config import load_config
    from meshrun.data.datasets import global_batch_arrays, make_dataset
    from meshrun.offload import chunk_store, swap_file
    from meshrun.parallel.sharding import DP_AXES
    from meshrun.planner.layout import layout_of
    from meshrun.runtime.mesh import build_mesh
    from meshrun.train.step import make_train_step

    small = ["train.seq_len=16", "model.max_seq_len=16", "data.kind=synthetic", "train.global_batch=16"]
    # pipe 2 x data 2 x tensor 2, ZeRO-1, bf16 params (3 fp32 slots: master, m, v)
    tier_over = [f"offload.optimizer={kind}", "offload.budget_mb=0.5"]
    tier_over += [f"offload.dir={tmp_path}"] if kind == "nvme" else []
    for over in (["train.zero=1", "model.param_dtype=bfloat16"],):
        cfg = load_config(ROOT / "configs/tiny_cpu.yaml", [*small, *tier_over, *over])
        mesh = build_mesh(cfg.mesh, devices=jax.devices()[:8])
        ts = make_train_step(cfg, mesh)
        state = ts.init()
        tier, f = ts.tier, ts.tier.file
        lay = layout_of(cfg, dict(mesh.shape))
        mem = step_model.predict_memory_jax(cfg.model, lay, seq_len=16)
        mem |= {"total": mem["device"], "overhead_context": 0.0}
        plan = tiers.optimizer_tier(mem, cfg.model, lay, Cluster(GPUS["h100-80g"], 1, 8), kind, 0.0, 0.5)
        assert plan.streamed and isinstance(f, swap_file.SwapFile if kind == "nvme" else chunk_store.HostStore)
        assert mem["opt_elems"] == tier.layout.used
        assert mem["opt_state"] == tier.layout.used * tier.pattern.n_slots * 4
        assert len(tier.layout.first) == 8 and plan.chunk == tier.layout.chunk and plan.n_chunks == tier.layout.n_chunks
        store = plan.nvme if kind == "nvme" else plan.host - 0.5 * 2**20 / 8  # the host tier: store + buffers
        assert 8 * store == f.state_bytes
        ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=16, global_batch=16)
        before = f.bytes_read, f.bytes_written
        ts.step(state, *global_batch_arrays(ds, 0, mesh, P(DP_AXES)))
        moved = (f.bytes_read - before[0], f.bytes_written - before[1])
        assert moved == (8 * plan.pcie / 2, 8 * plan.pcie / 2)
        assert moved == ((8 * plan.nvme_read, 8 * plan.nvme_write) if kind == "nvme" else (8 * store, 8 * store))


HOST_UPDATES = {  # overrides -> whether the runtime streams the host tier's update
    "adamw": ([], True),
    "whole": (["offload.update=whole"], False),
    "muon": (["optimizer.name=muon"], False),
    "bf16-moments": (["optimizer.state_dtype=bfloat16"], False),
    "fp8": (["model.fp8=tensorwise"], False),
    "offload-params": (["train.zero=3", "offload.params=true"], False),
    "streamed": (["offload.update=streamed"], True),
    # offload.params streams layer by layer itself, whatever the optimizer (no refusal raised)
    "offload-params-muon": (["train.zero=3", "offload.params=true", "optimizer.name=muon"], False),
}


@pytest.mark.parametrize("name", list(HOST_UPDATES))
def test_planner_streams_the_host_update_where_the_runtime_does(name):
    """The planner models the streamed host update exactly where the step's plan streams it
    (`offload.registry.placement`), and the whole-shard update where auto falls back to it."""
    from meshrun.config import load_config
    from meshrun.offload.registry import placement
    from meshrun.planner.layout import layout_of

    over, want = HOST_UPDATES[name]
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", ["offload.optimizer=host", *over])
    lay = layout_of(cfg, {"data": 2, "pipe": 2, "tensor": 2, "expert": 1})
    assert placement(cfg).streams is want and tiers.host_streams(cfg.model, lay) is want
    mem = step_model.predict_memory_jax(cfg.model, lay, seq_len=64)
    mem |= {"total": mem["device"]}
    t = tiers.optimizer_tier(mem, cfg.model, lay, Cluster(GPUS["h100-80g"], 1, 8), "host", 0.0)
    assert t.streamed is want and (t.chunk > 0) is want


def test_evaluate_offload_update(capsys):
    """`--evaluate ...,offload_optimizer=host,offload_update=whole|streamed`: whole costs the whole-shard
    update (its peak does not fit here), streamed (and auto) the chunked one; streamed with muon is
    refused as the runtime refuses it; offload_update without the host tier exits 2."""
    argv = ["--model", "llama-70b", "--cluster", "h100-80g:2x8", "--global-batch", "16", "--seq-len", "4096"]
    ev = "tensor=4,pipe=2,data=2,zero=1,microbatches=8,offload_optimizer=host"
    got = {}
    for upd in ("auto", "streamed", "whole"):
        rc, out, _ = run_cli([*argv, "--evaluate", f"{ev},offload_update={upd}", "--json"], capsys)
        assert rc == 0
        got[upd] = json.loads(out)["configs"][0]
    keys = ("memory_gb", "host_memory_gb", "step_time_s")
    assert [got["auto"][k] for k in keys] == [got["streamed"][k] for k in keys]
    assert got["streamed"]["memory_gb"] < 80 < got["whole"]["memory_gb"] and got["whole"]["offload_update"] == "whole"
    rc, out, _ = run_cli([*argv, "--evaluate", f"{ev},offload_update=whole"], capsys)
    assert "update the whole shard on the device" in out and "the update's peak" in out
    rc, out, _ = run_cli([*argv, "--evaluate", f"{ev},offload_update=streamed"], capsys)
    assert "update streamed in" in out and "the update's peak" not in out
    rc, out, _ = run_cli([*argv, "--optimizer", "muon", "--evaluate", f"{ev},offload_update=streamed"], capsys)
    assert "offload.update=streamed: meshrun refuses it (muon's update is not elementwise" in out
    rc, out, err = run_cli([*argv, "--evaluate", "tensor=4,pipe=2,data=2,offload_update=whole"], capsys)
    assert rc == 2 and "--evaluate offload_update: chooses the host tier's update only" in err and out == ""


# ----------------------------------------------------------------------------- which tier the search proposes

GPT3_LONG = ["--model", "gpt3-175b", "--global-batch", "16", "--seq-len", "16384", "--max-context", "1", "--top", "3"]


def _proposals(cluster: str, argv=GPT3_LONG):
    m = model(argv[1])
    kw = dict(top=3, max_context=1) if "--max-context" in argv else dict(top=3)
    return search.search(m, parse_cluster(cluster), int(argv[3]), int(argv[5]), **kw)


def _why(r) -> str:
    return next(v for v in r.violations if v.startswith("offload optimizer"))


def test_host_when_device_plus_host_fit_nvme_only_when_not():
    """GPT-3 175B at 16K tokens on 4 DGX A100: host offload fits (update peak and 2 TB of host
    memory), so NVMe is not proposed; with 256 GB of host memory per node it no longer fits and NVMe
    is, saying why. On 8 DGX A100 ZeRO-3, gathering a layer at a time, fits without offload."""
    host = _proposals("a100-80g:4x8")
    assert host and all(_why(r).startswith("offload optimizer to host memory") for r in host)
    assert all(r.memory["total"] <= 80 * GB and r.memory["host"] * 8 <= 0.9 * 2 * TB for r in host)
    nv = _proposals("a100-80g:4x8,host=256GB")
    assert nv and all(_why(r).startswith("offload optimizer to NVMe") for r in nv)
    assert all("host offload does not fit (host memory" in _why(r) for r in nv)
    assert all(r.step_time > host[0].step_time for r in nv)  # the drives are slower than the host link
    fsdp = _proposals("a100-80g:8x8")
    assert fsdp and all(r.layout.zero == 3 and not r.violations and r.memory["total"] <= 80 * GB for r in fsdp)


def test_no_offload_when_the_device_is_enough():
    best = search.search(model("gpt3-175b"), parse_cluster("a100-80g:8x8"), 64, 2048, top=3)
    assert not any(v.startswith("offload") for r in best for v in r.violations)


def test_streamed_host_update_where_the_whole_shards_peak_does_not_fit(capsys):
    """llama-70b on 2 DGX H100: the whole-shard host update brings the state shard to the device
    (105 GB, it does not fit); the streamed one (the default for adamw) holds nvme's flat rows and
    chunks (62 GB), so the host tier is proposed, at the host link's pace, not NVMe at the drives'."""
    argv = ["--model", "llama-70b", "--cluster", "h100-80g:2x8", "--global-batch", "16", "--seq-len", "4096"]
    rc, out, _ = run_cli([*argv, "--top", "2"], capsys)
    assert rc == 0
    why = [line for line in out.splitlines() if "offload optimizer" in line]
    assert len(why) == 2 and all("offload optimizer to host memory" in w and "update streamed in" in w for w in why)
    m, c = model("llama-70b"), parse_cluster("h100-80g:2x8")
    lay = Layout(tensor=4, pipe=2, data=2, microbatches=8, zero=1)
    r = search.evaluate(m, lay, c, 16, 4096)
    tier = lambda kind, lay: tiers.optimizer_tier(r.memory, m, lay, c, kind, r.time["optimizer"])
    whole, streamed, nv = tier("host", replace(lay, offload_update="whole")), tier("host", lay), tier("nvme", lay)
    assert any(w.startswith("the update's peak") for w in tiers.misfits(whole, c, lay))
    assert not tiers.misfits(streamed, c, lay) and streamed.update == nv.update < c.usable_memory < whole.update
    assert streamed.exposed_s < nv.exposed_s
    # the runtime streams elementwise optimizers with float32 state only: muon (Newton-Schulz) and
    # bfloat16 moments are never put on NVMe
    m, c = model("llama-70b"), parse_cluster("h100-80g:2x8")
    for kw in (dict(optimizer="muon"), dict(state_dtype="bfloat16")):
        lay = Layout(tensor=4, pipe=2, data=2, microbatches=8, zero=1, **kw)
        r = search.evaluate(m, lay, c, 16, 4096)
        t = tiers.optimizer_tier(r.memory, m, lay, c, "nvme", r.time["optimizer"])
        assert any("elementwise optimizers with float32 state only" in w for w in tiers.misfits(t, c, lay))


def test_1t_on_four_nodes_needs_the_parameters_off_the_device(capsys):
    """megatron-1t on 4 DGX A100: the state fits neither the devices nor 4 nodes' host memory; with the
    parameters in host memory and the state on NVMe it fits. Whether the planner answers with that
    layout or exits 2 naming what refuses it follows the runtime's rules (`config.offload_params_refusals`;
    the 405B on one node: tests/test_planner_params.py)."""
    from meshrun import config

    argv = ["--model", "megatron-1t", "--cluster", "a100-80g:4x8", "--global-batch", "64", "--top", "1"]
    rc, out, err = run_cli(argv, capsys)
    refused = config.offload_params_refusals(3, "nvme", fp8="none", pipe=1)  # its layout: pipe 1
    if refused:
        assert rc == 2 and len(err.strip().splitlines()) == 1 and "and the optimizer state on NVMe it would fit" in err
        assert all(f"it {w}" in err for w, _ in refused)
    else:
        assert rc == 0 and "offload.params=true offload.optimizer=nvme" in out


def test_delayed_fp8_is_never_put_on_nvme():
    """Delayed scaling's amax history is updated outside the nvme tier's elementwise update: the
    planner refuses the pair as the run's config does (tensorwise, which has no such state, is
    costed as before)."""
    c = parse_cluster("h100-80g:2x8")
    lay = Layout(tensor=4, pipe=2, data=2, microbatches=8, zero=1)
    for fp8, refused in (("delayed", True), ("tensorwise", False), ("none", False)):
        m = replace(model("llama-70b"), fp8=fp8)
        r = search.evaluate(m, lay, c, 16, 4096)
        t = tiers.optimizer_tier(r.memory, m, lay, c, "nvme", r.time["optimizer"])
        assert any("amax history" in w for w in tiers.misfits(t, c, lay)) is refused, fp8
