"""What a search returns: each hit as a chunk version with where it came from.

One record shape serves search results, answer sources and citations, lineage's chunk
versions and the audit log's sources: :class:`SourceRef` is where a chunk version came
from (source table, key, position, event time, Kafka coordinates), read from a lake or
id-map row by :meth:`SourceRef.from_row`, shown as the API's nested ``"source"`` object
by :meth:`SourceRef.as_json`, and flattened into the audit table by
:meth:`SourceRef.as_columns`. :data:`SOURCE_COLUMNS` are the row columns it needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np

from retrieval.filters import parse_metadata

#: the row columns a chunk version's source needs
SOURCE_COLUMNS = [
    "source_table",
    "source_pk",
    "position",
    "event_time",
    "kafka_topic",
    "kafka_partition",
    "kafka_offset",
]

#: what a result needs of its chunk's row (reading fewer columns makes lineage cheap)
RESULT_COLUMNS = ["chunk_id", "doc_id", "title", "text", "chunk_index", "metadata", *SOURCE_COLUMNS]


@dataclass(frozen=True)
class SourceRef:
    """Where a chunk version came from: the source row and the change that made it."""

    table: str
    pk: str
    position: str
    event_time: Any  # a datetime from the lake, an ISO string once shown
    topic: str
    partition: int
    offset: int

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> SourceRef:
        return cls(row["source_table"], row["source_pk"], row["position"], row.get("event_time"),
                   row["kafka_topic"], row["kafka_partition"], row["kafka_offset"])  # fmt: skip

    @classmethod
    def from_json(cls, shown: dict[str, Any]) -> SourceRef:
        kafka = shown["kafka"]
        return cls(shown["table"], shown["pk"], shown["position"], shown.get("event_time"),
                   kafka["topic"], kafka["partition"], kafka["offset"])  # fmt: skip

    def as_json(self) -> dict[str, Any]:
        return {
            "table": self.table,
            "pk": self.pk,
            "position": self.position,
            "event_time": iso(self.event_time),
            "kafka": {"topic": self.topic, "partition": self.partition, "offset": self.offset},
        }

    def as_columns(self) -> dict[str, Any]:
        """The audit table's flat columns for it."""
        return {"source_table": self.table, "source_pk": self.pk, "position": self.position,
                "kafka_topic": self.topic, "kafka_partition": self.partition, "kafka_offset": self.offset}  # fmt: skip


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
    #: how results were ranked: "hybrid", "dense" or "keyword"
    mode: str = "dense"


def iso(value: Any) -> Any:
    """A datetime as ISO 8601 text (what JSON shows); anything else as it is."""
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
        "source": SourceRef.from_row(row).as_json(),
        "metadata": parse_metadata(row.get("metadata")),
        "lake_version": lake_version,
        "index_version": index_version,
        "origin": origin,
    }
