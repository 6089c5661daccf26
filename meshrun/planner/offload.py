"""Offload in the planner: what each memory lever takes off the device and what it costs.

Levers (the train step's `train.offload_optimizer` and `model.remat=offload`):
* optimizer: the optimizer state rests in pinned host memory (`train.offload_optimizer=host`);
  nvme: it rests on the node's NVMe drives and the update streams it (`=nvme`). What each tier
  holds where, moves and costs: `tiers.optimizer_tier`.
* activations: the layer inputs stay on the device (full remat's footprint); the selective names
  (`activations.saved_name_bytes`) go to host in the forward and come back for the backward: 2 x
  their bytes per layer and micro-batch over the host link, overlapped with compute (DMA engines),
  so only the excess over the compute time is charged. Compute is selective's (no matmul recompute).

When no layout fits in device memory, `propose` tries the levers in LEVERS' order and stops at the
first that makes some layout fit: NVMe only when device + host memory do not fit.

Host link per GPU, one direction: the catalogue's `GPU.pcie_bw` x `COMM_EFFICIENCY` (A100 PCIe 4.0
x16 32 GB/s, H100/H200 PCIe 5.0 x16 64 GB/s, GH200 NVLink-C2C 450 GB/s).
"""

from __future__ import annotations

import math
from dataclasses import replace

from meshrun.analysis.flops import param_counts
from meshrun.config import ModelConfig
from meshrun.planner import tiers
from meshrun.planner.activations import saved_name_bytes
from meshrun.planner.cost import precision_of
from meshrun.planner.hardware import GB, TB, Cluster
from meshrun.planner.layout import DTYPE_BYTES
from meshrun.planner.tiers import host_bw as host_bw

# tried in this order when nothing fits ("optimizer": the host tier)
LEVERS = (("optimizer",), ("optimizer", "activations"), ("nvme",), ("nvme", "activations"))


def _names_share(model: ModelConfig, lay, seq_len: int) -> tuple[float, float]:
    """(share of selective's kept activations that are the offloaded names, their bytes per layer)."""
    act = precision_of(model).act
    s = seq_len / lay.context if lay.context > 1 else seq_len  # the local tokens under context parallelism
    names = saved_name_bytes(model, lay.micro_batch_size, s, lay.tensor, act=act)
    layer_in = act * s * lay.micro_batch_size * model.d_model / lay.tensor
    return names / (names + layer_in), names


def tier_of(levers: tuple[str, ...]) -> str:
    return "nvme" if "nvme" in levers else "host" if "optimizer" in levers else "none"


def _device_part(part: dict, levers: tuple[str, ...], share: float, tier: tiers.Tier) -> dict:
    """One stage's memory parts left on the device: the optimizer off it between the update's; the
    total the larger of the backward (less the offloaded activations) and the update's peak."""
    out = dict(part)
    if "activations" in levers:
        out["activations"] = part["activations"] * (1 - share)
    if tier.tier != "none":
        out["optimizer"] = 0.0
        backward = part["total"] - part["optimizer"] - (part["activations"] - out["activations"])
        out["total"], out["update_peak"] = max(backward, tier.update), tier.update
    else:
        out["total"] = part["total"] - (part["activations"] - out["activations"])
    return out


def with_offload(result, model: ModelConfig, cluster: Cluster, seq_len: int, levers: tuple[str, ...],
                 budget_mb: float = tiers.DEFAULT_BUDGET_MB) -> dict:  # fmt: skip
    """{memory (device parts), host, time, traffic, transfer_s, tier}: a planner Result with `levers`
    on (host: host bytes per GPU; traffic: bytes over the host link per step; transfer_s: the I/O
    time the step waits for)."""
    lay, mem, tm = result.layout, result.memory, result.time
    levers = tuple(x for x in levers if x != "activations" or lay.remat == "selective")
    share, names = _names_share(model, lay, seq_len)
    tier = tiers.optimizer_tier(mem, model, lay, cluster, tier_of(levers), tm["optimizer"], budget_mb)
    stage_tier = lambda part: tiers.optimizer_tier(part, model, lay, cluster, tier.tier, tm["optimizer"], budget_mb)
    memory = _device_part(mem, levers, share, tier)
    if "stages" in mem:
        memory["stages"] = {k: _device_part(v, levers, share, stage_tier(v)) for k, v in mem["stages"].items()}
    extra, traffic, host = tier.exposed_s, tier.pcie, tier.host
    if "activations" in levers:  # out in the forward, back in the backward, beside the compute
        per_step = 2 * names * model.n_layers / lay.pipe * lay.microbatches
        traffic += per_step
        extra += max(0.0, per_step / host_bw(cluster) - tm["compute"])
        host += mem["activations"] - memory["activations"]
    return {"memory": memory, "host": host, "time": tm["total"] + extra, "traffic": traffic, "transfer_s": extra,
            "tier": tier}  # fmt: skip


