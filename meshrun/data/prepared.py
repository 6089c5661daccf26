"""`data.kind=prepared`: training on the shards of `meshrun prepare-data` (meshrun/data/tokenize.py).

Split: document d is held out for validation iff a fixed hash of d in [0, 1) is < data.val_fraction,
so the split depends only on the corpus, and no document is in both splits.

Rows: each split's documents, in corpus order, form one token stream (EOS closes every document).
Row r of step t is a window of L+1 tokens at a position drawn from the RNG seeded with (seed, t, r),
so batches stay a pure function of (seed, step, row) as for the other kinds.

Packing (data.pack_documents=true): a row also carries segment ids; attention stays inside a
segment, positions restart at each segment, and the label of a segment's last token is -1. Without
packing rows are plain windows (nanoGPT-style: attention crosses EOS).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from meshrun.data.base import Dataset
from meshrun.errors import ConfigError, DataError

VAL_SALT = 0x7A1D  # validation rows draw from their own RNG stream


def _unit_hash(i: np.ndarray) -> np.ndarray:
    """splitmix64(i) / 2**64: a fixed, well-mixed value in [0, 1) per document index."""
    with np.errstate(over="ignore"):
        z = i.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


class Corpus:
    """A prepared DATA_DIR: memory-mapped shards and the global document table."""

    def __init__(self, path: str):
        d = Path(path) if path else None
        mf = d / "manifest.json" if d is not None else None
        if mf is None or not mf.is_file():
            raise ConfigError(
                "data.path",
                path,
                "give a directory written by `meshrun prepare-data` (it holds manifest.json)",
                "not set" if not path else "no manifest.json there",
            )
        try:
            self._open(d, mf)
        except DataError:
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # a damaged or edited directory
            why = " ".join(str(e).split())[:160]
            raise DataError(
                f"data.path={path!r}: not a readable `meshrun prepare-data` directory ({type(e).__name__}: {why}); "
                "rerun prepare-data"
            ) from None

    def _open(self, d: Path, mf: Path) -> None:
        """Read and check the manifest, the shards and their document ends (memory-mapped)."""
        path = str(d)
        self.manifest = m = json.loads(mf.read_text())
        if m.get("dtype") not in ("uint16", "uint32"):
            raise ValueError(f"manifest dtype {m.get('dtype')!r} is not uint16 or uint32")
        self.dir, self.vocab, self.eos_id = d, int(m["vocab"]), int(m["eos_id"])
        self.shards, starts, lens, shard_of = [], [], [], []
        dtype = np.dtype(m["dtype"])
        for k, s in enumerate(m["shards"]):
            ends = np.fromfile(d / s["idx"], dtype=np.uint64).astype(np.int64)
            size = (d / s["bin"]).stat().st_size
            if size != int(s["n_tokens"]) * dtype.itemsize:
                raise DataError(
                    f"data.path={path!r}: {s['bin']} holds {size} bytes, the manifest says {s['n_tokens']} "
                    f"{dtype.name} tokens; rerun prepare-data"
                )
            arr = np.memmap(d / s["bin"], dtype=dtype, mode="r") if s["n_tokens"] else np.empty(0)
            if len(arr) != s["n_tokens"] or (len(ends) and ends[-1] != len(arr)) or np.any(np.diff(ends) < 1):
                raise DataError(f"data.path={path!r}: {s['bin']} does not match the manifest; rerun prepare-data")
            if len(ends) and ends[0] < 1:
                raise DataError(f"data.path={path!r}: {s['idx']} does not match the manifest; rerun prepare-data")
            self.shards.append(arr)
            starts.append(np.concatenate([[0], ends[:-1]]))
            lens.append(np.diff(np.concatenate([[0], ends])))
            shard_of.append(np.full(len(ends), k, np.int32))
        self.doc_start, self.doc_len = np.concatenate(starts), np.concatenate(lens)
        self.doc_shard = np.concatenate(shard_of)

    def split(self, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
        """(train doc ids, val doc ids), disjoint; see the module docstring."""
        n = len(self.doc_len)
        u = _unit_hash(np.arange(n))
        val = u < val_fraction
        if val_fraction > 0 and n >= 2:
            val[np.argmin(u)] = True  # at least one document each way
            val[np.argmax(u)] = False
        return np.flatnonzero(~val), np.flatnonzero(val)


class PreparedDataset(Dataset):
    """Rows of one split of a `Corpus` (see the module docstring): `batch(step, rows)` ->
    (tokens_BxL, labels_BxL[, segment_ids_BxL]) int32."""

    def __init__(
        self,
        corpus: Corpus,
        docs: np.ndarray,
        *,
        seed: int,
        seq_len: int,
        global_batch: int,
        vocab: int,
        pack: bool,
        salt: tuple[int, ...] = (),
        name: str = "train",
    ):
        super().__init__(seed, seq_len, global_batch, vocab)
        self.corpus, self.docs, self.pack, self.salt = corpus, docs, pack, salt
        self.cum = np.cumsum(corpus.doc_len[docs])  # end of each doc in the split's virtual stream
        total = int(self.cum[-1]) if len(docs) else 0
        if total < seq_len + 1:
            raise ConfigError(
                "train.seq_len" if name == "train" else "data.val_fraction",
                seq_len if name == "train" else None,
                "use a smaller train.seq_len, a larger data.val_fraction, or more data",
                f"the {name} split holds {total} tokens, fewer than seq_len + 1",
            )
        self.total = total

    def _rng(self, step: int, row: int) -> np.random.Generator:  # validation rows: their own stream
        return np.random.default_rng([self.seed, *self.salt, step, row])

    def _rows(self, step: int, idx: range) -> tuple[np.ndarray, np.ndarray]:
        n = self.seq_len + 1
        win, seg = np.empty((len(idx), n), np.int32), np.empty((len(idx), n), np.int32)
        c = self.corpus
        for i, r in enumerate(idx):
            rng = self._rng(step, r)
            pos = int(rng.integers(0, self.total - n + 1))
            j = int(np.searchsorted(self.cum, pos, side="right"))  # the split's doc holding `pos`
            filled, s = 0, 0
            while filled < n:
                d = int(self.docs[j])
                off = pos - (int(self.cum[j]) - int(c.doc_len[d]))  # offset inside doc d
                take = min(int(c.doc_len[d]) - off, n - filled)
                a = int(c.doc_start[d]) + off
                win[i, filled : filled + take] = c.shards[c.doc_shard[d]][a : a + take]
                seg[i, filled : filled + take] = s
                filled, pos, j, s = filled + take, pos + take, j + 1, s + 1
        return win, seg

    def batch(self, step: int, rows: slice | None = None):
        rows = rows if rows is not None else slice(0, self.global_batch)
        win, seg = self._rows(step, range(*rows.indices(self.global_batch)))
        tokens, labels = win[:, :-1], win[:, 1:].copy()
        hi = int(win.max(initial=0))
        if hi >= self.vocab:
            raise ConfigError(
                "model.vocab", self.vocab, f"use model.vocab >= {self.corpus.vocab}", f"data.path holds token id {hi}"
            )
        if not self.pack:
            return tokens, labels
        labels[seg[:, 1:] != seg[:, :-1]] = -1  # a segment's last token would predict the next document
        return tokens, labels, np.ascontiguousarray(seg[:, :-1])


def make_prepared(
    dcfg, *, vocab: int, seq_len: int, global_batch: int
) -> tuple[PreparedDataset, PreparedDataset | None]:
    """(train dataset, validation dataset or None) of DataConfig `dcfg` (kind=prepared)."""
    corpus = Corpus(dcfg.path)
    if corpus.vocab > vocab:
        raise ConfigError(
            "model.vocab",
            vocab,
            f"use model.vocab >= {corpus.vocab} (the tokenizer's size; pad it to a multiple of mesh.tensor)",
            f"{dcfg.path} was tokenized with a vocabulary of {corpus.vocab}",
        )
    train_docs, val_docs = corpus.split(dcfg.val_fraction)
    kw = dict(seed=dcfg.seed, seq_len=seq_len, global_batch=global_batch, vocab=vocab, pack=dcfg.pack_documents)
    train = PreparedDataset(corpus, train_docs, **kw)
    val = PreparedDataset(corpus, val_docs, salt=(VAL_SALT,), name="validation", **kw) if dcfg.val_fraction else None
    return train, val
