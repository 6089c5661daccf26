"""Hugging Face checkpoints <-> meshrun parameters and ModelConfig: the generic part.

Which family a transformers directory is comes from the registry: each family's adapter
(`Family.hf`, e.g. models/llama/hf.py) lists the `architectures` and `model_type`s it accepts and
holds its tables: config.json <-> ModelConfig (`model_config`, `hf_config`), meshrun leaf path <->
tensor name (`top_map`: unstacked leaves, `layer_map`: stacked per-layer leaves, with a transform kind
below, a part index when several leaves share one tensor and the layer of each stack entry), `ignored` names.
Vocab: padded with zero rows/columns to a multiple (tensor-parallel vocab split), stripped on export.

A `Lazy` tensor is a shape plus a function of an index (a tuple of slices) that reads only that part
of the memory-mapped files, so each device's shard is read on its own (jax.make_array_from_callback).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshrun.config import ModelConfig
from meshrun.errors import ConfigError
from meshrun.family import registry

FIELD = "MODEL_DIR/config.json"


def adapters() -> dict[str, Any]:
    """model.family name -> its Hugging Face adapter, for the families that have one."""
    out = {}
    for name in registry.FAMILIES:
        hf = registry.get(name).hf
        if hf is not None:
            out[name] = hf
    return out


def family_for(hf: dict) -> tuple[str, Any]:
    """(model.family, adapter) of a transformers config.json: by `architectures`, else `model_type`."""
    archs = hf.get("architectures") or []
    found = adapters()
    for a in archs:
        for name, ad in found.items():
            if a in ad.ARCHITECTURES:
                return name, ad
    mt = hf.get("model_type")
    for name, ad in found.items():
        if mt in ad.MODEL_TYPES:
            return name, ad
    known = sorted(a for ad in found.values() for a in ad.ARCHITECTURES)
    raise ConfigError(
        f"{FIELD}: architectures", archs or mt, f"meshrun imports {known}", "unsupported model architecture"
    )


def family_of(hf: dict) -> str:
    """The checkpoint's own family name (e.g. llama, mistral, qwen2, mixtral, gpt2)."""
    return family_for(hf)[1].family_of(hf)


def model_config(hf: dict, vocab_multiple: int = 128) -> ModelConfig:
    """ModelConfig of a transformers config.json dict (vocab padded to a multiple of `vocab_multiple`;
    the ids past the checkpoint's own `vocab_size` are marked as padding: model.vocab_used)."""
    if not isinstance(hf, dict):
        raise ConfigError(FIELD, type(hf).__name__, "give a transformers config.json (a JSON object)", "not an object")
    family = family_for(hf)[1]  # an unsupported architecture is the first thing to say
    vocab = hf.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ConfigError(f"{FIELD}: vocab_size", vocab, "give the tokenizer's size, a positive integer")
    try:
        cfg = family.model_config(hf, vocab_multiple)
    except KeyError as e:
        raise ConfigError(f"{FIELD}: {e.args[0]}", None, "give a complete config.json", "missing key") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(FIELD, str(e), "fix config.json (numbers where numbers belong)", "unusable values") from None
    return dataclasses.replace(cfg, vocab_used=hf["vocab_size"] if hf["vocab_size"] < cfg.vocab else 0)


def adapter(cfg: ModelConfig):
    """The Hugging Face adapter of cfg's family; a ConfigError when it has none."""
    ad = registry.get(cfg.family).hf
    if ad is None:
        raise ConfigError(
            "model.family", cfg.family, f"use one of {sorted(adapters())}", "no Hugging Face import/export for it"
        )
    return ad


def hf_config(cfg: ModelConfig, vocab: int, dtype: str) -> dict[str, Any]:
    """A transformers config.json for a meshrun model (used when the run was not imported)."""
    return adapter(cfg).hf_config(cfg, vocab, dtype)


# ---------------------------------------------------------------- per-layer tensor map


def _deinterleave(dr: int) -> np.ndarray:
    """RoPE dims in DeepSeek's interleaved order (pairs side by side) -> rotate-half order: the even
    dims, then the odd ones (transformers' `apply_rotary_pos_emb_interleave` reorders them so)."""
    return np.concatenate([np.arange(0, dr, 2), np.arange(1, dr, 2)])


