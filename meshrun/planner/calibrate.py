"""Calibration of the kernel model on Megatron-LM's measured PTD-P runs, with leave-one-out.

Narayanan et al. 2021, Table 1: GPT models of 1.7B to 1T parameters on A100 80GB (Selene: DGX A100
nodes, 8 HDR 200 Gb/s NICs each), seq 2048, vocab 51200, measured TFLOP/s per GPU. Assumed (the
table does not say): micro-batch size 1, plain 1F1B schedule, no ZeRO, no sequence parallelism, full
activation recomputation, dropout 0.1, no flash attention (2021), Megatron's semantics
(`framework='megatron'`).
"""

from __future__ import annotations

import dataclasses
import math

from meshrun.analysis import flops
from meshrun.config import ModelConfig, model_class
from meshrun.planner import published, timing
from meshrun.planner.constants import H100_CALIBRATION
from meshrun.planner.cost import Layout
from meshrun.planner.fit import fit_logs
from meshrun.planner.hardware import parse_cluster
from meshrun.planner.kernels import Calibration

# (params B, heads, hidden, layers, TP, PP, GPUs, global batch, measured TFLOP/s per GPU)
MEGATRON_TABLE1 = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137.0),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138.0),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142.0),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135.0),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138.0),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140.0),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148.0),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155.0),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163.0),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163.0),
)
DROPOUT = 0.1  # GPT-3 / Megatron-LM's hidden and attention dropout


def gpt_config(heads: int, hidden: int, layers: int, vocab: int = 51200, seq: int = 2048) -> ModelConfig:
    """GPT-3-style model of Megatron's tables: gelu MLP with ffn 4h, MHA, tied embeddings, bf16 (the
    default family's config with those settings, as configs/models/megatron-*.yaml)."""
    return model_class("")(
        vocab=vocab, d_model=hidden, n_layers=layers, n_heads=heads, n_kv_heads=heads, head_dim=hidden // heads,
        d_ff=4 * hidden, max_seq_len=seq, dtype="bfloat16", param_dtype="bfloat16", mlp="gelu",
        tie_embeddings=True, remat="full",
    )  # fmt: skip


