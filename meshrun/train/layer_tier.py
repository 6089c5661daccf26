"""offload.params with offload.optimizer=nvme: the parameters and their gradient sums rest
in pinned host memory, the stacked layers' optimizer state in the NVMe tier's file, and the update
streams the layers through the device a chunk of layers at a time (ZeRO-Infinity's full offload,
Rajbhandari et al. 2021; docs/offload.md).

The step runs in two parts. On the device, one jitted function: forward and backward with the
layers fetched one at a time (`layer_fetch.py`), the global gradient norm (`layer_update.global_norm`)
and the update of the other entries (embedding, head, final norm), whose optimizer state stays where
`offload_optimizer=none` keeps it. Then, chunk by chunk (`per` consecutive layers of every device's
shard, or one piece of a layer when one layer's state does not fit the budget), the chunk's
optimizer state is read from the file while the previous chunk's is written (`chunk_store.ChunkStore.stream`);
the chunk's gradient and params come from host memory and the optimizer runs on them exactly as the
in-memory layer scan runs it on one layer (`layer_update.Update.layers`); the new params go back
into the host-resident params in place (donated).

The file row is layer-major (`LayerLayout`): layer l (or its piece) of every layer leaf's local
shard, then the next, each padded to a multiple of `swap.ALIGN`, so a chunk is whole layers or one
piece. Checkpoints stream the file as the nvme tier's do (`tier_io.StatePieces` over the row's
segments), in the same orbax format, so a run resumes across tiers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshrun.checkpoint import slices
from meshrun.checkpoint.state import path_key
from meshrun.config import RunConfig
from meshrun.errors import ConfigError
from meshrun.optim.optimizer import MasterState
from meshrun.parallel.layer_fetch import HOST_SPACE, on_host, to_device, use_grad_sink
from meshrun.parallel.sharding import is_spec
from meshrun.train import layer_update, streamed, swap, swap_dir, tier_io
from meshrun.train.chunk_store import resting_bytes
from meshrun.train.grad_file import GradSink
from meshrun.train.layer_layout import layer_layout
from meshrun.train.layer_update import LAYER, SCALAR


class LayerTier:
    """The NVMe tier of a TrainStep with offload.params (`make_layer_streamed`)."""

    def __init__(self, ts, cfg: RunConfig):
        t, plan, zl = cfg.offload, ts.plan, ts.plan.zero
        self.ts, self.file, self.sink = ts, None, None
        self.grads_nvme = t.grads == "nvme"  # the layers' gradient rests in the file (grad_file.py)
        self.directory = swap_dir.take_dir(t.dir, jax.process_index())
        abstract, sh = ts.abstract_run, ts.state_shardings
        tx = layer_update.no_clip_optimizer(cfg, plan.model_fns.param_names)
        cast = not isinstance(abstract.opt_state, MasterState)  # as the step without the tier
        self.up = up = layer_update.Update.of(tx, abstract.opt_state, abstract.params, cfg.optimizer.grad_clip, cast)
        slots_abs, _ = up.split(abstract.opt_state)
        if any(x.dtype != jnp.float32 for x in slots_abs):
            raise ConfigError("optimizer.state_dtype", cfg.optimizer.state_dtype, "use float32 with "
                              "offload.optimizer=nvme", "the NVMe tier stores float32 state only")  # fmt: skip
        k = len(jax.tree.leaves(abstract.params["layers"]))
        self.n_slots, self.cast = len(slots_abs) // k, cast
        self.layout = lay = layer_layout(zl.mesh, abstract.params["layers"], zl.opt["layers"],
                                         self.n_slots + self.grads_nvme, t.budget_mb * 2**20)  # fmt: skip
        opt_sh = jax.tree.leaves(sh.opt_state, is_leaf=lambda x: isinstance(x, NamedSharding))
        self.slot_sh, self.kept_sh = up.split(opt_sh)
        self.kept_def = [kd for kd in up.kinds if kd != LAYER]
        n_batch = 3 if cfg.data.pack_documents else 2
        rep = NamedSharding(lay.mesh, P())
        specs = lambda tree: tuple(jax.tree.leaves(tree, is_leaf=is_spec))
        store, grads_sp, opt_sp = specs(zl.store["layers"]), specs(zl.grads["layers"]), specs(zl.opt["layers"])
        if self.grads_nvme and not store == grads_sp == opt_sp:  # the gradient's rows are the state's
            raise ValueError("offload.grads=nvme: the layers' gradient and state layouts differ")
        layers_def = jax.tree.structure(abstract.params["layers"])
        self.layers_def = layers_def
        per, axes = lay.per, P(*lay.mesh.axis_names)
        other_sh = {k: v for k, v in sh.params.items() if k != "layers"}

        def device_part(params, kept, *batch):
            loss, grads, aux = ts.loss_and_grads(params, *plan.lay_out(batch))
            if self.grads_nvme:  # the gradient went to the file; its squared sums came back
                g_norm, g_layers = layer_update.sink_norm(grads, params, cast), ()
            else:
                g_norm, g_layers = layer_update.global_norm(grads, params, cast, zl), grads["layers"]
            new_other, new_kept = up.others(grads, params, kept, g_norm)
            return g_layers, new_other, tuple(new_kept), g_norm, {"loss": loss, "grad_norm": g_norm, **aux}

        self.device_part = jax.jit(
            device_part, in_shardings=(sh.params, tuple(self.kept_sh), *(ts.batch_sharding,) * n_batch),
            out_shardings=(() if self.grads_nvme else sh.params["layers"], other_sh, tuple(self.kept_sh), rep, None),
        )  # fmt: skip

        q = lay.split

        def cut(x, l0, k):  # a local shard's `per` layers from l0, or piece k of layer l0
            x = jax.lax.dynamic_slice_in_dim(x, l0, per, 0)
            return x if q == 1 else jax.lax.dynamic_slice_in_dim(x, k * (x.shape[1] // q), x.shape[1] // q, 1)

        def put(o, x, l0, k):  # the inverse: x written into the local shard o
            zero = jnp.zeros((), jnp.int32)
            start = (l0, zero if q == 1 else k * (o.shape[1] // q), *(zero,) * (o.ndim - 2))
            return jax.lax.dynamic_update_slice(o, x, start)

        def take(tree_leaves, spec, l0, k):  # one chunk's slices, on the device
            body = lambda *xs: tuple(to_device(cut(x, l0, k)) for x in xs)
            return jax.shard_map(body, mesh=lay.mesh, in_specs=spec, out_specs=spec, check_vma=False)(*tree_leaves)

        def layer_chunk(p_layers, g_layers, slots, scalars, g_norm, l0, k_):
            p = take(jax.tree.leaves(p_layers), store, l0, k_)
            rows = lambda *s: tuple(x for f in s for x in lay.from_rows(f.reshape(-1), per))
            if self.grads_nvme:  # the chunk's last slot: its gradient, read with its state
                g = jax.shard_map(rows, mesh=lay.mesh, in_specs=(axes,), out_specs=grads_sp,
                                  check_vma=False)(slots[-1])  # fmt: skip
                slots = slots[:-1]
            else:
                g = take(jax.tree.leaves(g_layers), grads_sp, l0, k_)
            state = jax.shard_map(rows, mesh=lay.mesh, in_specs=(axes,) * len(slots),
                                  out_specs=opt_sp * self.n_slots, check_vma=False)(*slots)  # fmt: skip
            like = {kk: v for kk, v in abstract.params.items() if kk != "layers"}
            like_g = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), like)
            new_p, new_slots = up.layers(jax.tree.unflatten(layers_def, g), jax.tree.unflatten(layers_def, p),
                                         list(state), scalars, like, like_g, g_norm)  # fmt: skip

            def back(*xs):  # the new params into the resting ones, in place; the new state as rows
                old, new, st = xs[:k], xs[k : 2 * k], xs[2 * k :]
                back = lambda x, o: jax.device_put(x, HOST_SPACE) if on_host(o) else x
                out = tuple(put(o, back(x.astype(o.dtype), o), l0, k_)
                            for o, x in zip(old, new, strict=True))  # fmt: skip
                ndim = len(lay.mesh.axis_names)
                return out, tuple(lay.to_rows(list(st[i * k : (i + 1) * k]), per).reshape((1,) * ndim + (-1,))
                                  for i in range(self.n_slots))  # fmt: skip

            out, new_rows = jax.shard_map(back, mesh=lay.mesh, in_specs=(*store, *store, *opt_sp * self.n_slots),
                                          out_specs=(store, (axes,) * self.n_slots), check_vma=False)(
                *jax.tree.leaves(p_layers), *jax.tree.leaves(new_p), *new_slots)  # fmt: skip
            return jax.tree.unflatten(layers_def, list(out)), new_rows

        scalar_sh = tuple(s for s, kd in zip(self.kept_sh, self.kept_def, strict=True) if kd == SCALAR)
        g_sh = () if self.grads_nvme else sh.params["layers"]
        self.layer_chunk = jax.jit(
            layer_chunk, in_shardings=(sh.params["layers"], g_sh, (lay.sharding,) * (self.n_slots + self.grads_nvme),
                                       scalar_sh, rep, rep, rep),
            out_shardings=(sh.params["layers"], (lay.sharding,) * self.n_slots), donate_argnums=(0,),
        )  # fmt: skip

        def chunk_rows(slot_leaves, l0, k_):  # one chunk's state as the file's rows (init, absorb)
            def body(*xs):
                ndim = len(lay.mesh.axis_names)
                got = [to_device(cut(x, l0, k_)) for x in xs]
                return tuple(lay.to_rows(got[i * k : (i + 1) * k], per).reshape((1,) * ndim + (-1,))
                             for i in range(self.n_slots))  # fmt: skip

            return jax.shard_map(body, mesh=lay.mesh, in_specs=opt_sp * self.n_slots,
                                 out_specs=(axes,) * self.n_slots, check_vma=False)(*slot_leaves)  # fmt: skip

        self.chunk_rows = jax.jit(chunk_rows, out_shardings=(lay.sharding,) * self.n_slots)
        f32 = [jnp.float32] * k
        self.unflatten_slot = jax.jit(lambda f: tuple(lay.unflatten(f, f32)), in_shardings=lay.sharding)
        saved = ts.abstract_state
        paths = [path_key(p) for p, _ in jax.tree_util.tree_flatten_with_path(saved)[0]]  # params, opt, step
        n_p = len(jax.tree.leaves(saved.params))
        keys, _ = up.split(paths[n_p : n_p + len(jax.tree.leaves(saved.opt_state))])  # checkpoint keys
        key_of = [keys[i * k : (i + 1) * k] for i in range(self.n_slots)]
        self.state_pieces = tier_io.StatePieces(self, key_of, only="layers")

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

    @swap_dir.stepping()  # the device part's and the chunks' temporaries kept, then trimmed
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

    def ensure_file(self) -> swap.SwapFile:
        if self.file is None:
            lay = self.layout
            slots = self.n_slots + self.grads_nvme  # the gradient's slot last: read, never written by the stream
            self.file = swap.SwapFile(self.directory, lay.n_chunks, (slots, len(lay.first), lay.chunk), self.n_slots)
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
        from the file while the save writes them (tier_io.py)."""
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


def make_layer_streamed(ts, cfg: RunConfig):
    """The TrainStep `ts` (built in memory, offload.params) with the layers' optimizer state in
    the NVMe tier."""
    tier = LayerTier(ts, cfg)
    return dataclasses.replace(
        ts,
        step=streamed._Stepper(tier),
        init=lambda: tier.absorb(ts.init()),
        init_from=lambda prm: tier.absorb(ts.init_from(prm)),
        to_run=lambda st: tier.absorb(ts.to_run(st)),
        to_model=lambda st: ts.to_model(tier.whole(st)),
        to_save=tier.save_view,
        restore=tier.restore,
        tier=tier,
    )
