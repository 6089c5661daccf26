"""Which stacked layers each pipeline stage runs, and the padded placement that holds them.

Virtual stage k (chunk c of stage s: k = c*p + s, or in a V `schedules.vstage`) runs `counts[k]`
consecutive stacked layers (units), in model order. The executor's SPMD program needs one shape on
every stage, so in the pipeline placement every chunk is padded to `lmax = max(counts)` entries: the
stacked axis becomes [p, v, lmax] (a contiguous P('pipe') shard is one device's v chunks). Padding
entries are zeros, their gradients are zero, and the stage skips them (`uneven_apply`: `lax.cond` on
a per-chunk count). Checkpoints keep model order ([L]), so they restore into any split.

Even splits keep the old placements: v = 1 is the identity, v > 1 a reshape ([v, p, Lc] -> [p, v, Lc]),
a V a reshape and a flip.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from meshrun.config import PipelineConfig
from meshrun.errors import ConfigError
from meshrun.pipeline import registry
from meshrun.pipeline.layer_balance import split_layers
from meshrun.pipeline.schedules import ChunkPlacement, vstage


@dataclass(frozen=True)
class LayerSplit:
    counts: tuple[int, ...]  # stacked layers per virtual stage k
    p: int
    v: int
    placement: ChunkPlacement = "loop"  # which virtual stage chunk c of stage s holds (`schedules.vstage`)

    @property
    def n(self) -> int:
        return sum(self.counts)

    @property
    def lmax(self) -> int:
        return max(self.counts)

    @property
    def lmin(self) -> int:
        return min(self.counts)

    @property
    def even(self) -> bool:
        return self.lmin == self.lmax

    @property
    def identity(self) -> bool:
        """Model order is already the pipeline placement."""
        return self.even and self.v == 1

    @property
    def reshaped(self) -> bool:
        """The pipeline placement is a reshape of model order (an even split of Megatron's chunks)."""
        return self.even and self.placement == "loop"

    def k(self, c: int, s: int) -> int:
        """Virtual stage of chunk c of stage s."""
        return vstage(c, s, self.p, self.placement)

    def count(self, c, stage):
        """counts[virtual stage of chunk c of `stage`] (traceable c and stage)."""
        counts = jnp.asarray(self.counts, jnp.int32)
        if self.placement == "v":
            return counts[jnp.where(c == 0, stage, 2 * self.p - 1 - stage)]
        return counts[c * self.p + stage]

    @property
    def padded(self) -> int:
        return self.p * self.v * self.lmax

    def pipeline_index(self) -> np.ndarray:
        """[p*v*lmax]: the model-order unit at each padded position, -1 for padding."""
        starts = np.concatenate([[0], np.cumsum(self.counts)])
        out = np.full((self.p, self.v, self.lmax), -1, np.int32)
        for c in range(self.v):
            for s in range(self.p):
                k = self.k(c, s)
                out[s, c, : self.counts[k]] = np.arange(starts[k], starts[k + 1])
        return out.reshape(-1)

    def model_index(self) -> np.ndarray:
        """[n]: the padded position of each model-order unit (inverse of `pipeline_index`)."""
        idx = self.pipeline_index()
        pos = np.empty(self.n, np.int32)
        pos[idx[idx >= 0]] = np.nonzero(idx >= 0)[0]
        return pos

    def to_pipeline(self, layers):
        """Stacked layer tree in model order [n, ...] -> pipeline placement [p*v*lmax, ...]."""
        if self.identity:
            return layers
        if self.reshaped:
            lc = self.lmax
            one = lambda a: a.reshape(self.v, self.p, lc, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)
            return jax.tree.map(one, layers)
        if self.even and self.placement == "v":  # stage s holds virtual stages s and 2p-1-s
            return jax.tree.map(lambda a: self._v(a.reshape(2, self.p, self.lmax, *a.shape[1:])).swapaxes(0, 1)
                                .reshape(a.shape), layers)  # fmt: skip
        idx = self.pipeline_index()
        take = np.where(idx >= 0, idx, self.n)  # padding reads an appended zero entry

        def one(a):
            a = jnp.concatenate([a, jnp.zeros((1, *a.shape[1:]), a.dtype)])
            return jnp.take(a, take, axis=0)

        return jax.tree.map(one, layers)

    def from_pipeline(self, layers):
        """Inverse of `to_pipeline` (padding entries are dropped)."""
        if self.identity:
            return layers
        if self.reshaped:
            lc = self.lmax
            one = lambda a: a.reshape(self.p, self.v, lc, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)
            return jax.tree.map(one, layers)
        if self.even and self.placement == "v":
            return jax.tree.map(lambda a: self._v(a.reshape(self.p, 2, self.lmax, *a.shape[1:]).swapaxes(0, 1))
                                .reshape(a.shape), layers)  # fmt: skip
        pos = self.model_index()
        return jax.tree.map(lambda a: jnp.take(a, pos, axis=0), layers)

    @staticmethod
    def _v(a):
        """[2, p, ...] chunk-major -> the same with chunk 1's stages reversed (a V; its own inverse):
        a flip and a reshape, where a gather of the layers made XLA all-reduce them all over 'pipe'."""
        return jnp.stack([a[0], jnp.flip(a[1], 0)])


def layer_split(pcfg: PipelineConfig, n_units: int, p: int, costs: tuple[float, float, float] | None = None):
    """The split a config asks for; ConfigError (naming the fix) for a bad one. balance=auto needs
    `costs` = (cost of one stacked unit, extra cost of the first stage, of the last stage), e.g. the
    planner's time model (`meshrun.train.plan.unit_costs`)."""
    v, placement = registry.chunks_of(pcfg), registry.get(pcfg.schedule).placement
    n_v = p * v
    what = f"{n_v} virtual stages (pipe={p} x virtual={v})" if v > 1 else f"pipe={p} stages"
    if pcfg.layers_per_stage:
        return LayerSplit(_given_counts(pcfg.layers_per_stage, n_units, n_v, what), p, v, placement)
    if n_units < n_v:
        raise ConfigError(
            "model.n_layers",
            n_units,
            f"use at least {n_v} stacked layers (MoE: layer groups of moe_every), or fewer stages",
            f"{n_units} stacked layers leave a stage empty on {what}",
        )
    if pcfg.balance == "auto":
        if costs is None:
            raise ConfigError("pipeline.balance", "auto", "pass the per-layer costs, or set pipeline.layers_per_stage")
        per_unit, first, last = costs
        return LayerSplit(split_layers(n_units, n_v, layer_cost=per_unit, first_cost=first, last_cost=last), p, v,
                          placement)  # fmt: skip
    if n_units % n_v:
        raise ConfigError(
            "model.n_layers",
            n_units,
            f"use a multiple of pipe*virtual={n_v} stacked layers (MoE: layer groups of moe_every), or set "
            f"pipeline.layers_per_stage={list(_even(n_units, n_v))} or pipeline.balance=auto",
            f"{n_units} stacked layers do not split evenly into {what}",
        )
    return LayerSplit((n_units // n_v,) * n_v, p, v, placement)


def _given_counts(layers_per_stage, n_units: int, n_v: int, what: str) -> tuple[int, ...]:
    """`pipeline.layers_per_stage` as a tuple, or ConfigError unless it gives one count per virtual
    stage (n_v of them, `what` in the message) that sum to the n_units stacked layers."""
    counts = tuple(layers_per_stage)
    if len(counts) != n_v:
        raise ConfigError(
            "pipeline.layers_per_stage",
            list(counts),
            f"give one count per stage: {n_v} numbers for {what}, in model order (chunk-major)",
            "wrong length",
        )
    if sum(counts) != n_units:
        raise ConfigError(
            "pipeline.layers_per_stage",
            list(counts),
            f"make the counts sum to the {n_units} stacked layers, e.g. {list(_even(n_units, n_v))}",
            f"sum {sum(counts)} != {n_units} stacked layers",
        )
    return counts


def _even(n: int, k: int) -> tuple[int, ...]:
    """As even as possible, the larger counts in the middle stages (the ends embed / run the head)."""
    base, extra = divmod(n, k)
    order = sorted(range(k), key=lambda i: (abs(i - (k - 1) / 2), i))
    more = set(order[:extra])
    return tuple(base + (i in more) for i in range(k))


def uneven_apply(apply_layers: Callable, lmin: int, n, params, x):
    """`apply_layers` over the first `n` entries of a chunk padded to lmax entries (`split.py`):
    the first `lmin` (every chunk holds at least that many) run as one call; each further entry
    runs under `lax.cond(j < n)`, so a shorter stage skips its padding (no FLOPs, zero gradients).
    `n` is traced (it depends on the stage), so one program serves every stage."""
    head = jax.tree.map(lambda a: a[:lmin], params)
    tail = jax.tree.map(lambda a: a[lmin:], params)
    y, aux = apply_layers(head, x)
    lmax = jax.tree.leaves(params)[0].shape[0]

    def unit(carry, inp):
        y, aux = carry
        p_j, j = inp
        run = lambda: apply_layers(jax.tree.map(lambda a: a[None], p_j), y)
        skip = lambda: (y, jax.tree.map(jnp.zeros_like, aux))
        y, a_j = jax.lax.cond(j < n, run, skip)
        return (y, jax.tree.map(jnp.add, aux, a_j)), None

    (y, aux), _ = jax.lax.scan(unit, (y, aux), (tail, jnp.arange(lmin, lmax)))
    return y, aux
