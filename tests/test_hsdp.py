"""Hybrid sharded data parallel (`mesh.zero_group`): ZeRO state sharded over groups of the data axis
and replicated across them; the batch over the whole data axis.

Checked here: the same numbers as one device (losses and params after 3 steps, fp32 rtol 1e-5) at
ZeRO-1, 2 and 3 (both ZeRO-3 gathers, both ZeRO-2 reductions) with groups of 4 and 2 on data 8, with
tensor 2 and with a pipeline; the compiled step's collectives (ZeRO's all-gathers and reduce-scatters inside a
group, one all-reduce of the scattered shards across the groups) and its memory (ZeRO state 1/group
per device); the mesh and the start-up block; a checkpoint written with HSDP resumed with plain ZeRO-3;
the planner (memory and collectives against the compiled step, ZeRO state divided by the group, the
group costed on NVLink and the replicas on the network, the search).
"""

import dataclasses
import json
import re

import pytest
from test_train import _cfg, assert_same, reference, run_steps
from test_zero3_layer import compiled_step

from meshrun.config import load_config
from meshrun.planner.hardware import parse_cluster
from meshrun.runtime.mesh import build_mesh, describe_dict

DP8 = ["mesh.pipe=1", "mesh.data=8", "mesh.tensor=1", "pipeline.microbatches=2"]
DP4_TP2 = ["mesh.pipe=1", "mesh.data=4", "mesh.tensor=2", "pipeline.microbatches=2"]
ZERO = {
    "zero1": ["train.zero=1"],
    "zero2-step": ["train.zero=2", "train.zero2_reduce=step"],
    "zero2-microbatch": ["train.zero=2", "train.zero2_reduce=microbatch"],
    "zero3-step": ["train.zero=3", "train.zero3_gather=step"],
    "zero3-layer": ["train.zero=3", "train.zero3_gather=layer"],
}


def test_hsdp_data4_group2_tensor2_zero3_matches_one_device():
    got = run_steps(_cfg("tiny_cpu.yaml", [*DP4_TP2, "mesh.zero_group=2", *ZERO["zero3-step"]]))
    assert_same(got, reference("tiny_cpu.yaml"))


@pytest.mark.slow
@pytest.mark.parametrize("group", [4, 2])
@pytest.mark.parametrize("zero", list(ZERO))
def test_hsdp_data8_matches_one_device(group, zero):
    got = run_steps(_cfg("tiny_cpu.yaml", [*DP8, f"mesh.zero_group={group}", *ZERO[zero]]))
    assert_same(got, reference("tiny_cpu.yaml"))


@pytest.mark.slow
def test_hsdp_data4_group2_tensor2_zero3_per_layer_matches_one_device():
    got = run_steps(_cfg("tiny_cpu.yaml", [*DP4_TP2, "mesh.zero_group=2", *ZERO["zero3-layer"]]))
    assert_same(got, reference("tiny_cpu.yaml"))


@pytest.mark.slow
def test_hsdp_pipe2_data4_group2_zero3_matches_one_device():
    """1F1B on pipe 2 x replica 2 x data 2: the pipeline's tick loop is manual over 'replica' too."""
    got = run_steps(_cfg("tiny_cpu.yaml", ["mesh.pipe=2", "mesh.data=4", "mesh.tensor=1", "pipeline.microbatches=2",
                                           "mesh.zero_group=2", "train.zero=3"]))  # fmt: skip
    assert_same(got, reference("tiny_cpu.yaml"))


def test_zero3_gathers_and_scatters_inside_the_group_and_all_reduces_across_groups():
    """data 8, group 4, ZeRO-3 (gathered once a step): the mesh is replica 2 x data 4; every all-gather
    and reduce-scatter runs over 'data' (groups of 4 devices), the scattered gradient shards are
    all-reduced over 'replica' (groups of 2) in the same bytes as the reduce-scatters give, and
    nothing but scalars and the unsharded norm scales is all-reduced over all 8. Parameters and Adam
    moments take 1/4 of the whole-model bytes per device: twice plain ZeRO-3's 1/8 on data 8."""
    _, mesh, colls, mem = compiled_step([*DP8, "mesh.zero_group=4", *ZERO["zero3-step"]])
    assert dict(mesh.shape) == {"pipe": 1, "replica": 2, "data": 4, "expert": 1, "context": 1, "tensor": 1}
    moved = [c for c in colls if c.op in ("all-gather", "reduce-scatter")]
    assert moved and {c.axes for c in moved} == {("data",)}
    across = [c for c in colls if c.op == "all-reduce" and c.axes == ("replica",)]
    scattered = sum(c.bytes for c in colls if c.op == "reduce-scatter")
    assert len(across) >= 1 and sum(c.bytes for c in across) == scattered
    whole = sum(c.bytes for c in colls if c.op == "all-reduce" and c.axes == ("replica", "data"))
    assert whole < 0.02 * scattered  # norm scales (not divisible) and the loss/token scalars
    *_, plain = compiled_step([*DP8, *ZERO["zero3-step"]])
    ratio = mem.argument_size_in_bytes / plain.argument_size_in_bytes
    assert 1.95 < ratio <= 2, ratio  # only the norm scales (0.3% of the bytes) are whole in both


