"""Every efficiency, overlap and overhead constant of the planner, in one place, each with where it
comes from: *sourced* (a datasheet, a paper, a library's documentation), *fitted* (least squares on
measured runs, reproducible by a function named beside it, and checked equal to that fit by a test),
or *assumed* (no measurement behind it yet; said so). The modules that use them import them from here.

Calibration sets (`CALIBRATIONS`, by the GPU catalogue's name):
* a100: Megatron-LM's PTD-P Table 1 (Narayanan et al. 2021: ten GPT runs, 1.7B to 1T, on DGX A100),
  `calibrate.fit_calibration()`, fields gemm and hbm.
* h100-80g: NVIDIA's DGX Cloud Benchmarking H100 runs (tests/data/published_runs.yaml, tag v24.11.1:
  GPT-3 175B, Llama 3.1 8B / 70B / 405B, Nemotron-4 340B, Grok-1 314B, bf16 and fp8), the rows not
  marked held_out, `calibrate.fit_published()`, fields gemm, fp8, flash and overlap (Megatron's overlap
  charge: 0, every larger charge fits worse); the held-out rows (the 405B proxies) are predicted, never
  fitted.
A GPU with no set of its own uses the A100's (`calibration_for`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# Assumed: overlapped communication is not free: NCCL kernels take SMs and HBM bandwidth from the GEMMs
# they run beside. This fraction of the hidden communication time is still charged to the step (TP
# rings, the gradient reduction beside the last ticks, ZeRO-2/3 per-micro-batch traffic, CP rings, the
# params' all-gathers beside the next forwards). The default of `Calibration.overlap`: the A100 set and
# every GPU without a fit of its own; the H100 set fits its own (`H100_CALIBRATION`).
OVERLAP_COST = 0.25

# ----------------------------------------------------------------------------- kernels


@dataclass(frozen=True)
class Calibration:
    """Fractions of peak the kernel model's roofline reaches (`kernels.py`)."""

    gemm: float  # fraction of an SM's bf16 peak a full tile wave reaches
    hbm: float  # fraction of HBM bandwidth memory-bound kernels reach
    fp8: float = 0.0  # fraction of the fp8 peak a full fp8 tile wave reaches (0: `gemm`)
    flash: float = 0.5  # fused (flash) attention's fraction of the bf16 peak, backward counted as 2.5 forwards
    overlap: float = OVERLAP_COST  # share of hidden communication still charged (`Cluster.overlap_cost`)

    @property
    def fp8_gemm(self) -> float:
        return self.fp8 or self.gemm


# Sourced: FlashAttention-2 (Dao 2023, Fig. 5-7): forward + backward, head dim 128, seq 2k on A100 reach
# ~50-55% of peak counting the backward as 2.5 forwards. The default of `Calibration.flash`.
FLASH_EFFICIENCY = 0.5
# Sourced: FlashAttention-2 on an H100 reaches ~35% of its bf16 peak (Shah et al. 2024, FlashAttention-3,
# abstract: "FlashAttention-2 achieving only 35% utilization on the H100 GPU"). The published H100 runs
# whose launch scripts set NVTE_FUSED_ATTN=0 (Transformer Engine's FlashAttention-2 backend) run at it;
# the fitted `flash` is cuDNN's fused attention (NVTE_FUSED_ATTN=1).
FLASH2_H100_EFFICIENCY = 0.35
# `--attention-kernel flash2` (and a published row's `attention: flash2`): FlashAttention-2's sourced
# efficiency by GPU: the A100s at the FlashAttention-2 paper's (FLASH_EFFICIENCY), the Hopper GPUs (the
# same SMs as the H100) at the FlashAttention-3 paper's H100 figure. Not sourced elsewhere (V100: no
# FlashAttention-2; B200: no published figure).
FLASH2_EFFICIENCY: dict[str, float] = {
    **dict.fromkeys(("a100-40g", "a100-80g", "a100-80g-pcie"), FLASH_EFFICIENCY),
    **dict.fromkeys(("h100-80g", "h800", "h200", "gh200", "gh200-144g"), FLASH2_H100_EFFICIENCY),
}
ATTENTION_KERNELS = ("cudnn", "flash2")  # fused attention's kernel: the GPU's fitted `flash`, or FlashAttention-2
# Fitted on Megatron-LM's PTD-P Table 1 (A100): `calibrate.fit_calibration()`; tests/test_planner.py
# checks these equal the fit. The fit puts the memory-bound kernels at the bound (full HBM bandwidth):
# their byte counts are if anything high.
CALIBRATION = Calibration(gemm=0.741, hbm=1.0)
# Fitted on the published H100 runs (not the held-out rows): `calibrate.fit_published()`;
# tests/test_planner_published.py checks these equal the fit. overlap: the charge under Megatron's
# semantics (the recipes' ub_tp_comm_overlap_cfg gives TE's ring-exchange overlaps 1 SM, its pipelined
# and bulk ones 2 to 24 of the 132); meshrun's semantics and ZeRO-2/3 traffic keep OVERLAP_COST.
H100_CALIBRATION = Calibration(gemm=0.612, hbm=1.0, fp8=0.497, flash=0.487, overlap=0.0)
CALIBRATIONS: dict[str, Calibration] = {"h100-80g": H100_CALIBRATION}


