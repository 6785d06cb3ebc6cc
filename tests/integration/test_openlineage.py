"""OpenLineage run events from the real ingest job and index build (file and HTTP transports)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.corpus import make_corpus
from tests.integration.helpers import cli, ingest_args, produce

pytestmark = pytest.mark.integration

TOPIC = "cdc.app.public.docs_lineage"


def events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_ingest_and_index_build_emit_start_and_complete(broker: str, tmp_path: Path) -> None:
    out_file = tmp_path / "ol.jsonl"
    lake, index = tmp_path / "lake", tmp_path / "index"
    produce(broker, TOPIC, make_corpus(docs=8, updates=2, deletes=1), tmp_path / "c.jsonl")
    out = cli(*ingest_args(broker, TOPIC, str(lake), None, idle=3), "--openlineage", f"file:{out_file}")
    assert out.returncode == 0, out.stderr[-3000:]
    out = cli("index", "build", "--lake", str(lake), "--index", str(index), "--nlist", "2", "--json",
              "--openlineage", f"file:{out_file}", timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    built = json.loads(out.stdout)
    ingest, build = events(out_file)[:2], events(out_file)[2:]
    assert [e["eventType"] for e in ingest] == ["START", "COMPLETE"]
    assert ingest[0]["run"]["runId"] == ingest[1]["run"]["runId"]
    assert ingest[1]["job"] == {"namespace": "streamrag", "name": "ingest.ingest", "facets": ingest[1]["job"]["facets"]}
    assert ingest[1]["inputs"][0]["namespace"] == f"kafka://{broker}" and ingest[1]["inputs"][0]["name"] == TOPIC
    outputs = {(o["namespace"], o["name"]) for o in ingest[1]["outputs"]}
    assert ("file", str(lake / "chunks")) in outputs and ("file", str(lake / "dead_letters")) in outputs
    assert (f"kafka://{broker}", TOPIC + ".dlq") in outputs
    assert [e["eventType"] for e in build] == ["START", "COMPLETE"] and build[1]["job"]["name"] == "index_build"
    done = build[1]
    assert done["inputs"][0]["name"] == str(lake / "chunks")
    assert done["inputs"][0]["facets"]["version"]["datasetVersion"] == str(built["lake_version"])
    assert done["outputs"][0]["name"] == str(index)
    assert done["outputs"][0]["facets"]["version"]["datasetVersion"] == str(built["version"])


def test_a_failed_build_emits_fail_over_http(tmp_path: Path) -> None:
    received: list[tuple[str, dict[str, Any]]] = []

    class Marquez(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            received.append((self.path, json.loads(body)))
            self.send_response(201)
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Marquez)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        out = cli("index", "build", "--lake", str(tmp_path / "none"), "--index", str(tmp_path / "idx"),
                  "--openlineage", url)  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
    assert out.returncode == 1 and "run `streamrag ingest` first" in out.stderr
    assert [path for path, _ in received] == ["/api/v1/lineage", "/api/v1/lineage"]
    fail = received[1][1]
    assert fail["eventType"] == "FAIL" and fail["run"]["runId"] == received[0][1]["run"]["runId"]
    assert "run `streamrag ingest` first" in fail["run"]["facets"]["errorMessage"]["message"]


def test_an_unreachable_lineage_endpoint_never_fails_the_job(tmp_path: Path) -> None:
    from tests.conftest import free_port

    out = cli("index", "build", "--lake", str(tmp_path / "none"), "--index", str(tmp_path / "idx"),
              "--openlineage", f"http://127.0.0.1:{free_port()}")  # fmt: skip
    assert out.returncode == 1 and "run `streamrag ingest` first" in out.stderr  # the job's own error, not lineage's
    assert "Traceback" not in out.stderr
