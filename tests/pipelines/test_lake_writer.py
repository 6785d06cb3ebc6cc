from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from pipelines.lake import CHUNKS, DEAD_LETTERS, DEAD_LETTERS_SCHEMA, Lake
from pipelines.lake_writer import ConcurrentWriterError, LakeWriter


def letters(*offsets: int) -> pa.Table:
    n = len(offsets)
    return pa.table(
        {
            "topic": ["t"] * n,
            "partition": [0] * n,
            "offset": list(offsets),
            "key": [None] * n,
            "value": [b"x"] * n,
            "error": ["bad"] * n,
            "headers": ["{}"] * n,
            "ingest_time": [None] * n,
            "writer": [None] * n,
            "writer_seq": [None] * n,
        },
        schema=DEAD_LETTERS_SCHEMA,
    )


@pytest.fixture
def lake(tmp_path: Path) -> Lake:
    lake = Lake.at(str(tmp_path / "lake"))
    lake.ensure_tables(2)
    return lake


def offsets(lake: Lake) -> list[int]:
    return sorted(lake.read(DEAD_LETTERS).column("offset").to_pylist())


def test_commits_are_numbered_and_tagged(lake: Lake) -> None:
    w = LakeWriter(lake, DEAD_LETTERS, "job:dl:000", None)
    w.write(letters(1, 2))
    w.write(letters(3))
    assert w.seq == 2 and lake.table(DEAD_LETTERS).transaction_version("job:dl:000") == 2
    rows = lake.read(DEAD_LETTERS).to_pylist()
    assert {(r["offset"], r["writer"], r["writer_seq"]) for r in rows} == {
        (1, "job:dl:000", 1),
        (2, "job:dl:000", 1),
        (3, "job:dl:000", 2),
    }


def test_rows_committed_after_the_snapshot_are_skipped_on_replay(lake: Lake) -> None:
    w = LakeWriter(lake, DEAD_LETTERS, "a", None)
    w.write(letters(1))
    snapshot = w.seq  # the recovery snapshot was taken here
    w.write(letters(2, 3))
    w.write(letters(4))
    # crash; resume from the snapshot: the replay re-sends 2, 3, 4 and then new 5
    resumed = LakeWriter(lake, DEAD_LETTERS, "a", snapshot)
    assert resumed.write(letters(2, 3)).num_rows == 0
    assert resumed.write(letters(4, 5)).column("offset").to_pylist() == [5]
    assert offsets(lake) == [1, 2, 3, 4, 5]


def test_without_resume_state_everything_the_writer_wrote_is_skipped(lake: Lake) -> None:
    LakeWriter(lake, DEAD_LETTERS, "a", None).write(letters(1, 2))
    again = LakeWriter(lake, DEAD_LETTERS, "a", None)
    assert again.write(letters(1, 2, 3)).num_rows == 1
    assert offsets(lake) == [1, 2, 3]


def test_other_writers_rows_are_not_skipped(lake: Lake) -> None:
    LakeWriter(lake, DEAD_LETTERS, "a", None).write(letters(1))
    assert LakeWriter(lake, DEAD_LETTERS, "b", None).write(letters(1)).num_rows == 1


def test_two_live_writers_with_one_app_id_are_refused(lake: Lake) -> None:
    first = LakeWriter(lake, DEAD_LETTERS, "a", None)
    second = LakeWriter(lake, DEAD_LETTERS, "a", None)
    first.write(letters(1))
    with pytest.raises(ConcurrentWriterError, match="two jobs share one lake writer id"):
        second.write(letters(2))


def test_a_writer_reads_only_the_commits_since_its_last_one(lake: Lake, transaction_version_calls) -> None:
    """deltalake's ``transaction_version`` reads the whole log since the last checkpoint
    (up to 100 GETs on S3): the writer asks it once, at start, not per commit; other
    writers' and compaction commits in between are read by their commit info."""
    asked = transaction_version_calls
    a, b = LakeWriter(lake, DEAD_LETTERS, "a", None), LakeWriter(lake, DEAD_LETTERS, "b", None)
    assert asked["n"] == 2
    for i in range(0, 40, 2):
        a.write(letters(i))
        b.write(letters(i + 1))
    lake.table(DEAD_LETTERS).optimize.compact()
    a.write(letters(100))
    assert asked["n"] == 2 and offsets(lake) == [*range(40), 100] and (a.seq, b.seq) == (21, 20)


