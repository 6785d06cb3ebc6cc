"""The recovery directory before a run: snapshots of epochs the last run never finished go.

bytewax 0.21 labels each snapshot with the epoch it ends and, on resume, loads for every key
its newest snapshot *before* the resume epoch (the first epoch the last run did not finish).
Snapshots of the unfinished epochs stay in the directory, and the next run starts at that
same epoch number. A key the next run does not touch before it finishes that epoch keeps the
dead run's snapshot under a finished label, and the run after loads it: keyed state ahead of
the source offsets it resumes from. For the ingest job that is a document state that claims
changes whose rows were never committed: on replay they are stale, and the rows are lost
(the rescale crash test lost 9–11 inserted documents about once in 40 runs; reproduced with
bytewax alone in ``tests/pipelines/test_recovery.py``).

So before each run (``runner.prepare``) the snapshots labelled at or after the epoch the run
will resume at are deleted: computed by bytewax's own rule (``resume_epoch``), they are exactly
the snapshots that no run may load. ``python -m bytewax.run`` on the flow skips this (and the
rest of ``prepare``): run the job with ``streamrag ingest``.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

log = logging.getLogger(__name__)


def resume_epoch(parts: list[sqlite3.Connection]) -> int | None:
    """The epoch the next run resumes at: the last run's lowest worker frontier, or the epoch
    it resumed at itself when not every one of its workers recorded a frontier (bytewax 0.21's
    own rule: a run whose worker 1 had recorded none was resumed where it had begun, not at
    worker 0's frontier). None: no run yet."""
    runs = [row for conn in parts for row in conn.execute("SELECT ex_num, worker_count, resume_epoch FROM exs")]
    if not runs:
        return None
    ex_num, worker_count, started_at = max(runs)
    fronts = [row for conn in parts for row in conn.execute(
        "SELECT worker_index, worker_frontier FROM fronts WHERE ex_num = ?", (ex_num,))]  # fmt: skip
    if len({worker for worker, _ in fronts}) < worker_count:
        return int(started_at)
    return int(min(frontier for _, frontier in fronts))


def drop_unfinished_epochs(recovery_dir: Path) -> int:
    """Delete the snapshots of the epochs the last run did not finish; return how many went."""
    paths = sorted(recovery_dir.glob("part-*.sqlite3"))
    if not paths:
        return 0
    conns = [sqlite3.connect(path, timeout=60) for path in paths]
    try:
        epoch = resume_epoch(conns)
        if epoch is None:
            return 0
        dropped = 0
        for conn in conns:
            with conn:  # one transaction per partition
                dropped += conn.execute("DELETE FROM snaps WHERE snap_epoch >= ?", (epoch,)).rowcount
    finally:
        for conn in conns:
            conn.close()
    if dropped:
        log.info("recovery: dropped %d snapshots of the epochs from %d on, unfinished by the last run", dropped, epoch)
    return dropped
