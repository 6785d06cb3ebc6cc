"""A retriever's candidates as arrays: what hybrid search fuses.

Hybrid search takes 100 candidates from each retriever and returns 10. Kept as arrays from
faiss and tantivy through the fusion, only the results become Python objects: one tuple,
``Hit`` and dict per candidate cost a hybrid query about a fifth of its time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from indexing.reader import Hit

#: an index row's key: its shard << SHARD_SHIFT | its faiss id (a tail row's: -1 - its row),
#: which is its keyword document's key (``indexing.keyword.index_key``) as it is
SHARD_SHIFT = 32


@dataclass(frozen=True)
class Ranking:
    """Candidates best first: ``scores`` (higher is better: cosine or BM25) and ``keys``
    (``index_keys`` or ``tail_keys``)."""

    scores: np.ndarray
    keys: np.ndarray

    def __len__(self) -> int:
        return len(self.keys)

    def head(self, n: int) -> Ranking:
        return Ranking(self.scores[:n], self.keys[:n])


def index_keys(shards: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return (np.asarray(shards, np.int64) << SHARD_SHIFT) | np.asarray(ids, np.int64)


def tail_keys(rows: np.ndarray) -> np.ndarray:
    return -1 - np.asarray(rows, np.int64)


def empty() -> Ranking:
    return Ranking(np.zeros(0), np.zeros(0, np.int64))


def reference(key: int) -> tuple[str, Hit | int]:
    """A candidate's origin and what its row is read by: an index ``Hit`` (its distance is not
    carried: a result's score is the fusion's) or a tail row."""
    if key < 0:
        return "tail", -1 - key
    return "index", Hit(key >> SHARD_SHIFT, key & ((1 << SHARD_SHIFT) - 1), 0.0)
