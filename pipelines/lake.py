"""The lake: Delta tables under one URI (``chunks``, ``dead_letters``), schemas and readers.

``chunks`` is an append-only log of chunk versions; the current state of a chunk is its
row with the greatest ``position`` (then ``ingest_time``), and a chunk whose latest row
is a delete is gone. :func:`current_chunks` computes that state at any table version.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError

from pipelines.storage import ObjectStoreSettings, join, normalize_uri

log = logging.getLogger(__name__)

CHUNKS = "chunks"
DEAD_LETTERS = "dead_letters"

#: How many writers (Delta app ids) feed the lake is recorded in the table description
#: (Delta rejects unknown table properties). It must not change for a lake: replayed
#: rows are deduplicated per writer.
_DESCRIPTION = "streamrag {name} table; writers={writers}"

_TS = pa.timestamp("us", tz="UTC")

CHUNKS_SCHEMA = pa.schema(
    [
        ("chunk_id", pa.string()),
        ("doc_id", pa.string()),
        ("source_table", pa.string()),
        ("source_pk", pa.string()),
        ("position", pa.string()),
        ("op", pa.string()),
        ("chunk_index", pa.int32()),
        ("title", pa.string()),
        ("text", pa.string()),
        ("content_hash", pa.string()),
        ("token_count", pa.int32()),
        ("embedding", pa.list_(pa.float32())),
        ("model", pa.string()),
        ("acl", pa.list_(pa.string())),
        ("metadata", pa.string()),  # JSON object of the table's mapped metadata columns (null: none)
        ("kafka_topic", pa.string()),
        ("kafka_partition", pa.int32()),
        ("kafka_offset", pa.int64()),
        ("event_time", _TS),
        ("ingest_time", _TS),
        ("writer", pa.string()),
        ("writer_seq", pa.int64()),
    ]
)

DEAD_LETTERS_SCHEMA = pa.schema(
    [
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("error", pa.string()),
        ("headers", pa.string()),
        ("ingest_time", _TS),
        ("writer", pa.string()),
        ("writer_seq", pa.int64()),
    ]
)

SCHEMAS = {CHUNKS: CHUNKS_SCHEMA, DEAD_LETTERS: DEAD_LETTERS_SCHEMA}

#: Columns that identify a row across replays (what the writer deduplicates on).
IDENTITY = {CHUNKS: ("chunk_id", "position", "op"), DEAD_LETTERS: ("topic", "partition", "offset")}


class LakeError(Exception):
    """The lake is missing, unreachable or inconsistent; the message says what to do."""


@dataclass(frozen=True)
class Lake:
    """A lake URI and the settings to reach it."""

    uri: str
    store: ObjectStoreSettings = field(default_factory=ObjectStoreSettings)

    @classmethod
    def at(cls, uri: str, store: ObjectStoreSettings | None = None) -> Lake:
        return cls(normalize_uri(uri), store or ObjectStoreSettings())

    def table_uri(self, name: str) -> str:
        return join(self.uri, name)

    @property
    def options(self) -> dict[str, str] | None:
        return self.store.delta_options(self.uri)

    def ensure_tables(self, writers: int) -> int:
        """Create missing tables; return the writer count the lake was created with."""
        for name, schema in SCHEMAS.items():
            DeltaTable.create(
                self.table_uri(name),
                schema,
                mode="ignore",
                description=_DESCRIPTION.format(name=name, writers=writers),
                storage_options=self.options,
            )
        self._add_missing_columns()
        description = self.table(CHUNKS).metadata().description or ""
        _, _, recorded = description.rpartition("writers=")
        return int(recorded) if recorded.isdigit() else writers

    def _add_missing_columns(self) -> None:
        for name, schema in SCHEMAS.items():
            add_missing_columns(self, name, schema)

    def table(self, name: str, version: int | None = None) -> DeltaTable:
        try:
            return DeltaTable(self.table_uri(name), version=version, storage_options=self.options)
        except TableNotFoundError as exc:
            raise LakeError(f"no Delta table {name!r} under {self.uri}; run `streamrag ingest` first.") from exc

    def read(self, name: str, version: int | None = None, columns: list[str] | None = None) -> pa.Table:
        return self.table(name, version).to_pyarrow_table(columns=columns)


def add_missing_columns(lake: Lake, name: str, schema: pa.Schema) -> None:
    """Tables made by older versions lack newer (nullable) columns: add them, keeping every row."""
    from deltalake.schema import Field

    table = lake.table(name)
    present = set(table.schema().to_arrow().names)
    missing = [f for f in schema if f.name not in present]
    if not missing:
        return
    log.info("adding columns %s to the %s table", [f.name for f in missing], name)
    try:
        table.alter.add_columns([Field.from_arrow(f) for f in missing])
    except Exception:  # another process may have added them first
        present = set(lake.table(name).schema().to_arrow().names)
        if any(f.name not in present for f in missing):
            raise


def models_in(lake: Lake) -> set[str]:
    """Model identities of the vectors in ``chunks``, from file statistics (no data read)."""
    actions = pa.table(lake.table(CHUNKS).get_add_actions(flatten=True))
    found: set[str] = set()
    for col in ("min.model", "max.model"):
        if col in actions.column_names:
            found.update(m for m in actions.column(col).to_pylist() if m)
    return found


def check_model(lake: Lake, model: str) -> None:
    """Refuse to mix vectors of another model into a lake (a new model needs a new lake)."""
    others = models_in(lake) - {model}
    if others:
        raise LakeError(
            f"the lake at {lake.uri} holds vectors of {sorted(others)}, but this job embeds with "
            f"{model}; vectors of different models must not mix. Use a new --lake, or --model "
            "(and --dtype, --context-weight: the part after '+context=') matching the lake."
        )


def latest_rows(table: pa.Table) -> pa.Table:
    """The latest version of each chunk id (greatest position, then ingest_time)."""
    if table.num_rows == 0:
        return table
    order = pc.sort_indices(
        table,
        sort_keys=[("chunk_id", "ascending"), ("position", "ascending"), ("ingest_time", "ascending")],
    )
    ordered = table.take(order)
    ids = ordered.column("chunk_id").to_numpy(zero_copy_only=False)
    last = np.ones(len(ids), dtype=bool)
    last[:-1] = ids[:-1] != ids[1:]
    return ordered.filter(pa.array(last))


def current_chunks(lake: Lake, version: int | None = None, columns: list[str] | None = None) -> pa.Table:
    """The live chunks at a table version: latest row per chunk id, deletes removed."""
    needed = None
    if columns is not None:
        needed = list(dict.fromkeys([*columns, "chunk_id", "position", "ingest_time", "op"]))
    latest = latest_rows(lake.read(CHUNKS, version, needed))
    live = latest.filter(pc.equal(latest.column("op"), "upsert"))
    return live.select(columns) if columns is not None else live


def embeddings(table: pa.Table, dim: int | None = None) -> np.ndarray:
    """The ``embedding`` column as an (n, dim) float32 array."""
    col = table.column("embedding").combine_chunks()
    flat = col.flatten().to_numpy().astype(np.float32, copy=False)
    if table.num_rows == 0:
        return np.zeros((0, dim or 0), dtype=np.float32)
    return np.asarray(flat.reshape(table.num_rows, -1), dtype=np.float32)
