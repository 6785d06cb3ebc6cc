"""Index benchmarks: one JSON line per figure, each against a baseline measured in the same run.

    .venv/bin/python benchmarks/index.py                      # 200k x 384 synthetic vectors
    .venv/bin/python benchmarks/index.py --n 1000000          # the 1M figure (minutes on 2 cores)
    .venv/bin/python benchmarks/index.py --corpus pydocs      # real embeddings: the Python docs

Sections
- build: ``index build`` end to end (plan the snapshot, load the lake files, k-means,
  assign, shards, publish) with each --executor (``local``: in-process; ``ray``: local Ray,
  its start-up included) on a lake of --n synthetic vectors written by the real lake
  writer, vs single-process faiss doing the same job (read the lake's live vectors,
  ``faiss.Kmeans`` over all of them + ``IndexIVFFlat.add``, write the index) at the same
  nlist and iterations: wall time, peak RSS of all processes, our k-means objective over
  all vectors against faiss's, how the build assigned (cells, probe, the recall loss it
  estimated) and recall@10 of both indexes at nprobe 8, 32 and the service's default.
  Targets: >= 10x faster; recall@10 at the default nprobe within 0.01 of faiss's.
- incremental: a full build with --reuse-centroids, then --changed (1%) of the chunks
  updated, deleted and inserted through the lake writer, then an incremental build (plan
  included) vs that full build and vs a full rewrite on the same centroids: seconds, bytes
  written, recall@10 at the default nprobe of both. Targets: <= 5% of the bytes and <= 10%
  of the time of a full build.
- scale (not in the default run): a lake of --n vectors written in blocks (the harness
  never holds them), then ``index build`` with each --executor: time, and peak RSS of the
  largest process and of all, against one partition plus the k-means sample.
- kmeans: distributed k-means on local Ray (the builder's code path) vs single-process
  ``faiss.Kmeans`` at the same nlist and iterations: wall time, peak RSS of all processes,
  objective ratio. Targets: <= 1.3x time, objective within 1%.
- recall: the build's two-level k-means against that flat k-means (objective over all
  vectors; recall@10 of an IVF index on each, default nprobe marked; target: within 0.01),
  and the IVF shards built from the flat centroids, searched through ``IndexReader``
  (the retrieval path: coarse search + ``search_preassigned`` per shard): recall@10 vs
  exact flat search and queries/s at nprobe 4/8/16/32, vs a single faiss IndexIVFFlat on
  the same centroids.
- peer: LanceDB's IVF_FLAT index (same vectors, nlist and iterations; run in .venv-peers):
  build time and recall@10 / queries/s at the same nprobe values.
- gpu: faiss-gpu k-means vs CPU on --gpu-n vectors; prints a skip line without a GPU.
- keyword (not in the default run): the keyword index of --n synthetic chunks (Zipf words,
  about 150 per chunk, a 40k-row shard's id map at a time) built as ``index build`` does
  (``indexing.keyword.build_keyword_index``: read each shard's id map from the store, index,
  write the files) vs the same documents added to tantivy straight from Python lists:
  seconds, bytes, per million chunks.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import faiss
import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.pydocs import EmbeddedCorpus, embedded_pydocs
from indexing.distributed import LocalPartitions, RayData, start_ray, stop_ray
from indexing.ivf import BuildOptions, build_index, build_shard, choose_nlist, plan_shards, train_centroids
from indexing.kmeans import nearest, partial_sums, train_kmeans
from indexing.manifest import Manifest, load_manifest, publish, put_file
from indexing.reader import IndexReader
from indexing.snapshot import plan
from indexing.store import LocalStore
from pipelines.lake import CHUNKS, Lake, current_chunks, embeddings
from pipelines.lake_writer import LakeWriter
from pipelines.storage import ObjectStoreSettings
from retrieval.corpus import load_pydocs, section_titles
from retrieval.engine import default_nprobe
from tests.indexing.lakes import chunk_rows

ROOT = Path(__file__).resolve().parents[1]


#: fields every line carries (which corpus the figures are on)
TAGS: dict[str, str] = {}


def emit(**fields: object) -> None:
    print(json.dumps({**fields, **TAGS}), flush=True)


def synthetic(n: int, d: int, topics: int, seed: int) -> np.ndarray:
    """Unit vectors around many overlapping topics (like sentence embeddings), made in blocks."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((topics, d)).astype(np.float32) * 3
    out = np.empty((n, d), dtype=np.float32)
    for lo in range(0, n, 100_000):
        hi = min(n, lo + 100_000)
        x = centers[rng.integers(0, topics, hi - lo)] + rng.standard_normal((hi - lo, d)).astype(np.float32)
        out[lo:hi] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out


