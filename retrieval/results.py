"""What a search returns: each hit as a chunk version with where it came from.

One record shape serves search results, answer sources and citations, and what lineage
and the audit log store of them (:func:`result_record`, :data:`RESULT_COLUMNS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np

from retrieval.filters import parse_metadata

#: what a result needs of its chunk's row (reading fewer columns makes lineage cheap)
RESULT_COLUMNS = [
    "chunk_id", "doc_id", "title", "text", "chunk_index", "metadata", "source_table", "source_pk", "position",
    "event_time", "kafka_topic", "kafka_partition", "kafka_offset",
]  # fmt: skip


@dataclass
class SearchResult:
    results: list[dict[str, Any]]
    index_version: int
    lake_version: int
    nprobe: int
    tail_rows: int
    timings: dict[str, float]
    #: the stored embedding of each result, in order (answers compare sentences with them)
    vectors: np.ndarray | None = None


def _iso(value: object) -> object:
    return value.isoformat() if isinstance(value, datetime) else value


def result_record(
    row: dict[str, Any], score: float, lake_version: int, index_version: int, origin: str
) -> dict[str, Any]:
    """One result as the API returns it: the chunk version and where it came from."""
    return {
        "chunk_id": row["chunk_id"],
        "doc_id": row["doc_id"],
        "title": row.get("title"),
        "text": row["text"],
        "chunk_index": row.get("chunk_index"),
        "score": round(float(score), 6),
        "source": {
            "table": row["source_table"],
            "pk": row["source_pk"],
            "position": row["position"],
            "event_time": _iso(row.get("event_time")),
            "kafka": {"topic": row["kafka_topic"], "partition": row["kafka_partition"], "offset": row["kafka_offset"]},
        },
        "metadata": parse_metadata(row.get("metadata")),
        "lake_version": lake_version,
        "index_version": index_version,
        "origin": origin,
    }
