"""Running the real CLI against the real broker, as a user would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from pipelines.broker import ensure_topics
from tests.corpus import Corpus

CLI = [sys.executable, "-m", "retrieval.cli"]


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout
    )


def produce(bootstrap: str, topic: str, corpus: Corpus, path: Path, partitions: int = 2) -> None:
    ensure_topics(bootstrap, [topic], partitions=partitions)
    out = cli("produce", "--bootstrap", bootstrap, "--topic", topic, str(corpus.write(path)))
    assert out.returncode == 0, out.stderr
    assert f"produced {len(corpus.lines)} messages" in out.stdout


def ingest_args(
    bootstrap: str, topic: str, lake: str, recovery: Path | None, workers: int = 1, idle: float = 6
) -> list[str]:
    args = [
        "ingest",
        "--bootstrap",
        bootstrap,
        "--topic",
        topic,
        "--lake",
        lake,
        "--workers",
        str(workers),
        "--until-idle",
        str(idle),
        "--batch-max-events",
        "8",
    ]
    if recovery is not None:
        args += ["--recovery-dir", str(recovery)]
    return args


def start(args: list[str], env: dict[str, str] | None, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as fh:
        return subprocess.Popen(
            [*CLI, *args], env={**os.environ, **(env or {})}, stdout=fh, stderr=fh, start_new_session=True
        )


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def read_topic(bootstrap: str, topic: str, idle: float = 2.0, timeout: float = 30) -> list[Any]:
    """Every message on a topic (all partitions; in offset order within each), read until
    nothing new arrives for ``idle`` s.

    (Tansu's watermarks and partition EOFs are per batch, not per record: don't trust them.)
    """
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "t", "enable.auto.commit": False})
    meta = consumer.list_topics(topic, timeout=10).topics[topic]
    consumer.assign([TopicPartition(topic, p, 0) for p in meta.partitions])
    out = []
    last = time.monotonic()
    deadline = last + timeout
    while time.monotonic() - last < idle and time.monotonic() < deadline:
        msg = consumer.poll(0.2)
        if msg is None or msg.error():
            continue
        last = time.monotonic()
        out.append(msg)
    consumer.close()
    return out


def count_dlq(bootstrap: str, topic: str, idle: float = 3.0, timeout: float = 30) -> list[dict[str, str]]:
    """Headers of the messages on a topic, read until nothing new arrives for ``idle`` s."""
    return [{k: v.decode() for k, v in (m.headers() or [])} for m in read_topic(bootstrap, topic, idle, timeout)]


def free_port_run(n: int) -> int:
    """A port P with P .. P + n - 1 free (``ingest --workers n --metrics-port P`` serves one each)."""
    from serving.process import bind_error, free_port

    for _ in range(100):
        port = free_port()
        if port + n <= 65536 and all(bind_error("127.0.0.1", port + i) is None for i in range(n)):
            return port
    raise RuntimeError(f"no run of {n} free ports found")


def _counter(port: int, sample: str) -> float:
    """A sample of a running ingest process's Prometheus metrics (0 when it serves none)."""
    import re
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=0.5) as resp:
            text = resp.read().decode()
    except OSError:
        return 0.0
    match = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def chunks_embedded(port: int) -> float:
    """The chunks a running ingest process has embedded so far."""
    return _counter(port, 'streamrag_ingest_chunks_total{action="embedded"}')


def rows_committed(port: int) -> float:
    """The ``chunks`` rows a running ingest process has committed so far."""
    return _counter(port, 'streamrag_ingest_lake_rows_total{table="chunks"}')


def delta_commits(lake_dir: Path) -> int:
    log = lake_dir / "chunks" / "_delta_log"
    return len(list(log.glob("*.json"))) if log.is_dir() else 0
