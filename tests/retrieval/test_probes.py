"""Probes that fit Kubernetes: liveness never waits on work, readiness waits for the index.

A real uvicorn server runs the API; a slow streaming generator (a token every 0.3 s)
keeps 40 answers streaming at once, more than the default thread pool holds. Probes and
searches must still answer promptly while every stream is in flight.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from pipelines.lake import Lake
from retrieval.answer import Answerer
from retrieval.api import create_app
from retrieval.audit import AuditLog
from retrieval.auth import Tokens
from serving.generator import Generator, GeneratorSettings
from tests.conftest import free_port
from tests.retrieval.test_answer import TEXTS, StubEngine

STREAMS = 40
TOKENS = 40  # × 0.3 s: each stream lasts about 12 s


@dataclass(frozen=True)
class _View:
    index_version: int = 3
    lake_version: int = 7


class ReadyEngine(StubEngine):
    ready = False
    problem: str | None = None

    def current_view(self) -> _View:
        return _View()

    def health(self) -> dict[str, Any]:
        if not self.ready:
            return {"status": "starting"}
        problems = [self.problem] if self.problem else []
        return {"status": "degraded" if problems else "ok", "problems": problems, "index_version": 3, "tail_rows": 5}


async def slow_tokens(request: Request) -> StreamingResponse:
    async def tokens() -> AsyncIterator[str]:
        for i in range(TOKENS):
            await asyncio.sleep(0.3)
            yield "data: " + json.dumps({"choices": [{"delta": {"content": f"w{i} "}, "finish_reason": None}]}) + "\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(tokens(), media_type="text/event-stream")


@dataclass
class Running:
    url: str
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)


def run(app: Any) -> Running:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    return Running(f"http://127.0.0.1:{port}", server, thread)


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[str, ReadyEngine]]:
    generator_app = run(Starlette(routes=[Route("/v1/chat/completions", slow_tokens, methods=["POST"])]))
    engine = ReadyEngine(TEXTS)
    audit = AuditLog(Lake.at(str(tmp_path / "lake")), flush_s=0.2)
    audit.start()
    settings = GeneratorSettings(generator_app.url + "/v1", model="m", retries=0)
    tokens_file = tmp_path / "tokens.yaml"
    tokens_file.write_text("secret-token-of-ops-0123: {principal: ops, groups: []}\n")
    answerer = Answerer(engine, Generator(settings), audit)  # type: ignore[arg-type]
    service = run(create_app(engine, Tokens.load(tokens_file), answerer))  # type: ignore[arg-type]
    yield service.url, engine
    service.stop()
    generator_app.stop()
    audit.stop()


AUTH = {"Authorization": "Bearer secret-token-of-ops-0123"}


def test_liveness_and_readiness_stay_prompt_under_40_streamed_answers(api: tuple[str, ReadyEngine]) -> None:
    url, engine = api
    assert httpx.get(f"{url}/livez").status_code == 200
    starting = httpx.get(f"{url}/readyz")
    assert starting.status_code == 503 and starting.json() == {"status": "starting"}
    engine.ready = True
    assert httpx.get(f"{url}/readyz").json() == {"status": "ready", "index_version": 3, "lake_version": 7}

    first_tokens = threading.Semaphore(0)

    def stream() -> list[str]:
        names = []
        body = {"question": "How do penguins swim?", "k": 2, "stream": True}
        with httpx.stream("POST", f"{url}/v1/answer", json=body, headers=AUTH, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("event: "):
                    if not names:
                        first_tokens.release()
                    names.append(line[7:])
        return names

    with ThreadPoolExecutor(STREAMS) as pool:
        futures = [pool.submit(stream) for _ in range(STREAMS)]
        for _ in range(STREAMS):  # every stream is under way: the first token of each has arrived
            assert first_tokens.acquire(timeout=30)
        in_flight = sum(not f.done() for f in futures)
        probes = []
        for _ in range(5):
            for path in ("/livez", "/readyz", "/healthz"):
                t0 = time.monotonic()
                r = httpx.get(f"{url}{path}", timeout=5)  # a blocked pool would make this time out
                probes.append((path, r.status_code, time.monotonic() - t0))
            r = httpx.post(f"{url}/v1/search", json={"query": "penguins"}, headers=AUTH, timeout=5)
            probes.append(("/v1/search", r.status_code, 0.0))
            time.sleep(0.2)
        still_in_flight = sum(not f.done() for f in futures)
        results = [f.result() for f in futures]
    assert in_flight == STREAMS and still_in_flight == STREAMS, "the probes must have run while all streams did"
    assert all(status == 200 for _, status, _ in probes), probes
    assert all(names[-1] == "done" and names.count("token") == TOKENS for names in results)


def test_health_details_are_for_authenticated_callers(api: tuple[str, ReadyEngine]) -> None:
    url, engine = api
    engine.ready = True
    engine.problem = "lake: cannot reach http://10.1.2.3:9000/secret-bucket/lake (connection refused)"
    public = httpx.get(f"{url}/healthz").json()
    assert public["status"] == "degraded" and public["problems"] == ["lake"]
    assert "secret-bucket" not in json.dumps(public) and "tail_rows" not in public
    private = httpx.get(f"{url}/healthz", headers=AUTH).json()
    assert "secret-bucket" in private["problems"][0] and private["tail_rows"] == 5
    assert httpx.get(f"{url}/healthz", headers={"Authorization": "Bearer wrong"}).json()["problems"] == ["lake"]
