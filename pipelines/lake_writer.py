"""Exactly-once appends to a Delta table: one writer per Delta app id.

Each writer (a sink partition of the streaming job) numbers its commits 1, 2, 3, … and
records the number as a Delta app transaction ``(app_id, seq)`` in the same commit as
the rows; every row also carries ``writer`` and ``writer_seq``. The streaming job's
recovery snapshot holds the seq the writer had reached at the end of the last completed
epoch. After a crash the job replays from that epoch, so rows committed after it arrive
again: on start the writer reads the rows it committed after the snapshot's *horizon* and
drops replayed rows with the same identity (``lake.IDENTITY``). Nothing is lost (the
replay re-sends everything after the snapshot) and nothing is written twice.

The horizon is the seq from which rows may still be replayed. Normally it is the seq
itself; but while a replay is still catching up (rows committed by an earlier run not yet
seen again), a snapshot taken mid-replay must keep the older horizon: its source offsets
are still before those rows, and a crash then would replay them once more (found by
killing a 2-process job five times at random moments).

deltalake accepts a commit whose app version was already used, so the writer checks
before each commit that nobody else committed as its app id: a second writer with the
same app id makes it stop rather than corrupt the table. deltalake's
``transaction_version`` answers that by reading every log entry since the last checkpoint
(up to 100 GETs per commit on S3), so the writer reads it once at start and then only
the commits that landed since its own last one, by their commit info (every streamrag
commit names its writer and seq there); a commit it cannot vouch for that way sends it
back to ``transaction_version``.

The writer loads its table afresh after each checkpoint: deltalake 1.6's append costs time
in proportion to the commits its table object has replayed since it was loaded, on top of
the files in the table (docs/PITFALLS.md). Right after a checkpoint a load reads that
checkpoint and a commit or two, which matters on S3.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pyarrow as pa
import pyarrow.dataset as ds
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from pipelines import metrics
from pipelines.lake import IDENTITY, Lake
from serving.retry import attempts, retrying

log = logging.getLogger(__name__)

Identity = tuple[object, ...]


#: Delta operations that never carry an app transaction
_NO_APP_TXN = frozenset({"OPTIMIZE", "VACUUM START", "VACUUM END"})


class ConcurrentWriterError(RuntimeError):
    """Another process committed with this writer's app id."""


#: delta.checkpointInterval when a table sets none (deltalake's default). A writer loads its
#: table afresh once a checkpoint is newer than its load. Measured on local disk with
#: deltalake 1.6 at ~1,000 files: an append took 56 ms from a table object updated since
#: version 0, 11-18 ms reloaded every 100 versions, and a reload 5-7 ms.
CHECKPOINT_INTERVAL = 100


