"""Communication levers: the data-parallel gradient reduction in bf16 (HLO dtype and bytes, gradients),
rack-aware meshes, the planner's level-by-level DP all-reduce, `meshrun explain`'s bucket report."""

import json
import warnings
from dataclasses import replace

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_train import SMALL, _cfg, full_batch_reference

from meshrun import ConfigError, MeshConfig, build_mesh, describe, describe_dict
from meshrun.analysis import hlo
from meshrun.cli.main import main
from meshrun.config import load_config
from meshrun.data.datasets import global_batch_arrays, make_dataset
from meshrun.parallel.sharding import DP_AXES
from meshrun.planner import search, step_model, timing
from meshrun.planner.hardware import COMM_EFFICIENCY, COMM_LATENCY_S, GB, parse_cluster
from meshrun.planner.layout import Layout, layout_of
from meshrun.report.explain import buckets, format_buckets
from meshrun.runtime.mesh import rack_of
from meshrun.train.step import make_train_step

BF16 = "train.grad_reduce_dtype=bfloat16"
TINY = ["model.n_layers=2"]


def _program_dp_collectives(over):
    """Data-parallel collectives of the train step as jax hands it to XLA (lowered HLO). XLA:CPU's
    backend widens 16-bit all-reduce/reduce-scatter to f32 (and aborts on a bf16 one when that pass
    is off), so the compiled CPU text cannot show the dtype a GPU build runs; this module can. All DP
    reductions sit in fully manual shard_maps, so with tensor=1 their shapes are per-device."""
    cfg = _cfg("tiny_cpu.yaml", [*TINY, "mesh.tensor=1", *over])
    mesh = build_mesh(cfg.mesh)
    train_step = make_train_step(cfg, mesh)
    shape = (cfg.train.global_batch, cfg.train.seq_len)
    batch = jax.ShapeDtypeStruct(shape, np.int32, sharding=train_step.batch_sharding)
    text = train_step.step.lower(train_step.abstract_state, batch, batch).as_text(dialect="hlo")
    return hlo.data_parallel(hlo.collectives(text, dict(mesh.shape)))


def test_bf16_reduction_halves_the_data_parallel_bytes():
    """The microbatch scan (data8, ZeRO-0): the same all-reduces, one per gradient leaf, in bf16; the
    planner's 'data' bytes of the run's layout (its train.grad_reduce_dtype) are the program's."""
    over = ["mesh.pipe=1", "mesh.data=8", "pipeline.microbatches=2"]
    f32, bf16 = _program_dp_collectives(over), _program_dp_collectives([*over, BF16])
    assert f32 and {c.op for c in f32} == {c.op for c in bf16} == {"all-reduce"}
    assert {t for c in f32 for t in c.dtypes} == {"f32"} and {t for c in bf16 for t in c.dtypes} == {"bf16"}
    assert len(bf16) == len(f32)
    assert 2 * sum(c.bytes for c in bf16) == sum(c.bytes for c in f32)
    assert not any(c.in_loop for c in bf16)  # still once per step, after the accumulation loop
    # bf16 params: the float32 sums are reduced in float32 by default, twice the param dtype's bytes
    half = ["model.param_dtype=bfloat16"]
    bf16_params, both_bf16 = _program_dp_collectives([*over, *half]), _program_dp_collectives([*over, *half, BF16])
    assert {t for c in bf16_params for t in c.dtypes} == {"f32"} and {t for c in both_bf16 for t in c.dtypes} == {
        "bf16"
    }
    for extra, program in (([], f32), ([BF16], bf16), (half, bf16_params), ([*half, BF16], both_bf16)):
        cfg = _cfg("tiny_cpu.yaml", [*TINY, "mesh.tensor=1", *over, *extra])
        lay = layout_of(cfg, dict(build_mesh(cfg.mesh).shape))
        predicted = step_model.predict_collective_bytes(cfg.model, lay, seq_len=cfg.train.seq_len)["bytes"]["data"]
        assert predicted == pytest.approx(sum(c.bytes for c in program if "data" in c.axes), rel=1e-3), extra


