"""Host offload in the planner: what each memory lever takes off the device and what it costs.

Levers (the train step's `train.offload_optimizer` and `model.remat=offload`):
* optimizer: the optimizer state of `predict_memory` (its moments and the fp32 master copy) rests in
  pinned host memory; every step fetches it for the update and writes it back: 2 x its bytes over
  the host link, exposed (the update waits for it).
* activations: the layer inputs stay on the device (full remat's footprint); the selective names
  (`activations.saved_name_bytes`) go to host in the forward and come back for the backward: 2 x
  their bytes per layer and micro-batch over the host link, overlapped with compute (DMA engines),
  so only the excess over the compute time is charged. Compute is selective's (no matmul recompute).

Host link per GPU, one direction: the catalogue's `GPU.pcie_bw` x `COMM_EFFICIENCY` (A100 PCIe 4.0
x16 32 GB/s, H100/H200 PCIe 5.0 x16 64 GB/s, GH200 NVLink-C2C 450 GB/s).
"""

from __future__ import annotations

from dataclasses import replace

from meshrun.config import ModelConfig
from meshrun.planner.activations import saved_name_bytes
from meshrun.planner.cost import precision_of
from meshrun.planner.hardware import COMM_EFFICIENCY, GB, Cluster

LEVERS = (("optimizer",), ("optimizer", "activations"))  # tried in this order when nothing fits


def host_bw(cluster: Cluster) -> float:
    """Achievable host<->device bytes/s of one GPU (one direction)."""
    return cluster.gpu.pcie_bw * COMM_EFFICIENCY


def _names_share(model: ModelConfig, lay, seq_len: int) -> tuple[float, float]:
    """(share of selective's kept activations that are the offloaded names, their bytes per layer)."""
    act = precision_of(model).act
    s = seq_len / lay.context if lay.context > 1 else seq_len  # the local tokens under context parallelism
    names = saved_name_bytes(model, lay.micro_batch_size, s, lay.tensor, act=act)
    layer_in = act * s * lay.micro_batch_size * model.d_model / lay.tensor
    return names / (names + layer_in), names


def _device_part(part: dict, levers: tuple[str, ...], share: float) -> dict:
    """One stage's memory parts left on the device."""
    out = dict(part)
    if "optimizer" in levers:
        out["optimizer"] = 0.0
    if "activations" in levers:
        out["activations"] = part["activations"] * (1 - share)
    out["total"] = part["total"] - (part["optimizer"] - out["optimizer"]) - (part["activations"] - out["activations"])
    return out


def with_offload(result, model: ModelConfig, cluster: Cluster, seq_len: int, levers: tuple[str, ...]) -> dict:
    """{memory (device parts), host, time, traffic, transfer_s}: a planner Result with `levers` on."""
    lay, mem, tm = result.layout, result.memory, result.time
    levers = tuple(x for x in levers if x != "activations" or lay.remat == "selective")
    share, names = _names_share(model, lay, seq_len)
    memory = _device_part(mem, levers, share)
    if "stages" in mem:
        memory["stages"] = {k: _device_part(v, levers, share) for k, v in mem["stages"].items()}
    bw, extra, traffic = host_bw(cluster), 0.0, 0.0
    if "optimizer" in levers:  # fetched for the update and written back: exposed
        traffic += 2 * mem["optimizer"]
        extra += 2 * mem["optimizer"] / bw
    if "activations" in levers:  # out in the forward, back in the backward, beside the compute
        per_step = 2 * names * model.n_layers / lay.pipe * lay.microbatches
        traffic += per_step
        extra += max(0.0, per_step / bw - tm["compute"])
    host = mem["total"] - memory["total"]
    return {"memory": memory, "host": host, "time": tm["total"] + extra, "traffic": traffic, "transfer_s": extra}


def propose(results, model: ModelConfig, cluster: Cluster, seq_len: int, top: int) -> list:
    """When no layout fits: the fastest layouts that fit with offloading, each saying why. `results`:
    planner Results that failed on memory only."""
    usable, out = cluster.usable_memory, []
    for levers in LEVERS:
        for r in results:
            if levers == ("optimizer", "activations") and r.layout.remat != "selective":
                continue
            o = with_offload(r, model, cluster, seq_len, levers)
            if o["memory"]["total"] > usable:
                continue
            why = (
                f"offload {' + '.join(levers)} to host memory: {o['host'] / GB:.1f} GB/device in host memory, "
                f"{o['traffic'] / GB:.1f} GB/step over the host link (+{o['transfer_s']:.3g} s); without it "
                f"this layout needs {r.memory['total'] / GB:.1f} GB > {usable / GB:.1f} GB usable"
            )
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
