"""offload.optimizer=nvme (and host, unless offload.update=whole): the optimizer state rests in
files (`swap_file.SwapFile`) or host memory (`chunk_store.HostStore`) and its update streams through
the device in chunks (ZeRO-Infinity, Rajbhandari et al. 2021; docs/offload.md).

The step runs in two parts. On the device, one jitted function: forward, backward, the gradient
reduction, the global gradient norm, and flat rows `[*mesh, L]` of the gradient and params (every
device's ZeRO shard of every leaf, `flat_layout.FlatLayout`). Then chunk by chunk the store's state is
read, updated by the optimizer's elementwise part, and written back while the next chunk is read and
the previous one written (`ChunkStore.stream`). Where a chunk is updated is a strategy picked by
offload.update_on (`UPDATES`: in place in the CPU device's own buffers, copied to the device, or on
jax's CPU backend). Init, saves and restores move the state one chunk at a time (`checkpoint_io.py`),
in the in-memory tiers' checkpoint format. `build(ts, cfg)` makes the tier; `tier.with_tier` uses it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshrun.checkpoint import slices
from meshrun.config import RunConfig
from meshrun.errors import ConfigError
from meshrun.offload import checkpoint_io, directory, host_update, malloc, swap_file
from meshrun.offload.chunk_store import SLOTS_IN_FLIGHT, ChunkStore, HostStore, resting_bytes
from meshrun.offload.device_chunk import DeviceChunk
from meshrun.offload.flat_layout import StatePattern, flat_layout
from meshrun.optim import optimizer


def clip(t: jax.Array, g_norm: jax.Array, max_norm: float) -> jax.Array:
    """optax.clip_by_global_norm's formula for one array, with the global norm computed elsewhere."""
    trigger = jnp.squeeze(g_norm < max_norm)
    return jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)


def piece_sizes(chunk: int) -> tuple[int, int]:
    """The chunk as two leaves of different lengths (`OptimizerTier.chunk_part`)."""
    return chunk // 2 + swap_file.ALIGN // 4, chunk - chunk // 2 - swap_file.ALIGN // 4