def test_bf16_reduction_gradients_and_compiled_collectives():
    """The pipeline (data2 x pipe2 x tensor2, 1F1B, m=2, ZeRO-1) with a bf16 reduction: the loss is
    exact (reduced in f32), every gradient is within bf16 rounding of a full-batch fp32
    `value_and_grad`, and most differ from it (the reduction did narrow). Compiled on XLA:CPU, every
    DP collective (the reduce-scatters, the all-reduce of the norm scales ZeRO cannot split) is a
    widened 16-bit one: its bytes on the wire are half its f32 bytes, scalars (loss) aside."""
    base = [x for x in SMALL if "optimizer.eps" not in x]
    cfg = load_config("configs/tiny_cpu.yaml", [*base, *TINY, "pipeline.microbatches=2", "train.zero=1", BF16])
    mesh = build_mesh(cfg.mesh)
    train_step = make_train_step(cfg, mesh)
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch)
    tok, lab = global_batch_arrays(ds, 0, mesh, P(DP_AXES))
    params = train_step.init().params
    compiled = jax.jit(train_step.loss_and_grads).lower(params, tok, lab).compile()
    loss, grads, _ = jax.device_get(compiled(params, tok, lab))
    ref_loss, ref, _ = full_batch_reference(cfg, np.asarray(tok), np.asarray(lab))
    assert float(loss) == pytest.approx(ref_loss, rel=1e-6)
    narrowed = 0
    for (path, g), r in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(ref), strict=True):
        assert g.dtype == np.float32  # cast back before the optimizer
        scale = float(np.abs(r).max())
        # each rank's partial sum and the result are rounded to bf16 (8-bit mantissa): 2^-9 relative each
        np.testing.assert_allclose(g, r, rtol=0, atol=2**-6 * scale, err_msg=jax.tree_util.keystr(path))
        narrowed += not np.allclose(g, r, rtol=1e-5, atol=1e-6 * scale)
    assert narrowed >= len(jax.tree.leaves(ref)) // 2
    dp = [c for c in hlo.data_parallel(hlo.collectives(compiled.as_text(), dict(mesh.shape))) if "data" in c.axes]
    assert {c.op for c in dp} == {"reduce-scatter", "all-reduce"} and all(c.promoted for c in dp), dp
    scalars = sum(4 for c in dp for d in c.dims if d == ())
    assert sum(c.bytes for c in dp) - scalars == 2 * (sum(c.wire_bytes for c in dp) - scalars)


def test_explain_buckets_report_program_dtype_and_bytes():
    promoted = hlo.Collective("all-reduce", 4 * 100 + 4, ("data",), 2, False, 1, ("f32", "f32"), ((100,), ()), True)
    plain = hlo.Collective("reduce-scatter", 4 * 64, ("data",), 1, False, 1, ("f32",), ((64,),))
    scalars = hlo.Collective("all-reduce", 8, ("data",), 2, False, 1, ("f32", "f32"), ((), ()))
    tensor = hlo.Collective("all-reduce", 4096, ("tensor",), 1, True, 4, ("f32",), ((1024,),))
    got = buckets([promoted, plain, scalars, tensor])
    assert got == [
        {"op": "reduce-scatter", "axes": ["data"], "arrays": 1, "bytes": 256, "dtype": "f32", "per_step": 1},
        {"op": "all-reduce", "axes": ["data"], "arrays": 2, "bytes": 204, "dtype": "bf16+f32", "per_step": 1},
    ]
    text = "\n".join(format_buckets(got, "bfloat16"))
    assert text.startswith("data-parallel collectives per step: 2 (0.000 MiB; train.grad_reduce_dtype=bfloat16)")
    assert "XLA:CPU widens" in text


def test_predicted_dp_bytes_halve_with_bf16_reduction():
    model = load_config("configs/tiny_cpu.yaml").model
    for kw in (dict(data=4), dict(data=2, pipe=2, tensor=2, microbatches=4)):  # ZeRO-0: all DP bytes are grads
        f32 = step_model.predict_collective_bytes(model, Layout(**kw), seq_len=64)["bytes"]
        lay = Layout(**kw, grad_reduce_dtype="bfloat16")
        bf16 = step_model.predict_collective_bytes(model, lay, seq_len=64)["bytes"]
        assert bf16["data"] == pytest.approx(f32["data"] / 2, rel=1e-12)
        assert {a: v for a, v in bf16.items() if a != "data"} == {a: v for a, v in f32.items() if a != "data"}


GPT3 = "configs/models/gpt3-175b.yaml"
PLAN = ["plan", "--cluster", "a100-80g:128x8,ib=8x200", "--global-batch", "1536", "--json"]
PLAN_175B = [*PLAN, "--model", "gpt3-175b", "--evaluate", "tensor=4,pipe=8,virtual=2,schedule=zb-v,zero=1"]