class LakeWriter:
    """Idempotent appends for one (table, app id)."""

    def __init__(
        self,
        lake: Lake,
        table: str,
        app_id: str,
        resume_seq: int | None,
        retries: int = 8,
        resume_horizon: int | None = None,
        backoff_s: float = 0.5,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.lake = lake
        self.table_name = table
        self.app_id = app_id
        self.identity_cols = IDENTITY[table]
        self.retries = retries
        self.backoff_s = backoff_s
        self._sleep = sleep
        self._dt = lake.table(table)
        committed = self._dt.transaction_version(app_id) or 0
        resume = resume_seq or 0
        if resume > committed:
            raise ConcurrentWriterError(
                f"recovery state says writer {app_id} reached commit {resume} but the table "
                f"has only {committed}: the recovery directory belongs to another lake."
            )
        horizon = min(resume, resume_horizon) if resume_horizon is not None else resume
        self._skip = self._committed_after(horizon) if committed > horizon else set()
        self._horizon = horizon
        self.seq = committed
        self._seen = self._dt.version()  # the log up to here holds no commit of ours after ``seq``
        self._loaded = self._seen
        interval = self._dt.metadata().configuration.get("delta.checkpointInterval")
        self._checkpoint_interval = int(interval) if interval else CHECKPOINT_INTERVAL
        if self._skip:
            log.info("%s: %d rows committed after the snapshot will be skipped on replay", app_id, len(self._skip))

    @property
    def table_version(self) -> int:
        """The table's version as this writer last saw it (after its own last commit)."""
        return self._seen

    @property
    def recovery_state(self) -> tuple[int, int]:
        """(seq, horizon) for the recovery snapshot: see the module docstring."""
        return self.seq, (self._horizon if self._skip else self.seq)

    def _committed_after(self, seq: int) -> set[Identity]:
        dataset = self._dt.to_pyarrow_dataset()
        cols = list(self.identity_cols)
        flt = (ds.field("writer") == self.app_id) & (ds.field("writer_seq") > seq)
        rows = dataset.to_table(columns=cols, filter=flt)
        return set(zip(*(rows.column(c).to_pylist() for c in cols), strict=True))

    def _drop_replayed(self, rows: pa.Table) -> pa.Table:
        if not self._skip or rows.num_rows == 0:
            return rows
        keys = zip(*(rows.column(c).to_pylist() for c in self.identity_cols), strict=True)
        keep = []
        for key in keys:
            if key in self._skip:
                self._skip.discard(key)
                keep.append(False)
            else:
                keep.append(True)
        return rows.filter(pa.array(keep))

    def write(self, rows: pa.Table, before_commit: Callable[[pa.Table], None] | None = None) -> pa.Table:
        """Commit rows not already committed; return the rows actually written.

        ``before_commit`` sees exactly those rows first (the dead-letter topic is
        published there, so a replay does not publish twice what was committed).
        """
        rows = self._drop_replayed(rows)
        if rows.num_rows == 0:
            return rows
        if before_commit is not None:
            before_commit(rows)
        seq = self.seq + 1
        n = rows.num_rows
        tags = {"writer": pa.array([self.app_id] * n, pa.string()), "writer_seq": pa.array([seq] * n, pa.int64())}
        for name, values in tags.items():
            rows = rows.set_column(rows.schema.get_field_index(name), name, values)
        props = CommitProperties(
            app_transactions=[Transaction(self.app_id, seq)],
            custom_metadata=app_metadata(self.app_id, seq),
        )
        started = time.perf_counter()
        for attempt in retrying(
            retry_on=lambda exc: not isinstance(exc, ConcurrentWriterError),
            stop=attempts(self.retries + 1),
            first_s=self.backoff_s,
            log=log,
            what=f"{self.app_id}: commit {seq}",
            sleep=self._sleep,
        ):
            with attempt:
                landed = self._landed()
                if attempt.retry_state.attempt_number > 1 and landed == seq:
                    break  # our earlier attempt committed, then failed to answer
                if landed != self.seq:
                    raise ConcurrentWriterError(
                        f"writer {self.app_id} expected commit {self.seq} in {self.table_name} "
                        f"but found {landed}: two jobs share one lake writer id."
                    )
                write_deltalake(self._dt, rows, mode="append", commit_properties=props)
        self.seq = seq
        self._seen = self._dt.version()
        if self._seen // self._checkpoint_interval > self._loaded // self._checkpoint_interval:
            self._reload()
        metrics.COMMIT_SECONDS.labels(self.table_name).observe(time.perf_counter() - started)
        return rows

    def _reload(self) -> None:
        """Load the table afresh, from the checkpoint just written. The commit has landed: a
        failure here only keeps the old table object (and its cost) until the next checkpoint."""
        try:
            self._dt = self.lake.table(self.table_name)
        except Exception as exc:  # noqa: BLE001 - the object store hiccuped; the commit stands
            log.warning("%s: cannot reload table %s (keeping the loaded one): %s", self.app_id, self.table_name, exc)
        self._loaded = self._seen

    def _landed(self) -> int:
        """This app id's last committed seq, from the commits since the last one we saw."""
        return landed_seq(self._dt, self.app_id, self._seen, self.seq)


def app_metadata(app_id: str, seq: int) -> dict[str, str]:
    """The commit info that lets ``landed_seq`` read a commit's writer without its actions."""
    return {"streamrag.writer": app_id, "streamrag.seq": str(seq)}


def landed_seq(table: DeltaTable, app_id: str, seen: int, seq: int) -> int:
    """``app_id``'s last committed app-transaction seq, given that it was ``seq`` at table
    version ``seen``: ``table`` is brought up to date and only the commits since ``seen``
    are read, by their commit info (``app_metadata``). A commit that names no writer
    (another tool, an older version) sends it back to deltalake's ``transaction_version``,
    which reads every log entry since the last checkpoint."""
    table.update_incremental()
    now = table.version()
    if now == seen:
        return seq
    limit = now - seen + 1
    history = table.history(limit)
    # deltalake 1.6 reads history from the newest commit in storage but numbers it from the
    # table's loaded version: a commit that lands between the update and this call shifts
    # every label, and shows as more entries than asked for. Then trust nothing.
    if len(history) != min(limit, now + 1):
        return table.transaction_version(app_id) or 0
    new = [c for c in history if seen < c.get("version", -1) <= now]
    covered = {c["version"] for c in new} == set(range(seen + 1, now + 1))
    if not covered or not all("streamrag.writer" in c or c.get("operation") in _NO_APP_TXN for c in new):
        return table.transaction_version(app_id) or 0
    mine = [int(c["streamrag.seq"]) for c in new if c.get("streamrag.writer") == app_id]
    return max(mine, default=seq)
