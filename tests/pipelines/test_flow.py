"""The dataflow on in-memory input: single worker, two workers, and abort + resume."""

from __future__ import annotations

import threading
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import pytest
from bytewax.connectors.kafka import KafkaSourceMessage
from bytewax.dataflow import Dataflow
from bytewax.recovery import RecoveryConfig, init_db_dir
from bytewax.testing import TestingSource, cluster_main, run_main
from prometheus_client import REGISTRY

from pipelines.flow import Runtime, build_flow
from pipelines.kafka_io import read_jsonl_messages
from pipelines.lake import DEAD_LETTERS, Lake
from pipelines.runner import prepare
from pipelines.settings import IngestSettings
from serving.fake_embedder import FakeEmbedder
from tests.corpus import make_corpus
from tests.oracle import assert_lake_matches

TOPIC = "cdc.app.public.docs"


def messages(tmp_path: Path, corpus) -> list[KafkaSourceMessage]:
    path = corpus.write(tmp_path / "events.jsonl")
    return [
        KafkaSourceMessage(key=k, value=v, topic=TOPIC, partition=0, offset=i)
        for i, (_, k, v) in enumerate(read_jsonl_messages(path))
    ]


def settings_for(tmp_path: Path, **kw) -> IngestSettings:
    return IngestSettings(topics=[TOPIC], lake=str(tmp_path / "lake"), chunk_max_tokens=80, **kw)


class Published:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def __call__(self, table: pa.Table) -> None:
        self.rows.extend(table.to_pylist())


def run(flow: Dataflow, workers: int) -> None:
    """The flow in this process: one worker, or a cluster of ``workers`` threads."""
    if workers == 1:
        run_main(flow)
    else:
        cluster_main(flow, [], 0, worker_count_per_proc=workers)


@pytest.mark.parametrize("workers", [1, 2])
def test_flow_writes_exactly_the_current_state(tmp_path: Path, workers: int) -> None:
    corpus = make_corpus(seed=workers)
    settings = prepare(settings_for(tmp_path))
    embedder = FakeEmbedder()
    published = Published()
    run(build_flow(settings, TestingSource(messages(tmp_path, corpus), batch_size=7), published, embedder), workers)
    lake = Lake.at(settings.lake)
    assert_lake_matches(lake, corpus, Runtime(settings, embedder).chunker)
    # Every dead letter went to the topic as well, with its original bytes.
    assert sorted(r["value"] for r in published.rows) == sorted(lake.read(DEAD_LETTERS).column("value").to_pylist())


class ThreadCountingEmbedder(FakeEmbedder):
    """Counts the texts each worker (a thread, in ``cluster_main``) embeds."""

    def __init__(self) -> None:
        super().__init__()
        self.by_thread: Counter[int] = Counter()

    def embed_batch(self, texts):
        self.by_thread[threading.get_ident()] += len(texts)
        return super().embed_batch(texts)


def test_every_worker_embeds_even_with_fewer_writers(tmp_path: Path) -> None:
    """Three workers over a two-writer lake: all three run the model (the writers only commit)."""
    corpus = make_corpus(seed=9, docs=120)
    settings = prepare(settings_for(tmp_path, writers=2))
    embedder = ThreadCountingEmbedder()
    flow = build_flow(settings, TestingSource(messages(tmp_path, corpus), batch_size=20), Published(), embedder)
    cluster_main(flow, [], 0, worker_count_per_proc=3)
    assert len(embedder.by_thread) == 3, embedder.by_thread
    assert min(embedder.by_thread.values()) > 0.15 * sum(embedder.by_thread.values()), embedder.by_thread
    lake = Lake.at(settings.lake)
    assert sorted(set(lake.read("chunks").column("writer").to_pylist())) == ["ingest:chunks:000", "ingest:chunks:001"]
    assert_lake_matches(lake, corpus, Runtime(settings, embedder).chunker)


