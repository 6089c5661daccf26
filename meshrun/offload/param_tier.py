"""offload.params with offload.optimizer=nvme: the parameters and their gradient sums rest in
pinned host memory, the stacked layers' optimizer state in an NVMe file, and the update streams the
layers through the device a chunk of layers at a time (ZeRO-Infinity's full offload; docs/offload.md).

On the device, one jitted function: forward and backward with the layers fetched one at a time
(`parallel/layer_fetch.py`), the global gradient norm and the update of the other entries (embedding,
head, final norm). Then chunk by chunk (`per` layers of every device's shard, or a piece of one
layer) the chunk's state is read from the file while the previous one is written; the optimizer runs
on it as the in-memory layer scan does (`layer_update.Update.layers`) and the new params go back
into the host-resident params in place. The file row is layer-major (`layer_layout.LayerLayout`);
checkpoints stream it as the optimizer tier's do (`checkpoint_io.StatePieces`), in the same format.
`build(ts, cfg)` makes the tier; `tier.with_tier` uses it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshrun.checkpoint import slices
from meshrun.checkpoint.state import path_key
from meshrun.config import RunConfig
from meshrun.errors import ConfigError
from meshrun.offload import checkpoint_io, directory, layer_update, malloc, swap_file
from meshrun.offload.chunk_store import resting_bytes
from meshrun.offload.grad_file import GradSink
from meshrun.offload.layer_layout import layer_layout
from meshrun.offload.layer_update import LAYER, SCALAR
from meshrun.optim.optimizer import MasterState
from meshrun.parallel.layer_fetch import rest_like, to_device, use_grad_sink
from meshrun.parallel.sharding import is_spec
from meshrun.parallel.zero import without_layers


class ParamTier:
    """The NVMe tier of a TrainStep with offload.params (`build`)."""

    def __init__(self, ts, cfg: RunConfig):
        self.ts, self.file, self.sink = ts, None, None
        self.grads_nvme = cfg.offload.grads == "nvme"  # the layers' gradient rests in the file (grad_file.py)
        self.directory = directory.take_dir(cfg.offload.dir, jax.process_index())
        self._lay_out_state(cfg)
        self._build_device_part(cfg)
        self._build_layer_chunk()
        self._build_moves()

    def _lay_out_state(self, cfg: RunConfig) -> None:
        """The optimizer's layer slots and kept leaves, and the file row's layout of the layers."""
        ts, zl = self.ts, self.ts.plan.zero
        abstract, sh = ts.abstract_run, ts.state_shardings
        tx = layer_update.no_clip_optimizer(cfg, ts.plan.model_fns.param_names)
        cast = not isinstance(abstract.opt_state, MasterState)  # as the step without the tier
        self.up = up = layer_update.Update.of(tx, abstract.opt_state, abstract.params, cfg.optimizer.grad_clip, cast)
        slots_abs, _ = up.split(abstract.opt_state)
        if any(x.dtype != jnp.float32 for x in slots_abs):
            raise ConfigError("optimizer.state_dtype", cfg.optimizer.state_dtype, "use float32 with "
                              "offload.optimizer=nvme", "the NVMe tier stores float32 state only")  # fmt: skip
        self.k = k = len(jax.tree.leaves(abstract.params["layers"]))
        self.n_slots, self.cast = len(slots_abs) // k, cast
        self.layout = layer_layout(zl.mesh, abstract.params["layers"], zl.opt["layers"],
                                   self.n_slots + self.grads_nvme, cfg.offload.budget_mb * 2**20)  # fmt: skip
        opt_sh = jax.tree.leaves(sh.opt_state, is_leaf=lambda x: isinstance(x, NamedSharding))
        self.slot_sh, self.kept_sh = up.split(opt_sh)
        self.kept_def = [kd for kd in up.kinds if kd != LAYER]
        specs = lambda tree: tuple(jax.tree.leaves(tree, is_leaf=is_spec))
        self.store_sp, self.grads_sp = specs(zl.store["layers"]), specs(zl.grads["layers"])
        self.opt_sp = specs(zl.opt["layers"])
        if self.grads_nvme and not self.store_sp == self.grads_sp == self.opt_sp:  # the gradient's rows: the state's
            raise ValueError("offload.grads=nvme: the layers' gradient and state layouts differ")
        self.layers_def = jax.tree.structure(abstract.params["layers"])

    def _build_device_part(self, cfg: RunConfig) -> None:
        """The step's jitted device part: loss, gradient, its norm and the other entries' update."""
        ts, up, cast, zl = self.ts, self.up, self.cast, self.ts.plan.zero
        sh, lay = ts.state_shardings, self.layout

        def device_part(params, kept, *batch):
            loss, grads, aux = ts.loss_and_grads(params, *ts.plan.lay_out(batch))
            if self.grads_nvme:  # the gradient went to the file; its squared sums came back
                g_norm, g_layers = layer_update.sink_norm(grads, params, cast), ()
            else:
                g_norm, g_layers = layer_update.global_norm(grads, params, cast, zl), grads["layers"]
            new_other, new_kept = up.others(grads, params, kept, g_norm)
            return g_layers, new_other, tuple(new_kept), g_norm, {"loss": loss, "grad_norm": g_norm, **aux}

        n_batch = 3 if cfg.data.pack_documents else 2
        other_sh = without_layers(sh.params)
        self.device_part = jax.jit(
            device_part, in_shardings=(sh.params, tuple(self.kept_sh), *(ts.batch_sharding,) * n_batch),
            out_shardings=(() if self.grads_nvme else sh.params["layers"], other_sh, tuple(self.kept_sh),
                           NamedSharding(lay.mesh, P()), None),
        )  # fmt: skip

    def _cut(self, x, l0, k):
        """A local shard's `per` layers from l0, or piece k of layer l0."""
        lay = self.layout
        x = jax.lax.dynamic_slice_in_dim(x, l0, lay.per, 0)
        q = lay.split
        return x if q == 1 else jax.lax.dynamic_slice_in_dim(x, k * (x.shape[1] // q), x.shape[1] // q, 1)

    def _put(self, o, x, l0, k):
        """The inverse of `_cut`: x written into the local shard o."""
        q, zero = self.layout.split, jnp.zeros((), jnp.int32)
        start = (l0, zero if q == 1 else k * (o.shape[1] // q), *(zero,) * (o.ndim - 2))
        return jax.lax.dynamic_update_slice(o, x, start)

    def _to_rows(self, leaves: list) -> tuple:
        """The local slices of every slot's layer leaves (slot-major) as the file's rows, one per slot."""
        lay, k, ndim = self.layout, self.k, len(self.layout.mesh.axis_names)
        return tuple(lay.to_rows(list(leaves[i * k : (i + 1) * k]), lay.per).reshape((1,) * ndim + (-1,))
                     for i in range(self.n_slots))  # fmt: skip

    def _build_layer_chunk(self) -> None:
        """The jitted update of one chunk of layers (`layer_chunk`): its params and gradient from host
        memory (or the file), its state from the file's rows, the new params back in place."""
        lay, up, abstract, sh = self.layout, self.up, self.ts.abstract_run, self.ts.state_shardings
        rep = NamedSharding(lay.mesh, P())

        def layer_chunk(p_layers, g_layers, slots, scalars, g_norm, l0, k_):
            p = self._take(jax.tree.leaves(p_layers), self.store_sp, l0, k_)
            g, state = self._chunk_grad_and_state(g_layers, slots, l0, k_)
            like = without_layers(abstract.params)
            like_g = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), like)
            layers = lambda leaves: jax.tree.unflatten(self.layers_def, leaves)
            new_p, new_slots = up.layers(layers(g), layers(p), list(state), scalars, like, like_g, g_norm)
            return self._chunk_back(p_layers, new_p, new_slots, l0, k_)

        scalar_sh = tuple(s for s, kd in zip(self.kept_sh, self.kept_def, strict=True) if kd == SCALAR)
        g_sh = () if self.grads_nvme else sh.params["layers"]
        self.layer_chunk = jax.jit(
            layer_chunk, in_shardings=(sh.params["layers"], g_sh, (lay.sharding,) * (self.n_slots + self.grads_nvme),
                                       scalar_sh, rep, rep, rep),
            out_shardings=(sh.params["layers"], (lay.sharding,) * self.n_slots), donate_argnums=(0,),
        )  # fmt: skip

    def _take(self, leaves, spec, l0, k):
        """One chunk's slices (`_cut`) of the local shards of `leaves` (laid out by `spec`), on the device."""
        body = lambda *xs: tuple(to_device(self._cut(x, l0, k)) for x in xs)
        return jax.shard_map(body, mesh=self.layout.mesh, in_specs=spec, out_specs=spec, check_vma=False)(*leaves)

    def _chunk_grad_and_state(self, g_layers, slots, l0, k_) -> tuple[tuple, tuple]:
        """(the chunk's gradient leaves, its state's layer leaves slot-major) inside `layer_chunk`: the
        state from the file's rows `slots`, the gradient from host memory (`g_layers`) or, with
        offload.grads=nvme, from the rows' last slot, read with the state."""
        lay, axes = self.layout, P(*self.layout.mesh.axis_names)
        rows = lambda *s: tuple(x for f in s for x in lay.from_rows(f.reshape(-1), lay.per))
        if self.grads_nvme:  # the chunk's last slot: its gradient, read with its state
            g = jax.shard_map(rows, mesh=lay.mesh, in_specs=(axes,), out_specs=self.grads_sp,
                              check_vma=False)(slots[-1])  # fmt: skip
            slots = slots[:-1]
        else:
            g = self._take(jax.tree.leaves(g_layers), self.grads_sp, l0, k_)
        state = jax.shard_map(rows, mesh=lay.mesh, in_specs=(axes,) * len(slots),
                              out_specs=self.opt_sp * self.n_slots, check_vma=False)(*slots)  # fmt: skip
        return g, state

    def _chunk_back(self, p_layers, new_p, new_slots, l0, k_) -> tuple:
        """The end of `layer_chunk`: (the resting params `p_layers` with the chunk's new params `new_p`
        written in place, back to host memory where they rest there; the new state as the file's rows)."""
        lay, k, store, axes = self.layout, self.k, self.store_sp, P(*self.layout.mesh.axis_names)

        def back(*xs):  # the new params into the resting ones, in place; the new state as rows
            old, new, st = xs[:k], xs[k : 2 * k], xs[2 * k :]
            out = tuple(self._put(o, rest_like(x.astype(o.dtype), o), l0, k_)
                        for o, x in zip(old, new, strict=True))  # fmt: skip
            return out, self._to_rows(st)

        out, new_rows = jax.shard_map(back, mesh=lay.mesh, in_specs=(*store, *store, *self.opt_sp * self.n_slots),
                                      out_specs=(store, (axes,) * self.n_slots), check_vma=False)(
            *jax.tree.leaves(p_layers), *jax.tree.leaves(new_p), *new_slots)  # fmt: skip
        return jax.tree.unflatten(self.layers_def, list(out)), new_rows

    def _build_moves(self) -> None:
        """The jitted whole-state moves (a chunk's state as the file's rows; a slot's rows as leaves) and
        the checkpoint's view of the file (`checkpoint_io.StatePieces`)."""
        lay, k, axes = self.layout, self.k, P(*self.layout.mesh.axis_names)

        def chunk_rows(slot_leaves, l0, k_):  # one chunk's state as the file's rows (init, absorb)
            body = lambda *xs: self._to_rows([to_device(self._cut(x, l0, k_)) for x in xs])
            return jax.shard_map(body, mesh=lay.mesh, in_specs=self.opt_sp * self.n_slots,
                                 out_specs=(axes,) * self.n_slots, check_vma=False)(*slot_leaves)  # fmt: skip

        self.chunk_rows = jax.jit(chunk_rows, out_shardings=(lay.sharding,) * self.n_slots)
        f32 = [jnp.float32] * k
        self.unflatten_slot = jax.jit(lambda f: tuple(lay.unflatten(f, f32)), in_shardings=lay.sharding)
        saved = self.ts.abstract_state
        paths = [path_key(p) for p, _ in jax.tree_util.tree_flatten_with_path(saved)[0]]  # params, opt, step
        n_p = len(jax.tree.leaves(saved.params))
        keys, _ = self.up.split(paths[n_p : n_p + len(jax.tree.leaves(saved.opt_state))])  # checkpoint keys
        key_of = [keys[i * k : (i + 1) * k] for i in range(self.n_slots)]
        self.state_pieces = checkpoint_io.StatePieces(self, key_of, only="layers")

    def init(self, params=None):
        """The run state at step 0 (the in-memory init), the layers' optimizer state written to the file."""
        return self.absorb(self.ts.init() if params is None else self.ts.init_from(params))

    # ------------------------------------------------------------ the step

    def kept(self, opt_state) -> tuple:
        """The non-LAYER optimizer leaves (the tier's run state keeps only those) of either form, told
        apart by their tree structure: the whole optimizer state's, or a tuple of the kept leaves."""
        got = jax.tree.structure(opt_state)
        if got == self.up.treedef:
            return tuple(self.up.split(opt_state)[1])
        if got != jax.tree.structure((0,) * len(self.kept_def)):
            raise ValueError(f"an optimizer state of neither the whole state's nor the tier's structure: {got}")
        return opt_state

    def bytes_per_device(self) -> dict[str, float]:
        """Where the tier's bytes rest, per device (this process's share): the layers' state (and with
        offload.grads=nvme their gradient) in the file (rows replicated over devices stored
        once) and the chunk buffers in host memory."""
        store, buffers = resting_bytes(self.layout, self.n_slots + self.grads_nvme)
        return {"host": buffers, "nvme": store}

    def lower_device_part(self, state, *batch):
        self.ensure_file()
        with use_grad_sink(self.sink):
            return self.device_part.lower(state.params, self.kept(state.opt_state), *batch)

    @malloc.stepping()  # the device part's and the chunks' temporaries kept, then trimmed
    def step(self, state, *batch, device_part=None):
        lay = self.layout
        kept = self.kept(state.opt_state)
        scalars = tuple(x for x, kd in zip(kept, self.kept_def, strict=True) if kd == SCALAR)
        self.ensure_file()
        with use_grad_sink(self.sink):
            g_layers, new_other, new_kept, g_norm, metrics = (device_part or self.device_part)(state.params, kept,
                                                                                               *batch)  # fmt: skip
        if self.sink is not None:  # every layer's gradient in the file before the first chunk is read
            jax.block_until_ready(g_norm)
            self.sink.check()
        box = {"p": state.params["layers"]}

        def update(i: int, buf: np.ndarray):
            slots = tuple(lay.put(buf[s], lay.chunk) for s in range(buf.shape[0]))
            l0, piece = lay.where(i)
            box["p"], new_rows = self.layer_chunk(box["p"], g_layers, slots, scalars, g_norm, jnp.int32(l0),
                                                  jnp.int32(piece))  # fmt: skip
            return new_rows

        fetch = lambda new_rows: [r for s in new_rows for r in lay.rows(s)]
        self.file.stream(update, fetch, ready=lambda: jax.block_until_ready(g_layers))
        params = {**new_other, "layers": box["p"]}
        return state._replace(params=params, opt_state=new_kept, step=state.step + 1), metrics

    # ------------------------------------------------------------ whole-state moves (init, checkpoints)

    def ensure_file(self) -> swap_file.SwapFile:
        if self.file is None:
            lay = self.layout
            slots = self.n_slots + self.grads_nvme  # the gradient's slot last: read, never written by the stream
            shape = (slots, len(lay.first), lay.chunk)
            self.file = swap_file.SwapFile(self.directory, lay.n_chunks, shape, self.n_slots)
            self.sink = GradSink(self.file, lay, self.n_slots, self.cast) if self.grads_nvme else None
        return self.file

    def absorb(self, state):
        """A whole in-memory run state -> the tier's: the layers' optimizer state written to the file one
        chunk at a time (the whole state is in memory once, as the in-memory init makes it)."""
        lay, f = self.layout, self.ensure_file()
        slots, kept = self.up.split(state.opt_state)
        for i in range(lay.n_chunks):
            with f.held():
                rows = self.chunk_rows(slots, *(jnp.int32(x) for x in lay.where(i)))
                f.write(i, [r for s in rows for r in lay.rows(s)])
            del rows
        return state._replace(opt_state=tuple(kept))

    def whole(self, state):
        """The tier's run state -> the whole in-memory run state (the layers' state read back)."""
        lay, c = self.layout, self.layout.chunk
        host = np.empty((self.n_slots, len(lay.first), lay.length), np.float32)

        def keep(i: int, buf: np.ndarray) -> None:
            host[:, :, i * c : (i + 1) * c] = buf[: self.n_slots]

        self.file.read_all(keep)
        move = lambda x, s: jax.device_put(x, s)
        layer_leaves = []
        for s in range(self.n_slots):
            got = self.unflatten_slot(lay.put(host[s], lay.length))
            layer_leaves += [move(x, sh) for x, sh in zip(got, self.slot_sh[s * len(got) : (s + 1) * len(got)],
                                                          strict=True)]  # fmt: skip
        return state._replace(opt_state=self.up.join(layer_leaves, list(self.kept(state.opt_state))))

    def save_view(self, state):
        """The run state as a checkpoint takes it: the layers' optimizer leaves as `StreamedArray`s read
        from the file while the save writes them (checkpoint_io.py)."""
        ts = self.ts
        if ts.plan.relaid:
            return ts.to_model(self.whole(state))
        slices.install()
        p, f32 = self.state_pieces, jnp.dtype(jnp.float32)
        k = len(p.key_of[0])
        streamed_leaves = [slices.StreamedArray(key, p.shapes[key], f32, self.slot_sh[s * k + j], p)
                           for s, keys in enumerate(p.key_of) for j, key in enumerate(keys)]  # fmt: skip
        return state._replace(opt_state=self.up.join(streamed_leaves, list(self.kept(state.opt_state))))

    def restore(self, ckpt, step: int):
        """Checkpoint `step` into the tier: params and the other leaves into memory, the layers' optimizer
        state into the file."""
        ts = self.ts
        if ts.plan.relaid:
            return self.absorb(ts.to_run(ckpt.restore(step, ts.abstract_state)))
        self.ensure_file()
        on_device = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding.with_memory_kind("device"))
        target = ts.abstract_state._replace(params=jax.tree.map(on_device, ts.abstract_state.params))
        state = ckpt.restore(step, target, streamed=self.state_pieces)
        params = jax.device_put(state.params, ts.state_shardings.params)
        _, kept = self.up.split(state.opt_state)
        return state._replace(params=params, opt_state=tuple(kept))


def build(ts, cfg: RunConfig) -> ParamTier:
    """The layer tier of the TrainStep `ts` (built in memory, offload.params)."""
    return ParamTier(ts, cfg)
