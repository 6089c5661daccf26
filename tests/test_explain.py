"""`meshrun explain`: the planner's memory and collective predictions against the compiled step.

Each layout compiles once (~10-30 s on 2 cores); nothing runs. Compiled total = argument + temp +
output - alias from `memory_analysis()` (outputs alias the donated state). Besides the tiny configs,
two layouts of other width, depth, mesh and schedule check that the model generalises.
"""

import json

import pytest

from meshrun.cli.main import main
from meshrun.config import load_config
from meshrun.report import explain

TOL = 0.15  # predicted per-device memory within +-15% of the compiled step


def _ratio(rep) -> float:
    return rep["memory"]["predicted"]["total"] / rep["memory"]["compiled"]["total"]


def _planner_total(cfg, rep) -> float:
    """`meshrun plan --framework meshrun`'s per-device bytes for the layout (no GPU runtime overheads)."""
    from meshrun.planner import cost

    lay = explain.planner_layout(cfg, rep["mesh"])
    return cost.predict_memory(cfg.model, lay, seq_len=cfg.train.seq_len)["total"]


# Widths, depths, meshes and schedules the step model's per-layer constants were not read from.
WIDE_DEEP = ["model.d_model=128", "model.n_heads=8", "model.n_kv_heads=4", "model.n_layers=6", "model.d_ff=256"]
INTERLEAVED = ["model.d_model=96", "model.head_dim=24", "model.n_layers=8", "model.d_ff=160"]
INTERLEAVED += ["pipeline.schedule=interleaved", "pipeline.virtual=2", "pipeline.microbatches=4", "train.zero=1"]


@pytest.mark.parametrize(
    "path, overrides",
    [
        ("configs/tiny_cpu.yaml", ["mesh.pipe=1", "mesh.data=4"]),
        ("configs/tiny_moe_cpu.yaml", []),
        ("configs/tiny_cpu.yaml", [*WIDE_DEEP, "mesh.data=1", "mesh.pipe=2", "mesh.tensor=4"]),
        ("configs/tiny_cpu.yaml", INTERLEAVED),
    ],
    ids=["dense-nopipe-data4", "moe-data2-expert2-tensor2", "unfitted-pipe2-tensor4", "unfitted-interleaved-zero1"],
)
def test_predicted_memory_matches_compiled(path, overrides):
    rep = explain.explain(load_config(path, overrides))
    assert rep["compiled"]
    pm, cm = rep["memory"]["predicted"], rep["memory"]["compiled"]
    assert abs(_ratio(rep) - 1) <= TOL, (pm, cm)
    assert _planner_total(load_config(path, overrides), rep) == pytest.approx(pm["total"], rel=1e-6)
    # The step's arguments are the state: params + Adam m, v (fp32), predicted almost exactly.
    assert pm["argument"] == pytest.approx(cm["argument"], rel=0.02)
    # Collectives per step: every axis of the mesh carries traffic and the prediction matches it.
    pc, cc = rep["collectives"]["predicted"], rep["collectives"]["compiled"]
    live = {a for a, n in rep["mesh"].items() if n > 1}
    assert set(cc) == live
    for a in live:
        assert pc[a] == pytest.approx(cc[a], rel=0.05), a
    # Per-step counts include the loop trip counts: more than the static HLO count.
    assert rep["counts"]["compiled"]["all-reduce"] > rep["counts"]["compiled_static"]["all-reduce"]


