"""The HTTP API fuzzed from its own OpenAPI spec (schemathesis): no 5xx, no stack traces.

The app is the real one (FastAPI, auth, body limits) over a real engine, index and lake;
only the generator is a scripted OpenAI-compatible reply, so the fuzzer can hit
``/v1/answer`` thousands of times.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

from indexing.store import LocalStore
from pipelines.lake import Lake
from retrieval.answer import Answerer
from retrieval.api import create_app
from retrieval.audit import AuditLog
from retrieval.auth import Tokens
from retrieval.cache import ShardCache
from retrieval.engine import SearchEngine
from retrieval.lineage import Lineage
from retrieval.views import EngineOptions
from serving.fake_embedder import FakeEmbedder
from serving.generator import Generator, GeneratorSettings
from tests.retrieval.lakes import DocLake
from tests.retrieval.test_engine import build, corpus

pytestmark = pytest.mark.reliability

TOKEN = "fuzz-token-of-an-eng-caller"


def scripted_generator() -> Generator:
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body.get("stream"):
            chunk = {"choices": [{"delta": {"content": "doc 1 w5."}}]}
            return httpx.Response(200, text=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n")
        return httpx.Response(200, json={"model": "m", "choices": [{"message": {"content": "doc 1 w5 [1]."},
                                                                     "finish_reason": "stop"}]})  # fmt: skip

    return Generator(GeneratorSettings("http://gen/v1", model="m", retries=0), transport=httpx.MockTransport(handle))


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory, ray_local: None) -> Iterator[Any]:
    tmp = tmp_path_factory.mktemp("fuzz")
    embedder = FakeEmbedder(dim=32)
    lake = DocLake(str(tmp / "lake"), embedder)
    lake.write(corpus(120))
    build(lake, tmp / "index")
    engine = SearchEngine(Lake.at(str(tmp / "lake")), LocalStore(str(tmp / "index")), embedder,
                          ShardCache(tmp / "cache"), EngineOptions(nprobe=4))  # fmt: skip
    engine.start(background=False)
    (tmp / "tokens.json").write_text(json.dumps({"tokens": {TOKEN: {"principal": "fuzz", "groups": ["eng"]}}}))
    audit = AuditLog(engine.lake, flush_s=0.2)
    audit.start()
    answerer = Answerer(engine, scripted_generator(), audit)
    yield create_app(engine, Tokens.load(tmp / "tokens.json"), answerer, Lineage(engine.lake, audit))
    audit.stop()
    engine.stop()


def check(case: Any) -> None:
    for auth in ({"Authorization": f"Bearer {TOKEN}"}, {}, {"Authorization": "Bearer wrong-token-wrong-token"}):
        response = case.call(headers=auth)
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
        text = response.text
        assert "Traceback" not in text and 'File "' not in text, text[:500]
        if response.status_code >= 400:
            assert "error" in response.json(), text[:300]
        # Every response is what the OpenAPI document says: a documented status, the declared schema.
        case.validate_response(response, checks=[status_code_conformance, response_schema_conformance])
        if not auth and case.path not in ("/livez", "/readyz", "/healthz", "/metrics"):
            assert response.status_code != 200, f"{case.path} answered without a token"


def test_no_server_errors_and_no_internals_in_any_response(api: Any) -> None:
    # schemathesis' pytest plugin does not load on this pytest; drive its strategies directly.
    schema = schemathesis.openapi.from_asgi("/openapi.json", api)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 7
    for operation in operations:

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy())
        def fuzz(case: Any) -> None:
            check(case)

        fuzz()


def test_the_spec_the_fuzzer_reads_covers_every_route(api: Any) -> None:
    paths = set(api.openapi()["paths"])
    assert {"/v1/search", "/v1/answer", "/v1/lineage/answers/{answer_id}", "/v1/lineage/sources/{table}/{pk}",
            "/v1/lineage/chunks/{chunk_id}", "/livez", "/readyz", "/healthz", "/metrics"} <= paths, paths  # fmt: skip


def test_huge_and_malformed_bodies_are_4xx(api: Any) -> None:
    from fastapi.testclient import TestClient

    client = TestClient(api)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    for path in ("/v1/search", "/v1/answer"):
        assert client.post(path, content=b"{" * 100, headers=headers).status_code == 422
        assert client.post(path, content=b"\xff\xfe\x00garbage", headers=headers).status_code == 422
        assert client.post(path, content=b"x" * (65 * 1024), headers=headers).status_code == 413
        assert client.post(path, json=[1, 2, 3], headers=headers).status_code == 422
        assert client.post(path, json={"query": None, "question": None}, headers=headers).status_code == 422