def test_planner_dp_bytes_double_with_float32_reduction_of_bf16_params():
    """bf16 params, gradients summed in float32: the default float32 reduction carries 4 bytes per
    gradient element, bfloat16 2 (the param dtype, which the planner used to charge whatever the run
    said); the params' all-gathers stay at 2 bytes, the float32 pipe sum of the embedding/head at 4.
    Time: meshrun's float32 sync is Megatron's (both fp32, same collectives at ZeRO 0 and 1)."""
    model = load_config(GPT3).model
    assert model.param_dtype == "bfloat16"
    cluster = parse_cluster("a100-80g:128x8,ib=8x200")
    for kw in (dict(tensor=8, data=8), dict(tensor=4, pipe=4, data=8, microbatches=8)):
        f32 = step_model.predict_collective_bytes(model, Layout(**kw), seq_len=2048)["bytes"]
        bf16 = step_model.predict_collective_bytes(model, Layout(**kw, grad_reduce_dtype="bfloat16"), seq_len=2048)
        assert f32["data"] == pytest.approx(2 * bf16["bytes"]["data"], rel=1e-12)
        assert {a: v for a, v in f32.items() if a != "data"} == {a: v for a, v in bf16["bytes"].items() if a != "data"}
        for zero in (0, 1):
            lay = Layout(**kw, zero=zero)
            mesh = timing.predict_time(model, lay, cluster, 2048)
            narrow = timing.predict_time(model, replace(lay, grad_reduce_dtype="bfloat16"), cluster, 2048)
            mega = timing.predict_time(model, lay, cluster, 2048, framework="megatron")
            assert mesh["dp_sync"] == pytest.approx(mega["dp_sync"], rel=1e-12) and narrow["dp_sync"] < mesh["dp_sync"]
    zero1 = Layout(tensor=8, data=8, zero=1)
    f32, bf16 = (step_model.predict_collective_bytes(model, replace(zero1, grad_reduce_dtype=d), seq_len=2048)
                 for d in ("float32", "bfloat16"))  # fmt: skip
    n = step_model.param_counts(model)["total"] / 8  # the elements one device reduces (TP 8), roughly
    # reduce-scatter (1/8 of the elements, 4 or 2 bytes) + all-gather (all of them, 2 bytes)
    assert f32["bytes"]["data"] - bf16["bytes"]["data"] == pytest.approx(2 * n / 8, rel=0.01)


def test_plan_costs_the_yamls_grad_reduce_dtype_unless_told(tmp_path, capsys):
    """meshrun plan: the YAML's train.grad_reduce_dtype, else float32; --grad-reduce-dtype overrides
    both; the header and --json name it."""
    narrow = tmp_path / "gpt3-bf16-reduce.yaml"
    narrow.write_text(open(GPT3).read().replace("train:\n", "train:\n  grad_reduce_dtype: bfloat16\n", 1))
    got = {}
    for name, argv in {"default": [], "flag": ["--grad-reduce-dtype", "bfloat16"]}.items():
        assert main([*PLAN_175B, *argv]) == 0
        got[name] = json.loads(capsys.readouterr().out)
    assert main([*PLAN, "--model", str(narrow), *PLAN_175B[-2:]]) == 0
    got["yaml"] = json.loads(capsys.readouterr().out)
    assert main([*PLAN, "--model", str(narrow), *PLAN_175B[-2:], "--grad-reduce-dtype", "float32"]) == 0
    got["yaml+flag"] = json.loads(capsys.readouterr().out)
    dtype = {k: (v["grad_reduce_dtype"], v["configs"][0]["grad_reduce_dtype"]) for k, v in got.items()}
    assert dtype == {"default": ("float32",) * 2, "flag": ("bfloat16",) * 2, "yaml": ("bfloat16",) * 2,
                     "yaml+flag": ("float32",) * 2}  # fmt: skip
    sync = {k: v["configs"][0]["time_parts_s"]["dp_sync"] for k, v in got.items()}
    assert sync["default"] == sync["yaml+flag"] > sync["flag"] == sync["yaml"]
    assert main([a for a in PLAN_175B if a != "--json"]) == 0
    assert "meshrun semantics, dp reduce float32" in capsys.readouterr().out.splitlines()[0]
    # Megatron's costing: float32 unless told bfloat16 (--grad-reduce-in-bf16, NeMo's grad_sync_dtype),
    # never the YAML's train section (meshrun's key)
    for argv, want in (([], "float32"), (["--grad-reduce-dtype", "bfloat16"], "bfloat16")):
        assert main([*PLAN, "--model", str(narrow), *PLAN_175B[-2:], "--framework", "megatron", *argv]) == 0
        assert json.loads(capsys.readouterr().out)["grad_reduce_dtype"] == want


