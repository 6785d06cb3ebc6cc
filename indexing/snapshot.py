"""A snapshot of the lake at one Delta version, planned for builders to read in parallel.

The driver reads only small metadata columns (ids, positions, ops, models) to decide which
rows are live (latest version of each chunk, deletes removed); vectors are read later,
by each builder straight from the lake files of its own partition.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from indexing.store import NotFound, ObjectStore, open_store
from pipelines.context import query_model
from pipelines.lake import CHUNKS, CHUNKS_SCHEMA, Lake, LakeError, embeddings, latest_rows

#: What a shard's id map keeps of each chunk: enough to answer and to trace lineage.
ROW_COLUMNS = [
    "chunk_id", "doc_id", "source_table", "source_pk", "position", "chunk_index", "title", "text",
    "content_hash", "acl", "metadata", "kafka_topic", "kafka_partition", "kafka_offset", "event_time", "ingest_time",
]  # fmt: skip


@dataclass(frozen=True)
class FileRows:
    """Live rows of one lake file (row numbers within the file)."""

    path: str
    rows: tuple[int, ...]


@dataclass(frozen=True)
class Changes:
    """What changed after an earlier snapshot, given by its writers' last commit numbers."""

    touched: pa.ChunkedArray  # chunk ids with any row (upsert or delete) committed after it, unique
    live: tuple[FileRows, ...]  # the live rows of those chunks now
    count: int  # rows in ``live``


@dataclass(frozen=True)
class Snapshot:
    lake: Lake
    version: int
    model: str
    dim: int
    count: int
    files: tuple[FileRows, ...]
    #: each lake writer's last commit number in the snapshot: the rows after it are exactly
    #: those with a greater ``writer_seq`` (how a tail is rebuilt once the log is cleaned up)
    writer_seqs: dict[str, int] = field(default_factory=dict)
    #: rows (of any op) without a writer tag: older lakes' rows, invisible to ``writer_seqs``
    untagged_rows: int = 0
    #: (chunk_id, writer, writer_seq) of every row, and (chunk_id, _file, _row) of the live ones;
    #: ``_file`` numbers the data files of ``_paths`` (4 bytes a row, not a path string a row)
    _meta: pa.Table | None = field(default=None, repr=False, compare=False)
    _live: pa.Table | None = field(default=None, repr=False, compare=False)
    _paths: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def changes_since(self, writer_seqs: dict[str, int]) -> Changes:
        """The chunks with rows committed after the snapshot that ``writer_seqs`` describes
        (writers it does not name: all their rows), and the live rows of those chunks now."""
        assert self._meta is not None and self._live is not None, "a snapshot from plan() knows its rows"
        writer = pc.field("writer")
        after = pc.invert(writer.isin(list(writer_seqs))) if writer_seqs else pc.scalar(True)
        for name, seq in writer_seqs.items():
            after = after | ((writer == name) & (pc.field("writer_seq") > seq))
        touched = pc.unique(self._meta.filter(after & writer.is_valid()).column("chunk_id"))
        live = self._live.filter(pc.is_in(self._live.column("chunk_id"), touched))
        return Changes(pa.chunked_array([touched]), _by_file(live, self._paths), live.num_rows)

    def restricted(self, files: tuple[FileRows, ...]) -> Snapshot:
        """The same snapshot, reading only ``files``' rows (a delta for builders)."""
        return Snapshot(self.lake, self.version, self.model, self.dim, sum(len(f.rows) for f in files), files,
                        self.writer_seqs, self.untagged_rows)  # fmt: skip

    def partitions(self, n: int) -> list[list[FileRows]]:
        """Files spread over n partitions, balanced by live rows (largest first)."""
        parts: list[list[FileRows]] = [[] for _ in range(max(1, n))]
        loads = [0] * len(parts)
        for f in sorted(self.files, key=lambda f: -len(f.rows)):
            i = loads.index(min(loads))
            parts[i].append(f)
            loads[i] += len(f.rows)
        return [p for p in parts if p]


