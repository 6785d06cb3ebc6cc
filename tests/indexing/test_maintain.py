"""``lake maintain``: compaction keeps every row and the writers' exactly-once state, and
vacuum deletes no file that a kept index version, its tail or ``as_of`` still reads."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import indexing.maintain as maintain
from indexing.ivf import BuildOptions, build_index
from indexing.maintain import MaintainError, maintain_lake
from indexing.manifest import publish
from indexing.snapshot import plan
from indexing.store import LocalStore
from pipelines.lake import CHUNKS, Lake, current_chunks
from pipelines.lake_writer import LakeWriter
from pipelines.storage import ObjectStoreSettings
from tests.indexing.lakes import chunk_rows, synthetic_lake

OPTS = BuildOptions(nlist=4, iterations=4, progress=False, executor="local", keyword=False)
ROOT = Path(__file__).resolve().parents[2]


def small_commits(lake: Lake, x: np.ndarray, start: int, commits: int, app_id: str = "w") -> LakeWriter:
    writer = LakeWriter(lake, CHUNKS, app_id, None)
    for i in range(commits):
        writer.write(chunk_rows(x[i : i + 1] * 0.5, start=start + i))
    return writer


def readable(lake: Lake, version: int) -> bool:
    try:
        lake.read(CHUNKS, version, columns=["chunk_id"])
        return True
    except Exception:  # noqa: BLE001 - a vacuumed file: "No such file or directory"
        return False


@pytest.fixture
def no_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests cannot wait an hour for removed files to age past the floor and clock margin."""
    monkeypatch.setattr(maintain, "MIN_RETENTION_HOURS", 0.0)
    monkeypatch.setattr(maintain, "CLOCK_MARGIN", maintain.timedelta(0))


def test_compaction_keeps_rows_and_the_writers_exactly_once_state(tmp_path: Path) -> None:
    lake, x = synthetic_lake(str(tmp_path / "lake"), n=200, files=2)
    writer = small_commits(lake, x, 1000, 30)
    before = current_chunks(lake).sort_by("chunk_id")
    protection, reports = maintain_lake(lake, [], retention_hours=1)
    chunks = next(r for r in reports if r.table == CHUNKS)
    assert protection.lake_version is None and not chunks.errors
    assert chunks.files_before == 32 and chunks.files_after == 1 and chunks.files_compacted == 32
    assert chunks.checkpoint_version is not None and chunks.vacuumed == 0  # removed just now: kept for an hour
    assert current_chunks(lake).sort_by("chunk_id").equals(before)
    # The writer goes on numbering its commits, and a restart skips replayed rows as before.
    writer.write(chunk_rows(x[:1] * 0.25, start=5000))
    resumed = LakeWriter(lake, CHUNKS, "w", 29)
    replay = chunk_rows(x[29:30] * 0.5, start=1029)
    assert resumed.write(replay).num_rows == 0 and resumed.seq == 31


def test_vacuum_keeps_what_the_oldest_kept_index_version_reads(tmp_path: Path, no_floor: None) -> None:
    lake, x = synthetic_lake(str(tmp_path / "lake"), n=300, files=3)
    store = LocalStore(str(tmp_path / "index"))
    publish(store, build_index(plan(lake), store.root, ObjectStoreSettings(), OPTS))
    indexed = lake.table(CHUNKS).version()
    small_commits(lake, x, 1000, 6)
    between = lake.table(CHUNKS).version() - 2  # an as_of version after the index's
    time.sleep(0.05)
    protection, reports = maintain_lake(lake, [store.root], retention_hours=0)
    assert protection.lake_version == indexed and protection.index_versions == {store.root: 1}
    chunks = next(r for r in reports if r.table == CHUNKS)
    assert chunks.files_compacted == 9 and chunks.vacuumed == 0, "every compacted file was removed after the index"
    assert readable(lake, indexed) and readable(lake, between)

    # Without the index's protection the same files go, and those versions are gone with them.
    _, reports = maintain_lake(lake, [], retention_hours=0)
    assert next(r for r in reports if r.table == CHUNKS).vacuumed == 9
    assert not readable(lake, indexed) and not readable(lake, between) and readable(lake, lake.table(CHUNKS).version())


def test_dry_run_changes_nothing(tmp_path: Path, no_floor: None) -> None:
    lake, x = synthetic_lake(str(tmp_path / "lake"), n=100, files=2)
    small_commits(lake, x, 1000, 5)
    lake.table(CHUNKS).optimize.compact()
    version = lake.table(CHUNKS).version()
    _, reports = maintain_lake(lake, [], retention_hours=0, dry_run=True)
    chunks = next(r for r in reports if r.table == CHUNKS)
    assert chunks.vacuumed == 7 and chunks.files_compacted == 0
    assert lake.table(CHUNKS).version() == version and readable(lake, 1)


def test_an_index_of_another_lake_is_refused(tmp_path: Path) -> None:
    lake, _ = synthetic_lake(str(tmp_path / "lake"), n=100, files=1)
    other, _ = synthetic_lake(str(tmp_path / "other"), n=100, files=1)
    store = LocalStore(str(tmp_path / "index"))
    publish(store, build_index(plan(other), store.root, ObjectStoreSettings(), OPTS))
    with pytest.raises(MaintainError, match="was built from"):
        maintain_lake(lake, [store.root])
    with pytest.raises(MaintainError, match="at least 1"):
        maintain_lake(lake, [], retention_hours=0.5)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "retrieval.cli", "lake", "maintain", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)  # fmt: skip


def test_the_command_requires_the_indexes_and_reports_what_it_did(tmp_path: Path) -> None:
    lake, x = synthetic_lake(str(tmp_path / "lake"), n=100, files=1)
    small_commits(lake, x, 1000, 4)
    refused = cli("--lake", lake.uri)
    assert refused.returncode == 2 and "--index URI" in refused.stderr and "--no-index" in refused.stderr
    done = cli("--lake", lake.uri, "--no-index", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    chunks = next(t for t in report["tables"] if t["table"] == CHUNKS)
    assert (chunks["files_before"], chunks["files_after"], chunks["retention_hours"]) == (5, 1, 168)
    text = cli("--lake", lake.uri, "--no-index")
    assert text.returncode == 0 and "chunks: 1 files" in text.stdout, text.stdout


def test_a_loop_that_cannot_vacuum_safely_keeps_compacting(tmp_path: Path) -> None:
    """--every never crash-loops: an index of another lake stops vacuum, not compaction."""
    lake, x = synthetic_lake(str(tmp_path / "lake"), n=100, files=1)
    other, _ = synthetic_lake(str(tmp_path / "other"), n=100, files=1)
    store = LocalStore(str(tmp_path / "index"))
    publish(store, build_index(plan(other), store.root, ObjectStoreSettings(), OPTS))
    small_commits(lake, x, 1000, 4)
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrieval.cli", "lake", "maintain", "--lake", lake.uri, "--index", store.root,
         "--every", "0.5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(lake.table(CHUNKS).file_uris()) > 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(lake.table(CHUNKS).file_uris()) == 1
        assert proc.poll() is None, "the loop must go on"
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=30)
    assert "was built from" in err and "compacting without vacuum" in err
    refused = cli("--lake", lake.uri, "--no-index", "--retention-hours", "0.5")
    assert refused.returncode == 2 and "at least 1" in refused.stderr
