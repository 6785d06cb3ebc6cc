"""Decoupled serving: what a replica moves from object storage, holds in memory, and answers.

For each index codec (``flat``: float32 IVF shards fetched whole; ``sq8``/``sq4``:
scalar-quantized lists fetched by byte range and re-ranked exactly with float vectors
fetched by range) on the Python docs' real embeddings, with the index in S3 (moto on
loopback) behind a fixed added delay per request (``--delay-ms``, 20 by default: about
what a first byte from real S3 costs):

- cold: a fresh replica's first query (latency, GET requests, bytes moved), and the next 20;
- warm: p50/p99 over every query once each has run, recall@10 against exact search at the
  engine's default nprobe, and the memory the cache holds for index data;
- restarted: the first query of a replica restarted on the same cache directory (the disk
  tier: whole files, and sparse copies of the ranges read);
- a replica whose memory budget is a tenth of the index, without and with a disk tier:
  recall, latency, requests and bytes per query (it serves the whole index from a tenth);
- storage bytes per million vectors.

One JSON line per codec. Run: ``.venv/bin/python -m benchmarks.decoupled`` (or
``benchmarks/retrieval.py --only codecs``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pyarrow as pa

from benchmarks.index import emit
from benchmarks.pydocs import embedded_pydocs
from indexing.ivf import BuildOptions, build_index
from indexing.manifest import publish
from indexing.reader import IndexReader
from indexing.snapshot import plan
from indexing.store import LocalStore, ObjectStore, S3Store
from pipelines.lake import CHUNKS, Lake
from pipelines.lake_writer import LakeWriter
from pipelines.storage import ObjectStoreSettings
from retrieval.acl import ANONYMOUS
from retrieval.cache import ShardCache
from retrieval.corpus import load_pydocs, section_titles
from retrieval.engine import SearchEngine, default_nprobe
from retrieval.views import EngineOptions
from serving.embedder import load_embedder
from tests.indexing.lakes import chunk_rows

#: queries of the tenth-of-memory replicas (twice each; without a disk tier each moves megabytes)
TENTH_QUERIES = 100


class LatencyStore(ObjectStore):
    """Another store with a fixed delay added to every request, counting requests and bytes."""

    def __init__(self, inner: ObjectStore, delay_s: float) -> None:
        self.inner, self.delay_s, self.root = inner, delay_s, inner.root
        self.requests = 0
        self.bytes = 0
        self._lock = threading.Lock()

    def _count(self, data: bytes) -> bytes:
        with self._lock:
            self.requests += 1
            self.bytes += len(data)
        return data

    def get(self, key: str) -> bytes:
        time.sleep(self.delay_s)
        return self._count(self.inner.get(key))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        time.sleep(self.delay_s)
        return self._count(self.inner.get_range(key, start, length))

    def put(self, key: str, data: bytes, if_absent: bool = False) -> None:
        self.inner.put(key, data, if_absent)

    def list(self, prefix: str = "") -> Iterator[str]:
        time.sleep(self.delay_s)
        self._count(b"")
        yield from self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return self.requests, self.bytes


def ms(seconds: list[float]) -> dict[str, float]:
    return {"p50_ms": round(float(np.percentile(seconds, 50)) * 1000, 2),
            "p99_ms": round(float(np.percentile(seconds, 99)) * 1000, 2)}  # fmt: skip


def pydocs(work: Path, queries: int) -> tuple[Lake, np.ndarray, np.ndarray, list[str], str]:
    """The docs as a lake of real embedded chunks with their real text (what id maps and row
    blocks hold); real queries (section titles) embedded by the model."""
    corpus = embedded_pydocs()
    lake = Lake.at(str(work / "lake"))
    lake.ensure_tables(1)
    writer = LakeWriter(lake, CHUNKS, "bench", None)
    for part in np.array_split(np.arange(len(corpus.texts)), 8):
        rows = chunk_rows(corpus.vectors[part], start=int(part[0]), model=corpus.model)
        text = pa.array([str(corpus.texts[i]) for i in part], rows.schema.field("text").type)
        writer.write(rows.set_column(rows.schema.get_field_index("text"), rows.schema.field("text"), text))
    titles = sorted({t for d in load_pydocs() for t in section_titles(d.body)})
    rng = np.random.default_rng(2)
    picked = [titles[i] for i in rng.choice(len(titles), queries, replace=False)]
    embedder = load_embedder()
    q = np.ascontiguousarray(embedder.embed(picked), np.float32)
    exact = faiss.IndexFlatIP(corpus.vectors.shape[1])
    exact.add(np.ascontiguousarray(corpus.vectors, np.float32))
    _, truth = exact.search(q, 10)
    ids = [f"c{i:07d}" for i in range(len(corpus.vectors))]
    return lake, q, truth, ids, corpus.model


def upload(local: Path, s3: S3Store) -> int:
    store = LocalStore(str(local))
    total = 0
    for key in store.list():
        data = store.get(key)
        s3.put(key, data)
        total += len(data)
    return total


def run_queries(
    engine: SearchEngine, queries: np.ndarray, truth: np.ndarray, ids: list[str]
) -> tuple[list[float], float]:
    view = engine.current_view()
    latencies, found = [], 0
    for q, want in zip(queries, truth, strict=True):
        t0 = time.perf_counter()
        result = engine.search_vector(view, q, 10, ANONYMOUS)
        latencies.append(time.perf_counter() - t0)
        found += len({r["chunk_id"] for r in result.results} & {ids[i] for i in want})
    return latencies, found / truth.size


def bench_codecs(work: Path, codecs: list[str], delay_ms: float, n_queries: int) -> None:
    import boto3

    from benchmarks.retrieval import VectorsOnly, start_moto

    work.mkdir(parents=True, exist_ok=True)
    lake, queries, truth, ids, model = pydocs(work, n_queries)
    snap = plan(lake)
    proc, env = start_moto(work)
    try:
        os.environ.update(env)
        settings = ObjectStoreSettings.from_env(env)
        boto3.client("s3").create_bucket(Bucket="codecs")
        for codec in codecs:
            local = work / f"index-{codec}"
            t0 = time.perf_counter()
            store = LocalStore(str(local))
            manifest = build_index(snap, store.root, ObjectStoreSettings(), BuildOptions(progress=False, codec=codec))
            publish(store, manifest)
            build_s = time.perf_counter() - t0
            s3 = S3Store(f"s3://codecs/{codec}", settings)
            stored = upload(local, s3)
            data_bytes = sum(s.index.bytes for s in manifest.shards)  # codes (or float IVF) only

            def replica(
                memory: int, cache_dir: Path | None, s3: S3Store = s3
            ) -> tuple[SearchEngine, LatencyStore, ShardCache]:
                slow = LatencyStore(s3, delay_ms / 1000)
                cache = ShardCache(cache_dir, memory_bytes=memory)
                # cold means cold: nothing fetched before the first query
                engine = SearchEngine(lake, slow, VectorsOnly(model), cache, EngineOptions(prefetch=False))
                engine.start(background=False)
                return engine, slow, cache

            def first_query(engine: SearchEngine, slow: LatencyStore) -> tuple[float, int, int]:
                view = engine.current_view()
                r0, b0 = slow.snapshot()
                t0 = time.perf_counter()
                engine.search_vector(view, queries[0], 10, ANONYMOUS)
                took = time.perf_counter() - t0
                r1, b1 = slow.snapshot()
                return took, r1 - r0, b1 - b0

            disk = work / f"cache-{codec}"
            engine, slow, cache = replica(64 << 30, disk)
            first_s, first_requests, first_bytes = first_query(engine, slow)
            probed = probed_list_bytes(engine.current_view().reader, queries[:1], default_nprobe(manifest.nlist))
            probed_mb = round(probed / 2**20, 3) if codec != "flat" else None  # float shards are fetched whole
            next20, _ = run_queries(engine, queries[1:21], truth[1:21], ids)
            run_queries(engine, queries, truth, ids)  # every probed list resident
            warm, recall = run_queries(engine, queries, truth, ids)
            held = cache.memory_held
            engine.stop()
            engine, slow, _ = replica(64 << 30, disk)  # a restart: memory empty, the disk tier kept
            restart_s, restart_requests, _ = first_query(engine, slow)
            engine.stop()

            budget = max(1, data_bytes // 10)
            tenth: dict[str, Any] = {"budget_mb": round(budget / 2**20, 2)}
            for tier, directory in (("memory_only", None), ("with_disk", work / f"tenth-{codec}")):
                engine, slow, cache = replica(budget, directory)
                some, some_truth = queries[:TENTH_QUERIES], truth[:TENTH_QUERIES]  # each one fetches megabytes
                run_queries(engine, some, some_truth, ids)
                r2, b2 = slow.snapshot()
                latencies, tenth_recall = run_queries(engine, some, some_truth, ids)
                r3, b3 = slow.snapshot()
                tenth[tier] = {**ms(latencies), "recall_at_10": round(tenth_recall, 4),
                               "memory_mb": round(cache.memory_held / 2**20, 2),
                               "requests_per_query": round((r3 - r2) / len(some), 2),
                               "kb_per_query": round((b3 - b2) / len(some) / 1024, 1)}  # fmt: skip
                engine.stop()
            per_million = 1e6 / manifest.count
            emit(bench="decoupled_serving", corpus="pydocs", n=manifest.count, codec=codec, nlist=manifest.nlist,
                 nprobe=default_nprobe(manifest.nlist), delay_ms_per_request=delay_ms,
                 build_s=round(build_s, 1),
                 storage_mb_per_million=round(stored * per_million / 2**20, 1),
                 cold_first_query_ms=round(first_s * 1000, 1), cold_first_requests=first_requests,
                 cold_first_mb=round(first_bytes / 2**20, 3), cold_first_probed_lists_mb=probed_mb,
                 cold_next_20=ms(next20),
                 restarted_first_query_ms=round(restart_s * 1000, 1), restarted_first_requests=restart_requests,
                 warm=ms(warm), recall_at_10=round(recall, 4),
                 memory_mb=round(held / 2**20, 1), memory_mb_per_million=round(held * per_million / 2**20, 1),
                 tenth=tenth)  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(30)


def probed_list_bytes(reader: IndexReader, query: np.ndarray, nprobe: int) -> int:
    """Bytes of the list blocks a query probes (codes, digests and filter columns): what the
    issue's "bytes fetched ≤ 1.5× the probed lists' bytes" compares with."""
    _, lists = reader.probe(query, nprobe)
    total = 0
    for list_no in lists[0].tolist():
        shard = reader.shards([int(reader.shard_of_list[list_no])]).popitem()[1]
        if shard.lists is not None:
            total += shard.lists.table.span(list_no)[1]
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--codec", action="append", help="flat, sq8, sq4 or pqM (default: flat, sq8, pq48)")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="added to every store request (20)")
    parser.add_argument("--queries", type=int, default=300)
    args = parser.parse_args()
    from indexing.distributed import start_ray

    with tempfile.TemporaryDirectory(prefix="srdecoupled-", dir="/tmp") as tmp:
        start_ray(work_dir=Path(tmp) / "ray")
        bench_codecs(Path(tmp), args.codec or ["flat", "sq8", "pq48"], args.delay_ms, args.queries)


if __name__ == "__main__":
    main()
