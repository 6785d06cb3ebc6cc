"""Retrieval benchmarks: one JSON line per figure, each against a baseline measured in the same run.

    .venv/bin/python benchmarks/retrieval.py                        # all sections
    .venv/bin/python benchmarks/retrieval.py --only search --n 1000000

Sections
- search: the engine in-process (coarse probe, shard scans with filters, tail, lineage
  rows) on --n synthetic vectors built by the real builder, one query at a time: p50/p99
  latency and queries/s with recall@10 vs exact at each nprobe, vs a single faiss
  IndexIVFFlat on the same centroids (overhead ratio; target <= 1.5x) and vs LanceDB's
  IVF_FLAT at the same nprobe (peer environment .venv-peers). Target: warm p99 <= 20 ms.
- cold: a service starting against the index in S3 (moto server on loopback) with an
  empty cache: time to ready, first-query latency (target <= 1 s), then warm latency.
- http: ``streamrag serve`` on the Python docs (real embeddings, real queries) with 1 and 8
  concurrent loopback clients, each mode: requests/s, p50/p99; queries repeated (served
  from the query-embedding cache) and distinct (each embedded). Target: hybrid p99 <= 1.3x
  dense. Baseline in the same run: repeated queries served with ``--search-on-workers``
  (every search handed to a worker thread, as before searches ran on the event loop).
- freshness: ``streamrag ingest`` and ``streamrag serve`` as users run them; documents
  updated at a steady rate: produce → the new text returned by /v1/search (p50/p95/p99),
  delete → gone; and /v1/search p99 while a bulk load ingests vs idle. With
  ``--fresh-source postgres`` the changes are SQL statements in a local Postgres that
  ``streamrag cdc postgres`` publishes: COMMIT → visible (target p95 <= 0.5 s).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import faiss
import httpx
import numpy as np
import pyarrow as pa
from confluent_kafka import Producer

from benchmarks.index import TAGS, bench_peer, emit, recall, synthetic, write_lake
from benchmarks.pydocs import embedded_pydocs
from indexing.distributed import start_ray
from indexing.ivf import BuildOptions, build_index, choose_nlist
from indexing.manifest import publish
from indexing.snapshot import plan
from indexing.store import LocalStore, S3Store
from pipelines.broker import ensure_topics, free_port, start_broker
from pipelines.context import DEFAULT_WEIGHT, contextual_documents, model_with_context
from pipelines.envelopes import envelope as debezium_envelope
from pipelines.envelopes import message
from pipelines.lake import CHUNKS, Lake
from pipelines.lake_writer import LakeWriter
from pipelines.storage import ObjectStoreSettings
from retrieval.acl import ANONYMOUS
from retrieval.cache import ShardCache
from retrieval.corpus import load_pydocs, section_titles
from retrieval.engine import SearchEngine
from retrieval.views import EngineOptions
from serving.embedder import Embedder, ModelIdentity
from tests.indexing.lakes import chunk_rows

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "retrieval.cli"]


class VectorsOnly(Embedder):
    """Stands in for the model of a synthetic lake: the benchmark passes vectors, not text."""

    def __init__(self, identity: str) -> None:
        super().__init__()
        self._identity = ModelIdentity.parse(identity)

    @property
    def identity(self) -> ModelIdentity:
        return self._identity

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return [1] * len(texts)

    def embed_batch(self, texts: Sequence[str]) -> np.ndarray:
        raise NotImplementedError("synthetic benchmark: search by vector")


def percentiles(seconds: list[float]) -> dict[str, float]:
    ms = np.array(seconds) * 1000
    return {"p50_ms": round(float(np.percentile(ms, 50)), 2), "p99_ms": round(float(np.percentile(ms, 99)), 2)}


def synthetic_index(n: int, work: Path, queries: int) -> tuple[np.ndarray, np.ndarray, Path, Lake]:
    x = synthetic(n, 384, topics=4 * choose_nlist(n), seed=0)
    rng = np.random.default_rng(1)
    q = x[rng.choice(len(x), queries, replace=False)]
    q = q + rng.standard_normal(q.shape).astype(np.float32) * 0.05
    q = np.ascontiguousarray(q / np.linalg.norm(q, axis=1, keepdims=True), dtype=np.float32)
    lake = write_lake(x, str(work / "lake"))
    store = LocalStore(str(work / "index"))
    publish(
        store, build_index(plan(lake), store.root, ObjectStoreSettings(), BuildOptions(iterations=10, progress=False))
    )
    return x, q, work / "index", lake


def bench_search(x: np.ndarray, queries: np.ndarray, index: Path, lake: Lake, work: Path, peer: Path) -> None:
    store = LocalStore(str(index))
    engine = SearchEngine(lake, store, VectorsOnly(plan(lake).model), ShardCache(None, memory_bytes=16 << 30))
    engine.start(background=False)
    view = engine.current_view()
    reader = view.reader
    reader.shards(range(len(reader.manifest.shards)))  # warm: cold start is its own section
    exact = faiss.IndexFlatL2(x.shape[1])
    exact.add(x)
    _, truth = exact.search(queries, 10)
    ivf = faiss.IndexIVFFlat(faiss.IndexFlatL2(x.shape[1]), x.shape[1], reader.manifest.nlist)
    ivf.quantizer.add(reader.centroids)
    ivf.is_trained = True
    ivf.add(x)
    for nprobe in (8, 16, 32, 64, 128):
        engine.options = EngineOptions(nprobe=nprobe)
        ours, found = [], []
        for q in queries:
            t0 = time.perf_counter()
            result = engine.search_vector(view, q, 10, ANONYMOUS)
            ours.append(time.perf_counter() - t0)
            found.append([int(r["chunk_id"][1:]) for r in result.results])
        ivf.nprobe = nprobe
        base, base_found = [], []
        for q in queries:
            t0 = time.perf_counter()
            _, ids = ivf.search(q[None, :], 10)
            base.append(time.perf_counter() - t0)
            base_found.append(ids[0].tolist())
        emit(bench="search_inprocess", n=len(x), nlist=reader.manifest.nlist, nprobe=nprobe, queries=len(queries),
             recall_at_10=round(recall(found, truth), 4), qps=round(len(ours) / sum(ours), 1), **percentiles(ours),
             faiss_recall_at_10=round(recall(base_found, truth), 4), faiss_qps=round(len(base) / sum(base), 1),
             faiss=percentiles(base), overhead=round(statistics.median(ours) / statistics.median(base), 2),
             targets="recall@10 >= 0.95, overhead <= 1.5x, warm p99 <= 20 ms")  # fmt: skip
    bench_peer(x, queries, reader.manifest.nlist, 10, peer, work)


def start_moto(work: Path) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    port = free_port()
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(env["AWS_ENDPOINT_URL"], timeout=1)
            break
        except httpx.TransportError:
            time.sleep(0.2)
    return proc, env


def bench_cold(index: Path, lake: Lake, queries: np.ndarray, work: Path) -> None:
    import boto3

    proc, env = start_moto(work)
    try:
        os.environ.update(env)
        settings = ObjectStoreSettings.from_env(env)
        boto3.client("s3").create_bucket(Bucket="bench")
        s3 = S3Store("s3://bench/index", settings)
        local = LocalStore(str(index))
        t0 = time.perf_counter()
        uploaded = 0
        for key in local.list():
            data = local.get(key)
            s3.put(key, data)
            uploaded += len(data)
        upload_s = time.perf_counter() - t0
        cache_dir = work / "cold-cache"
        t0 = time.perf_counter()
        engine = SearchEngine(lake, s3, VectorsOnly(plan(lake).model), ShardCache(cache_dir, 8 << 30))
        engine.start(background=False)
        ready = time.perf_counter() - t0
        view = engine.current_view()
        t0 = time.perf_counter()
        engine.search_vector(view, queries[0], 10, ANONYMOUS)
        first = time.perf_counter() - t0
        firsts = []
        for q in queries[1:21]:  # the next queries, shards still partly cold
            t0 = time.perf_counter()
            engine.search_vector(view, q, 10, ANONYMOUS)
            firsts.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        view.reader.shards(range(len(view.reader.manifest.shards)))
        prefetch = time.perf_counter() - t0
        warm = []
        for q in queries:
            t0 = time.perf_counter()
            engine.search_vector(view, q, 10, ANONYMOUS)
            warm.append(time.perf_counter() - t0)
        emit(bench="cold_start_s3", n=view.reader.manifest.count, shards=len(view.reader.manifest.shards),
             index_mb=round(uploaded / 2**20), upload_s=round(upload_s, 1), ready_s=round(ready, 3),
             first_query_s=round(first, 3), next_20=percentiles(firsts), prefetch_all_s=round(prefetch, 2),
             warm=percentiles(warm), targets="first query <= 1 s, warm p99 <= 20 ms")  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(30)


def pydocs_lake(work: Path, prefix: str = "", context_weight: float = DEFAULT_WEIGHT) -> tuple[Lake, Path, list[str]]:
    """The Python docs (ids starting with ``prefix``) as a lake of real embedded chunks, and its
    index; each chunk's vector mixed with its neighbours' as the ingest job's
    ``--context-weight`` mixes them (``pipelines.context``; its default unless given)."""
    corpus = embedded_pydocs(prefix=prefix)
    vectors = contextual_documents(corpus.vectors, corpus.doc_ids, context_weight)
    model = model_with_context(corpus.model, context_weight)
    lake = Lake.at(str(work / "pydocs-lake"))
    lake.ensure_tables(1)
    writer = LakeWriter(lake, CHUNKS, "bench", None)
    doc_titles = {d.id: d.title for d in load_pydocs()}  # every chunk carries its document's title, as ingested
    for part in np.array_split(np.arange(len(corpus.texts)), 8):
        rows = chunk_rows(vectors[part], start=int(part[0]), model=model)
        texts = pa.array([corpus.texts[i] for i in part])
        rows = rows.set_column(rows.schema.get_field_index("text"), "text", texts)
        title = pa.array([doc_titles[corpus.doc_ids[i]] for i in part])
        rows = rows.set_column(rows.schema.get_field_index("title"), "title", title)
        docs = pa.array([f"pydocs/{corpus.doc_ids[i]}" for i in part])
        writer.write(rows.set_column(rows.schema.get_field_index("doc_id"), "doc_id", docs))
    store = LocalStore(str(work / "pydocs-index"))
    publish(store, build_index(plan(lake), store.root, ObjectStoreSettings(), BuildOptions(progress=False)))
    titles = sorted({t for d in load_pydocs() for t in section_titles(d.body)})
    rng = random.Random(2)
    return lake, work / "pydocs-index", rng.sample(titles, 400)


def serve(lake: str, index: str, work: Path, *extra: str, answers: bool = False) -> tuple[subprocess.Popen[bytes], str]:
    """``streamrag serve`` in its own process group; search only unless ``answers``."""
    port = free_port()
    if not answers:
        extra = (*extra, "--no-answers")
    log = (work / f"serve-{port}.log").open("wb")
    proc = subprocess.Popen([*CLI, "serve", "--lake", lake, "--index", index, "--port", str(port),
                             "--cache-dir", str(work / f"cache-{port}"), *extra],
                            stdout=log, stderr=log, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, work / f"serve-{port}.log", "serve", lambda: httpx.get(f"{url}/healthz", timeout=2))
    return proc, url


def wait_ready(
    proc: subprocess.Popen[bytes], log: Path, name: str, probe: Callable[[], httpx.Response], poll_s: float = 0.3
) -> None:
    """Wait (up to 300 s) until ``probe`` answers 200; fail with the log's tail if ``proc`` exits."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited: {log.read_text()[-2000:]}")
        try:
            if probe().status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(poll_s)
    raise RuntimeError(f"{name} did not become ready")


