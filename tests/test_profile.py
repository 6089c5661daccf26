"""`meshrun profile`: busy / idle / collective time per stage from a profiler trace, the measured bubble."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from meshrun.analysis.trace import device_times, stage_report
from meshrun.cli.main import main
from meshrun.config import load_config
from meshrun.train.loop import run

ROOT = Path(__file__).resolve().parents[1]

# Devices 0..3 as pipe=2 x tensor=2: the permute runs over 'pipe', the all-reduce over 'tensor'.
HLO = """HloModule jit_step, is_scheduled=true

%branch (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %fusion.1 = f32[4]{0} fusion(%p), kind=kLoop, calls=%fused
}

ENTRY %main (a: f32[4], i: s32[]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %i = s32[] parameter(1)
  %conditional.2 = f32[4]{0} conditional(%i, %a), branch_computations={%branch}
  %ppermute.3 = f32[4]{0} collective-permute(%a), channel_id=1, source_target_pairs={{0,2},{2,0},{1,3},{3,1}}
  %all-reduce.4 = f32[4]{0} all-reduce(%a), channel_id=2, replica_groups={{0,1},{2,3}}, to_apply=%add
  ROOT %copy.5 = f32[4]{0} copy(%a)
}
"""
# (device, op, start us, end us) of one step. Device 0: the conditional spans two fusions (busy 20)
# and the copy (10) -> busy 30, pipe 15, tensor 10, idle 45. Device 2: a copy overlapping a fusion
# -> busy [0, 40] = 40; the permute counts outside busy only: [40, 100] = 60; idle 0. Span 100.
STEP = [
    (0, "conditional.2", 0, 50), (0, "fusion.1", 10, 20), (0, "fusion.1", 30, 40), (0, "ppermute.3", 45, 60),
    (0, "all-reduce.4", 60, 70), (0, "copy.5", 80, 90),
    (2, "fusion.1", 0, 30), (2, "copy.5", 20, 40), (2, "ppermute.3", 35, 100),
]  # fmt: skip


def _events(gpu: bool) -> list[dict]:
    """XLA:CPU style: device_ordinal + run_id in args, 2 steps. GPU style: the device in the process
    name, no run ids, 1 step."""
    meta = [{"ph": "M", "pid": 10 + d, "name": "process_name", "args": {"name": f"/device:GPU:{d}"}} for d in (0, 2)]
    other = {"hlo_op": "fusion.1", "hlo_module": "jit_other", "device_ordinal": "0"}  # another module: ignored
    out = [{"ph": "X", "pid": 1, "ts": 5.0, "dur": 500.0, "name": "Wait: pending", "args": {}},
           {"ph": "X", "pid": 1, "ts": 0.0, "dur": 999.0, "name": "x", "args": other}]  # fmt: skip
    for step in (0,) if gpu else (0, 1):
        for dev, op, s, e in STEP:
            args = {"hlo_op": op, "hlo_module": "jit_step"}
            args |= {} if gpu else {"device_ordinal": str(dev), "run_id": str(7 + step)}
            pid = 10 + dev if gpu else 1
            out.append({"ph": "X", "pid": pid, "ts": 1000.0 * step + s, "dur": e - s, "name": op, "args": args})
    return (meta if gpu else []) + out


@pytest.mark.parametrize("gpu", [False, True])
def test_device_times_and_stages_from_a_synthetic_trace(gpu):
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("pipe", "tensor"))
    times = device_times(_events(gpu), HLO, mesh, steps=1)
    assert sorted(times) == [0, 2]
    t0, t2 = times[0], times[2]
    steps = 1 if gpu else 2
    assert t0["steps"] == t2["steps"] == steps
    us = 1e-6 * steps
    assert t0["span"] == pytest.approx(100 * us) and t2["span"] == pytest.approx(100 * us)
    assert t0["busy"] == pytest.approx(30 * us) and t2["busy"] == pytest.approx(40 * us)
    assert t0["collective"] == pytest.approx({"pipe": 15 * us, "tensor": 10 * us, "total": 25 * us})
    assert t2["collective"] == pytest.approx({"pipe": 60 * us, "total": 60 * us})
    assert t0["idle"] == pytest.approx(45 * us) and t2["idle"] == pytest.approx(0, abs=1e-12)

    rep = stage_report(times, mesh, [0.25, 0.5])
    s0, s1 = rep["stages"]
    assert (s0["stage"], s0["devices"], s1["stage"], s1["devices"]) == (0, [0], 1, [2])
    assert s0["busy_s"] == pytest.approx(30e-6) and s0["idle_s"] == pytest.approx(45e-6)
    assert s0["measured_bubble"] == pytest.approx(0.7) and s1["measured_bubble"] == pytest.approx(0.6)
    assert (s0["predicted_bubble"], s1["predicted_bubble"]) == (0.25, 0.5)
    assert s1["collective_s"] == pytest.approx({"pipe": 60e-6, "total": 60e-6})
    assert rep["collective_share"] == pytest.approx({"pipe": 75 / 85, "tensor": 10 / 85})


def test_profile_cli_on_a_pipelined_run(tmp_path, capsys):
    over = ["mesh.data=1", "mesh.pipe=4", "mesh.tensor=2", "pipeline.microbatches=4", "train.global_batch=8",
            "train.seq_len=16", "model.max_seq_len=16", "data.kind=synthetic"]  # fmt: skip
    over.append(f"train.run_dir={tmp_path / 'run'}")
    assert main(["profile", str(ROOT / "configs/tiny_cpu.yaml"), *over, "--steps", "2", "--json"]) == 0
    out, err = capsys.readouterr()
    rep = json.loads(out.strip().splitlines()[-1])
    assert rep["steps"] == 2 and rep["mesh"]["pipe"] == 4
    assert [r["stage"] for r in rep["stages"]] == [0, 1, 2, 3]
    for r in rep["stages"]:
        assert len(r["devices"]) == 2
        assert 0 <= r["measured_bubble"] <= 1 and r["busy_s"] > 0 and r["collective_s"]["pipe"] > 0
        assert r["busy_s"] + r["idle_s"] + r["collective_s"]["total"] == pytest.approx(r["span_s"], rel=1e-6)
    assert rep["stages"][0]["predicted_bubble"] == pytest.approx(3 / 7)  # 1F1B, p=4, m=4: (p-1)/(m+p-1)
    written = json.loads((tmp_path / "run" / "profile" / "profile.json").read_text())
    assert written == rep
    # where the trace is and how to open it; the per-device timeline next to it (with matplotlib)
    trace = next((tmp_path / "run" / "profile").rglob("perfetto_trace.json.gz"))
    assert f"trace: {trace}" in err and "https://ui.perfetto.dev" in err
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no timeline picture: matplotlib is not installed" in err and rep["timeline_png"] is None
    else:
        png = tmp_path / "run" / "profile" / "timeline.png"
        assert rep["timeline_png"] == str(png) and f"timeline: {png} (" in err
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_profile_bad_input_exits_2(tmp_path, capsys):
    assert main(["profile", str(tmp_path / "missing.yaml")]) == 2
    assert main(["profile", str(ROOT / "configs/tiny_cpu.yaml"), "--steps", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "config" in err[0] and err[1].startswith("meshrun profile: error: --steps:")
    assert "Traceback" not in "\n".join(err)


def test_train_profile_true_writes_the_report(tmp_path, capsys):
    over = ["mesh.data=1", "mesh.pipe=2", "mesh.tensor=1", "model.n_layers=2", "pipeline.microbatches=2",
            "train.global_batch=4", "train.seq_len=16", "model.max_seq_len=16", "data.kind=synthetic",
            "train.steps=1", "train.profile=true", "checkpoint.async_save=false"]  # fmt: skip
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", [*over, f"train.run_dir={tmp_path}"])
    run(cfg, devices=jax.devices()[:2], quiet=True)
    rep = json.loads((tmp_path / "profile" / "profile.json").read_text())
    assert rep["steps"] == 1 and [r["stage"] for r in rep["stages"]] == [0, 1]
    assert all(r["busy_s"] > 0 and r["collective_s"]["pipe"] > 0 for r in rep["stages"])
    assert "train.profile: mesh pipe=2" in capsys.readouterr().err


# ------------------------------------------------------------------ the per-device timeline

# Forward/backward from autodiff's op names; the per-op executor's tick switch decides F/B/W; a fusion
# without op_name takes the phase of the computation it calls; the optimizer's add is "other".
PHASE_HLO = """HloModule jit_step, is_scheduled=true

