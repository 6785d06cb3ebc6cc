"""Query embedding for a service: many request threads, shared model batches, a cache."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np

from pipelines.caches import LRU
from serving.embedder import Embedder
from serving.waiting import may_wait


class QueryEmbedder:
    """Embeds queries from many threads in shared batches (one batch runs at a time)."""

    def __init__(self, embedder: Embedder, max_batch: int = 32, cache_size: int = 4096) -> None:
        self.embedder = embedder
        self.max_batch = max_batch
        self._pending: list[tuple[str, Future[np.ndarray]]] = []
        self._pending_lock = threading.Lock()
        self._run_lock = threading.Lock()
        self._cache: LRU[str, np.ndarray] = LRU(cache_size)

    def embed(self, text: str) -> np.ndarray:
        return self._cache.get_or_make(text, lambda: self._embed(text))

    def embed_texts(self, texts: list[str]) -> np.ndarray:
        """A batch of other texts (answer sentences, sources), one model call at a time."""
        with self._run_lock:
            return self.embedder.embed(texts)

    def _embed(self, text: str) -> np.ndarray:
        may_wait("embedding the query")
        future: Future[np.ndarray] = Future()
        with self._pending_lock:
            self._pending.append((text, future))
        while not future.done():
            with self._run_lock:
                if future.done():
                    break
                with self._pending_lock:
                    batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
                try:
                    vectors = self.embedder.embed([t for t, _ in batch])
                except Exception as exc:  # noqa: BLE001 - every waiter gets the error
                    for _, f in batch:
                        f.set_exception(exc)
                else:
                    for (_, f), v in zip(batch, vectors, strict=True):
                        f.set_result(v)
        return future.result()
