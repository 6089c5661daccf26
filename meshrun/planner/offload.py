"""Offload in the planner: what each memory lever takes off the device and what it costs.

Levers (the train step's `offload.optimizer` and `model.remat=offload`):
* optimizer: the optimizer state rests in pinned host memory (`offload.optimizer=host`);
  nvme: it rests on the node's NVMe drives and the update streams it (`=nvme`). What each tier
  holds where, moves and costs: `tiers.optimizer_tier`.
* activations: the layer inputs stay on the device (full remat's footprint); the selective names
  (`activations.saved_name_bytes`) go to host in the forward and come back for the backward: 2 x
  their bytes per layer and micro-batch over the host link, overlapped with compute (DMA engines),
  so only the excess over the compute time is charged. Compute is selective's (no matmul recompute).
* params: `offload.params` (ZeRO-3 layouts), with the state on the device, in host memory or
  on NVMe (`param_offload.py`); only combinations meshrun's runtime accepts
  (`param_offload.refusals`, which asks `config.offload_params_refusals`).
`propose` tries the levers when no layout fits in device memory.
"""

from __future__ import annotations

from dataclasses import replace

from meshrun.config import ModelConfig
from meshrun.planner import param_offload, tiers
from meshrun.planner.activations import saved_name_bytes
from meshrun.planner.cost import precision_of
from meshrun.planner.hardware import GB, TB, Cluster
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


def _device_part(part: dict, levers: tuple[str, ...], share: float, tier: tiers.TierCost) -> dict:
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
        how = f"streamed in {t.n_chunks} chunks" if t.streamed else "the whole shard on the device"
        return (f"offload optimizer{acts} to host memory: {o['host'] / GB:.1f} GB/device in host memory "
                f"({o['host'] * gpn / TB:.2f} of {st.host_bytes / TB:.2f} TB per node), {o['traffic'] / GB:.1f} "
                f"GB/step over the host link (+{o['transfer_s']:.3g} s); update {how}, peak {t.update / GB:.1f} GB"
                f"{'; ' + tiers.update_place(t) if t.streamed else ''}; {without}")  # fmt: skip
    host = f"{acts.removeprefix(' + ')} to host memory, " if acts else ""
    return (f"offload optimizer to NVMe (offload.optimizer=nvme){', ' + host if host else ': '}"
            f"{t.nvme / GB:.1f} GB/device on NVMe ({t.nvme * gpn / TB:.2f} of "
            f"{st.nvme_drives * st.nvme_drive_bytes / TB:.1f} TB per node), read and written once a step "
            f"in {t.n_chunks} chunks through {t.host * gpn / 2**20:.0f} MiB of host memory: drives and host "
            f"link {t.io_s:.3g} s, +{t.exposed_s:.3g} s beyond the update; {tiers.update_place(t)}; update peak "
            f"{t.update / GB:.1f} GB; "
            f"host offload does not fit ({'; '.join(host_misfit)}); {without}")  # fmt: skip


def propose(results, model: ModelConfig, cluster: Cluster, seq_len: int, top: int, framework: str = "meshrun") -> list:
    """When no layout fits: the fastest layouts that fit with offloading, each saying why. `results`:
    planner Results that failed on memory only. The NVMe tier is meshrun's own (framework meshrun).

    The levers are tried in LEVERS' order, stopping at the first that makes some layout fit: NVMe only
    when device + host memory do not fit; the parameters off the device only when the optimizer
    state's tiers alone do not fit. Host link per GPU, one direction: the catalogue's `GPU.pcie_bw` x
    `COMM_EFFICIENCY` (A100 PCIe 4.0 x16 32 GB/s, H100/H200 PCIe 5.0 x16 64 GB/s, GH200 NVLink-C2C
    450 GB/s)."""
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
            layout = replace(r.layout, offload_optimizer=o["tier"].tier)
            out.append(_offloaded(r, layout, memory, dict(r.time, total=o["time"], host_transfer=o["transfer_s"]), why))
        if out:
            break
    if not out and framework == "meshrun":
        out = _propose_params(results, model, cluster, seq_len)
    out.sort(key=lambda r: (r.step_time, r.memory["total"]))
    return out[:top]


