"""Datasets for training: synthetic, byte-level text, flat token files; per-process slices -> global arrays.

Every batch is a pure function of (data.seed, step, row), so a resumed run sees exactly the batches
it would have seen and a process builds only the rows it owns (`rows=`). Legend: B rows, L seq, V vocab.

kinds
- synthetic: a learnable Markov chain over the vocab (best loss `synthetic_entropy(V)`, 0.88 nats
  for V=256 against ln 256 = 5.55).
- text: byte-level (vocab 256) over the files of `data.glob` joined by NUL, first TEXT_CAP_BYTES
  only; empty glob: the Python standard library's .py sources (pin `data.glob` to match machines).
- tokens: nanoGPT/Megatron-style flat .bin of uint16/uint32 token ids, memory-mapped.
- prepared: the shards of `meshrun prepare-data` (validation split, optional packing; prepared.py).
text/tokens rows are random windows of L+1 tokens; tokens = window[:-1], labels = window[1:].
"""

from __future__ import annotations

import glob as globlib
import os
import sysconfig
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshrun.config import DataConfig
from meshrun.data.base import Dataset
from meshrun.data.prepared import make_prepared
from meshrun.errors import ConfigError, DataError

TEXT_CAP_BYTES = 8 << 20  # text corpus: first 8 MiB of the matched files
TEXT_SEP = b"\x00"  # document separator (NUL never occurs in source text)
NOISE = 0.1  # synthetic: probability that the next token is uniform instead of nxt[prev]
TOKEN_CHECK = 1 << 24  # tokens: ids checked against the vocab up front (then per batch)
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class SyntheticDataset(Dataset):
    """Markov chain: next = nxt[prev] with probability 1 - NOISE, else uniform (learnable, see module doc)."""

    def __init__(self, seed: int, seq_len: int, global_batch: int, vocab: int):
        super().__init__(seed, seq_len, global_batch, vocab)
        self.nxt = np.random.default_rng([seed, 0x5EED]).permutation(vocab).astype(np.int32)

    def _windows(self, step, idx):
        n = self.seq_len + 1
        uniform, keep = np.empty((len(idx), n), np.int32), np.empty((len(idx), n), bool)
        for i, r in enumerate(idx):  # per-row RNG: a row does not depend on which other rows are built
            rng = self._rng(step, r)
            uniform[i] = rng.integers(0, self.vocab, n, dtype=np.int32)
            keep[i] = rng.random(n) >= NOISE
        win = uniform.copy()
        for t in range(1, n):  # the chain, vectorized over rows
            win[:, t] = np.where(keep[:, t], self.nxt[win[:, t - 1]], uniform[:, t])
        return win


def synthetic_entropy(vocab: int, noise: float = NOISE) -> float:
    """Entropy (nats) of the synthetic chain's next token: the lowest loss a model can reach on it."""
    p_hit = 1 - noise + noise / vocab
    p_other = noise / vocab
    return float(-p_hit * np.log(p_hit) - (vocab - 1) * p_other * np.log(p_other))


class WindowDataset(Dataset):
    """Random windows of L+1 tokens from a flat 1-D token array (uint8 text corpus or memmapped ids)."""

    def __init__(self, corpus: np.ndarray, seed: int, seq_len: int, global_batch: int, vocab: int, source: str):
        super().__init__(seed, seq_len, global_batch, vocab)
        self.corpus, self.source = corpus, source
        if len(corpus) < seq_len + 1:
            raise ConfigError(
                "train.seq_len",
                seq_len,
                f"use train.seq_len <= {len(corpus) - 1} or give more data",
                f"{source} holds only {len(corpus)} tokens, fewer than seq_len + 1",
            )

    def _row(self, rng):
        start = int(rng.integers(0, len(self.corpus) - self.seq_len))
        return np.asarray(self.corpus[start : start + self.seq_len + 1], dtype=np.int32)

    def batch(self, step, rows=None):
        tokens, labels = super().batch(step, rows)
        hi = int(labels[:, -1:].max(initial=0)), int(tokens.max(initial=0))
        if max(hi) >= self.vocab:
            raise ConfigError(
                "model.vocab", self.vocab, "use a model.vocab above every token id", f"{self.source} holds id {max(hi)}"
            )
        return tokens, labels