def test_the_group_is_neighbouring_devices_of_one_host():
    """2 pretend hosts of 4 devices, data 8, group 4: each ZeRO group is one host's devices; the replica
    groups pair the hosts. Without a group the mesh is as before (no 'replica' axis)."""
    d = describe_dict(build_mesh(pipe=1, data=8, tensor=1, hosts=2, zero_group=4))
    assert d["axes"] == ["pipe", "replica", "data", "expert", "context", "tensor"]
    assert d["groups"]["data"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert d["groups"]["replica"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert (
        describe_dict(build_mesh(pipe=1, data=8, tensor=1, zero_group=8))["axes"]
        == describe_dict(build_mesh(pipe=1, data=8, tensor=1))["axes"]
    )  # one group: plain ZeRO, the mesh unchanged


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_a_checkpoint_saved_with_hsdp_resumes_with_plain_zero3(tmp_path):
    """Saved at step 2 by an HSDP run (group 2 on data 4, stopped after step 3), resumed with plain ZeRO-3
    on data 4: steps 3 and 4 log the losses of an uninterrupted plain ZeRO-3 run, at the layouts' parity
    tolerance (rtol 1e-5: the two layouts sum the gradients in a different order)."""
    from meshrun.train.loop import run

    base = ["train.seq_len=16", "model.max_seq_len=16", "data.kind=synthetic", "mesh.pipe=1", "mesh.data=4",
            "train.zero=3", "train.steps=4", "checkpoint.every=2", "checkpoint.async_save=false"]  # fmt: skip
    cfg = lambda d, *o: load_config("configs/tiny_cpu.yaml", [*base, *o, f"train.run_dir={tmp_path / d}"])  # noqa: E731
    run(cfg("plain"), quiet=True)
    run(cfg("mixed", "mesh.zero_group=2"), quiet=True, stop_after=3)
    run(cfg("mixed"), quiet=True)
    rows = [json.loads(r) for r in (tmp_path / "mixed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 3, 4]
    plain = _losses(tmp_path / "plain")
    for r in rows:
        assert r["loss"] == pytest.approx(plain[r["step"]], rel=1e-5)


def test_the_startup_block_says_hybrid_and_meshrun_mesh_shows_the_replica_axis(capsys):
    from meshrun.cli.main import main
    from meshrun.report.startup import startup_lines
    from meshrun.train.plan import build_plan

    cfg = _cfg("tiny_cpu.yaml", [*DP8, "mesh.zero_group=4", *ZERO["zero3-step"]])
    mesh = build_mesh(cfg.mesh)
    zero = next(ln for ln in startup_lines(cfg, mesh, build_plan(cfg, mesh)) if ln.startswith("zero "))
    assert "hybrid: sharded over 4, replicated over 2" in zero, zero
    assert main(["mesh", "--devices", "8", "mesh.pipe=1", "mesh.data=8", "mesh.zero_group=4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["shape"]["replica"] == 2 and d["shape"]["data"] == 4
    assert main(["mesh", "--devices", "8", "mesh.pipe=1", "mesh.data=8", "mesh.zero_group=4"]) == 0
    out = capsys.readouterr().out
    assert "replica groups: [0,4] [1,5] [2,6] [3,7]" in out and "sharded over groups of 4" in out, out


# ----------------------------------------------------------------------------- the planner


@pytest.mark.slow
def test_planner_predicts_the_compiled_hsdp_step():
    """`meshrun explain` of a parameter-heavy HSDP step (data 8, group 4, ZeRO-3): the planner's memory
    within +-10% of the compiled step's, its state (the step's arguments) within 2%, and its collective
    bytes on 'data' (in the group) and 'replica' (across the groups) within 5%."""
    from test_explain import PARAM_HEAVY, _planner_total

    from meshrun.report import explain

    cfg = load_config("configs/tiny_cpu.yaml", [*PARAM_HEAVY, "mesh.zero_group=4", "train.zero=3"])
    rep = explain.explain(cfg)
    pm, cm = rep["memory"]["predicted"], rep["memory"]["compiled"]
    assert _planner_total(cfg, rep) == pytest.approx(cm["total"], rel=0.10), (pm, cm)
    assert pm["argument"] == pytest.approx(cm["argument"], rel=0.02)
    pc, cc = rep["collectives"]["predicted"], rep["collectives"]["compiled"]
    assert set(cc) == {"data", "replica"}
    for a in cc:
        assert pc[a] == pytest.approx(cc[a], rel=0.05), a


def _llama7b():
    return load_config("configs/models/llama-7b.yaml").model


def test_planner_divides_zero_state_by_the_group():
    """data 32 with groups of 8 holds the ZeRO state of data 8, the activations of data 32."""
    from meshrun.planner import cost

    m = _llama7b()
    for zero in (1, 2, 3):
        hsdp = cost.predict_memory(m, cost.model_layout(m, data=32, zero=zero, zero_group=8), seq_len=4096)
        plain8 = cost.predict_memory(m, cost.model_layout(m, data=8, zero=zero), seq_len=4096)
        plain32 = cost.predict_memory(m, cost.model_layout(m, data=32, zero=zero), seq_len=4096)
        for part in ("params", "grads", "optimizer", "activations"):
            assert hsdp[part] == pytest.approx(plain8[part], rel=1e-12), (zero, part)
        assert hsdp["total"] > plain32["total"]


def test_planner_costs_the_group_on_nvlink_and_the_replicas_on_the_network():
    """ZeRO-1 on 4 nodes x 8, data 32 in groups of 8 (one node): the reduce-scatter and all-gather over the
    node's 8 GPUs, the all-reduce of each 1/8 shard over the 4 nodes, 8 GPUs apart."""
    from meshrun.analysis.flops import param_counts
    from meshrun.planner import cost, timing

    m, cluster = _llama7b(), parse_cluster("h100-80g:4x8")
    lay = cost.model_layout(m, data=32, zero=1, zero_group=8)
    prec = cost.precision_of(m, layout=lay)
    n = param_counts(m)["layers"] + param_counts(m)["embedding"]
    _, per_step, gathers = timing._dp_comm(m, lay, cluster, prec, "meshrun")
    rs = cluster.allreduce_seconds(n * prec.reduce, 8, 1, half=True)
    ag = cluster.allreduce_seconds(n * prec.param, 8, 1, half=True)
    across = cluster.allreduce_seconds(n * prec.reduce / 8, 4, 8)
    assert cluster.levels(8, 1)[0] == (8, cluster.group_bw(8)) and cluster.split_group(4, 8) == (1, 4)
    assert per_step == pytest.approx(rs + across + ag, rel=1e-12) and gathers == pytest.approx(ag, rel=1e-12)


def test_plan_search_tries_hsdp_beside_fsdp(capsys):
    """The search tries each ZeRO-3 layout also with one node's data ranks as its group; the table marks
    it `3L/<group>` or `3S/<group>` (mesh.zero_group; L/S: gathered per layer or once a step)."""
    from meshrun.cli.main import main
    from meshrun.planner import search

    m, cluster = _llama7b(), parse_cluster("h100-80g:4x8")
    layouts = list(search.candidates(m, cluster, 256))
    hsdp = [lay for lay in layouts if lay.zero_group]
    assert hsdp and all(lay.zero == 3 and lay.zero_group * lay.tensor * lay.expert * lay.context == 8 for lay in hsdp)
    plain = {dataclasses.replace(lay, zero_group=0) for lay in hsdp}
    assert plain <= set(layouts)  # beside the same layout's plain ZeRO-3
    argv = ["plan", "--model", "llama-7b", "--cluster", "h100-80g:4x8", "--global-batch", "256", "--top", "20"]
    assert main(argv) == 0
    assert re.search(r" 3[LS]/8 ", capsys.readouterr().out)
    argv = [*argv[:-2], "--evaluate", "tensor=1,data=32,zero=3,zero_group=8", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["configs"][0]["zero_group"] == 8
