"""The fresh tail: chunk versions the lake committed after the index's snapshot.

The tail reads the ``chunks`` table's Delta log directly, one commit file per version
after the index's lake version V, and only the data files those commits *added with new
data* (compaction rewrites carry ``dataChange: false`` and are skipped), so each poll
costs one GET when nothing changed and reads each new row once.

Its state is immutable and replaced whole on each change, so a query searches one
consistent tail while the next poll builds the following one:

- ``rows``: the latest version after V of every chunk id that changed (upserts and
  deletes), tagged with the lake version that committed it;
- ``live``/``vectors``: its upserts, searched exactly with every query;
- ``superseded``: every chunk id in ``rows`` — the index's copies of these are stale
  (updated, re-permissioned or deleted) and are filtered out of shard results.
"""

from __future__ import annotations

import io
import json
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from indexing.store import NotFound, ObjectStore, open_store
from pipelines.lake import CHUNKS, CHUNKS_SCHEMA, Lake, embeddings, latest_rows

log = logging.getLogger(__name__)

#: read at most this many commits per poll, so a far-behind tail still publishes progress
MAX_COMMITS_PER_POLL = 200


class TailError(Exception):
    """The lake's log cannot be followed from the requested version."""


@dataclass(frozen=True)
class TailState:
    base_version: int  # the index's lake version: the tail holds what came after it
    version: int  # the last lake version read
    rows: pa.Table  # CHUNKS columns + lake_version: latest row per changed chunk id
    live: pa.Table  # the upserts of rows
    vectors: np.ndarray  # embeddings of live, (n, dim)
    superseded: frozenset[str]
    #: when a poll last found the tail up to date with the lake (monotonic seconds)
    checked_at: float = field(default_factory=time.monotonic)

    @classmethod
    def empty(cls, base_version: int, dim: int) -> TailState:
        rows = _with_version(CHUNKS_SCHEMA.empty_table(), 0)
        return cls(base_version, base_version, rows, rows, np.zeros((0, dim), np.float32), frozenset())

    def search(self, query: np.ndarray, k: int, allowed: np.ndarray | None) -> list[tuple[int, float]]:
        """(row of ``live``, squared L2 distance) of the k nearest allowed live rows."""
        if len(self.vectors) == 0 or k <= 0:
            return []
        dist = 2.0 - 2.0 * (self.vectors @ query.astype(np.float32))
        if allowed is not None:
            dist = np.where(allowed, dist, np.inf)
        k = min(k, len(dist))
        top = np.argpartition(dist, k - 1)[:k]
        top = top[np.argsort(dist[top], kind="stable")]
        return [(int(i), float(dist[i])) for i in top if np.isfinite(dist[i])]

    def advanced(self, new_rows: pa.Table, version: int) -> TailState:
        """This tail plus rows committed up to ``version``."""
        if new_rows.num_rows == 0:
            return replace(self, version=version, checked_at=time.monotonic())
        return _state(self.base_version, version, pa.concat_tables([self.rows, new_rows]))

    def rebased(self, base_version: int) -> TailState:
        """The tail of a newer index (built at ``base_version``): drops what that index holds."""
        if base_version <= self.base_version:
            return self
        keep = self.rows.filter(pc.greater(self.rows.column("lake_version"), base_version))
        return _state(base_version, max(self.version, base_version), keep)


def _with_version(table: pa.Table, version: int) -> pa.Table:
    return table.append_column("lake_version", pa.array(np.full(table.num_rows, version, np.int64)))


def _state(base: int, version: int, rows: pa.Table) -> TailState:
    rows = latest_rows(rows)
    live = rows.filter(pc.equal(rows.column("op"), "upsert"))
    vectors = embeddings(live) if live.num_rows else np.zeros((0, 0), np.float32)
    ids = frozenset(rows.column("chunk_id").to_pylist())
    return TailState(base, version, rows, live, np.ascontiguousarray(vectors), ids)


class LogReader:
    """Reads the rows that commits of the ``chunks`` table added."""

    def __init__(self, lake: Lake) -> None:
        self.store: ObjectStore = open_store(lake.table_uri(CHUNKS), lake.store)

    def commit(self, version: int) -> list[str] | None:
        """Data files that ``version`` added with new data; None if it does not exist yet."""
        try:
            raw = self.store.get(f"_delta_log/{version:020d}.json")
        except NotFound:
            return None
        files = []
        for line in raw.decode().splitlines():
            if not line.strip():
                continue
            action = json.loads(line)
            add = action.get("add")
            if add and add.get("dataChange", True):
                files.append(unquote(add["path"]))
        return files

    def rows(self, path: str, version: int) -> pa.Table:
        if "://" in path:
            raise TailError(f"data file {path} is outside the table; absolute paths are not supported.")
        table = pq.read_table(io.BytesIO(self.store.get(path)))
        table = table.select([n for n in CHUNKS_SCHEMA.names if n in table.column_names])
        table = table.cast(pa.schema([CHUNKS_SCHEMA.field(n) for n in table.column_names]))
        for column in CHUNKS_SCHEMA:  # files written before a column existed: nulls, one schema for all
            if column.name not in table.column_names:
                table = table.append_column(column, pa.nulls(table.num_rows, column.type))
        return _with_version(table.select(CHUNKS_SCHEMA.names), version)

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
            return _with_version(CHUNKS_SCHEMA.empty_table(), 0), version
        return pa.concat_tables(tables, promote_options="permissive"), version


def tail_at(lake: Lake, base_version: int, until: int, dim: int) -> TailState:
    """The tail of an index built at ``base_version``, as it was at lake version ``until``."""
    rows, version = LogReader(lake).read(base_version, until)
    return TailState.empty(base_version, dim).advanced(rows, version)


class LakeTail:
    """Follows the lake in a background thread; ``state`` is always a consistent tail."""

    def __init__(self, lake: Lake, base_version: int, dim: int, poll_s: float = 0.5) -> None:
        self.log = LogReader(lake)
        self.state = TailState.empty(base_version, dim)
        self.poll_s = poll_s
        self.healthy = True
        self.last_error: str | None = None
        self._lock = threading.Lock()  # one poll or rebase at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> bool:
        """Read what the lake committed since the last poll; True if the tail changed."""
        with self._lock:
            state = self.state
            rows, version = self.log.read(state.version, limit=MAX_COMMITS_PER_POLL)
            if version == state.version:
                self.state = replace(state, checked_at=time.monotonic())
                return False
            self.state = state.advanced(rows, version)
            return True

    def rebase(self, base_version: int) -> None:
        with self._lock:
            self.state = self.state.rebased(base_version)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lake-tail", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        from retrieval import metrics

        while not self._stop.is_set():
            try:
                changed = self.poll()
            except Exception as exc:  # noqa: BLE001 - keep serving what we have; report and retry
                metrics.TAIL_POLL_ERRORS.inc()
                if self.healthy or str(exc) != self.last_error:
                    log.warning("cannot read the lake's new commits (will retry): %s", exc)
                self.healthy, self.last_error = False, str(exc)
                changed = False
            else:
                if not self.healthy:
                    log.info("reading the lake again")
                self.healthy, self.last_error = True, None
            state = self.state
            metrics.TAIL_ROWS.set(state.live.num_rows)
            metrics.LAKE_VERSION.set(state.version)
            metrics.TAIL_LAG.set(time.monotonic() - state.checked_at)
            if not changed:
                self._stop.wait(self.poll_s)