def test_a_foreign_commit_with_this_app_id_is_found_without_commit_info(lake: Lake) -> None:
    """A commit that names no streamrag writer (another tool, an older version) sends the
    writer back to the exact answer, which sees the app id taken."""
    from deltalake import CommitProperties, Transaction, write_deltalake

    w = LakeWriter(lake, DEAD_LETTERS, "a", None)
    w.write(letters(1))
    other = lake.table(DEAD_LETTERS)
    write_deltalake(other, letters(2), mode="append",
                    commit_properties=CommitProperties(app_transactions=[Transaction("a", 2)]))  # fmt: skip
    with pytest.raises(ConcurrentWriterError, match="two jobs share one lake writer id"):
        w.write(letters(3))
    assert offsets(lake) == [1, 2]


def test_a_commit_landing_while_the_writer_reads_history_is_not_misread(lake: Lake, monkeypatch) -> None:
    """deltalake numbers ``history`` from the loaded version but reads it from the newest
    commit: a commit that lands in between shifts every label. A foreign commit with this
    app id just before it must still be found."""
    from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

    from pipelines.lake_writer import app_metadata

    w = LakeWriter(lake, DEAD_LETTERS, "a", None)
    w.write(letters(1))
    foreign = CommitProperties(app_transactions=[Transaction("a", 2)], custom_metadata=app_metadata("a", 2))
    write_deltalake(lake.table(DEAD_LETTERS), letters(2), mode="append", commit_properties=foreign)
    real = DeltaTable.update_incremental

    def then_another_commit(self: DeltaTable) -> None:
        real(self)
        other = CommitProperties(app_transactions=[Transaction("b", 1)], custom_metadata=app_metadata("b", 1))
        write_deltalake(lake.table(DEAD_LETTERS), letters(3), mode="append", commit_properties=other)
        monkeypatch.setattr(DeltaTable, "update_incremental", real)

    monkeypatch.setattr(DeltaTable, "update_incremental", then_another_commit)
    with pytest.raises(ConcurrentWriterError, match="two jobs share one lake writer id"):
        w.write(letters(4))
    assert offsets(lake) == [1, 2, 3]


def test_recovery_state_from_another_lake_is_refused(lake: Lake) -> None:
    with pytest.raises(ConcurrentWriterError, match="belongs to another lake"):
        LakeWriter(lake, CHUNKS, "a", 5)


def test_a_failed_commit_is_retried_and_an_ambiguous_one_not_duplicated(lake: Lake, monkeypatch) -> None:
    import pipelines.lake_writer as mod

    real = mod.write_deltalake
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("connection reset")  # failed before committing
        if calls["n"] == 2:
            real(*args, **kwargs)
            raise OSError("timeout reading the response")  # committed, but we were not told
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, "write_deltalake", flaky)
    w = LakeWriter(lake, DEAD_LETTERS, "a", None, sleep=lambda s: None)
    w.write(letters(1, 2))
    assert offsets(lake) == [1, 2] and w.seq == 1 and calls["n"] == 2


def test_many_small_commits_get_checkpoints(lake: Lake) -> None:
    w = LakeWriter(lake, DEAD_LETTERS, "a", None)
    for i in range(105):
        w.write(letters(i))
    log = Path(lake.table_uri(DEAD_LETTERS)) / "_delta_log"
    assert list(log.glob("*.checkpoint.parquet")), "delta-rs should checkpoint every 100 commits"
    assert lake.table(DEAD_LETTERS).version() == 105 and len(offsets(lake)) == 105


def test_a_snapshot_taken_mid_replay_keeps_the_older_horizon(lake: Lake) -> None:
    """Crash, resume, snapshot before the replay caught up, crash again: still no duplicates."""
    app = "job:dl:000"
    first = LakeWriter(lake, DEAD_LETTERS, app, None)
    first.write(letters(1))
    snapshot = first.recovery_state
    assert snapshot == (1, 1)
    first.write(letters(2))
    first.write(letters(3))  # crash: the recovery state still says (1, 1)

    second = LakeWriter(lake, DEAD_LETTERS, app, snapshot[0], resume_horizon=snapshot[1])
    second.write(letters(2))  # the replay re-sends 2: skipped
    snapshot = second.recovery_state  # a snapshot while 3 has not been replayed yet
    assert snapshot == (3, 1), "the horizon must stay where rows may still be replayed"

    third = LakeWriter(lake, DEAD_LETTERS, app, snapshot[0], resume_horizon=snapshot[1])
    third.write(letters(3, 4))  # replay from after 2: 3 again (skipped) and the new 4
    assert offsets(lake) == [1, 2, 3, 4]
    # 2 will never be replayed again (the source resumed after it), but the writer cannot
    # tell: the horizon stays conservative until every row it skips has come back.
    assert third.recovery_state == (4, 1)
    fourth = LakeWriter(lake, DEAD_LETTERS, app, 4, resume_horizon=1)
    fourth.write(letters(2, 3, 4))  # a replay from the very start: all skipped
    assert offsets(lake) == [1, 2, 3, 4] and fourth.recovery_state == (4, 4)


