"""One GPU, a ~1B-parameter Llama-style model: step time, tokens/s, TFLOP/s, MFU, peak memory (a script).

    python bench/gpu.py                # on one H100/H200 with jax[cuda]: < 8 min including compiles
    python bench/gpu.py --dry-run      # anywhere: a tiny model on CPU, 3 steps, the same code path

Model: d_model 2048, 16 layers, 16 heads x 128 (no GQA), d_ff 5632 (SwiGLU), vocab 32000, seq 2048;
bfloat16 compute, float32 master weights and AdamW state, cuDNN flash attention
(`model.attention_impl=cudnn`), synthetic data. Batch: 4 sequences per micro-batch x 4 accumulated
micro-batches = global batch 16 (32768 tokens per step). Memory: ~0.95B params x 16 B (fp32 params,
grads, Adam moments) + the fp32 gradient accumulator is ~19 GB; the activations of one micro-batch
of 4 x 2048 tokens without recomputation about 10 GB more, and the logits a few GB: well inside
80 GB (H100) and 141 GB (H200); `--micro-batch 8 --accum 2` also fits on both.

Each variant (`model.remat=none`, then `full`, then fp8: remat none with `model.fp8=tensorwise`,
whose MFU is against the bf16 peak, and `loss_vs_bf16`; then offload_params: remat none with ZeRO-3
and `offload.params=true`, the parameters resting in pinned host memory and crossing the host
link layer by layer, with `loss_vs_none` and `step_ratio_vs_none`, not yet measured on a GPU; then
offload_device and offload_host: the streamed host tier with its chunk update on the device or on the
host CPU, `offload.update_on`, with `step_ratio_vs_none` and offload_host's `step_ratio_vs_device`;
then zero3_layer: remat none with ZeRO-3 gathered per layer, `train.zero3_gather=layer`, whose gathers
are no-ops on one device, so `step_ratio_vs_none` is the per-layer fetch's own cost; then hsdp: the
same over every device of the machine, `mesh.data` = the devices in groups of half of them
(`mesh.zero_group`, one micro-batch a step), skipped with fewer than 2 devices; the dry run gives it 4
simulated CPU devices) runs in its own process, so a failure (out of memory)
or a time-out in one still leaves the other's numbers, and peak memory is per variant. On a GPU the
processes get the environment of `source launch/gpu_env.sh` (XLA flags, allocator, NCCL); the JSON
line records them (`xla_flags`) and, parsed, the overlap and bucket-fusion ones (`comm_flags`). The output
is ONE JSON line: the remat=none numbers at the top level, the remat=full ones under `remat_full`,
and an `error` field (null when everything ran). Steady step = median of the steps after the first
two; model FLOPs and MFU follow meshrun.train.metrics (Megatron's count: no recomputation, full attention
matrix) against its dense bf16 peak table. `calibration`: `meshrun plan --calibrate` on the runs of
remat none, full and (on a GPU) fp8, one device each, written as run dirs into a temporary folder: the
fitted cluster profile, each run's measured and predicted step and its error.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _child  # noqa: E402  (bench/_child.py)

ROOT = _child.ROOT
GPU_ENV = ROOT / "launch/gpu_env.sh"
# model.remat, and "fp8": remat none with model.fp8=tensorwise (docs/fp8.md), reported under `fp8`
# with `loss_vs_bf16` (its last loss / remat=none's) and `speedup_vs_bf16` (step time ratio)
# "offload_params": remat none, ZeRO-3, offload.params=true (docs/offload.md), reported under
# `offload_params` with `loss_vs_none` and `step_ratio_vs_none` (its step time / remat=none's)
# "offload_device" / "offload_host": remat none with the streamed host tier (offload.optimizer=host),
# the chunk update on the device (the copy path) or on the host CPU (jax's CPU backend), reported under
# their names with `loss_vs_none`, `step_ratio_vs_none`, and on offload_host `step_ratio_vs_device`
# "zero3_layer": remat none, ZeRO-3 gathered per layer (train.zero3_gather=layer, docs/memory.md), with
# `loss_vs_none` and `step_ratio_vs_none`; "hsdp": the same on every device of the machine in ZeRO groups of
# half of them (mesh.zero_group), `n_devices` and `loss_vs_none`; skipped (not an error) on one device
OFFLOAD_ON = {"offload_device": "device", "offload_host": "host"}  # offload.update_on
ZERO3_LAYER = ["train.zero=3", "train.zero3_gather=layer"]
VARIANTS = ("none", "full", "fp8", "offload_params", *OFFLOAD_ON, "zero3_layer", "hsdp")
NAMED = ("fp8", "offload_params", *OFFLOAD_ON, "zero3_layer", "hsdp")  # reported under their own name
HSDP_DRY_DEVICES = 4  # simulated CPU devices of the dry run's hsdp child
CALIBRATE_ON = ("none", "full", "fp8")  # one-device variants whose runs `meshrun plan --calibrate` fits (fp8 on
# a GPU only: the planner has no fp8 GEMMs to cost on a CPU)
REAL = {"d_model": 2048, "n_layers": 16, "n_heads": 16, "n_kv_heads": 16, "head_dim": 128, "d_ff": 5632,
        "vocab": 32000, "seq_len": 2048}  # fmt: skip
TINY = {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "head_dim": 16, "d_ff": 128,
        "vocab": 256, "seq_len": 64}  # fmt: skip
SKIP_STEPS = 2  # the first step compiles; the second may still warm up allocators
KEYS = ("step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "peak_bytes_in_use", "bytes_limit",
        "first_step_s", "steps_run", "loss_first", "loss_last", "error")  # fmt: skip


def overrides(model: dict, remat: str, micro_batch: int, accum: int, steps: int) -> list[str]:
    m = {k: v for k, v in model.items() if k != "seq_len"}
    fp8 = ["model.fp8=tensorwise"] if remat == "fp8" else []
    params_off = ["train.zero=3", "offload.params=true"] if remat == "offload_params" else []
    state_off = ["offload.optimizer=host", f"offload.update_on={OFFLOAD_ON[remat]}"] \
        if remat in OFFLOAD_ON else []  # fmt: skip
    zero3 = ZERO3_LAYER if remat in ("zero3_layer", "hsdp") else []
    hsdp = remat == "hsdp"  # the child sets mesh.data and mesh.zero_group from its devices
    remat = "none" if remat in NAMED else remat
    return [
        *fp8,
        *params_off,
        *state_off,
        *zero3,
        *[f"model.{k}={v}" for k, v in m.items()],
        f"model.max_seq_len={model['seq_len']}",
        f"train.seq_len={model['seq_len']}",
        "model.dtype=bfloat16",
        "model.param_dtype=float32",
        "model.attention_impl=cudnn",
        f"model.remat={remat}",
        *([] if hsdp else ["mesh.data=1"]),
        "mesh.pipe=1",
        "mesh.tensor=1",
        "mesh.expert=1",
        f"pipeline.microbatches={1 if hsdp else accum}",
        f"train.global_batch={micro_batch * accum}",
        f"train.steps={steps}",
        "optimizer.warmup_steps=2",
        "optimizer.lr=3e-4",
        "data.kind=synthetic",
    ]


# ----------------------------------------------------------------------------- one variant (child)


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def child(a) -> int:
    import jax

    from meshrun.analysis.flops import model_flops
    from meshrun.config import load_config
    from meshrun.data.datasets import global_batch_arrays, make_dataset
    from meshrun.runtime.mesh import build_mesh
    from meshrun.train.metrics import peak_flops
    from meshrun.train.step import make_train_step

    over, dev = list(a.child_overrides), jax.devices()[0]
    devices = jax.devices() if a.hsdp else [dev]
    emit(event="start", platform=dev.platform, device_kind=dev.device_kind, xla_flags=os.environ.get("XLA_FLAGS", ""),
         n_devices=len(devices))  # fmt: skip
    if a.hsdp:  # every device, in ZeRO groups of half of them (2 replicas)
        if len(devices) < 2 or len(devices) % 2:
            emit(event="result", skipped=f"HSDP needs an even number of 2+ devices (found {len(devices)})")
            return 0
        over += [f"mesh.data={len(devices)}", f"mesh.zero_group={len(devices) // 2}"]
    cfg = load_config(None, over)
    t = cfg.train
    mesh = build_mesh(cfg.mesh, devices=devices)
    train_step = make_train_step(cfg, mesh)
    n_params = sum(x.size for x in jax.tree.leaves(train_step.abstract_state.params))
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=t.seq_len, global_batch=t.global_batch)
    state = train_step.init()
    jax.block_until_ready(state)
    emit(event="init", n_params=int(n_params))
    flops = model_flops(cfg.model, t.global_batch, t.seq_len)
    per_device = flops / len(devices)  # hsdp: the step's FLOPs over its devices
    peak = peak_flops(dev)
    times, losses = [], []
    for step in range(t.steps):
        tokens, labels = global_batch_arrays(ds, step, mesh, train_step.batch_sharding.spec)
        t0 = time.perf_counter()
        state, metrics = train_step.step(state, tokens, labels)
        loss = float(metrics["loss"])  # waits for the step
        dt = time.perf_counter() - t0
        times.append(dt)
        losses.append(loss)
        emit(event="step", step=step + 1, step_time_s=dt, loss=loss)
    if a.run_dir:
        write_run_dir(Path(a.run_dir), cfg, len(devices), times)
    steady = statistics.median(times[SKIP_STEPS:] or times[-1:])
    stats = dev.memory_stats() or {}
    emit(
        event="result",
        n_params=int(n_params),
        step_time_s=steady,
        tokens_per_s=t.global_batch * t.seq_len / steady,
        tflops_per_device=per_device / steady / 1e12,
        mfu=per_device / (steady * peak) if peak else None,
        peak_bytes_in_use=stats.get("peak_bytes_in_use"),
        bytes_limit=stats.get("bytes_limit"),
        first_step_s=times[0],
        steps_run=len(times),
        loss_first=losses[0],
        loss_last=losses[-1],
        flops_per_step=flops,
        peak_flops=peak,
    )
    return 0


def write_run_dir(d: Path, cfg, n_devices: int, times: list[float]) -> None:
    """A run dir as `meshrun train` leaves it for `meshrun plan --calibrate`: config.yaml, devices.json
    (the `n_devices` the step ran on) and metrics.jsonl with each step's time."""
    import yaml

    from meshrun.config import to_dict
    from meshrun.train.config_file import devices_record

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    (d / "devices.json").write_text(json.dumps(devices_record() | {"devices": n_devices, "local_devices": n_devices}))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "step_time_s": t}) + "\n"
                                             for i, t in enumerate(times)))  # fmt: skip