def test_cli_json_tiny_cpu_pipeline(capsys):
    assert main(["explain", "configs/tiny_cpu.yaml", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert set(rep) >= {"memory", "collectives", "counts", "mesh"}
    mem, comm = rep["memory"], rep["collectives"]
    assert set(mem) >= {"predicted", "compiled"} and set(comm) >= {"predicted", "compiled"}
    for k in ("argument", "temp", "output", "total"):
        assert mem["compiled"][k] > 0
    assert mem["compiled"]["host"] == 0 and mem["compiled"]["device"] == mem["compiled"]["total"]  # no offload
    for k in ("params", "grads", "optimizer", "activations", "logits", "total"):
        assert mem["predicted"][k] > 0
    assert abs(_ratio(rep) - 1) <= TOL, mem
    for a in ("tensor", "pipe", "data"):  # data=2 x pipe=2 x tensor=2
        assert comm["compiled"][a] > 0 and comm["predicted"][a] > 0
    assert comm["predicted"]["tensor"] == pytest.approx(comm["compiled"]["tensor"], rel=0.05)
    assert comm["predicted"]["data"] == pytest.approx(comm["compiled"]["data"], rel=0.05)
    # 1F1B p=2 m=4: the executor's tick phases send 9 activations/gradients over 'pipe' (b*s*h fp32 each);
    # the 4 steady ticks send both ways, each as one swap: 5 collective-permutes.
    assert rep["counts"]["compiled"]["collective-permute"] == rep["counts"]["predicted"]["collective-permute"] == 5
    assert comm["predicted"]["pipe"] == pytest.approx(comm["compiled"]["pipe"], rel=0.05)


def test_large_mesh_prints_prediction_only(capsys):
    assert main(["explain", "configs/gpt3_175b_a100.yaml"]) == 0
    out = capsys.readouterr().out
    assert "compiling needs the real device count (1024)" in out
    assert "predicted" in out and "tensor" in out


def test_bad_override_exits_2(capsys):
    assert main(["explain", "configs/tiny_cpu.yaml", "mesh.tensr=2"]) == 2
    assert "mesh.tensr" in capsys.readouterr().err


# Calibration of the planner against meshrun itself: with the two "unfitted" layouts above, six
# layouts whose widths, depths, meshes, ZeRO stages and schedules no step-model constant was read from.
# Tiny (d_model 32, 2 layers, seq 16): one cheap compile each.
TINY = ["model.d_model=32", "model.n_heads=4", "model.head_dim=8", "model.d_ff=64", "model.n_layers=2"]
TINY += ["train.seq_len=16", "model.max_seq_len=16", "train.global_batch=8", "mesh.pipe=1"]
CALIBRATION_LAYOUTS = {
    "data2-tensor4-zero1": ["model.n_kv_heads=4", "mesh.data=2", "mesh.tensor=4", "train.zero=1"],
    "data4-zero2-m2": ["mesh.data=4", "mesh.tensor=1", "train.zero=2", "pipeline.microbatches=2"],
    "data4-zero3": ["mesh.data=4", "mesh.tensor=1", "train.zero=3", "pipeline.microbatches=1"],
    "pipe2-tensor2-gpipe": ["mesh.pipe=2", "mesh.data=1", "pipeline.schedule=gpipe", "pipeline.microbatches=4"],
}


@pytest.mark.parametrize("name", list(CALIBRATION_LAYOUTS))
def test_planner_matches_meshrun_step(name):
    """`meshrun plan --framework meshrun`'s per-device memory within +-15% of the compiled step's and
    its collective bytes per mesh axis within +-5%."""
    cfg = load_config("configs/tiny_cpu.yaml", TINY + CALIBRATION_LAYOUTS[name])
    rep = explain.explain(cfg)
    plan = _planner_total(cfg, rep)
    assert plan == pytest.approx(rep["memory"]["predicted"]["total"], rel=1e-6)  # one model, not two
    assert plan == pytest.approx(rep["memory"]["compiled"]["total"], rel=TOL), rep["memory"]
    pc, cc = rep["collectives"]["predicted"], rep["collectives"]["compiled"]
    live = {a for a, n in rep["mesh"].items() if n > 1}
    assert set(cc) == live
    for a in live:
        assert pc[a] == pytest.approx(cc[a], rel=0.05), a


# Parameter-heavy (d_model 256, 16 tokens a sequence): the gradient bytes dominate, so a ZeRO stage
# that the planner credits with a saving the step does not make shows. meshrun reduces once after the
# loop at every stage: ZeRO-2's fresh gradients are whole, as ZeRO-1's (compiled bytes are equal).
PARAM_HEAVY = ["model.d_model=256", "model.d_ff=1024", "model.head_dim=64", "model.n_heads=4", "model.n_kv_heads=4"]
PARAM_HEAVY += ["model.n_layers=4", "model.vocab=256", "train.seq_len=16", "model.max_seq_len=16"]
PARAM_HEAVY += ["train.global_batch=32", "mesh.pipe=1", "mesh.data=8", "mesh.tensor=1", "pipeline.microbatches=1"]


@pytest.mark.parametrize("zero", [2, 3])
def test_planner_counts_whole_fresh_gradients_under_zero(zero):
    cfg = load_config("configs/tiny_cpu.yaml", [*PARAM_HEAVY, f"train.zero={zero}"])
    rep = explain.explain(cfg)
    plan = _planner_total(cfg, rep)
    assert plan == pytest.approx(rep["memory"]["compiled"]["total"], rel=TOL), rep["memory"]
    if zero == 2:
        one = load_config("configs/tiny_cpu.yaml", [*PARAM_HEAVY, "train.zero=1"])
        rep1 = explain.explain(one)
        assert rep["memory"]["compiled"]["total"] == rep1["memory"]["compiled"]["total"]
        assert plan == pytest.approx(_planner_total(one, rep1), rel=1e-9)


PER_OP_WIDE = ["model.d_model=256", "model.d_ff=1024", "model.head_dim=64", "model.n_heads=4", "model.n_kv_heads=2"]


@pytest.mark.parametrize("sched", ["pipeline.executor=per_op", "pipeline.schedule=zb-h1"])
def test_planner_memory_matches_the_per_op_executor(sched):
    """The per-op executor (1F1B with a split backward, zb-h1): residual slots, B's stash slots, the
    dy buffer and the in-place gradient sums as the planner counts them, within +-15% of the compiled
    step at a width the constants were not read from."""
    cfg = load_config("configs/tiny_cpu.yaml", [sched, "pipeline.microbatches=8", *PER_OP_WIDE])
    rep = explain.explain(cfg)
    assert rep["compiled"]
    plan = _planner_total(cfg, rep)
    assert plan == pytest.approx(rep["memory"]["compiled"]["total"], rel=TOL), rep["memory"]


def test_pipe_sends_the_sequence_slice_under_sequence_parallelism():
    """With model.sequence_parallel the residual stream a stage sends is split over 'tensor' along the
    sequence, so each device's collective-permute over 'pipe' carries b s h / t (as Megatron's
    scatter/gather sends), the payload the planner's pipe bytes and `_pipe_seconds` count
    (`step_model.pipe_payload`): zb-v on the per-op executor, the schedule of `meshrun plan`'s best
    GPT-3 175B layout."""
    from meshrun.analysis import hlo
    from meshrun.planner.step_model import pipe_payload

    over = [*TINY, "model.n_layers=4", "mesh.pipe=2", "mesh.tensor=2", "mesh.data=2", "model.sequence_parallel=true"]
    cfg = load_config("configs/tiny_cpu.yaml", [*over, "pipeline.schedule=zb-v", "pipeline.microbatches=2"])
    compiled, mesh, _ = explain.compile_step(cfg)
    perms = [c for c in hlo.collectives(compiled.as_text(), dict(mesh.shape)) if c.op == "collective-permute"]
    b, s, h, t = 8 // (2 * 2), cfg.train.seq_len, cfg.model.d_model, 2  # rows of a microbatch on a data shard
    assert perms and {(c.axes, c.dims, c.dtypes) for c in perms} == {(("pipe",), ((b, s // t, h),), ("f32",))}
    act = 4.0 * b * s * h  # a float32 microbatch activation of one data shard
    assert {c.bytes for c in perms} == {pipe_payload(act, explain.planner_layout(cfg, dict(mesh.shape)))} == {act / t}


def test_importing_explain_leaves_jax_unimported():
    """`meshrun explain` sets the simulated device count before jax starts: its module imports must not
    pull jax in (hlo.py and memory.py do, so explain imports them late)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    code = "import sys, meshrun.report.explain; sys.exit('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False, cwd=root, env=env).returncode == 0
