"""Host-aware mesh builder over the axes `data`, `pipe`, `expert`, `context`, `tensor`.

Devices are laid out host-major and the mesh is filled outer -> inner in `MeshConfig.order`
(default `pipe, data, expert, context, tensor`, Megatron's tp-cp-ep-dp-pp): the innermost axis
varies fastest, so `tensor` groups are neighbouring devices of one host (NVLink), `context` groups
the next ones (inside a host while tensor x context fits), `pipe`/`data` cross hosts.
Racks (`MeshConfig.racks` hosts each) are runs of consecutive hosts, so the device list is
rack-major too: the outermost axis (`pipe` by default) is the one that crosses racks.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from meshrun.config import MeshConfig, check_zero_group, from_dict, resolve_shape, to_dict
from meshrun.errors import ConfigError
from meshrun.parallel.sharding import REPLICA, ZERO_AXES

# Pretend-host count per mesh built on one process (CPU simulation); real runs use process_index.
_PRETEND_HOSTS: dict[Mesh, int] = {}
# Hosts per rack of each mesh built here (absent: one rack).
_HOSTS_PER_RACK: dict[Mesh, int] = {}


def split_data(cfg: MeshConfig, sizes: dict[str, int]) -> dict[str, int]:
    """HSDP (`mesh.zero_group`): {'replica': data / group, 'data': group}; {} without it (or one group)."""
    group, data = cfg.zero_group, sizes["data"]
    if not group:
        return {}
    check_zero_group(group, data)  # mesh.data=-1: known only now
    return {} if group == data else {REPLICA: data // group, "data": group}


def mesh_axes(cfg: MeshConfig, sizes: dict[str, int]) -> tuple[str, ...]:
    """The mesh's axis names, outer -> inner: `mesh.order`, with HSDP's 'replica' just outside 'data' so
    that a ZeRO group is the `zero_group` neighbouring data ranks (one node's devices when it is the GPUs
    per node and the axes inside 'data' have size 1)."""
    if REPLICA not in split_data(cfg, sizes):
        return tuple(cfg.order)
    at = cfg.order.index("data")
    return (*cfg.order[:at], REPLICA, *cfg.order[at:])


def _host_groups(devices: list, hosts: int) -> list[list]:
    """Split devices into hosts: by process when multi-process, else into `hosts` pretend hosts."""
    nproc = len({d.process_index for d in devices})
    if nproc > 1:
        if hosts and hosts != nproc:
            raise ConfigError("mesh.hosts", hosts, f"leave it 0 in a multi-process run ({nproc} processes)")
        by = {}
        for d in sorted(devices, key=lambda d: (d.process_index, d.id)):
            by.setdefault(d.process_index, []).append(d)
        groups = [by[k] for k in sorted(by)]
        if len({len(g) for g in groups}) != 1:
            raise ConfigError(
                "devices",
                [len(g) for g in groups],
                "give every process the same device count",
                "processes have different numbers of devices",
            )
        return groups
    hosts = hosts or 1
    if len(devices) % hosts:
        raise ConfigError(
            "mesh.hosts",
            hosts,
            f"choose a divisor of the {len(devices)} devices",
            f"{len(devices)} devices cannot be split evenly into {hosts} hosts",
        )
    ds = sorted(devices, key=lambda d: d.id)
    k = len(ds) // hosts
    return [ds[i * k : (i + 1) * k] for i in range(hosts)]


def _hybrid_array(groups: list[list], shape: tuple[int, ...]) -> np.ndarray:
    """Device array whose inner axes fit inside one host (create_hybrid_device_mesh's ICI/DCN split)."""
    per_host = len(groups[0])
    flat = [d for g in groups for d in g]
    if len(groups) > 1 and flat[0].platform != "cpu":
        # Split each axis, inner to outer, into an in-host (ICI) and an across-host (DCN) factor.
        ici, left = [1] * len(shape), per_host
        for i in reversed(range(len(shape))):
            ici[i] = math.gcd(shape[i], left)
            left //= ici[i]
        if left == 1:
            dcn = [s // c for s, c in zip(shape, ici)]
            try:
                return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=flat, process_is_granule=True)
            except (ValueError, AssertionError, NotImplementedError):
                pass  # topology the helper does not know: the host-major reshape below is equivalent
    return np.array(flat, dtype=object).reshape(shape)


def build_mesh(cfg: MeshConfig | None = None, devices: list | None = None, **overrides: Any) -> Mesh:
    """Build the training mesh (Auto axis types). Keyword overrides are MeshConfig fields."""
    cfg = cfg or MeshConfig()
    if overrides:
        cfg = from_dict(MeshConfig, {**to_dict(cfg), **overrides}, "mesh.")
    devices = list(devices) if devices is not None else jax.devices()
    sizes = resolve_shape(cfg, len(devices))
    groups = _host_groups(devices, cfg.hosts)
    names = mesh_axes(cfg, sizes)
    sizes = {**sizes, **split_data(cfg, sizes)}
    shape = tuple(sizes[ax] for ax in names)
    arr = _hybrid_array(groups, shape)
    axis_types = (jax.sharding.AxisType.Auto,) * len(shape)
    mesh = Mesh(arr, names, axis_types=axis_types)
    if len({d.process_index for d in devices}) == 1:
        _PRETEND_HOSTS[mesh] = len(groups)
    _HOSTS_PER_RACK.pop(mesh, None)  # meshes over the same devices are equal: forget an earlier build's racks
    if cfg.racks:
        if len(groups) % cfg.racks:
            raise ConfigError(
                "mesh.racks",
                cfg.racks,
                f"give the hosts per rack as a divisor of the {len(groups)} hosts (0: one rack)",
                f"{len(groups)} hosts cannot be split into racks of {cfg.racks} hosts",
            )
        _HOSTS_PER_RACK[mesh] = cfg.racks
    for w in check_placement(mesh, cfg):
        warnings.warn(w, stacklevel=2)
    return mesh


def host_of(mesh: Mesh) -> dict[int, int]:
    """Device id -> host index (process index, or pretend host on one process)."""
    devs = list(mesh.devices.flat)
    if len({d.process_index for d in devs}) > 1:
        procs = sorted({d.process_index for d in devs})
        return {d.id: procs.index(d.process_index) for d in devs}
    hosts = _PRETEND_HOSTS.get(mesh, 1)
    ids = sorted(d.id for d in devs)
    k = len(ids) // hosts
    return {i: n // k for n, i in enumerate(ids)}


def rack_of(mesh: Mesh) -> dict[int, int]:
    """Device id -> rack index (consecutive hosts, `MeshConfig.racks` per rack)."""
    hosts = host_of(mesh)
    per_rack = _HOSTS_PER_RACK.get(mesh, max(hosts.values()) + 1)
    return {d: h // per_rack for d, h in hosts.items()}


def axis_groups(mesh: Mesh, axis: str) -> list[list[int]]:
    """Device-id groups that communicate along `axis` (all other coordinates fixed)."""
    ids = np.vectorize(lambda d: d.id, otypes=[int])(mesh.devices)
    k = mesh.axis_names.index(axis)
    moved = np.moveaxis(ids, k, -1).reshape(-1, ids.shape[k])
    return [list(map(int, row)) for row in moved]


def check_placement(mesh: Mesh, cfg: MeshConfig) -> list[str]:
    """Topology rules: a tensor group across hosts is an error unless allowed; expert or context
    across hosts warns."""
    hosts = host_of(mesh)
    out = []
    for axis in ("tensor", "context", "expert"):
        if axis not in mesh.shape:
            continue
        spans = max(len({hosts[i] for i in g}) for g in axis_groups(mesh, axis))
        if spans <= 1:
            continue
        size = mesh.shape[axis]
        if axis == "tensor" and not cfg.allow_cross_host_tensor:
            per_host = len(hosts) // (max(hosts.values()) + 1)
            raise ConfigError(
                "mesh.tensor",
                size,
                f"use mesh.tensor <= {per_host} (devices per host), or set "
                "mesh.allow_cross_host_tensor=true to accept it",
                f"a tensor-parallel group spans {spans} hosts",
            )
        why = {
            "tensor": "TP all-reduces run over the inter-node network, ~10x slower than NVLink",
            "context": "every layer's K/V exchange runs over the inter-node network (keep mesh.tensor x "
            "mesh.context within a host where possible)",
            "expert": "expert all-to-all runs over the inter-node network",
        }[axis]
        out.append(f"mesh.{axis}={size}: a {axis} group spans {spans} hosts; {why}")
    return out + _rack_warnings(mesh)


def _rack_warnings(mesh: Mesh) -> list[str]:
    """A data-parallel or expert group across racks while the pipeline stays inside one: the
    per-step gradient all-reduce (or every all-to-all) then crosses the racks' uplinks, where only
    the pipeline's point-to-point sends should."""
    racks = rack_of(mesh)
    n = max(racks.values()) + 1
    if n == 1:
        return []
    spans = lambda axis: max(len({racks[i] for i in g}) for g in axis_groups(mesh, axis))
    if spans("pipe") > 1:
        return []
    out = []
    for axis in (REPLICA, "data", "expert"):  # 'replica': HSDP's all-reduce across the ZeRO groups
        if axis in mesh.shape and (k := spans(axis)) > 1:
            what = "gradient all-reduce" if axis == "data" else "all-to-all"
            out.append(
                f"mesh.{axis}={mesh.shape[axis]}: {'an' if axis == 'expert' else 'a'} {axis} group spans {k} racks "
                "while no pipeline group "
                f"does; its {what} crosses the inter-rack links: let the pipeline cross racks instead "
                f"(mesh.pipe a multiple of the {n} racks, outermost in mesh.order)"
            )
    return out


def describe_dict(mesh: Mesh) -> dict[str, Any]:
    """Machine-readable description: axes, shape, hosts, device ids, host of each device, groups."""
    hosts, racks = host_of(mesh), rack_of(mesh)
    ids = np.vectorize(lambda d: d.id, otypes=[int])(mesh.devices)
    return {
        "axes": list(mesh.axis_names),
        "shape": {ax: int(mesh.shape[ax]) for ax in mesh.axis_names},
        "hosts": max(hosts.values()) + 1,
        "racks": max(racks.values()) + 1,
        "device_ids": ids.tolist(),
        "host_of": {str(k): v for k, v in sorted(hosts.items())},
        "rack_of": {str(k): v for k, v in sorted(racks.items())},
        "groups": {ax: axis_groups(mesh, ax) for ax in mesh.axis_names},
    }


def describe(mesh: Mesh) -> str:
    """Readable table: host/device at each mesh coordinate, then the groups along each axis."""
    d = describe_dict(mesh)
    hosts, racks = d["host_of"], d["rack_of"]
    shape = " x ".join(f"{a}={d['shape'][a]}" for a in d["axes"])
    multi = d["racks"] > 1  # the rack column only where there is more than one rack
    in_racks = f" in {d['racks']} racks" if multi else ""
    lines = [f"mesh {shape}  ({d['hosts']} host(s){in_racks}, {len(hosts)} devices)"]
    if REPLICA in d["shape"]:  # HSDP
        group = math.prod(d["shape"][a] for a in ZERO_AXES)
        lines.append(f"hybrid (mesh.zero_group={d['shape']['data']}): ZeRO state sharded over groups of {group} "
                     f"data-parallel ranks (the data groups below), replicated {d['shape'][REPLICA]} times "
                     "(the replica groups)")  # fmt: skip
    lines.append("  " + "  ".join(f"{a:>7}" for a in d["axes"]) + ("    rack" if multi else "") + "    host  device")
    ids = np.array(d["device_ids"])
    for coord in np.ndindex(ids.shape):
        dev = int(ids[coord])
        rack = f"    {racks[str(dev)]:>4}" if multi else ""
        lines.append("  " + "  ".join(f"{c:>7}" for c in coord) + f"{rack}    {hosts[str(dev)]:>4}  {dev:>6}")
    for ax in d["axes"]:
        lines.append(f"{ax} groups: " + " ".join("[" + ",".join(map(str, g)) + "]" for g in d["groups"][ax]))
    return "\n".join(lines)
