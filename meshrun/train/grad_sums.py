"""What the microbatch scan differentiates and where its float32 gradient sums rest (`GradSums`).

`accumulate_grads` asks a `GradSums` for the differentiated tree, the zero sums and how a
microbatch's gradient goes into them, so it does not branch on the placement itself. The placement
(`sums_at`) is decided once from the step's ZeroShardings and the gradient sink it is traced with:

* whole  -- the parameters themselves are differentiated; the sums are float32 trees in device memory.
* device -- per layer (ZeRO-3 / ZeRO-2 per layer): the layers' gradient goes to float32 arrays beside
  them (`layer_fetch.Shadowed`), 1/DP of the layers' sums in device memory (`ZeroShardings.layer_sums`).
* host   -- the same with the layers' sums in pinned host memory (offload.params), added to a layer at a time.
* sink   -- offload.grads=nvme: the layers are shadowed by their sink indices (`layer_fetch.sink_index`),
  their gradient goes to the sink and their squared sums come back (one microbatch).

Per layer (device, host, sink) the other entries' gradient (embedding, head, final norm) goes every
microbatch to 1/DP float32 sums in device memory (`ZeroShardings.rest_fetch`, `rest_sums`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from meshrun.parallel.layer_fetch import add_to, grad_sink, host_zeros, on_host, shadowed, sink_index
from meshrun.parallel.sharding import is_spec
from meshrun.parallel.zero import ZeroShardings, accum_zeros, without_layers

PLACES = ("whole", "device", "host", "sink")


def sums_at(zl: ZeroShardings) -> str:
    """Where the layers' gradient sums rest (one of PLACES); call it inside the step's trace."""
    if not zl.per_layer:
        return "whole"
    if zl.from_host:
        return "sink" if grad_sink() is not None else "host"
    return "device"


def _add(acc: jax.Array, g: jax.Array) -> jax.Array:
    """A microbatch's gradient into the sums; one that left the scan reduced, in host memory, is the sum."""
    return g if on_host(g) else add_to(acc, g)


@dataclass(frozen=True)
class GradSums:
    """The differentiated tree and the gradient sums of one step's microbatch scan (see the module doc).
    Per layer the differentiated tree is (params but the layers, the layers' float32 arrays)."""

    at: str  # one of PLACES
    params: Any = None  # the loop's local params (`bind`)
    # per layer: (params, z) -> params of the entries other than the layers, whose gradient the backward
    # reduces into their 1/DP float32 sums z (`ZeroShardings.rest_fetch`)
    fetch_rest: Any = None

    @classmethod
    def of(cls, zl: ZeroShardings, microbatches: int) -> GradSums:
        at = sums_at(zl)
        if at == "sink" and microbatches != 1:
            raise ValueError("a gradient sink takes one microbatch (config.offload_params_refusals)")
        return cls(at, fetch_rest=zl.rest_fetch())

    def layout(self, zl: ZeroShardings) -> ZeroShardings:
        """The step's ZeroShardings as the loop reduces: per layer every entry leaves it reduced."""
        return dataclasses.replace(zl, rest_reduced=True) if self.fetch_rest is not None else zl

    def bind(self, params: Any) -> GradSums:
        return dataclasses.replace(self, params=params)

    @property
    def per_layer(self) -> bool:
        return self.at != "whole"

    def out_specs(self, zl: ZeroShardings) -> Any:
        """out_specs of the loop's gradient; with a sink the layers' squared sums, the same on every device."""
        out = zl.partial_specs()
        if self.at == "sink":
            out = {**out, "layers": jax.tree.map(lambda _: P(), out["layers"], is_leaf=is_spec)}
        return out

    def loss(self, share, d: Any, *mb: Any):
        """`share` (params, *microbatch -> (loss, aux)) of the differentiated tree `d`."""
        if not self.per_layer:
            return share(d, *mb)
        rest = d[0] if self.fetch_rest is None else self.fetch_rest(without_layers(self.params), d[0])
        return share({**rest, "layers": shadowed(self.params["layers"], d[1])}, *mb)

    def primal(self, sums: Any) -> Any:
        """The differentiated tree, given the gradient sums (per layer: the layers' arrays are the sums)."""
        if not self.per_layer:
            return self.params
        rest = without_layers(self.params if self.fetch_rest is None else sums)
        return rest, sums["layers"]

    def diff(self, sums: Any) -> Any:
        """The sums shaped as the differentiated tree (`bw_split.vjp_into` adds into them)."""
        return (without_layers(sums), sums["layers"]) if self.per_layer else sums

    def grads(self, g: Any) -> Any:
        """A gradient of the differentiated tree as a tree of the params."""
        return {**g[0], "layers": g[1]} if self.per_layer else g

    def zeros(self, zl: ZeroShardings, shapes: Any) -> Any:
        """The zero float32 sums (`shapes`: the gradient's) where they rest; with a sink, its indices."""
        if self.at == "whole":
            return accum_zeros(shapes)
        rest = zl.rest_sums(self.params)  # per layer: the other entries' 1/DP sums, wherever the layers' rest
        if self.at == "sink":
            return {**rest, "layers": sink_index(self.params["layers"])}
        if self.at == "host":  # m = 1: the float32 reduced gradient itself
            return {**rest, "layers": host_zeros(jax.eval_shape(accum_zeros, shapes["layers"]))}
        return {**rest, "layers": zl.layer_sums(self.params["layers"])}  # 1/DP (ZeRO-2: of whole params)

    def first(self, acc: Any, g: Any, aux: Any) -> Any:
        """With one microbatch: (sums, aux sums) after its gradient `g` (a tree of the params)."""
        out = jax.tree.map(_add, acc, (g, aux))
        if self.at == "sink":  # the layers' gradient went to the sink; their squared sums came back
            out[0]["layers"] = g["layers"]
        return out
