"""The fresh tail: chunk versions the lake committed after the index's snapshot.

The tail reads the ``chunks`` table's Delta log directly, one commit file per version
after the index's lake version V, and only the data files those commits *added with new
data* (compaction rewrites carry ``dataChange: false`` and are skipped), so each poll
costs one GET when nothing changed and reads each new row once.

A :class:`TailLog` keeps every row after V in commit order and grows by appending: a
commit costs work proportional to its own rows, never to the tail or the index. Queries
search immutable :class:`TailState` snapshots (a prefix of the log at one lake version),
so a query sees one consistent tail while the poller appends the next commit:

- the newest version of each chunk id after V (``live``: its upserts), searched exactly;
- the chunk ids with any version after V, by the lake version that first wrote one
  (``superseding``): the index's copies of these are stale (updated, re-permissioned or
  deleted) and are filtered out of shard results (``retrieval.masks``).
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.caches import LRU
from pipelines.lake import Lake, embeddings
from retrieval import metrics
from retrieval.acl import acl_mask
from retrieval.delta_log import MAX_COMMITS_PER_POLL, TAIL_SCHEMA, LogReader, TailError, rows_after
from retrieval.tail_index import EXACT_ALLOWED_ROWS, NEVER, TailIndex

log = logging.getLogger(__name__)

INF_VERSION = np.iinfo(np.int64).max
#: ACL masks kept per tail (and per snapshot): one per group set of recent callers
GROUP_SETS_KEPT = 256


class TailLog:
    """The rows the lake committed after one base version, in commit order (append-only).

    One writer (the poller) appends; readers take :class:`TailState` snapshots, which see
    a prefix of the log and never change. Appending costs work proportional to the new
    rows: vectors go into a buffer that grows geometrically, a chunk id → newest-row map
    says which row a new one replaces, and ACL masks per group set are extended, not
    recomputed. A row replaced by a newer version of its chunk gets the lake version that
    replaced it (``replaced_at``), so a snapshot at version V knows its latest rows
    without a copy: those with ``replaced_at > V``.
    """

    def __init__(self, base_version: int, dim: int, indexed: bool = True) -> None:
        self.base_version = base_version
        self.dim = dim
        self.n = 0
        self.version = base_version
        self._batches: list[pa.RecordBatch] = []
        self._vectors = np.zeros((16, dim), np.float32)
        self._upsert = np.zeros(16, bool)
        self._replaced_at = np.full(16, INF_VERSION, np.int64)
        self._order: list[tuple[object, object]] = []  # (position, ingest_time) per row
        self._newest: dict[str, int] = {}  # chunk id → row of its newest version
        # lake versions (ascending) and the chunk ids whose first tail version each committed
        self._first_versions: list[int] = []
        self._first_ids: list[list[str]] = []
        self._acl: LRU[frozenset[str], np.ndarray] = LRU(GROUP_SETS_KEPT)  # group set → mask over rows [0, len)
        self._acl_lock = threading.Lock()
        # an IVF index of the vectors once the tail is large (not for one-off tails: as_of)
        self.index = TailIndex(dim, None if indexed else NEVER)

    def append(self, rows: pa.Table, version: int) -> None:
        """Rows committed up to lake ``version`` (with a ``lake_version`` column, in commit order)."""
        if version < self.version:
            raise TailError(f"the tail is at lake version {self.version}; version {version} is older.")
        if rows.num_rows:
            rows = rows.select(TAIL_SCHEMA.names)
            rows = rows if rows.schema == TAIL_SCHEMA else rows.cast(TAIL_SCHEMA)
            start, count = self.n, rows.num_rows
            self._grow(start + count)
            upsert = np.asarray(pc.equal(rows.column("op"), "upsert").to_numpy(zero_copy_only=False), dtype=bool)
            self._upsert[start : start + count] = upsert
            # deletes carry no vector: only the upserts' embeddings are read
            self._vectors[start : start + count][upsert] = embeddings(rows.filter(pa.array(upsert)), self.dim)
            ids = rows.column("chunk_id").to_pylist()
            positions = rows.column("position").to_pylist()
            times = pc.fill_null(pc.cast(rows.column("ingest_time"), pa.int64()), 0).to_pylist()
            versions = rows.column("lake_version").to_pylist()
            for j, chunk_id in enumerate(ids):
                row, v = start + j, versions[j]
                order = (positions[j] or "", times[j])
                self._order.append(order)
                old = self._newest.get(chunk_id)
                if old is None:
                    self._newest[chunk_id] = row
                    if not self._first_versions or self._first_versions[-1] != v:
                        self._first_ids.append([])  # before the version: readers bisect the versions
                        self._first_versions.append(v)
                    self._first_ids[-1].append(chunk_id)
                elif order >= self._order[old]:  # as latest_rows: greatest (position, ingest_time) wins
                    self._replaced_at[old] = v
                    self._newest[chunk_id] = row
                else:  # a late, older version: never the newest
                    self._replaced_at[row] = v
            self._batches.extend(rows.to_batches())
            self.index.extend(self._vectors, self._upsert, start + count)  # before snapshots can see the rows
            self.n += count
            self._compact_batches()
        else:
            self.refresh_index()
        self.version = version

    def refresh_index(self) -> None:
        """Swap in an IVF index trained in the background since the last append, if any."""
        self.index.extend(self._vectors, self._upsert, self.n)

    @property
    def first_version(self) -> int | None:
        return self._first_versions[0] if self._first_versions else None

    def superseding(self, after: int, upto: int) -> list[tuple[int, list[str]]]:
        """(lake version, chunk ids) of chunks whose first tail version a commit in (after, upto] wrote.

        An index copy of each such chunk is stale from that version on.
        """
        lo = bisect.bisect_right(self._first_versions, after)
        hi = bisect.bisect_right(self._first_versions, upto)
        return list(zip(self._first_versions[lo:hi], self._first_ids[lo:hi], strict=True))

    def _grow(self, need: int) -> None:
        if need <= len(self._upsert):
            return
        size = max(need, 2 * len(self._upsert))
        vectors = np.zeros((size, self.dim), np.float32)
        vectors[: self.n] = self._vectors[: self.n]
        upsert = np.zeros(size, bool)
        upsert[: self.n] = self._upsert[: self.n]
        replaced = np.full(size, INF_VERSION, np.int64)
        replaced[: self.n] = self._replaced_at[: self.n]
        # Snapshots keep the old buffers: their rows are the same, and the only change to
        # an old row after this (a replaced_at set) is for a version they do not cover.
        self._vectors, self._upsert, self._replaced_at = vectors, upsert, replaced

    def _compact_batches(self) -> None:
        """Merge trailing batches like a binary counter: O(log n) batches, each row copied O(log n) times."""
        while len(self._batches) >= 2 and self._batches[-2].num_rows <= self._batches[-1].num_rows:
            merged = pa.Table.from_batches(self._batches[-2:]).combine_chunks().to_batches(max_chunksize=None)
            self._batches[-2:] = merged

    def snapshot(self, checked_at: float | None = None) -> TailState:
        return TailState(
            self,
            self.version,
            self.n,
            tuple(self._batches),
            self._vectors,
            self._upsert,
            self._replaced_at,
            time.monotonic() if checked_at is None else checked_at,
        )

    def acl(self, groups: frozenset[str], n: int, table: pa.Table) -> np.ndarray:
        """The ACL mask of rows [0, n) for a group set, extended from what was computed before."""
        with self._acl_lock:
            known = self._acl.get(groups)
            done = 0 if known is None else len(known)
            if done < n:
                extra = acl_mask(table.column("acl").slice(done, n - done), groups)
                known = extra if known is None else np.concatenate([known, extra])
                self._acl.put(groups, known)
            assert known is not None
            return known[:n]


@dataclass(frozen=True, eq=False)
class TailState:
    """A consistent snapshot of the tail: the first ``n`` rows of a :class:`TailLog`, at ``version``."""

    log: TailLog
    version: int  # the last lake version read
    n: int
    batches: tuple[pa.RecordBatch, ...]
    _vectors: np.ndarray
    _upsert: np.ndarray
    _replaced_at: np.ndarray
    #: when a poll last found the tail up to date with the lake (monotonic seconds)
    checked_at: float = field(default_factory=time.monotonic)
    _memo: dict[Any, Any] = field(default_factory=dict, repr=False)
    _allowed: LRU[frozenset[str], np.ndarray] = field(default_factory=lambda: LRU(GROUP_SETS_KEPT), repr=False)

    @classmethod
    def empty(cls, base_version: int, dim: int) -> TailState:
        return TailLog(base_version, dim).snapshot()

    @property
    def base_version(self) -> int:
        """The index's lake version: the tail holds what came after it."""
        return self.log.base_version

    @property
    def table(self) -> pa.Table:
        """Every row of the snapshot (all versions, upserts and deletes), with ``lake_version``."""
        found = self._memo.get("table")
        if found is None:
            found = self._memo["table"] = pa.Table.from_batches(list(self.batches), TAIL_SCHEMA)
        return found

    @property
    def live(self) -> np.ndarray:
        """Rows that are the newest version of their chunk at this version and not deletes."""
        found = self._memo.get("live")
        if found is None:
            found = self._upsert[: self.n] & (self._replaced_at[: self.n] > self.version)
            self._memo["live"] = found
        return found

    @property
    def live_rows(self) -> int:
        return int(self.live.sum())

    @property
    def vectors(self) -> np.ndarray:
        return self._vectors[: self.n]

    def allowed(self, groups: frozenset[str]) -> np.ndarray:
        """Live rows a caller in ``groups`` may see (computed once per snapshot and group set)."""
        return self._allowed.get_or_make(
            groups, lambda: self.live & self.log.acl(groups, self.n, self.table) if self.n else self.live
        )

    def superseding(self, after: int) -> list[tuple[int, list[str]]]:
        """(lake version, chunk ids) whose first tail version came after ``after``, up to this snapshot."""
        return self.log.superseding(after, self.version)

    @property
    def supersedes_any(self) -> bool:
        """Whether any index copy is stale at this snapshot's version."""
        return self.log.first_version is not None and self.log.first_version <= self.version

    def search(self, query: np.ndarray, k: int, allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, squared L2 distances) of the k nearest allowed rows, nearest first (``allowed``:
        one flag per row), as arrays: a hybrid query takes 100 candidates from a tail of hundreds
        of rows, and a Python pair per candidate cost it 0.1-0.2 ms.

        Exact over a small tail or a caller allowed few rows; through the tail's IVF index
        (:mod:`retrieval.tail_index`) once the tail is large.
        """
        count = int(allowed.sum()) if self.n and k > 0 else 0
        if count == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.float64)
        if count > EXACT_ALLOWED_ROWS:
            found = self.log.index.search(query, k, allowed)
            if found is not None:
                return found
        q = query.astype(np.float32)
        if count * 4 < self.n:  # few allowed rows: score just those
            rows = np.flatnonzero(allowed)
            dist = 2.0 - 2.0 * (self.vectors[rows] @ q)
        else:
            rows = None
            dist = np.where(allowed, 2.0 - 2.0 * (self.vectors @ q), np.inf)
        k = min(k, len(dist))
        top = np.argpartition(dist, k - 1)[:k]
        top = top[np.argsort(dist[top], kind="stable")]
        top = top[np.isfinite(dist[top])]
        return (top if rows is None else rows[top]).astype(np.int64), dist[top].astype(np.float64)

    def rebased(self, base_version: int) -> TailState:
        """The tail of a newer index (built at ``base_version``): drops what that index holds."""
        if base_version <= self.base_version:
            return self
        found = self._memo.get(("rebased", base_version))
        if found is None:
            log = TailLog(base_version, self.log.dim)
            table = self.table
            keep = table.filter(pc.greater(table.column("lake_version"), base_version))
            log.append(keep, max(self.version, base_version))
            found = self._memo[("rebased", base_version)] = log.snapshot(self.checked_at)
        return found

    def checked(self) -> TailState:
        """This snapshot, noted as up to date with the lake now."""
        return replace(self, checked_at=time.monotonic(), _memo=self._memo, _allowed=self._allowed)


def tail_at(lake: Lake, base_version: int, until: int, dim: int) -> TailState:
    """The tail of an index built at ``base_version``, as it was at lake version ``until``."""
    rows, version = LogReader(lake).read(base_version, until)
    log = TailLog(base_version, dim, indexed=False)
    log.append(rows, version)
    return log.snapshot()


class LakeTail:
    """Follows the lake in a background thread; ``state`` is always a consistent tail."""

    #: how often an idle tail checks whether the log was cleaned up past it (one GET)
    CLEANUP_CHECK_S = 10.0

    def __init__(
        self,
        lake: Lake,
        base_version: int,
        dim: int,
        poll_s: float = 0.5,
        writer_seqs: dict[str, int] | None = None,
    ) -> None:
        self.lake = lake
        self.reader = LogReader(lake)
        self.state = TailState.empty(base_version, dim)
        self.writer_seqs = writer_seqs  # the index's writers' commit numbers at base_version
        self._cleanup_checked = 0.0
        self.poll_s = poll_s
        self.healthy = True
        self.last_error: str | None = None
        self._lock = threading.Lock()  # one poll or rebase at a time
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._notified = base_version  # the newest lake version a commit notice named
        self._notice_at: float | None = None  # when the oldest notice not yet searchable came
        self._thread: threading.Thread | None = None
        #: called on the tail's thread with each new state that holds new rows, before queries see it
        #: (a follower brought up to date here never makes a query wait for it)
        self.on_change: Callable[[TailState], None] | None = None

    def notify(self, version: int) -> None:
        """A commit notice: lake version ``version`` exists; read it now rather than at the next poll.

        Notices may be lost, duplicated or reordered: the tail reads each version once,
        in order, whatever woke it, and polls anyway.
        """
        if version > self._notified:
            self._notified = version
            if self._notice_at is None:
                self._notice_at = time.monotonic()
        self._wake.set()

    def poll(self) -> bool:
        """Read what the lake committed since the last poll; True if the tail changed."""
        with self._lock:
            started = time.perf_counter()
            state = self.state
            rows, version = self._read_named(state.version) or self.reader.read(
                state.version, limit=MAX_COMMITS_PER_POLL
            )
            if version == state.version:
                if self._log_cleaned_up(state.version):
                    self._publish(self._from_snapshot(state))
                    return True
                state.log.refresh_index()  # a quiet stream still gets the index trained meanwhile
                self.state = state.checked()
                return False
            state.log.append(rows, version)  # the live state is always its log's newest snapshot
            metrics.TAIL_STAGE_SECONDS.labels("read").observe(time.perf_counter() - started)
            self._publish(state.log.snapshot())
            return True

    def _publish(self, state: TailState) -> None:
        if self.on_change is not None:
            started = time.perf_counter()
            try:
                self.on_change(state)
            except Exception:  # a follower's failure must not stop the tail
                log.exception("a follower of the tail failed")
            metrics.TAIL_STAGE_SECONDS.labels("follow").observe(time.perf_counter() - started)
        self.state = state
        noticed = self._notice_at
        if noticed is not None and state.version >= self._notified:
            self._notice_at = None
            metrics.TAIL_STAGE_SECONDS.labels("notice_to_visible").observe(time.monotonic() - noticed)

    def _read_named(self, after: int) -> tuple[pa.Table, int] | None:
        """The commits notices named after ``after``, without probing for the next one; None if none."""
        named = min(self._notified, after + MAX_COMMITS_PER_POLL)
        if named <= after:
            return None
        try:
            return self.reader.read(after, until=named)
        except TailError:  # a notice ahead of the log it names: read what is there instead
            return None

    def _log_cleaned_up(self, version: int) -> bool:
        now = time.monotonic()
        if now - self._cleanup_checked < self.CLEANUP_CHECK_S:
            return False
        self._cleanup_checked = now
        return self.reader.cleaned_up(version)

    def _from_snapshot(self, state: TailState) -> TailState:
        """The tail rebuilt from the table's current snapshot, when the log after it is gone."""
        if not self.writer_seqs:
            raise TailError(
                f"the lake's log was cleaned up past version {state.version}, which this tail has not read, and "
                f"the index (built at lake version {state.base_version}) records no writer commit numbers to "
                "rebuild the tail from a snapshot: publish a new index (streamrag index build) to recover."
            )
        rows, version = rows_after(self.lake, self.writer_seqs)
        log.warning(
            "the lake's log was cleaned up past version %d; the tail was rebuilt from the snapshot at version %d "
            "(%d rows after the index; their lake version reads %d)",
            state.version, version, rows.num_rows, version,
        )  # fmt: skip
        fresh = TailLog(state.base_version, state.log.dim)
        fresh.append(rows, version)
        return fresh.snapshot()

    def rebase(self, base_version: int, writer_seqs: dict[str, int] | None = None) -> None:
        with self._lock:
            if base_version > self.state.base_version:
                self.state = self.state.rebased(base_version)
                self.writer_seqs = writer_seqs
                self.reader.removals = [v for v in self.reader.removals if v > base_version]  # the index has them

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lake-tail", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # before reading: a notice that comes during the read wakes the next wait
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
            metrics.TAIL_ROWS.set(state.live_rows)
            metrics.LAKE_VERSION.set(state.version)
            metrics.TAIL_LAG.set(time.monotonic() - state.checked_at)
            if not changed:  # else read on at once: more commits may be waiting
                self._wake.wait(self.poll_s)
