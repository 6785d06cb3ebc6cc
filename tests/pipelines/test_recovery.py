"""A run never resumes keyed state from an epoch that a killed run did not finish.

bytewax 0.21 keeps the snapshots of a killed run's unfinished epochs, and the next run starts
at the same epoch number: a key it does not touch before finishing that epoch keeps the dead
run's snapshot under a finished label, and the run after loads it (``pipelines.recovery``).
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from bytewax.recovery import init_db_dir

from pipelines.recovery import drop_unfinished_epochs

ROOT = Path(__file__).resolve().parents[2]


def _run(recovery: Path, out: Path, block_after: int, quiet_s: float, kill_after_s: float | None) -> None:
    args = [str(recovery), str(out), str(block_after), str(quiet_s)]
    proc = subprocess.Popen([sys.executable, "-m", "tests.pipelines.epochs_flow", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    if kill_after_s is None:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()[-2000:]
        return
    time.sleep(kill_after_s)
    assert proc.poll() is None, "the run ended before its kill"
    proc.kill()
    proc.communicate(timeout=30)


def _wrong_counts(out: Path) -> list[str]:
    lines = out.read_text().splitlines() if out.exists() else []
    return [line for line in lines if int(line.split()[2]) != int(line.split()[1]) // 5 + 1]


def test_a_killed_runs_unfinished_epoch_is_not_resumed_by_the_run_after_next(tmp_path: Path) -> None:
    recovery = tmp_path / "recovery"
    recovery.mkdir()
    init_db_dir(recovery, 1)
    # 1: counts 140 items in its first epochs, then its sink hangs in a snapshot: that epoch's
    # counts are snapshotted, the epoch never finishes, the run is killed
    _run(recovery, tmp_path / "out1", block_after=140, quiet_s=0.0, kill_after_s=4)
    assert drop_unfinished_epochs(recovery) > 0
    # 2: resumes at that epoch number, stays quiet while its first epochs finish empty (the keys
    # untouched), then counts and hangs again, and is killed
    _run(recovery, tmp_path / "out2", block_after=1, quiet_s=1.0, kill_after_s=4)
    drop_unfinished_epochs(recovery)
    # 3: to the end; every count must agree with the items before it
    _run(recovery, tmp_path / "out3", block_after=0, quiet_s=0.0, kill_after_s=None)
    assert (tmp_path / "out3").exists()
    assert _wrong_counts(tmp_path / "out3") == []


Rows = list[tuple[int, int, int]]


def _partition(path: Path, exs: Rows, fronts: Rows, snaps: list[int]) -> None:
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("CREATE TABLE exs (ex_num INTEGER, worker_count INTEGER, resume_epoch INTEGER)")
        conn.execute("CREATE TABLE fronts (ex_num INTEGER, worker_index INTEGER, worker_frontier INTEGER)")
        conn.execute("CREATE TABLE snaps (step_id TEXT, state_key TEXT, snap_epoch INTEGER, ser_change BLOB)")
        conn.executemany("INSERT INTO exs VALUES (?, ?, ?)", exs)
        conn.executemany("INSERT INTO fronts VALUES (?, ?, ?)", fronts)
        conn.executemany("INSERT INTO snaps VALUES ('s', 'k', ?, NULL)", [(e,) for e in snaps])
    conn.close()


def _epochs_left(path: Path) -> list[int]:
    conn = sqlite3.connect(path)
    try:
        return sorted(e for (e,) in conn.execute("SELECT snap_epoch FROM snaps"))
    finally:
        conn.close()


def test_the_resume_epoch_is_the_last_runs_lowest_frontier_or_its_start_when_a_worker_recorded_none(
    tmp_path: Path,
) -> None:
    """As bytewax computes it (checked against bytewax 0.21: a run whose worker 1 recorded no
    frontier was resumed at the epoch it had started at, not at worker 0's frontier)."""
    every = tmp_path / "every"
    every.mkdir()
    _partition(every / "part-0.sqlite3", [(0, 2, 1)], [(1, 0, 7)], [1, 3, 6, 7, 8])
    _partition(every / "part-1.sqlite3", [(1, 3, 4)], [(1, 1, 6), (1, 2, 9)], [5, 6, 9])
    assert drop_unfinished_epochs(every) == 5  # ex 1 resumes at min(7, 6, 9) = 6
    assert _epochs_left(every / "part-0.sqlite3") == [1, 3] and _epochs_left(every / "part-1.sqlite3") == [5]
    missing = tmp_path / "missing"
    missing.mkdir()
    _partition(missing / "part-0.sqlite3", [(0, 2, 1), (1, 3, 4)], [(1, 0, 7), (1, 1, 8)], [3, 4, 7])
    assert drop_unfinished_epochs(missing) == 2  # worker 2 of ex 1 recorded no frontier: from 4, where ex 1 began
    assert _epochs_left(missing / "part-0.sqlite3") == [3]
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    _partition(fresh / "part-0.sqlite3", [], [], [])
    assert drop_unfinished_epochs(fresh) == 0
