"""ZeRO-3 per layer (FSDP, train.zero3_gather=layer): the layers' weights rest as their ZeRO-3 shards
in device memory, each layer is all-gathered inside the layer scan just before use and gathered again
in the backward (the fetched weights are never saved for it), and each layer's gradient is
reduce-scattered as the backward makes it into float32 sums that are themselves sharded.

Checked here: the same numbers as one device (losses and params after 3 steps, fp32 rtol 1e-5) on
data, tensor and pipeline layouts; bf16 params with the float32 master against the gather-once
step (every schedule too) and one device; the compiled HLO (the layers' all-gathers and
reduce-scatters inside the loops, once per layer and microbatch, none there with gather-once) and
its memory_analysis (below gather-once); bad input.
"""

import functools
import math

import jax
import numpy as np
import pytest
from test_moe_deepseek import MASTER_NORM_RTOL, run_master
from test_offload_params import _grads_and_one_step, assert_bf16_step_follows, assert_float32_grads_follow
from test_train import ONE_DEVICE, _cfg, assert_same, reference, run_steps

from meshrun.analysis import hlo
from meshrun.cli.main import main
from meshrun.config import zero3_per_layer
from meshrun.runtime.mesh import build_mesh
from meshrun.train.plan import build_plan
from meshrun.train.step import make_train_step

LAYER = ["train.zero=3", "train.zero3_gather=layer"]
DP4_TP2 = ["mesh.pipe=1", "mesh.data=4", "mesh.tensor=2", "pipeline.microbatches=4"]
DP8 = ["mesh.pipe=1", "mesh.data=8", "mesh.tensor=1", "pipeline.microbatches=2"]
WEIGHTS = 7  # gathered weights of one tiny_cpu layer: q, k, v, o, gate, up, down (norm scales stay whole)
# ZeRO-3 per layer (layer_group.Plan) gathers them in 5 collectives (q; k and v stacked; o; gate and
# up stacked; down: none is 1/8 of gate's size, so none is packed) and reduce-scatters them one by one
GATHERS, SCATTERS = 5, 7
EDGES = 2  # the embedding and head: without a pipeline reduce-scattered once per microbatch too


