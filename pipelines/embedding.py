"""Embed the chunk versions of a micro-batch and lay them out as ``chunks`` rows.

Only upserts are embedded, and of those only content not embedded recently by this
process (same content hash, same model: an LRU cache), so metadata-only changes (title,
ACL), chunks that only moved within their document and repeated text cost nothing while
the cache holds their content. With a context weight (``pipelines.context``) a chunk's row
holds its vector mixed with its neighbours', whose raw vectors come from the same cache
(or are embedded with the batch).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa

from pipelines import metrics
from pipelines.caches import LRU
from pipelines.context import contextual, model_with_context
from pipelines.lake import CHUNKS_SCHEMA, DEAD_LETTERS_SCHEMA
from pipelines.records import ChunkVersion, DeadLetter, DocUpdate
from serving.embedder import Embedder


class BatchEmbedder:
    """Turns micro-batches of :class:`DocUpdate` into Arrow rows of ``chunks``."""

    def __init__(self, embedder: Embedder, cache_size: int = 50_000, context_weight: float = 0.0) -> None:
        self.embedder = embedder
        self.context_weight = context_weight
        self.model = model_with_context(str(embedder.identity), context_weight)
        self.cache: LRU[str, np.ndarray] = LRU(cache_size)  # content hash → the model's own vector

    def rows(self, updates: Sequence[DocUpdate]) -> pa.Table:
        versions = [v for u in updates for v in u.versions]
        vectors = self._vectors(versions)
        now = datetime.now(UTC)
        return pa.table(
            {
                "chunk_id": [v.chunk_id for v in versions],
                "doc_id": [v.doc_id for v in versions],
                "source_table": [v.source_table for v in versions],
                "source_pk": [v.source_pk for v in versions],
                "position": [v.position for v in versions],
                "op": [v.op for v in versions],
                "chunk_index": [v.chunk_index for v in versions],
                "title": [v.title for v in versions],
                "text": [v.text if v.op == "upsert" else None for v in versions],
                "content_hash": [v.content_hash for v in versions],
                "token_count": [v.token_count for v in versions],
                "embedding": vectors,
                "model": [self.model if v.op == "upsert" else None for v in versions],
                "acl": [list(v.acl) for v in versions],
                "metadata": [v.metadata for v in versions],
                "kafka_topic": [v.kafka.topic for v in versions],
                "kafka_partition": [v.kafka.partition for v in versions],
                "kafka_offset": [v.kafka.offset for v in versions],
                "event_time": [_ms_to_dt(v.event_time_ms) for v in versions],
                "ingest_time": [now] * len(versions),
                "writer": [None] * len(versions),
                "writer_seq": [None] * len(versions),
            },
            schema=CHUNKS_SCHEMA,
        )

    def _vectors(self, versions: Sequence[ChunkVersion]) -> pa.Array:
        upserts = [v for v in versions if v.op == "upsert"]
        raw: dict[str, np.ndarray] = {}
        todo: dict[str, tuple[str, int]] = {}  # content hash → (text, tokens) to embed
        for v in upserts:
            wanted = [(v.content_hash, v.text, v.token_count or 0)]
            if self.context_weight:
                wanted.extend((chash, text, 0) for chash, text in v.neighbours)
            for chash, text, count in wanted:
                if chash in raw or chash in todo:
                    continue
                found = self.cache.get(chash)
                if found is not None:
                    raw[chash] = found
                else:
                    todo[chash] = (text, count)
        metrics.CHUNKS.labels("skipped-cached").inc(sum(1 for v in upserts if v.content_hash in raw))
        if todo:
            texts = [text for text, _ in todo.values()]
            tokens = [n for _, n in todo.values()]
            started = time.perf_counter()
            vecs = self.embedder.embed(texts, tokens if all(tokens) else None)
            metrics.EMBED_SECONDS.observe(time.perf_counter() - started)
            metrics.BATCH_SIZE.observe(len(texts))
            metrics.CHUNKS.labels("embedded").inc(len(texts))
            for chash, vec in zip(todo, vecs, strict=True):
                self.cache.put(chash, vec)
                raw[chash] = vec
        metrics.CHUNKS.labels("deleted").inc(len(versions) - len(upserts))
        out = [
            None
            if v.op != "upsert"
            else contextual(raw[v.content_hash], [raw[h] for h, _ in v.neighbours], self.context_weight)
            for v in versions
        ]
        return _vector_column(out, self.embedder.identity.dim)


def _vector_column(vectors: Sequence[np.ndarray | None], dim: int) -> pa.Array:
    """list<float32> column straight from numpy (nulls for deletes), no Python floats."""
    valid = np.array([v is not None for v in vectors], dtype=bool)
    flat = np.zeros((len(vectors), dim), dtype=np.float32)
    for i, v in enumerate(vectors):
        if v is not None:
            flat[i] = v
    offsets = np.zeros(len(vectors) + 1, dtype=np.int32)
    np.cumsum(np.where(valid, dim, 0), out=offsets[1:])
    values = pa.array(flat[valid].reshape(-1), type=pa.float32())
    return pa.ListArray.from_arrays(pa.array(offsets), values, mask=pa.array(~valid))


def dead_letter_rows(letters: Sequence[DeadLetter]) -> pa.Table:
    import json

    now = datetime.now(UTC)
    return pa.table(
        {
            "topic": [d.kafka.topic for d in letters],
            "partition": [d.kafka.partition for d in letters],
            "offset": [d.kafka.offset for d in letters],
            "key": [d.key for d in letters],
            "value": [d.value for d in letters],
            "error": [d.error for d in letters],
            "headers": [json.dumps({k: v.decode("utf-8", "replace") for k, v in d.headers}) for d in letters],
            "ingest_time": [now] * len(letters),
            "writer": [None] * len(letters),
            "writer_seq": [None] * len(letters),
        },
        schema=DEAD_LETTERS_SCHEMA,
    )


def _ms_to_dt(ms: int | None) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, UTC)
