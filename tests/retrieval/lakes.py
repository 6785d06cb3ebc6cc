"""Small lakes of one-chunk documents with known text and ACLs, embedded by the fake embedder."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pipelines.lake import CHUNKS, Lake
from pipelines.lake_writer import LakeWriter
from serving.embedder import Embedder
from tests.indexing.lakes import chunk_rows


@dataclass(frozen=True)
class Doc:
    pk: int
    text: str
    acl: tuple[str, ...] = ()
    metadata: str | None = None  # JSON object, as the ingest job stores it

    @property
    def chunk_id(self) -> str:
        return hashlib.sha256(f"{self.pk}:{self.text}".encode()).hexdigest()[:32]


def rows(embedder: Embedder, docs: list[Doc], position: int, op: str = "upsert") -> pa.Table:
    vectors = embedder.embed([d.text for d in docs]) if op == "upsert" else np.zeros((len(docs), 32), np.float32)
    table = chunk_rows(vectors, model=str(embedder.identity), op=op, position=f"pg:{position:020d}")
    replace = {
        "chunk_id": [d.chunk_id for d in docs],
        "doc_id": [f"public.docs/{d.pk}" for d in docs],
        "source_pk": [str(d.pk) for d in docs],
        "text": [d.text if op == "upsert" else "" for d in docs],
        "acl": pa.array([list(d.acl) for d in docs], pa.list_(pa.string())),
        "metadata": pa.array([d.metadata for d in docs], pa.string()),
    }
    for name, values in replace.items():
        table = table.set_column(
            table.schema.get_field_index(name), name, pa.array(values) if isinstance(values, list) else values
        )
    return table


class DocLake:
    """A lake written through the real lake writer, one commit per call."""

    def __init__(self, uri: str, embedder: Embedder) -> None:
        self.lake = Lake.at(uri)
        self.lake.ensure_tables(1)
        self.embedder = embedder
        self.writer = LakeWriter(self.lake, CHUNKS, "test", None)
        self.position = 100

    def write(self, docs: list[Doc], op: str = "upsert") -> int:
        self.position += 1
        self.writer.write(rows(self.embedder, docs, self.position, op))
        return self.lake.table(CHUNKS).version()
