"""The search engine on a lake written by the real lake writer and an index from the real builder.

Dense mode throughout: keyword and hybrid search are tests/retrieval/test_hybrid.py.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from indexing.ivf import BuildOptions, build_index
from indexing.manifest import publish
from indexing.snapshot import plan
from indexing.store import LocalStore
from pipelines.storage import ObjectStoreSettings
from retrieval.acl import Principal
from retrieval.cache import ShardCache
from retrieval.engine import SearchEngine
from retrieval.errors import SearchError
from retrieval.views import EngineOptions
from serving.fake_embedder import FakeEmbedder
from tests.retrieval.lakes import Doc, DocLake

OPTS = BuildOptions(nlist=16, iterations=5, shard_bytes=8_000, progress=False)
HR = Principal("hana", frozenset({"hr"}))


def words(rng: random.Random, n: int = 8) -> str:
    return " ".join(f"w{rng.randrange(400)}" for _ in range(n))


def corpus(n: int = 300, seed: int = 0) -> list[Doc]:
    rng = random.Random(seed)
    return [Doc(pk, f"doc {pk} {words(rng)}", ("hr",) if pk % 10 == 0 else ()) for pk in range(n)]


def build(lake: DocLake, index: Path, codec: str = "flat") -> int:
    store = LocalStore(str(index))
    opts = dataclasses.replace(OPTS, codec=codec)
    return publish(store, build_index(plan(lake.lake), store.root, ObjectStoreSettings(), opts))


@pytest.fixture(params=["flat", "sq8"])
def setup(request: pytest.FixtureRequest, tmp_path: Path, ray_local: None):  # type: ignore[no-untyped-def]
    """An engine over a float index, and over range-read lists (later builds in a test are float:
    a swap between the two layouts is covered too)."""
    embedder = FakeEmbedder(dim=32)
    lake = DocLake(str(tmp_path / "lake"), embedder)
    docs = corpus()
    lake.write(docs[:150])
    lake.write(docs[150:])
    build(lake, tmp_path / "index", request.param)
    engine = SearchEngine(
        lake.lake, LocalStore(str(tmp_path / "index")), embedder, ShardCache(tmp_path / "cache", memory_bytes=20_000),
        EngineOptions(nprobe=4, mode="dense"),
    )  # fmt: skip
    engine.start(background=False)
    return engine, lake, docs


def ids(result) -> list[str]:  # type: ignore[no-untyped-def]
    return [r["chunk_id"] for r in result.results]


def test_a_document_finds_itself_with_lineage(setup) -> None:
    engine, _, docs = setup
    result = engine.search(docs[7].text, k=3)
    top = result.results[0]
    assert top["chunk_id"] == docs[7].chunk_id and top["score"] == pytest.approx(1.0, abs=1e-5)
    assert top["source"]["pk"] == "7" and top["source"]["table"] == "public.docs"
    assert top["source"]["kafka"]["topic"] == "t" and top["origin"] == "index"
    assert top["index_version"] == result.index_version == 1 and top["lake_version"] == 2


def test_acl_fail_closed_and_no_recall_lost_to_filtering(setup) -> None:
    engine, _, docs = setup
    secret = docs[20]
    assert secret.chunk_id not in ids(engine.search(secret.text, k=10))
    assert ids(engine.search(secret.text, k=1, principal=HR)) == [secret.chunk_id]
    # 30 of 300 documents are HR's; a caller who can see them all but the public ones gets
    # every HR document it asks for, though they are a tenth of each list.
    only_hr = {d.chunk_id for d in docs if d.acl}
    engine_hr = engine.search("doc", k=30, principal=HR)
    visible = {d.chunk_id for d in docs if not d.acl or "hr" in d.acl}
    assert len(engine_hr.results) == 30 and set(ids(engine_hr)) <= visible
    public = engine.search(docs[5].text, k=100)
    assert len(public.results) == 100 and not set(ids(public)) & only_hr


def test_selective_filter_widens_the_probe_until_k_are_found(tmp_path: Path, ray_local: None) -> None:
    """All but 3 of 300 documents are restricted: an outsider asking for 3 gets exactly those 3."""
    embedder = FakeEmbedder(dim=32)
    lake = DocLake(str(tmp_path / "lake"), embedder)
    docs = [Doc(d.pk, d.text, () if d.pk in (17, 140, 288) else ("staff",)) for d in corpus()]
    lake.write(docs)
    build(lake, tmp_path / "index")
    engine = SearchEngine(
        lake.lake, LocalStore(str(tmp_path / "index")), embedder, None, EngineOptions(nprobe=2, mode="dense")
    )
    engine.start(background=False)
    for query in (docs[3].text, docs[200].text, "w1 w2 w3"):
        result = engine.search(query, k=3)
        assert set(ids(result)) == {docs[i].chunk_id for i in (17, 140, 288)}
    assert result.nprobe > 2
    staff = engine.search(docs[3].text, k=3, principal=Principal("sam", frozenset({"staff"})))
    assert ids(staff)[0] == docs[3].chunk_id and staff.nprobe == 2


def test_serving_below_the_nprobe_an_index_was_assigned_for_is_logged(
    tmp_path: Path, ray_local: None, caplog: pytest.LogCaptureFixture
) -> None:
    """A build that assigned through a coarse level bounds the recall it cost at one nprobe
    (``stats.assign_nprobe``); a replica told to probe fewer lists says so."""
    embedder = FakeEmbedder(dim=32)
    lake = DocLake(str(tmp_path / "lake"), embedder)
    lake.write(corpus(100))
    store = LocalStore(str(tmp_path / "index"))
    manifest = build_index(plan(lake.lake), store.root, ObjectStoreSettings(), OPTS)
    manifest.stats.update(assign="coarse-level", assign_nprobe=8, assign_recall_loss={"8": 0.003})
    publish(store, manifest)
    for nprobe, warned in ((None, False), (8, False), (4, True)):
        caplog.clear()
        engine = SearchEngine(lake.lake, store, embedder, None, EngineOptions(nprobe=nprobe, mode="dense"))
        with caplog.at_level("WARNING", logger="retrieval.views"):
            engine.start(background=False)
        assert ("for searches at nprobe >= 8; at --nprobe 4" in caplog.text) is warned, nprobe
        engine.stop()


def test_updates_and_deletes_after_the_index_are_reflected(setup) -> None:
    engine, lake, docs = setup
    old, gone = docs[3], docs[4]
    new = Doc(3, "doc 3 completely rewritten with fresh words")
    lake.write([old], op="delete")
    lake.write([new])
    lake.write([gone], op="delete")
    assert engine._tail is not None and engine._tail.poll()
    assert old.chunk_id not in ids(engine.search(old.text, k=20))
    assert gone.chunk_id not in ids(engine.search(gone.text, k=20))
    top = engine.search(new.text, k=1).results[0]
    assert top["chunk_id"] == new.chunk_id and top["origin"] == "tail" and top["lake_version"] == 4
    # Results carry their stored vectors, from the tail and from the index alike.
    assert engine.search(new.text, k=5).vectors is None  # plain searches skip the lookup
    result = engine.search(new.text, k=5, with_vectors=True)
    assert {r["origin"] for r in result.results} == {"index", "tail"} and result.vectors is not None
    texts = [r["text"] for r in result.results]
    np.testing.assert_allclose(result.vectors, engine.embedder.embed(texts), atol=1e-6)


def test_acl_change_in_the_tail_hides_the_index_copy(setup) -> None:
    engine, lake, docs = setup
    doc = docs[11]
    assert doc.chunk_id in ids(engine.search(doc.text, k=1))
    lake.write([Doc(doc.pk, doc.text, ("legal",))])  # same content, now restricted
    engine._tail.poll()
    outsider = engine.search(doc.text, k=50)
    assert doc.chunk_id not in ids(outsider)
    assert outsider.tail_rows == 0, "the count of changed chunks must not reveal hidden ones"
    legal = engine.search(doc.text, k=1, principal=Principal("lee", frozenset({"legal"})))
    assert ids(legal) == [doc.chunk_id] and legal.tail_rows == 1


def test_new_index_version_takes_over_the_tail(setup) -> None:
    engine, lake, _ = setup
    fresh = Doc(5000, "brand new document about zebras")
    lake.write([fresh])
    engine._tail.poll()
    assert engine.search(fresh.text, k=1).results[0]["origin"] == "tail"
    build(lake, Path(engine.store.root))
    assert engine.check_for_new_index()
    after = engine.search(fresh.text, k=1)
    assert after.index_version == 2 and after.tail_rows == 0
    assert after.results[0]["chunk_id"] == fresh.chunk_id and after.results[0]["origin"] == "index"


def test_as_of_answers_as_the_system_would_have(setup) -> None:
    engine, lake, docs = setup
    doc = docs[9]
    deleted_at = lake.write([doc], op="delete")
    engine._tail.poll()
    assert doc.chunk_id not in ids(engine.search(doc.text, k=5))
    assert ids(engine.search(doc.text, k=1, as_of=deleted_at - 1)) == [doc.chunk_id]
    build(lake, Path(engine.store.root))
    engine.check_for_new_index()
    assert ids(engine.search(doc.text, k=1, as_of=2)) == [doc.chunk_id]  # index 1 + empty tail
    with pytest.raises(SearchError, match="no index version was built at or before"):
        engine.search(doc.text, as_of=1)
    with pytest.raises(SearchError, match="newer than the newest"):
        engine.search(doc.text, as_of=99)


def test_bad_requests_and_a_different_model_are_refused(setup, tmp_path: Path) -> None:
    engine, lake, _ = setup
    for query, k in (("", 10), ("   ", 10), ("x" * 5000, 10), ("ok", 0), ("ok", 101)):
        with pytest.raises(SearchError) as info:
            engine.search(query, k=k)
        assert info.value.status == 422
    other = SearchEngine(lake.lake, engine.store, FakeEmbedder(dim=16))
    with pytest.raises(SearchError, match="built from vectors of fake-hashing"):
        other.start(background=False)


def test_compaction_commits_do_not_flood_the_tail(setup) -> None:
    engine, lake, docs = setup
    lake.write([Doc(7000, "one new document after the index")])
    table = lake.lake.table("chunks")
    table.optimize.compact()
    assert engine._tail.poll()
    state = engine._tail.state
    assert state.version == table.version() and state.live_rows == 1
    assert docs[1].chunk_id in ids(engine.search(docs[1].text, k=1))


def test_as_of_sees_the_version_current_then_not_the_newest(setup) -> None:
    engine, lake, docs = setup
    doc = docs[13]
    restricted_at = lake.write([Doc(doc.pk, doc.text, ("legal",))])
    lake.write([Doc(doc.pk, doc.text, ())])  # public again
    engine._tail.poll()
    assert ids(engine.search(doc.text, k=1)) == [doc.chunk_id]
    assert doc.chunk_id not in ids(engine.search(doc.text, k=20, as_of=restricted_at))
    legal = Principal("lee", frozenset({"legal"}))
    assert ids(engine.search(doc.text, k=1, principal=legal, as_of=restricted_at)) == [doc.chunk_id]


def test_an_index_of_an_older_snapshot_is_not_switched_to(setup) -> None:
    engine, lake, docs = setup
    store = LocalStore(str(engine.store.root))
    publish(store, build_index(plan(lake.lake, version=1), store.root, ObjectStoreSettings(), OPTS))
    assert not engine.check_for_new_index()
    result = engine.search(docs[201].text, k=1)  # written at lake version 2: still found
    assert result.index_version == 1 and ids(result) == [docs[201].chunk_id]


def test_an_as_of_query_never_lends_its_filter_to_live_queries(setup, tmp_path: Path) -> None:
    """A replica restarted after two commits past the index reads both in one poll; an
    ``as_of`` tail for the commit between them is as "young" as the live one. The index copy
    of a document restricted by the second commit must stay hidden from live queries even
    when the ``as_of`` query computed its filter first."""
    engine, lake, docs = setup
    other, doc = docs[21], docs[22]
    between = lake.write([Doc(other.pk, other.text, ("legal",))])
    lake.write([Doc(doc.pk, doc.text, ("legal",))])  # restricted after `between`
    restarted = SearchEngine(lake.lake, engine.store, engine.embedder, ShardCache(tmp_path / "cache2"),
                             EngineOptions(nprobe=16, mode="dense"))  # fmt: skip
    restarted.start(background=False)
    outsider = Principal("otto", frozenset({"sales"}))
    assert ids(restarted.search(doc.text, k=1, principal=outsider, as_of=between)) == [doc.chunk_id]
    assert doc.chunk_id not in ids(restarted.search(doc.text, k=20, principal=outsider))
    assert doc.chunk_id in ids(restarted.search(doc.text, k=20, principal=outsider, as_of=between))
    assert doc.chunk_id not in ids(restarted.search(doc.text, k=20, principal=outsider))


def test_as_of_after_garbage_collection_is_a_404_naming_the_kept_versions(setup, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import retrieval.views
    from indexing.manifest import collect_garbage, versions

    engine, lake, docs = setup
    doc = docs[31]
    for i in range(2):  # versions 2 and 3, each over a newer lake version
        lake.write([Doc(9000 + i, f"filler {i}")])
        build(lake, Path(engine.store.root))
    assert engine.check_for_new_index()
    assert ids(engine.search(doc.text, k=1, as_of=2)) == [doc.chunk_id]  # version 1 (lake version 2)
    listed_before = versions(engine.store)
    assert collect_garbage(engine.store, keep=1, grace_s=0) == [1, 2]
    # A request that listed the versions just before the collection, then finds the version
    # it chose gone: a 404 that says what happened and which versions are kept, not a 500.
    with monkeypatch.context() as m:
        listings = [listed_before]  # the first listing is from before the collection
        m.setattr(retrieval.views, "versions", lambda store: listings.pop() if listings else versions(store))
        engine._readers = type(engine._readers)(4)  # not opened yet by this replica
        with pytest.raises(SearchError, match=r"index version 1, which as_of=2 needs, has been deleted") as info:
            engine.search(doc.text, k=1, as_of=2)
    assert info.value.status == 404 and "kept versions: 3 (lake version 4)" in str(info.value)
    with pytest.raises(SearchError, match=r"no index version was built at or before lake version 2") as info:
        engine.search(doc.text, k=1, as_of=2)
    assert info.value.status == 404 and "the oldest kept covers lake version 4" in str(info.value)
    assert ids(engine.search(doc.text, k=1, as_of=4)) == [doc.chunk_id]
    assert ids(engine.search(doc.text, k=1)) == [doc.chunk_id]  # the live view is untouched


def test_a_cleaned_up_log_rebuilds_the_live_tail_and_refuses_as_of_into_the_gap(setup) -> None:  # type: ignore[no-untyped-def]
    """The index's manifest records its writers' commit numbers; with them the live tail is
    rebuilt from the snapshot (the update and the delete both hold), and an as_of into the
    versions whose log is gone is a 404 that says so."""
    from pipelines.lake import CHUNKS

    engine, lake, docs = setup
    assert engine._require_reader().manifest.writer_seqs  # recorded by the build
    updated, deleted = docs[3], docs[4]
    middle = lake.write([Doc(updated.pk, "a rewritten note about lighthouses")])
    lake.write([updated, deleted], op="delete")
    table = lake.lake.table(CHUNKS)
    table.alter.set_table_properties({"delta.logRetentionDuration": "interval 0 seconds"})
    table.create_checkpoint()
    table.cleanup_metadata()
    assert engine._tail is not None
    engine._tail.CLEANUP_CHECK_S = 0.0
    assert engine._tail.poll()
    assert ids(engine.search("a rewritten note about lighthouses", k=1)) == [
        Doc(updated.pk, "a rewritten note about lighthouses").chunk_id
    ]
    for gone in (updated, deleted):
        assert gone.chunk_id not in ids(engine.search(gone.text, k=10))
    with pytest.raises(SearchError, match="no longer there") as info:
        engine.search(updated.text, k=1, as_of=middle)
    assert info.value.status == 404


@pytest.mark.parametrize("codec", ["flat", "sq8"])
def test_metadata_filters_apply_inside_the_scan_in_the_index_and_the_tail(
    tmp_path: Path, ray_local: None, codec: str
) -> None:
    """A filter that a tenth of the documents match still gets k of them (the probe widens),
    from the index and the tail alike, and results carry their metadata. A compressed index
    decides it from the probed lists' row blocks: no whole id map is read."""
    import json

    from retrieval.filters import MetadataFilter

    embedder = FakeEmbedder(dim=32)
    lake = DocLake(str(tmp_path / "lake"), embedder)
    rng = random.Random(3)
    docs = [Doc(pk, f"doc {pk} {words(rng)}", (), json.dumps({"team": ["eng", "ops"][pk % 10 == 0], "year": 2026}))
            for pk in range(300)]  # fmt: skip
    lake.write(docs)
    build(lake, tmp_path / "index", codec)
    fresh = Doc(900, "doc 900 freshly written after the index", (), json.dumps({"team": "ops", "year": 2026.0}))
    moved = Doc(10, docs[10].text, (), json.dumps({"team": "eng", "year": 2026}))  # ops → eng after the index
    lake.write([fresh, moved])
    engine = SearchEngine(
        lake.lake, LocalStore(str(tmp_path / "index")), embedder, None, EngineOptions(nprobe=2, mode="dense")
    )
    engine.start(background=False)
    ops = MetadataFilter.parse({"team": "ops", "year": [2026, 2027]})
    result = engine.search("doc", k=30, where=ops)
    expected = {d.chunk_id for d in docs if d.pk % 10 == 0 and d.pk != 10} | {fresh.chunk_id}
    assert set(ids(result)) == expected and len(expected) == 30
    assert {r["origin"] for r in result.results} == {"index", "tail"}
    assert all(r["metadata"]["team"] == "ops" for r in result.results)
    assert ids(engine.search(docs[10].text, k=1, where=MetadataFilter.parse({"team": "eng"}))) == [moved.chunk_id]
    assert engine.search("doc", k=5, where=MetadataFilter.parse({"team": "nobody"})).results == []
    assert engine.search("doc", k=5, where=MetadataFilter.parse({"year": "2026"})).results == []  # a string is not 2026
    assert set(ids(engine.search("doc", k=30, where=ops, mode="keyword"))) == expected
    assert set(ids(engine.search("doc", k=30, where=ops, mode="hybrid"))) == expected
    reader = engine.current_view().reader
    shards = [reader.shard(s) for s in range(len(reader.manifest.shards))]
    assert all(shard.id_map is None for shard in shards) == (codec == "sq8")


