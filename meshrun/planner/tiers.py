"""Where the optimizer state rests (`offload.optimizer = none | host | nvme`): the planner's
three-tier memory model, per layout and per device. For each tier (`optimizer_tier`): the bytes on
the device (its peak), in host memory and on NVMe, the bytes each step moves over the host link and
to and from the drives, and the time of that I/O; `misfits` says why a tier does not fit a cluster
and `update_place` where a streamed update runs. Plain Python: `meshrun plan` uses it without jax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from meshrun.config import ModelConfig, streamed_update_refusal, streams_host_update
from meshrun.optim import registry as optimizers
from meshrun.planner.hardware import COMM_EFFICIENCY, GB, Cluster
from meshrun.planner.layout import DTYPE_BYTES, Layout

TIERS = ("none", "host", "nvme")
# Host memory a plan may fill: the rest is the OS, the data loader, the page cache and the process.
HOST_USABLE = 0.9
# Fraction of the drives' sequential bandwidth the tier reaches. It is the tier's target (70% of the
# disk's limit). bench/offload.py measured 34% on a loaded CPU host with small chunks (docs/offload.md).
NVME_EFFICIENCY = 0.7
DEFAULT_BUDGET_MB = 256.0  # offload.budget_mb's default
SLOTS_IN_FLIGHT = 3  # offload/chunk_store.py: read i + 1, update i, write i - 1
ALIGN = 1024  # offload/swap_file.py: chunk length granularity in elements
# Fraction of the host memory's peak bandwidth a CPU's streaming pass reaches: STREAM Triad on
# two-socket DDR4/DDR5 servers measures about 70-80% of the DDR peak (an assumption, not measured here).
HOST_MEM_EFFICIENCY = 0.7


def host_bw(cluster: Cluster) -> float:
    """Achievable host<->device bytes/s of one GPU (one direction)."""
    return cluster.gpu.pcie_bw * COMM_EFFICIENCY


def chunk_elems(budget_bytes: float, slots: int, rows: int, row_len: int) -> int:
    """Elements per row of one chunk, as `offload.swap_file.chunk_elems` (0: the budget holds no chunk)."""
    fit = int(budget_bytes // (SLOTS_IN_FLIGHT * slots * rows * 4)) // ALIGN * ALIGN
    return min(fit, -(-row_len // ALIGN) * ALIGN) if fit >= ALIGN else 0


@dataclass(frozen=True)
class TierCost:
    """The optimizer tier of one layout, per device: bytes in each tier, traffic and time per step."""

    tier: str
    backward: float  # device peak of the forward and backward
    update: float  # device peak of the update
    host: float  # host memory resting per GPU (nvme: its share of the process's chunk buffers)
    nvme: float  # bytes on NVMe per GPU (its share of the process's file)
    pcie: float  # bytes per step over the host link, both directions
    nvme_read: float  # bytes per step read from the drives
    nvme_write: float
    io_s: float  # the tier's I/O time per step
    exposed_s: float  # of it, not hidden behind the update
    chunk: int = 0  # nvme and the streamed host tier: elements per row of one chunk
    n_chunks: int = 0
    streamed: bool = False  # the update streams the state chunk by chunk (nvme; host unless whole)
    update_on: str = "device"  # streamed: where the chunk update runs, the faster of device | host
    device_s: float = 0.0  # streamed: the exposed seconds with the update on the device
    host_s: float = 0.0  # ... and on the host CPU
    cpu_s: float = 0.0  # the host CPU's Adam pass alone

    @property
    def device(self) -> float:
        return max(self.backward, self.update)


def drive_seconds(cluster: Cluster, file: float) -> float:
    """Seconds for a node's drives to read and then write back each of its GPUs' `file` bytes, at
    NVME_EFFICIENCY of their sequential bandwidth (reads and writes share the flash: added)."""
    st = cluster.storage
    if not st.nvme_drives:
        return math.inf
    eff = NVME_EFFICIENCY * st.nvme_drives
    return cluster.gpus_per_node * file * (1 / (eff * st.nvme_read_bw) + 1 / (eff * st.nvme_write_bw))


def streamable(layout: Layout) -> bool:
    """The NVMe tier streams elementwise optimizers with float32 state only (`offload/optimizer_tier.py`)."""
    return optimizers.get(layout.optimizer).elementwise and layout.state_dtype == "float32"


def host_streams(model: ModelConfig, layout: Layout) -> bool:
    """Whether the runtime streams the host tier's update: `config.streams_host_update`'s rule."""
    return streams_host_update(layout.offload_update, layout.offload_params, host_refusal(model, layout))


def host_refusal(model: ModelConfig, layout: Layout) -> str | None:
    """Why the host tier cannot stream this layout's optimizer (None: it can)."""
    opt = layout.optimizer
    return streamed_update_refusal(opt, optimizers.get(opt).elementwise, layout.state_dtype,
                                   model.fp8)  # fmt: skip


