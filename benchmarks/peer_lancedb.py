"""The peer system for the index benchmarks: LanceDB's IVF_FLAT index on the same vectors,
or (``--pq M --serving``) its IVF_PQ index served as ``benchmarks/serving_scale.py`` serves ours.

Runs in its own virtual environment (``make bench`` creates ``.venv-peers``: lancedb
brings its own Arrow and Lance stack, which must not leak into ours). Reads the vectors,
queries and exact top-10 from .npy files, prints one JSON line per figure.

    .venv-peers/bin/python benchmarks/peer_lancedb.py DIR --nlist K --iterations I
    .venv-peers/bin/python benchmarks/peer_lancedb.py DIR --nlist K --iterations I \\
        --pq 48 --refine 4 --nprobe P --serving
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import lancedb
import numpy as np
import pyarrow as pa
from lancedb.index import IvfFlat, IvfPq


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def io_read() -> tuple[int, int]:
    """(bytes, read calls) this process has read so far, page cache included (``/proc/self/io``)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["rchar"]), int(fields["syscr"])


def rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def batches(x: np.ndarray, dim: int) -> Iterator[pa.RecordBatch]:
    """The vectors as record batches, 100k rows at a time (never all in memory twice)."""
    for lo in range(0, len(x), 100_000):
        block = np.ascontiguousarray(x[lo : lo + 100_000], dtype=np.float32)
        vectors = pa.FixedSizeListArray.from_arrays(pa.array(block.ravel()), dim)
        yield pa.record_batch({"id": pa.array(np.arange(lo, lo + len(block))), "vector": vectors})


