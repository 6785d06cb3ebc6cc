"""Synthetic lakes: seeded unit vectors written as `chunks` rows by the real lake writer."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import pyarrow as pa

from pipelines.lake import CHUNKS, CHUNKS_SCHEMA, Lake
from pipelines.lake_writer import LakeWriter
from tests.indexing.test_kmeans import clustered

MODEL = "synthetic@0123456789abcdef/{dim}"


def chunk_rows(
    vectors: np.ndarray,
    start: int = 0,
    op: str = "upsert",
    model: str | None = None,
    position: str = "pg:00000000000000000100",
) -> pa.Table:
    n, dim = vectors.shape
    model = model or MODEL.format(dim=dim)
    ids = [f"c{start + i:07d}" for i in range(n)]
    now = datetime.now(UTC)
    values = pa.array(vectors.astype(np.float32).ravel(), pa.float32())
    offsets = pa.array(np.arange(0, (n + 1) * dim, dim, dtype=np.int32))
    return pa.table(
        {
            "chunk_id": ids, "doc_id": [f"public.docs/{start + i}" for i in range(n)],
            "source_table": ["public.docs"] * n, "source_pk": [str(start + i) for i in range(n)],
            "position": [position] * n, "op": [op] * n, "chunk_index": [0] * n, "title": ["t"] * n,
            "text": [f"text {start + i}" for i in range(n)], "content_hash": ids, "token_count": [5] * n,
            "embedding": pa.ListArray.from_arrays(offsets, values), "model": [model] * n,
            "acl": [[] for _ in range(n)], "metadata": [None] * n, "kafka_topic": ["t"] * n, "kafka_partition": [0] * n,
            "kafka_offset": list(range(start, start + n)), "event_time": [now] * n, "ingest_time": [now] * n,
            "writer": [None] * n, "writer_seq": [None] * n,
        },
        schema=CHUNKS_SCHEMA,
    )  # fmt: skip


def synthetic_lake(
    uri: str, n: int = 4000, dim: int = 32, seed: int = 0, files: int = 4, store=None
) -> tuple[Lake, np.ndarray]:  # type: ignore[no-untyped-def]
    lake = Lake.at(uri, store)
    lake.ensure_tables(1)
    x = clustered(n, dim, seed=seed)
    writer = LakeWriter(lake, CHUNKS, "synthetic", None)
    for i, part in enumerate(np.array_split(np.arange(n), files)):
        writer.write(chunk_rows(x[part], start=int(part[0]) if len(part) else i))
    return lake, x