def _offloaded(r, layout, memory: dict, time: dict, why: str, hard: list[str] = ()):
    """Result `r` with its layout's levers on: their memory and time, `why` as a note, `hard` misfits."""
    viol = [v for v in r.violations if not v.startswith("memory ")] + [*hard, why]
    slower = r.step_time / time["total"]
    return replace(r, layout=layout, memory=memory, time=time, violations=viol, hard=bool(hard),
                   tflops_per_device=r.tflops_per_device * slower, mfu=r.mfu * slower)  # fmt: skip


# Where `offload.params` keeps the optimizer state and the layers' gradient, nearest the device
# first: the search proposes the first that fits (the gradient goes to NVMe only when host memory
# cannot hold it beside the parameters).
PARAM_TIERS = (("none", "host"), ("host", "host"), ("nvme", "host"), ("nvme", "nvme"))


def params_of(r, model: ModelConfig, cluster: Cluster, tier: str, grads: str = "host") -> param_offload.ParamTierCost:
    """`offload.params` with the state in `tier` (the layers' gradient in `grads`) on Result `r`
    (a ZeRO-3 layout, meshrun's step)."""
    mem = dict(r.memory, layers=max(r.time["split"]))  # SPMD: every stage has the largest stage's shape
    return param_offload.param_tier(mem, model, r.layout, cluster, tier, r.time["dp_sync"],
                                    t_gather=r.time.get("dp_gather"), grads=grads)  # fmt: skip


def _params_result(r, model: ModelConfig, cluster: Cluster, pt: param_offload.ParamTierCost, why: str,
                   hard: list[str] = ()):  # fmt: skip
    """Result `r` with `offload.params` (and its state tier) on."""
    memory = dict(pt.parts, host=pt.host, update_peak=pt.update)
    memory["stages"] = {k: dict(memory, stage=v["stage"], layers=v["layers"]) for k, v in r.memory["stages"].items()}
    time = dict(r.time, dp_sync=pt.dp_s, host_transfer=pt.exposed_s, total=_params_step(r, pt))
    layout = replace(r.layout, offload_params=True, offload_optimizer=pt.optimizer, offload_grads=pt.grads)
    return _offloaded(r, layout, memory, time, why, hard)


def _params_why(pt: param_offload.ParamTierCost, r, cluster: Cluster, lower: list[str]) -> str:
    """A `offload.params` proposal's reason: what rests where, what it moves and costs, what did not fit."""
    gpn, st, usable = cluster.gpus_per_node, cluster.storage, cluster.usable_memory
    flags = (
        "train.zero=3 offload.params=true"
        + f" offload.optimizer={pt.optimizer}" * (pt.optimizer != "none")
        + f" offload.grads=nvme pipeline.microbatches={r.layout.microbatches}" * (pt.grads == "nvme")
    )
    disk = st.nvme_drives * st.nvme_drive_bytes
    grads = (f" and the layers' float32 gradient ({pt.grad_nvme / GB:.1f} GB/device, written by the backward and "
             f"read by the update once a step)") * (pt.grads == "nvme")  # fmt: skip
    state = {"none": "the optimizer state on the device", "host": "the optimizer state in host memory too",
             "nvme": f"the optimizer state{grads} on NVMe ({pt.nvme / GB:.1f} GB/device, {pt.nvme * gpn / TB:.2f} "
                     f"of {disk / TB:.1f} TB per node, drives {pt.disk_s:.3g} s)"}  # fmt: skip
    return (f"offload parameters to host memory ({flags}): {pt.host / GB:.1f} GB/device in host memory "
            f"({pt.host * gpn / TB:.2f} of {st.host_bytes / TB:.2f} TB per node), {state[pt.optimizer]}; "
            f"host link {pt.h2d / GB:.1f} GB in + {pt.d2h / GB:.1f} GB out per step (+{pt.link_s:.3g} s, not "
            f"overlapped with compute: unmeasured on a GPU), ZeRO-3 sync {pt.dp_s:.3g} s; update peak "
            f"{pt.update / GB:.1f} GB; {''.join(w + '; ' for w in lower)}without it this layout needs "
            f"{r.memory['total'] / GB:.1f} GB > {usable / GB:.1f} GB usable")  # fmt: skip


