"""The index builder killed mid-publish, and S3 gone during a build and during a publish.

The builder talks to S3 (moto on loopback) through a fault proxy that acts exactly when a
given request goes out: the manifest PUT (the publish), the LATEST hint, a shard upload.
Meanwhile readers poll the store directly, open the newest version, verify every file of
every listed version against its checksum and search it: they must only ever see complete
versions, and a build must never publish twice or lose its version.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from indexing.manifest import collect_garbage, get_verified, load_manifest, versions
from indexing.reader import IndexReader
from indexing.store import ObjectStore, open_store
from pipelines.lake import CHUNKS, Lake
from pipelines.lake_writer import LakeWriter
from pipelines.storage import ObjectStoreSettings
from tests.faultproxy import FaultProxy
from tests.indexing.lakes import chunk_rows, synthetic_lake
from tests.integration.helpers import kill_group, start
from tests.integration.test_index_build import _ray_processes

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

N = 20_000


@dataclass
class Rig:
    lake: str
    index: str
    bucket: str
    proxy: FaultProxy
    env: dict[str, str]  # the builder's: S3 through the proxy
    direct: ObjectStore  # the readers': S3 without faults
    tmp: Path
    builds: int = 0

    def args(self) -> list[str]:
        return ["index", "build", "--lake", self.lake, "--index", self.index, "--nlist", "32", "--iterations", "3",
                "--shard-mb", "0.05", "--json"]  # fmt: skip

    def start(self, *extra: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
        self.builds += 1
        scratch = Path(tempfile.mkdtemp(prefix="srf-", dir="/tmp"))  # Ray's socket paths must stay short
        log = self.tmp / f"build-{self.builds}.log"
        return start([*self.args(), *extra], {**self.env, "TMPDIR": str(scratch)}, log), log, scratch

    def run(self, *extra: str, timeout: float = 300) -> tuple[dict, str]:  # type: ignore[type-arg]
        proc, log, _ = self.start(*extra)
        proc.wait(timeout)
        text = log.read_text()
        assert proc.returncode == 0, text[-3000:]
        return json.loads(text.strip().splitlines()[-1]), text

    def kill(self, proc: subprocess.Popen[bytes], scratch: Path) -> None:
        kill_group(proc)
        for leftover in _ray_processes(str(scratch)):  # Ray's workers follow the driver
            leftover.wait(30)
        self.proxy.down()  # drop the held request: it never reaches S3
        self.proxy.up()

    def latest_hint(self) -> int:
        return int(self.direct.get("LATEST"))


@dataclass
class Readers:
    """Poll the store as a reader would, the whole time the builds run."""

    store: ObjectStore
    seen: set[int] = field(default_factory=set)
    verified: set[int] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    polls: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        query = np.ones((1, 32), np.float32) / np.sqrt(32)
        while not self._stop.is_set():
            try:
                for v in versions(self.store):
                    if v not in self.verified:
                        m = load_manifest(self.store, v)
                        for ref in m.files():
                            get_verified(self.store, ref)  # every file there (its own or shared), and intact
                        assert sum(s.live for s in m.shards) == m.count == N, (v, m.count)
                        self.verified.add(v)
                reader = IndexReader(self.store)
                hits = reader.search(query, 5, nprobe=8)
                assert len(hits[0]) == 5, hits
                self.seen.add(reader.manifest.version)
                self.polls += 1
            except Exception as exc:  # noqa: BLE001 - every failure is a finding
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self._stop.wait(0.3)

    def wait_for(self, version: int, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        # Seen and verified: a manifest that lands between one poll's listing and its search is
        # seen by the search first and verified on the next poll.
        while not {version} <= self.seen & self.verified and time.monotonic() < deadline and not self.errors:
            time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


@pytest.fixture
def rig(s3_server, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Rig]:  # type: ignore[no-untyped-def]
    lake, _ = synthetic_lake(str(tmp_path / "lake"), n=N, dim=32, files=4)
    bucket = f"idx-faults-{len(request.node.name) % 97}-{int(time.time() * 1000) % 100000}"
    index = f"{s3_server.create_bucket(bucket)}/idx"
    proxy = FaultProxy(int(s3_server.endpoint.rsplit(":", 1)[1]))
    settings = ObjectStoreSettings(s3_server.endpoint, "test", "test", None, "us-east-1")
    env = {**s3_server.env, "AWS_ENDPOINT_URL": proxy.url}
    yield Rig(lake.uri, index, bucket, proxy, env, open_store(index, settings), tmp_path)
    proxy.close()


def test_a_builder_killed_mid_publish_leaves_readers_on_complete_versions(rig: Rig) -> None:
    first, _ = rig.run()
    assert first["version"] == 1
    readers = Readers(rig.direct)
    try:
        # Killed while its manifest PUT is in flight (never reaches S3): nothing is published.
        trap = rig.proxy.set_trap(f"PUT /{rig.bucket}/idx/versions/".encode(), "hold")
        proc, log, scratch = rig.start()
        assert trap.hit.wait(300), log.read_text()[-3000:]
        rig.kill(proc, scratch)
        assert versions(rig.direct) == [1] and rig.latest_hint() == 1
        orphans = {k.split("/")[1] for k in rig.direct.list("builds/")} - {load_manifest(rig.direct, 1).build_id}
        assert len(orphans) == 1, "the killed build's shards are written, but unpublished"

        # Killed after its manifest landed, before the LATEST hint moved: version 2 exists and
        # is complete; readers take the newest manifest, not the stale hint.
        trap = rig.proxy.set_trap(f"PUT /{rig.bucket}/idx/LATEST".encode(), "hold")
        proc, log, scratch = rig.start()
        assert trap.hit.wait(300), log.read_text()[-3000:]
        rig.kill(proc, scratch)
        assert versions(rig.direct) == [1, 2] and rig.latest_hint() == 1
        assert IndexReader(rig.direct).manifest.version == 2
        assert load_manifest(rig.direct, 2).build_id not in orphans

        # The next build publishes normally after both.
        third, _ = rig.run()
        assert third["version"] == 3 and versions(rig.direct) == [1, 2, 3] and rig.latest_hint() == 3
        readers.wait_for(3)
    finally:
        readers.stop()
    assert not readers.errors, readers.errors[:5]
    assert readers.polls > 10 and {1, 3} <= readers.seen <= {1, 2, 3}, (readers.polls, readers.seen)
    assert readers.verified == {1, 2, 3}


@pytest.mark.parametrize(
    ("request_line", "action"),
    [
        pytest.param("PUT /{bucket}/idx/versions/", "lose_answer", id="publish-lands-but-its-answer-is-lost"),
        pytest.param("PUT /{bucket}/idx/builds/", "refuse", id="build-upload-refused"),
    ],
)
def test_s3_gone_for_10s_during_a_build_or_publish_the_build_waits_and_publishes_once(
    rig: Rig, request_line: str, action: str
) -> None:
    rig.run()
    readers = Readers(rig.direct)
    try:
        trap = rig.proxy.set_trap(request_line.format(bucket=rig.bucket).encode(), action, outage_s=10)
        t0 = time.monotonic()
        summary, log = rig.run(timeout=400)
        took = time.monotonic() - t0
        readers.wait_for(2)
    finally:
        readers.stop()
    assert trap.hit.is_set() and trap.fired_at is not None
    assert time.monotonic() - trap.fired_at >= 10 and took >= 10, "the build finished only after the outage"
    assert "retrying" in log, log[-3000:]
    assert summary["version"] == 2 and versions(rig.direct) == [1, 2], "published exactly once"
    assert rig.latest_hint() == 2 and summary["count"] == N
    assert not readers.errors, readers.errors[:5]
    assert readers.seen == {1, 2} and readers.verified == {1, 2}


def test_an_incremental_build_killed_anywhere_leaves_readers_on_complete_versions(rig: Rig) -> None:
    """Killed while writing its delta or while publishing: readers stay on complete versions,
    the next incremental build publishes, and garbage collection then keeps what it shares."""
    incremental = ("--reuse-centroids",)
    assert rig.run(*incremental)[0]["version"] == 1
    rng = np.random.default_rng(3)
    x = rng.standard_normal((300, 32)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    writer = LakeWriter(Lake.at(rig.lake), CHUNKS, "changes", None)
    later = "pg:00000000000000999999"
    writer.write(chunk_rows(x[:200], start=1000, position=later))  # updates
    writer.write(chunk_rows(x[200:250], start=5000, op="delete", position=later))
    writer.write(chunk_rows(x[250:], start=N))  # as many new chunks: N live chunks still
    readers = Readers(rig.direct)
    try:
        for line in (f"PUT /{rig.bucket}/idx/builds/", f"PUT /{rig.bucket}/idx/versions/"):
            trap = rig.proxy.set_trap(line.encode(), "hold")
            proc, log, scratch = rig.start(*incremental)
            assert trap.hit.wait(300), log.read_text()[-3000:]
            rig.kill(proc, scratch)
            assert versions(rig.direct) == [1] and IndexReader(rig.direct).manifest.version == 1
        summary, _ = rig.run(*incremental)
        stats = summary["stats"]
        assert summary["version"] == 2 and stats["incremental"] and stats["base_version"] == 1, stats
        assert stats["changed_chunks"] == 300 and stats["dead_rows"] == 250 and stats["delta_rows"] == 250
        readers.wait_for(2)
        assert rig.run(*incremental, "--full")[0]["version"] == 3
        readers.wait_for(3)
    finally:
        readers.stop()
    assert not readers.errors, readers.errors[:5]
    assert readers.verified == {1, 2, 3} and 3 in readers.seen
    # Collection down to the full build: the base goes with the last version that names it.
    older = {f.key for v in (1, 2) for f in load_manifest(rig.direct, v).files()}
    assert collect_garbage(rig.direct, keep=1, grace_s=0) == [1, 2]
    left, named = set(rig.direct.list("builds/")), {f.key for f in load_manifest(rig.direct, 3).files()}
    assert named <= left and not (older - named) & left
