"""Per-stage costs for `pipeline.balance=auto`: the planner's time of one layer, the embedding and the
head, fed to `pipeline.layer_balance.split_layers` (the split itself lives there, beside the executor).

Pure Python. The first stage also runs the embedding and the last the head and the vocabulary
cross-entropy, so those stages get fewer layers when the vocabulary is large.
"""

from __future__ import annotations

from meshrun.config import ModelConfig
from meshrun.pipeline.layer_balance import split_layers
from meshrun.planner.hardware import GPUS
from meshrun.planner.layout import Layout
from meshrun.planner.timing import stage_seconds

__all__ = ["DEFAULT_GPU", "balanced_split", "split_layers", "stage_cost", "stage_costs"]
DEFAULT_GPU = "a100-80g"  # what stage costs model when the run's GPU is unknown (a CPU, a GPU not in GPUS)


def stage_cost(split: tuple[int, ...], *, layer_cost: float, first_cost: float = 0.0, last_cost: float = 0.0) -> list:
    """Cost of each stage of `split` (same units as the inputs)."""
    out = [n * layer_cost for n in split]
    out[0] += first_cost
    out[-1] += last_cost
    return out


def stage_costs(
    model: ModelConfig,
    seq_len: int | None = None,
    *,
    micro_batch_size: int = 1,
    tensor: int = 1,
    remat: str | None = None,
    gpu: str = DEFAULT_GPU,
) -> tuple[float, float, float]:
    """(layer_cost, first_cost, last_cost): seconds of forward + backward of one micro-batch on one
    device for one transformer layer, the embedding, and the head + vocabulary cross-entropy, from
    the planner's time model (`timing.stage_seconds`) on `gpu` at tensor-parallel degree `tensor`."""
    s = seq_len or model.max_seq_len
    layout = Layout(tensor=tensor, micro_batch_size=micro_batch_size, remat=model.remat if remat is None else remat)
    return stage_seconds(model, layout, s, GPUS[gpu])


def balanced_split(model: ModelConfig, n_stages: int, seq_len: int | None = None, **kw) -> tuple[int, ...]:
    """`split_layers` of the model's layers over n_stages with the costs of `stage_costs(model, ...)`."""
    layer, first, last = stage_costs(model, seq_len, **kw)
    return split_layers(model.n_layers, n_stages, layer_cost=layer, first_cost=first, last_cost=last)