def _rope_rows(y: np.ndarray, dr: int, inverse: bool = False) -> np.ndarray:
    """The last dr entries of y's last axis reordered by `_deinterleave` (or back)."""
    perm, out = _deinterleave(dr), np.array(y)
    if inverse:
        out[..., out.shape[-1] - dr + perm] = y[..., -dr:]
    else:
        out[..., -dr:] = y[..., out.shape[-1] - dr + perm]
    return out


# transform: hf per-layer array -> meshrun per-layer array (and `_inverse`), n = heads of that projection
# (t_rope: the RoPE dims dr at the end; col_rope: (heads, dr))
def _forward(kind: str, x: np.ndarray, n) -> np.ndarray:
    if kind == "t_rope":  # [r + dr, D] -> [D, r + dr], the RoPE part in rotate-half order
        return _rope_rows(x.T, n)
    if kind == "col_rope":  # [H*(dn + dr), D] -> [D, H, dn + dr], each head's RoPE part reordered
        return _rope_rows(_forward("col", x, n[0]), n[1])
    if kind == "id":
        return x
    if kind == "t":  # [out, in] -> [in, out]
        return x.T
    if kind == "col":  # [n*Dh, D] -> [D, n, Dh]
        return x.T.reshape(x.shape[1], n, x.shape[0] // n)
    if kind == "row":  # [D, n*Dh] -> [n, Dh, D]
        return x.T.reshape(n, x.shape[1] // n, x.shape[0])
    if kind == "bias":  # [n*Dh] -> [n, Dh]
        return x.reshape(n, -1)
    if kind == "in_col":  # [D, n*Dh] (stored [in, out], GPT-2's Conv1D) -> [D, n, Dh]
        return x.reshape(x.shape[0], n, x.shape[1] // n)
    if kind == "in_row":  # [n*Dh, D] -> [n, Dh, D]
        return x.reshape(n, x.shape[0] // n, x.shape[1])
    raise AssertionError(kind)


def _inverse(kind: str, y: np.ndarray, n=0) -> np.ndarray:
    if kind == "t_rope":
        return _rope_rows(y, n, inverse=True).T
    if kind == "col_rope":
        return _inverse("col", _rope_rows(y, n[1], inverse=True))
    if kind == "id":
        return y
    if kind == "t":
        return y.T
    if kind == "col":  # [D, n, Dh] -> [n*Dh, D]
        return y.reshape(y.shape[0], -1).T
    if kind == "row":  # [n, Dh, D] -> [D, n*Dh]
        return y.reshape(-1, y.shape[-1]).T
    if kind == "bias":
        return y.reshape(-1)
    if kind == "in_col":  # [D, n, Dh] -> [D, n*Dh]
        return y.reshape(y.shape[0], -1)
    if kind == "in_row":  # [n, Dh, D] -> [n*Dh, D]
        return y.reshape(-1, y.shape[-1])
    raise AssertionError(kind)


@dataclass(frozen=True)
class Lazy:
    """A tensor of `shape` whose part at a tuple of slices is read by `read(index)`."""

    shape: tuple[int, ...]
    read: Callable[[tuple[slice, ...]], np.ndarray]


def _norm(index, shape) -> tuple[slice, ...]:
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(slice(*s.indices(n)) for s, n in zip(index, shape))


def _entry(v: tuple, cfg: ModelConfig) -> tuple:
    """A layer_map value (tmpl, kind, heads[, part, parts[, layers]]) in full: its part (0 of 1 when
    whole) and the transformers layer index of each entry of the stack (default: layer i at i)."""
    v = (*v, 0, 1) if len(v) == 3 else tuple(v)
    return v if len(v) == 6 else (*v, tuple(range(cfg.n_layers)))


def _names(tmpl: str, ids: np.ndarray, experts: int) -> Iterator[str]:
    """Every transformers name of a stacked leaf (per layer, and per expert when `{e}` is in it)."""
    for i in ids.flat:
        for e in range(experts if "{e}" in tmpl else 1):
            yield tmpl.format(l=int(i), e=e)


def first_name(v: tuple, cfg: ModelConfig) -> str:
    """The transformers name of a layer_map value's first layer (and expert)."""
    tmpl, *_, ids = _entry(v, cfg)
    return next(_names(tmpl, np.asarray(ids), 1)) if tmpl else ""


def _part(x: np.ndarray, part: int, parts: int) -> np.ndarray:
    """Piece `part` of `parts` equal pieces along the last axis (e.g. GPT-2's fused c_attn)."""
    if parts == 1:
        return x
    w = x.shape[-1] // parts
    return x[..., part * w : (part + 1) * w]


def lazy_params(cfg: ModelConfig, get: Callable[[str], np.ndarray], vocab: int) -> dict[tuple[str, ...], Lazy]:
    """meshrun leaf path -> Lazy of that leaf, reading transformers tensors through `get(name)`
    (memory-mapped); the vocab dimension padded with zeros from `vocab` to cfg.vocab."""
    ad = adapter(cfg)

    def padded(name: str, axis: int) -> Lazy:
        src = get(name) if axis == 0 else get(name).T  # lm_head [V, D] -> kernel [D, V]
        shape = tuple(cfg.vocab if a == axis else n for a, n in enumerate(src.shape))

        def read(index):  # device shards are contiguous slices (step 1)
            idx = _norm(index, shape)
            out = np.zeros(tuple(len(range(n)[s]) for s, n in zip(idx, shape)), src.dtype)
            lo, hi = idx[axis].start, min(idx[axis].stop, vocab)
            if hi > lo:
                put = [slice(None)] * len(shape)
                put[axis] = slice(0, hi - lo)
                out[tuple(put)] = src[idx[:axis] + (slice(lo, hi),) + idx[axis + 1 :]]
            return out

        return Lazy(shape, read)

    out = {}
    for path, (name, kind) in ad.top_map(cfg).items():
        out[path] = padded(name, 0) if kind == "vocab" else padded(name, 1) if kind == "vocab_t" else _whole(get(name))
    for path, v in ad.layer_map(cfg).items():
        out[path] = _layer_lazy(cfg, v, get)
    return out


def _layer_lazy(cfg: ModelConfig, v: tuple, get: Callable[[str], np.ndarray]) -> Lazy:
    """The Lazy of one stacked leaf: its transformers tensors per layer (and expert), transformed."""
    tmpl, kind, n, part, parts, ids = _entry(v, cfg)
    ids = np.asarray(ids, dtype=np.int64)
    experts = cfg.n_experts if "{e}" in tmpl else 0
    if kind == "zeros":  # state transformers does not keep (balance=bias's load): zeros, [*stack, n]
        shape = ids.shape + (n,)
        return Lazy(shape, lambda index: np.zeros([len(range(k)[s]) for s, k in zip(_norm(index, shape), shape)]))
    _same_shapes(tmpl, ids, experts, get)
    per = lambda i, e, t=tmpl, k=kind, n=n, q=part, m=parts: _forward(k, _part(get(t.format(l=i, e=e)), q, m), n)
    try:
        one = per(int(ids.flat[0]), 0)
    except ValueError:  # numpy's reshape message names neither the tensor nor the heads
        first, of = tmpl.format(l=int(ids.flat[0]), e=0), f", part {part + 1} of {parts}" if parts > 1 else ""
        raise ValueError(
            f"{first} has shape {tuple(get(first).shape)}, which does not split into {n} heads ({kind}{of})"
        ) from None
    return _stacked(ids, experts, one.shape, per)


class TransposedTensor(ValueError):
    """A layer's tensor holds the transpose of another layer's shape: the file is wrong, not config.json."""


def _same_shapes(tmpl: str, ids: np.ndarray, experts: int, get: Callable[[str], np.ndarray]) -> None:
    """ValueError naming the tensor when a layer's (or expert's) tensor differs in shape from the first's."""
    names = list(_names(tmpl, ids, experts))
    first = names[0]
    want = tuple(get(first).shape)
    for name in names:
        got = tuple(get(name).shape)
        if got != want and len(got) == 2 and got == want[::-1]:
            raise TransposedTensor(f"{name} has shape {got}, {first} has {want}: one is stored transposed")
        if got != want:
            raise ValueError(f"{name} has shape {got}, {first} has {want}")


def _whole(a: np.ndarray) -> Lazy:
    return Lazy(tuple(a.shape), lambda index: np.array(a[_norm(index, a.shape)]))


def _stacked(ids: np.ndarray, experts: int, shape: tuple[int, ...], per) -> Lazy:
    """[*ids.shape, (experts,) shape]: entry (pos, e) is per(ids[pos], e)."""
    lead = ids.shape + ((experts,) if experts else ())
    full = lead + tuple(shape)

    def read(index):
        idx = _norm(index, full)
        ranges, rest = [range(*s.indices(n)) for s, n in zip(idx, lead)], idx[len(lead) :]

        def build(pos: tuple) -> np.ndarray:
            if len(pos) == len(lead):
                return np.array(per(int(ids[pos[: ids.ndim]]), pos[-1] if experts else 0)[rest])
            return np.stack([build((*pos, i)) for i in ranges[len(pos)]])

        return build(())

    return Lazy(full, read)


def hf_tensors(
    cfg: ModelConfig, leaf: Callable[[tuple[str, ...]], Any], vocab: int
) -> Iterator[tuple[str, np.ndarray]]:
    """(transformers name, array) for every tensor, vocab stripped to `vocab`. `leaf(path)` returns a
    meshrun leaf indexable by layer (a jax or numpy array); one layer at a time is brought to host
    memory. Leaves that are parts of one tensor are concatenated along its last axis."""
    ad = adapter(cfg)
    top = ad.top_map(cfg)
    for path, (name, kind) in top.items():
        if kind == "vocab":
            yield name, np.asarray(leaf(path)[:vocab])
    for layer, entries in _by_layer(cfg, ad.layer_map(cfg)).items():
        pieces: dict[str, dict[int, np.ndarray]] = {}
        for path, pos, (tmpl, kind, n, part, parts, _) in entries:
            y = np.asarray(leaf(path)[pos])
            if "{e}" in tmpl:
                for e in range(cfg.n_experts):
                    yield tmpl.format(l=layer, e=e), _inverse(kind, y[e], n)
            elif parts == 1:
                yield tmpl.format(l=layer), _inverse(kind, y, n)
            else:
                got = pieces.setdefault(tmpl.format(l=layer), {})
                got[part] = _inverse(kind, y, n)
                if len(got) == parts:
                    yield tmpl.format(l=layer), np.concatenate([got[i] for i in range(parts)], axis=-1)
    for path, (name, kind) in top.items():
        if kind == "id":
            yield name, np.asarray(leaf(path))
        elif kind == "vocab_t":
            yield name, np.asarray(leaf(path)[:, :vocab]).T


def _by_layer(cfg: ModelConfig, layer_map: dict) -> dict[int, list]:
    """transformers layer -> [(meshrun path, index of that layer in the leaf, full entry)], in layer order."""
    out: dict[int, list] = {}
    for path, v in layer_map.items():
        e = _entry(v, cfg)
        if e[1] == "zeros":
            continue
        ids = np.asarray(e[5], dtype=np.int64)
        for pos in np.ndindex(*ids.shape):
            out.setdefault(int(ids[pos]), []).append((path, pos, e))
    return dict(sorted(out.items()))


def expected_names(cfg: ModelConfig) -> set[str]:
    """Every transformers tensor name the model needs (a tied lm_head is not among them)."""
    ad = adapter(cfg)
    names = {name for name, _ in ad.top_map(cfg).values()}
    for v in ad.layer_map(cfg).values():
        tmpl, kind, *_, ids = _entry(v, cfg)
        if kind != "zeros":
            names |= set(_names(tmpl, np.asarray(ids), cfg.n_experts))
    return names


def ignored(cfg: ModelConfig, name: str) -> bool:
    """A checkpoint tensor the model has no use for (a buffer, a tied lm_head copy)."""
    return adapter(cfg).ignored(cfg, name)
