"""The incremental tail (retrieval/tail.py) answers exactly like a tail rebuilt from scratch.

The oracle is what the tail used to do on every commit: concatenate every row after the
base, keep the newest version of each chunk id (``latest_rows``), search its upserts
exactly, supersede every chunk id it holds. Snapshots taken earlier must not change
when the log grows after them.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.lake import latest_rows
from retrieval.acl import acl_mask
from retrieval.tail import TailLog, TailState
from tests.indexing.lakes import chunk_rows

DIM = 8
GROUPS = [frozenset(), frozenset({"a"}), frozenset({"b"}), frozenset({"a", "b"})]
ACLS = [[], ["a"], ["b"], ["a", "b"]]


def commit_rows(changes: list[tuple[int, int, bool, int]], version: int, seed: int) -> pa.Table:
    """Rows of one commit: (chunk, position, is_delete, acl choice) each."""
    rng = np.random.default_rng(seed)
    vectors = rng.normal(size=(len(changes), DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    tables = []
    for (chunk, position, delete, acl), vector in zip(changes, vectors, strict=True):
        row = chunk_rows(vector[None, :], op="delete" if delete else "upsert", position=f"pg:{position:020d}")
        row = row.set_column(0, "chunk_id", pa.array([f"chunk-{chunk}"]))
        row = row.set_column(row.schema.get_field_index("acl"), "acl", pa.array([ACLS[acl]], pa.list_(pa.string())))
        if delete:  # as the ingest job writes them: no vector
            column = row.schema.get_field_index("embedding")
            row = row.set_column(column, "embedding", pa.nulls(1, row.schema.field(column).type))
        tables.append(row)
    table = pa.concat_tables(tables)
    return table.append_column("lake_version", pa.array([version] * table.num_rows, pa.int64()))


def oracle(commits: list[pa.Table], version: int) -> tuple[pa.Table, set[str]]:
    """(newest upserts, superseded chunk ids) at ``version``, recomputed from every row."""
    rows = [c for c in commits if c.num_rows and c.column("lake_version")[0].as_py() <= version]
    if not rows:
        return pa.table({}), set()
    table = pa.concat_tables(rows)
    latest = latest_rows(table)
    live = latest.filter(pc.equal(latest.column("op"), "upsert"))
    return live, set(table.column("chunk_id").to_pylist())


def chunk_ids(table: pa.Table, mask: np.ndarray | None = None) -> list[str]:
    if table.num_rows == 0:
        return []
    return sorted((table if mask is None else table.filter(pa.array(mask))).column("chunk_id").to_pylist())


def check(state: TailState, commits: list[pa.Table], query: np.ndarray) -> None:
    live, superseded = oracle(commits, state.version)
    table = state.table
    assert chunk_ids(table, state.live) == chunk_ids(live)
    assert {c for _, ids in state.superseding(state.base_version) for c in ids} == superseded
    assert state.supersedes_any == bool(superseded)
    for groups in GROUPS:
        allowed = state.allowed(groups)
        visible = live.filter(pa.array(acl_mask(live.column("acl"), groups))) if live.num_rows else live
        assert chunk_ids(table, allowed) == chunk_ids(visible)
        rows, distances = state.search(query, 5, allowed)
        want: list[float] = []
        if visible.num_rows:
            vectors = np.stack(visible.column("embedding").to_numpy(zero_copy_only=False))
            want = sorted(2.0 - 2.0 * (vectors @ query))[:5]
        assert np.allclose(distances, want, atol=1e-5)
        assert rows.dtype == np.int64 and all(allowed[rows])
        assert np.allclose(distances, 2.0 - 2.0 * (state.vectors[rows] @ query), atol=1e-5)  # each row's own distance


change = st.tuples(st.integers(0, 12), st.integers(0, 40), st.booleans(), st.integers(0, 3))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(change, min_size=0, max_size=4), min_size=1, max_size=25), st.integers(0, 2**16))
def test_an_incremental_tail_equals_one_rebuilt_from_scratch_at_every_snapshot(
    plan: list[list[tuple[int, int, bool, int]]], seed: int
) -> None:
    base = 10
    log = TailLog(base, DIM)
    query = np.random.default_rng(seed).normal(size=DIM).astype(np.float32)
    query /= np.linalg.norm(query)
    commits: list[pa.Table] = []
    snapshots: list[TailState] = [log.snapshot()]
    for i, changes in enumerate(plan):
        version = base + 1 + i
        rows = commit_rows(changes, version, seed + i) if changes else None
        if rows is not None:
            commits.append(rows)
            log.append(rows, version)
        else:  # a commit with no chunk rows (compaction, another table's writer): the version still moves
            log.append(commit_rows([(0, 0, False, 0)], version, 0).slice(0, 0), version)
        snapshots.append(log.snapshot())
        check(snapshots[-1], commits, query)
    for state in snapshots:  # older snapshots are unchanged by the appends after them
        check(state, commits, query)
    rebase_at = base + max(1, len(plan) // 2)
    rebased = snapshots[-1].rebased(rebase_at)
    later = [c.filter(pc.greater(c.column("lake_version"), rebase_at)) for c in commits]
    check(rebased, later, query)


def test_ten_thousand_single_row_commits() -> None:
    """The shape of a quiet stream: one row per commit, many updates of few chunks, ACL changes."""
    rng = np.random.default_rng(7)
    n = 10_000
    changes = [
        (int(rng.integers(0, 500)), v, bool(rng.random() < 0.1), int(rng.integers(0, 4))) for v in range(1, n + 1)
    ]
    everything = commit_rows(changes, 0, 7).combine_chunks()
    everything = everything.set_column(
        everything.num_columns - 1, "lake_version", pa.array(range(1, n + 1), pa.int64())
    )
    log = TailLog(0, DIM)
    commits = [everything.slice(v - 1, 1) for v in range(1, n + 1)]
    for version, rows in enumerate(commits, start=1):
        log.append(rows, version)
    state = log.snapshot()
    assert state.n == n and len(state.batches) <= 15  # merged like a binary counter: log2(10k) + 1
    query = rng.normal(size=DIM).astype(np.float32)
    check(state, commits, query / np.linalg.norm(query))


def test_commit_notices_lost_duplicated_reordered_or_bogus_never_lose_or_double_apply(tmp_path) -> None:
    """Notices only wake the tail: it reads each lake version once, in order, whatever woke it,
    and a commit nobody announced is found by the (slower) poll."""
    from retrieval.tail import LakeTail, tail_at
    from serving.fake_embedder import FakeEmbedder
    from tests.retrieval.lakes import Doc, DocLake

    lake = DocLake(str(tmp_path / "lake"), FakeEmbedder())
    base = lake.write([Doc(1, "the first document")])
    tail = LakeTail(lake.lake, base, 32, poll_s=60.0)  # the poll would come far too late for this test
    tail.start()
    try:

        def wait_for(version: int) -> None:
            deadline = time.monotonic() + 10
            while tail.state.version < version:
                assert time.monotonic() < deadline, f"the tail is at {tail.state.version}, not {version}"
                time.sleep(0.01)

        v1 = lake.write([Doc(2, "announced once")])
        tail.notify(v1)
        wait_for(v1)
        v2 = lake.write([Doc(3, "announced twice")])
        tail.notify(v2)
        tail.notify(v2)
        wait_for(v2)
        v3 = lake.write([Doc(4, "never announced")])  # its notice was lost ...
        v4 = lake.write([Doc(2, "announced once, then rewritten")])
        tail.notify(v4)  # ... the next one names a later version: both are read
        wait_for(v4)
        tail.notify(v1)  # late and out of order: nothing to do
        tail.notify(v4 + 50)  # ahead of the log (a bogus notice): what exists is read, nothing invented
        v5 = lake.write([Doc(5, "after the bogus notice")])
        tail.notify(v5)
        wait_for(v5)
        time.sleep(0.1)
        state = tail.state
        assert state.version == v5 and v3 < v4
        rebuilt = tail_at(lake.lake, base, v5, 32)
        assert state.n == rebuilt.n == 5  # every row once: none lost, none applied twice
        assert state.table.column("chunk_id").to_pylist() == rebuilt.table.column("chunk_id").to_pylist()
        assert state.live_rows == rebuilt.live_rows == 5
    finally:
        tail.stop()


def test_a_lost_notice_costs_at_most_one_poll_interval(tmp_path) -> None:
    from retrieval.tail import LakeTail
    from serving.fake_embedder import FakeEmbedder
    from tests.retrieval.lakes import Doc, DocLake

    lake = DocLake(str(tmp_path / "lake"), FakeEmbedder())
    base = lake.write([Doc(1, "the first document")])
    tail = LakeTail(lake.lake, base, 32, poll_s=0.3)
    tail.start()
    try:
        version = lake.write([Doc(2, "nobody announced this commit")])
        deadline = time.monotonic() + 10
        while tail.state.version < version:
            assert time.monotonic() < deadline, "the poll never found the unannounced commit"
            time.sleep(0.05)
    finally:
        tail.stop()


def test_a_follower_sees_each_new_state_before_queries_do(tmp_path) -> None:
    """The keyword copy follows the tail this way: a query never finds a state its copy lacks
    (and never waits for the copy's commit), and a failing follower stops nothing."""
    from retrieval.tail import LakeTail
    from serving.fake_embedder import FakeEmbedder
    from tests.retrieval.lakes import Doc, DocLake

    lake = DocLake(str(tmp_path / "lake"), FakeEmbedder())
    base = lake.write([Doc(1, "the first document")])
    tail = LakeTail(lake.lake, base, 32, poll_s=60)
    seen: list[tuple[int, int]] = []  # (the state handed over, the state queries had meanwhile)

    def follow(state) -> None:  # type: ignore[no-untyped-def]
        seen.append((state.version, tail.state.version))
        if len(seen) == 1:
            raise RuntimeError("a follower that fails")

    tail.on_change = follow
    v1 = lake.write([Doc(2, "one")])
    assert tail.poll() and tail.state.version == v1  # published although its follower failed
    v2 = lake.write([Doc(3, "two")])
    assert tail.poll() and tail.state.version == v2
    assert seen == [(v1, base), (v2, v1)]
    assert not tail.poll() and len(seen) == 2  # no new rows: nothing to follow


def test_log_cleaned_up_past_the_tail_is_rebuilt_from_the_snapshot(tmp_path) -> None:
    """A checkpoint plus log cleanup (delta.logRetentionDuration) removes commit files the tail
    has not read: it rebuilds from the table's snapshot by the writers' commit numbers, then
    follows the log again; without those numbers it says how to recover, and as_of into the
    gap is refused."""
    import pytest

    from indexing.snapshot import writer_seqs
    from pipelines.lake import CHUNKS
    from retrieval.delta_log import TailError
    from retrieval.tail import LakeTail, tail_at
    from serving.fake_embedder import FakeEmbedder
    from tests.retrieval.lakes import Doc, DocLake

    lake = DocLake(str(tmp_path / "lake"), FakeEmbedder())
    base = lake.write([Doc(1, "in the index"), Doc(2, "in the index too"), Doc(7, "untouched in the index")])
    seqs = writer_seqs(lake.lake.table(CHUNKS).to_pyarrow_table(columns=["writer", "writer_seq"]))
    tail = LakeTail(lake.lake, base, 32, poll_s=60, writer_seqs=seqs)
    tail.CLEANUP_CHECK_S = 0.0
    bare = LakeTail(lake.lake, base, 32, poll_s=60)  # an index from before manifests had writer numbers
    bare.CLEANUP_CHECK_S = 0.0
    read = lake.write([Doc(3, "read from the log")])
    assert tail.poll() and bare.poll() and tail.state.version == read
    lake.write([Doc(1, "in the index")], op="delete")
    lake.write([Doc(4, "never read from the log"), Doc(2, "in the index too")], op="upsert")
    last = lake.write([Doc(5, "the newest")])
    want = tail_at(lake.lake, base, last, 32)  # what the log said, before it goes
    table = lake.lake.table(CHUNKS)
    table.optimize.compact()  # compaction while tailing: rewrites with dataChange false
    table.alter.set_table_properties({"delta.logRetentionDuration": "interval 0 seconds"})
    table.create_checkpoint()
    table.cleanup_metadata()
    assert tail.reader.commit(read + 1) is None and tail.reader.cleaned_up(read)

    assert tail.poll()
    state = tail.state
    assert state.version == table.version() and state.base_version == base
    assert chunk_ids(state.table, state.live) == chunk_ids(want.table, want.live)
    got = {c for _, ids in state.superseding(base) for c in ids}
    assert got == {c for _, ids in want.superseding(base) for c in ids}
    after = lake.write([Doc(6, "after the cleanup")])  # the log is followed again from here
    assert tail.poll() and tail.state.version == after
    assert tail.state.live_rows == want.live_rows + 1

    with pytest.raises(TailError, match="publish a new index"):
        bare.poll()
    with pytest.raises(TailError, match="missing from the log"):
        tail_at(lake.lake, base, last, 32)


def test_rows_deleted_from_the_lake_are_reported_until_an_index_covers_them(tmp_path) -> None:
    """The ingest job only appends; a DELETE run on the chunks table (a purge) cannot be
    expressed by the tail, so it is reported (health says which versions) until rebased."""
    from pipelines.lake import CHUNKS
    from retrieval.tail import LakeTail
    from serving.fake_embedder import FakeEmbedder
    from tests.retrieval.lakes import Doc, DocLake

    lake = DocLake(str(tmp_path / "lake"), FakeEmbedder())
    base = lake.write([Doc(1, "kept"), Doc(2, "purged by hand")])
    tail = LakeTail(lake.lake, base, 32, poll_s=60)
    table = lake.lake.table(CHUNKS)
    table.delete("source_pk = '2'")
    compacted = lake.write([Doc(3, "later")])
    table.update_incremental()
    table.optimize.compact()  # compaction's removes carry dataChange false: not a purge
    assert tail.poll() and tail.reader.removals == [base + 1]
    while tail.poll():
        pass
    assert tail.reader.removals == [base + 1]
    tail.rebase(compacted, None)
    assert tail.reader.removals == []
