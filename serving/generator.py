"""One client for OpenAI-compatible chat completions: vLLM in production, llama.cpp here.

    gen = Generator(GeneratorSettings("http://vllm:8000/v1"))
    gen.complete(messages).text
    for token in gen.stream(messages): ...

Every request sends ``max_tokens`` and ``temperature`` (0 by default: answers are
reproducible). Connection failures (refused, reset, timed out while connecting) and
502/503/504 are retried a bounded number of times with backoff, but never once a stream
has produced tokens (a retry would repeat them). The model is the one configured, or the
first that ``GET /models`` lists.

Every way the server can fail surfaces as :class:`GeneratorError`, never as another
exception: transport errors at any point (a read or write broken mid-response, a pod
killed mid-stream), timeouts, error statuses, a 200 whose body is not the JSON expected,
and malformed stream frames.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from serving.retry import Retrying, attempts, retrying

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
            data = self._json(self._request("GET", "/models"))
            listed = data.get("data") if isinstance(data, dict) else None
            models = [m.get("id") for m in listed or [] if isinstance(m, dict)]
            if not models or not models[0]:
                raise GeneratorError(f"{self.where}/models lists no model; pass the model name.")
            self._model = str(models[0])
        return self._model

    def _json(self, response: httpx.Response) -> Any:
        """The response body as JSON; a body that is not (an HTML error page, a cut-off read) is an error."""
        try:
            return response.json()
        except (ValueError, httpx.HTTPError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise GeneratorError(
                f"the generator at {self.where} answered HTTP {response.status_code} with a body that is not JSON: "
                f"{response.text[:200]!r}"
            ) from exc

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

    def _retrying(self, what: str) -> Retrying:
        return retrying(
            retry_on=lambda exc: isinstance(exc, (*_RETRYABLE, _Busy)),
            stop=attempts(self.settings.retries + 1),
            first_s=self.settings.backoff_s,
            max_s=60.0,
            log=log,
            what=f"{what} to the generator at {self.where}",
        )

    def _unavailable(self, exc: Exception) -> GeneratorError:
        tries, why = self.settings.retries + 1, exc if isinstance(exc, _Busy) else _describe(exc)
        return GeneratorError(f"the generator at {self.where} is unavailable after {tries} attempts: {why}")

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        try:
            for attempt in self._retrying("request"):
                with attempt:
                    return self._request_once(method, path, body)
        except (*_RETRYABLE, _Busy) as exc:
            raise self._unavailable(exc) from exc
        raise AssertionError("unreachable: retrying() re-raises the last failure")

    def _request_once(self, method: str, path: str, body: dict[str, Any] | None) -> httpx.Response:
        try:
            response = self._http.request(method, path, json=body)
        except _RETRYABLE:
            raise
        except httpx.TimeoutException as exc:
            raise GeneratorError(f"the generator at {self.where} timed out: {exc}") from exc
        except httpx.HTTPError as exc:  # a read or write broken mid-response, a bad encoding, …
            raise GeneratorError(f"the generator at {self.where} failed mid-response: {_describe(exc)}") from exc
        if response.status_code in RETRY_STATUS:
            raise _Busy(f"HTTP {response.status_code}")
        if response.status_code >= 400:
            raise self._refused(response)
        return response

    def complete(self, messages: list[dict[str, str]], max_tokens: int | None = None) -> Completion:
        data = self._json(self._request("POST", "/chat/completions", self._body(messages, False, max_tokens)))
        try:
            choice = data["choices"][0]
            content = choice["message"]["content"] or ""
            if not isinstance(content, str):
                raise TypeError(f"content is {type(content).__name__}")
            usage = data.get("usage") or {}
            return Completion(content, str(data.get("model") or self.model), choice.get("finish_reason"),
                              usage if isinstance(usage, dict) else {})  # fmt: skip
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise GeneratorError(f"unexpected completion from the generator: {str(data)[:300]}") from exc

    def stream(self, messages: list[dict[str, str]], max_tokens: int | None = None) -> Iterator[str]:
        """Tokens (text deltas) as the server sends them (server-sent events)."""
        body = self._body(messages, True, max_tokens)
        try:
            for attempt in self._retrying("stream"):
                with attempt:
                    yield from self._stream_once(body)
                    return
        except _Busy as exc:
            raise self._unavailable(exc) from exc
        except _RETRYABLE as exc:
            raise GeneratorError(f"the generator stream from {self.where} broke: {_describe(exc)}") from exc

    def _stream_once(self, body: dict[str, Any]) -> Iterator[str]:
        """One streamed request; only a failure before the first token may be retried (as _RETRYABLE or _Busy)."""
        started = False
        try:
            with self._http.stream("POST", "/chat/completions", json=body) as response:
                if response.status_code in RETRY_STATUS:
                    raise _Busy(f"HTTP {response.status_code}")
                if response.status_code >= 400:
                    response.read()
                    raise self._refused(response)
                done = False
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        done = True
                        break
                    text, finish = _event(payload)
                    done = done or finish is not None
                    if text:
                        started = True
                        yield text
                if not done:  # no [DONE] and no finish_reason: the server went away mid-answer
                    raise GeneratorError(
                        f"the generator stream from {self.where} ended without [DONE]: the answer may be cut off."
                    )
        except _RETRYABLE as exc:
            if started:  # a retry would repeat the tokens already sent
                raise GeneratorError(f"the generator stream from {self.where} broke: {_describe(exc)}") from exc
            raise
        except httpx.TimeoutException as exc:
            raise GeneratorError(f"the generator at {self.where} timed out: {exc}") from exc
        except httpx.HTTPError as exc:  # a read broken mid-stream (the server's pod killed), …
            raise GeneratorError(f"the generator stream from {self.where} broke: {_describe(exc)}") from exc


class _Busy(Exception):
    """A 502/503/504: the server or its proxy is overloaded or restarting, so another try may succeed."""


#: failures before the server could have started answering: safe to retry (before any token)
_RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError)


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _event(payload: str) -> tuple[str | None, str | None]:
    """(text, finish_reason) of one stream event (``data: {...}``); a malformed event is an error."""
    try:
        event = json.loads(payload)
        if "error" in event and "choices" not in event:  # how servers report a failure mid-stream
            raise GeneratorError(f"the generator reported an error mid-stream: {str(event['error'])[:200]}")
        choices = event["choices"]
        if not choices:  # a usage-only event (stream_options.include_usage)
            return None, None
        text = (choices[0].get("delta") or {}).get("content")
        finish = choices[0].get("finish_reason")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise GeneratorError(f"unexpected stream event: {payload[:200]}") from exc
    if text is not None and not isinstance(text, str):
        raise GeneratorError(f"unexpected stream event: {payload[:200]}")
    return text, None if finish is None else str(finish)
