"""Faults in dependencies: the object store stops answering while the API serves.

A private moto S3 server (so pausing it disturbs no other test) is frozen with SIGSTOP for
10 s: the API keeps answering searches from its shard cache and the tail it holds, says
`degraded` on /healthz instead of failing requests, and recovers by itself on SIGCONT
(new lake rows show up again).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import S3Server, free_port, wait_port
from tests.corpus import make_corpus
from tests.integration.helpers import cli, ingest_args, kill_group, produce, start
from tests.integration.test_serve import doc_events, wait_ready

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

TOPIC = "cdc.app.public.docs_faults"


@pytest.fixture
def private_s3(tmp_path: Path) -> Iterator[tuple[S3Server, subprocess.Popen[bytes]]]:
    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    with (tmp_path / "moto.log").open("wb") as fh:
        proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=fh, stderr=fh)
    wait_port(port, proc)
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_REGION": "us-east-1"}  # fmt: skip
    yield S3Server(endpoint, env), proc
    os.kill(proc.pid, signal.SIGCONT)
    proc.terminate()
    proc.wait(10)


def health(url: str) -> dict:  # type: ignore[type-arg]
    return httpx.get(f"{url}/healthz", timeout=5).json()  # type: ignore[no-any-return]


def test_api_keeps_answering_while_s3_is_frozen_and_recovers(broker: str, private_s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    s3, moto = private_s3
    lake = f"{s3.create_bucket('lake-faults')}/lake"
    index = f"{s3.create_bucket('index-faults')}/idx"
    produce(broker, TOPIC, make_corpus(seed=31, docs=12, updates=4, deletes=2), tmp_path / "c.jsonl")
    out = cli(*ingest_args(broker, TOPIC, lake, tmp_path / "recovery", idle=4), env=s3.env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    out = cli("index", "build", "--lake", lake, "--index", index, "--nlist", "4", env=s3.env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    port = free_port()
    proc = start(["serve", "--lake", lake, "--index", index, "--port", str(port), "--no-answers", "--tail-poll",
                  "0.2", "--cache-dir", str(tmp_path / "cache")], s3.env, tmp_path / "serve.log")  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        query = {"query": "streaming lake documents", "k": 5}
        warm = httpx.post(f"{url}/v1/search", json=query, timeout=30)
        assert warm.status_code == 200 and warm.json()["results"]
        os.kill(moto.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        statuses, latencies, degraded = [], [], False
        while time.monotonic() - frozen_at < 10:
            t0 = time.perf_counter()
            r = httpx.post(f"{url}/v1/search", json=query, timeout=30)
            latencies.append(time.perf_counter() - t0)
            statuses.append(r.status_code)
            assert r.json()["results"] == warm.json()["results"] or r.status_code != 200
            degraded = degraded or health(url)["status"] == "degraded"
            time.sleep(0.2)
        os.kill(moto.pid, signal.SIGCONT)
        assert set(statuses) == {200}, statuses
        assert max(latencies) < 5, f"searches stalled behind the frozen store: {max(latencies):.1f} s"
        assert degraded, "health never said degraded while the store was frozen"
        # Recovery: healthy again, and a new document ingested now is found.
        deadline = time.monotonic() + 90
        while health(url)["status"] != "ok":
            assert time.monotonic() < deadline, health(url)
            time.sleep(0.5)
        rows = [(500, "Aurora", "The aurora borealis glows green over the frozen fjord tonight.", "")]
        produce(broker, TOPIC, doc_events(5000, rows), tmp_path / "new.jsonl")
        out = cli(*ingest_args(broker, TOPIC, lake, tmp_path / "recovery", idle=4), env=s3.env, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        deadline = time.monotonic() + 30
        while True:
            top = httpx.post(f"{url}/v1/search", json={"query": "aurora over the fjord", "k": 1}, timeout=30)
            if top.json()["results"] and "aurora" in top.json()["results"][0]["text"]:
                break
            assert time.monotonic() < deadline, "new rows never showed after the store came back"
            time.sleep(0.5)
    finally:
        os.kill(moto.pid, signal.SIGCONT)
        kill_group(proc)
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


def fake_chunker(lake: str):  # type: ignore[no-untyped-def]
    from pipelines.flow import Runtime
    from pipelines.settings import IngestSettings
    from serving.embedder import load_embedder

    return Runtime(IngestSettings(topics=["x"], lake=lake, model="fake"), load_embedder("fake")).chunker


def test_ingest_survives_a_frozen_broker_and_a_frozen_object_store(private_s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from pipelines.broker import start_broker
    from pipelines.lake import Lake
    from pipelines.storage import ObjectStoreSettings
    from tests.integration.helpers import delta_commits
    from tests.oracle import assert_lake_matches

    s3, moto = private_s3
    port = free_port()
    broker_proc = start_broker(port)
    bootstrap = f"127.0.0.1:{port}"
    try:
        corpus = make_corpus(seed=41, docs=1500, paragraphs=2, updates=600, deletes=100)
        produce(bootstrap, TOPIC, corpus, tmp_path / "c.jsonl")
        local = tmp_path / "lake"
        args = [*ingest_args(bootstrap, TOPIC, str(local), tmp_path / "recovery", idle=20), "--model", "fake",
                "--batch-max-events", "16"]  # fmt: skip
        job = start(args, None, tmp_path / "ingest.log")
        deadline = time.monotonic() + 120
        while delta_commits(local) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(broker_proc.pid, signal.SIGSTOP)  # the broker stops answering mid-stream
        time.sleep(10)
        os.kill(broker_proc.pid, signal.SIGCONT)
        assert job.wait(300) == 0, (tmp_path / "ingest.log").read_text()[-3000:]
        assert_lake_matches(Lake.at(str(local)), corpus, fake_chunker(str(local)))

        # Same stream into a lake on S3, with the S3 server frozen for 10 s mid-stream.
        lake = f"{s3.create_bucket('lake-frozen')}/lake"
        args = [*ingest_args(bootstrap, TOPIC, lake, tmp_path / "recovery-s3", idle=20), "--model", "fake",
                "--batch-max-events", "16"]  # fmt: skip
        job = start(args, s3.env, tmp_path / "ingest-s3.log")
        import boto3

        client = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id="test",
                              aws_secret_access_key="test", region_name="us-east-1")  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # freeze once a few commits have landed
            listed = client.list_objects_v2(Bucket="lake-frozen", Prefix="lake/chunks/_delta_log/")
            if sum(k["Key"].endswith(".json") for k in listed.get("Contents", [])) >= 3:
                break
            time.sleep(0.1)
        os.kill(moto.pid, signal.SIGSTOP)
        time.sleep(10)
        os.kill(moto.pid, signal.SIGCONT)
        assert job.wait(300) == 0, (tmp_path / "ingest-s3.log").read_text()[-3000:]
        settings = ObjectStoreSettings(s3.endpoint, "test", "test", None, "us-east-1")
        assert_lake_matches(Lake.at(lake, settings), corpus, fake_chunker(lake))
    finally:
        os.kill(broker_proc.pid, signal.SIGCONT)
        os.kill(moto.pid, signal.SIGCONT)
        broker_proc.terminate()
        broker_proc.wait(10)