def test_a_bare_seq_from_an_older_recovery_directory_still_resumes(lake: Lake) -> None:
    first = LakeWriter(lake, DEAD_LETTERS, "job:dl:001", None)
    first.write(letters(1))
    first.write(letters(2))
    again = LakeWriter(lake, DEAD_LETTERS, "job:dl:001", 1)
    again.write(letters(2, 3))
    assert offsets(lake) == [1, 2, 3]


def test_a_lake_made_before_the_metadata_column_is_upgraded_in_place(tmp_path: Path) -> None:
    """Older lakes lack newer nullable columns: ensure_tables adds them and old rows read as null."""
    import numpy as np
    from deltalake import DeltaTable

    from pipelines.lake import CHUNKS_SCHEMA, current_chunks
    from tests.indexing.lakes import chunk_rows

    lake = Lake.at(str(tmp_path / "old"))
    old_schema = pa.schema([f for f in CHUNKS_SCHEMA if f.name != "metadata"])
    DeltaTable.create(lake.table_uri(CHUNKS), old_schema, description="streamrag chunks table; writers=1")
    old = chunk_rows(np.eye(2, 4, dtype=np.float32)).drop_columns(["metadata"])
    LakeWriter(lake, CHUNKS, "old", None).write(old)
    assert lake.ensure_tables(1) == 1
    new = chunk_rows(np.eye(1, 4, dtype=np.float32), start=5)
    new = new.set_column(new.schema.get_field_index("metadata"), "metadata", pa.array(['{"team": "eng"}']))
    LakeWriter(lake, CHUNKS, "new", None).write(new)
    rows = current_chunks(lake, columns=["chunk_id", "metadata"]).sort_by("chunk_id").to_pylist()
    assert rows == [{"chunk_id": "c0000000", "metadata": None}, {"chunk_id": "c0000001", "metadata": None},
                    {"chunk_id": "c0000005", "metadata": '{"team": "eng"}'}]  # fmt: skip


def test_writers_that_reload_their_table_stay_exactly_once(lake: Lake, monkeypatch, transaction_version_calls) -> None:
    """A writer loads its table afresh after each checkpoint (an append costs deltalake time in
    proportion to the commits its table object replayed): across reloads, with another
    writer in between, each commit's version is its own, nothing is lost or doubled, no
    reload sends the writer back to ``transaction_version``, and a second writer with the
    same app id is still refused."""
    import pipelines.lake_writer as lake_writer

    monkeypatch.setattr(lake_writer, "CHECKPOINT_INTERVAL", 3)
    a, b = LakeWriter(lake, DEAD_LETTERS, "a", None), LakeWriter(lake, DEAD_LETTERS, "b", None)
    first_table = a._dt
    versions = []
    for i in range(0, 30, 2):
        a.write(letters(i))
        versions.append(a.table_version)
        b.write(letters(i + 1))
    assert a._dt is not first_table, "the writer must have reloaded its table"
    assert offsets(lake) == list(range(30)) and (a.seq, b.seq) == (15, 15)
    history = {c["version"]: c for c in lake.table(DEAD_LETTERS).history()}
    assert [(history[v]["streamrag.writer"], history[v]["streamrag.seq"]) for v in versions] == [
        ("a", str(seq)) for seq in range(1, 16)
    ], "a commit notice names the version of the writer's own commit"
    assert transaction_version_calls["n"] == 2
    intruder = LakeWriter(lake, DEAD_LETTERS, "a", None)
    intruder.write(letters(99))
    with pytest.raises(ConcurrentWriterError, match="two jobs share one lake writer id"):
        a.write(letters(100))


def test_a_failed_reload_keeps_the_commit_and_the_writer(lake: Lake, monkeypatch) -> None:
    """The reload after a checkpoint comes after the commit landed: an object store error
    there must not fail the commit (the job would stop and replay it)."""
    import pipelines.lake_writer as lake_writer

    monkeypatch.setattr(lake_writer, "CHECKPOINT_INTERVAL", 2)
    w = LakeWriter(lake, DEAD_LETTERS, "a", None)
    real = Lake.table

    def flaky(self: Lake, name: str, version: int | None = None):  # type: ignore[no-untyped-def]
        raise OSError("the object store said no")

    monkeypatch.setattr(Lake, "table", flaky)
    for i in range(4):
        assert w.write(letters(i)).num_rows == 1
    monkeypatch.setattr(Lake, "table", real)
    w.write(letters(4))
    assert offsets(lake) == [0, 1, 2, 3, 4] and w.seq == 5