def serving(args: argparse.Namespace, x: np.ndarray, queries: np.ndarray, truth: np.ndarray) -> None:
    """IVF_PQ built, then a fresh connection's first query, the next 20, and every query twice."""
    n, dim = x.shape
    with tempfile.TemporaryDirectory(prefix="lancedb-serving-", dir=args.dir) as tmp:
        db = lancedb.connect(tmp)
        t0 = time.perf_counter()
        schema = pa.schema([("id", pa.int64()), ("vector", pa.list_(pa.float32(), dim))])
        table = db.create_table("chunks", data=batches(x, dim), schema=schema)
        loaded = time.perf_counter() - t0
        t0 = time.perf_counter()
        config = IvfPq(distance_type="l2", num_partitions=args.nlist, num_sub_vectors=args.pq,
                       max_iterations=args.iterations)  # fmt: skip
        table.create_index("vector", config=config)
        indexed = time.perf_counter() - t0
        stored = sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file())
        del table, db
        rss0 = rss()
        t0 = time.perf_counter()
        table = lancedb.connect(tmp).open_table("chunks")
        opened = time.perf_counter() - t0
        [nprobe] = args.nprobe

        def run(qs: np.ndarray, want: np.ndarray, nprobes: int | None, refine: int | None) -> dict[str, object]:
            latencies, found = [], 0
            b0, c0 = io_read()
            for q, w in zip(qs, want, strict=True):
                t = time.perf_counter()
                search = table.search(q).limit(10).select(["id"])
                if nprobes is not None:
                    search = search.nprobes(nprobes)
                if refine is not None:
                    search = search.refine_factor(refine)
                hits = search.to_arrow()
                latencies.append(time.perf_counter() - t)
                found += len(set(hits.column("id").to_pylist()) & set(w.tolist()))
            b1, c1 = io_read()
            return {"p50_ms": round(float(np.percentile(latencies, 50)) * 1000, 2),
                    "p99_ms": round(float(np.percentile(latencies, 99)) * 1000, 2),
                    "recall_at_10": round(found / want.size, 4), "read_calls_per_query": round((c1 - c0) / len(qs), 1),
                    "kb_read_per_query": round((b1 - b0) / len(qs) / 1024, 1)}  # fmt: skip

        refine, *deeper = args.refine or [None]
        first = run(queries[:1], truth[:1], nprobe, refine)
        next20 = run(queries[1:21], truth[1:21], nprobe, refine)
        run(queries, truth, nprobe, refine)
        warm = run(queries, truth, nprobe, refine)
        more = {}
        for r in deeper:
            run(queries, truth, nprobe, r)
            more[f"refine_{r}"] = run(queries, truth, nprobe, r)
        defaults = run(queries, truth, None, None)
        emit(bench="serving_scale", system="lancedb", lancedb=lancedb.__version__, index="IVF_PQ", dim=dim,
             nlist=args.nlist, pq_sub_vectors=args.pq, nprobe=nprobe, refine_factor=refine, **more,
             load_s=round(loaded, 1), build_s=round(loaded + indexed, 1), index_s=round(indexed, 1),
             storage_mb_per_million=round(stored / n * 1e6 / 2**20, 1), open_s=round(opened, 3),
             cold_first_query_ms=first["p50_ms"], cold_first=first, cold_next_20=next20, warm=warm,
             recall_at_10=warm["recall_at_10"], process_rss_growth_mb=round((rss() - rss0) / 2**20, 1),
             lancedb_defaults=defaults,
             note="local files (page cache warm from the build); no object store, so no GET count")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir", type=Path, help="holds vectors.npy, queries.npy, truth.npy")
    parser.add_argument("--nlist", type=int, required=True)
    parser.add_argument("--iterations", type=int, required=True)
    parser.add_argument("--nprobe", type=int, action="append")
    parser.add_argument("--label", default="")
    parser.add_argument("--pq", type=int, help="IVF_PQ with this many sub-vectors (with --serving)")
    parser.add_argument(
        "--refine",
        type=int,
        action="append",
        help="refine_factor: re-rank this many × k exactly (with --serving; the first timed cold)",
    )
    parser.add_argument("--serving", action="store_true", help="IVF_PQ, measured as a replica serving it")
    args = parser.parse_args()
    x = np.load(args.dir / "vectors.npy", mmap_mode="r")
    queries = np.load(args.dir / "queries.npy")
    truth = np.load(args.dir / "truth.npy")
    if args.serving:
        serving(args, x, queries, truth)
        return
    n, dim = x.shape
    with tempfile.TemporaryDirectory(prefix="lancedb-bench-") as tmp:
        db = lancedb.connect(tmp)
        t0 = time.perf_counter()
        batches = []
        for lo in range(0, n, 100_000):
            block = np.ascontiguousarray(x[lo : lo + 100_000], dtype=np.float32)
            vectors = pa.FixedSizeListArray.from_arrays(pa.array(block.ravel()), dim)
            batches.append(pa.table({"id": np.arange(lo, lo + len(block)), "vector": vectors}))
        table = db.create_table("chunks", data=pa.concat_tables(batches))
        loaded = time.perf_counter() - t0
        t0 = time.perf_counter()
        config = IvfFlat(distance_type="l2", num_partitions=args.nlist, max_iterations=args.iterations)
        table.create_index("vector", config=config)
        indexed = time.perf_counter() - t0
        emit(bench="lancedb_build", corpus=args.label, n=n, dim=dim, nlist=args.nlist, iterations=args.iterations,
             load_s=round(loaded, 2), index_s=round(indexed, 2), lancedb=lancedb.__version__)  # fmt: skip
        for nprobe in args.nprobe or [4, 8, 16, 32, 64, 128]:
            found = []
            t0 = time.perf_counter()
            for q in queries:
                hits = table.search(q).nprobes(nprobe).limit(10).select(["id", "_distance"]).to_arrow()
                found.append(set(hits.column("id").to_pylist()))
            seconds = time.perf_counter() - t0
            recall = np.mean([len(f & set(t.tolist())) / 10 for f, t in zip(found, truth, strict=True)])
            emit(bench="lancedb_recall", corpus=args.label, n=n, nlist=args.nlist, nprobe=nprobe,
                 recall_at_10=round(float(recall), 4), qps=round(len(queries) / seconds, 1))  # fmt: skip


if __name__ == "__main__":
    main()
