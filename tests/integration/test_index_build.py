"""`streamrag index build` on a lake written by the real ingest job, local disk and S3."""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from indexing.manifest import versions
from indexing.reader import IndexReader
from indexing.store import LocalStore, open_store
from pipelines.lake import Lake, current_chunks, embeddings
from pipelines.storage import ObjectStoreSettings
from tests.corpus import make_corpus
from tests.indexing.lakes import synthetic_lake
from tests.integration.helpers import cli, ingest_args, kill_group, produce, start

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def s3_lake(broker: str, s3_server, tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("index-build")
    topic = "cdc.app.public.docs_index"
    produce(broker, topic, make_corpus(seed=41, docs=60, updates=10, deletes=5), tmp / "events.jsonl")
    uri = f"{s3_server.create_bucket('lake-index')}/lake"
    out = cli(*ingest_args(broker, topic, uri, tmp / "recovery", idle=5), env=s3_server.env)
    assert out.returncode == 0, out.stderr[-3000:]
    return uri


@pytest.mark.parametrize("where", ["local", "s3"])
def test_build_publishes_a_version_readers_can_open(s3_lake: str, s3_server, tmp_path: Path, where: str) -> None:
    index_uri = str(tmp_path / "index") if where == "local" else f"{s3_server.create_bucket('index-' + where)}/idx"
    out = cli("index", "build", "--lake", s3_lake, "--index", index_uri, "--nlist", "8", "--json",
              env=s3_server.env, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["version"] == 1 and summary["nlist"] == 8

    settings = ObjectStoreSettings.from_env(s3_server.env)
    lake = Lake.at(s3_lake, settings)
    live = current_chunks(lake, columns=["chunk_id", "embedding", "source_pk"])
    reader = IndexReader(open_store(index_uri, settings))
    assert reader.manifest.count == live.num_rows == summary["count"]
    assert reader.manifest.lake_version == lake.table("chunks").version()
    # Every live chunk finds itself first, with its lineage, probing all lists (or a chunk with
    # the same vector: the two chunks of a two-chunk document mix into one contextual vector).
    vectors = embeddings(live)
    hits = reader.search(vectors, 1, nprobe=8)
    rows = [reader.rows(h)[0] for h in hits]
    at = {c: i for i, c in enumerate(live.column("chunk_id").to_pylist())}
    found = [at[r["chunk_id"]] for r in rows]
    assert all(np.array_equal(vectors[f], vectors[i]) for i, f in enumerate(found))
    assert sum(f == i for i, f in enumerate(found)) > len(found) // 2
    pks = live.column("source_pk").to_pylist()
    assert [r["source_pk"] for r in rows] == [pks[f] for f in found]
    assert np.allclose([r["score"] for r in rows], 1.0, atol=1e-4)


def test_build_on_an_empty_lake_says_so(tmp_path: Path) -> None:
    Lake.at(str(tmp_path / "lake")).ensure_tables(2)
    out = cli("index", "build", "--lake", str(tmp_path / "lake"), "--index", str(tmp_path / "index"))
    assert out.returncode == 1 and "has no chunks" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "index" / "versions").exists()


def test_build_fails_fast_when_the_index_store_is_unreachable(tmp_path: Path) -> None:
    from tests.conftest import free_port

    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_ACCESS_KEY_ID": "x",
           "AWS_SECRET_ACCESS_KEY": "y", "AWS_REGION": "us-east-1"}  # fmt: skip
    Lake.at(str(tmp_path / "lake")).ensure_tables(2)
    out = cli("index", "build", "--lake", str(tmp_path / "lake"), "--index", "s3://bucket/idx", env=env, timeout=300)
    assert out.returncode == 1 and "cannot reach S3" in out.stderr and "Traceback" not in out.stderr


def _ray_processes(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in proc.info["cmdline"] or []):
            found.append(proc)
    return found