@pytest.mark.parametrize(
    "over",
    [DP4_TP2, ["mesh.pipe=1", "mesh.data=8", "mesh.tensor=1", "pipeline.microbatches=1"], []],
    ids=["data4-tensor2-m4", "data8-m1", "data2-pipe2-tensor2-1f1b"],
)
def test_zero3_per_layer_matches_one_device(over):
    got = run_steps(_cfg("tiny_cpu.yaml", [*over, *LAYER]))
    assert_same(got, reference("tiny_cpu.yaml"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "over",
    [["pipeline.schedule=interleaved", "pipeline.virtual=2"], ["pipeline.schedule=zb-h1"], ["pipeline.schedule=zb-v"]],
    ids=["interleaved", "zb-h1", "zb-v"],
)
def test_zero3_per_layer_pipelines_match_one_device(over):
    """pipe 2 x data 2 x tensor 2: interleaved 1F1B (virtual 2) and the V (layers stored in pipeline
    placement, compared in model order); ZB-H1 and ZB-V split each backward into B and W, W re-gathering
    the layer and reduce-scattering its gradient."""
    got = run_steps(_cfg("tiny_cpu.yaml", [*over, *LAYER]))
    assert_same(got, reference("tiny_cpu.yaml"))


@pytest.mark.slow
def test_zero3_per_layer_matches_one_device_moe_expert():
    """data 2 x expert 2 x tensor 2, MoE every other layer (the experts stay split over 'expert')."""
    got = run_steps(_cfg("tiny_moe_cpu.yaml", LAYER))
    assert_same(got, reference("tiny_moe_cpu.yaml"))


@pytest.mark.slow
def test_bf16_params_with_float32_master_match_gather_once():
    """bf16 params, float32 master: each layer's gradient is reduced in float32 (sent to float32 arrays
    beside the bf16 shards), so it equals the gather-once step's float32 sums (rtol 1e-5: added per
    microbatch after the reduction instead of before it), and after one step the master and Adam's
    moments follow at rtol 1e-5 and the params are the rounded master. (Further steps part by bf16
    roundings of last-bit differences, in any two layouts.)"""
    bf16 = ["model.param_dtype=bfloat16", "model.dtype=bfloat16", *DP4_TP2, "train.zero=3"]
    on = _grads_and_one_step([*bf16, "train.zero3_gather=layer"])
    off = _grads_and_one_step([*bf16, "train.zero3_gather=step"])
    np.testing.assert_allclose(on[0], off[0], rtol=1e-6)
    assert_bf16_step_follows(on, off)


BF16 = ["model.param_dtype=bfloat16"]
SCHEDULES = [
    [],
    pytest.param(["pipeline.schedule=interleaved", "pipeline.virtual=2"], marks=pytest.mark.slow, id="interleaved"),
    pytest.param(["pipeline.schedule=zb-h1"], marks=pytest.mark.slow, id="zb-h1"),
    pytest.param(["pipeline.schedule=zb-v"], marks=pytest.mark.slow, id="zb-v"),
    pytest.param(["pipeline.layers_per_stage=[3,1]"], marks=pytest.mark.slow, id="uneven"),
]
ZERO3_STEP = ["train.zero=3", "train.zero3_gather=step"]
ZERO2 = ["train.zero=2", "train.zero2_reduce=microbatch"]
# id -> (the per-layer variant, its once-per-step counterpart)
PER_LAYER = {
    "layer": (LAYER, ZERO3_STEP),
    "offload-params": (["train.zero=3", "offload.params=true"], ZERO3_STEP),
    "zero2-microbatch": (ZERO2, ["train.zero=2", "train.zero2_reduce=step"]),
}
FETCHES = [pytest.param(*PER_LAYER[k], id=k, marks=() if k == "layer" else pytest.mark.slow) for k in PER_LAYER]


@pytest.mark.parametrize("fetch,whole", FETCHES)
@pytest.mark.parametrize("schedule", SCHEDULES, ids=["1f1b", "interleaved", "zb-h1", "zb-v", "uneven"])
def test_bf16_params_pipelined_reduce_in_float32_as_gather_once(schedule, fetch, whole):
    """bf16 params through the pipeline (data 2 x pipe 2 x tensor 2): the stage's vjp differentiates
    float32 arrays beside the bf16 layers, so each layer's gradient is reduced in float32 and equals
    the once-per-step variant's float32 sums at rtol 1e-5 (a bf16 cotangent of the layers would be
    2^-9 off: measured, 740x the sums' rtol at its worst element)."""
    on = _grads_and_one_step([*BF16, *schedule, *fetch], step=False)
    off = _grads_and_one_step([*BF16, *schedule, *whole], step=False)
    np.testing.assert_allclose(on[0], off[0], rtol=1e-6)
    assert_float32_grads_follow(on, off)


@pytest.mark.slow
@pytest.mark.parametrize("fetch,whole", FETCHES)
@pytest.mark.parametrize("schedule", SCHEDULES, ids=["1f1b", "interleaved", "zb-h1", "zb-v", "uneven"])
def test_bf16_params_pipelined_match_one_device(schedule, fetch, whole):
    """3 steps with bf16 params and the float32 master against one device, compared as every bf16
    layout is (test_moe_deepseek.py: the losses at rtol 1e-5, each master tensor by its norm; a bf16
    param's local per-microbatch gradient rounds differently in another layout)."""
    got = run_master(_cfg("tiny_cpu.yaml", [*BF16, *schedule, *fetch]))
    ref = _one_device_bf16()
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    for (path, g), r in zip(jax.tree.leaves_with_path(got[2]), jax.tree.leaves(ref[2]), strict=True):
        assert np.linalg.norm(g - r) <= MASTER_NORM_RTOL * np.linalg.norm(r), jax.tree_util.keystr(path)


@functools.cache
def _one_device_bf16():
    return run_master(_cfg("tiny_cpu.yaml", [*BF16, *ONE_DEVICE]), n_devices=1)


def compiled_step(over):
    """tiny_cpu.yaml with `over`, its step compiled: (cfg, mesh, the collectives of its HLO, memory_analysis)."""
    cfg = _cfg("tiny_cpu.yaml", over)
    mesh = build_mesh(cfg.mesh)
    ts = make_train_step(cfg, mesh)
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.train.seq_len), np.int32, sharding=ts.batch_sharding)
    compiled = ts.step.lower(ts.abstract_run, batch, batch).compile()
    return cfg, mesh, hlo.collectives(compiled.as_text(), dict(mesh.shape)), compiled.memory_analysis()