def _lower(r, model: ModelConfig, cluster: Cluster, seq_len: int | None, tier: str, grads: str = "host") -> list[str]:
    """Why the cheaper levers do not fit layout `r`: the state's tiers alone, then `offload.params`
    with the state nearer the device than `tier`."""
    out = []
    if seq_len is not None:
        for levers in (("optimizer",), ("nvme",)):
            o = with_offload(r, model, cluster, seq_len, levers)
            out.append(f"{tier_of(levers)} offload alone does not fit ({'; '.join(misfits(o, r.layout, cluster))})")
    for t, g in PARAM_TIERS[: PARAM_TIERS.index((tier, grads))]:
        pt = params_of(r, model, cluster, t, g)
        why = param_offload.misfits(pt, cluster, r.layout) or param_offload.refusals(model, r.layout, t, g)
        where = {"none": "on the device", "host": "in host memory", "nvme": "on NVMe"}[t]
        out.append(f"with the state {where}{' (the gradient in host memory)' * (t == 'nvme')}: {'; '.join(why)}")
    return out


def _propose_params(results, model: ModelConfig, cluster: Cluster, seq_len: int | None = None) -> list:
    """The ZeRO-3 layouts that fit with `offload.params`, the state's tier the nearest that fits
    (device, host, NVMe; then the gradient on NVMe too), in combinations meshrun runs (`param_offload.refusals`)."""
    for tier, grads in PARAM_TIERS:
        out = []
        for r in (r for r in results if r.layout.zero == 3):
            pt = params_of(r, model, cluster, tier, grads)
            if param_offload.misfits(pt, cluster, r.layout) or param_offload.refusals(model, r.layout, tier, grads):
                continue
            why = _params_why(pt, r, cluster, _lower(r, model, cluster, seq_len, tier, grads))
            out.append(_params_result(r, model, cluster, pt, why))
        if out:
            return out
    return []


def misfits(o: dict, layout, cluster: Cluster) -> list[str]:
    """Why an offloaded layout (`with_offload`) does not fit (empty: it fits); the device's peak and
    host memory with the offloaded activations counted."""
    t = replace(o["tier"], host=o["host"], backward=o["memory"]["total"])
    return tiers.misfits(t, cluster, layout)


def apply(r, model: ModelConfig, cluster: Cluster, seq_len: int):
    """Result `r` (`search.evaluate` of a layout whose `offload_optimizer` / `offload_params` are set)
    with those levers costed; what does not fit, or what meshrun refuses, is a hard violation."""
    lay, tier = r.layout, r.layout.offload_optimizer
    base = replace(r, layout=replace(lay, offload_optimizer="none", offload_params=False, offload_grads="host"))
    if lay.offload_params:
        pt = params_of(base, model, cluster, tier, lay.offload_grads)
        refused = [f"offload.params {w} (meshrun refuses it)"
                   for w in param_offload.refusals(model, lay, tier, lay.offload_grads)]  # fmt: skip
        if lay.zero != 3:
            return replace(r, violations=[*refused, *r.violations], hard=True)
        hard = refused + param_offload.misfits(pt, cluster, lay)
        return _params_result(base, model, cluster, pt, _params_why(pt, base, cluster, []), hard)
    levers = ({"host": "optimizer", "nvme": "nvme"}[tier],)
    o = with_offload(base, model, cluster, seq_len, levers)  # base keeps lay's offload_update
    why = _why(o, levers, base, cluster, [])
    time = dict(r.time, total=o["time"], host_transfer=o["transfer_s"])
    hard = misfits(o, lay, cluster)
    refused = tiers.host_refusal(model, lay) if tier == "host" and lay.offload_update == "streamed" else None
    if refused is not None:
        hard.append(f"offload.update=streamed: meshrun refuses it ({refused}; use auto or whole)")
    return _offloaded(base, lay, dict(o["memory"], host=o["host"]), time, why, hard)


