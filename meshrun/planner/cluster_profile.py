"""Cluster profiles: the planner's cluster constants fitted on the cluster's own measured runs.

`meshrun plan --calibrate RUN_DIR [RUN_DIR ...]` reads each run dir that `meshrun train` wrote
(config.yaml, metrics.jsonl, devices.json), predicts each run's step time with the planner and fits
the constants of PARAMS to the measured times (least squares in log(predicted / measured),
Levenberg-damped Gauss-Newton in the logs of the parameters). It fits only what the runs determine:
of the parameters that move some run's prediction, the best-fitting set of one, then two, ..., a
larger set taken while it lowers the RMS residual by more than MIN_GAIN and more than the runs' own
noise, at most max(1, runs - 1) parameters. The rest keep the catalogue's figures.
`meshrun plan --cluster-profile FILE` costs layouts with the result.

A run's measured step time is the lower quartile of its step times after the first (which compiles):
the planner predicts an undisturbed step, and a load on the machine, a slow batch or a side job only
adds time. On simulated CPU devices at least as many as the host's cores, it is the lower quartile of
the steps' CPU seconds over the cores (`step_cpu_s`, `host_cores`): the work a step needs, which other
processes on the host do not change, spread over all the cores as the planner's CPU model assumes.
The runs of one profile share a device kind and node shape; their node counts may differ.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
from pathlib import Path

import yaml

from meshrun.config import RunConfig, from_dict, resolve_shape
from meshrun.errors import ConfigError
from meshrun.planner import search
from meshrun.planner.constants import COMM_LATENCY_S, Calibration, calibration_for
from meshrun.planner.fit import fit_logs
from meshrun.planner.hardware import GB, GPUS, Cluster, gpu_of_kind, parse_cluster
from meshrun.planner.layout import layout_of

# The fitted constants, in the order forward selection breaks ties: the kernel calibration's fractions of
# peak (gemm: bf16 GEMMs, hbm: memory-bound kernels, flash: fused attention, fp8: fp8 GEMMs), the link
# rates one way per device (intra_bw: between the devices of a node, inter_bw: off the node), the fixed
# cost of one collective or message, and the share of overlapped communication still charged.
PARAMS = ("gemm", "hbm", "intra_bw", "inter_bw", "latency_s", "overlap_cost", "flash", "fp8")
FRACTIONS = ("gemm", "hbm", "flash", "fp8", "overlap_cost")  # <= 1 on a GPU (its datasheet peak is a peak)
MIN_GAIN = 0.01  # a parameter is fitted when it lowers the RMS of log(predicted / measured) by 1 point
FORMAT = 1  # the profile file's version
METRICS, CONFIG, DEVICES = "metrics.jsonl", "config.yaml", "devices.json"


@dataclasses.dataclass(frozen=True)
class Run:
    """One measured run: what the planner needs to predict its step, and its measured step time."""

    path: str
    cfg: RunConfig
    mesh_shape: dict
    measured_s: float  # the lower quartile of its step times after step 1 (`steady_step`)
    steps: int  # step times the quartile is over
    spread: float  # their median absolute deviation / the median: the measurement's own noise
    kind: str  # device kind (jax's, e.g. 'NVIDIA H100 80GB HBM3', or 'cpu')
    cluster: str  # the cluster string of its devices, e.g. cpu:1x8
    basis: str = "wall"  # what measured_s is of: 'wall' step times, or 'cpu' seconds over the host's cores


def _refuse(path, what: str, fix: str):
    raise ConfigError("--calibrate", str(path), fix, what)


def read_run(path: str | Path) -> Run:
    """The run dir at `path`; a ConfigError naming the file that is missing or unusable."""
    d = Path(path)
    if not d.is_dir():
        _refuse(path, "no such run dir", "give run dirs that `meshrun train` wrote")
    for name in (CONFIG, METRICS, DEVICES):
        if not (d / name).is_file():
            fix = "give run dirs that `meshrun train` wrote" + (" (it writes devices.json since this release: "
                                                                 "rerun it)" if name == DEVICES else "")  # fmt: skip
            _refuse(path, f"no {name} in the run dir", fix)
    times = _step_times(d / METRICS)
    if not times:
        _refuse(path, f"no step_time_s after step 1 in {METRICS}", "train it for at least 2 steps (train.steps)")
    try:
        raw = yaml.safe_load((d / CONFIG).read_text())
        dev = json.loads((d / DEVICES).read_text())
        cfg = from_dict(RunConfig, raw)
    except (ValueError, TypeError, yaml.YAMLError) as e:
        _refuse(path, f"unreadable {CONFIG} or {DEVICES} ({str(e).splitlines()[0][:120]})", "rerun the training")
    if not cfg.model.predictable:
        _refuse(path, f"model.family={cfg.model.family} has no predicted step time", "calibrate on transformer runs")
    kind, n, procs = str(dev.get("device_kind", "")), int(dev.get("devices", 0)), int(dev.get("processes", 1))
    gpu = "cpu" if dev.get("platform") == "cpu" else gpu_of_kind(kind)
    if gpu is None:
        _refuse(path, f"device kind {kind!r} is not in the GPU catalogue", f"use a run on one of {list(GPUS)}")
    if cfg.model.fp8 != "none" and not GPUS[gpu].fp8_flops:
        _refuse(path, f"model.fp8={cfg.model.fp8} ran on {gpu}, which has no fp8 GEMMs to cost",
                "calibrate on runs without model.fp8")  # fmt: skip
    times, basis = _measured(d / METRICS, dev, gpu, times)
    med = statistics.median(times)
    spread = statistics.median(abs(t - med) for t in times) / med
    shape, cluster = resolve_shape(cfg.mesh, n), f"{gpu}:{procs}x{n // procs}"
    return Run(str(path), cfg, shape, steady_step(times), len(times), spread, kind, cluster, basis)


def _measured(metrics: Path, dev: dict, gpu: str, times: list[float]) -> tuple[list[float], str]:
    """(the step times the measurement is of, its basis): on simulated CPU devices at least as many as
    the host's cores, each step's CPU seconds over the cores ('cpu'; module doc), else `times` ('wall')."""
    cores, cpu = int(dev.get("host_cores", 0)), _step_times(metrics, "step_cpu_s")
    if gpu == "cpu" and cores and int(dev.get("devices", 0)) >= cores and len(cpu) == len(times):
        return [t / cores for t in cpu], "cpu"
    return times, "wall"


def steady_step(times: list[float]) -> float:
    """The lower quartile of a run's step times (linear between order statistics): interference only
    adds time, so the low part of the distribution is the undisturbed step; a quartile, not the
    minimum, so that one odd step does not set it."""
    return statistics.quantiles(times, n=4, method="inclusive")[0] if len(times) > 1 else times[0]


def _step_times(path: Path, key: str = "step_time_s") -> list[float]:
    """The `key` of every metrics row after step 1 (whose time includes the compile)."""
    out = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        st = row.get(key) if isinstance(row, dict) else None
        if isinstance(st, (int, float)) and st > 0 and int(row.get("step", 0)) > 1:
            out.append(float(st))
    return out


def read_runs(paths) -> list[Run]:
    """The runs, all of one device kind and node shape (else a ConfigError naming the first odd one)."""
    runs = [read_run(p) for p in paths]
    first = runs[0]
    for r in runs[1:]:
        if r.kind != first.kind or r.cluster.split("x")[-1] != first.cluster.split("x")[-1]:
            _refuse(r.path, f"ran on {r.cluster} ({r.kind}), {first.path} on {first.cluster} ({first.kind})",
                    "calibrate the runs of one cluster (one device kind and GPUs per node) together")  # fmt: skip
    return runs


def defaults(cluster: Cluster) -> dict[str, float]:
    """Each parameter's value before a fit: the catalogue's and `constants.py`'s."""
    gpu = cluster.gpu
    cal = gpu.calibration or calibration_for(gpu.name)
    return {"gemm": cal.gemm, "hbm": cal.hbm, "intra_bw": gpu.intra_node_bw, "inter_bw": cluster.nic_bw_per_gpu,
            "latency_s": COMM_LATENCY_S, "overlap_cost": cluster.overlap_for("meshrun"), "flash": cal.flash,
            "fp8": cal.fp8_gemm}  # fmt: skip


