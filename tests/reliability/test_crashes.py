"""Crashes: `kill -9` of a 2-process ingest job at random moments of a 10k-event stream.

Inserts, updates, deletes (with tombstones), late stale updates and garbage, on the real
broker; the job (2 workers, recovery on) is killed at least 5 times at random commit
counts and restarted each time; at the end the lake equals the oracle computed from the
events and no chunk version appears twice. The fake embedder keeps the model out of the
way: this is about the pipeline's state, not the vectors.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from pipelines.flow import Runtime
from pipelines.lake import Lake
from pipelines.settings import IngestSettings
from serving.embedder import load_embedder
from tests.corpus import make_corpus
from tests.integration.helpers import delta_commits, ingest_args, kill_group, produce, start
from tests.oracle import assert_lake_matches

pytestmark = [pytest.mark.reliability, pytest.mark.integration]


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
    settings = IngestSettings(topics=["x"], lake=str(lake_dir), model="fake")
    chunker = Runtime(settings, load_embedder("fake")).chunker
    assert_lake_matches(Lake.at(str(lake_dir)), corpus, chunker)