class SwitchedStore(LocalStore):
    """A local store that can be taken down: every read then fails as an unreachable S3 would."""

    down = False

    def _check(self, key: str) -> None:
        if self.down:
            from indexing.store import StoreUnavailable

            raise StoreUnavailable(f"cannot reach S3 for {self.uri(key)}: connection refused")

    def get(self, key: str) -> bytes:
        self._check(key)
        return super().get(key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        self._check(key)
        return super().get_range(key, start, length)

    def list(self, prefix: str = "") -> Iterator[str]:
        self._check(prefix)
        return super().list(prefix)


def test_a_compressed_index_serves_what_it_holds_while_the_store_is_down(tmp_path: Path, ray_local: None) -> None:
    """The S3-outage guarantees with the list layout: the lists, vectors and row blocks a
    replica holds keep answering exactly; a query that needs a list it lacks fails as the
    store did (a 503 asking to retry, at the API); health says degraded; all recovers."""
    import time

    from indexing.store import StoreUnavailable
    from retrieval.acl import ANONYMOUS

    embedder = FakeEmbedder(dim=32)
    lake = DocLake(str(tmp_path / "lake"), embedder)
    docs = corpus()
    lake.write(docs)
    build(lake, tmp_path / "index", "sq8")
    store = SwitchedStore(str(tmp_path / "index"))
    cache = ShardCache(tmp_path / "cache", memory_bytes=1 << 30)
    options = EngineOptions(nprobe=2, mode="dense", prefetch=False, index_poll_s=0.05)
    engine = SearchEngine(lake.lake, store, embedder, cache, options)
    engine.start()
    try:
        asked = [docs[i].text for i in range(0, 300, 37)]
        before = {q: ids(engine.search(q, k=5)) for q in asked}
        view = engine.current_view()
        reader = view.reader
        lacking = [
            n
            for s in range(len(reader.manifest.shards))
            for n in range(reader.manifest.shards[s].list_start, reader.manifest.shards[s].list_end)
            if reader.shard(s).lists.table.counts[n - reader.manifest.shards[s].list_start] > 0  # type: ignore[union-attr]
            and not reader.shard(s).lists.resident(n)  # type: ignore[union-attr]
        ]
        assert lacking, "the queries left some lists unfetched"
        store.down = True
        assert {q: ids(engine.search(q, k=5)) for q in asked} == before
        with pytest.raises(StoreUnavailable):
            engine.search_vector(view, reader.centroids[lacking[0]], 5, ANONYMOUS)
        deadline = time.monotonic() + 10
        while engine.health()["status"] != "degraded":
            assert time.monotonic() < deadline, engine.health()
            time.sleep(0.05)
        assert {q: ids(engine.search(q, k=5)) for q in asked} == before
        store.down = False
        while engine.health()["status"] != "ok":
            assert time.monotonic() < deadline + 10, engine.health()
            time.sleep(0.05)
        assert engine.search_vector(view, reader.centroids[lacking[0]], 5, ANONYMOUS).results
    finally:
        engine.stop()
