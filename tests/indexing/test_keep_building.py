"""``index build --every/--tail-rows``: when a continuous builder publishes a new version.

The builds themselves are recorded, not run (``test_ivf`` covers them); what is tested is
the decision: at once when no index covers the lake, then after ``--tail-rows`` chunk
versions (compaction rewrites not counted), or after ``--every`` seconds of changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import indexing.commands as commands
from indexing.settings import IndexBuildSettings
from pipelines.lake import CHUNKS
from pipelines.lake_writer import LakeWriter
from tests.indexing.lakes import chunk_rows, synthetic_lake


class Rounds:
    """Runs the builder's loop one check at a time: ``step(action)`` acts, then lets one check run."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.builds: list[int] = []
        self.now = 1000.0
        self.actions: list[Any] = []
        monkeypatch.setattr(commands, "_build_once", self._build)
        monkeypatch.setattr(commands.time, "sleep", self._sleep)
        monkeypatch.setattr(commands.time, "monotonic", lambda: self.now)
        self.lake: Any = None

    def _build(self, config: IndexBuildSettings, as_json: bool) -> int:
        self.builds.append(self.lake.table(CHUNKS).version())
        return 0

    def _sleep(self, seconds: float) -> None:
        self.now += seconds
        if not self.actions:
            raise StopIteration  # the script is over
        self.actions.pop(0)()


def test_tail_rows_and_every_trigger_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lake, _ = synthetic_lake(str(tmp_path / "lake"), n=100, dim=8, files=1)
    rounds = Rounds(monkeypatch)
    rounds.lake = lake
    writer = LakeWriter(lake, CHUNKS, "test", None)
    rng = np.random.default_rng(0)
    start = iter(range(1000, 10_000, 10))

    def commit(rows: int) -> Any:
        return lambda: writer.write(chunk_rows(rng.normal(size=(rows, 8)).astype(np.float32), start=next(start)))

    def compact() -> None:
        lake.table(CHUNKS).optimize.compact()

    built_at: list[int] = []
    rounds.actions = [
        lambda: built_at.append(len(rounds.builds)),  # after the first check: built at once (no index)
        commit(3),
        compact,  # rewrites 103 rows with dataChange false: not counted
        lambda: built_at.append(len(rounds.builds)),  # 3 rows < 5: no build
        commit(3),
        lambda: built_at.append(len(rounds.builds)),  # 6 rows >= 5: built
        commit(1),
        *[lambda: None] * 11,  # 12 checks of 5 s: --every 60 passed with a change waiting
        lambda: built_at.append(len(rounds.builds)),
    ]
    config = IndexBuildSettings(lake=str(tmp_path / "lake"), index=str(tmp_path / "index"), every=60, tail_rows=5)
    with pytest.raises(StopIteration):
        commands._keep_building(config, as_json=False)
    assert built_at == [1, 1, 2, 3]
    versions = lake.table(CHUNKS).version()
    assert rounds.builds[-1] == versions  # the last build saw every commit


def test_rows_committed_counts_new_rows_only(tmp_path: Path) -> None:
    from indexing.snapshot import rows_committed

    lake, _ = synthetic_lake(str(tmp_path / "lake"), n=40, dim=8, files=2)
    before = lake.table(CHUNKS).version()
    LakeWriter(lake, CHUNKS, "test", None).write(chunk_rows(np.ones((7, 8), np.float32), start=500))
    lake.table(CHUNKS).optimize.compact()
    after = lake.table(CHUNKS).version()
    assert rows_committed(lake, before, after) == 7
    assert rows_committed(lake, 0, after) is not None
    assert rows_committed(lake, after, after) == 0
    assert rows_committed(lake, before, after + 1) is None  # not committed yet: unknown, not zero


def test_a_failed_read_of_the_lake_is_retried_but_not_a_problem_with_the_lake(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import indexing.snapshot as snapshot
    from pipelines.lake import LakeError

    lake, _ = synthetic_lake(str(tmp_path / "lake"), n=20, dim=8, files=1)
    real, calls = snapshot.plan, []

    def flaky(lake: Any, version: int | None = None) -> Any:
        calls.append(version)
        if len(calls) == 1:
            raise OSError("Generic LocalFileSystem error: a log file read while it was replaced")
        return real(lake, version)

    monkeypatch.setattr(snapshot, "plan", flaky)
    assert commands._plan(lake, None).count == 20
    assert len(calls) == 2
    assert "reading the lake" in caplog.text and "a log file read while it was replaced" in caplog.text

    def broken(lake: Any, version: int | None = None) -> Any:
        calls.append(version)
        raise LakeError("the lake has no live chunks")

    calls.clear()
    monkeypatch.setattr(snapshot, "plan", broken)
    with pytest.raises(LakeError, match="no live chunks"):
        commands._plan(lake, None)
    assert len(calls) == 1  # what is wrong with the lake does not change by reading again

    def failing(lake: Any, version: int | None = None) -> Any:
        calls.append(version)
        raise OSError("the disk is gone")

    calls.clear()
    monkeypatch.setattr(snapshot, "plan", failing)
    with pytest.raises(OSError, match="the disk is gone"):
        commands._plan(lake, None)
    assert len(calls) == 3
