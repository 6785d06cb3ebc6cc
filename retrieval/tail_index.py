"""A small IVF index over a large tail, so its search stays fast between index builds.

Below :data:`TAIL_INDEX_ROWS` rows the tail is searched exactly (one matrix product over
its vectors). Measured on the Python docs' real embeddings, 2 cores
(``benchmarks/retrieval.py --only tail``): exact p50 0.5 / 1.3 / 2.6 ms at 10k / 20k /
39.5k rows, growing linearly; the IVF index 0.2 / 0.33 / 0.66 ms at recall@10 0.966 /
0.982 / 0.987 against exact. Past 20k rows the exact scan costs more than a millisecond
per query and the index keeps recall near 0.98, so that is where it takes over.
Past it, the tail trains its own ``IndexIVFFlat`` (inner product on the normalised
embeddings, so distances are exact for every candidate it scores) in a background
thread and searches that instead; until training ends, search stays exact.

- Appends cost work proportional to the new rows (each is assigned to its nearest list).
- The index is retrained, again in the background, each time the tail doubles past the
  rows it was trained on, so its lists stay balanced as the tail drifts.
- Rows are added with their tail row number as id, and a query passes the caller's
  allowed rows as a bitmap (faiss filters inside the scan), so superseded rows, ACLs,
  metadata filters and a snapshot's row count apply exactly as in the exact search.
- A query that finds fewer than ``k`` allowed rows in the probed lists probes 4x more
  lists until it has ``k`` or has probed them all (as the shard search widens); a caller
  allowed to see only a few rows is searched exactly over those rows.

faiss indexes are not safe to read while rows are added, so appends and the swap to a
retrained index take a write lock and searches a shared read lock.
"""

from __future__ import annotations

import logging
import math
import sys
import threading

import faiss
import numpy as np

from indexing.reader import bitmap_selector
from serving.locks import ReadWriteLock

log = logging.getLogger(__name__)

#: rows past which the tail is searched through its own IVF index (measured: see the module)
TAIL_INDEX_ROWS = 20_000
#: ``min_rows`` of a tail that is never indexed (a one-off tail for an ``as_of`` query)
NEVER = sys.maxsize
#: a caller allowed fewer rows than this is searched exactly over just those rows
EXACT_ALLOWED_ROWS = 4_000


def lists_for(rows: int) -> int:
    """IVF lists for a tail of ``rows``: about 4·√rows, at least 16."""
    return max(16, int(4 * math.sqrt(rows)))


def probes_for(nlist: int) -> int:
    """Lists probed per query: an eighth of them (recall@10 measured by ``--only tail``)."""
    return max(8, nlist // 8)


class TailIndex:
    """The IVF index of one :class:`retrieval.tail.TailLog` (row numbers as ids).

    The log's appending thread calls :meth:`extend`; any thread calls :meth:`search`.
    """

    def __init__(self, dim: int, min_rows: int | None = None) -> None:
        self.dim = dim
        self.min_rows = TAIL_INDEX_ROWS if min_rows is None else min_rows
        self._index: faiss.IndexIVFFlat | None = None
        self._rows = 0  # rows [0, _rows) of the log are in _index
        self._trained_on = 0  # rows the newest training started from
        self._lock = ReadWriteLock()
        self._training: threading.Thread | None = None
        self._ready: tuple[faiss.IndexIVFFlat, int] | None = None  # (a trained index, rows in it)
        self.nprobe = 8

    @property
    def rows(self) -> int:
        return self._rows if self._index is not None else 0

    def extend(self, vectors: np.ndarray, upsert: np.ndarray, n: int) -> None:
        """The log now has ``n`` rows (``vectors`` and ``upsert`` are its buffers)."""
        ready = self._ready
        if ready is not None:  # a (re)trained index: catch it up, then swap it in
            index, covered = ready
            self._add(index, vectors, upsert, covered, n)
            with self._lock.writing():
                self._index, self._rows = index, n
                self.nprobe = probes_for(index.nlist)
            self._ready = None
            log.info("the tail is searched through an IVF index: %d rows, %d lists", n, index.nlist)
        elif self._index is not None and n > self._rows:
            with self._lock.writing():
                self._add(self._index, vectors, upsert, self._rows, n)
                self._rows = n
        wanted = n >= self.min_rows and n >= 2 * self._trained_on
        if wanted and (self._training is None or not self._training.is_alive()) and self._ready is None:
            sample = np.ascontiguousarray(vectors[:n][upsert[:n]])  # a copy: the log's buffer keeps changing
            ids = np.flatnonzero(upsert[:n]).astype(np.int64)
            self._trained_on = n  # (a failed training is not retried until the tail doubles)
            self._training = threading.Thread(
                target=self._train, args=(sample, ids, n), name="tail-index-train", daemon=True
            )
            self._training.start()

    def _train(self, vectors: np.ndarray, ids: np.ndarray, n: int) -> None:
        try:
            nlist = min(lists_for(len(vectors)), max(1, len(vectors) // 39))  # faiss wants 39 points per list
            index = faiss.IndexIVFFlat(faiss.IndexFlatIP(self.dim), self.dim, nlist, faiss.METRIC_INNER_PRODUCT)
            index.cp.max_points_per_centroid = 64  # a bounded sample and few iterations: training takes
            index.cp.niter = 10  # about a second per 20k rows, off the query and append paths
            index.train(vectors)
            index.add_with_ids(vectors, ids)
        except Exception:  # exact search goes on; training is tried again once the tail doubles
            log.exception("training the tail's IVF index failed; the tail is still searched exactly")
            return
        self._ready = (index, n)

    @staticmethod
    def _add(index: faiss.IndexIVFFlat, vectors: np.ndarray, upsert: np.ndarray, start: int, end: int) -> None:
        keep = upsert[start:end]
        if keep.any():
            ids = np.arange(start, end, dtype=np.int64)[keep]
            index.add_with_ids(np.ascontiguousarray(vectors[start:end][keep]), ids)

    def search(self, query: np.ndarray, k: int, allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(rows, squared L2 distances) of the k nearest allowed rows, nearest first; None if the
        index cannot answer."""
        n = len(allowed)
        with self._lock.reading():
            index = self._index
            if index is None or self._rows < n:
                return None
            selector, _bits = bitmap_selector(allowed)  # rows past the snapshot are not selected
            q = np.ascontiguousarray(query[None, :], dtype=np.float32)
            want = min(k, int(allowed.sum()))
            nprobe = self.nprobe
            while True:
                params = faiss.SearchParametersIVF()
                params.sel, params.nprobe = selector, nprobe
                sims, ids = index.search(q, k, params=params)
                found = int((ids[0] >= 0).sum())
                if found >= want or nprobe >= index.nlist:
                    break
                nprobe = min(index.nlist, nprobe * 4)
        hit = ids[0] >= 0
        return ids[0][hit].astype(np.int64), (2.0 - 2.0 * sims[0][hit]).astype(np.float64)
