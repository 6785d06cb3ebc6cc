"""Incremental builds: a version that shares the last full build's shards, with dead rows and a delta."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from deltalake import DeltaTable

from indexing.ivf import BuildOptions, build_index
from indexing.manifest import Manifest, ManifestError, collect_garbage, load_manifest, publish
from indexing.reader import IndexReader
from indexing.snapshot import plan
from indexing.store import LocalStore
from pipelines.lake import CHUNKS, Lake, current_chunks, embeddings
from pipelines.lake_writer import LakeWriter
from pipelines.storage import ObjectStoreSettings
from tests.indexing.lakes import chunk_rows, synthetic_lake

NONE = ObjectStoreSettings()
OPTS = BuildOptions(nlist=24, iterations=8, shard_bytes=60_000, progress=False, reuse_centroids=True)
N = 3000


def position(n: int) -> str:
    return f"pg:{n:020d}"


def change(lake: Lake, x: np.ndarray, seed: int, updates: int = 20, deletes: int = 8, inserts: int = 12) -> None:
    """Update, delete and insert a few chunks (later positions win), one commit each."""
    rng = np.random.default_rng(seed)
    writer = LakeWriter(lake, CHUNKS, f"changes-{seed}", None)
    picked = rng.choice(N, updates + deletes, replace=False)
    moved = rng.standard_normal((updates, x.shape[1])).astype(np.float32)
    moved /= np.linalg.norm(moved, axis=1, keepdims=True)
    for i, row in enumerate(picked[:updates]):
        writer.write(chunk_rows(moved[i : i + 1], start=int(row), position=position(1000 + seed)))
    for row in picked[updates:]:
        writer.write(chunk_rows(x[row : row + 1], start=int(row), op="delete", position=position(1000 + seed)))
    new = rng.standard_normal((inserts, x.shape[1])).astype(np.float32)
    writer.write(chunk_rows(new / np.linalg.norm(new, axis=1, keepdims=True), start=100_000 + 100 * seed))


def answers(reader: IndexReader, queries: np.ndarray, k: int = 10) -> list[list[tuple[str, float]]]:
    """Each query's (chunk id, rounded distance) at nprobe = nlist, re-ranking every candidate."""
    hits = reader.search(queries, k, reader.manifest.nlist, rerank=reader.manifest.count)
    return [[(r["chunk_id"], round(1 - r["score"], 4)) for r in reader.rows(row)] for row in hits]


def oracle(lake: Lake, queries: np.ndarray, k: int = 10) -> list[list[str]]:
    live = current_chunks(lake, columns=["chunk_id", "embedding"])
    x = embeddings(live)
    ids = live.column("chunk_id").to_pylist()
    best = np.argsort(((queries[:, None, :] - x[None, :, :]) ** 2).sum(-1), axis=1, kind="stable")[:, :k]
    return [[ids[j] for j in row] for row in best]


