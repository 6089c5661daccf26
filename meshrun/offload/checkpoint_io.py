"""The NVMe tier's whole-state moves, one file chunk at a time, so that no more than the tier's budget
of optimizer state is ever in host memory (counted in `SwapFile.resident`):

- init computes each chunk's initial state (the optimizer's elementwise init of the chunk's params)
  on the device and writes it straight into the file;
- a checkpoint save hands orbax the optimizer's parameter-shaped leaves as `StreamedArray`s, which
  `meshrun/checkpoint/slices.py` writes box by box from the file's chunks, in every tier's format;
  a restore reads those leaves box by box into the file.

`StatePieces` maps a chunk of the file (`[slot][row][C]`, a sub-range of every row) to boxes of the
global optimizer leaves. Checkpoints keep the layers in model order; where the run places them
otherwise (interleaved or uneven pipelines, `plan.relaid`), each box of a layer leaf becomes one
piece per layer at its model-order index (`LayerSplit.pipeline_index`; padding layers are neither
saved nor restored, so they stay zero, as `to_pipeline` pads them).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from meshrun.checkpoint import slices
from meshrun.checkpoint.state import path_key
from meshrun.offload import malloc


def _rows(sharding: NamedSharding, shape: tuple, lay) -> list[tuple[int, tuple, bool]]:
    """(distinct local row, global start of its shard, primary) of one leaf: primary when a device
    holding the row is replica 0 of its shard (jax's replica numbering: in the sharding's device
    order), so every element is written and counted once over all processes."""
    index = sharding.devices_indices_map(shape)
    seen: dict = {}
    replica = {}
    for d, ix in index.items():
        h = tuple((s.start, s.stop, s.step) for s in ix)
        replica[d] = seen.get(h, 0)
        seen[h] = replica[d] + 1
    out = []
    for u in range(len(lay.first)):
        devs = [d for d, o in zip(lay.local, lay.owner, strict=True) if o == u]
        start = tuple(s.start or 0 for s in index[devs[0]])
        out.append((u, start, any(replica[d] == 0 for d in devs)))
    return out


class Runs:
    """A layout's `segments` (runs of one leaf's elements in the row) in row order, with the runs a
    chunk [c0, c1) of the row meets found by bisection on their offsets: a chunk of a layer-major row
    meets a few runs of the many (layers x pieces x leaves)."""

    def __init__(self, segments):
        self.segments = sorted(segments, key=lambda r: r[2])  # disjoint runs: their ends are in order too
        self.starts = [r[2] for r in self.segments]

    def within(self, c0: int, c1: int) -> list[tuple[int, int, int, int]]:
        """The runs with an element in [c0, c1), in row order."""
        out = []
        for run in self.segments[max(bisect.bisect_right(self.starts, c0) - 1, 0) :]:
            if run[2] >= c1:
                break
            if run[2] + run[3] > c0:
                out.append(run)
        return out


class StatePieces:
    """The tier's optimizer leaves as a `slices.Source` (see the module docstring)."""

    def __init__(self, tier, key_of: list | None = None, only: str | None = None):
        """`key_of` [slot][leaf]: the checkpoint keys of the file's leaves, the params' entry `only`
        (e.g. 'layers') when given, else every parameter-shaped leaf of the optimizer state
        (`tier.pattern`)."""
        lay, abstract = tier.layout, tier.ts.abstract_state
        self.tier = tier
        pick = (lambda t: t[only]) if only is not None else (lambda t: t)
        if key_of is None:
            k = tier.pattern.k
            n_opt = len(jax.tree.leaves(abstract.opt_state))
            paths = [path_key(p) for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]  # params, opt, step
            key_of, _ = tier.pattern.split(paths[k : k + n_opt])  # [slot][leaf]: checkpoint keys
        self.key_of = key_of
        leaves = jax.tree.leaves(pick(abstract.params))  # model order: the checkpoint's leaves
        self.shapes = {key: tuple(x.shape) for slot in self.key_of for key, x in zip(slot, leaves, strict=True)}
        self.keys = frozenset(self.shapes)
        self.sharding = [NamedSharding(lay.mesh, s) for s in lay.specs]
        run = tier.ts.abstract_run.params  # the run's placement: the file's rows
        run_leaves = jax.tree.leaves(pick(run))
        self.rows = [_rows(sh, tuple(x.shape), lay) for sh, x in zip(self.sharding, run_leaves, strict=True)]
        # Layers in another order than the checkpoint's (interleaved, uneven pipelines): per layer leaf,
        # the model-order layer at each run position of its first axis (-1: padding, not saved)
        self.layer_index: list = [None] * len(self.rows)
        if tier.ts.plan.relaid:
            idx = tier.ts.plan.split.pipeline_index()
            flags = jax.tree.leaves(pick({k: jax.tree.map(lambda _, k=k: k == "layers", v) for k, v in run.items()}))
            self.layer_index = [idx if f else None for f in flags]
        self.runs = Runs(lay.segments)
        self.zarr_chunk_bytes = lay.chunk * 4  # one row of one slot of a chunk
        self._sums = None

    @property
    def stamp(self) -> tuple:
        f = self.tier.file
        return (id(f), f.bytes_written)

    def pieces(self, i: int, buf: np.ndarray, primary_only: bool) -> list[slices.Piece]:
        """Chunk i's boxes, as views of `buf` ([slot][row][C])."""
        lay = self.tier.layout
        c0, c1 = i * lay.chunk, (i + 1) * lay.chunk
        out = []
        for leaf, first, off, n in self.runs.within(c0, c1):  # runs of one leaf's elements in the chunk
            lo, hi = max(off, c0), min(off + n, c1)
            if lo >= hi:
                continue
            shape = lay.shapes[leaf]
            boxes = slices.flat_boxes(shape, first + lo - off, first + hi - off)
            for u, start, primary in self.rows[leaf]:
                if primary_only and not primary:
                    continue
                for s, keys in enumerate(self.key_of):
                    flat, pos = buf[s, u, lo - c0 : hi - c0], 0
                    for b0, b1 in boxes:
                        box = tuple(e - a for a, e in zip(b0, b1, strict=True))
                        n = math.prod(box)
                        g0 = tuple(a + o for a, o in zip(b0, start, strict=True))
                        g1 = tuple(e + o for e, o in zip(b1, start, strict=True))
                        out += self._placed(keys[leaf], leaf, g0, g1, flat[pos : pos + n].reshape(box), primary)
                        pos += n
        return out

    def _placed(self, key: str, leaf: int, g0: tuple, g1: tuple, data: np.ndarray, primary: bool) -> list:
        """A box of the run's leaf as pieces of the checkpoint's: itself, or one per layer moved to
        its model-order index (padding layers dropped)."""
        idx = self.layer_index[leaf]
        if idx is None:
            return [slices.Piece(key, g0, g1, data, primary)]
        return [slices.Piece(key, (int(idx[r]), *g0[1:]), (int(idx[r]) + 1, *g1[1:]), data[r - g0[0] : r - g0[0] + 1],
                             primary) for r in range(g0[0], g1[0]) if idx[r] >= 0]  # fmt: skip

    def save_pieces(self, primary_only: bool = True) -> Iterator[list[slices.Piece]]:
        """Each chunk's boxes as read from the file: one copy of each element over all processes (orbax),
        or every box of this process's rows (`primary_only=False`: the local tier, which saves what
        this process restores)."""
        f = self.tier.file
        for i in range(f.n_chunks):
            buf = f.read(i, f.buffer)
            with f.held():  # TensorStore's copy of the chunk while it writes it
                yield self.pieces(i, buf, primary_only=primary_only)

    def restore_pieces(self) -> Iterator[list[slices.Piece]]:
        f = self.tier.ensure_file()
        for i in range(f.n_chunks):
            buf = f.buffer
            buf.fill(0)  # the rows' padding: zero, as `FlatLayout.flatten` pads
            with f.held():  # the boxes TensorStore reads before they land in the buffer
                yield self.pieces(i, buf, primary_only=False)
            f.write(i, [buf[: f.kept]])


