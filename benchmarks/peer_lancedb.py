"""The peer system for the index benchmarks: LanceDB's IVF_FLAT index on the same vectors.

Runs in its own virtual environment (``make bench`` creates ``.venv-peers``: lancedb
brings its own Arrow and Lance stack, which must not leak into ours). Reads the vectors,
queries and exact top-10 from .npy files, prints one JSON line per figure.

    .venv-peers/bin/python benchmarks/peer_lancedb.py DIR --nlist K --iterations I
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import lancedb
import numpy as np
import pyarrow as pa
from lancedb.index import IvfFlat


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir", type=Path, help="holds vectors.npy, queries.npy, truth.npy")
    parser.add_argument("--nlist", type=int, required=True)
    parser.add_argument("--iterations", type=int, required=True)
    parser.add_argument("--nprobe", type=int, action="append")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    x = np.load(args.dir / "vectors.npy", mmap_mode="r")
    queries = np.load(args.dir / "queries.npy")
    truth = np.load(args.dir / "truth.npy")
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
