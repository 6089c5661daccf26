"""GPU catalogue and cluster strings (`GPU:NODESxGPUS_PER_NODE[,racks=NODES_PER_RACK[,rack_gbps=G]]`,
e.g. `a100-80g:128x8` or `h100-80g:64x8,racks=16,rack_gbps=100`).

All figures are datasheet numbers in SI units (bytes, bytes/s, FLOP/s). Memory sizes are taken as
decimal GB (80 GB -> 80e9 bytes), which is slightly conservative for the A100/H100 (their HBM is
80 GiB). Bandwidths are per direction where noted: NVIDIA quotes NVLink as the bidirectional total.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from meshrun.errors import ConfigError

GB = 1e9

# Fraction of a link's bandwidth that NCCL collectives reach in practice (nccl-tests bus bandwidth on
# DGX A100/H100 is ~75-85% of the link rate for large messages).
COMM_EFFICIENCY = 0.8
# Fixed cost per collective / p2p message (launch + latency), seconds.
COMM_LATENCY_S = 10e-6
# Fraction of HBM a training process may plan to use: the rest is the CUDA context, NCCL buffers,
# cuBLAS/cuDNN workspaces and allocator fragmentation.
USABLE_MEMORY_FRACTION = 0.9


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float  # dense bf16 tensor-core FLOP/s
    memory_bytes: float  # HBM capacity
    hbm_bw: float  # HBM bandwidth, bytes/s
    nvlink_bw: float  # NVLink per GPU, bidirectional total, bytes/s
    nic_bw: float  # inter-node network per GPU (one NIC per GPU), one direction, bytes/s

    @property
    def nvlink_uni_bw(self) -> float:
        """One direction of NVLink: what a ring collective step can use."""
        return self.nvlink_bw / 2


GPUS: dict[str, GPU] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4): 312 TFLOP/s bf16 dense; 40 GB HBM2 1,555 GB/s;
    # 80 GB HBM2e 2,039 GB/s; NVLink 3 600 GB/s. DGX A100: 8x ConnectX-6 HDR 200 Gb/s = 25 GB/s per GPU.
    "a100-40g": GPU("a100-40g", 312e12, 40 * GB, 1555 * GB, 600 * GB, 200e9 / 8),
    "a100-80g": GPU("a100-80g", 312e12, 80 * GB, 2039 * GB, 600 * GB, 200e9 / 8),
    # NVIDIA H100 datasheet (SXM5): 989 TFLOP/s bf16 dense (1,979 with sparsity); 80 GB HBM3 3.35 TB/s;
    # NVLink 4 900 GB/s. DGX H100: 8x ConnectX-7 NDR 400 Gb/s = 50 GB/s per GPU.
    "h100-80g": GPU("h100-80g", 989e12, 80 * GB, 3350 * GB, 900 * GB, 400e9 / 8),
    # NVIDIA H200 datasheet (SXM): H100 compute (989 TFLOP/s bf16 dense); 141 GB HBM3e 4.8 TB/s;
    # NVLink 900 GB/s. DGX/HGX H200: 8x NDR 400 Gb/s = 50 GB/s per GPU.
    "h200": GPU("h200", 989e12, 141 * GB, 4800 * GB, 900 * GB, 400e9 / 8),
}


# jax `device_kind` substring -> dense bf16 peak FLOP/s; the first match wins (specific names first).
# The H100 PCIe is not in GPUS: its NVLink bridges join pairs of GPUs only, which the node model of
# `Cluster` (NVLink between every GPU of a node) would misrepresent to the planner.
DEVICE_KIND_PEAKS: tuple[tuple[str, float], ...] = (
    ("H200", GPUS["h200"].peak_flops),
    # NVIDIA H100 Tensor Core GPU datasheet: PCIe 1,513 TFLOP/s bf16 with sparsity -> 756 dense.
    ("H100 PCIe", 756e12),
    ("H100", GPUS["h100-80g"].peak_flops),
    ("A100", GPUS["a100-80g"].peak_flops),  # 40 GB and 80 GB, SXM and PCIe: 312 TFLOP/s
)


def peak_flops_of_kind(device_kind: str) -> float | None:
    """Dense bf16 peak of a jax device kind (e.g. 'NVIDIA H100 80GB HBM3'); None when unknown (CPU)."""
    for key, flops in DEVICE_KIND_PEAKS:
        if key.lower() in device_kind.lower():
            return flops
    return None


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    nodes: int
    gpus_per_node: int
    nodes_per_rack: int = 0  # 0: every node in one rack (a non-blocking fabric)
    rack_bw: float = 0.0  # per GPU between racks, one direction, bytes/s (0: the NIC rate)

    @property
    def racks(self) -> int:
        return self.nodes // self.nodes_per_rack if self.nodes_per_rack else 1

    @property
    def inter_rack_bw(self) -> float:
        """What one GPU gets across racks: the uplinks' share (oversubscription), at most its NIC."""
        return min(self.rack_bw, self.gpu.nic_bw) if self.rack_bw else self.gpu.nic_bw

    @property
    def n_devices(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable_memory(self) -> float:
        return self.gpu.memory_bytes * USABLE_MEMORY_FRACTION

    def group_bw(self, span: int) -> float:
        """Achievable per-GPU bandwidth (one direction) of a collective over `span` neighbouring devices:
        NVLink inside one node, the per-GPU NIC once the group leaves the node."""
        link = self.gpu.nvlink_uni_bw if span <= self.gpus_per_node else self.gpu.nic_bw
        if self.nodes_per_rack and span > self.gpus_per_node * self.nodes_per_rack:
            link = self.inter_rack_bw  # the group leaves the rack
        return link * COMM_EFFICIENCY

    def levels(self, ranks: int, stride: int) -> list[tuple[int, float]]:
        """A group of `ranks` devices `stride` apart in the node-major device order, split into
        (ranks per node, NVLink), (nodes per rack, NIC), (racks, inter-rack): each level's group size
        and achievable per-GPU bandwidth, inner to outer. Sizes multiply to `ranks`."""
        g, eff = self.gpus_per_node, COMM_EFFICIENCY
        k_node = min(ranks, max(1, g // stride)) if stride < g else 1
        left = ranks // k_node
        node_step = max(1, stride * k_node // g)  # nodes between the group's consecutive nodes
        per_rack = self.nodes_per_rack or self.nodes
        k_rack = min(left, max(1, per_rack // node_step))
        k_cluster = -(-left // k_rack)
        bws = (self.gpu.nvlink_uni_bw * eff, self.gpu.nic_bw * eff, self.inter_rack_bw * eff)
        return list(zip((k_node, k_rack, k_cluster), bws, strict=True))

    def __str__(self) -> str:
        racks = f",racks={self.nodes_per_rack}" if self.nodes_per_rack else ""
        if self.rack_bw:
            racks += f",rack_gbps={self.rack_bw * 8 / 1e9:g}"
        return f"{self.gpu.name}:{self.nodes}x{self.gpus_per_node}{racks}"


_CLUSTER_RE = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*:\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def parse_cluster(text: str, field: str = "--cluster") -> Cluster:
    """`a100-80g:128x8` -> Cluster(A100 80GB, 128 nodes, 8 GPUs per node); `,racks=16` puts 16
    nodes in a rack, `,rack_gbps=100` gives each GPU 100 Gb/s between racks (default: its NIC)."""
    known = ", ".join(GPUS)
    base, *extra = str(text).split(",")
    opts = _cluster_options(text, extra, field)
    m = _CLUSTER_RE.match(base)
    if not m:
        raise ConfigError(
            field, text, f"write GPU:NODESxGPUS_PER_NODE, e.g. a100-80g:128x8 (GPUs: {known})", "malformed cluster"
        )
    name, nodes, per_node = m.group(1).lower(), int(m.group(2)), int(m.group(3))
    if name not in GPUS:
        raise ConfigError(field, text, f"use one of the known GPUs: {known}", f"unknown GPU '{name}'")
    if nodes < 1 or per_node < 1:
        raise ConfigError(field, text, "use at least 1 node and 1 GPU per node", "empty cluster")
    per_rack = opts.get("racks", 0)
    if per_rack and nodes % per_rack:
        raise ConfigError(
            field, text, f"give racks=NODES_PER_RACK as a divisor of the {nodes} nodes", "racks do not divide nodes"
        )
    return Cluster(GPUS[name], nodes, per_node, int(per_rack), opts.get("rack_gbps", 0.0) * 1e9 / 8)


def _cluster_options(text: str, items: list[str], field: str) -> dict[str, float]:
    """`racks=16`, `rack_gbps=100` after the cluster's commas."""
    out: dict[str, float] = {}
    for item in items:
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in ("racks", "rack_gbps"):
            raise ConfigError(field, text, "options are racks=NODES_PER_RACK and rack_gbps=GBPS", f"unknown '{key}'")
        try:
            num = float(value)
        except ValueError:
            num = -1.0
        if num <= 0 or (key == "racks" and not num.is_integer()):
            raise ConfigError(field, text, f"give {key} a positive {'whole ' if key == 'racks' else ''}number")
        out[key] = num
    return out