def calibrate(run_dirs: list[Path]) -> dict:
    """The cluster profile `meshrun plan --calibrate` fits on the run dirs that have step times; its
    `error` names why there is none (a ConfigError's one line)."""
    from meshrun.errors import ConfigError
    from meshrun.planner import cluster_profile as cp

    dirs = [str(d) for d in run_dirs if (d / "metrics.jsonl").is_file()]
    if not dirs:
        return {"error": "no run of " + "/".join(CALIBRATE_ON) + " finished"}
    try:
        runs = cp.read_runs(dirs)
        prof = cp.profile_of(runs, *cp.fit(runs))
    except ConfigError as e:
        return {"error": str(e)}
    for row in prof["runs"]:  # the variant, not the temporary folder
        row["run_dir"] = Path(row["run_dir"]).name
    return {**prof, "error": None}


# ----------------------------------------------------------------------------- driver


def gpu_env(base: dict[str, str]) -> dict[str, str]:
    """The environment after `source launch/gpu_env.sh` on top of `base`."""
    r = subprocess.run(
        ["bash", "-c", 'source "$1" && env -0', "gpu_env", str(GPU_ENV)],
        capture_output=True,
        env=base,
        check=True,
        timeout=30,
    )
    return dict(item.split("=", 1) for item in r.stdout.decode().split("\0") if "=" in item)