@dataclass
class Partition:
    """What one builder holds: vectors and their rows' metadata, in the same order."""

    vectors: np.ndarray
    rows: pa.Table
    labels: np.ndarray | None = None


def plan(lake: Lake, version: int | None = None) -> Snapshot:
    """Decide the live rows at ``version`` (latest by default) from metadata alone."""
    table = lake.table(CHUNKS, version)
    dataset = table.to_pyarrow_dataset()
    pieces = []
    paths: list[str] = []
    for fragment in dataset.get_fragments():
        meta = as_chunks_types(
            fragment.to_table(columns=["chunk_id", "position", "ingest_time", "op", "model", "writer", "writer_seq"])
        )
        n = meta.num_rows
        meta = meta.append_column("_file", pa.array(np.full(n, len(paths), dtype=np.int32)))
        paths.append(fragment.path)
        pieces.append(meta.append_column("_row", pa.array(np.arange(n, dtype=np.int64))))
    if not pieces:
        raise LakeError(f"the lake at {lake.uri} has no chunks at version {table.version()}; ingest first.")
    meta = pa.concat_tables(pieces)
    live = latest_rows(meta)
    live = live.filter(pc.equal(live.column("op"), "upsert"))
    if live.num_rows == 0:
        raise LakeError(f"the lake at {lake.uri} has no live chunks at version {table.version()}.")
    models = set(live.column("model").to_pylist())
    if len(models) != 1 or None in models:
        raise LakeError(
            f"the live chunks at version {table.version()} were embedded by {len(models)} models "
            f"({sorted(str(m) for m in models)}); an index needs one. Re-ingest into a new lake."
        )
    model = str(models.pop())
    dim = int(query_model(model).rsplit("/", 1)[1])  # name@hash/dim, then any context weight
    return Snapshot(
        lake, table.version(), model, dim, live.num_rows, _by_file(live, tuple(paths)), writer_seqs(meta),
        meta.num_rows - pc.count(meta.column("writer")).as_py(),
        meta.select(["chunk_id", "writer", "writer_seq"]), live.select(["chunk_id", "_file", "_row"]), tuple(paths),
    )  # fmt: skip


def as_chunks_types(table: pa.Table) -> pa.Table:
    """The columns cast to the ``chunks`` schema's types where a file differs: files that
    deltalake itself rewrote (a DELETE, a compaction) may hold ``string_view`` columns, which
    do not concatenate with the lake writer's ``string`` ones."""
    fields = [
        CHUNKS_SCHEMA.field(f.name)
        if f.name in CHUNKS_SCHEMA.names and f.type != CHUNKS_SCHEMA.field(f.name).type
        else f
        for f in table.schema
    ]
    target = pa.schema(fields)
    return table if target == table.schema else table.cast(target)


def _by_file(live: pa.Table, paths: tuple[str, ...]) -> tuple[FileRows, ...]:
    """The live rows grouped by data file (files by path, rows in order)."""
    if live.num_rows == 0:
        return ()
    files = live.column("_file").to_numpy()
    rows = live.column("_row").to_numpy()
    order = np.lexsort((rows, files))
    files, rows = files[order], rows[order]
    cuts = np.flatnonzero(np.diff(files)) + 1
    grouped = [
        FileRows(paths[int(f[0])], tuple(r.tolist()))
        for f, r in zip(np.split(files, cuts), np.split(rows, cuts), strict=True)
    ]
    return tuple(sorted(grouped, key=lambda f: f.path))


def writer_seqs(rows: pa.Table) -> dict[str, int]:
    """The greatest ``writer_seq`` of each writer among ``rows`` (rows without a writer are left out)."""
    tagged = rows.filter(pc.is_valid(rows.column("writer")))
    if tagged.num_rows == 0:
        return {}
    grouped = tagged.group_by("writer").aggregate([("writer_seq", "max")])
    return {
        str(w): int(s) for w, s in zip(*grouped.select(["writer", "writer_seq_max"]).to_pydict().values(), strict=True)
    }


