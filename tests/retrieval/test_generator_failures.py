"""Every way a generator can fail is a 502 (or an SSE ``error`` event) and an audit row.

The generator is a scripted TCP server on loopback that fails as real servers do: a vLLM
pod killed mid-response (connection reset), a body cut short, an HTML error page with
status 200, JSON of the wrong shape, malformed or truncated server-sent events.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from retrieval.answer import Answerer
from retrieval.api import create_app
from retrieval.audit import AuditLog
from serving.generator import Generator, GeneratorSettings
from tests.retrieval.test_answer import TEXTS, StubEngine, audit_rows
from tests.scripted_server import ScriptedServer, headers, sse

QUESTION = {"question": "How do penguins swim?", "k": 2}
GOOD = json.dumps({"choices": [{"delta": {"content": "Penguins swim"}, "finish_reason": None}]})
JSON = "application/json"

#: non-streamed failures: (what, raw response parts, reset at the end)
COMPLETE_FAILURES: list[tuple[str, tuple[bytes, ...], bool]] = [
    ("reset mid-body", (headers(200, JSON, 400), b'{"choices": [{"mess'), True),
    ("body cut short", (headers(200, JSON, 400), b'{"choices": [{"mess'), False),
    ("html with 200", (headers(200, "text/html", 27), b"<html>bad gateway</html>\n\n\n"), False),
    ("json of the wrong shape", (headers(200, JSON, 9), b"[1, 2, 3]"), False),
    ("content not a string", (headers(200, JSON, 44), b'{"choices": [{"message": {"content": 42}}]}'), False),
    ("no response at all", (), True),
]

#: streamed failures, after the stream started
STREAM_FAILURES: list[tuple[str, tuple[bytes, ...], bool]] = [
    ("pod killed mid-stream", (headers(200, "text/event-stream"), sse(GOOD)), True),
    ("malformed frame", (headers(200, "text/event-stream"), sse(GOOD, "{not json")), False),
    ("frame of the wrong shape", (headers(200, "text/event-stream"), sse(GOOD, '{"choices": 7}')), False),
    ("ended without [DONE]", (headers(200, "text/event-stream"), sse(GOOD)), False),
    ("error event", (headers(200, "text/event-stream"), sse(GOOD, '{"error": {"message": "CUDA OOM"}}')), False),
]


def service(server: ScriptedServer, audit: AuditLog) -> tuple[TestClient, Answerer]:
    engine = StubEngine(TEXTS)
    generator = Generator(GeneratorSettings(server.url, model="m", retries=0, timeout_s=5))
    answerer = Answerer(engine, generator, audit)  # type: ignore[arg-type]
    return TestClient(create_app(engine, None, answerer)), answerer  # type: ignore[arg-type]


def events(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_every_failure_of_a_completion_is_a_502_and_audited(audit: AuditLog) -> None:
    with ScriptedServer() as server:
        client, _ = service(server, audit)
        ids = []
        for what, parts, reset in COMPLETE_FAILURES:
            server.play(*parts, reset=reset)
            r = client.post("/v1/answer", json=QUESTION)
            assert r.status_code == 502, (what, r.status_code, r.text)
            assert r.json()["error"].startswith("the generator failed"), what
            ids.append(r.json().get("answer_id"))
        assert client.get("/healthz").json()["status"] == "degraded"
    rows = audit_rows(audit)
    assert [r["status"] for r in rows] == ["failed"] * len(COMPLETE_FAILURES)
    assert all(r["error"] and not r["streamed"] for r in rows)


def test_every_failure_of_a_stream_ends_with_an_error_event_and_is_audited(audit: AuditLog) -> None:
    with ScriptedServer() as server:
        client, _ = service(server, audit)
        for what, parts, reset in STREAM_FAILURES:
            server.play(*parts, reset=reset)
            r = client.post("/v1/answer", json={**QUESTION, "stream": True})
            assert r.status_code == 200, what
            got = events(r.text)
            assert got[0] == ("token", {"text": "Penguins swim"}), what
            assert got[-1][0] == "error" and got[-1][1]["answer_id"] == r.headers["x-answer-id"], (what, got)
            assert not any(name == "done" for name, _ in got), what
    rows = audit_rows(audit)
    assert [r["status"] for r in rows] == ["failed"] * len(STREAM_FAILURES)
    assert all(r["streamed"] and r["raw_answer"] == "Penguins swim" and r["error"] for r in rows)


@pytest.mark.parametrize("exc", [httpx.ReadError("reset"), httpx.WriteError("broken pipe"), httpx.ReadTimeout("t")])
def test_transport_errors_of_every_kind_are_generator_errors(audit: AuditLog, exc: Exception) -> None:
    def fail(request: httpx.Request) -> httpx.Response:
        raise exc

    engine = StubEngine(TEXTS)
    generator = Generator(GeneratorSettings("http://gen/v1", model="m", retries=0), httpx.MockTransport(fail))
    client = TestClient(create_app(engine, None, Answerer(engine, generator, audit)))  # type: ignore[arg-type]
    assert client.post("/v1/answer", json=QUESTION).status_code == 502
    assert events(client.post("/v1/answer", json={**QUESTION, "stream": True}).text)[-1][0] == "error"
    assert [r["status"] for r in audit_rows(audit)] == ["failed", "failed"]


@pytest.mark.parametrize(
    ("failure", "status"),
    [("store", 503), ("integrity", 502)],
)
def test_index_storage_failures_during_a_search_are_clear_json_errors(failure: str, status: int) -> None:
    """A probed list not yet local while the index store is down, or one that fails its check."""
    from indexing.lists import ListIntegrityError
    from indexing.store import StoreUnavailable

    class Failing(StubEngine):
        def search(self, *args: Any, **kwargs: Any) -> Any:
            if failure == "store":
                raise StoreUnavailable("GET s3://bucket/index/shard-0-3.lists: connection refused")
            raise ListIntegrityError("list 3 does not match its sha256 in the index; refusing to use it.")

    client = TestClient(create_app(Failing(TEXTS), None, None))  # type: ignore[arg-type]
    r = client.post("/v1/search", json={"query": "penguins", "k": 2})
    assert r.status_code == status, r.text
    assert ("retry" in r.json()["error"]) == (status == 503) and "s3://" not in r.text
    assert (r.headers.get("retry-after") == "5") == (status == 503)
