"""A run never resumes keyed state from an epoch that a killed run did not finish.

bytewax 0.21 keeps the snapshots of a killed run's unfinished epochs, and the next run starts
at the same epoch number: a key it does not touch before finishing that epoch keeps the dead
run's snapshot under a finished label, and the run after loads it (``pipelines.recovery``).
"""

from __future__ import annotations

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