def apply(cluster: Cluster, params: dict[str, float]) -> Cluster:
    """`cluster` with a profile's parameters: its GPU's calibration and link rates, the cluster's latency
    and overlap charge (the node's NICs as one rate per device)."""
    gpu = cluster.gpu
    cal = Calibration(
        gemm=params["gemm"], hbm=params["hbm"], fp8=params["fp8"], flash=params["flash"], overlap=params["overlap_cost"]
    )
    link = {"nvlink_bw": 2 * params["intra_bw"]} if gpu.nvlink_bw else {"pcie_bw": params["intra_bw"]}
    gpu = dataclasses.replace(gpu, calibration=cal, nic_bw=params["inter_bw"], **link)
    return dataclasses.replace(cluster, gpu=gpu, nics=0, nic_gbps=0.0, latency_s=params["latency_s"],
                               overlap_cost=params["overlap_cost"])  # fmt: skip


def predict(run: Run, cluster: Cluster) -> float:
    """The planner's step time of `run` on `cluster` (memory levers as `meshrun explain --cluster`)."""
    cfg = run.cfg
    lay = layout_of(cfg, run.mesh_shape)
    lay = dataclasses.replace(lay, remat={"offload": "selective"}.get(lay.remat, lay.remat))
    levers = {"host": ("optimizer",), "nvme": ("nvme",)}.get(cfg.offload.optimizer, ())
    levers += ("activations",) * (cfg.model.remat == "offload")
    return search.predict_step_time(cfg.model, lay, cluster, cfg.train.global_batch, cfg.train.seq_len, levers)