class OptimizerTier:
    """The streamed optimizer tier (nvme: files, host: host memory) of one TrainStep (`build`)."""

    def __init__(self, ts, cfg: RunConfig, chunk_tx, apply: Callable, master: bool):
        self.ts, self.master, self.file = ts, master, None  # file: the store (a SwapFile or a HostStore)
        self.kind = cfg.offload.optimizer  # nvme | host
        self.directory = directory.take_dir(cfg.offload.dir, jax.process_index()) if self.kind == "nvme" else None
        self._lay_out_state(cfg, chunk_tx)
        self._build_device_part(cfg)
        self._build_chunk_update(cfg, chunk_tx, apply)
        self._build_moves()
        self.update = UPDATES[ts.plan.offload.update_on](self)  # where the chunk update runs
        self.streamed_init = checkpoint_io.StreamedInit(self, chunk_tx)
        self.state_pieces = checkpoint_io.StatePieces(self)

    def _lay_out_state(self, cfg: RunConfig, chunk_tx) -> None:
        """The optimizer state's slots and scalars, the flat rows' layout and the chunk's two pieces."""
        ts, abstract = self.ts, self.ts.abstract_run
        self.params_def = jax.tree.structure(abstract.params)
        self.full_def = jax.tree.structure(abstract.opt_state)
        self.pattern = StatePattern.of(ts.tx, abstract.opt_state, abstract.params)
        slot_leaves, _ = self.pattern.split(jax.tree.leaves(abstract.opt_state))
        if any(x.dtype != jnp.float32 for s in slot_leaves for x in s):
            raise ConfigError("optimizer.state_dtype", cfg.optimizer.state_dtype, "use float32 with "
                              f"offload.optimizer={self.kind}", "the tier stores float32 state only")  # fmt: skip
        zero = ts.plan.zero
        self.layout = lay = flat_layout(zero.mesh, abstract.params, zero.opt, self.pattern.n_slots,
                                        cfg.offload.budget_mb * 2**20)  # fmt: skip
        self.pieces = piece_sizes(lay.chunk)
        chunk_abs = tuple(jax.ShapeDtypeStruct((n,), cfg.model.param_dtype) for n in self.pieces)  # `chunk_part`
        self.chunk_pattern = StatePattern.of(chunk_tx, jax.eval_shape(chunk_tx.init, chunk_abs), chunk_abs)
        self.chunk_def = jax.tree.structure(jax.eval_shape(chunk_tx.init, chunk_abs))
        if [k for k, _ in self.chunk_pattern.tokens] != [k for k, _ in self.pattern.tokens]:
            raise ValueError("the optimizer's elementwise part keeps another state than the whole optimizer")
        opt_sh = jax.tree.leaves(ts.state_shardings.opt_state, is_leaf=lambda x: isinstance(x, NamedSharding))
        self.slot_sh, self.scalar_sh = self.pattern.split(opt_sh)
        self.param_dtypes = [x.dtype for x in jax.tree.leaves(abstract.params)]

    def _build_device_part(self, cfg: RunConfig) -> None:
        """The step's jitted device part: loss, gradient, its norm and the flat rows the chunks read."""
        ts, lay, master = self.ts, self.layout, self.master
        pdt, sh, plan = self.param_dtypes[0], ts.state_shardings, ts.plan
        n_batch = 3 if cfg.data.pack_documents else 2

        def device_part(params, rows, *batch):  # rows: spare flat rows, donated: the new ones land in their buffers
            del rows
            loss, grads, aux = ts.loss_and_grads(params, *plan.lay_out(batch))
            if not master:  # as the in-memory step: the fp32 sums in the param dtype
                grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
            g_norm = optax.tree.norm(grads)  # the clip's norm, over the whole gradient
            metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux}
            g_flat = lay.flatten(jax.tree.leaves(grads), jnp.float32)
            p_flat = None if master else lay.flatten(jax.tree.leaves(params), pdt)  # master: the state has it
            return g_flat, p_flat, g_norm, metrics

        # The flat rows the device part emits (the gradient; without a master, the params too) take the
        # previous step's rows' buffers (`rows`, donated), as the in-memory step's outputs take its state's:
        # no fresh pages for them each step.
        self.row_dtypes = (jnp.dtype(jnp.float32),) if master else (jnp.dtype(jnp.float32), jnp.dtype(pdt))
        rows_sh = (lay.sharding,) * len(self.row_dtypes)
        self.rows_abstract = tuple(jax.ShapeDtypeStruct(lay.shape(lay.length), dt, sharding=lay.sharding)
                                   for dt in self.row_dtypes)  # fmt: skip
        self.new_rows = jax.jit(lambda: tuple(jnp.zeros(lay.shape(lay.length), dt) for dt in self.row_dtypes),
                                out_shardings=rows_sh)  # fmt: skip
        self.rows = None  # the spare rows: the last step's, or None (`new_rows`)
        self.device_part = jax.jit(
            device_part, in_shardings=(sh.params, rows_sh, *(ts.batch_sharding,) * n_batch),
            out_shardings=(lay.sharding, None if master else lay.sharding, self.rep, None), donate_argnums=1,
            keep_unused=True,
        )  # fmt: skip

    @property
    def rep(self) -> NamedSharding:
        return NamedSharding(self.layout.mesh, P())

    def _build_chunk_update(self, cfg: RunConfig, chunk_tx, apply: Callable) -> None:
        """The optimizer's elementwise update of one chunk (`update_chunk`, traced) and its jitted forms:
        the copy path's (`chunk_part`) and the in-place pass's (`_build_in_place`)."""
        lay, master, pieces, rep = self.layout, self.master, self.pieces, self.rep
        pdt, max_norm = self.param_dtypes[0], cfg.optimizer.grad_clip

        def chunk_update(g_flat, p_flat, slots, scalars, g_norm, off):  # slots: each slot's two halves
            g = self.take_chunk(g_flat, off)
            # master: the params come from the state's fp32 master; `p` only carries the param dtype
            p = jnp.zeros(g.shape, pdt) if master else self.take_chunk(p_flat, off)
            return update_chunk(g, p, slots, scalars, g_norm)

        def update_chunk(g, p, slots, scalars, g_norm):  # g, p: the chunk's rows [..., C]
            g = g if master else g.astype(p.dtype)
            g = clip(g, g_norm, max_norm) if max_norm > 0 else g  # make_optimizer: no clipping at 0
            # The chunk as a tree of two halves: the optimizer's shared scalars (bias corrections, the
            # learning rate) then feed several elementwise fusions, as in the in-memory step, and XLA
            # makes the same algebraic rewrites there (with one leaf it rewrote a division the
            # in-memory step keeps: a last-bit difference).
            state = self.chunk_pattern.join([tuple(s) for s in slots], list(scalars))
            state = jax.tree.unflatten(self.chunk_def, state)
            new_p, state = apply(chunk_tx, halves(g), state, halves(p))
            new_slots, new_scalars = self.chunk_pattern.split(jax.tree.leaves(state))
            return tuple(new_p), tuple(tuple(s) for s in new_slots), tuple(new_scalars)

        self.update_chunk = update_chunk  # also the host CPU's (`host_update.HostUpdate`)
        cuts = list(np.cumsum(pieces[:-1]))
        halves = lambda x: tuple(jnp.split(x, cuts, axis=-1))
        chunk_part = lambda g_flat, p_flat, slots, *rest: chunk_update(g_flat, p_flat, [halves(x) for x in slots],
                                                                       *rest)  # fmt: skip
        n_slots, scalar_sh = self.pattern.n_slots, tuple(self.scalar_sh)
        halves_sh = ((lay.sharding,) * len(pieces),) * n_slots
        self.chunk_part = jax.jit(  # a chunk of every slot as one array per slot (read buffers on the host)
            chunk_part,
            in_shardings=(lay.sharding, None if master else lay.sharding, (lay.sharding,) * n_slots, scalar_sh, rep,
                          rep),
            out_shardings=((lay.sharding,) * len(pieces), halves_sh, scalar_sh),
        )  # fmt: skip
        self._update_at = chunk_update  # the chunk at `off` of the flat rows (`_build_in_place`)
        self._build_in_place(halves_sh, scalar_sh)

    def _build_in_place(self, halves_sh: tuple, scalar_sh: tuple) -> None:
        """The in-place pass's jitted chunk update (`chunk_part_in_place`) and its param row."""
        lay, master, rep, chunk_update = self.layout, self.master, self.rep, self._update_at

        # The same update on the slots' halves as the device's own arrays, donated: the new state
        # lands in the old one's buffers (`DeviceChunk`, the CPU backend's in-place pass). The new
        # slots come first: jax gives each donated buffer to the first output of its shape. The new
        # params go into the chunk's place in `p_row`, donated too: without a master the param row the
        # chunk's params were read from, with one a row of the param dtype (joined first: written as
        # two pieces, XLA:CPU copied the whole row twice per chunk).
        def chunk_in_place(g_flat, p_row, slots, scalars, g_norm, off):
            new_p, new_slots, new_scalars = chunk_update(g_flat, None if master else p_row, slots, scalars, g_norm,
                                                         off)  # fmt: skip
            at = (0,) * (p_row.ndim - 1) + (off,)
            return new_slots, jax.lax.dynamic_update_slice(p_row, jnp.concatenate(new_p, axis=-1), at), new_scalars

        self.chunk_part_in_place = jax.jit(
            chunk_in_place, donate_argnums=(1, 2),
            in_shardings=(lay.sharding, lay.sharding, halves_sh, scalar_sh, rep, rep),
            out_shardings=(halves_sh, lay.sharding, scalar_sh),
        )  # fmt: skip
        pdt = self.param_dtypes[0]
        self.new_param_row = jax.jit(lambda: jnp.zeros(lay.shape(lay.length), pdt), out_shardings=lay.sharding)

    def _build_moves(self) -> None:
        """The jitted moves between the flat rows and the state's trees (the step's new params, whole-
        state reads and writes, and the layers' order between checkpoint and run)."""
        ts, lay, sh, plan = self.ts, self.layout, self.ts.state_shardings, self.ts.plan
        unflatten = lambda parts: lay.unflatten_pieces(list(parts), self.param_dtypes)
        self.assemble = jax.jit(  # the new params' pieces -> the params in their ZeRO layout, in the old ones' buffers
            lambda old, parts: jax.tree.unflatten(self.params_def, unflatten(parts)),
            in_shardings=(sh.params, lay.sharding), out_shardings=sh.params, donate_argnums=0, keep_unused=True,
        )  # fmt: skip
        f32 = [jnp.float32] * self.pattern.k
        self.unflatten_slot = [
            jax.jit(lambda f: tuple(lay.unflatten(f, f32)), in_shardings=lay.sharding, out_shardings=tuple(s))
            for s in self.slot_sh
        ]
        self.flatten_slot = jax.jit(lambda leaves: lay.flatten(leaves, jnp.float32), out_shardings=lay.sharding)
        if plan.relaid:  # the params between the checkpoint's layer order and the run's (to run, to model)
            model_p, split = ts.abstract_state.params, plan.split
            self.relay_params = tuple(
                jax.jit(lambda prm, f=f: {**prm, "layers": f(prm["layers"])}, out_shardings=out)
                for f, out in ((split.to_pipeline, sh.params), (split.from_pipeline, jax.tree.map(lambda x: x.sharding,
                                                                                                 model_p)))
            )  # fmt: skip

    def init(self, params=None):
        """The run state at step 0, its optimizer state written to the store chunk by chunk."""
        return self.streamed_init(params)

    # ------------------------------------------------------------ the step

    def take_chunk(self, flat: jax.Array, off: jax.Array) -> jax.Array:
        """The chunk at element `off` of a flat row `[*mesh, L]` (traced): its C columns of every row.
        The device's chunk update, the host CPU's (`host_update.HostUpdate.take`) and init's take it."""
        return jax.lax.dynamic_slice(flat, (0,) * (flat.ndim - 1) + (off,), (*flat.shape[:-1], self.layout.chunk))

    def lower_device_part(self, state, *batch):
        return self.device_part.lower(state.params, self.rows_abstract, *batch)

    @malloc.stepping()  # the device part's and the chunks' temporaries kept, then trimmed
    def step(self, state, *batch, device_part=None):
        rows, self.rows = self.rows or self.new_rows(), None
        g_flat, p_flat, g_norm, metrics = (device_part or self.device_part)(state.params, rows, *batch)
        del rows
        ready = lambda: jax.block_until_ready(g_flat)  # the first chunks are read while the device part runs
        new_p, p_flat, scalars = self.update.run(g_flat, p_flat, g_norm, tuple(state.opt_state), ready)
        # the old params are donated, as the in-memory step donates the state: the new ones take their buffers
        params = jax.block_until_ready(self.assemble(state.params, tuple(new_p)))
        new_p.clear()
        self.rows = (g_flat,) if self.master else (g_flat, p_flat)
        return state._replace(params=params, opt_state=scalars, step=state.step + 1), metrics

    def bytes_per_device(self) -> dict[str, float]:
        """Where the tier's bytes rest, per device (this process's share): the store (host memory or
        the NVMe file; rows replicated over devices are stored once) and the chunk buffers in host
        memory (at most `SLOTS_IN_FLIGHT` chunks)."""
        store, buffers = resting_bytes(self.layout, self.pattern.n_slots)
        return {"host": store + buffers, "nvme": 0.0} if self.directory is None else {"host": buffers, "nvme": store}

    # ------------------------------------------------------------ whole-state moves (init, checkpoints)

    def ensure_file(self) -> ChunkStore:
        if self.file is None:
            lay = self.layout
            shape = (self.pattern.n_slots, len(lay.first), lay.chunk)
            self.file = swap_file.SwapFile(self.directory, lay.n_chunks, shape) if self.directory is not None else \
                HostStore(lay.n_chunks, shape)  # fmt: skip
        return self.file

    def save_view(self, state):
        """The run state as a checkpoint takes it: the optimizer's parameter-shaped leaves as
        `StreamedArray`s read from the file while the save writes them (checkpoint_io.py)."""
        slices.install()
        p, f32 = self.state_pieces, jnp.dtype(jnp.float32)
        model_sh = jax.tree.leaves(self.ts.abstract_state.opt_state, is_leaf=lambda x: hasattr(x, "sharding"))
        slot_sh, _ = self.pattern.split([x.sharding for x in model_sh])  # model order: the checkpoint's
        slots = [[slices.StreamedArray(key, p.shapes[key], f32, sh, p) for key, sh in zip(keys, shs, strict=True)]
                 for keys, shs in zip(p.key_of, slot_sh, strict=True)]  # fmt: skip
        leaves = self.pattern.join(slots, list(state.opt_state))
        params = self.relay_params[1](state.params) if self.ts.plan.relaid else state.params
        return state._replace(params=params, opt_state=jax.tree.unflatten(self.full_def, leaves))

    def restore(self, ckpt, step: int):
        """Checkpoint `step` into the tier: params and scalars into memory, the rest into the file."""
        ts = self.ts
        state = ckpt.restore(step, ts.abstract_state, streamed=self.state_pieces)
        _, scalars = self.pattern.split(jax.tree.leaves(state.opt_state))
        params = self.relay_params[0](state.params) if ts.plan.relaid else state.params
        malloc.trim_freed()  # what the restore freed
        return state._replace(params=params, opt_state=tuple(scalars))

    def absorb(self, state):
        """A whole in-memory run state -> the tier's: its optimizer state written to the file."""
        lay = self.layout
        slots, scalars = self.pattern.split(jax.tree.leaves(state.opt_state))
        rows = [lay.rows(self.flatten_slot(s)) for s in slots]  # [slot][distinct row] host copies
        self.ensure_file()
        c = lay.chunk
        self.file.write_all(lambda i: [r[i * c : (i + 1) * c] for s in rows for r in s])
        return state._replace(opt_state=tuple(scalars))

    def whole(self, state):
        """The tier's run state -> the whole in-memory run state (its optimizer state read back)."""
        lay, c = self.layout, self.layout.chunk
        host = np.empty((self.pattern.n_slots, len(lay.first), lay.length), np.float32)

        def keep(i: int, buf: np.ndarray) -> None:
            host[:, :, i * c : (i + 1) * c] = buf

        self.file.read_all(keep)
        slots = [list(self.unflatten_slot[s](lay.put(host[s], lay.length))) for s in range(len(host))]
        leaves = self.pattern.join(slots, list(state.opt_state))
        return state._replace(opt_state=jax.tree.unflatten(self.full_def, leaves))