@pytest.fixture(params=["flat", "sq8", "pq8"])
def codec(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_an_incremental_build_answers_exactly_like_a_full_build(tmp_path: Path, codec: str) -> None:
    lake, x = synthetic_lake(str(tmp_path / "lake"), n=N)
    store = LocalStore(str(tmp_path / "index"))
    opts = dataclasses.replace(OPTS, codec=codec)
    full = build_index(plan(lake), store.root, NONE, opts)
    assert not full.stats["incremental"] and full.stats["written_bytes"] > 0
    publish(store, full)
    change(lake, x, seed=1)

    inc = build_index(plan(lake), store.root, NONE, opts)
    stats = inc.stats
    assert stats["incremental"] and stats["base_version"] == 1
    assert stats["changed_chunks"] == 40 and stats["dead_rows"] == 28 and stats["delta_rows"] == 32
    assert stats["written_bytes"] < 0.1 * full.stats["written_bytes"]
    base_keys = {f.key for s in full.shards for f in s.files()}
    shared = [s for s in inc.shards if not s.delta]
    assert {f.key for s in shared for f in s.files() if f is not s.dead} == base_keys  # named, not copied
    assert inc.centroids == full.centroids and sum(s.live for s in inc.shards) == inc.count == N + 12 - 8
    publish(store, inc)

    again = LocalStore(str(tmp_path / "again"))  # a full build of the same lake version (its own centroids)
    publish(again, build_index(plan(lake), again.root, NONE, opts))
    assert not load_manifest(again).stats["incremental"]
    queries = np.concatenate([x[:20], x[-5:]])
    got = answers(IndexReader(store), queries)
    assert got == answers(IndexReader(again), queries)
    assert [[cid for cid, _ in row] for row in got] == oracle(lake, queries)


def test_incremental_versions_carry_every_change_since_the_base(tmp_path: Path) -> None:
    lake, x = synthetic_lake(str(tmp_path / "lake"), n=N)
    store = LocalStore(str(tmp_path / "index"))
    publish(store, build_index(plan(lake), store.root, NONE, OPTS))
    change(lake, x, seed=1)
    second = build_index(plan(lake), store.root, NONE, OPTS)
    publish(store, second)
    change(lake, x, seed=2)
    third = build_index(plan(lake), store.root, NONE, OPTS)
    publish(store, third)
    assert third.stats["incremental"] and third.stats["base_version"] == 1 and third.base_version == 1
    assert third.stats["changed_chunks"] >= 70  # both rounds of changes (two picks may coincide)
    assert sum(s.delta for s in third.shards) >= 1 and not any(s.delta and s in second.shards for s in third.shards)
    queries = np.concatenate([x[:20], x[-5:]])
    assert [[c for c, _ in row] for row in answers(IndexReader(store), queries)] == oracle(lake, queries)
    # An unchanged lake: the same dead rows, no new delta rows; nothing but dead-row files is new.
    fourth = build_index(plan(lake), store.root, NONE, OPTS)
    assert fourth.stats["delta_rows"] == third.stats["delta_rows"]
    assert {s.dead for s in fourth.shards} == {s.dead for s in third.shards}


def test_too_many_changes_drift_or_removed_rows_make_a_full_build(tmp_path: Path) -> None:
    lake, x = synthetic_lake(str(tmp_path / "lake"), n=N)
    store = LocalStore(str(tmp_path / "index"))
    publish(store, build_index(plan(lake), store.root, NONE, OPTS))
    change(lake, x, seed=1)
    few = build_index(plan(lake), store.root, NONE, dataclasses.replace(OPTS, max_delta=0.01))
    assert not few.stats["incremental"] and "> --max-delta 1%" in few.stats["full_reason"]
    assert few.stats["reused_from_version"] == 1  # centroids still reused: only the shards are all rewritten
    forced = build_index(plan(lake), store.root, NONE, dataclasses.replace(OPTS, incremental=False))
    assert not forced.stats["incremental"] and "full_reason" not in forced.stats
    # Rows deleted from the lake itself (not superseded) are caught by the count check, not guessed at.
    touched = set(plan(lake).changes_since(load_manifest(store).writer_seqs).touched.to_pylist())
    victim = next(f"c{i:07d}" for i in range(N) if f"c{i:07d}" not in touched)
    DeltaTable(lake.table_uri(CHUNKS)).delete(f"chunk_id = '{victim}'")
    removed = build_index(plan(lake), store.root, NONE, OPTS)
    assert not removed.stats["incremental"] and "live chunks" in removed.stats["full_reason"]
    # A codec change cannot share shards.
    other = build_index(plan(lake), store.root, NONE, dataclasses.replace(OPTS, codec="sq8"))
    assert "codec changed" in other.stats["full_reason"]


def test_gc_keeps_every_file_a_kept_version_names(tmp_path: Path) -> None:
    lake, x = synthetic_lake(str(tmp_path / "lake"), n=N)
    store = LocalStore(str(tmp_path / "index"))
    builds = [build_index(plan(lake), store.root, NONE, OPTS)]
    publish(store, builds[0])
    for seed in (1, 2):
        change(lake, x, seed=seed)
        builds.append(build_index(plan(lake), store.root, NONE, OPTS))
        publish(store, builds[-1])
    later = datetime.now(UTC) + timedelta(days=1)  # past every grace period
    assert collect_garbage(store, keep=1, grace_s=0, now=later) == [1, 2]
    left = set(store.list("builds/"))
    assert {f.key for f in builds[2].files()} <= left, "the base build's shared files are kept"
    assert not {f.key for s in builds[1].shards if s.delta for f in s.files()} & left, "version 2's delta went"
    reader = IndexReader(store)  # the kept version still reads every file it names
    assert len(reader.search(x[:3], 5, reader.manifest.nlist)[0]) == 5
    for i in range(len(reader.manifest.shards)):
        reader.shard(i)
        reader.alive(i)
    # A full build becomes the new base; once the incremental version goes, so do the old base's files.
    full = build_index(plan(lake), store.root, NONE, dataclasses.replace(OPTS, incremental=False))
    publish(store, full)
    assert collect_garbage(store, keep=1, grace_s=0, now=later) == [3]
    assert set(store.list("builds/")) == {f.key for f in full.files()}


def test_a_version_whose_shared_files_went_is_not_published(tmp_path: Path) -> None:
    lake, x = synthetic_lake(str(tmp_path / "lake"), n=N)
    store = LocalStore(str(tmp_path / "index"))
    base = build_index(plan(lake), store.root, NONE, OPTS)
    publish(store, base)
    change(lake, x, seed=1)
    inc = build_index(plan(lake), store.root, NONE, OPTS)
    store.delete(base.shards[0].index.key)  # e.g. collected while this build ran
    with pytest.raises(ManifestError, match=r"files of build .* are gone"):
        publish(store, inc)
    assert load_manifest(store).version == 1


def test_incremental_manifests_declare_their_format_and_round_trip(tmp_path: Path) -> None:
    lake, x = synthetic_lake(str(tmp_path / "lake"), n=N)
    store = LocalStore(str(tmp_path / "index"))
    publish(store, build_index(plan(lake), store.root, NONE, OPTS))
    change(lake, x, seed=1)
    inc = build_index(plan(lake), store.root, NONE, OPTS)
    assert inc.format_version == 3  # readers of formats 1 and 2 refuse it rather than serve its dead rows
    raw = Manifest.from_json(inc.to_json())
    assert raw.shards == inc.shards and raw.base_writer_seqs == inc.base_writer_seqs


def test_changes_since_reads_writer_commit_numbers(tmp_path: Path) -> None:
    lake, x = synthetic_lake(str(tmp_path / "lake"), n=400, files=2)
    before = plan(lake)
    LakeWriter(lake, CHUNKS, "other", None).write(chunk_rows(x[:3], start=0, position=position(5000)))
    LakeWriter(lake, CHUNKS, "synthetic", None).write(chunk_rows(x[:1], start=900))
    after = plan(lake)
    changes = after.changes_since(before.writer_seqs)
    assert sorted(changes.touched.to_pylist()) == ["c0000000", "c0000001", "c0000002", "c0000900"]
    assert changes.count == 4 and after.untagged_rows == 0
    assert after.changes_since(after.writer_seqs).count == 0
    assert pa.chunked_array([changes.touched]).length() == 4
