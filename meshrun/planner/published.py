"""Published training runs as planner cases: each row of a calibration file (tests/data/published_runs.yaml:
NVIDIA's DGX Cloud Benchmarking H100 recipes) -> the model, the layout and the cluster it ran on,
costed under Megatron's semantics the way `meshrun plan --framework megatron --evaluate` costs one
layout (`cli.plan.parse_evaluate` + `search.evaluate`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from meshrun.config import ModelConfig, model_class
from meshrun.planner import search
from meshrun.planner.constants import Calibration, calibration_for, with_attention_kernel
from meshrun.planner.hardware import GB, parse_cluster
from meshrun.planner.layout import Layout

REMATS = {"none": "none", "selective": "selective", "full": "full"}


@dataclass(frozen=True)
class Case:
    """One published run: its row, and the planner's model, layout and cluster for it."""

    row: dict
    model: ModelConfig
    layout: Layout
    cluster: object
    dropout: float

    @property
    def id(self) -> str:
        return self.row["id"]


def load(path: str | Path) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def model_of(spec: dict, row: dict) -> ModelConfig:
    """The planner's model of a run: the file's shape, the row's layer count (the proxies' fewer layers),
    bf16 compute and params, flash attention (Transformer Engine's fused attention), fp8 rows with
    delayed scaling (TE's recipe: amax history, no per-step amax all-reduce)."""
    kw = dict(
        vocab=spec["vocab"], d_model=spec["d_model"], n_layers=row.get("n_layers", spec["n_layers"]),
        n_heads=spec["n_heads"], n_kv_heads=spec["n_kv_heads"], head_dim=spec["d_model"] // spec["n_heads"],
        d_ff=spec["d_ff"], max_seq_len=row["seq_len"], mlp=spec["mlp"], tie_embeddings=spec["tie_embeddings"],
        dtype="bfloat16", param_dtype="bfloat16", attention_impl="cudnn", remat=REMATS[row["recompute"]],
        sequence_parallel=bool(row["sp"]), fp8="delayed" if row["dtype"] == "fp8" else "none",
    )  # fmt: skip
    if spec.get("n_experts"):
        kw |= dict(n_experts=spec["n_experts"], top_k=spec["top_k"], capacity_factor=spec["capacity_factor"],
                   moe_dispatch=spec["moe_dispatch"])  # fmt: skip
    return model_class("llama")(**kw)


def case_of(data: dict, row: dict) -> Case:
    """The row's model, layout (Megatron's degrees; data = the GPUs left over, expert folded out of it;
    the distributed optimizer: ZeRO-1, the gradient buffer in grad_sync_dtype; context parallelism as
    Megatron-Core runs it, Transformer Engine's ring of K/V blocks beside the attention with zigzag load
    balancing: the `ring` kind) and cluster (DGX H100
    nodes of 8). fp8 rows (fp8_params): the weights as fp8 data plus the transposed copy Hopper's fp8
    GEMMs read, costed as the 2 bytes of bf16."""
    spec = data["models"][row["model"]]
    model = model_of(spec, row)
    t, p, c, e = row["tensor"], row["pipe"], row["context"], row["expert"]
    d = row["gpus"] // (t * p * c * e)
    b = row["micro_batch"]
    layout = Layout(
        tensor=t, pipe=p, data=d, expert=e, context=c, context_kind="ring", virtual=row["virtual"], micro_batch_size=b,
        microbatches=row["global_batch"] // (b * d * e), zero=1, remat=model.remat,
        sequence_parallel=bool(row["sp"]), schedule="interleaved" if row["virtual"] > 1 else "1f1b",
        tp_comm_overlap=bool(row["tp_overlap"]) and bool(row["sp"]), overlap_grad_reduce=row["virtual"] > 1,
        tp_comm_fp8_rs=bool(spec.get("tp_overlap_fp8_rs")) and row["dtype"] == "fp8",  # fp8_buf=$FP8_ENABLED
        overlap_param_gather=bool(spec["overlap_param_sync"]),
        wgrad_deferral=row.get("wgrad_deferral", spec.get("wgrad_deferral", 0)),
        grad_reduce_dtype={"bf16": "bfloat16", "fp32": "float32"}[spec["grad_sync_dtype"]],
        # NeMo's distributed Adam keeps 16-bit master remainders on bf16 models, a full fp32 copy with fp8_params
        param_remainders=spec["optimizer"] == "distributed_fused_adam" and row["dtype"] == "bf16",
    )  # fmt: skip
    cluster = parse_cluster(f"h100-80g:{max(1, row['gpus'] // 8)}x{min(8, row['gpus'])}")
    row = {"attention": spec.get("attention", "cudnn"), **row}  # the recipe's attention backend
    return Case(row, model, layout, cluster, float(spec.get("dropout", 0.0)))


def cases(path: str | Path) -> list[Case]:
    data = load(path)
    return [case_of(data, row) for row in data["runs"]]


def calibration_of(case: Case, cal: Calibration | None = None) -> Calibration:
    """The kernel calibration a row runs under: `cal` (default the GPU's), with FlashAttention-2's
    efficiency where its launch script selects that backend (NVTE_FUSED_ATTN=0: `attention: flash2`;
    `meshrun plan --attention-kernel flash2`)."""
    gpu = case.cluster.gpu.name
    return with_attention_kernel(cal or calibration_for(gpu), case.row["attention"], gpu)


def evaluate(case: Case, calibration: Calibration | None = None, **kw) -> search.Result:
    """`search.evaluate` of the published layout with Megatron's semantics (kw: calibration), the
    cluster charging the calibration's overlap share (`Calibration.overlap`)."""
    cal = kw["calibration"] = calibration_of(case, calibration)
    cluster = replace(case.cluster, overlap_cost=cal.overlap)
    return search.evaluate(case.model, case.layout, cluster, case.row["global_batch"], case.row["seq_len"],
                           framework="megatron", dropout=case.dropout, **kw)  # fmt: skip


def table(rows: list[Case], **kw) -> tuple[str, list[float]]:
    """(markdown table of predicted vs published step time and memory per row, the ratios)."""
    lines = ["| run | GPUs | layout | memory GB | predicted s | published s | ratio |",
             "|---|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    ratios = []
    for c in rows:
        r = evaluate(c, **kw)
        lay = c.layout
        what = f"TP{lay.tensor} PP{lay.pipe} CP{lay.context} EP{lay.expert} VP{lay.virtual} DP{lay.data}"
        ratio = r.step_time / c.row["step_s"]
        ratios.append(ratio)
        held = " (held out)" if c.row.get("held_out") else ""
        lines.append(f"| {c.id}{held} | {c.row['gpus']} | {what} | {r.memory['total'] / GB:.1f} | "
                     f"{r.step_time:.2f} | {c.row['step_s']:.2f} | {ratio:.3f} |")  # fmt: skip
    errs = [abs(x - 1) for x in ratios]
    lines.append(f"\nmedian |error| {statistics.median(errs):.1%}, worst {max(errs):.1%}, "
                 f"{sum(x < 1 for x in ratios)} optimistic / {sum(x > 1 for x in ratios)} pessimistic")  # fmt: skip
    return "\n".join(lines), ratios