@pytest.mark.parametrize(
    "argv, frag",
    [
        (
            ["--grad-reduce-dtype", "float16"],
            "--grad-reduce-dtype: invalid value (got 'float16'); use one of ['float32', 'bfloat16']",
        ),
        (
            ["--grad-reduce-dtype", "float16", "--framework", "megatron"],
            "--grad-reduce-dtype: invalid value (got 'float16'); use one of ['float32', 'bfloat16']",
        ),
        (
            ["--evaluate", "tensor=8,grad_reduce_dtype=bfloat16"],
            "--evaluate grad_reduce_dtype: not a layout key (got 'bfloat16'); give it as --grad-reduce-dtype bfloat16",
        ),
    ],
)
def test_plan_bad_grad_reduce_dtype_exits_2(argv, frag, capsys):
    assert main([*PLAN[:-1], "--model", "gpt3-175b", *argv]) == 2
    out = capsys.readouterr()
    assert frag in out.err and "Traceback" not in out.err and out.out == ""


def test_bad_grad_reduce_dtype_exits_2(capsys):
    assert main(["explain", "configs/tiny_cpu.yaml", "train.grad_reduce_dtype=float8"]) == 2
    err = capsys.readouterr().err
    assert "train.grad_reduce_dtype" in err and "'float8'" in err and "bfloat16" in err


# ----------------------------------------------------------------------------- racks