def residuals(runs: list[Run], params: dict[str, float]) -> list[float]:
    """log(predicted / measured) of each run with `params`."""
    return [math.log(predict(r, apply(parse_cluster(r.cluster), params)) / r.measured_s) for r in runs]


def _rms(r: list[float]) -> float:
    return math.sqrt(sum(x * x for x in r) / len(r))


def fit_params(runs: list[Run], names: tuple[str, ...], start: dict[str, float], cap: bool) -> dict[str, float]:
    """Least squares of `residuals` in the logs of `names` (the others as in `start`); Gauss-Newton,
    Levenberg-damped, numerical derivatives, each step at most e^1; fractions <= 1 when `cap`."""
    x = [math.log(start[n]) for n in names]
    limit = [0.0 if cap and n in FRACTIONS else math.inf for n in names]
    of = lambda x: start | {n: math.exp(v) for n, v in zip(names, x)}  # noqa: E731
    resid = lambda x: residuals(runs, of(x))  # noqa: E731
    x = fit_logs(resid, x, upper=limit, iters=40, max_step=1.0, tol=1e-5)
    return of(x)


def determined(runs: list[Run], base: dict[str, float]) -> list[str]:
    """The parameters that move some run's predicted step time at all (not flash without flash
    attention, fp8 without fp8 GEMMs, inter_bw on one node, overlap_cost where nothing overlaps)."""
    r0, out = residuals(runs, base), []
    for n in PARAMS:
        moved = (residuals(runs, base | {n: base[n] * f}) for f in (math.e, 1 / math.e))
        if any(max(abs(a - b) for a, b in zip(r, r0)) > 1e-6 for r in moved):
            out.append(n)
    return out


def noise_of(runs: list[Run]) -> float:
    """The runs' measurement noise: the median of their step times' relative spread."""
    return statistics.median(r.spread for r in runs)


def fit(runs: list[Run], max_params: int | None = None) -> tuple[dict[str, float], tuple[str, ...]]:
    """(every parameter's value, the fitted ones) for `runs`: the best subset of each size (module doc)."""
    cluster = max((parse_cluster(r.cluster) for r in runs), key=lambda c: c.n_devices)
    base, cap = defaults(cluster), cluster.gpu.tiles
    limit = max(1, len(runs) - 1) if max_params is None else max_params
    cands, noise = determined(runs, base), noise_of(runs)
    best: tuple[float, tuple[str, ...], dict[str, float]] = (_rms(residuals(runs, base)), (), base)
    for k in range(1, min(limit, len(cands)) + 1):
        top = None
        for names in itertools.combinations(cands, k):
            trial = fit_params(runs, names, base, cap)
            r = _rms(residuals(runs, trial))
            if top is None or r < top[0] - 1e-12:
                top = (r, names, trial)
        if best[1] and best[0] - top[0] < max(MIN_GAIN, noise):
            break
        best = top
    return best[2], best[1]


# ----------------------------------------------------------------------------- the profile file


