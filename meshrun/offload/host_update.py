"""offload.update_on=host: the streamed tier's chunk update on jax's CPU backend instead of the
devices (DeepSpeed's CPU Adam, as one jitted function; docs/offload.md#where-the-update-runs).

Per chunk, only the gradient's columns (and the params' without a float32 master) come down from the
devices, one transfer per distinct local row, and the new params go back up, one per local device:
6 bytes per element of the shard with bf16 params over the host link instead of the state's 12 in
and 12 out. The state never leaves host memory: the ring buffers are arrays of the CPU backend's
device (`HostChunk`), the store reads chunk i straight into them, the update donates them so XLA
writes the new state into the same buffers, and the store writes those back, as the CPU backend's
in-place pass does with the mesh's own arrays (`device_chunk.DeviceChunk`). The update is the tier's
own (`optimizer_tier.OptimizerTier.update_chunk`) on every distinct row of the process at once ([rows, C]).

On a GPU machine the CPU backend's device is outside the mesh; on simulated CPU devices it is one the
mesh leaves out, else one of the mesh's (the same code path; the transfers are copies).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshrun.errors import ConfigError
from meshrun.offload.chunk_store import SLOTS_IN_FLIGHT
from meshrun.offload.device_chunk import host_view


def cpu_device(mesh_devices) -> jax.Device:
    """This process's CPU backend device for the host update: one outside the mesh where there is one
    (always on a GPU machine), else the first."""
    try:
        cpus = jax.local_devices(backend="cpu")
    except RuntimeError as e:  # JAX_PLATFORMS left the CPU backend out
        raise ConfigError("offload.update_on", "host", "add cpu to JAX_PLATFORMS (e.g. JAX_PLATFORMS=cuda,cpu) "
                          "or use device", f"jax's CPU backend is not available ({e})") from e  # fmt: skip
    used = set(mesh_devices)
    return next((d for d in cpus if d not in used), cpus[0])


class HostChunk:
    """One ring buffer of the host pass: a chunk of every slot as arrays of the CPU backend's device,
    each slot's two halves [rows, piece] (the store reads and writes them in place, `views`)."""

    def __init__(self, cpu: jax.Device, rows: int, pieces: tuple[int, ...], n_slots: int):
        self.rows = rows
        self.slots = tuple(tuple(jnp.zeros((rows, n), jnp.float32, device=cpu) for n in pieces)
                           for _ in range(n_slots))  # fmt: skip
        jax.block_until_ready(self.slots)

    def views(self) -> list[np.ndarray]:
        """Writable host views of every slot's rows, in the file's order ([slot][row][half])."""
        out = []
        for s in self.slots:
            halves = [host_view(h).reshape(self.rows, -1) for h in s]
            out += [h[r] for r in range(self.rows) for h in halves]
        return out

    def written(self) -> list[np.ndarray]:
        """The new chunk's pieces, once the update that made them has finished."""
        jax.block_until_ready(self.slots)
        return self.views()


class HostUpdate:
    """The chunk update of a `optimizer_tier.OptimizerTier` on the CPU backend (`run`: one step's pass)."""

    def __init__(self, tier: Any, scalar_sh: list):
        lay, master = tier.layout, tier.master
        self.tier, self.lay, self.scalar_sh = tier, lay, tuple(scalar_sh)
        self.cpu = cpu_device(lay.mesh.devices.flat)
        rows, pdt, blk = len(lay.first), tier.param_dtypes[0], (1,) * len(lay.mesh.axis_names) + (lay.chunk,)
        rep = NamedSharding(lay.mesh, P())

        def take(g_flat, p_flat, off):  # the chunk's columns of the flat rows, on the devices
            return tier.take_chunk(g_flat, off), None if p_flat is None else tier.take_chunk(p_flat, off)

        p_sh = None if master else lay.sharding
        self.take = jax.jit(take, in_shardings=(lay.sharding, p_sh, rep), out_shardings=(lay.sharding, p_sh))

        def update(g_rows, p_rows, slots, scalars, g_norm):  # on the CPU backend: every distinct row at once
            g = jnp.stack([x.reshape(-1) for x in g_rows])
            # master: the params come from the state's fp32 master; `p` only carries the param dtype
            p = jnp.zeros(g.shape, pdt) if master else jnp.stack([x.reshape(-1) for x in p_rows])
            new_p, new_slots, new_scalars = tier.update_chunk(g, p, slots, scalars, g_norm)
            new_p = jnp.concatenate(new_p, axis=-1)
            return new_slots, tuple(new_p[u].reshape(blk) for u in range(rows)), new_scalars

        # the new slots first: jax gives each donated buffer to the first output of its shape
        self.update = jax.jit(update, donate_argnums=2)

    def down(self, flat: jax.Array) -> tuple[jax.Array, ...]:
        """A [*mesh, C] array's distinct local rows -> the CPU backend's device (device to host)."""
        by_dev = {s.device: s.data for s in flat.addressable_shards}
        return tuple(jax.device_put(by_dev[self.lay.local[r]], self.cpu) for r in self.lay.first)

    def up(self, rows: tuple[jax.Array, ...]) -> jax.Array:
        """Distinct rows on the CPU backend -> a [*mesh, C] array on this process's devices (host to device)."""
        lay = self.lay
        arrays = [jax.device_put(rows[u], d) for d, u in zip(lay.local, lay.owner, strict=True)]
        return jax.make_array_from_single_device_arrays(lay.shape(lay.chunk), lay.sharding, arrays)

    def run(self, g_flat, p_flat, g_norm, scalars: tuple, ready) -> tuple[list, tuple]:
        """One step's pass over the store: (the chunks' new params on the devices, the new scalars)."""
        tier, lay, cpu = self.tier, self.lay, self.cpu
        box: dict = {}

        def start():  # once the gradient exists: the norm and the optimizer's scalars come down once
            ready()
            box["g_norm"] = jax.device_put(g_norm.addressable_data(0), cpu)
            box["scalars"] = tuple(jax.device_put(x.addressable_data(0), cpu) for x in scalars)

        new_p = []

        def update(i: int, item: HostChunk) -> HostChunk:
            g, p = self.take(g_flat, p_flat, jnp.int32(i * lay.chunk))
            p_rows = None if p is None else self.down(p)
            item.slots, rows, box["new"] = self.update(self.down(g), p_rows, item.slots, box["scalars"],
                                                       box["g_norm"])  # fmt: skip
            new_p.append(self.up(rows))
            return item

        ring = [HostChunk(cpu, len(lay.first), tier.pieces, tier.pattern.n_slots) for _ in range(SLOTS_IN_FLIGHT)]
        tier.file.stream(update, HostChunk.written, ready=start, ring=ring)
        new_scalars = tuple(jax.device_put(x, s) for x, s in zip(box["new"], self.scalar_sh, strict=True))
        return new_p, new_scalars