def recall(found: list[list[int]], truth: np.ndarray) -> float:
    """Mean share of each query's exact top-k (rows of ``truth``) that was found."""
    return float(np.mean([len(set(f) & set(t.tolist())) / truth.shape[1] for f, t in zip(found, truth, strict=True)]))


class PeakRSS:
    """Peak resident memory of this process and all its children (together, and of the
    largest single process), sampled every 0.2 s."""

    def __init__(self) -> None:
        self.peak = 0
        self.peak_process = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            total = 0
            for p in [me, *me.children(recursive=True)]:
                try:
                    rss = p.memory_info().rss
                except psutil.Error:
                    continue
                total += rss
                self.peak_process = max(self.peak_process, rss)
            self.peak = max(self.peak, total)
            time.sleep(0.2)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def write_lake(x: np.ndarray, uri: str, files: int = 16) -> Lake:
    lake = Lake.at(uri)
    lake.ensure_tables(1)
    writer = LakeWriter(lake, CHUNKS, "bench", None)
    for part in np.array_split(np.arange(len(x)), files):
        writer.write(chunk_rows(x[part], start=int(part[0])))
    return lake


def bench_build(x: np.ndarray, nlist: int, iters: int, work: Path, executors: list[str], queries: np.ndarray) -> None:
    """``index build`` end to end against single-process faiss (flat k-means over all vectors
    + ``IndexIVFFlat.add``), both reading the lake; recall@10 of each index at nprobe 8, 32
    and the service's default (the build's assignment through two-level k-means's cells
    against faiss's exact assignment to its flat k-means)."""
    lake = write_lake(x, str(work / "lake"))
    del x  # both sides read the vectors from the lake
    store = LocalStore(str(work / "index"))
    harness = psutil.Process().memory_info().rss  # the generated vectors, held by both runs
    ours_runs = []
    for executor in executors:
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            if executor == "ray":
                start_ray(work_dir=work / "ray")  # a build's Ray start-up is part of its time
            snap = plan(lake)
            opts = BuildOptions(nlist, iters, progress=False, executor=executor)
            manifest = build_index(snap, store.root, ObjectStoreSettings(), opts)
            version = publish(store, manifest)
            if executor == "ray":
                stop_ray()
            ours_runs.append((executor, time.perf_counter() - t0, mem, manifest, version))
    with PeakRSS() as ref_mem:
        t0 = time.perf_counter()
        live = current_chunks(lake, columns=["chunk_id", "position", "op", "embedding"])
        vectors = embeddings(live)
        km = faiss.Kmeans(vectors.shape[1], nlist, niter=iters, seed=1, max_points_per_centroid=10**9)
        km.train(vectors)
        ivf = faiss.IndexIVFFlat(km.index, vectors.shape[1], nlist)
        ivf.is_trained = True
        ivf.add(vectors)
        faiss.write_index(ivf, str(work / "faiss.index"))
        base = time.perf_counter() - t0
    ref_obj = partial_sums(vectors, km.centroids).objective
    served = default_nprobe(nlist)
    nprobes = sorted({8, 32, served})
    ids, truth = live.column("chunk_id").to_pylist(), exact_top10(vectors, queries)
    del live
    faiss_recall = {}
    for nprobe in nprobes:
        ivf.nprobe = nprobe
        faiss_recall[nprobe] = round(recall(ivf.search(queries, 10)[1].tolist(), truth), 4)
    del ivf
    for executor, ours, ours_mem, manifest, version in ours_runs:
        st = manifest.stats
        ours_recall = {p: round(r, 4) for p, r in reader_recall(store, version, ids, truth, queries, nprobes).items()}
        emit(bench="index_build", n=len(vectors), dim=vectors.shape[1], nlist=nlist, iterations=iters,
             executor=executor, partitions=st["partitions"], shards=len(manifest.shards), build_s=round(ours, 2),
             faiss_s=round(base, 2), speedup=round(base / ours, 2), stages=st["timings"],
             kmeans=st.get("kmeans"), kmeans_sample=st.get("kmeans_sample"), assign=st.get("assign"),
             assign_cells=st.get("assign_cells"), assign_probe=st.get("assign_probe"),
             assign_margin=st.get("assign_margin"), assign_cells_probed=st.get("assign_cells_probed"),
             assign_agreement=st.get("assign_agreement"), assign_nprobe=st.get("assign_nprobe"),
             assign_recall_loss_check=st.get("assign_recall_loss"), assign_scan_growth=st.get("assign_scan_growth"),
             assign_check_ms=st.get("assign_check_ms"),
             recall_at_10=ours_recall, faiss_recall_at_10=faiss_recall,
             recall_delta_default_nprobe=round(ours_recall[served] - faiss_recall[served], 4),
             harness_rss_mb=round(harness / 2**20),
             build_peak_rss_mb=round(ours_mem.peak / 2**20), faiss_peak_rss_mb=round(ref_mem.peak / 2**20),
             objective_ratio=round(st["kmeans_objective"] / ref_obj, 4),
             targets="speedup >= 10x single-process faiss; recall@10 at the default nprobe within 0.01 of "
                     "faiss's flat k-means index")  # fmt: skip


