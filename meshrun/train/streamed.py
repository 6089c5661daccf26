"""offload.optimizer=nvme (and host, unless offload.update=whole): the optimizer state
rests in files (or host memory) and the update streams through the device in chunks (ZeRO-Infinity,
Rajbhandari et al. 2021; docs/offload.md). Both tiers run the same code; only the store differs
(`swap.SwapFile`, `chunk_store.HostStore`), so the device never holds more than a few chunks of the state.

The step runs in two parts. On the device, one jitted function: forward, backward, the one gradient
reduction, the global gradient norm (once over the whole gradient, as the in-memory step computes
it), and a flat view of the gradient and params: every device's ZeRO shard of every leaf
concatenated into one row, `[*mesh, L]` (`flat_layout.FlatLayout`). Then, chunk by chunk (C elements of every
row: a sub-group of each rank's shard of every optimizer leaf), the chunk's state (fp32 master,
Adam m, v) is read from the store (the file or host memory), copied to the device (on the CPU
backend read straight into the device's own buffers, `DeviceChunk`) and updated there by the
optimizer's elementwise part, clipped with the global norm by optax's formula; the new params stay
on the device (in place: written into the flat param row; laid into the old params' buffers after the
last chunk) and the new state goes back to the file, while the next chunk is read and the previous
one written. The flat rows, the params and the in-place ring reuse their buffers from step to step
(donated, as the in-memory step's outputs reuse its state's), so a step maps no fresh pages for them.
The update runs on the device: the same XLA backend evaluates the same elementwise formulas as the
in-memory step (a host CPU's pow or division may differ from a GPU's in the last bit), at the
device's memory bandwidth.
Init, checkpoint saves and restores move the state between the file and its home (the optimizer's
init, an orbax checkpoint in the in-memory tiers' format) one chunk at a time (`tier_io.py`), so a
run resumes across tiers; `to_model` / `to_run` still give or take the whole state (tests, the
local checkpoint tier).
"""

from __future__ import annotations

import dataclasses
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
from meshrun.optim import optimizer
from meshrun.train import host_update, swap, swap_dir, tier_io
from meshrun.train.chunk_store import SLOTS_IN_FLIGHT, ChunkStore, HostStore, resting_bytes
from meshrun.train.device_chunk import DeviceChunk
from meshrun.train.flat_layout import StatePattern, flat_layout


def clip(t: jax.Array, g_norm: jax.Array, max_norm: float) -> jax.Array:
    """optax.clip_by_global_norm's formula for one array, with the global norm computed elsewhere."""
    trigger = jnp.squeeze(g_norm < max_norm)
    return jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)


def piece_sizes(chunk: int) -> tuple[int, int]:
    """The chunk as two leaves of different lengths (`Tier.chunk_part`)."""
    return chunk // 2 + swap.ALIGN // 4, chunk - chunk // 2 - swap.ALIGN // 4