@dataclass(frozen=True)
class CommitChanges:
    """What one Delta commit changed in the data: compaction rewrites (``dataChange: false``) left out."""

    adds: list[dict[str, Any]]  # the ``add`` actions of files with new data
    removes_data: bool  # whether it removed rows (a DELETE or an overwrite)
    timestamp_ms: int | None = None  # its commit info's timestamp (None: the writer wrote none)


def commit_changes(store: ObjectStore, version: int) -> CommitChanges | None:
    """The data changes of commit ``version`` of the Delta table in ``store`` (one GET); None if
    its log file does not exist (not committed yet, or cleaned up)."""
    try:
        raw = store.get(f"_delta_log/{version:020d}.json")
    except NotFound:
        return None
    adds, removes, timestamp = [], False, None
    for line in raw.decode().splitlines():
        if not line.strip():
            continue
        action = json.loads(line)
        add, remove, info = action.get("add"), action.get("remove"), action.get("commitInfo")
        if add and add.get("dataChange", True):
            adds.append(add)
        if remove and remove.get("dataChange", True):
            removes = True
        if info and "timestamp" in info:
            timestamp = int(info["timestamp"])
    return CommitChanges(adds, removes, timestamp)


def rows_committed(lake: Lake, after: int, until: int) -> int | None:
    """Rows that commits (after, until] of the ``chunks`` table added with new data, from the
    log's file statistics (one small GET per commit); None if a commit's log or statistics
    are gone (a cleaned-up log, a writer without statistics): the count is unknown.

    Compaction rewrites (``dataChange: false``) are not counted: they change no chunk.
    """
    store = open_store(lake.table_uri(CHUNKS), lake.store)
    total = 0
    for version in range(after + 1, until + 1):
        changes = commit_changes(store, version)
        if changes is None:
            return None
        for add in changes.adds:
            records = json.loads(add.get("stats") or "{}").get("numRecords")
            if records is None:
                return None
            total += int(records)
    return total


def load_partition(lake: Lake, version: int, files: list[FileRows]) -> Partition:
    """Read one partition's live rows (vectors + metadata) straight from the lake files.

    File by file, each file's vectors copied into one array sized for the partition: the
    peak is the partition plus one file's rows, never a second copy of the partition."""
    dataset = lake.table(CHUNKS, version).to_pyarrow_dataset()
    wanted = {f.path: f.rows for f in files}
    present = [c for c in ROW_COLUMNS if c in dataset.schema.names]  # lakes older than a column lack it
    total = sum(len(rows) for rows in wanted.values())
    vectors: np.ndarray | None = None
    tables, at = [], 0
    for fragment in dataset.get_fragments():
        rows = wanted.get(fragment.path)
        if rows is None:
            continue
        data = as_chunks_types(fragment.to_table(columns=[*present, "embedding"]))
        if len(rows) != data.num_rows:  # rows are sorted and unique: as many as the file holds means all of them
            data = data.take(pa.array(rows, pa.int64()))
        block = embeddings(data)
        if vectors is None:
            vectors = np.empty((total, block.shape[1]), np.float32)
        vectors[at : at + len(block)] = block
        at += len(block)
        del block
        data = data.drop_columns(["embedding"])
        for name in ROW_COLUMNS:
            if name not in present:
                data = data.append_column(
                    CHUNKS_SCHEMA.field(name), pa.nulls(data.num_rows, CHUNKS_SCHEMA.field(name).type)
                )
        tables.append(data.select(ROW_COLUMNS))
    if len(tables) != len(wanted):
        raise LakeError(f"{len(wanted) - len(tables)} lake files of version {version} were not found.")
    if vectors is None:
        vectors = np.zeros((0, 0), np.float32)
    return Partition(vectors, pa.concat_tables(tables))
