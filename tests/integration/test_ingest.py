"""The real job: Tansu broker, the real model, Delta on local disk and on S3 (moto server)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipelines.flow import Runtime
from pipelines.lake import CHUNKS, Lake
from pipelines.settings import IngestSettings
from pipelines.storage import ObjectStoreSettings
from tests.corpus import make_corpus
from tests.integration.helpers import cli, count_dlq, delta_commits, ingest_args, kill_group, produce, start
from tests.oracle import assert_lake_matches

pytestmark = pytest.mark.integration


def chunker_for(real_embedder, lake: str):
    return Runtime(IngestSettings(topics=["x"], lake=lake), real_embedder).chunker


def test_ingest_local_lake_then_rerun_without_duplicates(broker, real_embedder, tmp_path: Path) -> None:
    topic = "cdc.app.public.docs"
    corpus = make_corpus(seed=21, docs=30)
    produce(broker, topic, corpus, tmp_path / "events.jsonl")
    lake_dir = tmp_path / "lake"
    args = ingest_args(broker, topic, str(lake_dir), tmp_path / "recovery", idle=5)

    first = cli(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    lake = Lake.at(str(lake_dir))
    assert_lake_matches(lake, corpus, chunker_for(real_embedder, str(lake_dir)))
    version = lake.table(CHUNKS).version()

    # Every dead letter is on the DLQ topic too, with its reason and source coordinates.
    headers = count_dlq(broker, topic + ".dlq")
    assert len(headers) == corpus.malformed
    assert all(h["streamrag.error"] and h["streamrag.source.topic"] == topic for h in headers)

    # Again with the same recovery directory: resumes at the end, writes nothing.
    again = cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert lake.table(CHUNKS).version() == version

    # Again with no recovery state at all: re-reads everything, still no duplicates.
    fresh = cli(*ingest_args(broker, topic, str(lake_dir), None, idle=5))
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert_lake_matches(lake, corpus, chunker_for(real_embedder, str(lake_dir)))
    assert len(count_dlq(broker, topic + ".dlq")) == corpus.malformed


def test_ingest_to_s3(broker, real_embedder, s3_server, tmp_path: Path) -> None:
    topic = "cdc.app.public.docs_s3"
    corpus = make_corpus(seed=22, docs=20, updates=10, deletes=4)
    produce(broker, topic, corpus, tmp_path / "events.jsonl")
    bucket = s3_server.create_bucket("lake-ingest")
    uri = f"{bucket}/prod/lake"
    out = cli(*ingest_args(broker, topic, uri, tmp_path / "recovery", idle=5), env=s3_server.env)
    assert out.returncode == 0, out.stderr[-3000:]
    lake = Lake.at(uri, ObjectStoreSettings.from_env(s3_server.env))
    # The corpus's rows are mapped from the table in `source`, whatever the topic.
    assert_lake_matches(lake, corpus, chunker_for(real_embedder, uri))


# One worker is the simpler case of two: it runs with the crash tests (make test-reliability),
# which keeps the default suite under ten minutes on 2 cores.
@pytest.mark.parametrize("workers", [pytest.param(1, marks=pytest.mark.reliability), 2])
def test_kill_9_mid_stream_then_restart_equals_a_clean_run(broker, real_embedder, tmp_path: Path, workers: int) -> None:
    topic = f"cdc.app.public.docs_crash{workers}"
    corpus = make_corpus(seed=30 + workers, docs=120, updates=60, deletes=10)
    produce(broker, topic, corpus, tmp_path / "events.jsonl")
    lake_dir = tmp_path / "lake"
    recovery = tmp_path / "recovery"
    log = tmp_path / "ingest.log"
    kills = 0
    for target in (2, 6):  # kill after the lake has this many commits, twice
        proc = start(ingest_args(broker, topic, str(lake_dir), recovery, workers=workers, idle=5), None, log)
        deadline = time.monotonic() + 240
        while delta_commits(lake_dir) < target and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is None:
            kill_group(proc)
            kills += 1
    assert kills >= 1, "the job finished before it could be killed; make the corpus larger"
    final = start(ingest_args(broker, topic, str(lake_dir), recovery, workers=workers, idle=6), None, log)
    assert final.wait(300) == 0, log.read_text()[-3000:]
    assert_lake_matches(Lake.at(str(lake_dir)), corpus, chunker_for(real_embedder, str(lake_dir)))


def test_a_cluster_of_separately_started_members_as_in_a_statefulset(broker, real_embedder, tmp_path: Path) -> None:
    """`--process-id I --addresses …`: one process per pod; process 0 prepares, all share recovery."""
    from tests.conftest import free_port

    topic = "cdc.app.public.docs_members"
    corpus = make_corpus(seed=23, docs=20, updates=8, deletes=3)
    produce(broker, topic, corpus, tmp_path / "events.jsonl")
    lake_dir = tmp_path / "lake"
    addresses = ";".join(f"127.0.0.1:{free_port()}" for _ in range(2))
    args = [*ingest_args(broker, topic, str(lake_dir), tmp_path / "recovery", idle=5), "--addresses", addresses]
    members = [start([*args, "--process-id", str(i)], None, tmp_path / f"member-{i}.log") for i in (1, 0)]
    for proc in members:
        assert proc.wait(300) == 0, (tmp_path / "member-0.log").read_text()[-3000:]
    assert sorted(p.name for p in (tmp_path / "recovery").glob("part-*.sqlite3")) == [
        "part-0.sqlite3", "part-1.sqlite3"
    ]  # fmt: skip
    assert_lake_matches(Lake.at(str(lake_dir)), corpus, chunker_for(real_embedder, str(lake_dir)))
    out = cli(*ingest_args(broker, topic, str(lake_dir), None), "--process-id", "0")
    assert out.returncode == 2 and "--process-id and --addresses go together" in out.stderr