# XLA flags that decide how collectives overlap compute and how they are bucketed (launch/gpu_env.sh).
COMM_FLAG_WORDS = ("latency_hiding", "pipelined", "double_buffering", "async_stream", "combine")


def comm_flags(xla_flags: str) -> dict[str, str]:
    """The overlap and bucket-fusion flags in an XLA_FLAGS string: {flag name: value} (the last wins)."""
    out = {}
    for item in xla_flags.split():
        name, _, value = item.lstrip("-").partition("=")
        if any(w in name for w in COMM_FLAG_WORDS):
            out[name] = value or "true"
    return out


def parse_events(out: str) -> dict:
    """What a child printed, folded: the last `result`, else what the progress lines tell."""
    got: dict = {}
    times = []
    for line in out.splitlines():
        if not line.startswith("{"):
            continue
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        kind = ev.pop("event", None)
        if kind == "step":
            times.append(ev["step_time_s"])
            got.setdefault("loss_first", ev["loss"])
            got["loss_last"] = ev["loss"]
        elif kind in ("start", "init", "result"):
            got.update(ev)
    if times and "step_time_s" not in got:
        got["first_step_s"] = times[0]
        got["steps_run"] = len(times)
        if len(times) > SKIP_STEPS:
            got["step_time_s_partial"] = statistics.median(times[SKIP_STEPS:])
    return got