def _row_case(row):
    size, heads, hidden, layers, t, p, gpus, batch, measured = row
    d = gpus // (t * p)
    layout = Layout(tensor=t, pipe=p, data=d, microbatches=batch // d, micro_batch_size=1, remat="full")
    return gpt_config(heads, hidden, layers), layout, parse_cluster(f"a100-80g:{gpus // 8}x8"), batch


def predict_row(row, cal: Calibration) -> float:
    """Predicted TFLOP/s per GPU (Megatron's hardware FLOPs: model + recompute) of one table row."""
    model, layout, cluster, batch = _row_case(row)
    tm = timing.predict_time(model, layout, cluster, 2048, calibration=cal, framework="megatron", dropout=DROPOUT)
    return flops.hardware_flops(model, batch, 2048, "full") / (tm["total"] * cluster.n_devices) / 1e12


FIELDS = ("gemm", "hbm")


def fit_calibration(rows=MEGATRON_TABLE1, start: Calibration | None = None) -> Calibration:
    """Least squares of log(predicted / measured) over `rows` in the logs of the Calibration fields,
    Gauss-Newton (Levenberg-damped) with numerical derivatives; gemm and hbm stay <= 1. Rounded."""
    start = start or timing.CALIBRATION
    x = [math.log(max(getattr(start, f), 1e-6)) for f in FIELDS]
    n = len(x)

    def resid(x):
        cal = Calibration(**{f: math.exp(v) for f, v in zip(FIELDS, x)})
        return [math.log(predict_row(r, cal) / r[-1]) for r in rows]

    x = fit_logs(resid, x, upper=[0.0] * n, iters=20, max_step=1.0, tol=1e-4)  # fractions of peak <= 1
    return Calibration(gemm=round(math.exp(x[0]), 3), hbm=round(math.exp(x[1]), 3))


def leave_one_out(rows=MEGATRON_TABLE1) -> list[tuple[float, float, float, float]]:
    """For each row: (params B, measured, predicted with the row left out of the fit, relative error)."""
    out = []
    for i, row in enumerate(rows):
        cal = fit_calibration(rows[:i] + rows[i + 1 :])
        pred = predict_row(row, cal)
        out.append((row[0], row[-1], pred, pred / row[-1] - 1))
    return out


def loo_table(rows=MEGATRON_TABLE1) -> str:
    """The leave-one-out table of docs/benchmarks.md (markdown)."""
    lines = ["| params | TP | PP | measured | LOO predicted | error |", "|---:|---:|---:|---:|---:|---:|"]
    for row, (size, meas, pred, err) in zip(rows, leave_one_out(rows)):
        lines.append(f"| {size:g}B | {row[4]} | {row[5]} | {meas:.0f} | {pred:.1f} | {err:+.1%} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the published H100 runs

# the H100 calibration's fitted fields (hbm stays the A100 fit's); overlap: the share of hidden
# communication charged under Megatron's semantics (`Cluster.overlap_for`), 0 where its fit falls under OVERLAP_FLOOR
PUBLISHED_FIELDS = ("gemm", "fp8", "flash", "overlap")
OVERLAP_FLOOR = 1e-3


def published_residuals(cases, cal: Calibration) -> list[float]:
    """log(predicted / published step time) of each case under `cal` (Megatron's semantics)."""
    return [math.log(published.evaluate(c, calibration=cal).step_time / c.row["step_s"]) for c in cases]


def fit_published(path, fields=PUBLISHED_FIELDS, start: Calibration | None = None) -> Calibration:
    """Least squares of log(predicted / published step time) over the rows of the calibration file at
    `path` that are not held out (`fit_cases`)."""
    return fit_cases([c for c in published.cases(path) if not c.row.get("held_out")], fields, start)


def fit_cases(cases, fields=PUBLISHED_FIELDS, start: Calibration | None = None) -> Calibration:
    """Least squares of log(predicted / published step time) over `cases`, in the logs of `fields` of
    the GPU's Calibration (Gauss-Newton, Levenberg-damped, numerical derivatives; fractions of peak
    stay <= 1). The overlap share can reach 0, which its log cannot: where its fit falls under
    OVERLAP_FLOOR, it is 0 and the other fields are fitted again with it there. Rounded to 3 digits."""
    base = start or H100_CALIBRATION
    base = dataclasses.replace(base, fp8=base.fp8_gemm)  # fit the fp8 fraction in its own right
    cal = _fit_logs_of(cases, fields, base)
    if "overlap" in fields and cal.overlap < OVERLAP_FLOOR:
        rest = tuple(f for f in fields if f != "overlap")
        cal = _fit_logs_of(cases, rest, dataclasses.replace(cal, overlap=0.0))
    return dataclasses.replace(cal, **{f: round(getattr(cal, f), 3) for f in fields})


def _fit_logs_of(cases, fields, base: Calibration) -> Calibration:
    """`base` with `fields` at their least-squares fit (`fit_cases`), unrounded."""
    x = [math.log(max(getattr(base, f), OVERLAP_FLOOR)) for f in fields]

    def cal_of(x):
        return dataclasses.replace(base, **{f: math.exp(v) for f, v in zip(fields, x)})

    x = fit_logs(lambda x: published_residuals(cases, cal_of(x)), x, upper=[0.0] * len(x), iters=30, max_step=0.5,
                 tol=1e-5)  # fmt: skip
    return cal_of(x)


def leave_one_model_out(path) -> dict[str, float]:
    """Generalisation of the published fit: for each model of the rows not held out, the constants
    fitted on the other models' rows (`fit_cases`) predict its rows. {row id: predicted / published - 1}."""
    cases = [c for c in published.cases(path) if not c.row.get("held_out")]
    out = {}
    for model in dict.fromkeys(c.row["model"] for c in cases):
        cal = fit_cases([c for c in cases if c.row["model"] != model])
        for c in cases:
            if c.row["model"] == model:
                out[c.id] = published.evaluate(c, calibration=cal).step_time / c.row["step_s"] - 1
    return out