def profile_of(runs: list[Run], params: dict[str, float], fitted: tuple[str, ...]) -> dict:
    """The cluster profile (a JSON object): the device, the parameters, which were fitted, the runs."""
    cluster = max((parse_cluster(r.cluster) for r in runs), key=lambda c: c.n_devices)
    rows = []
    for r, e in zip(runs, residuals(runs, params)):
        pred = r.measured_s * math.exp(e)
        rows.append({"run_dir": r.path, "cluster": r.cluster, "measured_s": r.measured_s, "predicted_s": pred,
                     "error": math.exp(e) - 1, "steps": r.steps, "spread": r.spread, "basis": r.basis})  # fmt: skip
    return {"format": FORMAT, "gpu": cluster.gpu.name, "device_kind": runs[0].kind, "cluster": str(cluster),
            "params": dict(params), "fitted": list(fitted), "noise": noise_of(runs), "runs": rows}  # fmt: skip


def load_profile(path: str) -> dict:
    """A cluster profile file (JSON or YAML); a ConfigError naming what is missing or wrong."""
    field = "--cluster-profile"
    try:
        text = Path(path).read_text()
        prof = json.loads(text) if text.lstrip().startswith("{") else yaml.safe_load(text)  # YAML reads 1e-05 as text
    except ValueError:
        raise ConfigError(field, path, "give a file that `meshrun plan --calibrate` wrote", "not JSON") from None
    except OSError as e:
        raise ConfigError(field, path, "give a file that `meshrun plan --calibrate` wrote", e.strerror) from None
    except yaml.YAMLError:
        raise ConfigError(field, path, "give a file that `meshrun plan --calibrate` wrote", "not JSON/YAML") from None
    if not isinstance(prof, dict):
        raise ConfigError(field, path, "give a file that `meshrun plan --calibrate` wrote", "not a profile")
    if prof.get("gpu") not in GPUS:
        raise ConfigError(field, path, f"set gpu: to one of {list(GPUS)}", f"unknown gpu {prof.get('gpu')!r}")
    params = prof.get("params") if isinstance(prof.get("params"), dict) else {}
    missing = [n for n in PARAMS if not isinstance(params.get(n), (int, float)) or not params[n] > 0]
    missing = [n for n in missing if not (n == "overlap_cost" and params.get(n) == 0)]
    if missing:
        raise ConfigError(field, path, "rerun meshrun plan --calibrate, or give them (positive numbers) under params:",
                          f"missing parameters {missing}")  # fmt: skip
    return prof


def profile_cluster(prof: dict, text: str | None, path: str) -> Cluster:
    """The cluster of `--cluster` (else the profile's own) with the profile's parameters; the GPU must be
    the profile's."""
    cluster = parse_cluster(text or prof.get("cluster") or f"{prof['gpu']}:1x8")
    if cluster.gpu.name != prof["gpu"]:
        raise ConfigError("--cluster", text, f"use a {prof['gpu']} cluster, or a profile of {cluster.gpu.name}",
                          f"the profile {path} is of {prof['gpu']}")  # fmt: skip
    return apply(cluster, {n: float(prof["params"][n]) for n in PARAMS})


def format_fit(prof: dict) -> str:
    """The fit's report: the fitted and fixed parameters, then each run's measured and predicted step."""
    p, fitted = prof["params"], prof["fitted"]
    show = lambda n: f"{n} {p[n] / GB:.4g} GB/s" if n.endswith("_bw") else f"{n} {p[n]:.4g}"  # noqa: E731
    fixed = [n for n in PARAMS if n not in fitted]
    lines = [
        f"calibrated {prof['gpu']} ({prof['device_kind']}) on {len(prof['runs'])} runs (step-time noise "
        f"{prof.get('noise', 0):.1%}: a parameter is fitted where it explains more)",
        "fitted: " + ", ".join(show(n) for n in fitted),
        "fixed at their defaults: " + ", ".join(show(n) for n in fixed),
        "",
        f"{'run':<40} {'cluster':>10} {'steps':>5} {'measured s':>11} {'of':>4} {'predicted s':>11} {'error':>7}",
    ]
    for r in prof["runs"]:
        lines.append(f"{r['run_dir'][-40:]:<40} {r['cluster']:>10} {r['steps']:>5} {r['measured_s']:>11.4g} "
                     f"{r.get('basis', 'wall'):>4} {r['predicted_s']:>11.4g} {r['error']:>+7.1%}")  # fmt: skip
    lines.append("measured: the lower quartile of the steps after step 1; of wall: their times, cpu: their CPU "
                 "seconds over the host's cores (simulated devices)")  # fmt: skip
    return "\n".join(lines)