class Tier:
    """The streamed optimizer tier (nvme: files, host: host memory) of one TrainStep (`make_streamed`)."""

    def __init__(self, ts, cfg: RunConfig, chunk_tx, apply: Callable, master: bool):
        t, plan, tx, max_norm = cfg.offload, ts.plan, ts.tx, cfg.optimizer.grad_clip
        self.ts, self.master, self.file = ts, master, None  # file: the store (a SwapFile or a HostStore)
        self.kind = t.optimizer  # nvme | host
        self.directory = None
        if self.kind == "nvme":
            self.directory = swap_dir.take_dir(t.dir, jax.process_index())
        abstract = ts.abstract_run
        self.params_def = jax.tree.structure(abstract.params)
        self.full_def = jax.tree.structure(abstract.opt_state)
        self.pattern = StatePattern.of(tx, abstract.opt_state, abstract.params)
        slot_leaves, _ = self.pattern.split(jax.tree.leaves(abstract.opt_state))
        if any(x.dtype != jnp.float32 for s in slot_leaves for x in s):
            raise ConfigError("optimizer.state_dtype", cfg.optimizer.state_dtype, "use float32 with "
                              f"offload.optimizer={self.kind}", "the tier stores float32 state only")  # fmt: skip
        self.layout = lay = flat_layout(plan.zero.mesh, abstract.params, plan.zero.opt, self.pattern.n_slots,
                                        t.budget_mb * 2**20)  # fmt: skip
        self.pieces = pieces = piece_sizes(lay.chunk)
        chunk_abs = tuple(jax.ShapeDtypeStruct((n,), cfg.model.param_dtype) for n in pieces)  # see `chunk_part`
        self.chunk_pattern = StatePattern.of(chunk_tx, jax.eval_shape(chunk_tx.init, chunk_abs), chunk_abs)
        self.chunk_def = jax.tree.structure(jax.eval_shape(chunk_tx.init, chunk_abs))
        if [k for k, _ in self.chunk_pattern.tokens] != [k for k, _ in self.pattern.tokens]:
            raise ValueError("the optimizer's elementwise part keeps another state than the whole optimizer")
        sh = ts.state_shardings
        opt_sh = jax.tree.leaves(sh.opt_state, is_leaf=lambda x: isinstance(x, NamedSharding))
        self.slot_sh, self.scalar_sh = self.pattern.split(opt_sh)
        self.param_dtypes = [x.dtype for x in jax.tree.leaves(abstract.params)]
        pdt = self.param_dtypes[0]
        n_batch = 3 if cfg.data.pack_documents else 2
        rep = NamedSharding(lay.mesh, P())

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
            out_shardings=(lay.sharding, None if master else lay.sharding, rep, None), donate_argnums=1,
            keep_unused=True,
        )  # fmt: skip

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
            # makes the same algebraic rewrites there (measured: with one leaf it turned mu / bc into
            # mu * (1 / bc) where the in-memory step keeps the division: a last-bit difference).
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

        # The same update on the slots' halves as the device's own arrays, donated: the new state
        # lands in the old one's buffers (`DeviceChunk`, the CPU backend's in-place pass). The new
        # slots come first: jax gives each donated buffer to the first output of its shape. The new
        # params go into the chunk's place in `p_row`, donated too: without a master the param row the
        # chunk's params were read from, with one a row of the param dtype. (The copy path's chunk
        # update returns them as its own outputs instead: written into the row as two pieces, one per
        # half, XLA:CPU copied the whole row twice per chunk; joined first, it writes in place.)
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
        self.new_param_row = jax.jit(lambda: jnp.zeros(lay.shape(lay.length), pdt), out_shardings=lay.sharding)
        self.on = update_on(t.update_on, lay.local)  # in_place | device | host
        self.in_place = self.on == "in_place"
        self.host = host_update.HostUpdate(self, self.scalar_sh) if self.on == "host" else None
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
        self.init = tier_io.StreamedInit(self, chunk_tx)
        self.state_pieces = tier_io.StatePieces(self)

    # ------------------------------------------------------------ the step

    def take_chunk(self, flat: jax.Array, off: jax.Array) -> jax.Array:
        """The chunk at element `off` of a flat row `[*mesh, L]` (traced): its C columns of every row.
        The device's chunk update, the host CPU's (`host_update.HostUpdate.take`) and init's take it."""
        return jax.lax.dynamic_slice(flat, (0,) * (flat.ndim - 1) + (off,), (*flat.shape[:-1], self.layout.chunk))

    def lower_device_part(self, state, *batch):
        return self.device_part.lower(state.params, self.rows_abstract, *batch)

    @swap_dir.stepping()  # the device part's and the chunks' temporaries kept, then trimmed
    def step(self, state, *batch, device_part=None):
        lay = self.layout
        rows, self.rows = self.rows or self.new_rows(), None
        g_flat, p_flat, g_norm, metrics = (device_part or self.device_part)(state.params, rows, *batch)
        del rows
        scalars, box, new_p = tuple(state.opt_state), {"scalars": None}, []
        ready = lambda: jax.block_until_ready(g_flat)  # the first chunks are read while the device part runs

        if self.host is not None:  # on jax's CPU backend (host_update.py)
            new_p, box["scalars"] = self.host.run(g_flat, p_flat, g_norm, scalars, ready)
        elif self.in_place:  # the ring stays from step to step (the store drops it when it needs buffers)
            ring = self.file.keep_ring(lambda: [DeviceChunk(lay, self.pieces, self.pattern.n_slots)
                                                for _ in range(SLOTS_IN_FLIGHT)])  # fmt: skip
            # the new params' row (`chunk_in_place`): without a master the param row itself
            box["row"] = self.new_param_row() if self.master else p_flat

            def update(i: int, item: DeviceChunk):
                item.spread()
                off = jnp.int32(i * lay.chunk)
                item.slots, box["row"], box["scalars"] = self.chunk_part_in_place(g_flat, box["row"], item.slots,
                                                                                  scalars, g_norm, off)  # fmt: skip
                return item

            try:
                self.file.stream(update, DeviceChunk.written, ready=ready, ring=ring)
            except BaseException:  # its buffers may be donated and gone
                self.file.drop_ring()
                raise
            del ring
            new_p.append(box.pop("row"))  # the whole row: one piece
            p_flat = None if self.master else new_p[0]  # (the device part's row, updated in place)
        else:

            def update(i: int, buf: np.ndarray):
                slots = tuple(lay.put(buf[s], lay.chunk) for s in range(buf.shape[0]))
                off = jnp.int32(i * lay.chunk)
                p, new_slots, box["scalars"] = self.chunk_part(g_flat, p_flat, slots, scalars, g_norm, off)
                new_p.extend(p)
                return new_slots

            fetch = lambda new_slots: [h for s in new_slots for r in zip(*map(lay.rows, s)) for h in r]
            self.file.stream(update, fetch, ready=ready, done=jax.block_until_ready)
        # the old params are donated, as the in-memory step donates the state: the new ones take their buffers
        params = jax.block_until_ready(self.assemble(state.params, tuple(new_p)))
        new_p.clear()
        self.rows = (g_flat,) if self.master else (g_flat, p_flat)
        return state._replace(params=params, opt_state=box["scalars"], step=state.step + 1), metrics

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
            self.file = swap.SwapFile(self.directory, lay.n_chunks, shape) if self.directory is not None else \
                HostStore(lay.n_chunks, shape)  # fmt: skip
        return self.file

    def save_view(self, state):
        """The run state as a checkpoint takes it: the optimizer's parameter-shaped leaves as
        `StreamedArray`s read from the file while the save writes them (tier_io.py)."""
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
        swap_dir.trim_freed()  # what the restore freed
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