class StreamedInit:
    """Init that writes each chunk's initial optimizer state straight into the file."""

    def __init__(self, tier, chunk_tx):
        ts, lay, pattern = tier.ts, tier.layout, tier.pattern
        sh = ts.state_shardings

        # The chunks' init starts from the params as a float32 row. With master weights that row is the
        # whole init's master slot, taken from the same program as the in-memory init: XLA may keep
        # excess precision there (measured: the master of bf16 params is the unrounded float32 init,
        # not float32(params)), and the chunked init must give the same state.
        def flat32(st):
            leaves = pattern.split(jax.tree.leaves(st.opt_state))[0][0] if tier.master else jax.tree.leaves(st.params)
            return lay.flatten([x.astype(jnp.float32) for x in leaves], jnp.float32)

        pick = lambda st: (st.params, tuple(pattern.split(jax.tree.leaves(st.opt_state))[1]), st.step, flat32(st))
        outs = (sh.params, tuple(tier.scalar_sh), sh.step, lay.sharding)
        body = lambda f: getattr(f, "__wrapped__", f)  # the jitted init's function, traced inline
        self.parts = jax.jit(lambda: pick(body(ts.init)()), out_shardings=outs)  # the unused moments: dead code
        self.parts_from = jax.jit(lambda prm: pick(body(ts.init_from)(prm)), out_shardings=outs)
        cuts = list(np.cumsum(tier.pieces[:-1]))

        def init_chunk(p_flat, off):
            p = tier.take_chunk(p_flat, off)
            state = chunk_tx.init(tuple(jnp.split(p, cuts, axis=-1)))  # the same two leaves as the step's
            new_slots, _ = tier.chunk_pattern.split(jax.tree.leaves(state))
            return tuple(tuple(s) for s in new_slots)

        n = (lay.sharding,) * len(tier.pieces)
        self.init_chunk = jax.jit(init_chunk, out_shardings=(n,) * pattern.n_slots)
        self.tier = tier

    def fill(self, p_flat) -> None:
        """The file's state: the optimizer's init of the params in the flat row `p_flat`, chunk by chunk."""
        tier = self.tier
        lay, f = tier.layout, tier.ensure_file()
        for i in range(lay.n_chunks):
            with f.held():  # the chunk computed on the device, then copied to the file
                new = self.init_chunk(p_flat, jnp.int32(i * lay.chunk))
                f.write(i, [h for s in new for r in zip(*map(lay.rows, s)) for h in r])
            del new

    def __call__(self, params_from=None):
        params, scalars, step, p_flat = self.parts() if params_from is None else self.parts_from(params_from)
        self.fill(p_flat)
        del p_flat
        malloc.trim_freed()  # what compiling the init and its chunks freed
        return type(self.tier.ts.abstract_run)(params, scalars, step)