def stdlib_sources() -> list[Path]:
    """The standard library's .py files in sorted order (site-/dist-packages and caches skipped)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS)
        out.extend(Path(d) / f for f in sorted(files) if f.endswith(".py"))
    return out


def load_text(pattern: str, cap: int = TEXT_CAP_BYTES) -> np.ndarray:
    """Files matching `pattern` (sorted; empty: stdlib .py sources) joined by TEXT_SEP -> uint8, first `cap` bytes."""
    if pattern:
        files = sorted(Path(p) for p in globlib.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
        if not files:
            raise ConfigError(
                "data.glob",
                pattern,
                "give a glob that matches readable files (e.g. 'corpus/**/*.txt'), or leave it empty "
                "for the Python standard library sources",
                "matches no files",
            )
    else:
        files = stdlib_sources()
    parts, total = [], 0
    for f in files:
        if total >= cap:
            break
        data = f.read_bytes()[: cap - total] + TEXT_SEP
        parts.append(data)
        total += len(data)
    corpus = np.frombuffer(b"".join(parts)[:cap], dtype=np.uint8)
    if len(corpus) == len(parts):  # nothing but separators
        raise ConfigError("data.glob", pattern, "give a glob that matches non-empty files", "matched files are empty")
    return corpus


def load_tokens(path: str, token_dtype: str, vocab: int) -> np.ndarray:
    """Memory-map a flat token file; ids >= vocab in the first TOKEN_CHECK tokens -> ConfigError."""
    p = Path(path) if path else None
    if p is None or not p.is_file():
        raise ConfigError(
            "data.path",
            path,
            "give the path of a flat uint16/uint32 token file (nanoGPT/Megatron .bin), or use data.kind=text",
            "no such file" if path else "not set",
        )
    dtype = np.dtype(token_dtype)
    size = p.stat().st_size
    if size == 0 or size % dtype.itemsize:
        raise ConfigError(
            "data.token_dtype",
            token_dtype,
            "set data.token_dtype to the dtype the file was written with",
            f"{path} has {size} bytes, not a positive multiple of {dtype.itemsize}",
        )
    arr = np.memmap(p, dtype=dtype, mode="r")
    hi = int(arr[:TOKEN_CHECK].max())
    if hi >= vocab:
        raise ConfigError(
            "model.vocab",
            vocab,
            f"use model.vocab >= {hi + 1} (the tokenizer's vocabulary size) or the matching data.path",
            f"{path} holds token id {hi}",
        )
    return arr


def make_dataset(dcfg: DataConfig, *, vocab: int, seq_len: int, global_batch: int, vocab_used: int = 0) -> Dataset:
    """Build the dataset named by `dcfg.kind` (see the module docstring). A file that exists but
    cannot be read (permissions, I/O error) -> DataError naming the field and the file.
    `vocab_used` > 0 (model.vocab_used): ids from it up are padding, never drawn and never accepted
    as data (the data's id range is vocab_used)."""
    vocab = vocab_used or vocab
    try:
        return _make_dataset(dcfg, vocab=vocab, seq_len=seq_len, global_batch=global_batch)
    except OSError as e:
        field, value = ("data.glob", dcfg.glob) if dcfg.kind == "text" else ("data.path", dcfg.path)
        where = f" {e.filename}" if getattr(e, "filename", None) else ""
        raise DataError(
            f"{field}={value!r}: cannot read{where} ({e.strerror or e}); fix the file's permissions or "
            f"point {field} at readable files"
        ) from e


def _make_dataset(dcfg: DataConfig, *, vocab: int, seq_len: int, global_batch: int) -> Dataset:
    if dcfg.kind == "synthetic":
        return SyntheticDataset(dcfg.seed, seq_len, global_batch, vocab)
    if dcfg.kind == "prepared":
        train, val = make_prepared(dcfg, vocab=vocab, seq_len=seq_len, global_batch=global_batch)
        train.val = val
        return train
    if dcfg.kind == "text":
        if vocab < 256:
            raise ConfigError("model.vocab", vocab, "use model.vocab >= 256 for byte-level text (data.kind=text)")
        src = f"data.glob={dcfg.glob!r}" if dcfg.glob else "the Python stdlib sources"
        return WindowDataset(load_text(dcfg.glob), dcfg.seed, seq_len, global_batch, vocab, src)
    arr = load_tokens(dcfg.path, dcfg.token_dtype, vocab)
    return WindowDataset(arr, dcfg.seed, seq_len, global_batch, vocab, f"data.path={dcfg.path!r}")


def _local_slices(index_map: dict, dim: int) -> list[slice]:
    """Distinct slices along `dim` held by this process's devices, in global order."""
    out = {}
    for idx in index_map.values():
        s = idx[dim] if dim < len(idx) else slice(None)
        out[(s.start or 0, s.stop)] = s
    return [out[k] for k in sorted(out, key=lambda k: k[0])]


def global_batch_arrays(ds: Dataset, step: int, mesh: Mesh, batch_spec: PartitionSpec) -> tuple[jax.Array, ...]:
    """Global (tokens, labels[, segment_ids]) sharded as NamedSharding(mesh, batch_spec); each process
    builds only its rows.

    The process's rows are the distinct row blocks of its addressable devices (in global order,
    concatenated), which is what `jax.make_array_from_process_local_data` expects as local data.
    """
    sharding = NamedSharding(mesh, batch_spec)
    shape = (ds.global_batch, ds.seq_len)
    index_map = sharding.addressable_devices_indices_map(shape)
    row_blocks, col_blocks = _local_slices(index_map, 0), _local_slices(index_map, 1)
    parts = [ds.batch(step, rows) for rows in row_blocks]
    out = []
    for k in range(len(parts[0])):
        local = np.concatenate([p[k] for p in parts], axis=0)
        if col_blocks != [slice(None)]:
            local = np.concatenate([local[:, c] for c in col_blocks], axis=1)
        out.append(jax.make_array_from_process_local_data(sharding, local, shape))
    return tuple(out)
