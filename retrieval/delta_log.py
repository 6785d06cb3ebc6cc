"""Reading the ``chunks`` table's Delta log: the rows each commit added with new data.

The tail (``retrieval.tail``) follows the log one commit file per version: each version
costs one GET, and only the data files a commit *added with new data* are read
(compaction rewrites carry ``dataChange: false`` and are skipped).
"""

from __future__ import annotations

import json
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from indexing.snapshot import commit_changes
from indexing.store import NotFound, ObjectStore, open_store
from pipelines.lake import CHUNKS, CHUNKS_SCHEMA, Lake

#: read at most this many commits per poll, so a far-behind tail still publishes progress
MAX_COMMITS_PER_POLL = 200


class TailError(Exception):
    """The lake's log cannot be followed from the requested version."""


TAIL_SCHEMA = CHUNKS_SCHEMA.append(pa.field("lake_version", pa.int64()))


def with_version(table: pa.Table, version: int) -> pa.Table:
    return table.append_column("lake_version", pa.array(np.full(table.num_rows, version, np.int64)))


class LogReader:
    """Reads the rows that commits of the ``chunks`` table added."""

    def __init__(self, lake: Lake) -> None:
        self.store: ObjectStore = open_store(lake.table_uri(CHUNKS), lake.store)
        #: versions whose commit removed rows with ``dataChange: true`` (a DELETE or an
        #: overwrite: the ingest job never does that; the rows stay served until a new index)
        self.removals: list[int] = []

    def commit(self, version: int) -> list[str] | None:
        """Data files that ``version`` added with new data; None if it does not exist yet."""
        changes = commit_changes(self.store, version)
        if changes is None:
            return None
        if changes.removes_data and version not in self.removals:
            self.removals.append(version)
        return [unquote(add["path"]) for add in changes.adds]

    def cleaned_up(self, after: int) -> bool:
        """Whether lake version ``after + 1`` was committed but its log file is gone.

        Delta removes old log files only behind a checkpoint, so a checkpoint at or past
        that version with no commit file for it means the log was cleaned up there.
        """
        try:
            checkpoint = json.loads(self.store.get("_delta_log/_last_checkpoint"))
        except NotFound:
            return False
        except ValueError as exc:  # being rewritten: look again at the next poll
            raise TailError(f"unreadable _last_checkpoint in {self.store.root}: {exc}") from exc
        return int(checkpoint.get("version", -1)) > after and self.commit(after + 1) is None

    def rows(self, path: str, version: int) -> pa.Table:
        if "://" in path:
            raise TailError(f"data file {path} is outside the table; absolute paths are not supported.")
        # One small file: ParquetFile reads it 2.7x faster than read_table's dataset path (0.31 against 0.85 ms)
        table = pq.ParquetFile(pa.BufferReader(self.store.get(path))).read(use_threads=False)
        present = set(table.schema.names)  # once: ``column_names`` builds a new list at every call
        table = table.select([n for n in CHUNKS_SCHEMA.names if n in present])
        table = table.cast(pa.schema([CHUNKS_SCHEMA.field(n) for n in table.schema.names]))
        for column in CHUNKS_SCHEMA:  # files written before a column existed: nulls, one schema for all
            if column.name not in present:
                table = table.append_column(column, pa.nulls(table.num_rows, column.type))
        return with_version(table.select(CHUNKS_SCHEMA.names), version)

    def read(self, after: int, until: int | None = None, limit: int | None = None) -> tuple[pa.Table, int]:
        """Rows of the commits after version ``after`` (up to ``until``); the last version read."""
        tables: list[pa.Table] = []
        version = after
        while until is None or version < until:
            if limit is not None and version - after >= limit:
                break
            files = self.commit(version + 1)
            if files is None:
                if until is not None:
                    raise TailError(
                        f"lake version {version + 1} is missing from the log of {self.store.root} "
                        "(not written yet, or cleaned up)."
                    )
                break
            version += 1
            tables.extend(self.rows(f, version) for f in files)
        if not tables:
            return with_version(CHUNKS_SCHEMA.empty_table(), 0), version
        return pa.concat_tables(tables, promote_options="permissive"), version


def rows_after(lake: Lake, writer_seqs: dict[str, int]) -> tuple[pa.Table, int]:
    """The rows committed after the point that ``writer_seqs`` describes, read from the table's
    current snapshot rather than its log; all tagged with that snapshot's version.

    Each lake writer numbers its commits, and every row carries its writer's number, so the
    rows after an index's snapshot are exactly those whose ``writer_seq`` exceeds what the
    index's manifest recorded for their writer (writers it never saw: all their rows).
    Which commit wrote each row is no longer known, so ``lake_version`` is the snapshot's.
    """
    table = lake.table(CHUNKS)
    dataset = table.to_pyarrow_dataset()
    known = list(writer_seqs)
    after = ~ds.field("writer").isin(known) if known else ds.scalar(True)
    for writer, seq in writer_seqs.items():
        after = after | ((ds.field("writer") == writer) & (ds.field("writer_seq") > seq))
    present = [n for n in CHUNKS_SCHEMA.names if n in dataset.schema.names]
    rows = dataset.to_table(columns=present, filter=after & ds.field("writer").is_valid())
    for column in CHUNKS_SCHEMA:
        if column.name not in rows.column_names:
            rows = rows.append_column(column, pa.nulls(rows.num_rows, column.type))
    rows = rows.select(CHUNKS_SCHEMA.names).cast(CHUNKS_SCHEMA)
    # Commit order within the tail: by writer and commit number (positions order each document).
    rows = rows.take(pc.sort_indices(rows, [("writer", "ascending"), ("writer_seq", "ascending")]))
    return with_version(rows, table.version()), table.version()
