"""The API's request histogram (``RequestTiming``): route and status class of every request,
whatever answered it, and a streamed response timed to its end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Histogram
from pydantic import BaseModel

from retrieval.http import BodyLimit, RequestTiming


class Query(BaseModel):
    query: str


def app_and_histogram() -> tuple[FastAPI, CollectorRegistry]:
    registry = CollectorRegistry()
    histogram = Histogram("t_request_seconds", "test", ["route", "status"], registry=registry,
                          buckets=(0.05, 0.2, 1.0))  # fmt: skip
    app = FastAPI()

    @app.post("/v1/items/{item}")
    def item(item: int, body: Query) -> dict[str, object]:
        return {"item": item, "query": body.query}

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("a bug")

    @app.get("/stream")
    def stream() -> StreamingResponse:
        def events() -> Iterator[bytes]:
            yield b"first\n"
            time.sleep(0.3)
            yield b"last\n"

        return StreamingResponse(events(), media_type="text/plain")

    app.add_middleware(BodyLimit, limit=100)
    app.add_middleware(RequestTiming, histogram=histogram)
    return app, registry


def count(registry: CollectorRegistry, route: str, status: str) -> float:
    return registry.get_sample_value("t_request_seconds_count", {"route": route, "status": status}) or 0.0


def test_every_request_is_counted_under_its_route_and_status_class() -> None:
    app, registry = app_and_histogram()
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.post("/v1/items/3", json={"query": "q"}).status_code == 200
        # curl -d sends a form content type: BodyLimit reads it as JSON and the route is still known
        form = {"content-type": "application/x-www-form-urlencoded"}
        assert client.post("/v1/items/4", content=b'{"query": "q"}', headers=form).status_code == 200
        assert client.post("/v1/items/x", json={"query": "q"}).status_code == 422
        assert client.get("/nowhere").status_code == 404
        assert client.post("/v1/items/5", content=b"x" * 200).status_code == 413  # refused before routing
        assert client.get("/boom").status_code == 500
    assert count(registry, "/v1/items/{item}", "2xx") == 2
    assert count(registry, "/v1/items/{item}", "4xx") == 1
    assert count(registry, "unmatched", "4xx") == 2
    assert count(registry, "/boom", "5xx") == 1


def test_a_streamed_response_is_timed_to_its_last_byte() -> None:
    app, registry = app_and_histogram()
    with TestClient(app) as client:
        assert client.get("/stream").text == "first\nlast\n"
    # the 0.3 s pause comes after the response started: timed to the start it would fall in 0.05
    under = {"route": "/stream", "status": "2xx", "le": "0.2"}
    assert registry.get_sample_value("t_request_seconds_bucket", under) == 0
    assert count(registry, "/stream", "2xx") == 1


def test_websocket_and_lifespan_scopes_pass_through() -> None:
    registry = CollectorRegistry()
    seen: list[str] = []

    async def inner(scope: dict[str, object], receive: object, send: object) -> None:
        seen.append(str(scope["type"]))

    histogram = Histogram("t_other_seconds", "test", ["route", "status"], registry=registry)
    asyncio.run(RequestTiming(inner, histogram)({"type": "lifespan"}, None, None))  # type: ignore[arg-type]
    assert seen == ["lifespan"]
    assert registry.get_sample_value("t_other_seconds_count", {"route": "unmatched", "status": "5xx"}) is None
