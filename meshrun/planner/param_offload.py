"""`offload.params` in the planner: ZeRO-3 parameters rest in pinned host memory and come to
the device one scan unit (layer) at a time, in the forward and again in the backward; each unit's
reduced gradient leaves as the backward makes it (docs/offload.md "Parameters off the device").
`param_tier` gives the bytes per place, the host-link traffic and the time per device of the fullest
stage; `refusals` the combinations the runtime refuses; `misfits` why a layout does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshrun import config
from meshrun.analysis.flops import param_counts
from meshrun.config import ModelConfig
from meshrun.optim import registry as optimizers
from meshrun.planner import tiers
from meshrun.planner.hardware import Cluster
from meshrun.planner.layout import DTYPE_BYTES, Layout

GRAD_BYTES = 4  # the layers' gradient rests in float32 (layer_fetch.Shadowed)


@dataclass(frozen=True)
class Elements:
    """Parameter elements of one device: `unit` one scan unit gathered (before ZeRO), `edge` the
    non-layer params gathered, `layers` / `edges` their ZeRO-3 shards (N of the traffic table)."""

    unit: float
    edge: float
    layers: float
    edges: float
    units: float  # scan units on the stage

    @property
    def shard(self) -> float:
        return self.layers + self.edges


def elements(model: ModelConfig, layout: Layout, stage_layers: float) -> Elements:
    """The ZeRO-3 element counts of a device on a stage of `stage_layers` layers (as `step_model`:
    norm scales are whole, dense params shard over data x expert x context, experts over data x context)."""
    c, h, t, e = param_counts(model), model.d_model, layout.tensor, layout.expert
    norms = 2 * h * model.n_layers
    frac = stage_layers / model.n_layers
    dp, edp = layout.data * e * layout.context, layout.data * layout.context
    unit = ((c["layers"] - norms) / t + norms + c["experts"] / (t * e)) / model.n_units
    edge = (c["embedding"] + c["head"]) / t
    layers = frac * ((c["layers"] - norms) / t / dp + norms + c["experts"] / (t * e) / edp)
    return Elements(unit, edge + h, layers, edge / dp + h, model.n_units * frac)


def link_bytes(n: float, b: float, m: int, state: float = 0.0, grads: str = "host") -> tuple[float, float]:
    """(host -> device, device -> host) bytes per step of a layer shard of `n` elements of `b` bytes
    with `m` micro-batches and `state` bytes per element resting in host memory (the host tier):
    docs/offload.md's table, row by row (the reduced gradient is float32 whatever `b`). `grads`
    nvme (m = 1): the backward's gradient goes out once, no zeros, no norm read (its squared sums
    come from the backward), and the update reads it back once."""
    if grads == "nvme":
        return 2 * n * b + n * 4 + n * b + state * n, n * 4 + n * b + state * n
    h2d = m * n * b + m * n * b  # forward fetch, backward fetch
    d2h = m * n * 4 + n * 4  # the backward's reduced gradient, and the zeros it goes to (made on the device)
    if m > 1:  # the sums: slice and new gradient in, sum out
        h2d += m * (n * 4 + n * 4)
        d2h += m * n * 4
    h2d += 2 * n * 4 + n * b  # the norm's read, then the update's gradient and params
    d2h += n * b  # the new params
    return h2d + state * n, d2h + state * n


@dataclass(frozen=True)
class ParamTierCost:
    """`offload.params` with the optimizer state in `optimizer` (none | host | nvme), per device."""

    optimizer: str
    grads: str  # where the layers' gradient rests: host | nvme (offload.grads)
    parts: dict  # device bytes by MEMORY_PARTS (total: the larger of backward and update)
    backward: float
    update: float
    host: float  # host memory per GPU
    nvme: float  # bytes on NVMe per GPU (the state's file, and the gradient with grads=nvme)
    grad_nvme: float  # of it, the layers' float32 gradient (written and read once a step)
    h2d: float  # host-link bytes per step, each direction
    d2h: float
    link_s: float  # (h2d + d2h) / the host link: added to the step
    disk_s: float  # the drives' read + write time of the state (nvme)
    exposed_s: float  # link_s + the drives' time beyond the state's own link time
    dp_s: float  # the ZeRO-3 gathers and reduce-scatters per step (replaces the step's dp_sync)
    state: tiers.TierCost | None = None  # the nvme tier's chunks and file

    @property
    def device(self) -> float:
        return max(self.backward, self.update)


def refusals(model: ModelConfig, layout: Layout, optimizer: str, grads: str = "host") -> list[str]:
    """Why meshrun's runtime refuses this combination (empty: it runs it): `config.offload_params_refusals`
    (looked up at call time, so the planner follows it) and the layer-streamed update's elementwise rule."""
    fp8 = model.fp8
    refused = config.offload_params_refusals(layout.zero, optimizer, fp8=fp8, pipe=layout.pipe, offload_grads=grads,
                                             microbatches=layout.microbatches,
                                             overlap_grad_reduce=layout.overlap_grad_reduce)  # fmt: skip
    out = [what for what, _ in refused]
    if not optimizers.get(layout.optimizer).elementwise:
        out.append(f"streams the update layer by layer, which {layout.optimizer}'s update is not")
    return out