class InPlaceUpdate:
    """offload.update_on=in_place (auto on CPU devices): the chunk buffers are the device's own arrays
    (`DeviceChunk`), read and written by the store in place; the new params land in one flat row."""

    def __init__(self, tier: OptimizerTier):
        self.tier = tier

    def run(self, g_flat, p_flat, g_norm, scalars: tuple, ready) -> tuple[list, object, tuple]:
        """One step's pass: (the new params' pieces, the param row after the pass, the new scalars)."""
        tier, lay = self.tier, self.tier.layout
        # the ring stays from step to step (the store drops it when it needs buffers)
        ring = tier.file.keep_ring(lambda: [DeviceChunk(lay, tier.pieces, tier.pattern.n_slots)
                                            for _ in range(SLOTS_IN_FLIGHT)])  # fmt: skip
        # the new params' row (`chunk_in_place`): without a master the param row itself
        box = {"row": tier.new_param_row() if tier.master else p_flat, "scalars": None}

        def update(i: int, item: DeviceChunk):
            item.spread()
            off = jnp.int32(i * lay.chunk)
            item.slots, box["row"], box["scalars"] = tier.chunk_part_in_place(g_flat, box["row"], item.slots,
                                                                              scalars, g_norm, off)  # fmt: skip
            return item

        try:
            tier.file.stream(update, DeviceChunk.written, ready=ready, ring=ring)
        except BaseException:  # its buffers may be donated and gone
            tier.file.drop_ring()
            raise
        del ring
        new_p = [box.pop("row")]  # the whole row: one piece
        return new_p, None if tier.master else new_p[0], box["scalars"]  # (the device part's row, updated in place)