def host_adam_bytes(slots: int, param_bytes: int) -> int:
    """Host-memory bytes per element of the host CPU's Adam pass: the gradient read (float32), the state's
    slots read and written, the new params written, and without a float32 master the old params read."""
    master = slots == 3
    return 4 + 2 * 4 * slots + param_bytes * (1 if master else 2)


def cpu_update_seconds(cluster: Cluster, elems: float, slots: int, param_bytes: int) -> float:
    """Seconds of the host CPU's Adam pass over one GPU's `elems` elements: its bytes at HOST_MEM_EFFICIENCY
    of the node's host memory bandwidth, shared by the node's GPUs (each runs its own pass at once)."""
    bw = HOST_MEM_EFFICIENCY * cluster.storage.host_mem_bw / cluster.gpus_per_node
    return elems * host_adam_bytes(slots, param_bytes) / bw if bw else math.inf


def _placed(t: TierCost, cluster: Cluster, elems: float, slots: int, param_bytes: int, drives_s: float,
            t_update: float) -> TierCost:  # fmt: skip
    """Streamed tier `t` (the update on the device) with the update where it is faster: on the host CPU
    the link carries the gradient down and the new params up (and the old params down without a master),
    and the CPU's pass, not the device's update, overlaps the I/O."""
    link = elems * (4 + param_bytes * (1 if slots == 3 else 2))
    cpu = cpu_update_seconds(cluster, elems, slots, param_bytes)
    io = max(drives_s, link / host_bw(cluster))
    host_s = max(0.0, max(io, cpu) - t_update)
    if host_s < t.exposed_s:
        return replace(t, pcie=link, io_s=io, exposed_s=host_s, update_on="host", device_s=t.exposed_s,
                       host_s=host_s, cpu_s=cpu)  # fmt: skip
    return replace(t, device_s=t.exposed_s, host_s=host_s, cpu_s=cpu)


