"""The OpenAI-compatible client against scripted servers (httpx mock transports)."""

from __future__ import annotations

import json

import httpx
import pytest

from serving.generator import Generator, GeneratorError, GeneratorSettings

MESSAGES = [{"role": "user", "content": "hi"}]


def server(handler):  # type: ignore[no-untyped-def]
    sent: list[dict] = []

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        sent.append({"path": request.url.path, "body": body})
        return handler(request, body, len(sent))

    return httpx.MockTransport(handle), sent


def completion(text: str) -> dict:
    return {"model": "m", "choices": [{"message": {"content": text}, "finish_reason": "stop"}], "usage": {"x": 1}}


def test_model_discovery_and_a_completion_send_max_tokens_and_temperature() -> None:
    def handler(request, body, n):  # type: ignore[no-untyped-def]
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "smol"}, {"id": "other"}]})
        return httpx.Response(200, json=completion("hello"))

    transport, sent = server(handler)
    gen = Generator(GeneratorSettings("http://gen/v1", max_tokens=42), transport)
    out = gen.complete(MESSAGES)
    assert out.text == "hello" and out.finish_reason == "stop"
    body = sent[-1]["body"]
    assert sent[-1]["path"] == "/v1/chat/completions"
    assert body["model"] == "smol" and body["max_tokens"] == 42 and body["temperature"] == 0.0
    assert body["stream"] is False


def test_connection_errors_and_503_are_retried_a_bounded_number_of_times() -> None:
    def flaky(request, body, n):  # type: ignore[no-untyped-def]
        if n == 1:
            raise httpx.ConnectError("refused")
        if n == 2:
            return httpx.Response(503)
        return httpx.Response(200, json=completion("ok"))

    transport, sent = server(flaky)
    settings = GeneratorSettings("http://gen/v1", model="m", retries=2, backoff_s=0)
    assert Generator(settings, transport).complete(MESSAGES).text == "ok" and len(sent) == 3

    transport, sent = server(lambda r, b, n: httpx.Response(503))
    with pytest.raises(GeneratorError, match="unavailable after 3 attempts"):
        Generator(settings, transport).complete(MESSAGES)
    transport, sent = server(lambda r, b, n: httpx.Response(400, json={"error": "bad"}))
    with pytest.raises(GeneratorError, match="refused the request: HTTP 400"):
        Generator(settings, transport).complete(MESSAGES)
    assert len(sent) == 1  # 4xx is not retried


def sse(*events: str) -> bytes:
    return "".join(f"data: {e}\n\n" for e in events).encode()


def test_streaming_yields_deltas_until_done() -> None:
    chunks = [json.dumps({"choices": [{"delta": {"content": t}}]}) for t in ("Hel", "lo", " world")]
    role = json.dumps({"choices": [{"delta": {"role": "assistant"}}]})

    def handler(request, body, n):  # type: ignore[no-untyped-def]
        assert body["stream"] is True
        return httpx.Response(200, content=sse(role, *chunks, "[DONE]"), headers={"content-type": "text/event-stream"})

    transport, _ = server(handler)
    gen = Generator(GeneratorSettings("http://gen/v1", model="m"), transport)
    assert list(gen.stream(MESSAGES)) == ["Hel", "lo", " world"]

    transport, _ = server(lambda r, b, n: httpx.Response(200, content=sse("{not json")))
    with pytest.raises(GeneratorError, match="unexpected stream event"):
        list(Generator(GeneratorSettings("http://gen/v1", model="m"), transport).stream(MESSAGES))


def test_no_models_listed_is_a_clear_error() -> None:
    transport, _ = server(lambda r, b, n: httpx.Response(200, json={"data": []}))
    with pytest.raises(GeneratorError, match="lists no model"):
        Generator(GeneratorSettings("http://gen/v1"), transport).model  # noqa: B018
