"""Layers per pipeline stage that minimise the slowest stage, given per-layer and end-stage costs.

Pure Python (no JAX): the planner costs layouts with it, the pipeline's `LayerSplit` (balance=auto)
builds its stages with it. The first stage also runs the embedding, the last the output head and
the vocabulary cross-entropy, so giving those stages fewer layers shortens the slowest stage.
"""

from __future__ import annotations

import heapq

from meshrun.errors import ConfigError


def split_layers(
    n_layers: int, n_stages: int, *, layer_cost: float, first_cost: float = 0.0, last_cost: float = 0.0
) -> tuple[int, ...]:
    """Layers per stage (in order, each >= 1, summing to n_layers) that minimise the slowest stage's
    cost, where stage i costs n_i * layer_cost, plus first_cost on stage 0 and last_cost on the last.

    Every layer adds the same cost, so filling the currently cheapest stage one layer at a time is
    optimal for the maximum (greedy list scheduling with equal jobs). Ties go to the stage with the
    smaller fixed cost, then the earlier one, so equal costs give the usual even split."""
    if n_stages < 1:
        raise ConfigError("pipe", n_stages, "use at least 1 pipeline stage")
    if n_layers < n_stages:
        raise ConfigError(
            "model.n_layers",
            n_layers,
            f"use at least one layer per stage ({n_stages} stages)",
            "fewer layers than stages",
        )
    if not layer_cost > 0 or first_cost < 0 or last_cost < 0:
        raise ConfigError(
            "layer_cost", (layer_cost, first_cost, last_cost), "give a positive layer cost and non-negative extras"
        )
    fixed = [0.0] * n_stages
    fixed[0] += first_cost
    fixed[-1] += last_cost
    counts = [1] * n_stages
    heap = [(fixed[i] + 2 * layer_cost, fixed[i], i) for i in range(n_stages)]  # cost after one more layer
    heapq.heapify(heap)
    for _ in range(n_layers - n_stages):
        _, f, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, (f + (counts[i] + 1) * layer_cost, f, i))
    return tuple(counts)