class CopyUpdate:
    """offload.update_on=device (auto on other devices): each chunk read into the store's buffers is
    copied to the device, updated there, and its new state copied back."""

    def __init__(self, tier: OptimizerTier):
        self.tier = tier

    def run(self, g_flat, p_flat, g_norm, scalars: tuple, ready) -> tuple[list, object, tuple]:
        tier, lay = self.tier, self.tier.layout
        box, new_p = {"scalars": None}, []

        def update(i: int, buf: np.ndarray):
            slots = tuple(lay.put(buf[s], lay.chunk) for s in range(buf.shape[0]))
            off = jnp.int32(i * lay.chunk)
            p, new_slots, box["scalars"] = tier.chunk_part(g_flat, p_flat, slots, scalars, g_norm, off)
            new_p.extend(p)
            return new_slots

        fetch = lambda new_slots: [h for s in new_slots for r in zip(*map(lay.rows, s)) for h in r]
        tier.file.stream(update, fetch, ready=ready, done=jax.block_until_ready)
        return new_p, p_flat, box["scalars"]


class HostCPUUpdate:
    """offload.update_on=host: the chunk update on jax's CPU backend (`host_update.HostUpdate`)."""

    def __init__(self, tier: OptimizerTier):
        self.host = host_update.HostUpdate(tier, tier.scalar_sh)

    def run(self, g_flat, p_flat, g_norm, scalars: tuple, ready) -> tuple[list, object, tuple]:
        new_p, new_scalars = self.host.run(g_flat, p_flat, g_norm, scalars, ready)
        return new_p, p_flat, new_scalars


UPDATES = {"in_place": InPlaceUpdate, "device": CopyUpdate, "host": HostCPUUpdate}  # offload.update_on


def build(ts, cfg: RunConfig) -> OptimizerTier:
    """The streamed optimizer tier (nvme or host) of the TrainStep `ts` (built in memory)."""
    master = jnp.dtype(cfg.model.param_dtype).itemsize < 4  # as make_optimizer decides
    elem = optimizer.elementwise_transform(cfg)  # a ConfigError for an optimizer that is not elementwise
    chunk_tx = optimizer.with_master_weights(elem) if master else elem
    return OptimizerTier(ts, cfg, chunk_tx, optimizer.apply_optimizer, master)