%fused (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %mul.9 = f32[4]{0} multiply(%p, %p), metadata={op_name="jit(step)/transpose(jvp(layer))/mul"}
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %dot.1 = f32[4]{0} dot(%a, %a), metadata={op_name="jit(step)/jvp(layer)/dot_general"}
  %fusion.2 = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused, metadata={stack_frame_id=3}
  %ppermute.3 = f32[4]{0} collective-permute(%a), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %dot.4 = f32[4]{0} dot(%a, %a), metadata={op_name="jit(step)/while/body/closed_call/per_op_W/cond/branch_1_fun/dot"}
  ROOT %add.5 = f32[4]{0} add(%a, %a), metadata={op_name="jit(step)/add"}
}
"""


def test_op_phases_from_op_names():
    from meshrun.analysis.trace import op_phases

    got = op_phases(PHASE_HLO)
    # the per-op executor's W scope (dot.4) marks a per-op program: its ops take the tick op's phase
    assert got["dot.1"] == "forward" and got["fusion.2"] == "backward" and got["mul.9"] == "backward"
    assert got["dot.4"] == "weight" and got["add.5"] == "other"
    lockstep = PHASE_HLO.replace("per_op_W/cond/branch_1_fun/dot", "dot")  # no per-op tick: no W phase
    assert op_phases(lockstep)["dot.4"] == "other"


def test_device_intervals_split_one_step_by_phase():
    from meshrun.analysis.trace import device_intervals

    mesh = Mesh(np.array(jax.devices()[:2]), ("pipe",))
    # device 0, run 7 (then run 8, ignored): forward [0,10], backward [10,20], permute [15,40] -> only
    # [20,40] is collective time; weight [50,60]; other [60,65]; idle [40,50]
    step = [("dot.1", 0, 10), ("fusion.2", 10, 20), ("ppermute.3", 15, 40), ("dot.4", 50, 60), ("add.5", 60, 65)]
    events = []
    for run_id, t0 in (("7", 1000.0), ("8", 2000.0)):
        for op, s, e in step:
            args = {"hlo_op": op, "hlo_module": "jit_step", "device_ordinal": "0", "run_id": run_id}
            events.append({"ph": "X", "pid": 1, "ts": t0 + s, "dur": e - s, "name": op, "args": args})
    got = device_intervals(events, PHASE_HLO, mesh)
    us = 1e-6
    want = [(0, 10, "forward"), (10, 20, "backward"), (20, 40, "collective"), (50, 60, "weight"), (60, 65, "other")]
    assert list(got) == [0]
    assert [(pytest.approx(s * us), pytest.approx(e * us), w) for s, e, w in want] == got[0]


def test_timeline_without_matplotlib_is_a_note(tmp_path, capsys, monkeypatch):
    import sys

    from meshrun.analysis.trace import draw_timeline

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    with pytest.raises(ImportError):
        draw_timeline(
            {0: [(0.0, 1.0, "forward")]}, Mesh(np.array(jax.devices()[:1]), ("pipe",)), tmp_path / "t.png", ""
        )
    over = ["mesh.data=8", "mesh.pipe=1", "mesh.tensor=1", "model.n_layers=1", "train.global_batch=8",
            "pipeline.microbatches=1", "train.seq_len=16", "model.max_seq_len=16", "data.kind=synthetic",
            f"train.run_dir={tmp_path / 'run'}"]  # fmt: skip
    assert main(["profile", str(ROOT / "configs/tiny_cpu.yaml"), *over, "--steps", "1"]) == 0
    err = capsys.readouterr().err
    assert "meshrun profile: note: no timeline picture: matplotlib is not installed: pip install matplotlib" in err
    assert not (tmp_path / "run" / "profile" / "timeline.png").exists()
