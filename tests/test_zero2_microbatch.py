"""ZeRO-2 per microbatch (train.zero2_reduce=microbatch, DeepSpeed's ZeRO-2): each layer's gradient is
reduce-scattered as the backward makes it, every microbatch, and added into float32 sums that are
themselves sharded (1/DP of the bytes); train.zero2_reduce=step keeps whole sums reduced once a step.

Checked: one-device parity (losses and params after 3 steps, fp32 rtol 1e-5) on data, data x tensor and
pipeline layouts (1F1B, interleaved, ZB-H1, ZB-V: the stage's vjp differentiates the sharded sums);
the compiled HLO (the layers' reduce-scatters inside the loops, once per layer and microbatch; none
there once per step); memory_analysis below once-per-step; bad input.
"""

import jax
import numpy as np
import pytest
from test_train import _cfg, assert_same, reference, run_steps
from test_zero3_layer import DP8, EDGES, WEIGHTS, compiled_step

from meshrun.cli.main import main
from meshrun.config import zero2_per_microbatch
from meshrun.runtime.mesh import build_mesh
from meshrun.train.plan import build_plan

MB = ["train.zero=2", "train.zero2_reduce=microbatch"]


@pytest.mark.parametrize(
    "over",
    [
        ["mesh.pipe=1", "mesh.data=4", "mesh.tensor=2", "pipeline.microbatches=4"],
        ["mesh.pipe=1", "mesh.data=8", "mesh.tensor=1", "pipeline.microbatches=1"],
    ],
    ids=["data4-tensor2-m4", "data8-m1"],
)
def test_zero2_per_microbatch_matches_one_device(over):
    got = run_steps(_cfg("tiny_cpu.yaml", [*over, *MB]))
    assert_same(got, reference("tiny_cpu.yaml"))


@pytest.mark.parametrize(
    "over",
    [
        [],
        pytest.param(["pipeline.schedule=interleaved", "pipeline.virtual=2"], marks=pytest.mark.slow),
        pytest.param(["pipeline.schedule=zb-h1"], marks=pytest.mark.slow),
        pytest.param(["pipeline.schedule=zb-v"], marks=pytest.mark.slow),
    ],
    ids=["1f1b", "interleaved", "zb-h1", "zb-v"],
)
def test_zero2_per_microbatch_pipelined_matches_one_device(over):
    """data 2 x pipe 2 x tensor 2: each stage's vjp sends every layer's gradient, reduce-scattered over
    'data', to the stage's sharded float32 sums (the B/W split of ZB-H1 and ZB-V: in W)."""
    got = run_steps(_cfg("tiny_cpu.yaml", [*over, *MB]))
    assert_same(got, reference("tiny_cpu.yaml"))


@pytest.mark.slow
def test_zero2_per_microbatch_matches_one_device_moe_expert():
    """data 2 x expert 2 x tensor 2, MoE every other layer: the experts' gradients are reduce-scattered
    over 'data' only (they stay split over 'expert')."""
    got = run_steps(_cfg("tiny_moe_cpu.yaml", MB))
    assert_same(got, reference("tiny_moe_cpu.yaml"))


def test_layers_reduce_scattered_inside_the_loop_and_sums_sharded():
    """data 8, 2 microbatches, 4 layers: each layer weight's gradient is reduce-scattered inside a loop
    once per layer and microbatch (the embedding's and head's once per microbatch), nothing
    all-gathered there; once a step: no collective of the layers in any loop. The per-microbatch
    step's temporaries are below once-per-step's (float32 sums of 1/8 of the layers' bytes)."""
    cfg, _, mb, mem_mb = compiled_step([*DP8, *MB])
    _, _, step, mem_step = compiled_step([*DP8, "train.zero=2", "train.zero2_reduce=step"])
    runs = cfg.model.n_layers * cfg.pipeline.microbatches
    looped = lambda cs, op: [c for c in cs if c.op == op and c.in_loop]  # noqa: E731
    edges = [cfg.pipeline.microbatches] * EDGES
    assert sorted(c.per_step for c in looped(mb, "reduce-scatter")) == sorted([runs] * WEIGHTS + edges)
    assert not looped(mb, "all-gather")
    assert not looped(step, "reduce-scatter") and not looped(step, "all-gather")
    assert mem_mb.temp_size_in_bytes < mem_step.temp_size_in_bytes