# What `param_tier` models, per device of the fullest stage:
# * device: two units' gathered weights (the one computed, the next fetched), the non-layer params
#   (embedding, head, final norm) gathered whole, one unit's fresh gradient and its reduced shard (+ the
#   float32 slice of the sums with micro-batches), the non-layer gradients (+ their float32 sums), the
#   activations and logits of meshrun's step, and the optimizer state unless it rests elsewhere. The
#   update's peak: the non-layer params and gradients, a unit's slices in and out (+ their state with
#   the host tier; with the nvme tier its chunks of
#   state beside their params' and gradients' slices), the optimizer temporaries.
# * host memory: the param shard, the layers' gradient (float32: the sums with micro-batches, else
#   the step's reduced gradient) unless `offload.grads=nvme`, and the optimizer state with the
#   host tier (the nvme tier: its chunk budget).
# * NVMe: the optimizer state's file with the nvme tier (`tiers.optimizer_tier`'s chunks), and with
#   `offload.grads=nvme` the layers' float32 gradient beside it: written once by the backward,
#   read once by the update (one micro-batch: `config.offload_params_refusals`).
# * host link: the traffic table of docs/offload.md, per step and device (`link_bytes`).
#
# Time, conservatively: the host link's bytes (both directions) at `tiers.host_bw` are ADDED to the
# step, none hidden behind compute. Each unit's fetch could overlap the previous unit's compute, but
# no GPU run has shown XLA doing so (XLA:CPU emits no transfers). The drives' time beyond the state's
# own host-link time is added too (nothing overlaps the update). The ZeRO-3 all-gather runs per
# micro-batch in the forward and again in the backward, the reduce-scatter per micro-batch: m x the
# in-memory step's once-per-step gather + reduce-scatter, plus m x its gather (`dp_seconds`).
def param_tier(mem: dict, model: ModelConfig, layout: Layout, cluster: Cluster, optimizer: str, t_dp: float,
               budget_mb: float = tiers.DEFAULT_BUDGET_MB, t_gather: float | None = None,
               grads: str = "host") -> ParamTierCost:  # fmt: skip
    """The figures of `offload.params` for one stage's memory parts `mem` (`predict_memory`,
    meshrun's step, ZeRO-3); `t_dp`: the in-memory step's once-per-step ZeRO-3 sync seconds, `t_gather`
    its all-gathers' part (None: half); `grads`: where the layers' gradient rests (host | nvme)."""
    if optimizer not in tiers.TIERS:
        raise ValueError(f"unknown optimizer tier {optimizer!r}; one of {tiers.TIERS}")
    if grads not in config.OFFLOAD_GRADS:
        raise ValueError(f"unknown gradient tier {grads!r}; one of {config.OFFLOAD_GRADS}")
    el = elements(model, layout, mem.get("layers", model.n_layers / layout.pipe))
    pb = DTYPE_BYTES[model.param_dtype]
    per_elem = mem["opt_state"] / mem["opt_elems"]  # state bytes per element of the shard
    nv = tiers.optimizer_tier(mem, model, layout, cluster, "nvme", 0.0, budget_mb) if optimizer == "nvme" else None
    parts, backward, update = _device_bytes(mem, layout, optimizer, el, pb, per_elem, nv)
    off_device = _off_device(cluster, layout.microbatches, optimizer, grads, el, pb, per_elem, nv)
    return ParamTierCost(optimizer, grads, parts, backward, update, **off_device,
                         dp_s=dp_seconds(t_dp, layout.microbatches, t_gather), state=nv)  # fmt: skip