def test_a_build_killed_between_shards_and_manifest_leaves_readers_on_the_last_version(tmp_path: Path) -> None:
    lake, _ = synthetic_lake(str(tmp_path / "lake"), n=20_000, dim=32, files=4)
    index = tmp_path / "index"
    args = ["index", "build", "--lake", lake.uri, "--index", str(index), "--iterations", "3", "--shard-mb", "0.02",
            "--json"]  # fmt: skip
    first = cli(*args, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    first_build = json.loads(first.stdout.strip().splitlines()[-1])
    store = LocalStore(str(index))
    assert versions(store) == [1]
    published = IndexReader(store).manifest.build_id

    # Kill -9 the whole second build (driver and its local Ray) once its first shard is written.
    scratch = Path(tempfile.mkdtemp(prefix="srk-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    proc = start(args, {"TMPDIR": str(scratch)}, tmp_path / "build.log")
    deadline = time.monotonic() + 300
    shards: list[Path] = []
    while not shards and time.monotonic() < deadline and proc.poll() is None:
        shards = [p for p in index.glob("builds/*/shard-*.faiss") if published not in str(p)]
        time.sleep(0.02)
    assert shards, (tmp_path / "build.log").read_text()[-3000:]
    kill_group(proc)
    for leftover in _ray_processes(str(scratch)):  # Ray's own processes follow the driver
        leftover.wait(30)

    assert versions(store) == [1], "the killed build must not have published"
    reader = IndexReader(store)
    assert reader.manifest.version == 1 and reader.manifest.build_id == published
    hits = reader.search(np.ones((1, 32), np.float32) / np.sqrt(32), 5, nprobe=4)
    assert len(hits[0]) == 5
    orphans = {p.parent.name for p in shards}
    assert orphans and published not in orphans

    # The next build publishes normally; the orphaned files stay invisible to readers.
    again = cli(*args, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert versions(store) == [1, 2] and IndexReader(store).manifest.build_id not in orphans
    shutil.rmtree(scratch, ignore_errors=True)
    assert first_build["count"] == IndexReader(store).manifest.count == 20_000


def test_serve_from_s3_with_a_cold_cache(s3_lake: str, s3_server, tmp_path: Path) -> None:
    import httpx

    from tests.conftest import free_port
    from tests.integration.test_serve import wait_ready

    index_uri = f"{s3_server.create_bucket('index-serve')}/idx"
    out = cli("index", "build", "--lake", s3_lake, "--index", index_uri, "--nlist", "8", env=s3_server.env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    port = free_port()
    proc = start(["serve", "--lake", s3_lake, "--index", index_uri, "--port", str(port), "--cache-dir",
                  str(tmp_path / "cache")], s3_server.env, tmp_path / "serve.log")  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        health = wait_ready(url, proc)
        assert health["index_version"] == 1 and health["status"] == "ok"
        r = httpx.post(f"{url}/v1/search", json={"query": "kafka delta lake", "k": 5}, timeout=60)
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert len(results) == 5 and all(x["source"]["table"] == "public.docs" for x in results)
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        fetched = [
            line for line in metrics.splitlines() if line.startswith("streamrag_shard_cache_fetched_bytes_total")
        ]
        assert fetched and float(fetched[0].split()[-1]) > 0
        assert any(p.stat().st_size > 0 for p in (tmp_path / "cache").iterdir())
        # Answers from the embedded generator (no --generator-url; it extracts unless asked to generate), audited on S3.
        body = {"question": "What does the lake store?", "k": 2, "style": "generate"}
        r = httpx.post(f"{url}/v1/answer", json=body, timeout=300)
        assert r.status_code == 200, r.text
        answer_id = r.json()["answer_id"]
        proc.send_signal(signal.SIGINT)  # a graceful stop flushes the audit log
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            kill_group(proc)
    assert "Traceback" not in (tmp_path / "serve.log").read_text()
    out = cli("lineage", "answer", answer_id, "--lake", s3_lake, "--json", env=s3_server.env)
    assert out.returncode == 0, out.stderr[-3000:]
    chain = json.loads(out.stdout)
    assert chain["models"]["generator"].endswith(".gguf@sha256:" + chain["models"]["generator"][-16:])
    assert len(chain["sources"]) == 2 and all(s["source"]["table"] == "public.docs" for s in chain["sources"])