def load(
    url: str,
    queries: list[str],
    clients: int,
    seconds: float,
    mode: str | None = None,
    distinct: Iterator[str] | None = None,
) -> tuple[list[float], int]:
    """Clients searching for ``seconds``: each request a random one of ``queries`` or, given
    ``distinct``, its next query (never repeated, so never in the service's query-embedding
    cache; the phase ends early when they run out, and the next phase goes on from there)."""
    latencies: list[float] = []
    errors = 0
    stop = time.monotonic() + seconds
    lock = threading.Lock()

    def client(i: int) -> None:
        nonlocal errors
        rng = random.Random(i)
        with httpx.Client(timeout=30) as http:
            while time.monotonic() < stop:
                with lock:
                    query = next(distinct, None) if distinct is not None else rng.choice(queries)
                if query is None:
                    return
                t0 = time.perf_counter()
                body = {"query": query, "k": 10, **({"mode": mode} if mode else {})}
                r = http.post(f"{url}/v1/search", json=body)
                dt = time.perf_counter() - t0
                with lock:
                    latencies.append(dt)
                    errors += r.status_code != 200

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    return latencies, errors


def bench_http(work: Path, seconds: float) -> None:
    """/v1/search by mode, at 1 and 8 clients: ``repeated`` queries (400 section titles, each
    embedded once and then served from the query-embedding cache: the search's own cost) and
    ``distinct`` ones (the first ten words of a chunk, each asked once: every request embeds
    its query, as a new question does); then repeated queries, dense and hybrid, served by a
    second service with ``--search-on-workers`` (the baseline: ``threads="workers"``)."""
    lake, index, queries = pydocs_lake(work)
    texts = embedded_pydocs().texts
    titles = set(queries)
    fresh = [q for q in dict.fromkeys(" ".join(t.split()[:10]) for t in texts) if q.strip() and q not in titles]
    random.Random(3).shuffle(fresh)
    unasked = iter(fresh)
    chunks = plan(lake).count

    def phase(url: str, kind: str, clients: int, mode: str, loop_p99: float | None = None) -> float:
        """One load phase, printed; its p99 (``loop_p99``: a workers baseline's, compared with it)."""
        latencies, errors = load(url, queries, clients, seconds, mode, unasked if kind == "distinct" else None)
        shown = percentiles(latencies)
        baseline = (
            {}
            if loop_p99 is None
            else {"threads": "workers", "event_loop_p99_vs_workers": round(loop_p99 / shown["p99_ms"], 3)}
        )
        emit(bench="http_search", corpus="pydocs", chunks=chunks, queries=kind, clients=clients, mode=mode,
             seconds=seconds, requests=len(latencies), errors=errors, rps=round(len(latencies) / seconds, 1),
             **shown, **baseline)  # fmt: skip
        return shown["p99_ms"]

    on_loop: dict[int, dict[str, float]] = {}  # clients → mode → p99 ms, repeated queries
    proc, url = serve(lake.uri, str(index), work)
    try:
        for mode in ("dense", "hybrid", "keyword"):  # warm-up: shards, keyword files, every code path
            load(url, queries, 2, 5, mode)
        for kind in ("repeated", "distinct"):
            for clients in (1, 8):
                p99 = {mode: phase(url, kind, clients, mode) for mode in ("dense", "hybrid", "keyword")}
                emit(bench="http_search_hybrid_vs_dense", queries=kind, clients=clients,
                     p99_ratio=round(p99["hybrid"] / p99["dense"], 3), target_p99_ratio=1.3)  # fmt: skip
                if kind == "repeated":
                    on_loop[clients] = p99
    finally:
        os.killpg(proc.pid, 9)
    proc, url = serve(lake.uri, str(index), work, "--search-on-workers")
    try:
        for mode in ("dense", "hybrid"):
            load(url, queries, 2, 5, mode)
        for clients in (1, 8):
            for mode in ("dense", "hybrid"):
                phase(url, "repeated", clients, mode, on_loop[clients][mode])
    finally:
        os.killpg(proc.pid, 9)