class _Stepper:
    """The step a loop calls: `(state, *batch) -> (state, metrics)`; `lower(...).compile()` compiles
    the device part ahead of time (the loop's step-1 timing), as for a jitted step."""

    def __init__(self, tier: Tier, device_part=None):
        self.tier, self.device_part = tier, device_part

    def __call__(self, state, *batch):
        return self.tier.step(state, *batch, device_part=self.device_part)

    def lower(self, state, *batch):
        return _Lowered(self.tier, self.tier.lower_device_part(state, *batch))


class _Lowered:
    """The device part's lowering; `compile` gives a step that runs its executable (other attributes:
    the lowering's, e.g. `as_text`)."""

    def __init__(self, tier: Tier, lowered):
        self.tier, self.lowered = tier, lowered

    def compile(self, **kwargs):
        return _Compiled(self.tier, self.lowered.compile(**kwargs))

    def __getattr__(self, name: str):
        return getattr(self.lowered, name)


class _Compiled(_Stepper):
    """A step over the compiled device part; `memory_analysis`, `as_text`, ...: the device part's."""

    def __init__(self, tier: Tier, compiled):
        super().__init__(tier, compiled)

    def __getattr__(self, name: str):
        return getattr(self.device_part, name)


def update_on(asked: str, devices) -> str:
    """Where the chunk update runs (`offload.update_on`): in_place (auto on CPU devices: the
    device's memory is host memory, so the ring buffers are the device's arrays), device (the copy
    path: auto on other devices) or host (jax's CPU backend, `host_update.py`)."""
    if asked == "auto":
        return "in_place" if all(d.platform == "cpu" for d in devices) else "device"
    return asked


def make_streamed(ts, cfg: RunConfig):
    """The TrainStep `ts` (built in memory) with its optimizer state in the streamed tier (nvme or host)."""
    master = jnp.dtype(cfg.model.param_dtype).itemsize < 4  # as make_optimizer decides
    elem = optimizer.elementwise_transform(cfg)  # a ConfigError for an optimizer that is not elementwise
    chunk_tx = optimizer.with_master_weights(elem) if master else elem
    tier = Tier(ts, cfg, chunk_tx, optimizer.apply_optimizer, master)
    return dataclasses.replace(
        ts,
        step=_Stepper(tier),
        init=lambda: tier.init(),
        init_from=lambda prm: tier.init(prm),
        to_run=lambda st: tier.absorb(ts.to_run(st)),
        to_model=lambda st: ts.to_model(tier.whole(st)),
        to_save=tier.save_view,
        restore=tier.restore,
        tier=tier,
    )
