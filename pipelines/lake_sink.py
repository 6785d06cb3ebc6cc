"""Bytewax sink over :class:`LakeWriter`: one partition = one Delta app id.

The partition's recovery state is the writer's commit number and replay horizon (see
lake_writer), snapshotted with the source offsets at each epoch, which is what lets the
writer recognise replayed rows. Older recovery directories hold just the number.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
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


class _LakePartition(StatefulSinkPartition[pa.Table, State]):
    """Commits on a thread of its own, one commit in flight: the worker reads and embeds
    the next micro-batch while the last one commits (on S3 a commit takes a few hundred
    milliseconds of log requests; before, the next changes waited in Kafka meanwhile).

    Exactly-once is unchanged: commits still land one at a time and in order, a batch is
    handed over only after the previous commit landed, and ``snapshot`` (the end of an
    epoch, when bytewax records the source offsets) and ``close`` wait for the commit in
    flight and raise its error, so no epoch is recorded as done before its rows are in the
    lake.
    """

    def __init__(
        self,
        writer: LakeWriter,
        before_commit: Callable[[pa.Table], None] | None,
        notices: NoticePublisher | None = None,
    ) -> None:
        self._writer = writer
        self._before_commit = before_commit
        self._notices = notices
        self._committer = ThreadPoolExecutor(1, thread_name_prefix=f"commit-{writer.app_id}")
        self._in_flight: Future[None] | None = None

    def write_batch(self, values: list[pa.Table]) -> None:
        rows = pa.concat_tables(values)
        self._settle()
        self._in_flight = self._committer.submit(self._commit, rows)

    def _settle(self) -> None:
        """Wait for the commit in flight; its failure is raised here, in the worker."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.result()

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