def scrape(url: str) -> dict[str, float]:
    """Prometheus samples at ``url`` by name: unlabelled ones, the chunks table's, and those
    labelled by stage (as ``name|stage``); a histogram's buckets as ``name_bucket[|stage]|le``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=10).text
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            le = labels.pop("le", None)
            suffix = "" if le is None else f"|{le}"
            if labels in ({}, {"table": "chunks"}):
                found[sample.name + suffix] = sample.value
            elif set(labels) == {"stage"}:
                found[f"{sample.name}|{labels['stage']}{suffix}"] = sample.value
    return found


def bucket_quantile(before: dict[str, float], after: dict[str, float], prefix: str, q: float) -> float | None:
    """Milliseconds below which ``q`` of the observations between two scrapes fall, interpolated
    within a histogram's buckets (as Prometheus's ``histogram_quantile``): coarse, but it shows
    which stage has the long tail. ``prefix``: ``name_bucket`` or ``name_bucket|stage``."""
    edges = sorted((float(key.rsplit("|", 1)[1]), after[key] - before.get(key, 0.0))
                   for key in after if key.rsplit("|", 1)[0] == prefix)  # fmt: skip
    if not edges or edges[-1][1] <= 0:
        return None
    rank, low, below = q * edges[-1][1], 0.0, 0.0
    for edge, count in edges:
        if count >= rank:
            if math.isinf(edge):
                return round(low * 1000, 1)  # past the last finite bucket: its edge is all we know
            return round((low + (edge - low) * (rank - below) / max(count - below, 1e-9)) * 1000, 1)
        low, below = edge, count
    return None


#: the stages of a change's way to search: (histogram, stage label) by the name printed
STAGES = {
    "produce_to_commit_ms": ("streamrag_ingest_event_to_commit_seconds", ""),
    "produce_to_read_ms": ("streamrag_ingest_fetch_delay_seconds", ""),
    "embed_batch_ms": ("streamrag_ingest_embed_seconds", ""),
    "commit_batch_ms": ("streamrag_ingest_commit_seconds", ""),
    "commit_to_notice_ms": ("streamrag_commit_notice_delay_seconds", ""),
    "notice_to_visible_ms": ("streamrag_tail_stage_seconds", "notice_to_visible"),
    "tail_read_ms": ("streamrag_tail_stage_seconds", "read"),
    "tail_follow_ms": ("streamrag_tail_stage_seconds", "follow"),
}


def stage_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Mean milliseconds per stage between two scrapes of the ingest job and the service."""

    def mean(name: str, stage: str) -> float | None:
        count, total = f"{name}_count", f"{name}_sum"
        if stage:
            count, total = f"{count}|{stage}", f"{total}|{stage}"
        n = after.get(count, 0) - before.get(count, 0)
        return round((after[total] - before.get(total, 0)) / n * 1000, 1) if n else None

    return {shown: mean(name, stage) for shown, (name, stage) in STAGES.items()}


