"""`meshrun plan --calibrate RUN_DIR ...`: a cluster profile fitted on measured runs, and
`--cluster-profile` using it. The fit on synthetic metrics (step times the planner itself gives for
known constants) must find those constants; bad input exits 2 with one line and writes nothing; the
slow case trains layouts on the 8 simulated CPU devices and predicts a held-out one."""

import json
import math
from pathlib import Path

import pytest
import yaml

from meshrun.config import load_config, to_dict
from meshrun.planner import cluster_profile as cp
from meshrun.planner.hardware import parse_cluster

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
BASE = ["mesh.data=1", "mesh.pipe=1", "mesh.tensor=1", "train.global_batch=32", "checkpoint.every=0"]
LAYOUTS = {
    "d8": ["mesh.data=8"],
    "t2": ["mesh.data=4", "mesh.tensor=2"],
    "p2": ["mesh.data=4", "mesh.pipe=2"],
    "t2p2": ["mesh.data=2", "mesh.pipe=2", "mesh.tensor=2"],
}
CPU8 = {"platform": "cpu", "device_kind": "cpu", "devices": 8, "processes": 1, "local_devices": 8}
TRUE = {"gemm": 0.03, "latency_s": 2e-3}  # the synthetic cluster: these two off their defaults


def run_cli(argv, capsys):
    from meshrun.cli.main import main

    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def write_run(d: Path, layout: str, seconds=None, devices=CPU8) -> Path:
    """A run dir as `meshrun train` leaves it: config.yaml, devices.json and metrics.jsonl whose step
    times (after step 1) have a lower quartile of `seconds` (None: the planner's time under TRUE)."""
    d.mkdir(parents=True, exist_ok=True)
    cfg = load_config(TINY, BASE + LAYOUTS[layout] + [f"train.run_dir={d}"])
    (d / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    (d / "devices.json").write_text(json.dumps(devices))
    if seconds is None:
        (d / "metrics.jsonl").write_text(json.dumps({"step": 2, "step_time_s": 1.0}) + "\n")
        run = cp.read_run(d)
        seconds = cp.predict(run, cp.apply(parse_cluster(run.cluster), cp.defaults(parse_cluster("cpu:1x8")) | TRUE))
    noise = (0.0, 0.02, 0.05, -0.01, 0.01)  # the lower quartile is the 0.0; step 1 (compile) is left out
    rows = [{"step": 1, "step_time_s": 30.0}] + [{"step": s + 2, "step_time_s": seconds * (1 + e)}
                                                   for s, e in enumerate(noise)]  # fmt: skip
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return {name: write_run(root / name, name) for name in LAYOUTS}


def test_fit_finds_the_constants_behind_synthetic_step_times(synthetic):
    """Three layouts' step times made with gemm 0.03 and a 2 ms latency: the fit picks those two of the
    CPU's determined parameters, recovers them within 1%, and predicts the held-out layout within 0.5%."""
    runs = cp.read_runs([synthetic[n] for n in ("d8", "t2", "p2")])
    true = cp.defaults(parse_cluster("cpu:1x8")) | TRUE
    assert [r.measured_s for r in runs] == pytest.approx([cp.predict(r, cp.apply(parse_cluster(r.cluster), true))
                                                          for r in runs], rel=1e-9)  # lower quartiles read  # fmt: skip
    assert set(cp.determined(runs, cp.defaults(parse_cluster("cpu:1x8")))) >= {"gemm", "hbm", "latency_s"}
    params, fitted = cp.fit(runs)
    assert fitted == ("gemm", "latency_s")
    for name, value in TRUE.items():
        assert params[name] == pytest.approx(value, rel=0.01), name
    held = cp.read_run(synthetic["t2p2"])
    pred = cp.predict(held, cp.apply(parse_cluster(held.cluster), params))
    assert pred == pytest.approx(held.measured_s, rel=0.005)
    # one parameter alone cannot fit them: the residual says so
    one, _ = cp.fit(runs, max_params=1)
    assert max(abs(e) for e in cp.residuals(runs, one)) > 0.03


def test_calibrate_writes_a_profile_that_plan_uses(synthetic, tmp_path, capsys):
    out = tmp_path / "cpu.json"
    rc, text, err = run_cli(["--calibrate", *(str(synthetic[n]) for n in ("d8", "t2", "p2")), "--out", str(out)],
                            capsys)  # fmt: skip
    assert rc == 0, err
    assert "fitted: gemm 0.03" in text and "latency_s 0.002" in text
    prof = json.loads(out.read_text())
    assert prof["gpu"] == "cpu" and prof["fitted"] == ["gemm", "latency_s"] and len(prof["runs"]) == 3
    assert all(abs(r["error"]) < 0.005 for r in prof["runs"])
    # the held-out layout, costed by `meshrun plan --cluster-profile` with its --evaluate
    layout = "tensor=2,pipe=2,data=2,microbatches=4,micro_batch_size=4"
    argv = ["--cluster-profile", str(out), "--model", str(TINY), "--global-batch", "32", "--evaluate", layout]
    rc, text, err = run_cli([*argv, "--json"], capsys)
    assert rc == 0, err
    step = json.loads(text)["configs"][0]["step_time_s"]
    held = cp.read_run(synthetic["t2p2"])
    assert step == pytest.approx(held.measured_s, rel=0.005)
    assert json.loads(text)["cluster"] == "cpu:1x8"


def _refused(argv, capsys, *words):
    rc, out, err = run_cli(argv, capsys)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, (rc, out, err)
    for w in words:
        assert w in err, err
    return err


def test_bad_runs_exit_2_naming_what_is_missing_and_write_nothing(synthetic, tmp_path, capsys):
    out = tmp_path / "p.json"
    bare = write_run(tmp_path / "bare", "d8", 1.0)
    (bare / "metrics.jsonl").unlink()
    _refused(["--calibrate", str(synthetic["d8"]), str(bare), "--out", str(out)], capsys, "metrics.jsonl", "bare")
    one = write_run(tmp_path / "one", "d8", 1.0)
    (one / "metrics.jsonl").write_text(json.dumps({"step": 1, "step_time_s": 3.0}) + "\n")
    _refused(["--calibrate", str(one), "--out", str(out)], capsys, "step_time_s", "train.steps")
    old = write_run(tmp_path / "old", "d8", 1.0)
    (old / "devices.json").unlink()
    _refused(["--calibrate", str(old), "--out", str(out)], capsys, "devices.json")
    gpu = write_run(tmp_path / "gpu", "t2", 1.0, {**CPU8, "platform": "gpu", "device_kind": "NVIDIA H100 80GB HBM3"})
    _refused(["--calibrate", str(synthetic["d8"]), str(gpu), "--out", str(out)], capsys, "h100-80g:1x8", "one cluster")
    _refused(["--calibrate", str(tmp_path / "nowhere"), "--out", str(out)], capsys, "no such run dir")
    fp8 = write_run(tmp_path / "fp8", "d8", 1.0)  # fp8 on a device the catalogue has no fp8 GEMMs for
    raw = yaml.safe_load((fp8 / "config.yaml").read_text())
    (fp8 / "config.yaml").write_text(yaml.safe_dump({**raw, "model": {**raw["model"], "fp8": "tensorwise"}}))
    _refused(["--calibrate", str(synthetic["d8"]), str(fp8), "--out", str(out)], capsys, "model.fp8", "no fp8 GEMMs")
    assert not out.exists()


def test_a_profile_missing_parameters_is_refused(synthetic, tmp_path, capsys):
    prof = tmp_path / "p.json"
    rc, _, err = run_cli(["--calibrate", str(synthetic["d8"]), str(synthetic["t2"]), "--out", str(prof)], capsys)
    assert rc == 0, err
    good = json.loads(prof.read_text())
    del good["params"]["latency_s"], good["params"]["intra_bw"]
    prof.write_text(json.dumps(good))
    plan = ["--cluster-profile", str(prof), "--model", str(TINY), "--global-batch", "32"]
    _refused(plan, capsys, "--cluster-profile", "missing parameters", "intra_bw", "latency_s")
    _refused(["--cluster-profile", str(tmp_path / "none.json"), "--model", str(TINY)], capsys, "none.json")
    good["params"]["latency_s"] = good["params"]["intra_bw"] = 1e-3
    prof.write_text(json.dumps(good))
    _refused([*plan, "--cluster", "h100-80g:1x8"], capsys, "--cluster", "profile", "cpu")


def test_profile_parameters_reach_the_prediction():
    """Each profile parameter moves the step time it should: compute with gemm, the TP all-reduces with
    the latency and the link rate (a layout with tensor=2), nothing when all stay at their defaults."""
    from meshrun.planner import search
    from meshrun.planner.layout import model_layout

    cfg = load_config(TINY, BASE)
    cluster = parse_cluster("cpu:1x8")
    base = cp.defaults(cluster)
    lay = model_layout(cfg.model, tensor=2, data=4, microbatches=4)
    t = lambda **kw: search.evaluate(cfg.model, lay, cp.apply(cluster, base | kw), 32, 64).time  # noqa: E731
    ref = search.evaluate(cfg.model, lay, cluster, 32, 64).time
    assert t()["total"] == ref["total"]
    assert t(gemm=base["gemm"] / 2)["compute"] > 1.5 * ref["compute"]
    assert t(latency_s=1e-3)["tensor_comm"] > 10 * ref["tensor_comm"]
    assert t(intra_bw=base["intra_bw"] / 100)["tensor_comm"] > 2 * ref["tensor_comm"]
    assert math.isclose(t(overlap_cost=0.5)["total"], ref["total"])  # nothing overlaps here


def test_a_burst_of_load_leaves_the_measured_step_alone(tmp_path):
    """Three of seven steps slowed 2x by a load on the machine: the lower quartile is the undisturbed
    step (the median would be 2% up, the mean 43%); every step slowed moves it (nothing is clipped)."""
    d = write_run(tmp_path / "d8", "d8", 1.0)
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    times = [1.0, 1.02, 0.99, 1.01, 2.0, 2.1, 1.9]
    rows = rows[:1] + [{"step": s + 2, "step_time_s": t} for s, t in enumerate(times)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cp.read_run(d).measured_s == pytest.approx(1.0, rel=0.006)
    assert cp.steady_step([2 * t for t in times]) == pytest.approx(2 * cp.read_run(d).measured_s)


def test_simulated_devices_are_measured_by_their_cpu_seconds(tmp_path):
    """On simulated CPU devices at least as many as the host's cores, the measured step is the steps'
    CPU seconds over the cores (a load on the host stretches the wall times, not the work); with more
    cores than devices, or a run without step_cpu_s, the wall times; never on a GPU."""
    walls, cpus = [1.0, 2.0, 1.5, 3.0, 1.2], [1.6, 1.7, 1.6, 1.8, 1.6]
    for name, dev, want in (("cpu", {**CPU8, "host_cores": 2}, (0.8, "cpu")),
                            ("wide", {**CPU8, "host_cores": 16}, (1.2, "wall")),
                            ("old", CPU8, (1.2, "wall"))):  # fmt: skip
        d = write_run(tmp_path / name, "d8", 1.0, dev)
        pairs = zip([9.0, *walls], [9.0, *cpus])  # step 1 (compile) left out
        rows = [{"step": s + 1, "step_time_s": w, "step_cpu_s": c} for s, (w, c) in enumerate(pairs)]
        if name == "old":
            rows = [{k: v for k, v in r.items() if k != "step_cpu_s"} for r in rows]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        run = cp.read_run(d)
        assert (run.measured_s, run.basis) == (pytest.approx(want[0]), want[1]), name


def test_simulated_devices_pay_no_bubble():
    """On the CPU's simulated devices (one host's cores) the other stage's work fills a stage's idle
    ticks: a pipe=2 layout is charged no bubble there, while a GPU cluster charges the schedule's."""
    from meshrun.planner import search
    from meshrun.planner.layout import model_layout

    cfg = load_config(TINY, BASE)
    lay = model_layout(cfg.model, pipe=2, data=4, microbatches=4)
    cpu = search.evaluate(cfg.model, lay, parse_cluster("cpu:1x8"), 32, 64).time
    gpu = search.evaluate(cfg.model, lay, parse_cluster("h100-80g:1x8"), 32, 64).time
    assert cpu["bubble"] == 0 and cpu["bubble_fraction"] == gpu["bubble_fraction"] > 0.1
    assert gpu["bubble"] > gpu["bubble_fraction"] * gpu["compute"]


def test_profile_numbers_round_trip_through_the_file(synthetic, tmp_path, capsys):
    """Small parameters (1e-05) are numbers again when read back (YAML would read them as text)."""
    prof = tmp_path / "p.json"
    rc, _, err = run_cli(["--calibrate", str(synthetic["d8"]), str(synthetic["t2"]), "--out", str(prof)], capsys)
    assert rc == 0, err
    assert cp.load_profile(str(prof))["params"]["latency_s"] == pytest.approx(1e-05)


HELD_OUT = "t2p2"
ROUNDS = 3  # each layout trained this many times, the layouts interleaved; its fastest round is kept


def _fastest_rounds(tmp_path, overrides) -> dict[str, Path]:
    """Each layout's run dir of least measured step (the lower quartile of its steps after the compile) over
    ROUNDS rounds that train every layout in turn: a load on the machine only adds time, and
    interleaving gives every layout the same chances at a quiet moment."""
    from meshrun.train.loop import run

    rounds: dict[str, list[Path]] = {name: [] for name in LAYOUTS}
    for r in range(ROUNDS):
        for name in LAYOUTS:
            d = tmp_path / f"{name}-{r}"
            run(load_config(TINY, BASE + overrides + LAYOUTS[name] + [f"train.run_dir={d}"]), quiet=True)
            rounds[name].append(d)
    return {name: min(ds, key=lambda d: cp.read_run(d).measured_s) for name, ds in rounds.items()}


@pytest.mark.slow
def test_cpu_layouts_calibrate_and_predict_a_held_out_layout(tmp_path, capsys):
    """Train three layouts of a small model on the 8 simulated CPU devices (8 steps each, the fastest
    of ROUNDS interleaved rounds), calibrate on them, and predict a fourth layout (tensor 2 x pipe 2 x
    data 2) within 15% of its measured step (its steps' CPU seconds over the host's cores)."""
    small = ["model.d_model=128", "model.d_ff=384", "model.head_dim=32", "train.steps=8", "train.log_every=1"]
    dirs = _fastest_rounds(tmp_path, small)
    prof = tmp_path / "cpu.json"
    rc, text, err = run_cli(["--calibrate", *(str(dirs[n]) for n in ("d8", "t2", "p2")), "--out", str(prof)], capsys)
    assert rc == 0, err
    print(text)
    held = cp.read_run(dirs[HELD_OUT])
    assert {cp.read_run(d).basis for d in dirs.values()} == {"cpu"}  # 8 devices, at most 8 cores
    cluster = cp.profile_cluster(cp.load_profile(str(prof)), None, str(prof))
    pred = cp.predict(held, cluster)
    err = pred / held.measured_s - 1
    wall = cp.steady_step(cp._step_times(Path(held.path) / cp.METRICS))
    print(f"held out {HELD_OUT}: measured {held.measured_s:.4g} s (wall {wall:.4g} s), predicted {pred:.4g} s "
          f"({err:+.1%})")  # fmt: skip
    assert pred == pytest.approx(held.measured_s, rel=0.15)