def bench_scale(n: int, dim: int, nlist: int, iters: int, work: Path, executors: list[str]) -> None:
    """``index build`` of a lake too big to hold twice: vectors generated and written in
    blocks (the harness never holds them), then each executor's build with its peak memory,
    per process and in all, against what one partition plus the k-means sample take."""
    lake = Lake.at(str(work / "scale-lake"))
    lake.ensure_tables(1)
    writer = LakeWriter(lake, CHUNKS, "bench", None)
    block = 250_000
    for at in range(0, n, block):
        x = synthetic(min(block, n - at), dim, topics=4 * nlist, seed=at)
        writer.write(chunk_rows(x, start=at))
        del x
    harness = psutil.Process().memory_info().rss  # imports and the lake writer, before any build
    for executor in executors:
        store = LocalStore(str(work / f"scale-index-{executor}"))
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            snap = plan(lake)
            opts = BuildOptions(nlist, iters, progress=False, executor=executor, ray_dir=str(work / "ray"))
            manifest = build_index(snap, store.root, ObjectStoreSettings(), opts)
            elapsed = time.perf_counter() - t0
            stop_ray()
        st = manifest.stats
        # in-process, the one process holds every partition (and the harness: subtracted)
        partition = n * dim * 4 / (st["partitions"] if executor == "ray" else 1)
        sample = (st.get("kmeans_sample") or 0) * dim * 4
        process = mem.peak_process - (harness if executor == "local" else 0)
        emit(bench="index_build_scale", n=n, dim=dim, nlist=nlist, executor=executor, partitions=st["partitions"],
             shards=len(manifest.shards), build_s=round(elapsed, 1), stages=st["timings"], kmeans=st.get("kmeans"),
             assign=st.get("assign"), assign_probe=st.get("assign_probe"), assign_margin=st.get("assign_margin"),
             assign_cells_probed=st.get("assign_cells_probed"),
             assign_scan_growth=st.get("assign_scan_growth"), assign_recall_loss_check=st.get("assign_recall_loss"),
             partitions_per_process_mb=round(partition / 2**20), sample_mb=round(sample / 2**20),
             harness_rss_mb=round(harness / 2**20), peak_process_rss_mb=round(mem.peak_process / 2**20),
             peak_total_rss_mb=round(mem.peak / 2**20),
             process_over_partitions_plus_sample=round(process / (partition + sample), 2),
             target="peak memory per process bounded by its partition plus the sample")  # fmt: skip