def blocker(results, model: ModelConfig, cluster: Cluster, seq_len: int) -> str:
    """What keeps every layout of `results` (memory-only misfits) off the device even with every lever
    the planner costs, and the fix, in words: a `offload.params` combination that would fit
    but meshrun refuses (`param_offload.refusals`), else the smallest need."""
    z3, gpn = [r for r in results if r.layout.zero == 3], cluster.gpus_per_node
    for tier, grads in PARAM_TIERS:
        pts = ((r, params_of(r, model, cluster, tier, grads)) for r in z3)
        fit = [(r, pt) for r, pt in pts if not param_offload.misfits(pt, cluster, r.layout)]
        if not fit:
            continue
        r, pt = min(fit, key=lambda rp: _params_step(*rp))
        on = {"none": "", "host": " and the optimizer state in host memory", "nvme": " and the optimizer state on NVMe"}
        on_g = " (the gradient too)" * (grads == "nvme")
        nvme = f", {pt.nvme * gpn / TB:.2f} TB on NVMe per node" if pt.nvme else ""
        combo = [f"offload.optimizer={tier}"] * (tier != "none") + ["offload.grads=nvme"] * (
            grads == "nvme") + [f"model.param_dtype={model.param_dtype}"]  # fmt: skip
        refused = "; ".join(f"it {w}" for w in param_offload.refusals(model, r.layout, tier, grads))
        nearer = "; ".join(_lower(r, model, cluster, None, tier, grads))
        return (f"with the parameters in host memory (offload.params){on[tier]}{on_g} it would fit "
                f"({_degrees(r.layout)}: {pt.device / GB:.1f} GB per device, {pt.host * gpn / TB:.2f} TB of host "
                f"memory per node{nvme}, {_params_step(r, pt):.3g} s/step), but meshrun does not run "
                f"offload.params with {' and '.join(combo)}: {refused}"
                f"{f' (nearer the device: {nearer})' if nearer else ''}; "
                f"use more GPUs or GPUs with more memory")  # fmt: skip
    if z3:
        r, pt = min(((r, params_of(r, model, cluster, "nvme", "nvme")) for r in z3), key=lambda rp: rp[1].device)
        m, why = pt.parts, "; ".join(param_offload.misfits(pt, cluster, r.layout))
        return (f"even with the parameters in host memory (offload.params) and the optimizer state and the "
                f"gradient on NVMe "
                f"it needs {pt.device / GB:.1f} GB per device and {pt.host * gpn / TB:.2f} TB of host memory per "
                f"node ({_degrees(r.layout)}: params {m['params'] / GB:.1f} GB, gradients {m['grads'] / GB:.1f} GB, "
                f"activations {m['activations'] / GB:.1f} GB, logits {m['logits'] / GB:.1f} GB; {why}): use more "
                f"GPUs or GPUs with more memory")  # fmt: skip
    r, o = min(((r, with_offload(r, model, cluster, seq_len, ("nvme",))) for r in results),
               key=lambda ro: ro[1]["memory"]["total"])  # fmt: skip
    m = o["memory"]
    return (f"even with the optimizer state on NVMe it needs {m['total'] / GB:.1f} GB per device "
            f"({_degrees(r.layout)}: params {m['params'] / GB:.1f} GB, gradients {m['grads'] / GB:.1f} GB, "
            f"activations {m['activations'] / GB:.1f} GB, update peak {o['tier'].update / GB:.1f} GB), and no "
            f"ZeRO-3 layout for offload.params: use more GPUs or GPUs with more memory")  # fmt: skip


def _params_step(r, pt: param_offload.ParamTierCost) -> float:
    """Seconds per step of Result `r` with `offload.params`: its ZeRO-3 sync and host-link time."""
    return r.time["total"] - r.time["dp_sync"] + pt.dp_s + pt.exposed_s


def _degrees(lay) -> str:
    extra = "".join(f" {k}={v}" for k, v in (("expert", lay.expert), ("context", lay.context)) if v > 1)
    return (f"tensor={lay.tensor} pipe={lay.pipe} data={lay.data}{extra} zero={lay.zero} remat={lay.remat} "
            f"micro_batch_size={lay.micro_batch_size} microbatches={lay.microbatches}")  # fmt: skip
