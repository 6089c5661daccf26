"""`mesh:`: the parallel degrees and the order of the axes over the devices (docs/mesh.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshrun.config.base import MAX_DEVICES, _bounded
from meshrun.errors import ConfigError

AXES = ("data", "pipe", "expert", "context", "tensor")
DEFAULT_ORDER = ("pipe", "data", "expert", "context", "tensor")


@dataclass(frozen=True)
class MeshConfig:
    """Parallel degrees. One of them may be -1: it takes the devices left over."""

    data: int = -1  # data-parallel degree: the batch (and ZeRO state) split over this many devices
    pipe: int = 1  # pipeline stages: the stack of layers split over this many devices
    expert: int = 1  # expert parallelism: MoE experts split over this many devices (borrowed from data)
    tensor: int = 1  # tensor parallelism: each layer's weights split over this many devices (Megatron)
    context: int = 1  # context parallelism: each sequence split over this many devices
    order: tuple[str, ...] = DEFAULT_ORDER  # outer -> inner; `tensor` innermost keeps TP on NVLink
    hosts: int = 0  # 0: one host per process; on CPU, H>0 splits the simulated devices into H hosts
    racks: int = 0  # hosts per rack (consecutive hosts share a rack); 0: all hosts in one rack
    allow_cross_host_tensor: bool = False  # true: a tensor group across hosts is a warning, not an error
    # HSDP: ZeRO state sharded over groups of this many data ranks (e.g. the GPUs of one node) and
    # replicated over mesh.data / zero_group groups; the mesh gets an outer 'replica' axis beside an inner
    # 'data' axis of this size. 0: ZeRO shards over the whole data axis. docs/memory.md
    zero_group: int = 0

    def __post_init__(self):
        for ax in AXES:
            v = getattr(self, ax)
            if v == 0 or v < -1:
                raise ConfigError(
                    f"mesh.{ax}",
                    v,
                    "use a positive degree, or -1 to take the devices left over",
                    "degree must be >= 1 or -1",
                )
            _bounded(f"mesh.{ax}", v, -1, MAX_DEVICES)
        fill = [ax for ax in AXES if getattr(self, ax) == -1]
        if len(fill) > 1:
            raise ConfigError("mesh", {a: -1 for a in fill}, "set at most one axis to -1", "two axes are -1")
        if "context" not in self.order and sorted((*self.order, "context")) == sorted(AXES):
            # an order written before the context axis existed: context sits just outside tensor
            at = self.order.index("tensor") if "tensor" in self.order else len(self.order)
            object.__setattr__(self, "order", (*self.order[:at], "context", *self.order[at:]))
        if sorted(self.order) != sorted(AXES):
            raise ConfigError(
                "mesh.order",
                list(self.order),
                f"list each of {list(AXES)} exactly once",
                "order must be a permutation of the mesh axes",
            )
        if self.hosts < 0:
            raise ConfigError("mesh.hosts", self.hosts, "use 0 (one host per process) or a positive count")
        if self.racks < 0:
            raise ConfigError("mesh.racks", self.racks, "use 0 (one rack) or the number of hosts per rack")
        _bounded("mesh.hosts", self.hosts, 0, MAX_DEVICES)
        _bounded("mesh.zero_group", self.zero_group, 0, MAX_DEVICES)
        if self.zero_group and self.data != -1:
            check_zero_group(self.zero_group, self.data)
        _bounded("mesh.racks", self.racks, 0, MAX_DEVICES)


def check_zero_group(group: int, data: int, field: str = "mesh.zero_group") -> None:
    """mesh.zero_group must split the data degree into whole groups (`data`: mesh.data, resolved)."""
    if group > data:
        raise ConfigError(field, group, f"use at most mesh.data={data} (a divisor of it), or 0",
                          "the ZeRO group is larger than the data-parallel degree")  # fmt: skip
    if data % group:
        fits = [g for g in range(2, data) if data % g == 0]
        eg = f" ({', '.join(map(str, fits))})" if fits else ""
        raise ConfigError(field, group, f"use a divisor of mesh.data={data}{eg}, or 0",
                          "the data-parallel degree does not split into groups of this size")  # fmt: skip


def resolve_shape(cfg: MeshConfig, n_devices: int) -> dict[str, int]:
    """Axis sizes with the -1 axis filled; errors name the axes and the device count."""
    sizes = {ax: getattr(cfg, ax) for ax in AXES}
    fill = [ax for ax, v in sizes.items() if v == -1]
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if fill:
        if n_devices % fixed:
            raise ConfigError(
                f"mesh.{fill[0]}",
                -1,
                f"make the other degrees' product ({fixed}) divide the {n_devices} devices",
                f"{n_devices} devices are not divisible by {fixed}",
            )
        sizes[fill[0]] = n_devices // fixed
    elif fixed != n_devices:
        shape = " x ".join(f"{ax}={sizes[ax]}" for ax in AXES)
        raise ConfigError(
            "mesh",
            shape,
            f"make the product equal {n_devices}, or set one axis to -1",
            f"product of axes is {fixed} but there are {n_devices} devices",
        )
    return sizes
