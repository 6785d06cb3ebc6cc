"""Shared fixtures: fake and real embedders, the real embedded generator (llama.cpp on
SmolLM2), a real Tansu broker, a real S3 server (moto)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipelines.pgcluster import LocalPostgres
from serving.embedder import Embedder
from serving.fake_embedder import FakeEmbedder

_STATUS: dict[str, int] = {}

# OpenLineage events of the jobs tests run go to a scratch file, not the user's state dir.
_EVENTS = Path(tempfile.gettempdir()) / "streamrag-test-openlineage.jsonl"
os.environ.setdefault("STREAMRAG_OPENLINEAGE", f"file:{_EVENTS}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Tests that start local Ray (≈4 s and 0.75 GB once per session) are marked, so that
    # `make test-unit` can leave them out; integration tests (real broker, CLI subprocesses,
    # the real model) carry the integration marker in their modules.
    for item in items:
        if "ray_local" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _STATUS["status"] = int(exitstatus)


def pytest_unconfigure(config: pytest.Config) -> None:
    # deltalake's background runtime threads sometimes abort interpreter teardown
    # ("terminate called without an active exception", exit 134) after every test has
    # run and been reported. Leave with pytest's own status instead.
    if "status" in _STATUS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_STATUS["status"])


@pytest.fixture
def fake_embedder() -> FakeEmbedder:
    return FakeEmbedder(dim=32)


@pytest.fixture(scope="session")
def real_embedder() -> Embedder:
    from serving.st_embedder import SentenceTransformerEmbedder

    return SentenceTransformerEmbedder(device="cpu")


@pytest.fixture(scope="session")
def generator_url() -> Iterator[str]:
    """The embedded llama.cpp server on SmolLM2-135M-Instruct, started once per session."""
    from serving.local_generator import EmbeddedGenerator

    with EmbeddedGenerator(threads=2) as gen:
        yield gen.base_url


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listening on {port} after {timeout}s")


@pytest.fixture(scope="session")
def broker() -> Iterator[str]:
    """A real Kafka-protocol broker (Tansu, memory storage) on loopback."""
    from pipelines.broker import start_broker

    port = free_port()
    proc = start_broker(port)
    yield f"127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="session")
def postgres() -> Iterator[LocalPostgres]:
    """A real Postgres (Debian's, installed by make) as an unprivileged local cluster with
    ``wal_level = logical``; each test makes its own database (``new_database``)."""
    server = LocalPostgres(durable=False).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def ray_local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Local Ray, two CPUs, its files under the test session's temp dir."""
    import ray

    from indexing.distributed import start_ray

    start_ray(work_dir=Path("/tmp") / f"ray-{tmp_path_factory.getbasetemp().name}", num_cpus=2)
    yield
    ray.shutdown()


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    env: dict[str, str]

    def create_bucket(self, name: str) -> str:
        import boto3

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="test",
            aws_secret_access_key="test",
            region_name="us-east-1",
        )
        client.create_bucket(Bucket=name)
        return f"s3://{name}"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """moto in server mode on loopback: reached over HTTP exactly as real S3 would be."""
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    exe = Path(sys.executable).with_name("moto_server")
    with log.open("wb") as fh:
        proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=fh, stderr=fh)
    wait_port(port, proc)
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_REGION": "us-east-1",
    }
    yield S3Server(endpoint, env)
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def transaction_version_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts deltalake's ``DeltaTable.transaction_version`` calls (each reads every log entry
    since the last checkpoint: writers must not make one per commit)."""
    from deltalake import DeltaTable

    calls = {"n": 0}
    real = DeltaTable.transaction_version

    def counted(self: DeltaTable, app_id: str) -> int | None:
        calls["n"] += 1
        return real(self, app_id)

    monkeypatch.setattr(DeltaTable, "transaction_version", counted)
    return calls
