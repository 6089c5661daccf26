"""The dataset base class, shared by meshrun/data/datasets.py and meshrun/data/prepared.py."""

from __future__ import annotations

import numpy as np


class Dataset:
    """Base: `batch(step, rows)` -> (tokens_BxL, labels_BxL) int32, deterministic in (seed, step, row).
    Packed datasets add segment_ids_BxL as a third array; `val` is the held-out split (or None)."""

    val: Dataset | None = None

    def __init__(self, seed: int, seq_len: int, global_batch: int, vocab: int):
        self.seed, self.seq_len, self.global_batch, self.vocab = seed, seq_len, global_batch, vocab

    def _row(self, rng: np.random.Generator) -> np.ndarray:  # one window of L+1 token ids
        raise NotImplementedError

    def _rng(self, step: int, row: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, step, row])

    def _windows(self, step: int, idx: range) -> np.ndarray:  # (rows, L+1)
        win = np.empty((len(idx), self.seq_len + 1), np.int32)
        for i, r in enumerate(idx):
            win[i] = self._row(self._rng(step, r))
        return win

    def batch(self, step: int, rows: slice | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(tokens_BxL, labels_BxL) int32 for global rows `rows` (default: all) of step `step`."""
        rows = rows if rows is not None else slice(0, self.global_batch)
        win_BxL1 = self._windows(step, range(*rows.indices(self.global_batch)))
        return win_BxL1[:, :-1], win_BxL1[:, 1:]
