"""Uneven pipeline splits: layers per stage that minimise the slowest stage (pure Python, no JAX).

The first stage also embeds and the last one runs the head and the loss (a d_model x vocab matmul
per token, forward and backward), so with a vocabulary that is large next to a layer they should
hold fewer layers. Costs are in any one unit (FLOPs per token here); a stage's cost is
count * layer_cost (+ first_cost on stage 0, + last_cost on the last stage).
"""

from __future__ import annotations

from meshrun.config import ModelConfig
from meshrun.errors import ConfigError


def split_layers(
    n_layers: int, n_stages: int, *, layer_cost: float, first_cost: float = 0.0, last_cost: float = 0.0
) -> tuple[int, ...]:
    """Contiguous layer counts per stage (each >= 1, summing to n_layers) minimising the largest
    stage cost; among optimal splits, layers are taken from the costliest stages first."""
    if n_stages < 1 or n_layers < n_stages:
        raise ConfigError(
            "pipeline.layers_per_stage", n_layers, f"use at least one layer per stage ({n_stages} stages)"
        )
    if layer_cost <= 0:
        raise ConfigError("layer_cost", layer_cost, "use a positive cost per layer")
    extra = stage_times([0] * n_stages, layer_cost=layer_cost, first_cost=first_cost, last_cost=last_cost)

    def caps(bound: float) -> list[int]:
        return [max(0, int((bound - e) / layer_cost + 1e-9)) for e in extra]

    # The optimum is one of the values count * layer_cost + extra_s: try them in increasing order.
    cands = sorted({c * layer_cost + e for e in extra for c in range(1, n_layers + 1)})
    lo, hi = 0, len(cands) - 1
    while lo < hi:  # smallest bound whose caps hold every layer with no empty stage
        mid = (lo + hi) // 2
        c = caps(cands[mid])
        if min(c) >= 1 and sum(c) >= n_layers:
            hi = mid
        else:
            lo = mid + 1
    counts = caps(cands[lo])
    while sum(counts) > n_layers:  # drop surplus from the costliest stage (ties: the later one)
        cost = stage_times(counts, layer_cost=layer_cost, first_cost=first_cost, last_cost=last_cost)
        counts[max((i for i in range(n_stages) if counts[i] > 1), key=lambda i: (cost[i], i))] -= 1
    return tuple(counts)


def stage_times(counts, *, layer_cost: float, first_cost: float = 0.0, last_cost: float = 0.0) -> tuple[float, ...]:
    """Cost of each stage of a split (same units as the inputs); the slowest one paces the pipeline."""
    out = [n * layer_cost for n in counts]
    out[0] += first_cost
    out[-1] += last_cost
    return tuple(out)


def stage_costs(model: ModelConfig, seq_len: int) -> dict[str, float]:
    """Forward FLOPs per token of one stacked unit (MoE: a group of moe_every layers), of the
    embedding (a gather: counted as one multiply-add per element it writes) and of the head + loss."""
    from meshrun import flops

    dense = flops.layer_fwd_flops(model, 1.0, seq_len)
    unit = dense
    if model.is_moe:
        unit = (model.moe_every - 1) * dense + flops.layer_fwd_flops(model, 1.0, seq_len, moe=True)
    return {
        "layer_cost": unit,
        "first_cost": 2.0 * model.d_model,
        "last_cost": 2.0 * model.d_model * model.vocab + 5.0 * model.vocab,  # matmul + softmax/xent
    }