def test_racks_order_describe_and_warning():
    with pytest.warns(UserWarning, match="a data group spans 2 racks while no pipeline group does"):
        flat = build_mesh(MeshConfig(data=4, tensor=2, hosts=4, racks=2))
    assert rack_of(flat) == {i: i // 4 for i in range(8)}  # rack-major: hosts 0,1 | 2,3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        piped = build_mesh(MeshConfig(pipe=2, data=2, tensor=2, hosts=4, racks=2))  # pipe crosses racks
        build_mesh(MeshConfig(data=4, tensor=2, hosts=4))  # one rack: nothing to warn about
    d = describe_dict(piped)
    assert d["racks"] == 2 and d["rack_of"]["5"] == 1
    assert all(len({d["rack_of"][str(i)] for i in g}) == 1 for g in d["groups"]["data"])
    assert all(len({d["rack_of"][str(i)] for i in g}) == 2 for g in d["groups"]["pipe"])
    text = describe(piped)
    assert "(4 host(s) in 2 racks, 8 devices)" in text and "rack    host  device" in text
    with warnings.catch_warnings(record=True) as seen:  # an expert group across racks crosses hosts too
        warnings.simplefilter("always")
        build_mesh(MeshConfig(expert=8, hosts=4, racks=2))
    assert any("an expert group spans 2 racks" in str(w.message) for w in seen)


def test_racks_not_dividing_hosts_exits_2(capsys):
    with pytest.raises(ConfigError, match="4 hosts cannot be split into racks of 3 hosts"):
        build_mesh(MeshConfig(hosts=4, racks=3))
    assert main(["mesh", "--devices", "8", "--hosts", "4", "mesh.racks=3"]) == 2
    assert "mesh.racks" in capsys.readouterr().err


# ----------------------------------------------------------------------------- planner


def test_cluster_racks_and_level_by_level_allreduce():
    c = parse_cluster("h100-80g:64x8,racks=16x1600")
    assert (c.nodes_per_rack, c.racks, c.rack_gbps, str(c)) == (16, 4, 1600, "h100-80g:64x8,racks=16x1600")
    assert c.rack_bw_per_gpu == pytest.approx(1600e9 / 8 / 8)  # a quarter of the 400 Gb/s NIC per GPU
    flat, fast = parse_cluster("h100-80g:64x8"), parse_cluster("h100-80g:64x8,racks=16")
    assert flat.racks == 1 and fast.rack_bw_per_gpu == fast.nic_bw_per_gpu
    nbytes, lat = 1 * GB, COMM_LATENCY_S
    nvl, nic, rack = (bw * COMM_EFFICIENCY for bw in (c.gpu.intra_node_bw, c.nic_bw_per_gpu, c.rack_bw_per_gpu))
    # inside one node: the NVLink ring, racks or not
    assert c.allreduce_seconds(nbytes, 8) == pytest.approx(lat + 2 * 7 / 8 * nbytes / nvl)
    # one GPU per node (tensor 8), 16 nodes of one rack: the NIC ring, the uplinks unused
    assert c.allreduce_seconds(nbytes, 16, 8) == pytest.approx(lat + 2 * 15 / 16 * nbytes / nic)
    # data 512 over the cluster: node (8), rack (16 nodes), cluster (4 racks) on ever smaller shares
    want = lat + 2 * (7 / 8 * nbytes / nvl + 15 / 16 * nbytes / 8 / nic + 3 / 4 * nbytes / 128 / rack)
    assert c.allreduce_seconds(nbytes, 512) == pytest.approx(want)
    assert c.allreduce_seconds(nbytes, 512) > fast.allreduce_seconds(nbytes, 512) == flat.allreduce_seconds(nbytes, 512)
    assert [k for k, _ in c.levels(64, 8)] == [1, 16, 4]  # stride 8: one GPU per node
    # a pipeline send between racks runs at the uplinks' rate, one inside a rack at the NICs'
    assert (c.group_bw(8 * 16), c.group_bw(2 * 8 * 16)) == pytest.approx((nic, rack))
    # the cost model charges it: the same layout's DP sync grows on the oversubscribed cluster
    model = load_config("configs/models/megatron-1.7b.yaml").model
    lay = timing.Layout(tensor=1, pipe=1, data=512, microbatches=1)
    assert timing.predict_time(model, lay, c, 2048)["dp_sync"] > timing.predict_time(model, lay, flat, 2048)["dp_sync"]


def test_bad_cluster_racks():
    for text, match in [
        ("h100-80g:64x8,racks=5", "racks do not divide nodes"),
        ("h100-80g:64x8,racks=16x0", "malformed racks"),
        ("h100-80g:64x8,racks=fast", "malformed racks"),
        ("h100-80g:64x8,rack=16", "unknown field"),
    ]:
        with pytest.raises(ConfigError, match=match):
            parse_cluster(text)


def test_overlap_grad_reduce_on_a_layout_the_schedule_rejects_is_a_violation_not_a_crash(capsys):
    """interleaved at p 4, v 2 needs m divisible by p: with overlap_grad_reduce on, `evaluate` still
    reports the pipeline's rule as a hard violation (no overlap credited) instead of raising."""
    model = load_config(GPT3).model
    cluster = parse_cluster("a100-80g:4x8")
    lay = Layout(tensor=4, pipe=4, data=2, schedule="interleaved", virtual=2, microbatches=6, overlap_grad_reduce=True)
    assert step_model.overlap_cut(lay) == (0, 0, 0.0)
    on, off = (search.evaluate(model, replace(lay, overlap_grad_reduce=o), cluster, 12, 2048) for o in (True, False))
    assert on.hard and off.hard and any("microbatches" in w for w in on.violations)
    ev = "tensor=4,pipe=4,data=2,schedule=interleaved,virtual=2,microbatches=6"
    argv = ["plan", "--model", "gpt3-175b", "--cluster", "a100-80g:4x8", "--global-batch", "12", "--evaluate"]
    outs = []
    for extra in ("", ",overlap_grad_reduce=true"):  # --evaluate shows the schedule's rule either way
        assert main([*argv, ev + extra]) == 0
        outs.append(capsys.readouterr().out)
    assert all("microbatches=6 is not divisible by pipe=4" in o for o in outs)


def test_overlap_grad_reduce_credit_is_the_early_chunks_reduction_within_the_tail():
    """pipeline.overlap_grad_reduce (Megatron: --overlap-grad-reduce): the chunks whose gradients are
    final before the last tick (zb-v at p 8, m 48: chunk 1 at tick 288 of 295) reduce their share of
    the layers' gradients beside the ticks after the cut; the step saves (1 - OVERLAP_COST) of the
    hidden seconds. Both frameworks get the same credit for the same layout (fp32 at ZeRO-1);
    one-chunk schedules and Megatron's per-micro-batch ZeRO-2 none."""
    model = load_config(GPT3).model
    cluster = parse_cluster("a100-80g:128x8,ib=8x200")
    zbv = Layout(tensor=4, pipe=8, data=32, schedule="zb-v", virtual=2, microbatches=48, zero=1, remat="selective",
                 sequence_parallel=True, executor="per_op")  # fmt: skip
    on = replace(zbv, overlap_grad_reduce=True)
    assert step_model.overlap_cut(zbv) == (0, 0, 0.0) and step_model.overlap_cut(on) == (295, 288, 0.5)
    inter = Layout(tensor=4, pipe=8, data=32, schedule="interleaved", virtual=4, microbatches=48, zero=1,
                   overlap_grad_reduce=True)  # fmt: skip
    assert step_model.overlap_cut(inter) == (230, 206, 0.75)
    off_t, on_t = (timing.predict_time(model, lay, cluster, 2048) for lay in (zbv, on))
    counts = step_model.param_counts(model)
    layers = counts["layers"] / 8 / 4
    share = 0.5 * layers / (layers + counts["embedding"] / 4)
    loop = off_t["total"] - off_t["dp_sync"] - off_t["optimizer"]
    reduce_s = off_t["dp_sync"] - off_t["dp_gather"]
    # meshrun drains the chunk's 6 layers one per tick over the first 6 of the 7 ticks after the cut
    assert timing.overlap_ticks(model, on) == (6, 7, 295) and timing.overlap_ticks(model, on, "megatron") == (7, 7, 295)
    assert on_t["dp_hidden"] == pytest.approx(min(share * reduce_s, 6 / 295 * loop), rel=1e-9)
    assert on_t["dp_hidden"] == pytest.approx(share * reduce_s, rel=1e-9)  # it fits: all of it hidden
    assert 0 < on_t["dp_hidden"] < off_t["dp_sync"] and off_t["dp_hidden"] == 0
    saved = (1 - timing.OVERLAP_COST) * on_t["dp_hidden"]
    assert off_t["dp_sync"] - on_t["dp_sync"] == pytest.approx(saved, rel=1e-9)
    assert off_t["total"] - on_t["total"] == pytest.approx(saved, rel=1e-9)
    assert on_t["dp_sync_full"] == pytest.approx(off_t["dp_sync_full"], rel=1e-12)
    mega = timing.predict_time(model, on, cluster, 2048, framework="megatron")
    assert mega["dp_hidden"] == pytest.approx(on_t["dp_hidden"], rel=1e-9)  # same bytes (fp32), same cut
    assert timing.predict_time(model, replace(on, zero=2), cluster, 2048, framework="megatron")["dp_hidden"] == 0
    one = Layout(tensor=4, pipe=8, data=32, microbatches=48, zero=1, overlap_grad_reduce=True)
    assert step_model.overlap_cut(one) == (0, 0, 0.0)
    assert timing.predict_time(model, one, cluster, 2048)["dp_hidden"] == 0
    # meshrun's step holds the chunks' reduced sums (ZeRO-1: 1/32 shards) beside the array they are joined
    # into, and the float32 rows of the layer a drain tick reduces (one of the stage's 12)
    mem_off, mem_on = (step_model.predict_memory_jax(model, lay, seq_len=2048) for lay in (zbv, on))
    norms = 2 * 12288 * 96 / 8
    reduced = 4 * ((counts["layers"] / 8 - norms) / 4 / 32 + norms)
    row = 4 * ((counts["layers"] / 8 - norms) / 4 + norms) / 12
    assert mem_on["grads"] - mem_off["grads"] == pytest.approx(reduced + row, rel=1e-9)


def test_overlap_grad_reduce_drain_resends_when_its_layers_do_not_split_over_the_ticks():
    """meshrun's drain reduces ceil(Lc / n) layers a tick: zb-v at p 5 (chunks of Lc = 10 of GPT-3's 96
    layers, n = 4 ticks after the cut) reduces 3 a tick over 4 ticks, 12 layer reductions for 10 layers
    (the last tick rounds up with the last layer again). It sends 6/5 of the bytes it moves, hides at
    most that and at most the 4 ticks, and the step pays the rest; Megatron's buckets send what they move."""
    model = load_config(GPT3).model
    cluster = parse_cluster("a100-80g:5x8")
    on = Layout(tensor=4, pipe=5, data=2, schedule="zb-v", virtual=2, microbatches=10, zero=1, executor="per_op",
                overlap_grad_reduce=True)  # fmt: skip
    ticks, cut, early = step_model.overlap_cut(on)
    assert (ticks - cut, early) == (4, 0.5) and timing.overlap_ticks(model, on) == (4, 4, ticks)
    counts = step_model.param_counts(model)
    layers = counts["layers"] / 5 / 4
    for fw, resent in (("meshrun", 12 / 10), ("megatron", 1.0)):
        off_t, on_t = (timing.predict_time(model, lay, cluster, 2048, framework=fw)
                       for lay in (replace(on, overlap_grad_reduce=False), on))  # fmt: skip
        moved = early * layers / (layers + counts["embedding"] / 4) * (off_t["dp_sync"] - off_t["dp_gather"])
        loop = off_t["total"] - off_t["dp_sync"] - off_t["optimizer"]
        hidden = min(resent * moved, 4 / ticks * loop)
        assert on_t["dp_hidden"] == pytest.approx(hidden, rel=1e-9) and 0 < hidden
        want = off_t["dp_sync"] - moved + (resent * moved - hidden) + timing.OVERLAP_COST * hidden
        assert on_t["dp_sync"] == pytest.approx(want, rel=1e-9), fw


def test_plan_175b_overlaps_the_reduction_on_both_frameworks(capsys):
    """The 175B search turns overlap_grad_reduce on for both frameworks' best (interleaved, beside
    model.tp_comm_overlap's rings: meshrun's on the lockstep executor) and for meshrun's ZB-V layout,
    and says what it hid; --evaluate refuses it where nothing is final early (exit 2)."""
    best = {}
    for fw in ("meshrun", "megatron"):
        assert main([*PLAN, "--model", "gpt3-175b", "--top", "1", "--framework", fw]) == 0
        best[fw] = json.loads(capsys.readouterr().out)["configs"][0]
    assert [b["schedule"] for b in best.values()] == ["interleaved", "interleaved"]
    assert best["meshrun"]["executor"] == "lockstep" and all(b["tp_comm_overlap"] for b in best.values())
    assert main([*PLAN_175B[:-1], PLAN_175B[-1] + ",overlap_grad_reduce=true"]) == 0
    best["zb-v"] = json.loads(capsys.readouterr().out)["configs"][0]
    assert all(b["overlap_grad_reduce"] and b["time_parts_s"]["dp_hidden"] > 0 for b in best.values())
    assert main([a for a in PLAN if a != "--json"] + ["--model", "gpt3-175b", "--top", "1"]) == 0
    assert "#1 overlap_grad_reduce: " in capsys.readouterr().out
    assert main([*PLAN, "--model", "gpt3-175b", "--evaluate", "tensor=4,pipe=8,zero=1,overlap_grad_reduce=true"]) == 2
    assert "--evaluate overlap_grad_reduce: no chunk's gradients are final" in capsys.readouterr().err


@pytest.mark.parametrize("zero", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_overlap_grad_reduce_in_bf16_without_tensor_parallelism(zero):
    """pipeline.overlap_grad_reduce with a bf16 reduction and 'tensor' of size 1 (data4 x pipe2, zb-v):
    the drained chunk's 16-bit reductions run in the nested shard_map manual over 'tensor' (left to
    GSPMD they aborted XLA:CPU); loss and gradients equal the run without the option's."""
    base = [x for x in SMALL if "optimizer.eps" not in x]
    over = [*base, "model.n_layers=4", "mesh.tensor=1", "mesh.data=4", "pipeline.schedule=zb-v",
            "pipeline.microbatches=4", f"train.zero={zero}", BF16]  # fmt: skip
    got = []
    for on in (False, True):
        cfg = load_config("configs/tiny_cpu.yaml", [*over, f"pipeline.overlap_grad_reduce={on}"])
        mesh = build_mesh(cfg.mesh)
        train_step = make_train_step(cfg, mesh)
        ds = make_dataset(
            cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch
        )
        tok, lab = global_batch_arrays(ds, 0, mesh, P(DP_AXES))
        got.append(jax.device_get(jax.jit(train_step.loss_and_grads)(train_step.init().params, tok, lab)[:2]))
    np.testing.assert_allclose(float(got[1][0]), float(got[0][0]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got[1][1]), jax.tree.leaves(got[0][1]), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-8)