@pytest.mark.slow
def test_pipelined_layers_reduce_scattered_inside_the_tick_loop():
    """data 2 x pipe 2 x tensor 2, 1F1B over 4 microbatches: every layer weight's gradient is
    reduce-scattered over 'data' inside the tick loop (per layer of a backward tick: at least the
    stage's 2 layers x 4 microbatches a step, idle ticks' counted too), and the embedding's and head's
    (the first and last stage's vjps) at least once per microbatch, nothing all-gathered there; once a
    step, no reduce-scatter there. The per-microbatch step's temporaries are below once-per-step's."""
    cfg, _, mb, mem_mb = compiled_step(MB)
    _, _, step, mem_step = compiled_step(["train.zero=2", "train.zero2_reduce=step"])
    looped = lambda cs, op: [c for c in cs if c.op == op and c.in_loop]  # noqa: E731
    scatters = looped(mb, "reduce-scatter")
    edge = 4 * cfg.model.vocab * cfg.model.d_model // (cfg.mesh.tensor * cfg.mesh.data)  # a 1/DP shard's bytes
    edges, layers = [c for c in scatters if c.bytes == edge], [c for c in scatters if c.bytes != edge]
    per_stage = cfg.model.n_layers // cfg.mesh.pipe * cfg.pipeline.microbatches
    assert layers and len(layers) % WEIGHTS == 0 and {c.axes for c in scatters} == {("data",)}
    assert sum(c.per_step for c in layers) >= WEIGHTS * per_stage
    assert len(edges) == EDGES and min(c.per_step for c in edges) >= cfg.pipeline.microbatches
    assert not looped(mb, "all-gather") and not looped(step, "reduce-scatter")
    assert mem_mb.temp_size_in_bytes < mem_step.temp_size_in_bytes


def test_auto_and_plan():
    assert zero2_per_microbatch("auto", 2, 2**31, refused=False)
    assert not zero2_per_microbatch("auto", 2, 2**29, refused=False)
    assert not zero2_per_microbatch("auto", 2, 2**31, refused=True)
    assert not zero2_per_microbatch("microbatch", 1, 2**31, refused=False)
    cfg = _cfg("tiny_cpu.yaml", ["mesh.pipe=1", "mesh.data=4", *MB])
    plan = build_plan(cfg, build_mesh(cfg.mesh, devices=jax.devices()[:8]))
    assert plan.zero2_reduce == "microbatch" and plan.zero.fsdp and plan.zero3_gather is None
    cfg = _cfg("tiny_cpu.yaml", ["mesh.pipe=1", "mesh.data=4", "train.zero=2"])
    assert build_plan(cfg, build_mesh(cfg.mesh, devices=jax.devices()[:8])).zero2_reduce == "step"


@pytest.mark.parametrize(
    "over,fix",
    [
        ([*MB, "pipeline.schedule=zb-v", "pipeline.overlap_grad_reduce=true"], "overlap_grad_reduce=false"),
        (["train.zero=1", "train.zero2_reduce=microbatch"], "set train.zero=2"),
        (["train.zero=2", "train.zero2_reduce=often"], "use one of"),
    ],
    ids=["overlap-grad-reduce", "zero1", "unknown"],
)
def test_a_variant_the_layout_cannot_run_exits_2_naming_the_field(over, fix, capsys, tmp_path):
    assert main(["train", "configs/tiny_cpu.yaml", *over, f"train.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train.zero2_reduce" in err and fix in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_sums_are_one_dp_shard():
    """The layers' float32 sums inside the loop are 1/DP of the layers (`ZeroShardings.layer_sums`)."""
    cfg = _cfg("tiny_cpu.yaml", [*DP8, *MB])
    zl = build_plan(cfg, build_mesh(cfg.mesh)).zero
    layers = build_plan(cfg, build_mesh(cfg.mesh)).abstract_params["layers"]
    sums = zl.layer_sums(layers)
    big = [
        (s.shape, a.shape) for s, a in zip(jax.tree.leaves(sums), jax.tree.leaves(layers), strict=True) if a.ndim > 2
    ]
    assert big and all(np.prod(s) * 8 == np.prod(a) for s, a in big)