class Interrupted(Exception):
    pass


def _interrupt(signum, frame):
    raise Interrupted(f"signal {signum}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny model on CPU, 3 steps: checks the code path")
    ap.add_argument("--steps", type=int, default=0, help="steps per variant (default 30; --dry-run 3)")
    ap.add_argument("--micro-batch", type=int, default=0, help="sequences per micro-batch (default 4; --dry-run 2)")
    ap.add_argument("--accum", type=int, default=0, help="accumulated micro-batches per step (default 4; --dry-run 2)")
    ap.add_argument("--budget-s", type=float, default=450, help="wall-clock limit for everything (default 450)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, help="model.remat values")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hsdp", action="store_true", help=argparse.SUPPRESS)  # child: all devices, mesh.zero_group
    ap.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)  # child: write a run dir for --calibrate
    ap.add_argument("child_overrides", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a)

    t_start = time.monotonic()
    deadline = t_start + a.budget_s
    dry = a.dry_run
    model = TINY if dry else REAL
    steps = a.steps or (3 if dry else 30)
    micro, accum = a.micro_batch or (2 if dry else 4), a.accum or (2 if dry else 4)
    from meshrun.runtime.devices import default_platform  # imports no jax

    env = _child.env()
    if dry:
        env["JAX_PLATFORMS"] = "cpu"
    platform = default_platform(env)
    out: dict = {
        "bench": "gpu.py" + (" --dry-run" if dry else ""),
        "model": model,
        "dtype": "bfloat16",
        "param_dtype": "float32",
        "attention_impl": "cudnn",
        "micro_batch": micro,
        "accum": accum,
        "global_batch": micro * accum,
        "tokens_per_step": micro * accum * model["seq_len"],
        "steps": steps,
        "platform": platform,
        "jax": _version("jax"),
        "jaxlib": _version("jaxlib"),
        "gpu_env_applied": False,
    }
    errors = []
    runs_root = Path(tempfile.mkdtemp(prefix="meshrun_gpu_bench_"))  # the run dirs --calibrate reads
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        if platform == "gpu":
            env = gpu_env(env)
            out["gpu_env_applied"] = True
        elif not dry:
            raise RuntimeError(f"no GPU found (platform {platform}); use --dry-run to check the code path on CPU")
        out["xla_flags"] = env.get("XLA_FLAGS", "")
        out["comm_flags"] = comm_flags(out["xla_flags"])
        calibrated = [v for v in a.variants if v in CALIBRATE_ON and (v != "fp8" or platform == "gpu")]
        for i, remat in enumerate(a.variants):
            key = remat if remat in NAMED else "remat_" + remat
            left = deadline - time.monotonic()
            if left < 20:
                out[key] = {"error": f"skipped: {left:.0f} s of --budget-s left"}
                errors.append(f"{key}: skipped (time)")
                continue
            timeout = left / (len(a.variants) - i)  # an equal share of what is left; unused time rolls over
            res = out[key] = {}
            child_env, flags = env, ["--hsdp"] if remat == "hsdp" else []
            flags += ["--run-dir", str(runs_root / remat)] if remat in calibrated else []
            if flags and dry:  # the dry run's hsdp child: simulated CPU devices
                xla = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={HSDP_DRY_DEVICES}"
                child_env = {**env, "XLA_FLAGS": xla.strip()}
            run_variant([*flags, *overrides(model, remat, micro, accum, steps)], child_env, timeout, res)
            if res.get("error"):
                errors.append(f"{key}: {res['error']}")
    except (Exception, Interrupted, KeyboardInterrupt) as e:  # report what there is, whatever happened
        errors.append(f"{type(e).__name__}: {e}")
    if any(v in CALIBRATE_ON for v in a.variants):
        out["calibration"] = calibrate([runs_root / v for v in a.variants if v in CALIBRATE_ON])  # those that ran
        errors += [f"calibration: {out['calibration']['error']}"] if out["calibration"]["error"] else []
    shutil.rmtree(runs_root, ignore_errors=True)
    bf16, fp8 = out.get("remat_none", {}), out.get("fp8", {})
    if bf16.get("loss_last") and fp8.get("loss_last") and fp8.get("step_time_s"):
        fp8["loss_vs_bf16"] = fp8["loss_last"] / bf16["loss_last"]
        fp8["speedup_vs_bf16"] = bf16["step_time_s"] / fp8["step_time_s"]
    for name in ("offload_params", *OFFLOAD_ON, "zero3_layer", "hsdp"):
        off = out.get(name, {})
        if bf16.get("loss_last") and off.get("loss_last") and off.get("step_time_s"):
            off["loss_vs_none"] = off["loss_last"] / bf16["loss_last"]
            off["step_ratio_vs_none"] = off["step_time_s"] / bf16["step_time_s"]
    on_dev, on_host = out.get("offload_device", {}), out.get("offload_host", {})
    if on_dev.get("step_time_s") and on_host.get("step_time_s"):
        on_host["step_ratio_vs_device"] = on_host["step_time_s"] / on_dev["step_time_s"]
    main_key = a.variants[0] if a.variants[0] in NAMED else "remat_" + a.variants[0]
    first = out.get(main_key, {})
    head = {"bench": out.pop("bench"), "platform": platform, "device_kind": first.get("device_kind"),
            "remat": a.variants[0], **{k: first.get(k) for k in KEYS if k != "error"}}  # fmt: skip
    if main_key == "remat_none":
        out.pop(main_key, None)  # its numbers are the top level
    out = {**head, "n_params": first.get("n_params"), **out}
    out["error"] = "; ".join(errors) or None
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    print(json.dumps(out), flush=True)
    return 1 if errors else 0


def run_variant(over: list[str], env: dict[str, str], timeout: float, res: dict) -> None:
    """Run one variant's process; fill `res` with what it reported (partial on failure) and `error`."""
    res["error"] = "interrupted"

    def fill(r: _child.Result) -> None:
        res.update({k: v for k, v in parse_events(r.stdout).items() if k != "xla_flags"}, error=r.error)

    fill(_child.run([sys.executable, str(Path(__file__).resolve()), "--child", *over], env=env, timeout=timeout,
                    on_interrupt=fill))  # fmt: skip


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
