"""The commands as a user types them: broker, produce, and ingest's clear errors."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import free_port, wait_port
from tests.integration.helpers import CLI, cli, ingest_args, kill_group, start

pytestmark = pytest.mark.integration


def test_broker_prints_its_address_and_stops_cleanly_on_sigterm() -> None:
    port = free_port()
    proc = subprocess.Popen([*CLI, "broker", "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().decode().strip() == f"127.0.0.1:{port}"
        wait_port(port, proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        with pytest.raises(OSError):  # the Tansu child is gone too
            __import__("socket").create_connection(("127.0.0.1", port), timeout=0.5)
    finally:
        proc.kill()
        proc.communicate()


def test_broker_dies_with_its_command_even_after_kill_9() -> None:
    import os
    import socket

    port = free_port()
    proc = subprocess.Popen([*CLI, "broker", "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    proc.stdout.readline()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(15)
    proc.stdout.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        except OSError:
            return  # Tansu is gone too
        time.sleep(0.2)
    pytest.fail("Tansu outlived the broker command")


def test_broker_refuses_a_port_in_use(broker: str) -> None:
    out = cli("broker", "--port", broker.rsplit(":", 1)[1], timeout=30)
    assert out.returncode == 1 and "already in use" in out.stderr


def test_produce_reports_a_missing_file(broker: str, tmp_path: Path) -> None:
    out = cli("produce", "--bootstrap", broker, "--topic", "t", str(tmp_path / "nope.jsonl"))
    assert out.returncode != 0 and "no such file" in out.stderr


def test_ingest_refuses_a_missing_topic_with_a_sentence(broker: str, tmp_path: Path) -> None:
    args = [*ingest_args(broker, "no.such.topic", str(tmp_path / "lake"), None), "--topic-wait", "1"]
    out = cli(*args, timeout=120)
    assert out.returncode == 1
    assert "topic 'no.such.topic' does not exist on" in out.stderr and "(waited 1 s)" in out.stderr
    assert "Traceback" not in out.stderr


def test_ingest_waits_for_a_topic_that_a_source_creates_after_it_starts(broker: str, tmp_path: Path) -> None:
    """A source and the job started together (a compose file, two pods): the job must not exit
    (and be restarted in a loop) because the source has not created its topic yet."""
    from pipelines.broker import ensure_topics
    from pipelines.runner import ensure_dead_letter_topics
    from pipelines.settings import IngestSettings

    topic = f"late.{free_port()}"
    settings = IngestSettings(bootstrap=broker, topics=[topic], lake=str(tmp_path / "lake"), topic_wait_s=30)
    creator = threading.Timer(2.0, ensure_topics, (broker, [topic]), {"partitions": 3})
    creator.start()
    try:
        t0 = time.monotonic()
        ensure_dead_letter_topics(settings)
        assert time.monotonic() - t0 >= 1.5  # it did wait, then went on
    finally:
        creator.cancel()
    from confluent_kafka.admin import AdminClient

    topics = AdminClient({"bootstrap.servers": broker}).list_topics(timeout=15).topics
    assert len(topics[topic + ".dlq"].partitions) == 3  # as many partitions as the topic it waited for


def test_ingest_says_when_kafka_is_unreachable(tmp_path: Path) -> None:
    out = cli(*ingest_args(f"127.0.0.1:{free_port()}", "t", str(tmp_path / "lake"), None), timeout=120)
    assert out.returncode == 1 and "cannot reach Kafka at 127.0.0.1:" in out.stderr
    assert "Traceback" not in out.stderr


def test_ingest_rejects_bad_options(broker: str, tmp_path: Path) -> None:
    out = cli("ingest", "--bootstrap", broker, "--topic", "t", "--lake", str(tmp_path), "--workers", "0")
    assert out.returncode == 2 and "--workers" in out.stderr
    out = cli("ingest", "--bootstrap", broker, "--topic", "t", "--lake", "ftp://x/y")
    assert out.returncode == 1 and "unsupported storage URI scheme" in out.stderr


def test_ingest_serves_prometheus_metrics(broker: str, tmp_path: Path) -> None:
    from pipelines.broker import ensure_topics
    from tests.corpus import make_corpus
    from tests.integration.helpers import produce

    topic = "cdc.app.public.docs_metrics"
    ensure_topics(broker, [topic])
    produce(broker, topic, make_corpus(seed=5, docs=5, updates=2, deletes=1), tmp_path / "e.jsonl")
    port = free_port()
    proc = start(
        [*ingest_args(broker, topic, str(tmp_path / "lake"), None, idle=20), "--metrics-port", str(port)],
        None,
        tmp_path / "log",
    )
    try:
        deadline = time.monotonic() + 120
        body = ""
        while time.monotonic() < deadline:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            except OSError:
                time.sleep(0.5)
                continue
            if 'streamrag_ingest_lake_commits_total{table="chunks"}' in body:
                break
            time.sleep(0.5)
        assert 'streamrag_ingest_events_total{outcome="dead-letter"} 8.0' in body, body[-2000:]
        assert "streamrag_ingest_event_to_commit_seconds_bucket" in body
        assert 'streamrag_ingest_chunks_total{action="embedded"}' in body
    finally:
        proc.terminate()
        proc.wait(30)
    assert "CONFWARN" not in (tmp_path / "log").read_text()  # no consumer property reaches an admin client
    json.dumps(body[:10])


def test_a_failing_process_of_a_multi_process_ingest_stops_the_command(broker: str, tmp_path: Path) -> None:
    """Process 1 cannot serve its metrics (the port is taken) and exits at start: the command
    stops the others and exits non-zero instead of waiting forever (process 0 waits for
    its peer; the supervisor used to poll only until it met a running child)."""
    import socket

    from pipelines.broker import ensure_topics
    from tests.corpus import make_corpus
    from tests.integration.helpers import produce

    topic = "cdc.app.public.docs_one_fails"
    ensure_topics(broker, [topic])
    produce(broker, topic, make_corpus(seed=6, docs=5, updates=0, deletes=0), tmp_path / "e.jsonl")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1] - 1  # process 1 serves on port + 1
        args = [*ingest_args(broker, topic, str(tmp_path / "lake"), None, workers=2, idle=30), "--model", "fake",
                "--metrics-port", str(port)]  # fmt: skip
        proc = start(args, None, tmp_path / "log")
        try:
            status = proc.wait(60)
        finally:
            if proc.poll() is None:
                kill_group(proc)
    assert status != 0, (tmp_path / "log").read_text()[-2000:]
    assert "Address already in use" in (tmp_path / "log").read_text()


def test_a_cluster_address_taken_before_its_process_listens_starts_the_cluster_again(
    broker: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The runner chooses the processes' ports and they listen on them a second later; a socket
    that takes one in between used to fail the whole command ("Address already in use", one
    crash-test run in 40). The cluster now starts again on other ports, and its work is whole."""
    import signal as signals
    import socket

    from pipelines import runner
    from pipelines.broker import ensure_topics
    from pipelines.lake import Lake, current_chunks
    from pipelines.settings import IngestSettings
    from tests.corpus import make_corpus
    from tests.integration.helpers import produce

    topic = "cdc.app.public.docs_port_taken"
    ensure_topics(broker, [topic])
    corpus = make_corpus(seed=7, docs=6, updates=0, deletes=0)
    produce(broker, topic, corpus, tmp_path / "e.jsonl")
    chosen: list[list[str]] = []
    real = runner.cluster_addresses

    def first_taken(n: int) -> list[str]:
        addresses = real(n)
        if not chosen:
            addresses[1] = f"127.0.0.1:{taken.getsockname()[1]}"
        chosen.append(addresses)
        return addresses

    settings = IngestSettings(
        bootstrap=broker, topics=[topic], lake=str(tmp_path / "lake"), workers=2, until_idle_s=6, model="fake",
        batch_max_events=8, recovery_dir=str(tmp_path / "rec"),
    )  # fmt: skip
    handlers = {s: signals.getsignal(s) for s in (signals.SIGINT, signals.SIGTERM)}
    monkeypatch.setattr(runner, "cluster_addresses", first_taken)
    with socket.socket() as taken, caplog.at_level("WARNING", logger="pipelines.runner"):
        taken.bind(("127.0.0.1", 0))  # bound, not listening: like a connection's local end
        try:
            status = runner.run_ingest(settings)
        finally:
            for sig, handler in handlers.items():
                signals.signal(sig, handler)
    assert status == 0
    assert len(chosen) == 2 and chosen[1][1] != chosen[0][1]
    assert "starting again on other ports" in caplog.text
    live = current_chunks(Lake.at(settings.lake, settings.object_store()), columns=["doc_id"])
    assert len(live.column("doc_id").unique()) == 6
