"""GPU catalogue and cluster strings (`GPU:NODESxGPUS_PER_NODE[,ib=NICSxGBPS][,racks=NODESxGBPS]
[,host=SIZE][,nvme=DRIVESxSIZE][,nvme_bw=READ/WRITE]`, e.g. `a100-80g:48x8,ib=4x200` or
`h100-80g:2x8,host=1TB,nvme=4x7.68TB`).

More `,key=value` fields of the cluster string are one parser each in CLUSTER_FIELDS.

All figures are datasheet numbers in SI units (bytes, bytes/s, FLOP/s). Memory sizes are taken as
decimal GB (80 GB -> 80e9 bytes), conservative where the HBM is binary, except the H100 80GB: the
memory a process can allocate on it (`H100_MEMORY_BYTES`) is what its published runs fill, and the
decimal figure would reject layouts that ran. Bandwidths are per direction where noted: NVIDIA
quotes NVLink as the bidirectional total.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from meshrun.errors import ConfigError

# NCCL's achievable fraction of link bandwidth and per-message latency: `constants.py`
from meshrun.planner.constants import COMM_EFFICIENCY as COMM_EFFICIENCY
from meshrun.planner.constants import COMM_LATENCY_S as COMM_LATENCY_S
from meshrun.planner.constants import OVERLAP_COST, Calibration, calibration_for

GB = 1e9
TB = 1e12
MIB = 2**20
# H100 SXM5 80GB (HBM3): total memory nvidia-smi and cudaMemGetInfo report, 81559 MiB (80 GiB of HBM3
# less the driver's reservation) = 85.5e9 bytes. NVIDIA's published Nemotron-4 340B run (TP8 PP8 VP12,
# DP2, tests/data/published_runs.yaml) needs more than 80e9 bytes by Megatron's documented accounting.
H100_MEMORY_BYTES = 81559 * MIB


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float  # dense bf16 tensor-core FLOP/s
    memory_bytes: float  # HBM capacity
    hbm_bw: float  # HBM bandwidth, bytes/s
    nvlink_bw: float  # NVLink per GPU, bidirectional total, bytes/s (0: GPUs of a node talk over PCIe)
    nic_bw: float  # default inter-node network per GPU (one NIC per GPU), one direction, bytes/s
    sms: int = 108  # streaming multiprocessors (GEMM wave quantisation)
    pcie_bw: float = 32 * GB  # host link, one direction: PCIe Gen4 x16 32 GB/s, Gen5 64 GB/s
    fp8_flops: float = 0.0  # dense fp8 tensor-core FLOP/s (0: no fp8 GEMMs)
    tiles: bool = True  # GEMMs run in waves of tiles over the SMs (False: a CPU, no wave quantisation)
    # The devices share one host's cores (simulated CPU devices): a pipeline stage's idle ticks run the
    # other stages' work, so the bubble costs no time while the devices keep the cores busy.
    shared_cores: bool = False
    calibration: Calibration | None = None  # a cluster profile's fitted fractions (None: `calibration_for`)

    @property
    def nvlink_uni_bw(self) -> float:
        """One direction of NVLink: what a ring collective step can use."""
        return self.nvlink_bw / 2

    @property
    def intra_node_bw(self) -> float:
        """One direction, per GPU, between GPUs of a node: NVLink, else PCIe."""
        return self.nvlink_uni_bw if self.nvlink_bw else self.pcie_bw


GPUS: dict[str, GPU] = {
    # NVIDIA Tesla V100 datasheet (SXM2 32GB): no bf16 and no fp8: peak_flops is the fp16 tensor-core peak,
    # 125 TFLOP/s (what a bf16 model costs as if run in fp16); 32 GB HBM2 900 GB/s; NVLink 2 300 GB/s
    # (DGX-1V's hybrid cube mesh: modelled as NVLink between every GPU of a node); 80 SMs, PCIe Gen3
    # x16 16 GB/s each way. DGX-1V datasheet: 4x EDR InfiniBand 100 Gb/s for 8 GPUs = 6.25 GB/s per GPU.
    "v100-32g": GPU("v100-32g", 125e12, 32 * GB, 900 * GB, 300 * GB, 100e9 / 8 / 2, 80, 16 * GB),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4): 312 TFLOP/s bf16 dense; 40 GB HBM2 1,555 GB/s;
    # 80 GB HBM2e 2,039 GB/s; NVLink 3 600 GB/s. DGX A100: 8x ConnectX-6 HDR 200 Gb/s = 25 GB/s per GPU.
    # 108 SMs, PCIe Gen4. The PCIe card (300 W, 1,935 GB/s) has NVLink bridges between pairs only:
    # modelled as PCIe between all GPUs of a node.
    "a100-40g": GPU("a100-40g", 312e12, 40 * GB, 1555 * GB, 600 * GB, 200e9 / 8),
    "a100-80g": GPU("a100-80g", 312e12, 80 * GB, 2039 * GB, 600 * GB, 200e9 / 8),
    "a100-80g-pcie": GPU("a100-80g-pcie", 312e12, 80 * GB, 1935 * GB, 0.0, 200e9 / 8),
    # NVIDIA H100 datasheet (SXM5): 989 TFLOP/s bf16 dense (1,979 with sparsity); 80 GB HBM3 3.35 TB/s;
    # NVLink 4 900 GB/s. DGX H100: 8x ConnectX-7 NDR 400 Gb/s = 50 GB/s per GPU.
    # 132 SMs, PCIe Gen5.
    # fp8: 1,979 TFLOP/s dense (3,958 with sparsity), the same on H200 and GH200.
    "h100-80g": GPU("h100-80g", 989e12, H100_MEMORY_BYTES, 3350 * GB, 900 * GB, 400e9 / 8, 132, 64 * GB, 1979e12),
    # H800 SXM5 (the H100 for the Chinese market, NVIDIA's H800 product brief): H100 compute and memory,
    # NVLink cut to 400 GB/s; 8x 400 Gb/s InfiniBand per node as DeepSeek-V3's cluster (its report, 3.1).
    "h800": GPU("h800", 989e12, H100_MEMORY_BYTES, 3350 * GB, 400 * GB, 400e9 / 8, 132, 64 * GB, 1979e12),
    # NVIDIA H200 datasheet (SXM): H100 compute (989 TFLOP/s bf16 dense); 141 GB HBM3e 4.8 TB/s;
    # NVLink 900 GB/s. DGX/HGX H200: 8x NDR 400 Gb/s = 50 GB/s per GPU.
    "h200": GPU("h200", 989e12, 141 * GB, 4800 * GB, 900 * GB, 400e9 / 8, 132, 64 * GB, 1979e12),
    # NVIDIA GH200 Grace Hopper datasheet: H100 compute, 96 GB HBM3 4 TB/s, NVLink 900 GB/s; the host
    # link is NVLink-C2C, 900 GB/s total = 450 GB/s each way (what host offload runs over).
    "gh200": GPU("gh200", 989e12, 96 * GB, 4000 * GB, 900 * GB, 400e9 / 8, 132, 450 * GB, 1979e12),
    # The same datasheet's HBM3e version: 144 GB at 4.9 TB/s, the rest as the 96 GB one.
    "gh200-144g": GPU("gh200-144g", 989e12, 144 * GB, 4900 * GB, 900 * GB, 400e9 / 8, 132, 450 * GB, 1979e12),
    # NVIDIA DGX B200 / HGX B200 datasheets: 8 GPUs 36 PFLOP/s bf16 and 72 PFLOP/s fp8 with sparsity ->
    # 2.25 PFLOP/s bf16 and 4.5 PFLOP/s fp8 dense per GPU; 1,440 GB HBM3e = 180 GB per GPU, 8 TB/s;
    # NVLink 5 1.8 TB/s; 8x ConnectX-7 400 Gb/s = 50 GB/s per GPU; PCIe Gen5 host link. 148 SMs.
    "b200": GPU("b200", 2250e12, 180 * GB, 8000 * GB, 1800 * GB, 400e9 / 8, 148, 64 * GB, 4500e12),
    # One simulated XLA:CPU device of a host (`--devices N`: N devices share the host's cores): nominal
    # figures, no datasheet. The devices share one process, so "NVLink" is a memory copy between them.
    # Fit them to the host with `meshrun plan --calibrate RUN_DIR ...` (a cluster profile); uncalibrated
    # step times are orders of magnitude only.
    "cpu": GPU("cpu", 20e9, 16 * GB, 10 * GB, 20 * GB, 10 * GB, 1, 10 * GB, tiles=False, shared_cores=True),
}


@dataclass(frozen=True)
class NodeStorage:
    """Host memory and local NVMe drives of a reference node of `gpus` GPUs; a cluster with another
    number of GPUs per node gets them in proportion (the DGX's per-GPU share)."""

    gpus: int
    host_bytes: float  # host (CPU) memory of the node
    nvme_drives: int  # local data drives (the OS drives not counted)
    nvme_drive_bytes: float
    nvme_read_bw: float  # sequential, per drive, bytes/s
    nvme_write_bw: float
    host_mem_bw: float = 0.0  # host memory's peak bandwidth, bytes/s (sockets x channels x MT/s x 8 B)


# Local data drives of the DGX systems: 3.84 TB U.2 NVMe, PCIe Gen4 (Samsung PM1733 class: sequential
# read 6.4 GB/s, write 3.8 GB/s per drive, its datasheet).
U2_READ, U2_WRITE = 6.4 * GB, 3.8 * GB
# Host memory's peak bandwidth: DGX A100: 2 AMD EPYC 7742, 8 channels of DDR4-3200 each (2 x 8 x 3.2 GT/s
# x 8 B = 409.6 GB/s); DGX H100 / H200: 2 Intel Xeon Platinum 8480C, 8 channels of DDR5-4800 each
# (614.4 GB/s); GH200: LPDDR5X, up to 512 GB/s per superchip (its datasheet).
EPYC_7742_X2, XEON_8480_X2 = 2 * 8 * 3.2 * 8 * GB, 2 * 8 * 4.8 * 8 * GB
NODES: dict[str, NodeStorage] = {
    # DGX A100 datasheet: the 320 GB system 1 TB memory and 4 x 3.84 TB NVMe (15 TB); the 640 GB
    # system 2 TB and 8 x 3.84 TB (30 TB).
    "a100-40g": NodeStorage(8, 1 * TB, 4, 3.84 * TB, U2_READ, U2_WRITE, EPYC_7742_X2),
    "a100-80g": NodeStorage(8, 2 * TB, 8, 3.84 * TB, U2_READ, U2_WRITE, EPYC_7742_X2),
    # No reference system for 8 PCIe cards: assumed as the DGX A100 640 GB.
    "a100-80g-pcie": NodeStorage(8, 2 * TB, 8, 3.84 * TB, U2_READ, U2_WRITE, EPYC_7742_X2),
    # DGX H100 and DGX H200 datasheets: 2 TB memory, 8 x 3.84 TB NVMe U.2 (30 TB).
    "h100-80g": NodeStorage(8, 2 * TB, 8, 3.84 * TB, U2_READ, U2_WRITE, XEON_8480_X2),
    "h200": NodeStorage(8, 2 * TB, 8, 3.84 * TB, U2_READ, U2_WRITE, XEON_8480_X2),
    "h800": NodeStorage(8, 2 * TB, 8, 3.84 * TB, U2_READ, U2_WRITE, XEON_8480_X2),  # assumed as the DGX H100
    # GH200 datasheet: 480 GB LPDDR5X per superchip. Drives vary by vendor: assumed one 3.84 TB drive
    # of the same class per superchip.
    "gh200": NodeStorage(1, 480 * GB, 1, 3.84 * TB, U2_READ, U2_WRITE, 512 * GB),
    "gh200-144g": NodeStorage(1, 480 * GB, 1, 3.84 * TB, U2_READ, U2_WRITE, 512 * GB),
    # DGX-1 datasheet: 512 GB DDR4 (2 Xeon E5-2698 v4, 4 channels of DDR4-2400 each: 153.6 GB/s), 4 x
    # 1.92 TB SSD (SATA: ~0.5 GB/s read and write each).
    "v100-32g": NodeStorage(8, 512 * GB, 4, 1.92 * TB, 0.5 * GB, 0.5 * GB, 2 * 4 * 2.4 * 8 * GB),
    # DGX B200 datasheet: 2 TB memory (2 Xeon Platinum 8570, 8 channels of DDR5-5600 each: 716.8 GB/s),
    # 8 x 3.84 TB NVMe U.2.
    "b200": NodeStorage(8, 2 * TB, 8, 3.84 * TB, U2_READ, U2_WRITE, 2 * 8 * 5.6 * 8 * GB),
    # A simulated-CPU cluster: nominal (the host's memory and disk are not modelled from a datasheet).
    "cpu": NodeStorage(8, 64 * GB, 1, 1 * TB, 2 * GB, 1 * GB, 20 * GB),
}


# jax `device_kind` substring -> dense bf16 peak FLOP/s; the first match wins (specific names first).
# The H100 PCIe is not in GPUS: its NVLink bridges join pairs of GPUs only, which the node model of
# `Cluster` (NVLink between every GPU of a node) would misrepresent to the planner.
DEVICE_KIND_PEAKS: tuple[tuple[str, float], ...] = (
    ("B200", GPUS["b200"].peak_flops),
    ("H200", GPUS["h200"].peak_flops),
    # NVIDIA H100 Tensor Core GPU datasheet: PCIe 1,513 TFLOP/s bf16 with sparsity -> 756 dense.
    ("H100 PCIe", 756e12),
    ("H800", GPUS["h800"].peak_flops),
    ("H100", GPUS["h100-80g"].peak_flops),
    ("A100", GPUS["a100-80g"].peak_flops),  # 40 GB and 80 GB, SXM and PCIe: 312 TFLOP/s
    ("V100", GPUS["v100-32g"].peak_flops),  # the fp16 tensor-core peak (V100 has no bf16)
)


def peak_flops_of_kind(device_kind: str) -> float | None:
    """Dense bf16 peak of a jax device kind (e.g. 'NVIDIA H100 80GB HBM3'); None when unknown (CPU)."""
    for key, flops in DEVICE_KIND_PEAKS:
        if key.lower() in device_kind.lower():
            return flops
    return None


# jax `device_kind` substring -> the GPUS entry that models it; the first match wins (specific names
# first: 'GH200' contains 'H200'). Kinds with no entry (H100 PCIe, CPUs) model as unknown.
DEVICE_KIND_GPUS: tuple[tuple[str, str | None], ...] = (
    ("GH200 144G", "gh200-144g"),
    ("GH200", "gh200"),
    ("B200", "b200"),
    ("H200", "h200"),
    ("H100 PCIe", None),
    ("H800", "h800"),
    ("H100", "h100-80g"),
    ("A100-SXM4-40GB", "a100-40g"),
    ("A100 80GB PCIe", "a100-80g-pcie"),
    ("A100", "a100-80g"),
    ("V100-SXM2-32GB", "v100-32g"),
)


def gpu_of_kind(device_kind: str) -> str | None:
    """The GPUS name of a jax device kind (e.g. 'NVIDIA H100 80GB HBM3' -> 'h100-80g'); None: unknown."""
    for key, name in DEVICE_KIND_GPUS:
        if key.lower() in device_kind.lower():
            return name
    return None


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    nodes: int
    gpus_per_node: int
    nics: int = 0  # NICs per node (0: the catalogue's default, one per GPU at gpu.nic_bw)
    nic_gbps: float = 0.0  # Gb/s of each NIC
    nodes_per_rack: int = 0  # 0: every node in one rack (one non-blocking fabric)
    rack_gbps: float = 0.0  # Gb/s of each node's share of the rack's uplinks (0: its NICs, non-blocking)
    host_bytes: float = 0.0  # host memory per node (0: the catalogue's NODES default)
    nvme_drives: int = -1  # local NVMe data drives per node (-1: the default; 0: none)
    nvme_drive_bytes: float = 0.0  # capacity of each (0: the default)
    nvme_read_gbs: float = 0.0  # sequential GB/s of each drive (0: the default)
    nvme_write_gbs: float = 0.0
    latency_s: float = COMM_LATENCY_S  # fixed cost of each collective / p2p message (a cluster profile's fit)
    overlap_cost: float | None = None  # share of overlapped communication still charged (None: `overlap_for`)

    def overlap_for(self, framework: str) -> float:
        """The share of hidden communication still charged to the step under `framework`: the cluster's
        own where set (a cluster profile's fit); else under Megatron's semantics the GPU calibration's
        `overlap` (the H100's fitted on the published runs), under meshrun's OVERLAP_COST (assumed: no GPU
        run of meshrun has measured it)."""
        if self.overlap_cost is not None:
            return self.overlap_cost
        if framework == "megatron":
            return (self.gpu.calibration or calibration_for(self.gpu.name)).overlap
        return OVERLAP_COST

    @property
    def n_devices(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable_memory(self) -> float:
        """HBM a plan may fill: all of it, since the runtime's own memory is costed explicitly
        (`cost.overhead_bytes`: CUDA context, communicator buffers, allocator fragmentation)."""
        return self.gpu.memory_bytes

    @property
    def storage(self) -> NodeStorage:
        """The node's host memory and NVMe: the catalogue's reference node scaled to this node's GPUs,
        with the cluster string's overrides."""
        ref = NODES[self.gpu.name]
        k = self.gpus_per_node / ref.gpus
        drives = self.nvme_drives if self.nvme_drives >= 0 else max(1, round(ref.nvme_drives * k))
        return NodeStorage(
            self.gpus_per_node,
            self.host_bytes or ref.host_bytes * k,
            drives,
            self.nvme_drive_bytes or ref.nvme_drive_bytes,
            self.nvme_read_gbs * GB or ref.nvme_read_bw,
            self.nvme_write_gbs * GB or ref.nvme_write_bw,
            ref.host_mem_bw * k,
        )

    @property
    def nic_bw_per_gpu(self) -> float:
        """One direction, per GPU, when every GPU of a node sends off the node at once (rings of all
        the node's GPUs run together, e.g. the DP rings of the TP ranks): the node's NICs shared out."""
        if not self.nics:
            return self.gpu.nic_bw
        return self.nics * self.nic_gbps * 1e9 / 8 / self.gpus_per_node

    @property
    def racks(self) -> int:
        return self.nodes // self.nodes_per_rack if self.nodes_per_rack else 1

    @property
    def rack_bw_per_gpu(self) -> float:
        """One direction, per GPU, between racks when every GPU of a node sends at once: the node's
        share of the uplinks (oversubscribed fabrics give less than the NICs), at most its NICs."""
        if not self.rack_gbps:
            return self.nic_bw_per_gpu
        return min(self.nic_bw_per_gpu, self.rack_gbps * 1e9 / 8 / self.gpus_per_node)

    def group_bw(self, span: int) -> float:
        """Achievable per-GPU bandwidth (one direction) of a collective over `span` neighbouring devices:
        NVLink (or PCIe) inside one node, the node's NICs once the group leaves the node, the rack's
        uplinks once it leaves the rack."""
        link = self.gpu.intra_node_bw if span <= self.gpus_per_node else self.nic_bw_per_gpu
        if self.nodes_per_rack and span > self.gpus_per_node * self.nodes_per_rack:
            link = self.rack_bw_per_gpu
        return link * COMM_EFFICIENCY

    def split_group(self, size: int, stride: int) -> tuple[int, int]:
        """(ranks per node, nodes) of a group of `size` ranks that are `stride` devices apart."""
        if stride >= self.gpus_per_node:
            return 1, size
        inner = max(1, min(size, self.gpus_per_node // stride))
        return inner, math.ceil(size / inner)

    def levels(self, size: int, stride: int = 1) -> list[tuple[int, float]]:
        """A group of `size` ranks `stride` devices apart, level by level, inner to outer: (ranks per
        node, NVLink), (the group's nodes in one rack, NICs), (racks, uplinks); each level's size and
        achievable per-GPU bandwidth. Without racks the last level is 1."""
        inner, outer = self.split_group(size, stride)
        node_step = max(1, stride * inner // self.gpus_per_node)  # nodes between the group's nodes
        in_rack = min(outer, max(1, self.nodes_per_rack // node_step)) if self.nodes_per_rack else outer
        eff = COMM_EFFICIENCY
        return [
            (inner, self.gpu.intra_node_bw * eff),
            (in_rack, self.nic_bw_per_gpu * eff),
            (math.ceil(outer / in_rack), self.rack_bw_per_gpu * eff),
        ]

    def allreduce_seconds(self, nbytes: float, size: int, stride: int = 1, *, half: bool = False) -> float:
        """Hierarchical ring all-reduce of `nbytes` over `size` ranks `stride` apart: reduce-scatter
        among the ranks of a node, then of each 1/inner shard across the group's nodes of a rack,
        all-reduce of each 1/(inner in_rack) shard across racks, and all-gather back (NCCL's
        tree/ring hierarchy, Megatron/Horovod hierarchical all-reduce): node, rack, cluster. `half`: a
        reduce-scatter or all-gather alone (each ring phase once)."""
        if size <= 1:
            return 0.0
        t, share = 0.0, nbytes
        for n, bw in self.levels(size, stride):
            t += (n - 1) / n * share / bw  # one ring phase over this level, on what the inner levels left
            share /= n
        return self.latency_s + (1 if half else 2) * t

    def __str__(self) -> str:
        net = f",ib={self.nics}x{self.nic_gbps:g}" if self.nics else ""
        if self.nodes_per_rack:
            net += f",racks={self.nodes_per_rack}" + (f"x{self.rack_gbps:g}" if self.rack_gbps else "")
        if self.host_bytes:
            net += f",host={_size(self.host_bytes)}"
        if self.nvme_drives >= 0 or self.nvme_drive_bytes:
            st = self.storage
            net += f",nvme={st.nvme_drives}x{_size(st.nvme_drive_bytes)}" if st.nvme_drives else ",nvme=0"
        if self.nvme_read_gbs or self.nvme_write_gbs:
            st = self.storage
            net += f",nvme_bw={st.nvme_read_bw / GB:g}/{st.nvme_write_bw / GB:g}"
        return f"{self.gpu.name}:{self.nodes}x{self.gpus_per_node}{net}"


_CLUSTER_RE = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*:\s*(\d+)\s*[xX]\s*(\d+)\s*$")
_NET_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+(?:\.\d+)?)\s*$")
CLUSTER_HELP = (
    "GPU:NODESxGPUS_PER_NODE[,ib=NICSxGBPS][,racks=NODES_PER_RACK[xGBPS]][,host=SIZE][,nvme=DRIVESxSIZE]"
    "[,nvme_bw=READ/WRITE], e.g. a100-80g:48x8,ib=4x200 (4 NICs of 200 Gb/s per node), h100-80g:64x8,racks=16x1600 "
    "(16 nodes a rack, 1600 Gb/s per node between racks) or h100-80g:2x8,host=1TB,nvme=4x7.68TB,nvme_bw=6.4/3.8 "
    "(per node: 1 TB host memory, 4 NVMe drives of 7.68 TB reading 6.4 and writing 3.8 GB/s each)"
)


def _parse_ib(field: str, text: str, raw: str) -> dict:
    """`ib=4x200`: NICs per node x Gb/s each."""
    m = _NET_RE.match(raw)
    if not m or int(m.group(1)) < 1 or float(m.group(2)) <= 0:
        raise ConfigError(field, text, "write ib=NICSxGBPS per node, e.g. ib=4x200", "malformed network")
    return {"nics": int(m.group(1)), "nic_gbps": float(m.group(2))}


_RACKS_RE = re.compile(r"^\s*(\d+)\s*(?:[xX]\s*(\d+(?:\.\d+)?))?\s*$")


def _parse_racks(field: str, text: str, raw: str) -> dict:
    """`racks=16x1600`: nodes per rack x Gb/s each node gets between racks (`racks=16`: non-blocking)."""
    m = _RACKS_RE.match(raw)
    if not m or int(m.group(1)) < 1 or (m.group(2) is not None and float(m.group(2)) <= 0):
        raise ConfigError(
            field, text, "write racks=NODES_PER_RACK or racks=NODES_PER_RACKxGBPS per node", "malformed racks"
        )
    return {"nodes_per_rack": int(m.group(1)), "rack_gbps": float(m.group(2) or 0)}


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(GB|TB)\s*$", re.IGNORECASE)


def _size(nbytes: float) -> str:
    return f"{nbytes / TB:g}TB" if nbytes >= TB else f"{nbytes / GB:g}GB"


def _bytes(raw: str) -> float | None:
    """`2TB` / `512GB` -> bytes (decimal units); None when malformed or not positive."""
    m = _SIZE_RE.match(raw)
    if not m or not 0 < float(m.group(1)) < 1e6:
        return None
    return float(m.group(1)) * (TB if m.group(2).upper() == "TB" else GB)


def _parse_host(field: str, text: str, raw: str) -> dict:
    """`host=2TB`: host memory per node."""
    size = _bytes(raw)
    if size is None:
        raise ConfigError(field, text, "write host=SIZE per node with GB or TB, e.g. host=2TB", "malformed host memory")
    return {"host_bytes": size}


_NVME_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(.+)$")


def _parse_nvme(field: str, text: str, raw: str) -> dict:
    """`nvme=8x3.84TB`: local NVMe drives per node x the capacity of each; `nvme=0`: none."""
    if raw.strip() == "0":
        return {"nvme_drives": 0}
    m = _NVME_RE.match(raw)
    size = _bytes(m.group(2)) if m else None
    if not m or size is None or not 1 <= int(m.group(1)) <= 1024:
        fix = "write nvme=DRIVESxSIZE per node, e.g. nvme=8x3.84TB (or nvme=0: no local NVMe)"
        raise ConfigError(field, text, fix, "malformed nvme")
    return {"nvme_drives": int(m.group(1)), "nvme_drive_bytes": size}


_BW_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)\s*$")


def _parse_nvme_bw(field: str, text: str, raw: str) -> dict:
    """`nvme_bw=6.4/3.8`: sequential read / write GB/s of each NVMe drive."""
    m = _BW_RE.match(raw)
    if not m or not all(0 < float(g) < 1e4 for g in m.groups()):
        raise ConfigError(
            field, text, "write nvme_bw=READ/WRITE in GB/s per drive, e.g. nvme_bw=6.4/3.8", "malformed nvme_bw"
        )
    return {"nvme_read_gbs": float(m.group(1)), "nvme_write_gbs": float(m.group(2))}


# Optional `,key=value` fields of a cluster string: key -> parser(field, whole text, value) -> Cluster kwargs.
CLUSTER_FIELDS = {"ib": _parse_ib, "racks": _parse_racks, "host": _parse_host, "nvme": _parse_nvme,
                  "nvme_bw": _parse_nvme_bw}  # fmt: skip


def parse_cluster(text: str, field: str = "--cluster") -> Cluster:
    """`a100-80g:128x8` -> Cluster(A100 80GB, 128 nodes, 8 GPUs per node); `,ib=4x200` sets the network."""
    known = ", ".join(GPUS)
    head, *extras = str(text).split(",")
    m = _CLUSTER_RE.match(head)
    if not m:
        raise ConfigError(field, text, f"write {CLUSTER_HELP} (GPUs: {known})", "malformed cluster")
    name, nodes, per_node = m.group(1).lower(), int(m.group(2)), int(m.group(3))
    if name not in GPUS:
        raise ConfigError(field, text, f"use one of the known GPUs: {known}", f"unknown GPU '{name}'")
    if nodes < 1 or per_node < 1:
        raise ConfigError(field, text, "use at least 1 node and 1 GPU per node", "empty cluster")
    kw: dict = {}
    for item in extras:
        key, sep, raw = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in CLUSTER_FIELDS:
            raise ConfigError(
                field, text, f"use ,key=value with key one of {list(CLUSTER_FIELDS)}", f"unknown field '{item}'"
            )
        kw |= CLUSTER_FIELDS[key](field, text, raw)
    if nodes % kw.get("nodes_per_rack", 1):
        raise ConfigError(
            field, text, f"give racks=NODES_PER_RACK as a divisor of the {nodes} nodes", "racks do not divide nodes"
        )
    return Cluster(GPUS[name], nodes, per_node, **kw)