# What `optimizer_tier` models, per tier:
# * none: the state lives on the device (`predict_memory`).
# * host, streamed (`offload.update=auto`, the default, where the runtime streams: `host_streams`):
#   the state rests in host memory in the nvme tier's chunk layout (`offload/chunk_store.HostStore`) and the
#   update streams it through the device chunk by chunk as nvme's does, through the same buffers
#   (`offload.budget_mb` per process). The device's update peak is nvme's (flat rows + a few
#   chunks); host memory holds the chunked state and the buffers. Each step moves the state in and out
#   once over the host link (2 x its bytes), overlapped with the update as nvme's I/O is, so only
#   the time beyond the update is exposed.
# * host, whole (`offload.update=whole`, and what auto falls back to: optimizers whose update is
#   not elementwise (muon), bf16 moments, fp8, `offload.params`): the state rests in pinned host
#   memory. It is the optimizer's moments and fp32 master, plus the stored params when they are
#   float32 under a 16-bit compute dtype (`offload.registry.placement`). The step brings the whole shard to
#   the device for the update and puts it back. That is 2 x its bytes over the host link, exposed,
#   because the update waits for it. The device's peak is the larger of the backward (no state) and
#   the update (stored params, the update's gradients, the whole state and the update's temporaries).
# * nvme: the state rests in one file per process on the node's NVMe drives. The update streams it
#   in chunks through `offload.budget_mb` of host memory per process (`offload/optimizer_tier.py`,
#   one process per node). The device holds the flat float32 gradient row and the param row of its
#   shard plus a few chunks. Each step reads and writes the whole state once, from the drives and
#   over the host link. The reads, copies and writes of neighbouring chunks overlap the update, so
#   only the I/O time beyond the update's own time is exposed. A drive's reads and writes share its
#   flash, so the drives' time is the read time plus the write time (conservative).
#
# Where a streamed update runs (`offload.update_on`): on the device, the state crosses the host
# link both ways (above); on the host CPU (jax's CPU backend), only the gradient goes down and the new
# params up (6 bytes per element with bf16 params and a float32 master, 12 with float32 params), and
# the CPU's Adam pass reads and writes the state in host memory, at HOST_MEM_EFFICIENCY of the node's
# host memory bandwidth shared by its GPUs (`cpu_update_seconds`). Each layout gets the faster place;
# a tie keeps the device. Not modelled: the host-memory traffic of the link's DMA and of the store's
# copies, which both places pay.
#
# The chunk size follows the runtime's rule (`offload/swap_file.chunk_elems`, pinned by tests): three chunks
# of (state slots x the node's rows) float32 fit the budget, in multiples of 1024 elements.
def optimizer_tier(mem: dict, model: ModelConfig, layout: Layout, cluster: Cluster, tier: str, t_update: float,
                   budget_mb: float = DEFAULT_BUDGET_MB) -> TierCost:  # fmt: skip
    """The tier's figures for one stage's memory parts `mem` (`predict_memory`, meshrun's step);
    `t_update`: the update's seconds (the time model's `optimizer`)."""
    opt, fixed = mem["optimizer"], mem.get("overhead_context", 0.0) + mem.get("overhead_comm_buffers", 0.0)
    backward = mem["total"] - opt
    stored, grads = mem.get("stored", mem["params"]), mem.get("grads_update", mem["grads"])
    state = mem.get("opt_state", opt)
    if tier == "none":
        return TierCost(tier, mem["total"], 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    if tier == "host" and not host_streams(model, layout):
        rest = state + (stored if model.param_dtype != model.dtype else 0.0)
        pcie = 2 * rest
        t = pcie / host_bw(cluster)
        return TierCost(tier, backward, stored + grads + opt + fixed, rest, 0.0, pcie, 0.0, 0.0, t, t)
    if tier not in ("host", "nvme"):
        raise ValueError(f"unknown optimizer tier {tier!r}; one of {TIERS}")
    elems = mem.get("opt_elems", state / 12)
    slots = max(1, round(state / (4 * elems)))  # float32 state slots: master, m, v (m, v without a master)
    rows, gpn = cluster.gpus_per_node, cluster.gpus_per_node  # one process per node: a row per GPU
    budget = budget_mb * 2**20
    c = chunk_elems(budget, slots, rows, math.ceil(elems))
    n_chunks = -(-math.ceil(elems) // c) if c else 0
    file = n_chunks * c * slots * 4  # this GPU's rows of the process's file
    flat = (4 + DTYPE_BYTES[model.param_dtype]) * elems  # the flat gradient (float32) and param rows
    on_device = 2 * SLOTS_IN_FLIGHT * slots * 4 * c  # chunks copied in and their new state out
    pcie = 2 * file
    update = stored + grads + flat + on_device + fixed
    pb, padded = DTYPE_BYTES[model.param_dtype], n_chunks * c
    if tier == "host":  # the chunks rest in host memory (`HostStore`), beside the buffers
        io = pcie / host_bw(cluster)
        t = TierCost(tier, backward, update, file + budget / gpn, 0.0, pcie, 0.0, 0.0, io, max(0.0, io - t_update),
                 c, n_chunks, True)  # fmt: skip
        return _placed(t, cluster, padded, slots, pb, 0.0, t_update)
    drives = drive_seconds(cluster, file)
    io = max(drives, pcie / host_bw(cluster))
    t = TierCost(tier, backward, update, budget / gpn, file, pcie, file, file, io, max(0.0, io - t_update), c, n_chunks,
             True)  # fmt: skip
    return _placed(t, cluster, padded, slots, pb, drives, t_update)


def update_place(t: TierCost) -> str:
    """Where a streamed tier's update runs and why, in words (the planner's note)."""
    if t.update_on == "host":
        return (f"update on the host CPU (offload.update_on=host): +{t.host_s:.3g} s against "
                f"+{t.device_s:.3g} s on the device, its Adam pass {t.cpu_s:.3g} s")  # fmt: skip
    return (f"update on the device: +{t.device_s:.3g} s against +{t.host_s:.3g} s on the host CPU (its Adam pass "
            f"{t.cpu_s:.3g} s)")  # fmt: skip


def misfits(t: TierCost, cluster: Cluster, layout: Layout | None = None) -> list[str]:
    """Why the tier does not fit on `cluster` (empty: it fits): device, host memory or NVMe capacity
    (host and NVMe per node: the node's GPUs together)."""
    out, usable, gpn, st = [], cluster.usable_memory, cluster.gpus_per_node, cluster.storage
    if t.device > usable:
        what = "the update's peak" if t.update >= t.backward else "the backward's peak"
        out.append(f"{what} {t.device / GB:.1f} GB > {usable / GB:.1f} GB usable on the device")
    if t.host * gpn > HOST_USABLE * st.host_bytes:
        out.append(f"host memory {t.host * gpn / GB:.0f} GB per node > {HOST_USABLE * st.host_bytes / GB:.0f} GB "
                   f"usable of {st.host_bytes / GB:.0f} GB")  # fmt: skip
    if t.streamed and not t.chunk:
        out.append("the chunk budget holds no chunk")
    if t.tier == "nvme":
        disk = st.nvme_drives * st.nvme_drive_bytes
        if layout is not None and not streamable(layout):
            out.append(f"the NVMe tier streams elementwise optimizers with float32 state only "
                       f"({layout.optimizer}, {layout.state_dtype})")  # fmt: skip
        if t.nvme * gpn > disk:
            out.append(f"NVMe {t.nvme * gpn / GB:.0f} GB per node > {disk / GB:.0f} GB of local drives")
    return out
