"""Crashes: `kill -9` of a 2-process ingest job at random moments of a 10k-event stream,
and kill -9s across a rescale from 2 to 3 processes.

Inserts, updates, deletes (with tombstones), late stale updates and garbage, on the real
broker; the job (2 workers, recovery on) is killed at least 5 times at random commit
counts and restarted each time; at the end the lake equals the oracle computed from the
events and no chunk version appears twice. The fake embedder keeps the model out of the
way: this is about the pipeline's state, not the vectors.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import pytest

from pipelines.flow import Runtime
from pipelines.lake import Lake
from pipelines.settings import IngestSettings
from serving.embedder import load_embedder
from tests.corpus import Corpus, make_corpus
from tests.integration.helpers import (
    chunks_embedded,
    delta_commits,
    free_port_run,
    ingest_args,
    kill_group,
    produce,
    read_topic,
    start,
)
from tests.oracle import DOC_PREFIX, assert_lake_matches, expected_state, lake_state

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

#: ingest log lines that say where a run resumed, skipped or stopped reading
_TELLING = re.compile(r"skipped on replay|idle at offset|consumer error|resum|Traceback|ERROR|WARNING")


def assert_lake_matches_explained(broker: str, topic: str, lake_dir: Path, corpus: Corpus, log: Path) -> None:
    """``assert_lake_matches``, and on a mismatch what a reader needs to find the cause: for
    each document in question, its events (partition, offset) and every lake row of it, the
    lake rows of its neighbours in the partition, and what the runs logged about resuming."""
    settings = IngestSettings(topics=["x"], lake=str(lake_dir), model="fake")
    chunker = Runtime(settings, load_embedder("fake")).chunker
    lake = Lake.at(str(lake_dir))
    try:
        assert_lake_matches(lake, corpus, chunker)
    except AssertionError as exc:
        expected, actual = expected_state(corpus, chunker), lake_state(lake)
        docs = sorted({row[0] for row in (expected - actual) | (actual - expected)})[:5]
        raise AssertionError(f"{exc}\n{_explain(broker, topic, lake, docs, log)}") from None


def _explain(broker: str, topic: str, lake: Lake, docs: list[str], log: Path) -> str:
    events: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for msg in read_topic(broker, topic):
        try:
            pk = json.loads(msg.key())["id"]
        except (TypeError, ValueError, KeyError):
            continue
        events[DOC_PREFIX + str(pk)].append((msg.partition(), msg.offset()))
    cols = ["doc_id", "op", "kafka_partition", "kafka_offset", "writer", "writer_seq"]
    rows = [tuple(r.values()) for r in lake.read("chunks", columns=cols).to_pylist()]
    out = [f"lake rows: {cols}"]
    for doc in docs:
        out.append(f"{doc}: events {events.get(doc)}; lake rows {[r for r in rows if r[0] == doc]}")
        for part, offset in events.get(doc, []):
            near = sorted((r for r in rows if r[2] == part), key=lambda r: r[3])
            before = [r for r in near if r[3] < offset][-2:]
            after = [r for r in near if r[3] > offset][:2]
            out.append(f"  partition {part} around offset {offset}: before {before} after {after}")
    told = [line for line in log.read_text(errors="replace").splitlines() if _TELLING.search(line)]
    out.append("ingest log:\n" + "\n".join(told[-60:]))
    return "\n".join(out)


def test_five_random_kill_9s_of_two_workers_leave_the_clean_run_result(broker: str, tmp_path: Path) -> None:
    topic = "cdc.app.public.docs_crashes"
    corpus = make_corpus(seed=77, docs=5200, paragraphs=2, updates=3600, deletes=600)
    assert len(corpus.lines) >= 10_000
    produce(broker, topic, corpus, tmp_path / "events.jsonl", partitions=4)
    lake_dir, recovery, log = tmp_path / "lake", tmp_path / "recovery", tmp_path / "ingest.log"
    args = [*ingest_args(broker, topic, str(lake_dir), recovery, workers=2, idle=6), "--model", "fake",
            "--batch-max-events", "8", "--epoch-interval", "0.5"]  # fmt: skip
    rng = random.Random(5)
    kills, target = 0, 0
    while kills < 5:
        target = delta_commits(lake_dir) + rng.randint(1, 4)
        proc = start(args, None, log)
        deadline = time.monotonic() + 180
        while delta_commits(lake_dir) < target and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(rng.random() * 0.5)  # not always right after a commit
        if proc.poll() is not None:
            break  # finished before this kill: the stream is consumed
        kill_group(proc)
        kills += 1
    assert kills >= 5, f"only {kills} kills before the job finished; make the stream longer"
    final = start(args, None, log)
    assert final.wait(600) == 0, log.read_text()[-3000:]
    assert_lake_matches_explained(broker, topic, lake_dir, corpus, log)


def test_kill_9s_across_a_rescale_from_two_to_three_workers_leave_the_clean_run_result(
    broker: str, tmp_path: Path
) -> None:
    """A 2-writer lake: 2 workers, kill -9; 3 workers on the same recovery directory, kill -9;
    3 workers to the end. Every process of a 3-worker run embeds, and the lake equals the oracle."""
    topic = "cdc.app.public.docs_rescale"
    corpus = make_corpus(seed=78, docs=2400, paragraphs=2, updates=1200, deletes=300)
    produce(broker, topic, corpus, tmp_path / "events.jsonl", partitions=4)
    lake_dir, recovery, log = tmp_path / "lake", tmp_path / "recovery", tmp_path / "ingest.log"
    port = free_port_run(3)
    embedded = [0.0, 0.0, 0.0]

    def run(workers: int, commits: int | None) -> subprocess.Popen[bytes]:
        args = [*ingest_args(broker, topic, str(lake_dir), recovery, workers=workers, idle=6), "--model", "fake",
                "--batch-max-events", "8", "--epoch-interval", "0.5", "--metrics-port", str(port)]  # fmt: skip
        target = None if commits is None else delta_commits(lake_dir) + commits
        proc = start(args, None, log)
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if target is not None and delta_commits(lake_dir) >= target:
                break
            if workers == 3:
                embedded[:] = [max(seen, chunks_embedded(port + i)) for i, seen in enumerate(embedded)]
            time.sleep(0.05)
        return proc

    proc = run(2, commits=6)
    assert proc.poll() is None, "the 2-worker run finished before its kill; make the stream longer"
    kill_group(proc)
    proc = run(3, commits=6)
    assert proc.poll() is None, "the first 3-worker run finished before its kill; make the stream longer"
    kill_group(proc)
    final = run(3, commits=None)
    assert final.wait(600) == 0, log.read_text()[-3000:]
    assert all(n > 0 for n in embedded), f"chunks embedded per process of the 3-worker runs: {embedded}"
    writers = set(Lake.at(str(lake_dir)).read("chunks", columns=["writer"]).column("writer").to_pylist())
    assert writers == {"ingest:chunks:000", "ingest:chunks:001"}, writers
    assert_lake_matches_explained(broker, topic, lake_dir, corpus, log)