def change_lake(lake: Lake, x: np.ndarray, share: float, seed: int = 7) -> int:
    """Update, delete and insert ``share`` of the chunks (half, a quarter, a quarter) in 10 commits;
    updated and new vectors are perturbed copies of existing ones (the same distribution)."""
    rng = np.random.default_rng(seed)
    m = max(4, int(share * len(x)))
    picked = rng.choice(len(x), m // 2 + m // 4, replace=False)
    updated, deleted = picked[: m // 2], picked[m // 2 :]

    def near(rows: np.ndarray) -> np.ndarray:
        v = x[rows] + rng.standard_normal((len(rows), x.shape[1])).astype(np.float32) * 0.05
        return v / np.linalg.norm(v, axis=1, keepdims=True)

    writer = LakeWriter(lake, CHUNKS, "bench-changes", None)
    later = "pg:00000000000000999999"
    for part in np.array_split(updated, 5):
        writer.write(pa.concat_tables([chunk_rows(near(np.array([r])), start=int(r), position=later) for r in part]))
    for part in np.array_split(deleted, 3):
        writer.write(pa.concat_tables([chunk_rows(x[[r]], start=int(r), op="delete", position=later) for r in part]))
    inserted = rng.choice(len(x), m // 4, replace=False)
    writer.write(chunk_rows(near(inserted), start=len(x) + 1))
    writer.write(chunk_rows(near(inserted[:1]), start=len(x) + 10 * m))  # one more commit, one row
    return m


def exact_top10(vectors: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Each query's 10 nearest vectors (row numbers), by exact search."""
    exact = faiss.IndexFlatL2(vectors.shape[1])
    exact.add(vectors)
    return exact.search(queries, 10)[1]


def reader_recall(
    store: LocalStore, version: int, ids: list[str], truth: np.ndarray, queries: np.ndarray, nprobes: list[int]
) -> dict[int, float]:
    """recall@10 of an index version at each nprobe against ``truth`` (rows of the live chunks' ``ids``)."""
    reader = IndexReader(store, version)
    out = {}
    for nprobe in nprobes:
        hits = reader.search(queries, 10, nprobe)
        found = [{r["chunk_id"] for r in reader.rows(row, ["chunk_id"])} for row in hits]
        out[nprobe] = float(np.mean([len(f & {ids[j] for j in t}) / 10 for f, t in zip(found, truth, strict=True)]))
    return out


def index_recall(store: LocalStore, version: int, lake: Lake, queries: np.ndarray) -> float:
    """recall@10 at the default nprobe of an index version against exact search over the live chunks."""
    live = current_chunks(lake, columns=["chunk_id", "position", "op", "embedding"])
    truth = exact_top10(embeddings(live), queries)
    nprobe = default_nprobe(load_manifest(store, version).nlist)
    return reader_recall(store, version, live.column("chunk_id").to_pylist(), truth, queries, [nprobe])[nprobe]


def bench_incremental(x: np.ndarray, nlist: int, iters: int, work: Path, queries: np.ndarray, share: float) -> None:
    """A full build, then ``share`` of the chunks changed, then an incremental build vs a full
    rewrite on the same centroids: time (plan included), bytes written, recall."""
    lake = write_lake(x, str(work / "inc-lake"))
    store = LocalStore(str(work / "inc-index"))
    opts = BuildOptions(nlist, iters, progress=False, reuse_centroids=True, ray_dir=str(work / "ray"))

    def timed(o: BuildOptions) -> tuple[float, Manifest]:
        t0 = time.perf_counter()
        manifest = build_index(plan(lake), store.root, ObjectStoreSettings(), o)
        elapsed = time.perf_counter() - t0
        stop_ray()
        return elapsed, manifest

    full_s, full = timed(opts)
    publish(store, full)
    changed = change_lake(lake, x, share)
    inc_s, inc = timed(opts)
    inc_version = publish(store, inc)
    rewrite_s, rewrite = timed(dataclasses.replace(opts, incremental=False))
    rewrite_version = publish(store, rewrite)
    st = inc.stats
    emit(bench="index_incremental", n=len(x), dim=x.shape[1], nlist=nlist, changed_chunks=st["changed_chunks"],
         changed_share=round(changed / len(x), 4), incremental=st["incremental"], delta_rows=st.get("delta_rows"),
         dead_rows=st.get("dead_rows"), full_s=round(full_s, 2), full_bytes=full.stats["written_bytes"],
         incremental_s=round(inc_s, 2), incremental_bytes=st["written_bytes"],
         time_ratio=round(inc_s / full_s, 4), bytes_ratio=round(st["written_bytes"] / full.stats["written_bytes"], 4),
         rewrite_same_centroids_s=round(rewrite_s, 2), rewrite_bytes=rewrite.stats["written_bytes"],
         stages=st["timings"], full_executor=full.stats["executor"],
         recall_at_10_incremental=round(index_recall(store, inc_version, lake, queries), 4),
         recall_at_10_rewrite=round(index_recall(store, rewrite_version, lake, queries), 4),
         targets="after 1% changed: <= 5% of a full build's bytes, <= 10% of its time")  # fmt: skip


def bench_kmeans(x: np.ndarray, nlist: int, iters: int, partitions: int) -> np.ndarray:
    parts = np.array_split(x, partitions)
    with PeakRSS() as ours_mem:
        t0 = time.perf_counter()
        data = RayData([(lambda p=p: p) for p in parts])
        result = train_kmeans(data, nlist, iterations=iters, tol=0.0, seed=1, progress=False)
        ours = time.perf_counter() - t0
        data.close()
    with PeakRSS() as ref_mem:
        t0 = time.perf_counter()
        ref = faiss.Kmeans(x.shape[1], nlist, niter=iters, seed=1, max_points_per_centroid=10**9)
        ref.train(x)
        base = time.perf_counter() - t0
    ref_obj = partial_sums(x, ref.centroids).objective
    emit(bench="kmeans", n=len(x), dim=x.shape[1], nlist=nlist, iterations=iters, partitions=partitions,
         ray_s=round(ours, 2), faiss_s=round(base, 2), time_ratio=round(ours / base, 3),
         ray_peak_rss_mb=round(ours_mem.peak / 2**20), faiss_peak_rss_mb=round(ref_mem.peak / 2**20),
         objective_ratio=round(result.objective / ref_obj, 4), targets="time <= 1.3x, objective within 1%")  # fmt: skip
    return result.centroids


def bench_recall(x: np.ndarray, centroids: np.ndarray, queries: np.ndarray, work: Path, nprobes: list[int]) -> None:
    store = LocalStore(str(work / "index"))
    _, labels = nearest(x, centroids)
    counts = np.bincount(labels, minlength=len(centroids))
    ranges = plan_shards(counts, x.shape[1], 64 << 20)
    rows = pa.table({"chunk_id": [str(i) for i in range(len(x))]})
    sink = __import__("io").BytesIO()
    np.save(sink, centroids)
    cref = put_file(store, "builds/bench/centroids.npy", sink.getvalue())
    shards = []
    for start, end in ranges:
        sel = np.flatnonzero((labels >= start) & (labels < end))
        shards.append(build_shard(store.root, ObjectStoreSettings(), "builds/bench", start, end, len(centroids),
                                  x.shape[1], None, (x[sel], labels[sel], rows.take(pa.array(sel)))))  # fmt: skip
    publish(store, Manifest(0, "bench", "", "synthetic", 0, "synthetic", x.shape[1], "l2", len(centroids), len(x),
                            cref, shards))  # fmt: skip
    reader = IndexReader(store)
    for i in range(len(shards)):
        reader.shard(i)  # warm: fetching is measured by the retrieval benchmarks, not here

    truth = exact_top10(x, queries)
    quantizer = faiss.IndexFlatL2(x.shape[1])
    quantizer.add(centroids)
    ivf = faiss.IndexIVFFlat(quantizer, x.shape[1], len(centroids))
    ivf.is_trained = True
    ivf.add(x)
    for nprobe in nprobes:
        t0 = time.perf_counter()
        hits = reader.search(queries, 10, nprobe)
        ours = time.perf_counter() - t0
        found = [[int(r["chunk_id"]) for r in reader.rows(row, ["chunk_id"])] for row in hits]
        ours_recall = recall(found, truth)
        ivf.nprobe = nprobe
        t0 = time.perf_counter()
        _, ref_ids = ivf.search(queries, 10)
        base = time.perf_counter() - t0
        ref_recall = recall(ref_ids.tolist(), truth)
        emit(bench="ivf_recall", n=len(x), nlist=len(centroids), nprobe=nprobe, queries=len(queries),
             recall_at_10=round(ours_recall, 4), qps=round(len(queries) / ours, 1),
             faiss_recall_at_10=round(ref_recall, 4), faiss_qps=round(len(queries) / base, 1),
             overhead=round(ours / base, 2))  # fmt: skip


def bench_two_level(x: np.ndarray, flat: np.ndarray, queries: np.ndarray, iters: int, nprobes: list[int]) -> None:
    """The build's two-level k-means (bounded sample + refinement) against flat k-means over
    all vectors (``flat``): objective over all vectors, and recall@10 of an IVF index on
    each set of centroids at each nprobe (both assign exactly; the service's default nprobe
    is marked)."""
    truth = exact_top10(x, queries)

    quantizers = []  # the IVF indexes borrow them

    def ivf_on(c: np.ndarray) -> faiss.IndexIVFFlat:
        quantizers.append(faiss.IndexFlatL2(x.shape[1]))
        quantizers[-1].add(c)
        ivf = faiss.IndexIVFFlat(quantizers[-1], x.shape[1], len(c))
        ivf.is_trained = True
        ivf.add(x)
        return ivf

    reference = ivf_on(flat)
    flat_objective = partial_sums(x, flat).objective
    for refine in (0, 1):
        stats: dict[str, object] = {}
        t0 = time.perf_counter()
        opts = BuildOptions(len(flat), iters, progress=False, refine=refine)
        two = train_centroids(LocalPartitions([lambda: x]), len(flat), opts, stats).centroids
        seconds = time.perf_counter() - t0
        ours = ivf_on(two)
        objective_ratio = partial_sums(x, two).objective / flat_objective
        for nprobe in nprobes:
            got = {}
            for name, ivf in (("two", ours), ("flat", reference)):
                ivf.nprobe = nprobe
                got[name] = recall(ivf.search(queries, 10)[1].tolist(), truth)
            emit(bench="two_level_recall", n=len(x), nlist=len(flat), refine=refine, nprobe=nprobe,
                 default_nprobe=nprobe == default_nprobe(len(flat)), recall_at_10=round(got["two"], 4),
                 flat_kmeans_recall_at_10=round(got["flat"], 4), recall_delta=round(got["two"] - got["flat"], 4),
                 objective_ratio=round(objective_ratio, 4), two_level_train_s=round(seconds, 2),
                 kmeans_sample=stats.get("kmeans_sample"), target="recall within 0.01 of flat k-means")  # fmt: skip


def bench_gpu(n: int, d: int, nlist: int, iters: int) -> None:
    if faiss.get_num_gpus() == 0:
        emit(bench="kmeans_gpu", skipped="no GPU visible to faiss (install faiss-gpu on a CUDA machine)")
        return
    x = synthetic(n, d, 4 * nlist, seed=3)
    timings = {}
    for name, gpu in (("gpu", True), ("cpu", False)):
        t0 = time.perf_counter()
        km = faiss.Kmeans(d, nlist, niter=iters, seed=1, gpu=gpu, max_points_per_centroid=10**9)
        km.train(x)
        timings[name] = time.perf_counter() - t0
    emit(bench="kmeans_gpu", n=n, dim=d, nlist=nlist, iterations=iters, gpu_s=round(timings["gpu"], 2),
         cpu_s=round(timings["cpu"], 2), speedup=round(timings["cpu"] / timings["gpu"], 1))  # fmt: skip


def real_queries(corpus: EmbeddedCorpus, n: int) -> np.ndarray:
    """Section titles of the docs (FAQ questions among them) as queries, embedded."""
    titles = sorted({t for d in load_pydocs() for t in section_titles(d.body)})
    rng = np.random.default_rng(1)
    chosen = [titles[i] for i in rng.choice(len(titles), min(n, len(titles)), replace=False)]
    return corpus.embedder.embed(chosen)


def synthetic_texts(n: int, seed: int = 0, vocabulary: int = 50_000, words: int = 150) -> list[str]:
    """Chunks of Zipf-distributed words (a natural vocabulary's long tail)."""
    rng = np.random.default_rng(seed)
    ids = np.minimum(rng.zipf(1.2, size=n * words), vocabulary) - 1
    lexicon = np.array([f"w{i}" for i in range(vocabulary)])
    return [" ".join(row) for row in lexicon[ids].reshape(n, words)]


def bench_keyword(n: int, work: Path) -> None:
    from indexing.keyword import WRITER_HEAP, KeywordIndex, build_keyword_index, document
    from indexing.manifest import ShardRef

    store = LocalStore(str(work / "kw-store"))
    shards, texts_all, chunk_ids_all = [], [], []
    for s, start in enumerate(range(0, n, 40_000)):
        texts = synthetic_texts(min(40_000, n - start), seed=s)
        texts_all.append(texts)
        chunk_ids = [hashlib.sha256(f"{start + i}".encode()).hexdigest()[:32] for i in range(len(texts))]
        ids = pa.table({"title": ["t"] * len(texts), "text": texts, "acl": [[] for _ in texts],
                        "chunk_id": chunk_ids, "faiss_id": np.arange(len(texts), dtype=np.int64)})  # fmt: skip
        chunk_ids_all.append(chunk_ids)
        sink = pa.BufferOutputStream()
        pq.write_table(ids, sink, compression="zstd")
        ref = put_file(store, f"shard-{s}.ids.parquet", sink.getvalue().to_pybytes())
        shards.append(ShardRef(ref, ref, 0, 1, len(texts)))
    harness = psutil.Process().memory_info().rss  # the generated texts
    with PeakRSS() as mem:
        t = time.perf_counter()
        refs, stats = build_keyword_index(store, "builds/bench", shards)
        ours = time.perf_counter() - t
    t = time.perf_counter()
    plain = KeywordIndex(work / "kw-plain", create=True)
    writer = plain.index.writer(heap_size=WRITER_HEAP * 2, num_threads=2)
    for s, texts in enumerate(texts_all):
        for i, text in enumerate(texts):
            writer.add_document(document(s << 32 | i, "t", text, None, chunk_ids_all[s][i]))
    writer.commit()
    writer.wait_merging_threads()
    raw = time.perf_counter() - t
    per_million = 1_000_000 / n
    emit(bench="keyword_index_build", chunks=n, seconds=round(ours, 1), bytes=stats["bytes"],
         seconds_per_million=round(ours * per_million, 1), mb_per_million=round(stats["bytes"] * per_million / 2**20),
         harness_rss_mb=round(harness / 2**20), peak_rss_mb=round(mem.peak / 2**20), files=len(refs),
         baseline="the same documents added to tantivy from Python lists",
         baseline_seconds=round(raw, 1), vs_baseline=round(ours / raw, 2))  # fmt: skip


def bench_peer(x: np.ndarray, queries: np.ndarray, nlist: int, iters: int, python: Path, work: Path) -> None:
    if not python.exists():
        emit(bench="lancedb", skipped=f"{python} not found: `make bench` creates the peers' environment")
        return
    np.save(work / "vectors.npy", x)
    np.save(work / "queries.npy", queries)
    np.save(work / "truth.npy", exact_top10(x, queries))
    out = subprocess.run(
        [str(python), str(Path(__file__).with_name("peer_lancedb.py")), str(work), "--nlist", str(nlist),
         "--iterations", str(iters), "--label", TAGS["corpus"]],
        capture_output=True, text=True, env={**os.environ, "LANCE_LOG": "error"},
    )  # fmt: skip
    for line in out.stdout.splitlines():
        print(line, flush=True)
    if out.returncode != 0:
        emit(bench="lancedb", error=out.stderr[-2000:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sections_all = ["build", "incremental", "scale", "kmeans", "recall", "peer", "gpu", "keyword"]
    parser.add_argument("--only", choices=sections_all, action="append")
    parser.add_argument("--changed", type=float, default=0.01, help="incremental: share of the chunks changed")
    parser.add_argument("--corpus", choices=["synthetic", "pydocs"], default="synthetic")
    parser.add_argument("--n", type=int, default=200_000, help="synthetic vectors")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--nlist", type=int, help="default: about 4*sqrt(n)")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--partitions", type=int, default=os.cpu_count() or 2)
    parser.add_argument(
        "--executor", choices=["local", "ray"], nargs="+", default=["local", "ray"], help="build: which executors"
    )
    parser.add_argument("--queries", type=int, default=500)
    parser.add_argument("--nprobe", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128])
    parser.add_argument("--gpu-n", type=int, default=10_000_000)
    parser.add_argument("--peer-python", type=Path, default=ROOT / ".venv-peers" / "bin" / "python")
    args = parser.parse_args()
    sections = set(args.only or ["build", "incremental", "kmeans", "recall", "peer", "gpu"])  # not "scale"
    TAGS["corpus"] = args.corpus
    with tempfile.TemporaryDirectory(prefix="streamrag-ibench-") as tmp:
        work = Path(tmp)
        if "scale" in sections:  # its own lake, written in blocks: run it alone (--only scale --n 5000000)
            bench_scale(args.n, args.dim, args.nlist or choose_nlist(args.n), args.iterations, work, args.executor)
            sections.discard("scale")
        if "keyword" in sections:  # texts, not vectors: run it alone (--only keyword --n 1000000)
            bench_keyword(args.n, work)
            sections.discard("keyword")
        if sections - {"gpu"}:
            if args.corpus == "pydocs":
                corpus = embedded_pydocs()
                x = corpus.vectors
                queries = real_queries(corpus, args.queries)
            else:
                x = synthetic(args.n, args.dim, topics=4 * choose_nlist(args.n), seed=0)
                rng = np.random.default_rng(1)
                q = x[rng.choice(len(x), args.queries, replace=False)]
                q = q + rng.standard_normal(q.shape).astype(np.float32) * 0.05
                queries = np.ascontiguousarray(q / np.linalg.norm(q, axis=1, keepdims=True), dtype=np.float32)
            nlist = args.nlist or choose_nlist(len(x))
            if "build" in sections:
                bench_build(x, nlist, args.iterations, work, args.executor, queries)
            if "incremental" in sections:
                bench_incremental(x, nlist, args.iterations, work, queries, args.changed)
            if sections & {"kmeans", "recall"}:
                start_ray(work_dir=work / "ray")
                centroids = bench_kmeans(x, nlist, args.iterations, args.partitions)
                if "recall" in sections:
                    bench_recall(x, centroids, queries, work, args.nprobe)
                    nprobes = sorted({*args.nprobe, default_nprobe(nlist)})
                    bench_two_level(x, centroids, queries, args.iterations, nprobes)
            if "peer" in sections:
                bench_peer(x, queries, nlist, args.iterations, args.peer_python, work)
        if "gpu" in sections:
            bench_gpu(args.gpu_n, args.dim, 4096, args.iterations)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
