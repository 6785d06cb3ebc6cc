"""One client for OpenAI-compatible chat completions: vLLM in production, llama.cpp here.

    gen = Generator(GeneratorSettings("http://vllm:8000/v1"))
    gen.complete(messages).text
    for token in gen.stream(messages): ...

Every request sends ``max_tokens`` and ``temperature`` (0 by default: answers are
reproducible). Connection failures (refused, reset, timed out while connecting) and
502/503/504 are retried a bounded number of times with backoff, but never once a stream
has produced tokens (a retry would repeat them). The model is the one configured, or the
first that ``GET /models`` lists.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

log = logging.getLogger(__name__)

RETRY_STATUS = {502, 503, 504}


class GeneratorError(Exception):
    """The generator could not answer; the message says why."""


@dataclass(frozen=True)
class GeneratorSettings:
    base_url: str  # e.g. http://127.0.0.1:8000/v1
    model: str | None = None
    api_key: str | None = field(default=None, repr=False)
    max_tokens: int = 256
    temperature: float = 0.0
    timeout_s: float = 120.0
    connect_timeout_s: float = 5.0
    retries: int = 2
    backoff_s: float = 0.5


@dataclass
class Completion:
    text: str
    model: str
    finish_reason: str | None
    usage: dict[str, Any] = field(default_factory=dict)


def display_url(url: str) -> str:
    """``http://user:secret@host/v1`` → ``http://user:***@host/v1``."""
    return _with_credentials(url, lambda user: f"{user}:***@")


def _without_credentials(url: str) -> str:
    return _with_credentials(url, lambda _user: "")


def _with_credentials(url: str, shown: Callable[[str], str]) -> str:
    """The URL with its ``user:password@`` part, if it has a password, replaced by ``shown(user)``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    credentials, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=shown(credentials.partition(":")[0]) + host))


class Generator:
    def __init__(self, settings: GeneratorSettings, transport: httpx.BaseTransport | None = None) -> None:
        self.settings = settings
        #: the URL as errors, logs and the audit log show it: without a password in it
        self.where = display_url(settings.base_url)
        base = settings.base_url.rstrip("/")
        headers = {}
        if settings.api_key:
            headers["Authorization"] = f"Bearer {settings.api_key}"
            if urlsplit(base).password is not None:  # httpx would send them as Basic auth instead of the key
                log.warning("generator at %s: using the API key; the credentials in the URL are ignored", self.where)
                base = _without_credentials(base)
        self._http = httpx.Client(
            base_url=base,
            headers=headers,
            timeout=httpx.Timeout(settings.timeout_s, connect=settings.connect_timeout_s),
            transport=transport,
        )
        self._model = settings.model

    def close(self) -> None:
        self._http.close()

    @property
    def model(self) -> str:
        if self._model is None:
            response = self._request("GET", "/models")
            models = [m.get("id") for m in response.json().get("data", []) if isinstance(m, dict)]
            if not models or not models[0]:
                raise GeneratorError(f"{self.where}/models lists no model; pass the model name.")
            self._model = str(models[0])
        return self._model

    def _refused(self, response: httpx.Response) -> GeneratorError:
        """The server's error, without our API key (some servers echo the credentials they refuse)."""
        text, key = response.text, self.settings.api_key
        text = text.replace(key, "***") if key else text
        return GeneratorError(f"the generator refused the request: HTTP {response.status_code} {text[:300]}")

    def _body(self, messages: list[dict[str, str]], stream: bool, max_tokens: int | None) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens or self.settings.max_tokens,
            "temperature": self.settings.temperature,
            "stream": stream,
        }

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        last: Exception | None = None
        for attempt in range(self.settings.retries + 1):
            if attempt:
                time.sleep(self.settings.backoff_s * 2 ** (attempt - 1))
            try:
                response = self._http.request(method, path, json=body)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as exc:
                last = exc
                log.warning("generator at %s unreachable (attempt %d): %s", self.where, attempt + 1, exc)
                continue
            except httpx.TimeoutException as exc:
                raise GeneratorError(f"the generator at {self.where} timed out: {exc}") from exc
            if response.status_code in RETRY_STATUS:
                last = GeneratorError(f"HTTP {response.status_code}")
                continue
            if response.status_code >= 400:
                raise self._refused(response)
            return response
        attempts = self.settings.retries + 1
        raise GeneratorError(f"the generator at {self.where} is unavailable after {attempts} attempts: {last}")

    def complete(self, messages: list[dict[str, str]], max_tokens: int | None = None) -> Completion:
        data = self._request("POST", "/chat/completions", self._body(messages, False, max_tokens)).json()
        try:
            choice = data["choices"][0]
            return Completion(
                choice["message"]["content"] or "", data.get("model", self.model), choice.get("finish_reason"),
                data.get("usage") or {},
            )  # fmt: skip
        except (KeyError, IndexError, TypeError) as exc:
            raise GeneratorError(f"unexpected completion from the generator: {str(data)[:300]}") from exc

    def stream(self, messages: list[dict[str, str]], max_tokens: int | None = None) -> Iterator[str]:
        """Tokens (text deltas) as the server sends them (server-sent events)."""
        body = self._body(messages, True, max_tokens)
        for attempt in range(self.settings.retries + 1):
            if attempt:
                time.sleep(self.settings.backoff_s * 2 ** (attempt - 1))
            started = False
            try:
                with self._http.stream("POST", "/chat/completions", json=body) as response:
                    if response.status_code in RETRY_STATUS and attempt < self.settings.retries:
                        continue
                    if response.status_code >= 400:
                        response.read()
                        raise self._refused(response)
                    for line in response.iter_lines():
                        if not line.startswith("data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == "[DONE]":
                            return
                        try:
                            delta = json.loads(payload)["choices"][0].get("delta", {})
                        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
                            raise GeneratorError(f"unexpected stream event: {payload[:200]}") from exc
                        text = delta.get("content")
                        if text:
                            started = True
                            yield text
                    return
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as exc:
                if started or attempt >= self.settings.retries:
                    raise GeneratorError(f"the generator stream from {self.where} broke: {exc}") from exc
                log.warning("generator unreachable (attempt %d): %s", attempt + 1, exc)
            except httpx.TimeoutException as exc:
                raise GeneratorError(f"the generator at {self.where} timed out: {exc}") from exc
        raise GeneratorError(f"the generator at {self.where} is unavailable.")