def test_gathers_inside_the_layer_loop_once_per_layer_and_below_gather_once_in_memory():
    """data 8, 2 microbatches, 4 layers. Per layer: the layer's weights are all-gathered inside a loop
    once per layer and microbatch in the forward and again in the backward (2 x 5 gathers, each run
    4 x 2 times a step), and their gradients reduce-scattered there once per layer and microbatch
    (7 reduce-scatters; the embedding's and head's once per microbatch). Gather-once: no all-gather in
    any loop. The per-layer step's temporaries are below gather-once's."""
    cfg, _, layer, mem_layer = compiled_step([*DP8, *LAYER])
    _, _, step, mem_step = compiled_step([*DP8, "train.zero=3", "train.zero3_gather=step"])
    runs = cfg.model.n_layers * cfg.pipeline.microbatches
    looped = lambda cs, op: [c for c in cs if c.op == op and c.in_loop]  # noqa: E731
    assert [c.per_step for c in looped(layer, "all-gather")] == [runs] * 2 * GATHERS
    assert all(c.axes == ("data",) for c in looped(layer, "all-gather"))
    edges = [cfg.pipeline.microbatches] * EDGES
    assert sorted(c.per_step for c in looped(layer, "reduce-scatter")) == sorted([runs] * SCATTERS + edges)
    assert not looped(step, "all-gather") and not looped(step, "reduce-scatter")
    assert mem_layer.temp_size_in_bytes < mem_step.temp_size_in_bytes
    assert mem_layer.argument_size_in_bytes == mem_step.argument_size_in_bytes  # both rest sharded


def _local_bytes(tree) -> int:
    """Bytes of one device's blocks of a tree of sharded ShapeDtypeStructs."""
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree))


@pytest.mark.parametrize("variant", [LAYER, ["train.zero=2", "train.zero2_reduce=microbatch"]], ids=["zero3", "zero2"])
def test_sharded_state_and_gradient_sums_fall_as_one_over_data(variant):
    """tensor 1, data 2, 4, 8: per device the state ZeRO shards (the compiled step's arguments, less
    ZeRO-2's whole params: ZeRO-3's params and Adam's moments, ZeRO-2's moments) and the layers' float32
    gradient sums (their block as `ZeroShardings.layer_sums` makes it in the loop) are 2/data of data 2's
    within 10% (norm scales and the step counter rest whole)."""
    sharded = {}
    for data in (2, 4, 8):
        over = ["mesh.pipe=1", f"mesh.data={data}", "mesh.tensor=1", "pipeline.microbatches=2", *variant]
        cfg = _cfg("tiny_cpu.yaml", over)
        ts = make_train_step(cfg, build_mesh(cfg.mesh, devices=jax.devices()[:data]))
        batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.train.seq_len), np.int32, sharding=ts.batch_sharding)
        args = ts.step.lower(ts.abstract_run, batch, batch).compile().memory_analysis().argument_size_in_bytes
        whole = 0 if variant == LAYER else _local_bytes(ts.abstract_run.params)
        layers = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.sharding.shard_shape(a.shape), a.dtype),
                              ts.abstract_run.params["layers"])  # fmt: skip
        sums = jax.eval_shape(ts.plan.zero.sub("layers").layer_sums, layers)
        sharded[data] = (args - whole, sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(sums)))
    for data in (4, 8):
        for got, base in zip(sharded[data], sharded[2], strict=True):
            assert got == pytest.approx(base * 2 / data, rel=0.1), (data, sharded)


def test_auto_gathers_per_layer_by_the_gathered_bytes():
    """auto: per layer where the gathered weights would exceed 1 GiB per device and the layout runs it."""
    assert not zero3_per_layer("auto", 3, False, 2**29, refused=False)
    assert zero3_per_layer("auto", 3, False, 2**31, refused=False)
    assert not zero3_per_layer("auto", 3, False, 2**31, refused=True)
    assert zero3_per_layer("step", 3, True, 0, refused=False)  # offload_params: its fetch is per layer
    assert not zero3_per_layer("layer", 1, False, 2**31, refused=False)
    cfg = _cfg("tiny_cpu.yaml", ["train.zero=3"])
    assert build_plan(cfg, build_mesh(cfg.mesh)).zero3_gather == "step"  # a tiny model gathers once
    cfg = _cfg("tiny_cpu.yaml", LAYER)
    plan = build_plan(cfg, build_mesh(cfg.mesh))
    assert plan.zero3_gather == "layer" and plan.zero.fsdp and not plan.zero.from_host


@pytest.mark.parametrize(
    "over,fix",
    [
        (["train.zero=1", "train.zero3_gather=layer"], "set train.zero=3"),
        (
            [*LAYER, "pipeline.overlap_grad_reduce=true", "pipeline.schedule=interleaved", "pipeline.virtual=2"],
            "set pipeline.overlap_grad_reduce=false",
        ),
        (["train.zero=3", "train.zero3_gather=step", "offload.params=true"], "leave it auto"),
        (["train.zero=3", "train.zero3_gather=sometimes"], "use one of"),
    ],
    ids=["zero1", "overlap-grad-reduce", "step-with-offload-params", "unknown"],
)
def test_a_variant_the_layout_cannot_run_exits_2_naming_the_field(over, fix, capsys, tmp_path):
    assert main(["train", "configs/tiny_cpu.yaml", *over, f"train.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train.zero3_gather" in err and fix in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
