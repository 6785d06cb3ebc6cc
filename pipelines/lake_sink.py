"""Bytewax sink over :class:`LakeWriter`: one partition = one Delta app id.

The partition's recovery state is the writer's commit number and replay horizon (see
lake_writer), snapshotted with the source offsets at each epoch, which is what lets the
writer recognise replayed rows. Older recovery directories hold just the number.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import pyarrow as pa
from bytewax.outputs import FixedPartitionedSink, StatefulSinkPartition

from pipelines import metrics
from pipelines.lake import CHUNKS, Lake
from pipelines.lake_writer import LakeWriter
from pipelines.notices import CommitNotice, NoticePublisher
from pipelines.settings import IngestSettings

log = logging.getLogger(__name__)


State = tuple[int, int] | int  # (seq, horizon); a bare seq from older recovery directories


#: rows a sink partition holds for its next commit before the worker waits for the one in flight
MAX_PENDING_ROWS = 8192


class _LakePartition(StatefulSinkPartition[pa.Table, State]):
    """Group commit on a thread of its own, one commit in flight: the worker goes on reading
    and embedding while a commit lands, and the micro-batches it hands over meanwhile are
    committed together, in one commit, as soon as it has landed.

    A lone change therefore waits for at most the commit in flight and its own, and a busy
    stream makes fewer, larger commits instead of a queue of small ones. (Before, the worker
    waited for the commit in flight before it handed over the next batch, and read nothing
    from Kafka meanwhile: under load, changes queued behind commits.) The worker waits only
    when ``max_pending_rows`` are held (backpressure).

    Exactly-once is unchanged: commits land one at a time and in order, rows keep the order
    they were handed over in, and ``snapshot`` (the end of an epoch, when bytewax records
    the source offsets) and ``close`` wait until every row handed over has landed and raise
    a commit's error, so no epoch is recorded as done before its rows are in the lake.
    After a failed commit nothing more is committed.
    """

    def __init__(
        self,
        writer: LakeWriter,
        before_commit: Callable[[pa.Table], None] | None,
        notices: NoticePublisher | None = None,
        max_pending_rows: int = MAX_PENDING_ROWS,
    ) -> None:
        self._writer = writer
        self._before_commit = before_commit
        self._notices = notices
        self._max_pending_rows = max_pending_rows
        self._committer = ThreadPoolExecutor(1, thread_name_prefix=f"commit-{writer.app_id}")
        self._changed = threading.Condition()
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._committing = False  # a commit thread task is running (or about to)
        self._failed: BaseException | None = None
        self._raised = False  # the failure was raised in the worker already

    def write_batch(self, values: list[pa.Table]) -> None:
        with self._changed:
            self._raise_failure()
            while self._committing and self._pending_rows >= self._max_pending_rows:
                self._changed.wait()
                self._raise_failure()
            self._pending.extend(values)
            self._pending_rows += sum(v.num_rows for v in values)
            if not self._committing:
                self._committing = True
                self._committer.submit(self._drain)

    def _drain(self) -> None:
        """Commit what is pending, in one commit, until nothing is (on the commit thread)."""
        while True:
            with self._changed:
                if not self._pending:
                    self._committing = False
                    self._changed.notify_all()
                    return
                values, self._pending, self._pending_rows = self._pending, [], 0
                self._changed.notify_all()
            try:
                self._commit(pa.concat_tables(values))
            except BaseException as exc:  # noqa: BLE001 - raised in the worker by the next call
                with self._changed:
                    self._failed, self._committing = exc, False
                    self._changed.notify_all()
                return

    def _raise_failure(self) -> None:
        if self._failed is not None:
            self._raised = True
            raise self._failed

    def _settle(self) -> None:
        """Wait until every row handed over has landed; a commit's failure is raised here, in the worker."""
        with self._changed:
            while self._committing:
                self._changed.wait()
            self._raise_failure()

    def _commit(self, rows: pa.Table) -> None:
        written = self._writer.write(rows, before_commit=self._before_commit)
        table = self._writer.table_name
        metrics.REPLAYED.inc(rows.num_rows - written.num_rows)
        if written.num_rows == 0:
            return
        metrics.COMMITS.labels(table).inc()
        metrics.ROWS.labels(table).inc(written.num_rows)
        if self._notices is not None:
            w = self._writer
            notice = CommitNotice(
                w.lake.uri, table, w.table_version, w.app_id, written.num_rows, int(time.time() * 1000)
            )
            self._notices.publish(notice)
        if table == CHUNKS:
            now = time.time()
            for ts in written.column("event_time").to_pylist():
                if isinstance(ts, datetime):
                    metrics.LAG.observe(max(0.0, now - ts.replace(tzinfo=ts.tzinfo or UTC).timestamp()))

    def snapshot(self) -> State:
        self._settle()
        return self._writer.recovery_state

    def close(self) -> None:
        try:
            if not self._raised:  # (bytewax aborts the process if close raises what snapshot did)
                self._settle()
        finally:
            self._committer.shutdown(wait=True)
            if self._notices is not None:
                self._notices.close()


class LakeSink(FixedPartitionedSink[pa.Table, State]):
    """Items are ``(writer key "000".."NNN", rows)``; partition i commits as app id
    ``<job>:<table>:<i>``."""

    def __init__(
        self,
        lake: Lake,
        table: str,
        settings: IngestSettings,
        before_commit: Callable[[pa.Table], None] | None = None,
        notices: Callable[[], NoticePublisher] | None = None,
    ) -> None:
        self._lake = lake
        self._table = table
        self._writers = settings.writers
        self._job = settings.job_name
        self._before_commit = before_commit
        self._notices = notices

    def list_parts(self) -> list[str]:
        return [f"{self._job}:{self._table}:{i:03d}" for i in range(self._writers)]

    def part_fn(self, item_key: str) -> int:
        return int(item_key)

    def build_part(self, step_id: str, for_part: str, resume_state: State | None) -> _LakePartition:
        seq, horizon = resume_state if isinstance(resume_state, tuple) else (resume_state, None)
        writer = LakeWriter(self._lake, self._table, for_part, seq, resume_horizon=horizon)
        return _LakePartition(writer, self._before_commit, self._notices() if self._notices else None)