def _device_bytes(
    mem: dict, layout: Layout, optimizer: str, el: Elements, pb: int, per_elem: float, nv: tiers.TierCost | None
) -> tuple[dict, float, float]:
    """`param_tier`'s device memory (the comment above it): (the parts by MEMORY_PARTS, the backward's
    peak, the update's) for `el` elements of `pb` bytes and `per_elem` state bytes per element of the
    shard; `nv`: the nvme tier's chunks (None: no nvme tier)."""
    m, g = layout.microbatches, GRAD_BYTES
    sums = GRAD_BYTES if m > 1 else 0  # with micro-batches: the float32 slice of the sums
    state = per_elem * el.shard
    u = el.layers / el.units  # one unit's shard
    fixed = mem.get("overhead_context", 0.0) + mem.get("overhead_comm_buffers", 0.0)
    params = pb * (2 * el.unit + el.edge)
    grad_b = pb * el.unit + (pb + sums) * u + (pb + sums) * el.edge
    on_device = state if optimizer == "none" else 0.0
    parts = dict(mem, params=params, grads=grad_b, optimizer=on_device)
    backward = params + grad_b + on_device + mem["activations"] + mem["logits"] + mem["overheads"]
    temps = 4 * optimizers.get(layout.optimizer).update_temps * u
    if nv is not None:  # chunks of state beside their params' and gradients' slices, in and out
        window = 2 * tiers.SLOTS_IN_FLIGHT * nv.chunk * (per_elem + pb + g)
    else:
        window = 2 * u * (pb + g + (per_elem if optimizer == "host" else 0.0))
    update = fixed + (pb + g) * el.edge + on_device + window + temps
    parts["total"] = max(backward, update)
    return parts, backward, update


def _off_device(
    cluster: Cluster, m: int, optimizer: str, grads: str, el: Elements, pb: int, per_elem: float,
    nv: tiers.TierCost | None,
) -> dict[str, float]:  # fmt: skip
    """`param_tier`'s figures off the device (the comment above it), as ParamTierCost's fields: host
    memory, NVMe bytes (of them the gradient's), the host-link bytes per step each way with `m`
    micro-batches, and their seconds: the link's, the drives', and the two exposed."""
    g = GRAD_BYTES
    g_nvme = g * el.layers if grads == "nvme" else 0.0  # the layers' float32 gradient in the file
    host = pb * el.shard + (g * el.layers - g_nvme) + (per_elem * el.shard if optimizer == "host" else 0.0)
    h2d, d2h = link_bytes(el.layers, pb, m, per_elem if optimizer == "host" else 0.0, grads)
    edge = (pb + (per_elem if optimizer == "host" else 0.0)) * el.edges  # non-layer: in once, updated, out
    h2d, d2h = h2d + edge, d2h + edge
    disk, nvme = 0.0, 0.0
    if nv is not None:
        host += nv.host
        h2d, d2h, nvme = h2d + nv.nvme_read, d2h + nv.nvme_write, nv.nvme + g_nvme
        disk = tiers.drive_seconds(cluster, nvme)  # the state and the gradient: each read and written once
    bw = tiers.host_bw(cluster)
    link = (h2d + d2h) / bw
    state_link = (nv.nvme_read + nv.nvme_write + 2 * g_nvme) / bw if nv is not None else 0.0
    exposed = link + max(0.0, disk - state_link)
    return dict(host=host, nvme=nvme, grad_nvme=g_nvme, h2d=h2d, d2h=d2h, link_s=link, disk_s=disk, exposed_s=exposed)


def dp_seconds(t_dp: float, m: int, t_gather: float | None = None) -> float:
    """ZeRO-3 sync per step with layers fetched: per micro-batch a gather in the forward, one in the
    backward and a reduce-scatter, from the in-memory step's one gather + one reduce-scatter `t_dp`
    and its gather's part `t_gather` (None: half; the reduce-scatter carries the gradients in
    `train.grad_reduce_dtype`, the gathers the params; the non-layer params, gathered once a step,
    are counted as layers: an upper bound)."""
    return m * (t_dp + (t_dp / 2 if t_gather is None else t_gather))


def misfits(pt: ParamTierCost, cluster: Cluster, layout: Layout) -> list[str]:
    """Why the combination does not fit on `cluster` (empty: it fits): device, host memory per node,
    and the nvme tier's own rules (`tiers.misfits`)."""
    t = tiers.TierCost(pt.optimizer, pt.backward, pt.update, pt.host, pt.nvme, pt.h2d + pt.d2h, 0, 0, 0, 0,
                   pt.state.chunk if pt.state else 0, pt.state.n_chunks if pt.state else 0)  # fmt: skip
    return tiers.misfits(t, cluster, layout if pt.optimizer == "nvme" else None)
