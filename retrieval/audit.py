"""The audit log: every answer appended to the Delta table ``answers`` in the lake.

Requests hand their record to :class:`AuditLog` and return; a writer thread appends
records in batches (every ``flush_rows`` records or ``flush_s`` seconds). A failed write
is retried with backoff and its rows kept; each commit carries a Delta app transaction
(this writer's id and sequence number), so a commit that landed but failed to answer is
not written twice. Every ``compact_every`` commits the writer compacts the table's small
files and checkpoints its log. ``stop()`` drains the queue: no record is lost on a graceful stop.
When the queue is full (the lake unreachable for a long time) a request waits at most
``put_timeout_s`` and the record is then counted as dropped and logged in full.

A record that can never be written must not block the ones behind it. Records that do not
fit the table's schema are set aside at once; a batch whose write keeps failing for
``give_up_s`` (a table whose schema was changed under us, say) is set aside whole. Set
aside means appended, with the reason, to the dead-letter file (JSON lines, default
``~/.local/state/streamrag/audit-dead-letters.jsonl``), counted in
``streamrag_audit_quarantined_total`` and logged; the writer then goes on.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import SchemaMismatchError

from pipelines.lake import Lake, add_missing_columns
from pipelines.lake_writer import app_metadata, landed_seq
from retrieval import metrics
from serving.retry import RetryCallState, retrying, stop_when

log = logging.getLogger(__name__)

ANSWERS = "answers"

_TS = pa.timestamp("us", tz="UTC")

#: one chunk version sent to the generator, with the coordinates lineage needs
SOURCE_TYPE = pa.struct(
    [
        ("n", pa.int32()),
        ("chunk_id", pa.string()),
        ("doc_id", pa.string()),
        ("source_table", pa.string()),
        ("source_pk", pa.string()),
        ("position", pa.string()),
        ("kafka_topic", pa.string()),
        ("kafka_partition", pa.int32()),
        ("kafka_offset", pa.int64()),
        ("lake_version", pa.int64()),
        ("origin", pa.string()),
        ("score", pa.float32()),
    ]
)
CITATION_TYPE = pa.struct([("n", pa.int32()), ("chunk_id", pa.string()), ("support", pa.float32())])

ANSWERS_SCHEMA = pa.schema(
    [
        ("answer_id", pa.string()),
        ("time", _TS),
        ("principal", pa.string()),
        ("groups", pa.list_(pa.string())),
        ("question", pa.string()),
        ("status", pa.string()),  # answered | no_answer | failed
        ("answer", pa.string()),  # as returned: validated markers, flagged sentences unmarked
        ("raw_answer", pa.string()),  # as the model wrote it
        ("sources", pa.list_(SOURCE_TYPE)),
        ("citations", pa.list_(CITATION_TYPE)),
        ("sentences", pa.string()),  # JSON: per sentence, its support and scores
        ("flagged_sentences", pa.int32()),
        ("k", pa.int32()),
        ("as_of", pa.int64()),
        ("lake_version", pa.int64()),
        ("index_version", pa.int64()),
        ("embedder", pa.string()),
        ("generator", pa.string()),
        ("generator_url", pa.string()),
        ("prompt_hash", pa.string()),
        ("streamed", pa.bool_()),
        ("retrieve_ms", pa.float64()),
        ("first_token_ms", pa.float64()),
        ("total_ms", pa.float64()),
        ("error", pa.string()),
        ("style", pa.string()),  # generate | extract (null: written before extractive answers)
        ("mode", pa.string()),  # how sources were retrieved: hybrid | dense | keyword (null: before modes: dense)
    ]
)


def ensure_answers_table(lake: Lake) -> None:
    DeltaTable.create(
        lake.table_uri(ANSWERS),
        ANSWERS_SCHEMA,
        mode="ignore",
        description="streamrag answers audit table",
        storage_options=lake.options,
    )
    add_missing_columns(lake, ANSWERS, ANSWERS_SCHEMA)


def now() -> datetime:
    return datetime.now(UTC)


def default_dead_letter_path() -> Path:
    return Path.home() / ".local" / "state" / "streamrag" / "audit-dead-letters.jsonl"


class _Poison(Exception):
    """A batch the table will never take as it is (its schema, not the store, refuses it)."""


class AuditLog:
    def __init__(
        self,
        lake: Lake,
        flush_rows: int = 64,
        flush_s: float = 1.0,
        max_queue: int = 10_000,
        put_timeout_s: float = 2.0,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        compact_every: int = 500,
        give_up_s: float = 600.0,
        dead_letter_path: Path | None = None,
    ) -> None:
        self.lake = lake
        self.give_up_s = give_up_s
        self.dead_letter_path = dead_letter_path or default_dead_letter_path()
        self.flush_rows = flush_rows
        self.flush_s = flush_s
        self.put_timeout_s = put_timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.compact_every = compact_every
        self.app_id = f"audit-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.last_error: str | None = None
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue(max_queue)
        self._pending: set[str] = set()  # answer ids not written yet
        self._lock = threading.Lock()
        self._written = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._table: DeltaTable | None = None
        self._seq = 0
        self._seen: int | None = None  # the answers table's version after our last commit

    # -- requests --------------------------------------------------------------------------

    def record(self, row: dict[str, Any]) -> None:
        """Queue one answer record; never blocks longer than ``put_timeout_s``."""
        with self._lock:
            self._pending.add(row["answer_id"])
        try:
            self._queue.put(row, timeout=self.put_timeout_s)
        except queue.Full:
            with self._lock:
                self._pending.discard(row["answer_id"])
            metrics.AUDIT_DROPPED.inc()
            log.error("audit queue full (lake unreachable?); record not written: %s", json.dumps(row, default=str))
            return
        metrics.AUDIT_QUEUE.set(self._queue.qsize())

    def pending(self, answer_id: str) -> bool:
        with self._lock:
            return answer_id in self._pending

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every record queued so far is written; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._written.wait(min(left, 0.2))
        return True

    @property
    def healthy(self) -> bool:
        return self.last_error is None

    # -- writer ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="audit-writer", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Write everything queued, then stop."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error("audit writer still busy after %.0f s; %d records unwritten", timeout_s, len(self._pending))

    def _run(self) -> None:
        batch: list[dict[str, Any]] = []
        while True:
            deadline = time.monotonic() + self.flush_s
            while len(batch) < self.flush_rows:
                try:
                    batch.append(self._queue.get(timeout=max(0.0, min(0.2, deadline - time.monotonic()))))
                except queue.Empty:
                    if time.monotonic() >= deadline or self._stop.is_set():
                        break
            metrics.AUDIT_QUEUE.set(self._queue.qsize())
            if batch:
                self._write_until_done(batch)
                batch = []
            if self._stop.is_set() and self._queue.empty():
                return

    def _write_until_done(self, batch: list[dict[str, Any]]) -> None:
        """Write the batch, retrying with backoff; set it aside once retrying cannot help.

        That is: at once when the table's schema refuses it, after ``give_up_s`` of
        failures, or at shutdown once the backoff has reached its cap.
        """
        batch = self._without_misfits(batch)
        if not batch:
            return

        def hopeless(state: RetryCallState) -> bool:
            too_long = (state.seconds_since_start or 0.0) >= self.give_up_s
            return too_long or (self._stop.is_set() and state.upcoming_sleep >= self.max_backoff_s)

        try:
            for attempt in retrying(
                retry_on=lambda exc: not isinstance(exc, _Poison),
                stop=stop_when(hopeless),
                first_s=self.backoff_s,
                max_s=self.max_backoff_s,
            ):
                with attempt:
                    try:
                        self._write(batch)
                    except Exception as exc:
                        self._failed(batch, exc)
                        raise
        except Exception as exc:  # noqa: BLE001 - set aside, so the rows behind these get written
            shutdown = self._stop.is_set() and not isinstance(exc, _Poison)
            reason = "still failing at shutdown" if shutdown else "the audit table refused the batch for good"
            self._quarantine(batch, f"{reason}: {exc}")
            return
        self.last_error = None
        metrics.AUDIT_WRITTEN.inc(len(batch))
        self._done(batch)

    def _failed(self, batch: list[dict[str, Any]], exc: Exception) -> None:
        metrics.AUDIT_FAILURES.inc()
        if str(exc) != self.last_error:  # one warning per distinct failure, not one per retry
            log.warning("audit write of %d records failed (retrying): %s", len(batch), exc)
        self.last_error = str(exc)

    def _without_misfits(self, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The batch less records that do not fit the table's schema (those are set aside)."""
        try:
            pa.Table.from_pylist(batch, schema=ANSWERS_SCHEMA)
            return batch
        except (pa.ArrowException, TypeError, ValueError, KeyError):
            pass
        fit = []
        for row in batch:
            try:
                pa.Table.from_pylist([row], schema=ANSWERS_SCHEMA)
            except (pa.ArrowException, TypeError, ValueError, KeyError) as exc:
                self._quarantine([row], f"the record does not fit the audit table's schema: {exc}")
            else:
                fit.append(row)
        return fit

    def _quarantine(self, rows: list[dict[str, Any]], reason: str) -> None:
        """Set records aside in the dead-letter file so that the ones behind them get written."""
        metrics.AUDIT_QUARANTINED.inc(len(rows))
        lines = "".join(
            json.dumps({"quarantined_at": now().isoformat(), "reason": reason, "record": row}, default=str) + "\n"
            for row in rows
        )
        try:
            self.dead_letter_path.parent.mkdir(parents=True, exist_ok=True)
            with self.dead_letter_path.open("a", encoding="utf-8") as fh:
                fh.write(lines)
            log.error("%d audit records set aside in %s: %s", len(rows), self.dead_letter_path, reason)
        except OSError as exc:  # the last resort: the log holds them in full
            log.error("%d audit records set aside (%s; the dead-letter file failed too: %s): %s",
                      len(rows), reason, exc, lines)  # fmt: skip
        self._done(rows)

    def _done(self, batch: list[dict[str, Any]]) -> None:
        with self._lock:
            for row in batch:
                self._pending.discard(row["answer_id"])
            self._written.notify_all()

    def _write(self, batch: list[dict[str, Any]]) -> None:
        if self._table is None:
            ensure_answers_table(self.lake)
            self._table = DeltaTable(self.lake.table_uri(ANSWERS), storage_options=self.lake.options)
        table = self._table
        seq = self._seq + 1
        if self._seen is None:
            self._seen = table.version()  # a new app id: nothing of ours in the log yet
        if landed_seq(table, self.app_id, self._seen, self._seq) < seq:  # else: an earlier attempt landed
            rows = pa.Table.from_pylist(batch, schema=ANSWERS_SCHEMA)
            props = CommitProperties(
                app_transactions=[Transaction(self.app_id, seq)], custom_metadata=app_metadata(self.app_id, seq)
            )
            try:
                write_deltalake(table, rows, mode="append", commit_properties=props)
            except SchemaMismatchError as exc:
                raise _Poison(str(exc)) from exc
        self._seq = seq
        self._seen = table.version()
        if self.compact_every and seq % self.compact_every == 0:
            self._maintain(table)

    def _maintain(self, table: DeltaTable) -> None:
        """Compact the small files of many one-second batches; best effort (another replica may be at it)."""
        try:
            table.optimize.compact()
            table.create_checkpoint()
        except Exception as exc:  # noqa: BLE001 - maintenance never stops auditing
            log.warning("audit table compaction failed (will retry later): %s", exc)