def calibration_for(gpu_name: str) -> Calibration:
    """The calibration set of a GPU of the catalogue: its own where fitted, else the A100's."""
    return CALIBRATIONS.get(gpu_name, CALIBRATION)


def with_attention_kernel(cal: Calibration, kernel: str, gpu_name: str) -> Calibration:
    """`cal` with fused attention run by `kernel` (ATTENTION_KERNELS): cudnn keeps its `flash`, flash2
    takes FLASH2_EFFICIENCY's figure for the GPU (KeyError where none is sourced)."""
    return cal if kernel == "cudnn" else replace(cal, flash=FLASH2_EFFICIENCY[gpu_name])


# ----------------------------------------------------------------------------- communication

# Sourced: the fraction of a link's bandwidth NCCL collectives reach in practice (nccl-tests bus
# bandwidth on DGX A100/H100 is ~75-85% of the link rate for large messages).
COMM_EFFICIENCY = 0.8
# Assumed: fixed cost per collective / p2p message (launch + latency), seconds.
COMM_LATENCY_S = 10e-6

# Assumed: a dropless MoE's busiest expert rank receives this many times the mean routed rows (top_k per
# token); 1.0: the expectation, the load-balancing loss keeping the routing even. Scales the expert GEMMs
# (both semantics: both run the real rows) and, under Megatron's semantics, the all-to-all and the
# routed activations (meshrun's dropless experts keep worst-case buffers: `flops.moe_routed`).
MOE_DROPLESS_IMBALANCE = 1.0

# ----------------------------------------------------------------------------- runtime memory (GPU plans)

# Sourced: CUDA context + cuBLAS/cuDNN handles and workspaces: ~0.5-1 GB per process on A100/H100 with
# CUDA 12 (PyTorch's CUDA semantics notes; what nvidia-smi shows for a process that has allocated nothing).
CUDA_CONTEXT_BYTES = 0.8e9
# Sourced: NCCL communicator buffers: NCCL_BUFFSIZE (4 MiB, NCCL's environment-variable docs) per channel
# and ring peer (send + recv), up to 16 channels on NVLink: 128 MiB per communicator (one per mesh axis
# of size > 1).
COMM_BUFFER_BYTES = 16 * 2 * 4 * 2**20
# Assumed: allocator fragmentation: transient tensors (activations, logits) cost this much more than
# their size (PyTorch caching allocator / XLA BFC; ZeRO-R, Rajbhandari et al. 2020 sec. 3.2, reports
# OOMs with >30% free in bad cases; 10% is the usual headroom in Megatron-LM and MaxText memory estimates).
FRAGMENTATION = 0.10