def stage_p95s(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Each stage's p95 in milliseconds between two scrapes, from its histogram's buckets."""
    return {
        shown: bucket_quantile(before, after, f"{name}_bucket" + (f"|{stage}" if stage else ""), 0.95)
        for shown, (name, stage) in STAGES.items()
    }


def envelope(pk: int, body: str | None, lsn: int, before: str | None = None) -> tuple[bytes, bytes]:
    """(key, value) of a change as Debezium writes it with schemas on (Kafka Connect's default)
    and REPLICA IDENTITY FULL (``before`` is the old row): what Pathway's connector needs."""

    def row(text: str | None) -> dict[str, object] | None:
        return None if text is None else {"id": pk, "title": f"Note {pk}", "body": text, "acl": []}

    op = "d" if body is None else "u" if before is not None else "c"
    value = debezium_envelope(op, row(body), row(before), lsn=lsn, wrapped=True)
    key, raw = message({"schema": {"type": "struct", "name": "key"}, "payload": {"id": pk}}, value)
    assert raw is not None
    return key, raw


@dataclass
class Target:
    """A search service under test and how to read its results: (note number, text) per hit."""

    name: str
    url: str
    route: str
    hits: Callable[[dict[str, Any] | list[Any]], list[tuple[int, str]]]

    def search(self, http: httpx.Client, query: str, k: int) -> list[tuple[int, str]]:
        r = http.post(f"{self.url}{self.route}", json={"query": query, "k": k})
        r.raise_for_status()
        return self.hits(r.json())


@dataclass
class Searches:
    """One searching client's latencies (s, as the client saw them) and, where the service
    reports it, each search's own time (ms); filled when its ``searching`` block ends."""

    client: list[float] = field(default_factory=list)
    server_ms: list[float] = field(default_factory=list)


@contextlib.contextmanager
def searching(target: Target, queries: list[str], seed: int) -> Iterator[Searches]:
    """One client searching ``target`` in a loop for the duration of the block, in a process of
    its own (``benchmarks/search_client.py``: not behind this process's GIL)."""
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.search_client", target.url, target.route,
                             "--seed", str(seed), "--k", "10"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(queries) + "\n")
    proc.stdin.flush()
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the search client did not start (exit {proc.wait()})")
    found = Searches()
    try:
        yield found
    finally:
        out, _ = proc.communicate(timeout=60)  # closes its stdin: it stops, and reports
    if proc.returncode != 0:
        raise RuntimeError(f"the search client failed (exit {proc.returncode}); see its stderr above")
    report = json.loads(out)
    found.client, found.server_ms = report["latencies_s"], report["server_ms"]


def server_percentiles(ms: list[float]) -> dict[str, float] | None:
    """p50/p99 of the times a service reported for its searches (None if it reports none)."""
    return percentiles([x / 1000 for x in ms]) if ms else None


def streamrag_target(url: str) -> Target:
    return Target("streamrag", url, "/v1/search",
                  lambda body: [(int(x["doc_id"].rsplit("/", 1)[1]), x["text"]) for x in body["results"]])  # type: ignore[call-overload,index]  # fmt: skip


def pathway_target(url: str) -> Target:
    return Target("pathway", url, "/v1/retrieve",
                  lambda body: [(int(x["metadata"]["title"].split()[-1]), x["text"]) for x in body])  # type: ignore[index,union-attr]  # fmt: skip


def start_pathway(
    bootstrap: str, topic: str, work: Path, python: Path, extra: list[str]
) -> tuple[subprocess.Popen[bytes], str]:
    """``benchmarks/peer_pathway.py`` in the peer environment, once it answers."""
    from serving.models import default_model_path

    port = free_port()
    log = (work / "pathway.log").open("wb")
    proc = subprocess.Popen([str(python), str(ROOT / "benchmarks" / "peer_pathway.py"), "--bootstrap", bootstrap,
                             "--topic", topic, "--port", str(port), "--model", str(default_model_path()), *extra],
                            stdout=log, stderr=log, cwd=work, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def answers() -> httpx.Response:
        return httpx.post(f"{url}/v1/retrieve", json={"query": "note", "k": 1}, timeout=5)

    wait_ready(proc, work / "pathway.log", "pathway", answers, poll_s=0.5)
    return proc, url


class Changes:
    """Produces changes to the notes and times how long a target takes to show each one."""

    def __init__(
        self, producer: Producer, topic: str, bodies: dict[int, str], rate: float, queries: list[str], db: Any = None
    ):
        self.producer, self.topic, self.bodies, self.rate, self.queries = producer, topic, bodies, rate, queries
        self.db = db  # a Postgres connection (autocommit): changes are SQL, published by the Postgres source
        self.lsn = 10_000
        self.lock = threading.Lock()
        self.local = threading.local()
        self.next_poll = 0.0  # the detection searches' shared pace (``--max-polls-per-s``)
        self.sent: dict[int, list[float]] = {}  # note → when each of its changes was acknowledged
        #: for timed changes never seen: seconds until the note's next change replaced them
        self.superseded: list[float] = []

    def send(self, pk: int, body: str | None) -> float:
        """Produce a change (``body`` None: delete); the monotonic time it was acknowledged (with
        a database: the time its SQL statement was sent, COMMIT included)."""
        if self.db is not None:
            return self.send_sql(pk, body)
        with self.lock:
            self.lsn += 1
            key, value = envelope(pk, body, self.lsn, self.bodies.get(pk))
            if body is None:
                self.bodies.pop(pk, None)
            else:
                self.bodies[pk] = body
            t0 = time.monotonic()
            self.producer.produce(self.topic, value, key)
            self.producer.flush(10)
            self.sent.setdefault(pk, []).append(t0)
        return t0

    def send_sql(self, pk: int, body: str | None) -> float:
        with self.lock:
            t0 = time.monotonic()
            with self.db.cursor() as cur:
                if body is None:
                    cur.execute("DELETE FROM docs WHERE id = %s", (pk,))
                    self.bodies.pop(pk, None)
                else:
                    cur.execute(
                        "INSERT INTO docs (id, title, body) VALUES (%s, %s, %s) "
                        "ON CONFLICT (id) DO UPDATE SET body = EXCLUDED.body",
                        (pk, f"Note {pk}", body),
                    )
                    self.bodies[pk] = body
            self.sent.setdefault(pk, []).append(t0)
        return t0

    def shows(self, target: Target, pk: int, text: str) -> bool:
        """The detection rule, the same for every system: the note with this text in the top 3."""
        if not hasattr(self.local, "http"):
            self.local.http = httpx.Client(timeout=30)
        if MAX_POLLS_PER_S:  # one pace for all changes in flight: the detection load cannot feed on lag
            with self.lock:
                at = max(time.monotonic(), self.next_poll)
                self.next_poll = at + 1 / MAX_POLLS_PER_S
            time.sleep(max(0.0, at - time.monotonic()))
        # Whitespace-insensitive: a document cut into several chunks has its whitespace runs collapsed.
        head = " ".join(text[:60].split())
        return any(
            found == pk and head in " ".join(hit.split()) for found, hit in target.search(self.local.http, text, 3)
        )

    def change(
        self, target: Target, pk: int, text: str | None, due: float, gone: str | None, timed: bool = True
    ) -> float | None:
        """One change at ``due``; seconds until ``target`` shows it (the new text, or ``gone``
        absent), or None for an untimed change (sent, not searched for)."""
        time.sleep(max(0.0, due - time.monotonic()))
        t0 = self.send(pk, text)
        if not timed:
            return None
        while self.shows(target, pk, gone) if gone is not None else not self.shows(target, pk, text or ""):
            if time.monotonic() - t0 > 60:
                later = [t for t in self.sent.get(pk, []) if t > t0]
                if later:  # a later change replaced it: only a lag past that gap could hide it
                    self.superseded.append(round(min(later) - t0, 1))
                log.warning("%s: change of note %s not visible after 60 s", target.name, pk)
                return math.inf  # counted as not visible, never dropped silently
            time.sleep(0.01)
        return time.monotonic() - t0

    def measure(
        self,
        target: Target,
        plan: list[tuple[int, str | None, str | None]],
        rate: float | None = None,
        timing: bool = True,
    ) -> tuple[list[float], Searches]:
        """(lags, search latencies of one client searching meanwhile) for changes made at
        ``rate``/s (the stream's rate by default); with ``timing`` off, no change is searched for."""
        rate = rate or self.rate
        every = timed_every(rate)
        start = time.monotonic() + 0.5
        with searching(target, self.queries, seed=5) as during, ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(self.change, target, pk, text, start + i / rate, gone, timing and i % every == 0)
                       for i, (pk, text, gone) in enumerate(plan)]  # fmt: skip
            lags = [lag for f in futures if (lag := f.result()) is not None]
        return lags, during

    def idle(self, target: Target, seconds: float) -> Searches:
        """Search latencies of one client with no changes flowing."""
        with searching(target, self.queries, seed=6) as latencies:
            time.sleep(seconds)
        return latencies

    def run(self, target: Target, updates: list[tuple[int, str]], deletes: list[int]) -> dict[str, Any]:
        """Idle search; search while updates flow, none of them timed; then timed updates and
        timed deletes: one system's figures.

        Search latency while updates flow is taken with no change being timed: timing a change
        searches for it every 10 ms, a load on the service that idle search does not carry,
        and that would be counted as the updates' cost (``search_during_timed_updates`` shows
        the latency with it).
        """
        self.idle(target, 5)  # warm-up (first queries, caches): not part of the idle figure
        idle = self.idle(target, 15)
        self.superseded = []
        # Texts of their own ("<tag> load revision …"): never what a timed change looks for.
        flow = [(pk, text.replace(" revision ", " load revision ", 1), None) for pk, text in updates]
        _, during = self.measure(target, flow[: round(self.rate * 15)], timing=False)  # 15 s of the stream
        time.sleep(2)
        lags, during_timed = self.measure(target, [(pk, text, None) for pk, text in updates])
        gone_plan: list[tuple[int, str | None, str | None]] = []
        for pk in deletes:
            text = self.bodies[pk]
            if self.shows(target, pk, text):  # (else not in its own top 3: not measurable)
                gone_plan.append((pk, None, text))
        gone, _ = self.measure(target, gone_plan, min(self.rate, TIMED_PER_S))  # few deletes: all timed

        def pct(values: list[float], q: float) -> int | None:
            return round(float(np.percentile(np.array(values) * 1000, q))) if values else None

        invisible = sum(1 for x in lags + gone if math.isinf(x))
        lags, gone = [x for x in lags if not math.isinf(x)], [x for x in gone if not math.isinf(x)]
        return dict(not_visible_after_60_s=invisible, superseded_after_s=self.superseded, updates=len(lags),
                    p50_ms=pct(lags, 50), p95_ms=pct(lags, 95), p99_ms=pct(lags, 99),
                    deletes=len(gone), delete_gone_p50_ms=pct(gone, 50), delete_gone_p95_ms=pct(gone, 95),
                    delete_gone_p99_ms=pct(gone, 99), search_idle=percentiles(idle.client),
                    search_during_updates=percentiles(during.client),
                    search_during_timed_updates=percentiles(during_timed.client),
                    search_p99_ratio=round(float(np.percentile(during.client, 99) / np.percentile(idle.client, 99)), 2),
                    search_server_idle=server_percentiles(idle.server_ms),
                    search_server_during_updates=server_percentiles(during.server_ms))  # fmt: skip


#: changes per second that the freshness benchmark times (faster streams time every n-th change)
TIMED_PER_S = 2.0


def timed_every(rate: float) -> int:
    """Timing a change means searching for it every 10 ms until it shows; on 2 cores that load
    alone saturates a server past ~2 timed changes/s. Faster streams time every n-th change,
    so that the detection load stays that of 2/s."""
    return max(1, math.ceil(rate / TIMED_PER_S))


#: detection searches per second across all changes in flight (None: each polls every 10 ms)
MAX_POLLS_PER_S: float | None = None

#: freshness: the service under test (ours, then Pathway) alone on CPU 1, the broker, our ingest
#: job and the client on CPU 0 (None: no pinning). On a 2-core machine this separates the
#: service's own per-commit work from the CPU that embedding and the client take from it.
PIN_SERVICE: bool = False


@contextlib.contextmanager
def service_cpus() -> Iterator[None]:
    """While it lasts, processes started from this thread run on the service's CPU (with
    ``PIN_SERVICE``; every thread they start inherits it)."""
    if not PIN_SERVICE:
        yield
        return
    os.sched_setaffinity(0, {1})
    try:
        yield
    finally:
        os.sched_setaffinity(0, {0})


#: both systems' librdkafka fetch.wait.max.ms: Tansu holds a fetch for its whole wait (docs/PITFALLS.md)
FETCH_WAIT_MS = 10


def bench_freshness(
    work: Path,
    updates: int,
    rate: float,
    store: str,
    peer: Path | None,
    cpu_threads: int | None = None,
    dtype: str | None = None,
    source: str = "kafka",
) -> None:
    moto = None
    lake, index = str(work / f"fresh-lake-{store}"), str(work / f"fresh-index-{store}")
    if store == "s3":
        import boto3

        moto, env = start_moto(work)
        os.environ.update(env)  # the ingest and serve processes inherit it
        boto3.client("s3").create_bucket(Bucket="fresh")
        lake, index = "s3://fresh/lake", "s3://fresh/index"
    try:
        _freshness(work, updates, rate, store, lake, index, peer, cpu_threads, dtype, source)
    finally:
        if moto is not None:
            moto.terminate()
            moto.wait(30)


def pathway_phase(
    changes: Changes,
    bootstrap: str,
    topic: str,
    work: Path,
    python: Path,
    updates: list[tuple[int, str]],
    deletes: list[int],
    procs: list[subprocess.Popen[bytes]],
    extra: list[str],
) -> dict[str, Any]:
    """Pathway on the same topic: once it has caught up with every change so far, the same plan."""
    with service_cpus():
        proc, url = start_pathway(bootstrap, topic, work, python, extra)
    procs.append(proc)
    target = pathway_target(url)
    last = sorted(changes.bodies)[-10:]  # the bulk load's last notes (both partitions, surely)
    deadline = time.monotonic() + 900
    with httpx.Client(timeout=300) as http:  # its API stalls while it embeds the backlog
        while True:
            try:
                if all(any(pk == n for pk, _ in target.search(http, changes.bodies[n], 3)) for n in last):
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("pathway did not catch up with the topic in 15 minutes")
            time.sleep(1)
    figures = changes.run(target, updates, deletes)
    figures.update(system="pathway 0.33 VectorStoreServer", commit_ms=100, args=extra)
    return figures


def _freshness(
    work: Path,
    updates: int,
    rate: float,
    store: str,
    lake: str,
    index: str,
    peer: Path | None,
    cpu_threads: int | None,
    dtype: str | None,
    source: str = "kafka",
) -> None:
    if PIN_SERVICE:  # this process, and the broker and ingest job it starts, on CPU 0
        os.sched_setaffinity(0, {0})
    docs = load_pydocs()
    rng = random.Random(4)
    paragraphs = [p for d in docs[:60] for p in d.body.split("\n\n") if 200 < len(p) < 600]
    port = free_port()
    broker = start_broker(port)
    bootstrap = f"127.0.0.1:{port}"
    n_docs, n_deletes = 200, 25  # the last 2 × n_deletes notes are deleted: half by each system's phase
    updatable = n_docs - 2 * n_deletes
    procs: list[subprocess.Popen[bytes]] = []
    cleanup: list[Callable[[], None]] = []
    try:
        topic = "cdc.app.public.docs"
        ensure_topics(bootstrap, [topic], partitions=2)
        producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
        queries = [paragraphs[i][:200] for i in range(40)]
        db = start_postgres_source(work, bootstrap, procs, cleanup) if source == "postgres" else None
        changes = Changes(producer, topic, {}, rate, queries, db)
        for pk in range(n_docs):  # unique text per note: each one is its own best match
            changes.send(pk, f"Note {pk} original text. " + paragraphs[pk % len(paragraphs)])
        threads = ["--cpu-threads", str(cpu_threads)] if cpu_threads else []
        embedder_args = [*threads, *(["--dtype", dtype] if dtype else [])]  # an int8 lake needs int8 queries too
        ingest = [*CLI, "ingest", "--bootstrap", bootstrap, "--topic", topic, "--lake", lake, *embedder_args,
                  "--recovery-dir", str(work / f"fresh-recovery-{store}"), "--batch-max-events", "16",
                  "--fetch-wait-ms", str(FETCH_WAIT_MS),
                  *os.environ.get("FRESH_EXTRA", "").split()]  # fmt: skip
        out = subprocess.run([*ingest, "--until-idle", "4"], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        out = subprocess.run([*CLI, "index", "build", "--lake", lake, "--index", index,
                              "--nlist", "8"], capture_output=True, text=True)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        metrics_port = free_port()
        log = (work / "ingest.log").open("wb")
        job = subprocess.Popen([*ingest, "--metrics-port", str(metrics_port)], stdout=log, stderr=log,
                               start_new_session=True)  # fmt: skip
        procs.append(job)
        # Commit notices from the ingest job (the lake is polled every 2 s as a fallback).
        with service_cpus():
            server, url = serve(lake, index, work, "--bootstrap", bootstrap, *embedder_args)
        procs.append(server)
        time.sleep(10)  # the ingest job's model load is not part of the lag

        def update_plan(tag: str) -> list[tuple[int, str]]:
            return [(pk, f"{tag} revision {i} of note {pk}. " + rng.choice(paragraphs))
                    for i, pk in ((i, i % updatable) for i in range(updates))]  # fmt: skip

        def scrape_both() -> dict[str, float]:
            # Both processes register both packages' metrics (zeros where unused): take each
            # metric from the process that observes it.
            service = scrape(f"{url}/metrics")
            job = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
            served = ("streamrag_commit_notice_delay", "streamrag_tail_stage")
            return {**job, **{k: v for k, v in service.items() if k.startswith(served)}}

        before = scrape_both()
        ours = changes.run(streamrag_target(url), update_plan("Ours"), list(range(updatable, updatable + n_deletes)))
        after = scrape_both()
        stages, stages_p95 = stage_means(before, after), stage_p95s(before, after)

        # Interactive queries while a bulk load ingests.
        idle, _ = load(url, queries, 1, 15)
        bulk = {pk: f"Bulk note {pk}. " + rng.choice(paragraphs) for pk in range(1000, 3000)}
        changes.bodies.update(bulk)
        if db is not None:
            from psycopg2.extras import execute_values

            with db.cursor() as cur:
                execute_values(cur, "INSERT INTO docs (id, title, body) VALUES %s",
                               [(pk, f"Note {pk}", text) for pk, text in bulk.items()])  # fmt: skip
        else:
            for pk, text in bulk.items():
                changes.lsn += 1
                key, value = envelope(pk, text, changes.lsn)
                producer.produce(topic, value, key)
                producer.poll(0)
            producer.flush(30)
        busy, errors = load(url, queries, 1, 15)
        emit(bench="search_during_bulk_load", lake=store, idle=percentiles(idle), during_bulk_load=percentiles(busy),
             errors=errors, p99_ratio=round(np.percentile(busy, 99) / np.percentile(idle, 99), 2))  # fmt: skip
        for proc in procs:
            os.killpg(proc.pid, 9)
        procs.clear()

        # The peer, alone on the machine as ours was, on the same broker, topic and notes.
        peer_figures: dict[str, Any] | str = "not run: no peer environment (make bench)"
        fetch_wait = {"fetch.wait.max.ms": str(FETCH_WAIT_MS)}  # the same Kafka client setting as ours
        if store != "local":
            peer_figures = "local lake only"
        elif source != "kafka":
            peer_figures = "not run: Pathway reads schema-wrapped JSON; the Postgres source writes it bare"
        elif peer is not None:
            try:
                peer_figures = pathway_phase(changes, bootstrap, topic, work, peer, update_plan("Peer"),
                                             list(range(updatable + n_deletes, n_docs)), procs,
                                             [*threads, "--kafka-config", json.dumps(fetch_wait)])  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - our figures still stand; say why the peer's are missing
                peer_figures = f"failed: {exc}"
        emit(bench="freshness", lake=store, rate_per_s=rate, timed_every=timed_every(rate),
             max_polls_per_s=MAX_POLLS_PER_S, pinned="service on CPU 1, the rest on CPU 0" if PIN_SERVICE else None,
             push="commit notices", cpu_threads=cpu_threads, dtype=dtype or "auto",
             source="postgres (SQL COMMIT → visible)" if source == "postgres" else "kafka (produce → visible)",
             fetch_wait_ms=FETCH_WAIT_MS,
             **ours, stages_mean=stages, stages_p95=stages_p95,
             peer=peer_figures,
             targets="update and delete p95 <= 300 ms, p99 <= 500 ms local; p99 <= 1 s on S3; "
                     "search p99 during updates <= 1.2x idle")  # fmt: skip
    finally:
        for proc in procs:
            os.killpg(proc.pid, 9)
        for step in reversed(cleanup):
            step()
        broker.terminate()
        broker.wait(30)


def start_postgres_source(
    work: Path, bootstrap: str, procs: list[subprocess.Popen[bytes]], cleanup: list[Callable[[], None]]
) -> Any:
    """A local Postgres with the notes' table, and ``streamrag cdc postgres`` publishing it to
    cdc.app.public.docs; returns a connection (autocommit) to make the changes with."""
    import psycopg2

    from pipelines.pgcluster import LocalPostgres, docs_table

    server = LocalPostgres().start()  # durable: commits are fsynced, as a real database's
    cleanup.append(server.stop)
    db = psycopg2.connect(server.dsn())
    db.autocommit = True
    cleanup.append(db.close)
    with db.cursor() as cur:
        cur.execute(docs_table() + " CREATE PUBLICATION streamrag FOR TABLE docs")
    log = (work / "cdc.log").open("wb")
    procs.append(subprocess.Popen([*CLI, "cdc", "postgres", "--dsn", server.dsn(), "--publication", "streamrag",
                                   "--slot", "fresh", "--bootstrap", bootstrap, "--topic-prefix", "cdc.app",
                                   "--state-dir", str(work / "cdc")], stdout=log, stderr=log,
                                  start_new_session=True))  # fmt: skip
    return db


def bench_tail(sizes: list[int], queries: int = 200) -> None:
    """The fresh tail's search at growing sizes: exact (a matrix product) against its IVF index.

    Real embeddings (the Python docs); queries are held-out chunks. Decides where
    ``retrieval.tail_index.TAIL_INDEX_ROWS`` belongs.
    """
    from retrieval.tail import TailLog
    from retrieval.tail_index import TailIndex

    corpus = embedded_pydocs()
    held_out, pool = corpus.vectors[:queries], corpus.vectors[queries:]
    for size in sizes:
        if size > len(pool):
            print(f"the corpus has {len(pool)} chunks: no tail of {size}", file=sys.stderr)
            continue
        rows = chunk_rows(pool[:size])
        rows = rows.append_column("lake_version", pa.array(np.ones(size, np.int64)))
        log_ = TailLog(0, pool.shape[1])
        log_.index = TailIndex(pool.shape[1], min_rows=size + 1)  # never trains: exact search
        t0 = time.perf_counter()
        log_.append(rows, 1)
        append_s = time.perf_counter() - t0
        state = log_.snapshot()
        allowed = state.allowed(frozenset())
        exact_s, truth = [], []
        for q in held_out:
            t0 = time.perf_counter()
            found = state.search(q, 10, allowed)
            exact_s.append(time.perf_counter() - t0)
            truth.append({r for r, _ in found})
        index = TailIndex(pool.shape[1], min_rows=1)
        t0 = time.perf_counter()
        index.extend(state.vectors, state._upsert, size)
        assert index._training is not None
        index._training.join()
        index.extend(state.vectors, state._upsert, size)  # swaps the trained index in
        train_s = time.perf_counter() - t0
        ivf_s, recalls = [], []
        for q, want in zip(held_out, truth, strict=True):
            t0 = time.perf_counter()
            found = index.search(q, 10, allowed)
            ivf_s.append(time.perf_counter() - t0)
            assert found is not None
            recalls.append(len({r for r, _ in found} & want) / len(want))
        emit(bench="tail_search", rows=size, exact=percentiles(exact_s), ivf=percentiles(ivf_s),
             ivf_recall_at_10=round(float(np.mean(recalls)), 4), nlist=index._index.nlist if index._index else None,
             nprobe=index.nprobe, ivf_train_s=round(train_s, 2), append_us_per_row=round(append_s / size * 1e6, 1),
             corpus="pydocs")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["search", "cold", "http", "freshness", "tail", "codecs"], action="append")
    parser.add_argument("--n", type=int, default=200_000, help="synthetic vectors for search and cold")
    parser.add_argument("--queries", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=30.0, help="HTTP load duration per client count")
    parser.add_argument("--updates", type=int, default=100)
    parser.add_argument("--rate", type=float, default=2.0, help="updates/s in the freshness section")
    parser.add_argument(
        "--max-polls-per-s",
        type=float,
        help="freshness: cap on detection searches per second, all changes together (none)",
    )
    parser.add_argument("--fresh-store", choices=["local", "s3"], action="append", help="lake for freshness (local)")
    parser.add_argument(
        "--fresh-source",
        choices=["kafka", "postgres"],
        default="kafka",
        help="freshness: changes produced to Kafka (kafka), or SQL in a local Postgres published by "
        "streamrag cdc postgres (postgres: timed from COMMIT)",
    )
    parser.add_argument("--peer-python", type=Path, default=ROOT / ".venv-peers" / "bin" / "python")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="codecs: added to every S3 request (20)")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="freshness: the service (ours, then the peer) on CPU 1, everything else on CPU 0",
    )
    parser.add_argument("--cpu-threads", type=int, help="freshness: --cpu-threads of ingest, serve and the peer")
    parser.add_argument("--dtype", help="freshness: --dtype of our ingest and serve (int8; the peer stays fp32)")
    parser.add_argument("--pathway-python", type=Path, default=ROOT / ".venv-pathway" / "bin" / "python",
                        help="Pathway's environment (made by make bench): the freshness peer")  # fmt: skip
    args = parser.parse_args()
    global MAX_POLLS_PER_S, PIN_SERVICE
    MAX_POLLS_PER_S = args.max_polls_per_s
    PIN_SERVICE = args.pin
    if PIN_SERVICE and args.cpu_threads is None:
        args.cpu_threads = 1  # one CPU each: more threads than that only contend
    sections = set(args.only or ["search", "cold", "http", "freshness", "tail", "codecs"])
    TAGS["corpus"] = "synthetic"
    work = Path(tempfile.mkdtemp(prefix="srbench-", dir="/tmp"))
    try:
        if sections & {"search", "cold"}:
            start_ray(work_dir=work / "ray")
            x, queries, index, lake = synthetic_index(args.n, work, args.queries)
            if "search" in sections:
                bench_search(x, queries, index, lake, work, args.peer_python)
            if "cold" in sections:
                bench_cold(index, lake, queries, work)
            import ray

            ray.shutdown()
        TAGS.clear()
        if sections & {"http"}:
            start_ray(work_dir=work / "ray2")
            bench_http(work, args.seconds)
        if "tail" in sections:
            bench_tail([5_000, 10_000, 20_000, 39_500])
        if "codecs" in sections:
            from benchmarks.decoupled import bench_codecs

            start_ray(work_dir=work / "ray3")
            bench_codecs(work / "codecs", ["flat", "sq8", "pq48"], args.delay_ms, 300)
        if "freshness" in sections:
            for store in args.fresh_store or ["local"]:
                bench_freshness(work, args.updates, args.rate, store,
                                args.pathway_python if args.pathway_python.exists() else None,
                                args.cpu_threads, args.dtype, args.fresh_source)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
