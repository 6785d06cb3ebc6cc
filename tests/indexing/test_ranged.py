"""Compressed, list-granular shards: fetched by range, checked, re-ranked, budgeted."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import faiss
import numpy as np
import pytest

from indexing.ivf import BuildOptions, build_index
from indexing.lists import ROW_BLOCK, ByteBudget, Fetched, ListIntegrityError
from indexing.manifest import ManifestError, ShardRef, load_manifest, publish
from indexing.reader import IndexReader, LoadedShard, load_shard, take_rows
from indexing.snapshot import plan
from indexing.store import LocalStore, ObjectStore
from pipelines.lake import Lake
from pipelines.storage import ObjectStoreSettings
from tests.indexing.lakes import synthetic_lake

OPTS = BuildOptions(nlist=64, iterations=15, shard_bytes=200_000, progress=False)


class CountingStore(LocalStore):
    """Counts whole-file and ranged reads of each kind of file."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.whole: list[str] = []
        self.ranged: list[tuple[str, int, int]] = []
        self.lock = threading.Lock()

    def get(self, key: str) -> bytes:
        with self.lock:
            self.whole.append(key)
        return super().get(key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        with self.lock:
            self.ranged.append((key, start, length))
        return super().get_range(key, start, length)


@pytest.fixture(scope="module")
def indexes(tmp_path_factory: pytest.TempPathFactory, ray_local: None) -> tuple[Path, Path, np.ndarray]:
    tmp = tmp_path_factory.mktemp("ranged")
    lake, x = synthetic_lake(str(tmp / "lake"), n=6000, dim=32)
    for name, codec in (("flat", "flat"), ("sq8", "sq8")):
        store = LocalStore(str(tmp / name))
        publish(
            store, build_index(plan(lake), store.root, ObjectStoreSettings(), dataclasses.replace(OPTS, codec=codec))
        )
    return tmp / "flat", tmp / "sq8", x


def truth(x: np.ndarray, queries: np.ndarray, k: int = 10) -> np.ndarray:
    exact = faiss.IndexFlatL2(x.shape[1])
    exact.add(x)
    return exact.search(queries, k)[1]


def found_ids(reader: IndexReader, hits) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [[int(r["chunk_id"][1:]) for r in reader.rows(row)] for row in hits]


def test_manifest_records_the_codec_and_old_readers_refuse_it_cleanly(indexes) -> None:  # type: ignore[no-untyped-def]
    flat, sq8, _ = indexes
    m = load_manifest(LocalStore(str(sq8)))
    assert m.codec == "sq8" and m.format_version == 5
    assert all(s.ranged and s.table and s.vectors and s.codec and s.id_blocks for s in m.shards)
    assert all(s.ids.key.endswith(".rows") for s in m.shards)
    assert load_manifest(LocalStore(str(flat))).format_version == 1  # float indexes stay readable by older readers
    raw = (sq8 / "versions" / "00000001.json").read_bytes().replace(b'"format_version": 5', b'"format_version": 9')
    with pytest.raises(ManifestError, match="upgrade streamrag"):
        type(m).from_json(raw)


def test_recall_with_exact_rerank_matches_the_float_index(indexes) -> None:  # type: ignore[no-untyped-def]
    flat, sq8, x = indexes
    rng = np.random.default_rng(3)
    queries = (x[rng.choice(len(x), 100, replace=False)] + rng.normal(0, 0.05, (100, x.shape[1]))).astype(np.float32)
    want = truth(x, queries)
    recall = {}
    for name, path in (("flat", flat), ("sq8", sq8)):
        reader = IndexReader(LocalStore(str(path)))
        got = found_ids(reader, reader.search(queries, 10, nprobe=8))
        recall[name] = np.mean([len(set(g) & set(w.tolist())) / 10 for g, w in zip(got, want, strict=True)])
    assert recall["sq8"] >= recall["flat"] - 0.01, recall
    reader = IndexReader(LocalStore(str(sq8)))
    hits = reader.search(queries[:5], 10, nprobe=8)
    exact_d = [h.distance for h in hits[0]]
    assert exact_d == sorted(exact_d)  # re-ranked distances are exact float distances, in order
    v = reader.vectors(hits[0][:3])
    assert np.allclose(np.square(v - queries[0]).sum(axis=1), exact_d[:3], atol=1e-4)
    # the re-ranking's own vectors come back with the hits, and nothing is read twice for them
    counted = CountingStore(str(sq8))
    found, vectors = IndexReader(counted).search_arrays(queries[:5], 10, nprobe=8, with_vectors=True)
    assert vectors is not None
    again = [one.hits() for one in found]
    alone = CountingStore(str(sq8))
    assert IndexReader(alone).search(queries[:5], 10, nprobe=8) == again == hits
    assert sorted(counted.ranged) == sorted(alone.ranged) and sorted(counted.whole) == sorted(alone.whole)
    for q, (found, stored) in enumerate(zip(again, vectors, strict=True)):
        assert np.allclose(np.square(stored - queries[q]).sum(axis=1), [h.distance for h in found], atol=1e-4)


def test_product_quantized_lists_hold_m_bytes_a_vector_and_rerank_to_the_float_recall(  # type: ignore[no-untyped-def]
    indexes, tmp_path: Path
) -> None:
    """``pq8`` on 32 dimensions: 8 bytes of codes per vector (16× smaller than float32), the
    sub-quantizers trained on a sample, and after the exact re-rank the float index's recall."""
    flat, _, x = indexes
    lake = synthetic_lake(str(tmp_path / "lake"), n=6000, dim=32)[0]
    store = LocalStore(str(tmp_path / "pq"))
    manifest = build_index(plan(lake), store.root, ObjectStoreSettings(), dataclasses.replace(OPTS, codec="pq8"))
    publish(store, manifest)
    assert manifest.codec == "pq8" and manifest.format_version == 5
    rng = np.random.default_rng(3)
    queries = (x[rng.choice(len(x), 100, replace=False)] + rng.normal(0, 0.05, (100, x.shape[1]))).astype(np.float32)
    want = truth(x, queries)
    recall = {}
    for name, path in (("flat", flat), ("pq8", tmp_path / "pq")):
        reader = IndexReader(LocalStore(str(path)))
        got = found_ids(reader, reader.search(queries, 10, nprobe=8))
        recall[name] = np.mean([len(set(g) & set(w.tolist())) / 10 for g, w in zip(got, want, strict=True)])
    assert recall["pq8"] >= recall["flat"] - 0.02, recall
    reader = IndexReader(LocalStore(str(tmp_path / "pq")))
    shard = reader.shard(0)
    assert shard.lists is not None and shard.lists.table.code_size == 8
    reader.search(queries, 10, nprobe=64)  # every list resident
    rows = sum(s.count for s in manifest.shards)
    held = sum(reader.shard(i).lists.resident_bytes for i in range(len(manifest.shards)))  # type: ignore[union-attr]
    # codes, the digest that checks each re-ranked vector, and the filter columns (ACL number, chunk-id hash)
    assert held == rows * (8 + 8 + 4 + 8)
    hits = reader.search(queries[:1], 10, nprobe=8)[0]
    assert np.allclose(np.square(reader.vectors(hits) - queries[0]).sum(axis=1), [h.distance for h in hits], atol=1e-4)


def faiss_over_the_same_codes(reader: IndexReader) -> faiss.IndexIVF:
    """faiss's own IVF (the index's centroids and codec) holding every shard's codes, each
    row's id ``shard << 32 | row``: what a scan of the probed lists must answer."""
    m = reader.manifest
    first = reader.shard(0).lists
    assert first is not None
    if first.codec.startswith("pq"):
        index = faiss.IndexIVFPQ(reader.quantizer, m.dim, m.nlist, int(first.codec[2:]), 8)
        faiss.copy_array_to_vector(np.ascontiguousarray(first.trained, np.float32), index.pq.centroids)
    else:
        index = faiss.IndexIVFScalarQuantizer(reader.quantizer, m.dim, m.nlist, faiss.ScalarQuantizer.QT_8bit)
        faiss.copy_array_to_vector(np.ascontiguousarray(first.trained, np.float32), index.sq.trained)
    index.by_residual = False
    index.is_trained = True
    for s in range(len(m.shards)):
        lists = reader.shard(s).lists
        assert lists is not None
        table = lists.table
        for list_no, data in lists.lists(list(range(table.list_start, table.list_start + len(table.counts)))).items():
            first = int(table.firsts[list_no - table.list_start])
            ids = (np.arange(len(data.codes), dtype=np.int64) + first) | (s << 32)
            codes = np.ascontiguousarray(data.codes)
            index.invlists.add_entries(list_no, len(ids), faiss.swig_ptr(ids), faiss.swig_ptr(codes))
    index.ntotal = m.count
    return index


@pytest.mark.parametrize("codec", ["sq8", "pq8"])
def test_a_query_scans_every_probed_shard_in_one_pass_and_answers_as_faiss_over_the_same_codes(  # type: ignore[no-untyped-def]
    indexes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, codec: str
) -> None:
    """One scan per query over every probed shard's lists, read in place (a scan per shard
    cost ~0.2 ms each; copying the lists into a throwaway faiss IVF cost ~6 µs a list): the
    rows and distances faiss's own IVF gives for the same codes, in the same order; with a
    filter, those it gives with the same rows selected (the allowed rows' codes taken out)."""
    import indexing.lists as lists_mod
    import indexing.reader as reader_mod

    _, sq8, x = indexes
    path = sq8
    if codec != "sq8":
        lake = synthetic_lake(str(tmp_path / "lake"), n=6000, dim=32)[0]
        store = LocalStore(str(tmp_path / codec))
        publish(
            store, build_index(plan(lake), store.root, ObjectStoreSettings(), dataclasses.replace(OPTS, codec=codec))
        )
        path = tmp_path / codec
    calls: list[int] = []
    real = lists_mod.scan_runs

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(len(args[3]))
        return real(*args, **kwargs)

    monkeypatch.setattr(reader_mod, "scan_runs", counting)
    queries = x[:20] + 0.01
    reader = IndexReader(LocalStore(str(path)))
    theirs = faiss_over_the_same_codes(reader)
    assert len(reader.manifest.shards) > 1
    rng = np.random.default_rng(0)
    allowed = {s: rng.random(ref.count) < 0.3 for s, ref in enumerate(reader.manifest.shards)}
    selected = np.concatenate([np.flatnonzero(a).astype(np.int64) | (s << 32) for s, a in allowed.items()])
    for allow, params in (
        (None, faiss.SearchParametersIVF(nprobe=32)),
        (lambda s, _: allowed[s], faiss.SearchParametersIVF(nprobe=32, sel=faiss.IDSelectorBatch(selected))),
    ):
        calls.clear()
        hits = reader.search(queries, 10, nprobe=32, allow=allow, rerank=1)
        assert len(calls) == len(queries)  # one scan per query, whatever the shards
        dist, labels = theirs.search(queries, 10, params=params)
        assert [[(h.shard << 32) | h.faiss_id for h in row] for row in hits] == labels.tolist()
        assert np.allclose([[h.distance for h in row] for row in hits], dist, rtol=1e-5)
        assert len({h.shard for row in hits for h in row}) > 1
        if allow is not None:
            assert all(allowed[h.shard][h.faiss_id] for row in hits for h in row)


def test_a_pq_size_that_does_not_divide_the_dimension_is_refused_before_any_work(tmp_path: Path) -> None:
    lake = synthetic_lake(str(tmp_path / "lake"), n=600, dim=32)[0]
    with pytest.raises(ValueError, match=r"'pq5': 5 does not divide the dimension 32; pqM takes M in \[4, 8, 16\]"):
        build_index(plan(lake), str(tmp_path / "pq"), ObjectStoreSettings(), dataclasses.replace(OPTS, codec="pq5"))
    assert not (tmp_path / "pq").exists()


def test_a_batch_of_queries_answers_as_each_query_alone(indexes) -> None:  # type: ignore[no-untyped-def]
    """Each shard holds fewer lists than a query probes: faiss clamps its probes per query to
    the lists it was given, which once made every query after a batch's first read another's."""
    _, sq8, x = indexes
    reader = IndexReader(LocalStore(str(sq8)))
    assert max(s.list_end - s.list_start for s in reader.manifest.shards) < 32
    batch = reader.search(x[:6], 10, nprobe=32)
    assert batch == [reader.search(q[None, :], 10, nprobe=32)[0] for q in x[:6]]
    assert all(len(hits) == 10 for hits in batch)


def test_a_query_fetches_only_the_lists_it_probes(indexes, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    import indexing.reader as reader_mod
    from indexing.store import coalesce

    _, sq8, x = indexes
    asked: dict[str, list[tuple[int, int]]] = {}
    real_get_ranges = reader_mod.get_ranges

    def recording(store, key, ranges, pool=None):  # type: ignore[no-untyped-def]
        asked.setdefault(key, []).extend(ranges)
        return real_get_ranges(store, key, ranges, pool)

    monkeypatch.setattr(reader_mod, "get_ranges", recording)
    store = CountingStore(str(sq8))
    reader = IndexReader(store)
    moved = Fetched()
    query = x[:1] + 0.01
    reader.search(query, 10, nprobe=4, moved=moved)
    assert not any(k.endswith((".lists", ".vectors")) for k in store.whole), "no whole list or vector file"
    _, probed = reader.probe(query, 4)
    list_bytes = 0
    for list_no in probed[0]:
        shard = reader.shard(int(reader.shard_of_list[list_no]))
        assert shard.lists is not None
        list_bytes += shard.lists.table.span(int(list_no))[1]
    # the reader asks for exactly the probed lists and, to re-rank, the rerank × k candidates'
    # rows; the store moves only those, merged across gaps under COALESCE_GAP (the gap rule
    # itself: test_store_ranges)
    list_asks = {key: r for key, r in asked.items() if key.endswith(".lists")}
    vector_asks = {key: r for key, r in asked.items() if key.endswith(".vectors")}
    assert sum(n for r in list_asks.values() for _, n in r) == list_bytes
    assert sum(n for r in vector_asks.values() for _, n in r) == 40 * 32 * 4
    for key, ranges in {**list_asks, **vector_asks}.items():
        assert sorted((s, n) for k, s, n in store.ranged if k == key) == coalesce(ranges)
    assert moved.bytes == sum(n for _, _, n in store.ranged)
    before = len(store.ranged)
    hits = reader.search(query, 10, nprobe=4)[0]
    assert all(k.endswith(".vectors") for k, _, _ in store.ranged[before:]), "probed lists are resident now"
    # The results' lineage: only their row blocks, by range; no id map is read whole.
    asked.clear()
    rows = reader.rows(hits)
    blocks = {(h.shard, h.faiss_id // ROW_BLOCK) for h in hits}
    row_asks = [n for key, r in asked.items() if key.endswith(".rows") for _, n in r]
    assert len(row_asks) == len(blocks) and list(asked) == [k for k in asked if k.endswith(".rows")]
    assert not any(k.endswith((".rows", ".parquet")) for k in store.whole), store.whole
    assert sum(row_asks) < sum(s.ids.bytes for s in reader.manifest.shards) / 4
    whole = [take_rows(reader.shard(h.shard).ids, [h.faiss_id])[0] | {"score": h.score} for h in hits]
    assert rows == whole  # the same rows, values and types as the whole id map gives


def test_a_corrupted_list_or_vector_is_refused(indexes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import shutil

    _, sq8, x = indexes
    copy = tmp_path / "copy"
    shutil.copytree(sq8, copy)
    m = load_manifest(LocalStore(str(copy)))
    reader = IndexReader(LocalStore(str(copy)))
    _, probed = reader.probe(x[:1], 1)
    list_no = int(probed[0][0])
    ref = m.shards[int(reader.shard_of_list[list_no])]
    shard = load_shard(LocalStore(str(copy)), ref)
    assert shard.lists is not None
    offset, length = shard.lists.table.span(list_no)
    path = copy / ref.index.key
    data = bytearray(path.read_bytes())
    data[offset + length // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ListIntegrityError, match="sha256"):
        reader.search(x[:1], 10, nprobe=1)
    # Vectors: flip a bit in every row of the best hit's shard; its re-rank refuses them.
    copy2 = tmp_path / "copy2"
    shutil.copytree(sq8, copy2)
    best = IndexReader(LocalStore(str(sq8))).search(x[:1], 10, nprobe=4)[0][0]
    vectors_key = m.shards[best.shard].vectors.key  # type: ignore[union-attr]
    flipped = np.frombuffer((sq8 / vectors_key).read_bytes(), np.uint8).copy()
    flipped[::128] ^= 0x01
    (copy2 / vectors_key).write_bytes(flipped.tobytes())
    with pytest.raises(ListIntegrityError, match="digest"):
        IndexReader(LocalStore(str(copy2))).search(x[:1], 10, nprobe=4)
    # Row blocks: flip a byte in the best hit's row block; its lineage is refused, and so is
    # the whole id map a metadata filter would read.
    copy3 = tmp_path / "copy3"
    shutil.copytree(sq8, copy3)
    rows_ref = m.shards[best.shard].ids
    table = load_shard(LocalStore(str(sq8)), m.shards[best.shard]).lists.table  # type: ignore[union-attr]
    block = best.faiss_id // ROW_BLOCK
    start, end = int(table.row_offsets[block]), int(table.row_offsets[block + 1])
    data = bytearray((sq8 / rows_ref.key).read_bytes())
    data[(start + end) // 2] ^= 0xFF
    (copy3 / rows_ref.key).write_bytes(bytes(data))
    corrupt = IndexReader(LocalStore(str(copy3)))
    hits = corrupt.search(x[:1], 10, nprobe=4)[0]  # the search itself reads no row block
    with pytest.raises(ListIntegrityError, match="row block"):
        corrupt.rows(hits)
    with pytest.raises(ListIntegrityError, match="id map"):
        _ = corrupt.shard(best.shard).ids
    (copy3 / rows_ref.key).write_bytes(bytes(data[: len(data) // 2]))  # truncated
    with pytest.raises(ListIntegrityError, match=r"row block|id map"):
        IndexReader(LocalStore(str(copy3))).rows(hits)


def test_a_tenth_of_the_index_in_memory_answers_exactly_as_all_of_it(indexes) -> None:  # type: ignore[no-untyped-def]
    _, sq8, x = indexes
    rng = np.random.default_rng(5)
    queries = x[rng.choice(len(x), 60, replace=False)] + 0.01
    everything = IndexReader(LocalStore(str(sq8)))
    m = everything.manifest
    total = sum(s.index.bytes for s in m.shards)
    budget = ByteBudget(total // 10)

    class Budgeted:
        def __init__(self) -> None:
            self.shards: dict[str, LoadedShard] = {}

        def cached(self, ref: ShardRef) -> LoadedShard | None:
            return self.shards.get(ref.index.sha256)

        def load(self, store: ObjectStore, ref: ShardRef) -> LoadedShard:
            return self.shards.setdefault(ref.index.sha256, load_shard(store, ref, budget))

    tenth = IndexReader(LocalStore(str(sq8)), source=Budgeted())
    for q in queries:
        want = [(h.shard, h.faiss_id) for h in everything.search(q[None], 10, nprobe=16)[0]]
        got = [(h.shard, h.faiss_id) for h in tenth.search(q[None], 10, nprobe=16)[0]]
        assert got == want
        assert budget.held <= total // 10 + max(s.index.bytes for s in m.shards)
    assert budget.evictions > 0, "the budget must have been exceeded and lists dropped"


def test_ranged_reads_cannot_deadlock_the_thread_pools(indexes, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Per-shard work waits on ranged reads; were both on one pool, a full pool would wait forever."""
    import indexing.reader as reader_mod
    import indexing.store as store_mod

    _, sq8, x = indexes
    pools: dict[str, object] = {}
    monkeypatch.setattr(reader_mod, "_pools", pools)
    monkeypatch.setattr(reader_mod, "RANGE_THREADS", 1)
    monkeypatch.setattr(reader_mod, "SHARD_THREADS", 1)
    uncoalesced = store_mod.coalesce
    monkeypatch.setattr(store_mod, "coalesce", lambda ranges, gap: uncoalesced(ranges, 0))  # every range its own GET
    reader = IndexReader(LocalStore(str(sq8)))
    done: list[object] = []
    worker = threading.Thread(target=lambda: done.append(reader.search(x[:8] + 0.01, 10, nprobe=8)), daemon=True)
    worker.start()
    worker.join(60)
    assert done, "search hung: a pool's task waited on a task queued behind it"
    for pool in pools.values():
        pool.shutdown(wait=False)  # type: ignore[attr-defined]


def test_the_disk_tier_serves_a_restarted_replica_and_repairs_rot(indexes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from retrieval.cache import ShardCache

    _, sq8, x = indexes
    queries = x[:20] + 0.01
    cache_dir = tmp_path / "cache"

    def replica(**kw: int) -> tuple[IndexReader, CountingStore, ShardCache]:
        store = CountingStore(str(sq8))
        cache = ShardCache(cache_dir, **kw)
        return IndexReader(store, source=cache), store, cache

    def answers(reader: IndexReader) -> list[list[tuple[int, int]]]:
        return [[(h.shard, h.faiss_id) for h in row] for row in reader.search(queries, 10, nprobe=8)]

    first, store, _ = replica()
    want = answers(first)
    assert store.ranged, "a cold replica reads lists and vectors by range"
    again, store, _ = replica()  # a restart: memory empty, disk kept
    assert answers(again) == want
    assert not any(k.endswith((".lists", ".vectors")) for k, _, _ in store.ranged), "all from the disk tier"
    assert not any(k.endswith((".lists", ".vectors")) for k in store.whole)
    for part in cache_dir.glob("*.part"):  # rot every byte the copies hold
        data = bytearray(part.read_bytes())
        for i in range(0, len(data), 7):
            data[i] ^= 0x5A
        part.write_bytes(bytes(data))
    rotted, store, _ = replica()
    assert answers(rotted) == want, "rotten local bytes fail their check and are read again from the store"
    assert store.ranged
    healed, store, _ = replica()
    assert answers(healed) == want and not store.ranged, "the fresh reads repaired the copies"
    total = sum(r.index.bytes + r.vectors.bytes for r in first.manifest.shards)  # type: ignore[union-attr]
    small, _, _ = replica(disk_bytes=total // 20)
    answers(small)
    usage = sum(min(p.stat().st_size, p.stat().st_blocks * 512) for p in cache_dir.iterdir() if p.is_file())
    assert usage <= total // 20 + 64 * 1024, "the disk bound holds the sparse copies too"


def test_concurrent_queries_fetch_a_list_once(indexes) -> None:  # type: ignore[no-untyped-def]
    import time

    _, sq8, x = indexes

    class SlowStore(CountingStore):
        def get_range(self, key: str, start: int, length: int) -> bytes:
            time.sleep(0.05)  # every query arrives while the first fetch is in flight
            return super().get_range(key, start, length)

    store = SlowStore(str(sq8))
    reader = IndexReader(store)
    query = x[:1] + 0.01
    reader.shards(range(len(reader.manifest.shards)))  # the small files first: only lists remain to fetch
    barrier = threading.Barrier(8)
    results: list[list[int]] = []

    def ask() -> None:
        barrier.wait()
        results.append([h.faiss_id for h in reader.search(query, 10, nprobe=4)[0]])

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 8 and all(r == results[0] for r in results)
    list_reads = [(k, s) for k, s, _ in store.ranged if k.endswith(".lists")]
    assert len(list_reads) == len(set(list_reads)), "a list being fetched is waited for, not fetched again"


def test_an_index_of_the_older_layout_answers_as_the_row_block_one(  # type: ignore[no-untyped-def]
    indexes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compressed indexes built before row blocks (format 2: a parquet id map fetched whole,
    list blocks without filter columns) keep working, with the same answers and lineage."""
    import indexing.ivf as ivf_mod
    from indexing.lists import encode_lists

    _, sq8, x = indexes
    lake_path = tmp_path / "lake"
    lake = synthetic_lake(str(lake_path), n=6000, dim=32)[0]
    monkeypatch.setattr(ivf_mod, "encode_lists", lambda *args: encode_lists(*args[:6]))  # no id map: no row blocks
    store = LocalStore(str(tmp_path / "old"))
    manifest = build_index(plan(lake), store.root, ObjectStoreSettings(), dataclasses.replace(OPTS, codec="sq8"))
    publish(store, manifest)
    assert manifest.format_version == 2 and not any(s.id_blocks for s in manifest.shards)
    assert all(s.ids.key.endswith(".ids.parquet") for s in manifest.shards)
    old, new = IndexReader(store), IndexReader(LocalStore(str(sq8)))
    assert not old.shard(0).row_blocks and old.shard(0).lists.table.row_bytes == 32 + 8  # type: ignore[union-attr]
    queries = x[:20] + 0.01
    for got, want in zip(old.search(queries, 10, nprobe=8), new.search(queries, 10, nprobe=8), strict=True):
        assert [r["chunk_id"] for r in old.rows(got)] == [r["chunk_id"] for r in new.rows(want)]


def test_row_blocks_of_format_4_answer_as_those_compressed_whole(  # type: ignore[no-untyped-def]
    indexes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row blocks whose buffers Arrow compressed one by one (format 4, as first written) keep
    working beside blocks compressed whole (format 5): the same answers, lineage, filters on
    the probed lists' rows, and whole id maps; the whole blocks are smaller."""
    import indexing.lists as lists_mod

    _, sq8, x = indexes
    lake = Lake.at(str(sq8.parent / "lake"))  # the same rows as the fixture's index
    monkeypatch.setattr(lists_mod, "ROW_CODEC", "")
    store = LocalStore(str(tmp_path / "v4"))
    manifest = build_index(plan(lake), store.root, ObjectStoreSettings(), dataclasses.replace(OPTS, codec="sq8"))
    publish(store, manifest)
    monkeypatch.undo()
    assert manifest.format_version == 4 and all(s.id_blocks and not s.row_codec for s in manifest.shards)
    new_store = LocalStore(str(sq8))
    new_manifest = load_manifest(new_store)
    assert all(s.row_codec == "zstd" for s in new_manifest.shards)
    old, new = IndexReader(store), IndexReader(new_store)
    assert old.shard(0).lists.table.row_codec == ""  # type: ignore[union-attr]
    queries = x[:20] + 0.01
    for got, want in zip(old.search(queries, 10, nprobe=8), new.search(queries, 10, nprobe=8), strict=True):
        assert old.rows(got) == new.rows(want)
    for s in range(len(manifest.shards)):
        assert old.shard(s).ids.equals(new.shard(s).ids)  # the whole id maps, decoded both ways
    rows = sum(s.ids.bytes for s in manifest.shards), sum(s.ids.bytes for s in new_manifest.shards)
    assert rows[1] < rows[0], f"whole-block zstd should be smaller: {rows}"


def test_shards_opened_side_by_side_share_one_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every shard of a build names one codec file; shards opened at once parse it at once.
    They must all get the same parameters object: the reader scans the unfiltered shards of
    one codec together, and a cold replica whose shards each kept their own copy scanned
    them one by one (23 calls instead of 1 at 1M vectors, measured)."""
    import indexing.lists as lists_mod

    raw = lists_mod.save_codec("sq8", np.arange(64, dtype=np.float32))
    threads = 4
    inside = threading.Barrier(threads, timeout=10)
    real_check = lists_mod.check_codec

    def parse_together(codec: str, dim: int | None = None) -> None:
        inside.wait()  # every thread is past the memo lookup and parsing
        real_check(codec, dim)

    monkeypatch.setattr(lists_mod, "check_codec", parse_together)
    monkeypatch.setattr(lists_mod, "_LOADED_CODECS", type(lists_mod._LOADED_CODECS)())
    got: list[tuple[str, np.ndarray]] = []
    workers = [threading.Thread(target=lambda: got.append(lists_mod.load_codec(raw, "digest"))) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(got) == threads and len({id(trained) for _, trained in got}) == 1


def test_results_from_several_shards_fetch_their_row_blocks_side_by_side(indexes) -> None:  # type: ignore[no-untyped-def]
    """A cold replica's 10 results usually lie in as many shards: their row blocks are
    fetched at once (one round trip to S3), not one shard after another."""
    from indexing.reader import Hit

    _, sq8, _ = indexes

    class Meeting(LocalStore):
        barrier = threading.Barrier(3, timeout=10)

        def get_range(self, key: str, start: int, length: int) -> bytes:
            if key.endswith(".rows"):
                self.barrier.wait()  # BrokenBarrierError when the shards' reads come one by one
            return super().get_range(key, start, length)

    reader = IndexReader(Meeting(str(sq8)))
    assert len(reader.manifest.shards) >= 3
    hits = [Hit(s, 1, 0.5) for s in range(3)]
    rows = reader.rows(hits)
    plain = IndexReader(LocalStore(str(sq8)))
    assert rows == [take_rows(plain.shard(h.shard).ids, [h.faiss_id])[0] | {"score": h.score} for h in hits]
