"""`meshrun plan`: which tensor/pipe/data/expert layout to use for a model on a cluster.

meshrun plan --model configs/models/gpt3-175b.yaml --cluster a100-80g:128x8 --global-batch 1536
meshrun plan --model gpt3-175b --cluster a100-80g:128x8,ib=8x200 --framework megatron \
    --evaluate tensor=8,pipe=16,remat=full --json
meshrun plan --model llama-70b --cluster h100-80g:16x8 --seq-len 131072 --global-batch 32   # context parallelism
meshrun plan --model gpt3-175b --cluster a100-80g:128x8 --grad-reduce-dtype bfloat16   # bf16 DP reduction
meshrun plan --model llama-70b --cluster h100-80g:1x8 --global-batch 16 \
    --evaluate tensor=4,data=2,zero=3,offload_params=true,offload_optimizer=host   # the offload levers
meshrun plan --calibrate runs/a runs/b runs/c --out cluster.json   # fit this cluster's constants to its runs
meshrun plan --cluster-profile cluster.json --model llama-7b --global-batch 64   # ... and plan with them
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from pathlib import Path

from meshrun.analysis.flops import active_params, param_counts
from meshrun.config import (
    FP8_RECIPES,
    GRAD_REDUCE_DTYPES,
    MAX_DIM,
    OFFLOAD_GRADS,
    OFFLOAD_TIERS,
    OFFLOAD_UPDATES,
    OPTIMIZER_STATE_DTYPES,
    ZERO2_REDUCES,
    ZERO3_GATHERS,
    RunConfig,
    TrainConfig,
    check_zero_group,
    from_dict,
    load_yaml,
    zero2_layer_refusals,
    zero3_layer_refusals,
)
from meshrun.errors import ConfigError
from meshrun.optim import registry as optimizers
from meshrun.pipeline import registry
from meshrun.planner import cluster_profile
from meshrun.planner.constants import ATTENTION_KERNELS, FLASH2_EFFICIENCY, calibration_for, with_attention_kernel
from meshrun.planner.cost import MEMORY_PARTS, Layout
from meshrun.planner.hardware import CLUSTER_HELP, GB, GPUS, Cluster, parse_cluster
from meshrun.planner.layout import CONTEXT_KINDS
from meshrun.planner.search import (
    MAX_CONTEXT,
    SEARCHED_REMATS,
    Result,
    context_violations,
    evaluate,
    search,
    tp_overlap_refusal,
)
from meshrun.planner.step_model import layerwise, overlap_cut
from meshrun.planner.timing import FRAMEWORKS, overlap_ticks

INT_KEYS = ("tensor", "pipe", "data", "expert", "context", "virtual", "microbatches", "micro_batch_size", "zero",
            "zero_group", "wgrad_deferral")  # fmt: skip
# --evaluate keys of Megatron's semantics only (--framework megatron): NeMo / Megatron-Core settings
MEGATRON_KEYS = ("param_remainders", "tp_comm_fp8_rs", "overlap_param_gather", "wgrad_deferral")
# --evaluate keys whose value is one of a fixed set of names
_CHOICES = {
    "remat": SEARCHED_REMATS,
    "offload_optimizer": OFFLOAD_TIERS,
    "offload_update": OFFLOAD_UPDATES,
    "offload_grads": OFFLOAD_GRADS,
    "zero3_gather": ZERO3_GATHERS,
    "zero2_reduce": ZERO2_REDUCES,
}
EVAL_KEYS = (*INT_KEYS, "remat", "sequence_parallel", "schedule", "executor", "context_kind", "offload_optimizer",
             "offload_update", "offload_params", "overlap_grad_reduce", "offload_grads", "tp_comm_overlap",
             "zero3_gather", "zero2_reduce", *MEGATRON_KEYS)  # fmt: skip
DEGREES = ("tensor", "pipe", "data", "expert", "context")  # their product is the device count
FLAG_KEYS = {"optimizer": "--optimizer", "state_dtype": "--state-dtype", "grad_reduce_dtype": "--grad-reduce-dtype"}
# configs/models of the source tree, for `--model NAME`.
MODELS_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="rank parallel layouts (TP/PP/DP/EP, ZeRO, remat) for a model")
    p.add_argument("--model", help="model YAML (a `model:` section), or a name in configs/models")
    p.add_argument("--cluster", help=f"{CLUSTER_HELP}; GPUs: {list(GPUS)} (default: --cluster-profile's cluster)")
    p.add_argument("--calibrate", nargs="+", metavar="RUN_DIR", default=None,
                   help="fit the cluster's constants to the step times of these `meshrun train` run dirs and "
                   "write a cluster profile (--out)")  # fmt: skip
    p.add_argument("--out", default="cluster-profile.json", help="the profile --calibrate writes")
    p.add_argument("--cluster-profile", default=None, metavar="FILE",
                   help="cost layouts with the constants a --calibrate fit wrote")  # fmt: skip
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: train.global_batch)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: train.seq_len)")
    p.add_argument("--top", type=int, default=5, help="how many layouts to show")
    p.add_argument("--evaluate", default=None, metavar="KEY=VALUE,...", help=f"one layout; keys: {list(EVAL_KEYS)}")
    p.add_argument(
        "--max-context",
        type=int,
        default=MAX_CONTEXT,
        help=f"largest context-parallel degree the search tries (default {MAX_CONTEXT}; 1: no context parallelism)",
    )
    p.add_argument("--framework", default="meshrun", help=f"whose step semantics to cost: {list(FRAMEWORKS)}")
    p.add_argument("--fp8", default=None, help=f"fp8 recipe to cost: {list(FP8_RECIPES)} (default: model.fp8)")
    p.add_argument("--attention-kernel", default="cudnn", metavar="KERNEL",
                   help=f"fused attention's kernel: {list(ATTENTION_KERNELS)} (cudnn: the GPU's fitted efficiency, "
                   "flash2: FlashAttention-2's published one; default cudnn)")  # fmt: skip
    p.add_argument("--dropout", type=float, default=0.0, help="dropout probability (megatron only; meshrun has none)")
    p.add_argument(
        "--optimizer",
        default=None,
        metavar="NAME",
        help=f"optimizer whose state to cost: {list(optimizers.OPTIMIZERS)} (default: the YAML's optimizer.name)",
    )
    p.add_argument("--state-dtype", default=None, choices=OPTIMIZER_STATE_DTYPES,
                   help="dtype of the optimizer moments (default: the YAML's optimizer.state_dtype)")  # fmt: skip
    p.add_argument("--grad-reduce-dtype", default=None, metavar="DTYPE",
                   help=f"dtype of meshrun's data-parallel gradient reduction: {list(GRAD_REDUCE_DTYPES)} "
                   f"(default: the YAML's train.grad_reduce_dtype, else {TrainConfig.grad_reduce_dtype})")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object with key `configs`")
    p.set_defaults(func=run_plan)


def _model_path(text: str) -> Path:
    for cand in (Path(text), Path("configs/models") / f"{text}.yaml", MODELS_DIR / f"{text}.yaml"):
        if cand.is_file():
            return cand
    names = sorted(f.stem for f in MODELS_DIR.glob("*.yaml")) if MODELS_DIR.is_dir() else []
    raise ConfigError("--model", text, f"give a YAML file with a `model:` section, or one of {names}", "no such model")


def load_model(text: str):
    """--model -> (ModelConfig, raw `train:` section of the YAML, name, OptimizerConfig)."""
    path = _model_path(text)
    raw = load_yaml(path)
    cfg = from_dict(RunConfig, raw)
    if not cfg.model.predictable:  # a user's family whose layers the transformer formulas do not describe
        what = f"model.family={cfg.model.family} sets predictable = False"
        fix = "meshrun plan costs transformer layers only (`meshrun explain CONFIG` compiles its step)"
        raise ConfigError("--model", text, fix, what)
    train = raw.get("train") if isinstance(raw.get("train"), dict) else {}
    return cfg.model, train, path.stem, cfg.optimizer


def parse_evaluate(text: str, model, cluster: Cluster, global_batch: int, seq_len: int | None = None,
                   framework: str = "meshrun") -> Layout:  # fmt: skip
    """`tensor=8,pipe=16,...` -> a Layout; keys left out get defaults (data takes the devices left over).
    Degrees above the device count, degrees whose product is not the device count, a context degree
    that does not split `seq_len`, an unknown context_kind and a Megatron-only key under another
    framework's semantics are ConfigErrors (exit 2)."""
    given = _evaluate_pairs(text)
    for key in MEGATRON_KEYS:
        if key in given and framework != "megatron":
            raise ConfigError(f"--evaluate {key}", given[key], "add --framework megatron, or leave it out",
                              "a NeMo / Megatron-Core setting, costed under Megatron's semantics only")  # fmt: skip
    t, p, e, c, d = _evaluate_degrees(given, cluster)
    b = given.get("micro_batch_size", 1)
    m = given.get("microbatches", max(1, global_batch // (b * d * e)))
    sched = registry.get(given.get("schedule", registry.default_name(given.get("virtual", 1))), "--evaluate schedule")
    v = given.get("virtual", sched.chunks_of(1))
    if given.get("executor", sched.executors[0]) not in sched.executors:
        raise ConfigError("--evaluate executor", given["executor"], f"use {' or '.join(sched.executors)}",
                          f"{sched.name} runs on the {'/'.join(sched.executors)} executor only")  # fmt: skip
    layout = Layout(tensor=t, pipe=p, data=d, expert=e, virtual=v, microbatches=m, micro_batch_size=b,
                    schedule=sched.name, executor=sched.executor(given.get("executor", "auto")),
                    context=c, **_plain_fields(given, model))  # fmt: skip
    _check_evaluated(layout, model, seq_len, framework)
    return layout


# --evaluate keys copied into the Layout as given, with their defaults when left out
_PLAIN_DEFAULTS = {"zero": 0, "offload_optimizer": "none", "offload_update": "auto", "offload_params": False,
                   "overlap_grad_reduce": False, "offload_grads": "host", "zero_group": 0, "zero3_gather": "auto",
                   "zero2_reduce": "auto"}  # fmt: skip


def _plain_fields(given: dict, model) -> dict:
    """The Layout fields `--evaluate` takes as given: `_PLAIN_DEFAULTS`' keys, the model config's own
    defaults (remat, sequence parallelism, context kind, TP-communication overlap) and the
    Megatron-only keys present."""
    from_model = {"remat": model.remat, "sequence_parallel": model.sequence_parallel,
                  "context_kind": getattr(model, "context_parallel", "allgather"),
                  "tp_comm_overlap": getattr(model, "tp_comm_overlap", False)}  # fmt: skip
    out = {k: given.get(k, dflt) for k, dflt in {**_PLAIN_DEFAULTS, **from_model}.items()}
    return out | {k: given[k] for k in MEGATRON_KEYS if k in given}


def _evaluate_pairs(text: str) -> dict:
    """`key=value,...` -> {key: parsed value}; an unknown key, a flag's key or a pair without `=`
    is a ConfigError."""
    given: dict = {}
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        key, sep, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep:
            raise ConfigError("--evaluate", item, "write KEY=VALUE pairs separated by commas, e.g. tensor=8,pipe=16")
        if key in FLAG_KEYS:
            raise ConfigError(f"--evaluate {key}", raw, f"give it as {FLAG_KEYS[key]} {raw}", "not a layout key")
        if key not in EVAL_KEYS:
            close = difflib.get_close_matches(key, EVAL_KEYS, n=1, cutoff=0.5)
            fix = f"did you mean '{close[0]}'?" if close else f"valid keys: {list(EVAL_KEYS)}"
            raise ConfigError(f"--evaluate {key}", raw, fix, "unknown key")
        given[key] = _parse_value(key, raw)
    return given


def _evaluate_degrees(given: dict, cluster: Cluster) -> tuple[int, int, int, int, int]:
    """(tensor, pipe, expert, context, data) of the given degrees; data takes the devices left over."""
    n = cluster.n_devices
    for key in DEGREES:
        if given.get(key, 1) > n:
            raise ConfigError(
                f"--evaluate {key}", given[key], f"use a degree that divides the {n} devices of {cluster}", "too large"
            )
    t, p, e, c = (given.get(k, 1) for k in ("tensor", "pipe", "expert", "context"))
    if "data" not in given and n % (t * p * e * c):
        named = "*".join(k for k in DEGREES if k in given) or "tensor"
        raise ConfigError(
            f"--evaluate {named}",
            t * p * e * c,
            f"choose degrees whose product divides the {n} devices of {cluster} (data takes the rest)",
            "does not divide the device count",
        )
    d = given.get("data", max(1, n // (t * p * e * c)))
    if t * p * e * c * d != n:
        raise ConfigError(
            "--evaluate " + "*".join(DEGREES),
            t * p * e * c * d,
            f"make tensor*pipe*data*expert*context equal the {n} devices of {cluster} (or leave data out)",
            "product is not the device count",
        )
    return t, p, e, c, d


def _check_evaluated(layout: Layout, model, seq_len: int | None, framework: str = "meshrun") -> None:
    """The rules `train` and the search apply to a layout given with --evaluate."""
    c = layout.context
    if framework == "megatron":
        _check_megatron(layout, model)
    _check_zero_variant(layout, framework)
    if layout.zero_group:  # mesh.zero_group's rules (MeshConfig, RunConfig)
        check_zero_group(layout.zero_group, layout.data, "--evaluate zero_group")
        if layout.zero == 0:
            raise ConfigError("--evaluate zero_group", layout.zero_group, "set zero to 1, 2 or 3 with it, or leave "
                              "it out", "groups shard ZeRO state, and zero=0 has none")  # fmt: skip
    if layout.tp_comm_overlap and framework != "megatron" and (refusal := tp_overlap_refusal(model, layout)):
        raise ConfigError("--evaluate tp_comm_overlap", True, *refusal)  # the rules `train` and the search apply
    upd, field = layout.offload_update, "--evaluate offload_update"
    if upd != "auto" and layout.offload_optimizer != "host":  # the rules `train` applies (TrainConfig)
        raise ConfigError(field, upd, "leave it auto, or set offload_optimizer=host",
                          "chooses the host tier's update only")  # fmt: skip
    if upd == "streamed" and layout.offload_params:
        raise ConfigError(field, upd, "leave it auto with offload_params",
                          "offload_params streams layer by layer itself")  # fmt: skip
    if layout.overlap_grad_reduce and not overlap_cut(layout)[2] and not _schedule_rejects(layout):
        raise ConfigError("--evaluate overlap_grad_reduce", True, "use pipe > 1 with a schedule of 2+ chunks per stage "
                          "(zb-v, or interleaved with virtual >= 2), or leave it out",
                          "no chunk's gradients are final before the last tick")  # fmt: skip
    model.check_context(c, "--evaluate context")  # the rule `train` applies
    if c > 1 and seq_len is not None and (bad := context_violations(layout, seq_len)):
        need = 2 * c if layout.context_kind == "ring" else c
        raise ConfigError(
            "--evaluate context",
            c,
            f"use a context degree whose {'2 x context' if need > c else 'context'} divides --seq-len {seq_len} "
            f"(e.g. a power of two)",
            bad[0],
        )


# --evaluate key -> (its ZeRO stage, its per-layer value, the rules `train` applies to that value)
_ZERO_VARIANTS = {"zero3_gather": (3, "layer", zero3_layer_refusals), "zero2_reduce": (2, "microbatch",
                                                                                     zero2_layer_refusals)}  # fmt: skip


def _check_zero_variant(layout: Layout, framework: str) -> None:
    """train.zero3_gather / train.zero2_reduce as --evaluate keys: meshrun's variants of its own ZeRO
    stage, refused where `train` refuses them (`config.zero`)."""
    for key, (stage, per_layer, refusals) in _ZERO_VARIANTS.items():
        value, field = getattr(layout, key), f"--evaluate {key}"
        if value == "auto":
            continue
        if framework != "meshrun":
            raise ConfigError(field, value, "leave it out", f"a meshrun variant; {framework}'s semantics run ZeRO "
                              "as DeepSpeed does")  # fmt: skip
        if layout.zero != stage:
            raise ConfigError(field, value, f"set zero={stage} with it, or leave it out",
                              f"chooses ZeRO-{stage}'s variant (zero={layout.zero})")  # fmt: skip
        if value == "step" and layout.offload_params:
            raise ConfigError(field, value, "leave it auto with offload_params", "offload_params fetches per layer")
        if value == per_layer and (refused := refusals(layout.overlap_grad_reduce)):
            raise ConfigError(field, value, refused[0][1], refused[0][0])


def _check_megatron(layout: Layout, model) -> None:
    """The settings Megatron-Core / NeMo accept (--framework megatron): --tp-comm-overlap needs sequence
    parallelism over TP > 1 (fp8 too: Transformer Engine's userbuffers); fp8 reduce-scatter buffers
    need it and fp8; the master-weight remainders a 16-bit param; the wgrad deferral a pipeline."""
    if layout.tp_comm_overlap and not (layout.sequence_parallel and layout.tensor > 1):
        raise ConfigError("--evaluate tp_comm_overlap", True, "set sequence_parallel=true and tensor > 1 with it",
                          "Megatron-Core's --tp-comm-overlap needs sequence parallelism")  # fmt: skip
    if layout.tp_comm_fp8_rs and not (layout.tp_comm_overlap and model.fp8 != "none"):
        raise ConfigError("--evaluate tp_comm_fp8_rs", True, "set tp_comm_overlap=true and an fp8 recipe (--fp8)",
                          "fp8 userbuffers exist only for fp8 with TP overlap")  # fmt: skip
    if layout.param_remainders and model.param_dtype != "bfloat16":
        raise ConfigError("--evaluate param_remainders", True, "leave it out, or use a model with bfloat16 params",
                          f"16-bit master-weight remainders need bf16 params, not {model.param_dtype}")  # fmt: skip
    if layout.wgrad_deferral and layout.pipe == 1:
        raise ConfigError("--evaluate wgrad_deferral", layout.wgrad_deferral, "set pipe > 1, or leave it out",
                          "defers the output layer's weight gradients into the pipeline flush")  # fmt: skip


def _schedule_rejects(layout) -> bool:
    """The layout's schedule refuses its pipe, micro-batches or chunks (evaluate reports that as a
    hard violation, with or without overlap_grad_reduce)."""
    if layout.pipe == 1 or layout.chunks == 1:
        return False
    try:
        registry.get(layout.schedule).table(layout.pipe, layout.microbatches, layout.virtual, layout.run_executor)
    except ConfigError:
        return True
    return False


def _parse_value(key: str, raw: str):
    field = f"--evaluate {key}"
    if key in INT_KEYS:
        if not raw.isdigit() or (int(raw) < 1 and key not in ("zero", "zero_group", "wgrad_deferral")):
            raise ConfigError(field, raw, "use a positive whole number", "not a positive integer")
        if int(raw) > MAX_DIM:
            raise ConfigError(field, raw, f"use a whole number in [1, {MAX_DIM}]", "too large")
        if key == "zero" and int(raw) not in (0, 1, 2, 3):
            raise ConfigError(field, raw, "use a ZeRO stage 0, 1, 2 or 3")
        return int(raw)
    choices = _CHOICES.get(key)
    if choices is not None:
        if raw not in choices:
            raise ConfigError(field, raw, f"use one of {list(choices)}")
        return raw
    if key == "context_kind":
        if raw not in CONTEXT_KINDS:
            close = difflib.get_close_matches(raw, CONTEXT_KINDS, n=1, cutoff=0.5)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(field, raw, f"{hint}use one of {list(CONTEXT_KINDS)}", "unknown context kind")
        return raw
    if key == "executor":
        if raw not in ("lockstep", "per_op"):
            raise ConfigError(field, raw, "use lockstep or per_op")
        return raw
    if key == "schedule":
        return registry.get(raw, field).name
    low = raw.lower()
    if low not in ("true", "false", "1", "0", "yes", "no"):
        raise ConfigError(field, raw, "use true or false", "not a boolean")
    return low in ("true", "1", "yes")


def run_calibrate(args) -> int:
    """`--calibrate RUN_DIR ...`: fit, print each run's residual, write the profile (nothing on bad input)."""
    runs = cluster_profile.read_runs(args.calibrate)
    out = Path(args.out)
    if not out.parent.is_dir():
        raise ConfigError("--out", args.out, "give a file in an existing directory", "no such directory")
    prof = cluster_profile.profile_of(runs, *cluster_profile.fit(runs))
    out.write_text(json.dumps(prof, indent=1) + "\n")
    print(json.dumps(prof) if args.json else cluster_profile.format_fit(prof))
    if not args.json:
        print(f"\nwrote {out}; use it: meshrun plan --cluster-profile {out} --model MODEL --global-batch N")
    return 0


def _cluster(args) -> Cluster:
    """--cluster, with --cluster-profile's constants when given (its cluster when --cluster is not)."""
    if args.cluster_profile is not None:
        prof = cluster_profile.load_profile(args.cluster_profile)
        return cluster_profile.profile_cluster(prof, args.cluster, args.cluster_profile)
    if args.cluster is None:
        raise ConfigError("--cluster", None, f"give one, e.g. h100-80g:2x8 ({CLUSTER_HELP}), or --cluster-profile")
    return parse_cluster(args.cluster)


def run_plan(args) -> int:
    if args.calibrate is not None:
        return run_calibrate(args)
    if args.model is None:
        raise ConfigError("--model", None, "give a model YAML or a name in configs/models, e.g. --model llama-70b")
    model, train, name, opt_cfg = load_model(args.model)
    opt = _optimizer(args, opt_cfg)
    cluster = _cluster(args)
    model = _with_fp8(args, model, cluster)
    cluster = _with_attention_kernel(args, model, cluster)
    batch, seq = _batch_and_seq(args, train, model)
    _check_flags(args, opt)
    opt["grad_reduce_dtype"] = _grad_reduce(args, train)
    kw = dict(framework=args.framework, dropout=args.dropout)
    if args.evaluate is not None:
        layout = dataclasses.replace(parse_evaluate(args.evaluate, model, cluster, batch, seq, args.framework), **opt)
        results = [evaluate(model, layout, cluster, batch, seq, **kw)]
    else:
        found = search(model, cluster, batch, seq, top=4 * args.top, name=name, max_context=args.max_context,
                       **opt, **kw)  # fmt: skip
        results = fold_zero(found)[: args.top]
    counts = param_counts(model)
    if args.json:
        print(json.dumps(_json_answer(args, model, name, cluster, batch, seq, opt, results)))
    else:
        print(format_table(name, counts["total"], cluster, batch, seq, results, args.framework, model))
    return 0


def _json_answer(args, model, name: str, cluster: Cluster, batch: int, seq: int, opt: dict, results) -> dict:
    """`plan --json`'s answer: the question (model, cluster, semantics, batch) and each layout's result."""
    return {
        "model": name,
        "params": param_counts(model)["total"],
        "active_params": active_params(model),
        "cluster": str(cluster),
        "framework": args.framework,
        "attention_kernel": args.attention_kernel,
        "grad_reduce_dtype": opt["grad_reduce_dtype"],
        "devices": cluster.n_devices,
        "usable_memory_gb": round(cluster.usable_memory / GB, 3),
        "global_batch": batch,
        "seq_len": seq,
        "configs": [r.to_dict() for r in results],
    }


def _with_fp8(args, model, cluster: Cluster):
    """The model with --fp8's recipe, if given; an fp8 recipe needs a GPU with fp8 GEMMs."""
    if args.fp8 is not None:
        if args.fp8 not in FP8_RECIPES:
            raise ConfigError("--fp8", args.fp8, f"use one of {list(FP8_RECIPES)}")
        if not model.fp8_gemms:
            raise ConfigError("--fp8", args.fp8, "leave it out", f"model.family={model.family} has no fp8 GEMMs")
        model = dataclasses.replace(model, fp8=args.fp8)
    if model.fp8 != "none" and not cluster.gpu.fp8_flops:
        fix = "use --fp8 none here, or an H100/H200/GH200/B200 cluster"
        raise ConfigError("--fp8", model.fp8, fix, f"{cluster.gpu.name} has no fp8 GEMMs")
    return model


def _with_attention_kernel(args, model, cluster: Cluster) -> Cluster:
    """The cluster whose GPU runs fused attention with --attention-kernel's efficiency
    (`constants.with_attention_kernel`); flash2 needs fused attention and a GPU with a sourced figure."""
    kernel, gpu = args.attention_kernel, cluster.gpu
    if kernel not in ATTENTION_KERNELS:
        raise ConfigError("--attention-kernel", kernel, f"use one of {list(ATTENTION_KERNELS)}")
    if kernel == "cudnn":
        return cluster
    if model.attention_impl != "cudnn":
        fix = "use --attention-kernel cudnn, or a model with attention_impl: cudnn (fused attention)"
        raise ConfigError("--attention-kernel", kernel, fix, f"model.attention_impl={model.attention_impl}")
    if gpu.name not in FLASH2_EFFICIENCY:
        fix = f"use cudnn on {gpu.name}, or one of {sorted(FLASH2_EFFICIENCY)}"
        raise ConfigError("--attention-kernel", kernel, fix, f"no published FlashAttention-2 figure for {gpu.name}")
    cal = with_attention_kernel(gpu.calibration or calibration_for(gpu.name), kernel, gpu.name)
    return dataclasses.replace(cluster, gpu=dataclasses.replace(gpu, calibration=cal))


def _batch_and_seq(args, train: dict, model) -> tuple[int, int]:
    """(global batch, sequence length): the flags, else the YAML's train section (checked, bounded)."""
    for flag, val in (("--global-batch", args.global_batch), ("--seq-len", args.seq_len), ("--top", args.top)):
        if val is not None and val < 1:  # given on the command line: checked, never replaced by the YAML's
            raise ConfigError(flag, val, "use a positive whole number")
    seq = args.seq_len if args.seq_len is not None else train.get("seq_len") or model.max_seq_len
    batch = args.global_batch if args.global_batch is not None else train.get("global_batch")
    if not batch:
        raise ConfigError("--global-batch", batch, "give the number of sequences per step, e.g. --global-batch 1536")
    for flag, val in (("--global-batch", batch), ("--seq-len", seq), ("--top", args.top)):
        if not 1 <= int(val) <= MAX_DIM:  # the search's work grows with them: bounded answer time
            raise ConfigError(flag, val, f"use a whole number in [1, {MAX_DIM}]")
    return int(batch), int(seq)


def _check_flags(args, opt: dict) -> None:
    """--framework, --dropout, --max-context and the optimizer Megatron-LM's costing allows."""
    if args.framework not in FRAMEWORKS:
        raise ConfigError("--framework", args.framework, f"use one of {list(FRAMEWORKS)}")
    if not 0.0 <= args.dropout < 1.0 or (args.dropout and args.framework == "meshrun"):
        raise ConfigError(
            "--dropout", args.dropout, "use 0 <= p < 1, and only with --framework megatron (meshrun has no dropout)"
        )
    if not 1 <= args.max_context <= MAX_DIM:
        raise ConfigError("--max-context", args.max_context, "use 1 (no context parallelism) or a larger degree")
    if args.framework == "megatron" and opt["optimizer"] != "adamw":
        raise ConfigError("--optimizer", opt["optimizer"], "use --framework meshrun (Megatron-LM's costing is Adam's)")


def _optimizer(args, cfg) -> dict[str, str]:
    """The Layout fields of the optimizer to cost: --optimizer / --state-dtype, else the YAML's."""
    flag = args.optimizer is not None
    name = args.optimizer if flag else cfg.name
    optimizers.get(name, "--optimizer" if flag else "optimizer.name")  # unknown: names where it came from
    return {"optimizer": name, "state_dtype": args.state_dtype or cfg.state_dtype}


def _grad_reduce(args, train: dict) -> str:
    """The dtype of the data-parallel gradient reduction to cost: --grad-reduce-dtype, else the YAML's
    train.grad_reduce_dtype, else meshrun's default. Megatron's costing: float32 unless the flag says
    bfloat16 (Megatron-Core's --grad-reduce-in-bf16, NeMo's optim.grad_sync_dtype: bf16)."""
    flag = args.grad_reduce_dtype
    if flag is not None and flag not in GRAD_REDUCE_DTYPES:
        raise ConfigError("--grad-reduce-dtype", flag, f"use one of {list(GRAD_REDUCE_DTYPES)}")
    if args.framework == "megatron":
        return flag or "float32"
    return flag or train.get("grad_reduce_dtype", TrainConfig.grad_reduce_dtype)


def fold_zero(results: list[Result]) -> list[Result]:
    """One row per layout: ZeRO variants of the same TP/PP/DP/EP/schedule/remat layout fold into the
    fastest one (results come best first, so its ZeRO stage and variant are the best that fit)."""
    seen, out = set(), []
    for r in results:
        key = dataclasses.replace(r.layout, zero=0, zero3_gather="auto", zero2_reduce="auto")
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


ZERO_VARIANT_CELLS = {"layer": "L", "step": "S", "microbatch": "M"}  # the zero cell's variant letter


def _zero(lay: Layout) -> str:
    """The table's zero cell: the stage, HSDP's ZeRO group (`3/8`: ZeRO-3 sharded over groups of 8 data
    ranks, mesh.zero_group=8) and a named ZeRO-2/3 variant (`3L`: train.zero3_gather=layer, `3S`: step;
    `2M`: train.zero2_reduce=microbatch, `2S`: step)."""
    variant = {3: lay.zero3_gather, 2: lay.zero2_reduce}.get(lay.zero, "auto")
    group = f"/{lay.zero_group}" if lay.zero_group else ""
    return f"{lay.zero}{ZERO_VARIANT_CELLS.get(variant, '')}{group}"


def _cp(lay: Layout) -> str:
    """The table's CP cell: the degree, and its kind when > 1 (`4 ring`, `2 ag`)."""
    return "1" if lay.context == 1 else f"{lay.context} {'ring' if lay.context_kind == 'ring' else 'ag'}"


def format_table(
    name: str,
    n_params: float,
    cluster: Cluster,
    batch: int,
    seq: int,
    results: list[Result],
    framework: str = "meshrun",
    model=None,
) -> str:
    active = f", {active_params(model) / 1e9:.3g}B active" if model is not None and model.is_moe else ""
    lines = [
        f"{name} ({n_params / 1e9:.3g}B params{active}) on {cluster} = {cluster.n_devices} x {cluster.gpu.name} "
        f"({cluster.usable_memory / GB:.0f} GB each), global batch {batch} x seq {seq}, {framework} semantics, "
        f"dp reduce {results[0].layout.grad_reduce_dtype}",
        "",
        f"{'#':>2} {'TP':>3} {'PP':>3} {'DP':>5} {'EP':>3} {'CP':>7} {'v':>2} {'m':>5} {'mbs':>3} {'zero':>5} "
        f"{'remat':>9} {'SP':>3} {'mem GB':>7} {'step s':>9} {'TFLOP/s':>7} {'MFU':>6} {'bubble':>6}",
    ]
    for i, r in enumerate(results, 1):
        p = r.layout
        lines.append(
            f"{i:>2} {p.tensor:>3} {p.pipe:>3} {p.data:>5} {p.expert:>3} {_cp(p):>7} {p.virtual:>2} "
            f"{p.microbatches:>5} {p.micro_batch_size:>3} {_zero(p):>5} {p.remat:>9} "
            f"{'y' if p.sequence_parallel else 'n':>3} {r.memory['total'] / GB:>7.3g} {r.step_time:>9.4g} "
            f"{r.tflops_per_device:>7.1f} {r.mfu:>6.1%} {r.time['bubble_fraction']:>6.1%}"
        )
        lines += [f"   ! {v}" for v in r.violations]
    lines += _best_time_lines(results[0], framework, model)
    lines += _best_memory_lines(results[0])
    return "\n".join(lines)


def _best_time_lines(best: Result, framework: str, model) -> list[str]:
    """The best layout's layers per stage, schedule, time parts and overlap notes."""
    parts = (
        "compute",
        "tensor_comm",
        "context_comm",
        "pipe_comm",
        "expert_comm",
        "zero_comm",
        "bubble",
        "dp_sync",
        "optimizer",
        "host_transfer",  # an offloading proposal's I/O the step waits for (host link, NVMe)
    )
    tm = ", ".join(f"{k} {best.time[k]:.3g}" for k in parts if best.time.get(k, 0) > 0)
    split = best.time["split"]
    even = len(set(split)) == 1
    uneven = f"#1 layers per stage: {list(split)} (train it with pipeline.balance=auto, which splits per virtual stage)"
    lines = ["", f"#1 layers per stage: {split[0]} x {len(split)}" if even else uneven]
    if best.layout.pipe > 1:
        lines.append(f"#1 schedule: {best.layout.schedule} on the {best.layout.run_executor} executor")
    lines += _zero_variant_lines(best.layout, model)
    lines += [f"#1 time (s): {tm}", _axis_shares(best.time)]
    charge = best.time["overlap_cost"]
    if best.time.get("dp_hidden", 0) > 0 and model is not None:
        early = overlap_cut(best.layout)[2]
        used, n, ticks = overlap_ticks(model, best.layout, framework)
        lines.append(
            f"#1 overlap_grad_reduce: {best.time['dp_hidden']:.3g} s of the gradient reduction ({early:.0%} of the "
            f"layers) beside {used} of the last {n} of {ticks} ticks, charged {charge:.0%} "
            f"(dp_sync {best.time['dp_sync_full']:.3g} s without it; modeled from the schedule, not measured on a GPU)"
        )
    if best.time.get("tp_hidden", 0) > 0:
        lines.append(
            f"#1 tp_comm_overlap: {best.time['tp_hidden']:.3g} s of the TP all-gathers and reduce-scatters hidden "
            f"beside the chunks' matmuls, net of the {charge:.0%} charge (tensor_comm "
            f"{best.time['tensor_comm'] + best.time['tp_hidden']:.3g} s without it; modeled, not measured on a GPU)"
        )
    return lines


def _zero_variant_lines(lay: Layout, model) -> list[str]:
    """The best layout's ZeRO-2/3 variant as the setting that runs it, and what the run's `auto` would
    pick instead where it differs (`layerwise` asks the run's rule)."""
    field = {3: "zero3_gather", 2: "zero2_reduce"}.get(lay.zero)
    if field is None or getattr(lay, field) == "auto":
        return []
    chosen = getattr(lay, field)
    line = f"#1 ZeRO-{lay.zero}: train.{field}={chosen}"
    if model is not None:
        auto = layerwise(model, dataclasses.replace(lay, **{field: "auto"}))
        picked = ("layer" if lay.zero == 3 else "microbatch") if auto else "step"
        line += " (what auto picks too)" if picked == chosen else f" (auto would pick {picked}: set it in the config)"
    return [line]


def _best_memory_lines(best: Result) -> list[str]:
    """The best layout's memory per device, part by part, on its first, middle and last stage."""
    lines = ["", "#1 memory per device (GB)"]
    stages = best.memory["stages"]
    lines.append(f"  {'stage':<14}" + "".join(f"{k:>12}" for k in MEMORY_PARTS))
    for label, part in stages.items():
        lines.append(
            f"  {label + ' (' + str(part['stage']) + ')':<14}" + "".join(f"{part[k] / GB:>12.3f}" for k in MEMORY_PARTS)
        )
    over = stages[next(iter(stages))]
    lines.append(
        "  overheads = "
        + ", ".join(f"{k.removeprefix('overhead_')} {over[k] / GB:.2f}" for k in over if k.startswith("overhead_"))
    )
    return lines


def _axis_shares(t: dict) -> str:
    """The rule of thumb that at peak efficiency TP : PP : DP time is about 3 : 2 : 1, checked on this
    layout: tensor = TP all-reduces, pipe = point-to-point sends + bubble, data = gradient sync (+ ZeRO)."""
    tp, pp, dp = t["tensor_comm"], t["pipe_comm"] + t["bubble"], t["dp_sync"] + t["zero_comm"]
    shares = ", ".join(f"{k} {v / t['total']:.1%}" for k, v in (("TP", tp), ("PP", pp), ("DP", dp)))
    ratio = " : ".join(f"{v / dp:.2g}" for v in (tp, pp, dp)) if dp > 0 else "n/a (no data-parallel sync)"
    return f"#1 parallelism time shares of the step: {shares}; TP : PP : DP = {ratio} (rule of thumb: ~3 : 2 : 1)"
