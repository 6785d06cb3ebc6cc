"""``streamrag lake maintain``: compaction, checkpoints and vacuum, off the stream's hot path.

The ingest job only appends: one small file per commit and writer, several a second on a
busy stream. Compacting inline stalled the dataflow for the length of a rewrite, and
nothing ever deleted the small files that compaction replaced. This job does both, from
cron or in a loop (``--every``), while the stream and the replicas go on:

1. **Compaction** (``optimize.compact``) rewrites small files into files of up to
   ``target_mb`` (32), with ``dataChange: false``: a replica's tail skips such commits, an
   index build reads the same rows, and the streaming writers' blind appends never conflict
   with it. Run it often (``--every 60``): in deltalake 1.6 every commit costs time in
   proportion to the files in the table (measured: 31 ms per commit at 200 files, 145 ms
   at 1,000), so small files slow the stream's commits, and with them freshness. Files
   that reached ``target_mb`` are never rewritten again, which bounds the rewriting a
   frequent compaction does.
2. **A checkpoint** after a compaction, so that opening the table reads one Parquet file
   instead of every commit since the last one.
3. **Vacuum**: files that compaction replaced are deleted only when nothing still promises
   to read them. For ``chunks`` that is every file removed after the commit of the
   **oldest kept index version's lake version** (each ``--index`` store is read): an
   ``as_of`` request for any version from there on, and a replica that rebuilds its tail
   from that index, read the files that version's snapshot and the commits after it name.
   On every table, files removed less than ``--retention-hours`` ago (168, Delta's default:
   ``as_of`` promises and the audit period) are kept too. Vacuum removes only files that a
   commit *removed*; the rows of the lake are never lost by it.
4. **Log cleanup** (Delta's ``logRetentionDuration``, 30 days unless the table says
   otherwise) runs only when the oldest kept index version's commit is younger than that,
   so time travel to every kept version keeps working.

The retention floor is one hour: an index build that started before the run and reads its
snapshot's files for longer than that could otherwise lose them.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta

from deltalake import DeltaTable

from indexing.manifest import load_manifest, versions
from indexing.snapshot import commit_changes
from indexing.store import open_store
from pipelines.lake import CHUNKS, DEAD_LETTERS, Lake, LakeError

log = logging.getLogger(__name__)

#: the audit table (``retrieval.audit.ANSWERS``; the indexing package does not import the service)
ANSWERS = "answers"
TABLES = (CHUNKS, DEAD_LETTERS, ANSWERS)

MIN_RETENTION_HOURS = 1.0
#: compacted files are made up to this size; larger ones are never rewritten
DEFAULT_TARGET_MB = 32.0
DEFAULT_RETENTION_HOURS = 168.0
#: writers' clocks may disagree by this much (a file's removal time is its writer's clock)
CLOCK_MARGIN = timedelta(hours=1)
#: Delta's default log retention when a table does not set ``delta.logRetentionDuration``
DEFAULT_LOG_RETENTION = timedelta(days=30)

_INTERVAL = re.compile(r"interval\s+(\d+)\s+(second|minute|hour|day|week)s?", re.IGNORECASE)


class MaintainError(Exception):
    """Maintenance cannot run safely; the message says why."""


@dataclass
class TableReport:
    table: str
    files_before: int = 0
    files_after: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    files_compacted: int = 0  # small files rewritten
    files_written: int = 0  # the large files they became
    checkpoint_version: int | None = None
    retention_hours: float = 0.0
    vacuumed: int | None = None  # files deleted (or that would be, with dry_run); None: no vacuum this round
    log_cleanup: str = "skipped"
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


@dataclass
class Protection:
    """What vacuum must keep on ``chunks``: files removed after ``since`` (the commit of
    ``lake_version``, the oldest kept index version's), or nothing in particular (None)."""

    lake_version: int | None = None
    since: datetime | None = None
    index_versions: dict[str, int] = field(default_factory=dict)  # store URI → oldest kept version


def oldest_index_protection(lake: Lake, index_uris: list[str]) -> Protection:
    """The oldest lake version any kept version of these index stores was built from, and when
    it was committed (read from its log file: one GET)."""
    oldest: int | None = None
    kept: dict[str, int] = {}
    for uri in index_uris:
        store = open_store(uri, lake.store)
        numbers = versions(store)
        if not numbers:
            continue
        manifest = load_manifest(store, numbers[0])
        if manifest.lake_uri.rstrip("/") != lake.uri.rstrip("/"):
            raise MaintainError(f"index {uri} was built from {manifest.lake_uri}, not {lake.uri}: check --index.")
        kept[uri] = numbers[0]
        oldest = manifest.lake_version if oldest is None else min(oldest, manifest.lake_version)
    if oldest is None:
        return Protection(index_versions=kept)
    return Protection(oldest, commit_time(lake, CHUNKS, oldest), kept)


def commit_time(lake: Lake, table: str, version: int) -> datetime:
    """When ``version`` of ``table`` was committed: its commit info's timestamp (one GET)."""
    changes = commit_changes(open_store(lake.table_uri(table), lake.store), version)
    if changes is None:
        # Its log entry was cleaned up: a checkpoint holds the state, but not when. Keep
        # everything an hour-floored retention cannot prove unneeded: refuse rather than guess.
        raise MaintainError(
            f"the log entry of lake version {version} (the oldest kept index version's) is gone, so "
            "its commit time is unknown: vacuum would guess. Build a new index and let --keep retire the old one."
        )
    if changes.timestamp_ms is None:
        raise MaintainError(f"lake version {version} has no commit timestamp")
    return datetime.fromtimestamp(changes.timestamp_ms / 1000, UTC)


def log_retention(table: DeltaTable) -> timedelta:
    raw = table.metadata().configuration.get("delta.logRetentionDuration") or ""
    match = _INTERVAL.fullmatch(raw.strip())
    if not match:
        return DEFAULT_LOG_RETENTION
    n, unit = int(match.group(1)), match.group(2).lower()
    return timedelta(**{f"{unit}s": n})


def _span(span: timedelta) -> str:
    hours = span.total_seconds() / 3600
    return f"{hours / 24:g} days" if hours >= 48 else f"{hours:g} h"


def _files(table: DeltaTable) -> tuple[int, int]:
    adds = table.get_add_actions(flatten=True)
    sizes = [int(s) for s in adds.column("size_bytes").to_pylist()] if adds.num_rows else []
    return len(sizes), int(sum(sizes))


def maintain_table(
    table: DeltaTable,
    name: str,
    retention_hours: float,
    protect_since: datetime | None = None,
    dry_run: bool = False,
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
    attempts: int = 3,
    vacuum: bool = True,
    target_mb: float = DEFAULT_TARGET_MB,
) -> TableReport:
    """Compact, checkpoint and (``vacuum``) vacuum one table; errors are reported, not raised."""
    started = time.perf_counter()
    report = TableReport(name)
    report.files_before, report.bytes_before = _files(table)
    if not dry_run:
        for attempt in range(1, attempts + 1):
            try:
                metrics = table.optimize.compact(target_size=int(target_mb * (1 << 20)))
                report.files_compacted += int(metrics.get("numFilesRemoved", 0))
                report.files_written += int(metrics.get("numFilesAdded", 0))
                break
            except Exception as exc:  # noqa: BLE001 - a concurrent commit: try again, then report
                log.warning("%s: compaction attempt %d failed: %s", name, attempt, exc)
                if attempt == attempts:
                    report.errors.append(f"compaction: {exc}")
                table.update_incremental()
        if report.files_compacted:  # else nothing to gain: delta-rs checkpoints every 100 commits itself
            try:
                table.update_incremental()
                table.create_checkpoint()
                report.checkpoint_version = table.version()
            except Exception as exc:  # noqa: BLE001
                report.errors.append(f"checkpoint: {exc}")
    hours = max(retention_hours, MIN_RETENTION_HOURS)
    if protect_since is not None:
        hours = max(hours, (now() - protect_since + CLOCK_MARGIN).total_seconds() / 3600)
    report.retention_hours = round(hours, 3)
    if vacuum:
        try:
            doomed = table.vacuum(
                retention_hours=int(hours) + (hours % 1 > 0), dry_run=dry_run, enforce_retention_duration=False
            )
            report.vacuumed = len(doomed)
        except Exception as exc:  # noqa: BLE001
            report.errors.append(f"vacuum: {exc}")
    if vacuum and not dry_run:
        keep_log = log_retention(table)
        if protect_since is not None and now() - protect_since + CLOCK_MARGIN >= keep_log:
            report.log_cleanup = (
                f"skipped: the oldest kept index version is older than the log retention ({_span(keep_log)})"
            )
        else:
            try:
                table.cleanup_metadata()
                report.log_cleanup = f"done (log retention {_span(keep_log)})"
            except Exception as exc:  # noqa: BLE001
                report.errors.append(f"log cleanup: {exc}")
    table.update_incremental()
    report.files_after, report.bytes_after = _files(table)
    report.seconds = round(time.perf_counter() - started, 3)
    return report


def check_retention(hours: float) -> None:
    if hours < MIN_RETENTION_HOURS:
        raise MaintainError(
            f"--retention-hours must be at least {MIN_RETENTION_HOURS:g}: "
            "index builds in progress read the files of their snapshot."
        )


def maintain_lake(
    lake: Lake,
    index_uris: list[str],
    retention_hours: float = DEFAULT_RETENTION_HOURS,
    dry_run: bool = False,
    tables: tuple[str, ...] = TABLES,
    vacuum: bool = True,
    target_mb: float = DEFAULT_TARGET_MB,
) -> tuple[Protection, list[TableReport]]:
    """Maintain every table of the lake; ``vacuum`` False: compaction and checkpoints only
    (``--every`` rounds between vacuums)."""
    check_retention(retention_hours)
    protection = oldest_index_protection(lake, index_uris) if vacuum else Protection()
    reports = []
    for name in tables:
        since = protection.since if name == CHUNKS else None
        try:
            table = lake.table(name)
        except LakeError:
            continue  # e.g. no answers table: the service never answered
        report = maintain_table(table, name, retention_hours, since, dry_run, vacuum=vacuum, target_mb=target_mb)
        log.debug("lake maintain %s: %s", name, asdict(report))
        reports.append(report)
    return protection, reports
