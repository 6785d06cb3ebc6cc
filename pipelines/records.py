"""Records that travel through the streaming job: frozen dataclasses at the edges."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Op = Literal["upsert", "delete"]


@dataclass(frozen=True)
class KafkaCoordinates:
    """Where a message sits in Kafka: the change position of last resort."""

    topic: str
    partition: int
    offset: int


@dataclass(frozen=True)
class ChangeEvent:
    """One decoded Debezium change of one source row (one document).

    ``position`` orders changes of one document (see :mod:`pipelines.debezium`);
    ``None`` only for a Kafka tombstone, which carries no source position.
    """

    source_table: str
    source_pk: str
    op: Op
    position: str | None
    kafka: KafkaCoordinates
    event_time_ms: int | None
    title: str = ""
    text: str = ""
    acl: tuple[str, ...] = ()
    metadata: tuple[tuple[str, str], ...] = ()
    tombstone: bool = False

    @property
    def doc_id(self) -> str:
        return doc_id_for(self.source_table, self.source_pk)


def doc_id_for(source_table: str, source_pk: str) -> str:
    """Document id: the source table and primary key, readable and unique."""
    return f"{source_table}/{source_pk}"


@dataclass(frozen=True)
class DeadLetter:
    """A message that could not be decoded or mapped, with the reason and original bytes."""

    kafka: KafkaCoordinates
    key: bytes | None
    value: bytes | None
    error: str
    headers: tuple[tuple[str, bytes], ...] = ()


@dataclass(frozen=True)
class ChunkVersion:
    """One version of one chunk, before embedding (``text`` set for upserts only)."""

    chunk_id: str
    doc_id: str
    source_table: str
    source_pk: str
    position: str
    op: Op
    chunk_index: int
    text: str
    content_hash: str
    acl: tuple[str, ...]
    kafka: KafkaCoordinates
    event_time_ms: int | None
    token_count: int = 0
    title: str = ""
    #: the document's mapped metadata columns as a JSON object (sorted keys); None = none mapped
    metadata: str | None = None
    #: (content hash, text) of the chunks just before and after it in its document, for a
    #: contextual vector (``pipelines.context``); empty when the job mixes in no context
    neighbours: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class DocUpdate:
    """What one change event did to one document: the chunk versions to write."""

    doc_id: str
    kafka: KafkaCoordinates
    event_time_ms: int | None
    versions: tuple[ChunkVersion, ...] = field(default=())