def test_a_recovery_directory_from_before_per_worker_embedding_resumes_without_loss(tmp_path: Path) -> None:
    """Until embedding moved to every worker, updates were batched per writer before the
    model, and a snapshot could hold a batch read from the source but not yet embedded.

    The fixture was written by commit 2c8184a: the flow below aborted after two thirds of
    the messages, while its micro-batch step held updates of 9 chunks (its batches of 4
    had pushed the wait to a minute). Resumed without the old step, those are lost; the
    lake must equal the oracle."""
    import tarfile

    with tarfile.open(Path(__file__).parent / "data" / "recovery-before-per-worker-embedding.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    corpus = make_corpus(seed=21, docs=120)
    msgs = messages(tmp_path, corpus)
    cut = len(msgs) * 2 // 3  # the old run had PAUSE and ABORT here: same offsets, no abort
    items = [*msgs[:cut], TestingSource.PAUSE(timedelta(0)), TestingSource.PAUSE(timedelta(0)), *msgs[cut:]]
    settings = prepare(settings_for(tmp_path, batch_max_events=4, batch_timeout_ms=60_000))
    embedder = FakeEmbedder()
    flow = build_flow(settings, TestingSource(items, batch_size=20), Published(), embedder)
    run_main(flow, epoch_interval=timedelta(milliseconds=250), recovery_config=RecoveryConfig(tmp_path / "recovery"))
    assert_lake_matches(Lake.at(settings.lake), corpus, Runtime(settings, embedder).chunker)


@pytest.mark.parametrize("epoch_ms", [250, 30_000])
def test_abort_and_resume_leaves_the_clean_run_result(tmp_path: Path, epoch_ms: int) -> None:
    """Short epochs: resume from a recent snapshot. Long epochs: no snapshot before the
    abort, so everything committed is replayed and must be recognised and skipped."""
    corpus = make_corpus(seed=11)
    msgs = messages(tmp_path, corpus)
    settings = prepare(settings_for(tmp_path, batch_max_events=1))
    rdir = tmp_path / "recovery"
    rdir.mkdir()
    init_db_dir(rdir, 1)
    embedder = FakeEmbedder()
    third = len(msgs) // 3
    items = [
        *msgs[:third],
        TestingSource.PAUSE(timedelta(milliseconds=600)),
        TestingSource.ABORT(),
        *msgs[third : 2 * third],
        TestingSource.PAUSE(timedelta(milliseconds=600)),
        TestingSource.ABORT(),
        *msgs[2 * third :],
    ]
    source = TestingSource(items, batch_size=5)
    recovery = RecoveryConfig(rdir)
    lake = Lake.at(settings.lake)
    versions = []
    skipped_before = REGISTRY.get_sample_value("streamrag_ingest_replayed_rows_skipped_total") or 0.0
    for _ in range(3):  # two aborted runs, then one that completes
        flow = build_flow(settings, source, Published(), embedder)
        run_main(flow, epoch_interval=timedelta(milliseconds=epoch_ms), recovery_config=recovery)
        versions.append(lake.table("chunks").version())
    assert 0 < versions[0] < versions[1] < versions[2], "each run should have committed"
    skipped = (REGISTRY.get_sample_value("streamrag_ingest_replayed_rows_skipped_total") or 0.0) - skipped_before
    assert_lake_matches(lake, corpus, Runtime(settings, embedder).chunker)
    if epoch_ms > 10_000:
        assert skipped > 0, "replayed rows were committed before the abort and must have been skipped"


def test_a_lake_refuses_vectors_of_another_model(tmp_path: Path) -> None:
    from pipelines.lake import LakeError

    corpus = make_corpus(seed=3, docs=3, updates=0, deletes=0)
    settings = prepare(settings_for(tmp_path))
    run_main(build_flow(settings, TestingSource(messages(tmp_path, corpus)), Published(), FakeEmbedder(dim=32)))
    with pytest.raises(LakeError, match="vectors of different models must not mix"):
        build_flow(settings, TestingSource([]), Published(), FakeEmbedder(dim=16))


def test_stage_metrics_time_the_fetch_and_the_commit(tmp_path: Path) -> None:
    """A message's Kafka timestamp is where the fetch delay starts; each chunks commit is timed."""
    import time

    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    corpus = make_corpus(seed=5, docs=4, updates=0, deletes=0)
    produced_ms = int(time.time() * 1000) - 2000  # produced 2 s before the job reads it
    msgs = [
        KafkaSourceMessage(
            key=m.key, value=m.value, topic=TOPIC, partition=0, offset=m.offset, timestamp=(1, produced_ms)
        )
        for m in messages(tmp_path, corpus)
    ]
    untimed = KafkaSourceMessage(key=msgs[0].key, value=msgs[0].value, topic=TOPIC, partition=0, offset=99,
                                 timestamp=(0, 0))  # fmt: skip  # TIMESTAMP_NOT_AVAILABLE: not observed
    before = {
        n: sample(n) for n in ("streamrag_ingest_fetch_delay_seconds_count", "streamrag_ingest_fetch_delay_seconds_sum")
    }
    commits = sample("streamrag_ingest_commit_seconds_count", table="chunks")
    settings = prepare(settings_for(tmp_path))
    run_main(build_flow(settings, TestingSource([*msgs, untimed]), Published(), FakeEmbedder()))
    observed = (
        sample("streamrag_ingest_fetch_delay_seconds_count") - before["streamrag_ingest_fetch_delay_seconds_count"]
    )
    assert observed == len(msgs)
    delay = sample("streamrag_ingest_fetch_delay_seconds_sum") - before["streamrag_ingest_fetch_delay_seconds_sum"]
    assert 2.0 * len(msgs) <= delay < 60.0 * len(msgs)
    assert sample("streamrag_ingest_commit_seconds_count", table="chunks") > commits
