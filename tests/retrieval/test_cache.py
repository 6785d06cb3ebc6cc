"""The shard cache: disk and memory tiers, verification, single fetch under concurrency."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from indexing.ivf import BuildOptions, build_index
from indexing.lists import ResidentLists
from indexing.manifest import ManifestError, publish
from indexing.reader import IndexReader
from indexing.snapshot import plan
from indexing.store import LocalStore, ObjectStore
from pipelines.storage import ObjectStoreSettings
from retrieval import metrics
from retrieval.cache import ShardCache
from tests.indexing.lakes import synthetic_lake


class CountingStore(LocalStore):
    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.gets: list[str] = []
        self.lock = threading.Lock()

    def get(self, key: str) -> bytes:
        with self.lock:
            self.gets.append(key)
        return super().get(key)


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory, ray_local: None) -> Path:
    tmp = tmp_path_factory.mktemp("cache")
    lake, _ = synthetic_lake(str(tmp / "lake"), n=2000, dim=16)
    store = LocalStore(str(tmp / "index"))
    opts = BuildOptions(nlist=16, iterations=3, shard_bytes=20_000, progress=False)
    publish(store, build_index(plan(lake), store.root, ObjectStoreSettings(), opts))
    return tmp / "index"


def shard_gets(store: CountingStore) -> int:
    return sum(1 for k in store.gets if k.endswith(".faiss"))


def count(result: str) -> float:
    return metrics.CACHE_REQUESTS.labels(result)._value.get()


def test_memory_then_disk_then_store(index: Path, tmp_path: Path) -> None:
    store = CountingStore(str(index))
    cache = ShardCache(tmp_path / "c", memory_bytes=1 << 30)
    reader = IndexReader(store, source=cache)
    n = len(reader.manifest.shards)
    assert n > 2
    reader.shards(range(n))
    assert shard_gets(store) == n
    memory = count("memory")
    reader.shards(range(n))
    assert shard_gets(store) == n and count("memory") == memory + n
    # A new process (fresh memory) finds the files on disk, verified.
    again = IndexReader(store, source=ShardCache(tmp_path / "c", memory_bytes=1 << 30))
    disk = count("disk")
    again.shards(range(n))
    assert shard_gets(store) == n and count("disk") == disk + n


def test_memory_budget_evicts_least_recently_used(index: Path, tmp_path: Path) -> None:
    store = CountingStore(str(index))
    reader = IndexReader(store, source=None)
    one = reader.shard(0).nbytes
    cache = ShardCache(None, memory_bytes=int(one * 2.5))
    reader = IndexReader(store, source=cache)
    for i in (0, 1, 2):
        reader.shard(i)
    assert cache.memory_held <= int(one * 2.5) * 1.5
    assert not cache.contains(reader.manifest.shards[0]) and cache.contains(reader.manifest.shards[2])


def test_disk_budget_and_corrupt_files(index: Path, tmp_path: Path) -> None:
    store = CountingStore(str(index))
    ref = IndexReader(store).manifest.shards[0]
    cache = ShardCache(tmp_path / "c", memory_bytes=0, disk_bytes=ref.index.bytes + ref.ids.bytes)
    reader = IndexReader(store, source=cache)
    reader.shard(0)
    reader.shard(1)
    files = list((tmp_path / "c").iterdir())
    assert sum(f.stat().st_size for f in files) <= ref.index.bytes + ref.ids.bytes + 1
    # A corrupted cache file is discarded and fetched again, never used.
    target = tmp_path / "c" / reader.manifest.shards[1].index.sha256
    if target.exists():
        target.write_bytes(b"garbage")
    fresh = IndexReader(store, source=ShardCache(tmp_path / "c", memory_bytes=0))
    before = shard_gets(store)
    assert fresh.shard(1).index.ntotal == reader.manifest.shards[1].count
    assert shard_gets(store) == before + 1


def test_concurrent_loads_share_one_fetch(index: Path, tmp_path: Path) -> None:
    store = CountingStore(str(index))
    cache = ShardCache(tmp_path / "c")
    reader = IndexReader(store, source=cache)
    barrier = threading.Barrier(8)

    def load() -> None:
        barrier.wait()
        reader.shard(0)

    threads = [threading.Thread(target=load) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert shard_gets(store) == 1


def test_a_store_file_that_does_not_match_is_refused(index: Path, tmp_path: Path) -> None:
    store: ObjectStore = LocalStore(str(index))
    reader = IndexReader(store, source=ShardCache(tmp_path / "c"))
    key = reader.manifest.shards[0].ids.key
    original = store.get(key)
    store.put(key, original[:-10] + b"0123456789")
    try:
        with pytest.raises(ManifestError, match="checksum"):
            reader.shard(0)
    finally:
        store.put(key, original)


class MeetingStore(CountingStore):
    """Reads of the ``meet`` keys wait until all of them are in flight at once (or fail)."""

    def __init__(self, root: str, meet: set[str]) -> None:
        super().__init__(root)
        self.meet = meet
        self.barrier = threading.Barrier(len(meet), timeout=10)

    def get(self, key: str) -> bytes:
        if key in self.meet:
            self.barrier.wait()  # BrokenBarrierError if they are read one after another
        return super().get(key)


@pytest.mark.parametrize("disk", [True, False])
def test_a_cold_replica_fetches_a_builds_codec_once_and_a_shards_files_in_one_round_trip(
    tmp_path: Path, ray_local: None, disk: bool
) -> None:
    """Every shard of a compressed build names the same codec file (a PQ's centroids: 384 KB
    at 384 dimensions): opening all shards at once fetches it once, with or without a disk
    tier; and a shard's list table and codec are fetched side by side, not one after the
    other (a round trip to S3 each, before). Its id map is row blocks, read by range later."""
    lake, _ = synthetic_lake(str(tmp_path / "lake"), n=3000, dim=16)
    root = tmp_path / "index"
    opts = BuildOptions(nlist=16, iterations=3, shard_bytes=20_000, progress=False, codec="pq4")
    manifest = build_index(plan(lake), str(root), ObjectStoreSettings(), opts)
    publish(LocalStore(str(root)), manifest)
    assert len(manifest.shards) >= 4
    first = {f.key for f in manifest.shards[0].opened()}
    assert len(first) == 2 and not any(k.endswith((".rows", ".parquet")) for k in first)
    meeting = MeetingStore(str(root), first)
    IndexReader(meeting, source=ShardCache(tmp_path / "c1" if disk else None)).shard(0)

    store = CountingStore(str(root))
    reader = IndexReader(store, source=ShardCache(tmp_path / "c2" if disk else None))
    store.gets.clear()
    reader.shards(range(len(manifest.shards)))
    codec_gets = [key for key in store.gets if key.endswith("codec.npz")]
    assert len(codec_gets) == 1, codec_gets
    assert sum(key.endswith(".table.npz") for key in store.gets) == len(manifest.shards)
    assert not any(key.endswith((".rows", ".ids.parquet")) for key in store.gets), "no id map is fetched whole"


def test_a_warm_rerank_reads_its_vectors_from_the_disk_tier_in_place(
    tmp_path: Path, ray_local: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compressed index re-ranks by float vectors: once the cache's sparse copy holds them, a
    search reads them there on its own thread (``local_vectors`` through the copy's
    ``read_local``), not through a ranged fetch on the shard pool. A wrapper around the copy
    that hid ``read_local`` would quietly send every warm re-rank the long way."""
    lake, vectors = synthetic_lake(str(tmp_path / "lake"), n=2000, dim=16)
    root = tmp_path / "index"
    opts = BuildOptions(nlist=16, iterations=3, shard_bytes=20_000, progress=False, codec="sq8")
    publish(LocalStore(str(root)), build_index(plan(lake), str(root), ObjectStoreSettings(), opts))
    reader = IndexReader(LocalStore(str(root)), source=ShardCache(tmp_path / "c"))
    local: list[bool] = []
    real = ResidentLists.local_vectors

    def spy(self: ResidentLists, rows: np.ndarray, digests: np.ndarray) -> np.ndarray | None:
        found = real(self, rows, digests)
        local.append(found is not None)
        return found

    monkeypatch.setattr(ResidentLists, "local_vectors", spy)
    query = vectors[:1]
    cold = reader.search(query, 10, nprobe=4)
    assert local and not any(local)  # cold: nothing on disk yet
    local.clear()
    assert reader.search(query, 10, nprobe=4) == cold
    assert local and all(local)
