"""Planner: hardware specs, memory + FLOPs + comm + bubble cost model, layout search, rules.

Pure Python (no JAX): `meshrun plan` answers "what TP/PP/DP/EP should I use?" before anyone pays for GPUs.
"""

from meshrun.analysis.flops import hardware_flops, model_flops, param_counts
from meshrun.planner.balance import split_layers
from meshrun.planner.cost import Layout, Precision, precision_of, predict_memory
from meshrun.planner.hardware import GPUS, Cluster, parse_cluster
from meshrun.planner.search import Result, evaluate
from meshrun.planner.step_model import predict_collective_bytes, predict_memory_jax
from meshrun.planner.timing import CALIBRATION, predict_time

# `meshrun.planner.search` stays the module (search.search(...) ranks layouts); it is not shadowed here.

__all__ = [
    "CALIBRATION",
    "GPUS",
    "Cluster",
    "Layout",
    "Precision",
    "Result",
    "evaluate",
    "hardware_flops",
    "model_flops",
    "param_counts",
    "parse_cluster",
    "precision_of",
    "predict_collective_bytes",
    "predict_memory",
    "predict_memory_jax",
    "predict_time",
    "split_layers",
]
