"""Load: the ingest job on a steady stream for 5 minutes while the API answers searches and
index builds run, all on this machine.

- Ingest: `streamrag ingest` (real model) fed RATE events/s (updates, inserts, deletes with
  ts_ms = now) for STREAMRAG_LOAD_SECONDS (300 by default). Lag (event time → Delta commit)
  must not grow: the last minute's p99 within 3x the first minute's (+2 s); memory must stay
  bounded: RSS at the end within 30% of RSS after the first minute; nothing lost: the lake
  equals the oracle once the stream is consumed.
- Mixed workload: searches from 4 clients with fresh queries (each one is embedded) alone
  first, then during the stream, then during the stream *and* back-to-back index builds.
  Zero errors, and interactive queries must not starve behind background work: p99 with
  everything running stays within 10x its p99 alone (with a 1 s floor), and no search
  takes longer than 5 s.

The figures are printed as one JSON line (run with -s); they belong in the closing note.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
from confluent_kafka import Producer

from pipelines.broker import ensure_topics
from pipelines.envelopes import envelope, message
from pipelines.flow import Runtime
from pipelines.lake import CHUNKS, Lake
from pipelines.settings import IngestSettings
from tests.conftest import free_port
from tests.corpus import WORDS, Corpus, body, paragraph
from tests.integration.helpers import cli, kill_group, start
from tests.integration.test_serve import wait_ready
from tests.oracle import assert_lake_matches

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

SECONDS = float(os.environ.get("STREAMRAG_LOAD_SECONDS", "300"))
RATE = 8.0  # events/s
ALONE_S = min(30.0, SECONDS / 5)
CLIENTS = 4
INITIAL_DOCS = 200
TOPIC = "cdc.app.public.docs_mixed"


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def tree_rss(proc: psutil.Process) -> int:
    try:
        return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
    except psutil.NoSuchProcess:
        return 0


@dataclass
class Stream:
    """Produces Debezium events at a steady rate and keeps the oracle."""

    bootstrap: str
    corpus: Corpus = field(default_factory=Corpus)
    rng: random.Random = field(default_factory=lambda: random.Random(11))
    lsn: int = 100
    next_pk: int = 1
    produced: int = 0

    def __post_init__(self) -> None:
        self.producer = Producer({"bootstrap.servers": self.bootstrap})

    def send(self, op: str, pk: int, row: dict | None) -> None:  # type: ignore[type-arg]
        self.lsn += 10
        value = envelope(op, row, {"id": pk} if op == "d" else None, lsn=self.lsn)  # type: ignore[arg-type]
        key, raw = message({"id": pk}, value)
        self.producer.produce(TOPIC, key=key, value=raw)
        self.producer.poll(0)
        self.produced += 1
        if op == "d":
            self.corpus.expected.pop(str(pk), None)
        else:
            assert row is not None
            self.corpus.expected[str(pk)] = (row["title"], row["body"], ())

    def insert(self) -> None:
        pk, self.next_pk = self.next_pk, self.next_pk + 1
        self.send("c", pk, {"id": pk, "title": f"Doc {pk}", "body": body(self.rng, 2), "acl": []})

    def step(self) -> None:
        """70% updates (one paragraph rewritten), 20% inserts, 10% deletes."""
        live = list(self.corpus.expected)
        roll = self.rng.random()
        if roll < 0.2 or len(live) < 20:
            self.insert()
        elif roll < 0.3:
            self.send("d", int(self.rng.choice(live)), None)
        else:
            pk = self.rng.choice(live)
            title, text, _ = self.corpus.expected[pk]
            paragraphs = text.split("\n\n")
            paragraphs[self.rng.randrange(len(paragraphs))] = paragraph(self.rng)
            self.send("u", int(pk), {"id": int(pk), "title": title, "body": "\n\n".join(paragraphs), "acl": []})

    def run(self, seconds: float) -> None:
        t0 = time.monotonic()
        n = 0
        while time.monotonic() - t0 < seconds:
            delay = t0 + n / RATE - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            self.step()
            n += 1
        self.producer.flush(30)


def commit_lags(lake: Lake) -> list[tuple[float, float]]:
    """(commit time, event time → commit seconds) of every chunk row the job committed."""
    table = lake.table(CHUNKS)
    commit_ms = {}
    for entry in table.history():
        writer, seq = entry.get("streamrag.writer"), entry.get("streamrag.seq")
        if writer is not None and seq is not None:
            commit_ms[(writer, int(seq))] = entry["timestamp"] / 1000
    rows = table.to_pyarrow_table(columns=["event_time", "writer", "writer_seq"]).to_pylist()
    return [
        (
            commit_ms[(r["writer"], r["writer_seq"])],
            commit_ms[(r["writer"], r["writer_seq"])] - r["event_time"].timestamp(),
        )
        for r in rows
        if (r["writer"], r["writer_seq"]) in commit_ms
    ]


def wait_until(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}")


def test_steady_ingest_for_minutes_with_searches_and_index_builds(broker: str, real_embedder, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ensure_topics(broker, [TOPIC], partitions=2)
    lake_uri, index = str(tmp_path / "lake"), str(tmp_path / "index")
    stream = Stream(broker)
    for _ in range(INITIAL_DOCS):
        stream.insert()
    stream.producer.flush(30)

    ingest = start(["ingest", "--bootstrap", broker, "--topic", TOPIC, "--lake", lake_uri, "--recovery-dir",
                    str(tmp_path / "recovery")], None, tmp_path / "ingest.log")  # fmt: skip
    ingest_ps = psutil.Process(ingest.pid)
    serve = None
    try:
        lake = Lake.at(lake_uri)
        wait_until(lambda: (tmp_path / "lake" / CHUNKS).exists() and _docs(lake) == INITIAL_DOCS, 300, "initial docs")
        built = cli("index", "build", "--lake", lake_uri, "--index", index, "--nlist", "16", timeout=600)
        assert built.returncode == 0, built.stderr[-3000:]
        port = free_port()
        serve_args = ["serve", "--lake", lake_uri, "--index", index, "--port", str(port), "--no-answers",
                      "--tail-poll", "0.5", "--cache-dir", str(tmp_path / "cache")]  # fmt: skip
        serve = start(serve_args, None, tmp_path / "serve.log")
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, serve)

        t0 = time.monotonic()
        stream_at = t0 + ALONE_S
        stop = stream_at + SECONDS
        samples: list[tuple[float, float, int]] = []  # (time, latency, status)
        builds: list[tuple[float, float, int]] = []  # (start, end, returncode)
        failures: list[str] = []  # each failed build's stderr
        retried: list[str] = []  # the reads a build retried, with their reasons (shown in the figures)
        rss: list[tuple[float, int]] = []
        lock = threading.Lock()

        def client(i: int) -> None:
            rng = random.Random(100 + i)
            with httpx.Client(timeout=30) as http:
                while time.monotonic() < stop:
                    query = " ".join(rng.sample(WORDS, 3))  # fresh queries: each one is embedded
                    t = time.perf_counter()
                    try:
                        status = http.post(f"{url}/v1/search", json={"query": query, "k": 5}).status_code
                    except httpx.HTTPError:
                        status = 0
                    with lock:
                        samples.append((time.monotonic(), time.perf_counter() - t, status))

        def builder() -> None:  # back-to-back builds from the 1st to the 3rd minute of the stream
            begin = stream_at + min(60.0, SECONDS / 5)
            time.sleep(max(0.0, begin - time.monotonic()))
            while time.monotonic() < stream_at + min(180.0, SECONDS * 0.6):
                b0 = time.monotonic()
                out = cli("index", "build", "--lake", lake_uri, "--index", index, "--nlist", "16", timeout=600)
                builds.append((b0, time.monotonic(), out.returncode))
                if out.returncode:
                    failures.append(out.stderr[-3000:])
                retried.extend(line for line in out.stderr.splitlines() if "; retrying in" in line)

        def watch() -> None:
            while time.monotonic() < stop:
                rss.append((time.monotonic() - stream_at, tree_rss(ingest_ps)))
                time.sleep(2)

        threads = [threading.Thread(target=f, daemon=True) for f in (builder, watch)]
        with ThreadPoolExecutor(CLIENTS + 1) as pool:
            futures = [pool.submit(client, i) for i in range(CLIENTS)]
            time.sleep(max(0.0, stream_at - time.monotonic()))
            for t in threads:
                t.start()
            stream.run(SECONDS)
            for f in futures:
                f.result()
        for t in threads:
            t.join(600)

        # Nothing lost: the stream drains and the lake equals the oracle.
        expected_docs = len(stream.corpus.expected)
        wait_until(lambda: _docs(lake) == expected_docs and _caught_up(lake, stream), 180, "the stream to drain")
    finally:
        if serve is not None:
            kill_group(serve)
        kill_group(ingest)

    chunker = Runtime(IngestSettings(topics=["x"], lake=lake_uri), real_embedder).chunker
    assert_lake_matches(Lake.at(lake_uri), stream.corpus, chunker)

    # Figures.
    in_build = [any(b0 <= t <= b1 for b0, b1, _ in builds) for t, _, _ in samples]
    alone = [lat for (t, lat, _), b in zip(samples, in_build, strict=True) if t < stream_at and not b]
    ingesting = [lat for (t, lat, _), b in zip(samples, in_build, strict=True) if t >= stream_at and not b]
    building = [lat for (_, lat, _), b in zip(samples, in_build, strict=True) if b]
    errors = [s for s in samples if s[2] != 200]
    lags = commit_lags(Lake.at(lake_uri))
    epoch = time.time() - time.monotonic()  # monotonic → wall clock
    window = min(60.0, SECONDS / 5)
    first = [lag for at, lag in lags if stream_at + epoch <= at < stream_at + epoch + window]
    last = [lag for at, lag in lags if stop + epoch - window <= at < stop + epoch]
    warm_rss = next((r for t, r in rss if t >= window), rss[0][1])
    figures = {
        "seconds": SECONDS, "rate_events_per_s": RATE, "events": stream.produced,
        "docs_at_end": len(stream.corpus.expected), "searches": len(samples), "search_errors": len(errors),
        "search_p50_ms_alone": round(pct(alone, 50) * 1000, 1), "search_p99_ms_alone": round(pct(alone, 99) * 1000, 1),
        "search_p99_ms_ingest": round(pct(ingesting, 99) * 1000, 1),
        "search_p99_ms_ingest_and_build": round(pct(building, 99) * 1000, 1),
        "search_max_ms": round(max(lat for _, lat, _ in samples) * 1000, 1),
        "builds": len(builds), "build_retries": retried, "build_s": [round(b1 - b0, 1) for b0, b1, _ in builds],
        "lag_p50_s_first_min": round(pct(first, 50), 2), "lag_p99_s_first_min": round(pct(first, 99), 2),
        "lag_p50_s_last_min": round(pct(last, 50), 2), "lag_p99_s_last_min": round(pct(last, 99), 2),
        "ingest_rss_warm_mb": warm_rss >> 20, "ingest_rss_end_mb": rss[-1][1] >> 20,
        "ingest_rss_max_mb": max(r for _, r in rss) >> 20,
    }  # fmt: skip
    print(json.dumps({"bench": "mixed_load", **figures}))

    assert not errors, f"{len(errors)} failed searches, e.g. status {errors[0][2]}"
    assert builds and not failures, failures
    assert alone and ingesting and building, figures
    assert first and last, figures
    assert pct(last, 99) <= 3 * pct(first, 99) + 2, f"ingest lag grows: {figures}"
    assert rss[-1][1] <= 1.3 * warm_rss, f"ingest memory grows: {figures}"
    assert pct(building, 99) <= max(10 * pct(alone, 99), 1.0), f"searches starve behind background work: {figures}"
    assert max(lat for _, lat, _ in samples) < 5, figures


def _docs(lake: Lake) -> int:
    from pipelines.lake import current_chunks

    try:
        return len({r["doc_id"] for r in current_chunks(lake, columns=["doc_id"]).to_pylist()})
    except Exception:  # noqa: BLE001 - not there yet
        return -1


def _caught_up(lake: Lake, stream: Stream) -> bool:
    """The newest position in the lake is the last one produced."""
    positions = lake.read(CHUNKS, columns=["position"]).column("position").to_pylist()
    return max(positions) == f"pg:{stream.lsn:020d}"