def _why(o: dict, levers: tuple[str, ...], r, cluster: Cluster, host_misfit: list[str]) -> str:
    """The proposal's reason: what rests where, what it moves and costs, and what did not fit."""
    t, usable, gpn, st = o["tier"], cluster.usable_memory, cluster.gpus_per_node, cluster.storage
    acts = " + activations" if "activations" in levers else ""
    without = f"without it this layout needs {r.memory['total'] / GB:.1f} GB > {usable / GB:.1f} GB usable"
    if t.tier == "host":
        return (f"offload optimizer{acts} to host memory: {o['host'] / GB:.1f} GB/device in host memory "
                f"({o['host'] * gpn / TB:.2f} of {st.host_bytes / TB:.2f} TB per node), {o['traffic'] / GB:.1f} "
                f"GB/step over the host link (+{o['transfer_s']:.3g} s); update peak {t.update / GB:.1f} GB; "
                f"{without}")  # fmt: skip
    host = f"{acts.removeprefix(' + ')} to host memory, " if acts else ""
    return (f"offload optimizer to NVMe (train.offload_optimizer=nvme){', ' + host if host else ': '}"
            f"{t.nvme / GB:.1f} GB/device on NVMe ({t.nvme * gpn / TB:.2f} of "
            f"{st.nvme_drives * st.nvme_drive_bytes / TB:.1f} TB per node), read and written once a step "
            f"in {t.n_chunks} chunks through {t.host * gpn / 2**20:.0f} MiB of host memory: drives and host "
            f"link {t.io_s:.3g} s, +{t.exposed_s:.3g} s beyond the update; update peak {t.update / GB:.1f} GB; "
            f"host offload does not fit ({'; '.join(host_misfit)}); {without}")  # fmt: skip


def propose(results, model: ModelConfig, cluster: Cluster, seq_len: int, top: int, framework: str = "meshrun") -> list:
    """When no layout fits: the fastest layouts that fit with offloading, each saying why. `results`:
    planner Results that failed on memory only. The NVMe tier is meshrun's own (framework meshrun)."""
    out = []
    for levers in LEVERS:
        if tier_of(levers) == "nvme" and framework != "meshrun":
            break
        for r in results:
            if "activations" in levers and r.layout.remat != "selective":
                continue
            o = with_offload(r, model, cluster, seq_len, levers)
            if misfits(o, r.layout, cluster):
                continue
            host_misfit = []
            if o["tier"].tier == "nvme":
                host_levers = tuple("optimizer" if x == "nvme" else x for x in levers)
                h = with_offload(r, model, cluster, seq_len, host_levers)
                host_misfit = misfits(h, r.layout, cluster)
            why = _why(o, levers, r, cluster, host_misfit)
            memory = dict(o["memory"], host=o["host"])
            time = dict(r.time, total=o["time"], host_transfer=o["transfer_s"])
            viol = [v for v in r.violations if not v.startswith("memory ")] + [why]
            slower = r.step_time / o["time"]
            out.append(replace(r, memory=memory, time=time, violations=viol, hard=False,
                               tflops_per_device=r.tflops_per_device * slower, mfu=r.mfu * slower))  # fmt: skip
        if out:
            break
    out.sort(key=lambda r: (r.step_time, r.memory["total"]))
    return out[:top]


def misfits(o: dict, layout, cluster: Cluster) -> list[str]:
    """Why an offloaded layout (`with_offload`) does not fit (empty: it fits); the device's peak and
    host memory with the offloaded activations counted."""
    t = replace(o["tier"], host=o["host"], backward=o["memory"]["total"])
    return tiers.misfits(t, cluster, layout)


def blocker(results, model: ModelConfig, cluster: Cluster, seq_len: int) -> str:
    """What keeps every layout of `results` (memory-only misfits) off the device even with the
    optimizer state on NVMe, and the fix, in words."""
    usable, n = cluster.usable_memory, cluster.n_devices
    pb = DTYPE_BYTES[model.param_dtype]
    params = pb * param_counts(model)["total"]
    if params / n > usable:  # ZeRO-3 gathers a stage's weights for the step: never below params / n
        return (f"even with the optimizer state on NVMe the {model.param_dtype} parameters alone are "
                f"{params / n / GB:.1f} GB per device split over all {n} GPUs (tensor x pipe x ZeRO-3) > "
                f"{usable / GB:.1f} GB usable; it needs the parameters off the device (train.offload_params), which "
                f"the planner does not cost yet and the nvme tier does not combine with: use at least "
                f"{math.ceil(params / usable)} GPUs of this kind (for the parameters alone)")  # fmt: skip
    r, o = min(((r, with_offload(r, model, cluster, seq_len, ("nvme",))) for r in results),
               key=lambda ro: ro[1]["memory"]["total"])  # fmt: skip
    m, lay = o["memory"], r.layout
    degrees = "".join(f" {k}={v}" for k, v in (("expert", lay.expert), ("context", lay.context)) if v > 1)
    return (f"even with the optimizer state on NVMe it needs {m['total'] / GB:.1f} GB per device (tensor={lay.tensor} "
            f"pipe={lay.pipe} data={lay.data}{degrees} zero={lay.zero} remat={lay.remat}: "
            f"params {m['params'] / GB:.1f} GB, "
            f"gradients {m['grads'] / GB:.1f} GB, activations {m['activations'] / GB:.1f} GB, update peak "
            f"{o['tier'].update / GB:.1f} GB); parameters and gradients stay on the device (train.offload_params "
            f"is not costed by the planner yet): use more GPUs or GPUs with more memory")  # fmt: skip
