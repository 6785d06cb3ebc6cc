"""A loopback HTTP proxy that records every request body on its way to the generator.

Tests point the service at it (``--generator-url``) to assert on the prompts actually
sent: which sources, in which order, and never a document the caller may not see.
Streamed responses are passed through as they arrive.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx


class RecordingProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _forward(self, method: str) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else None
                if body:
                    with proxy._lock:
                        proxy.requests.append(json.loads(body))
                path = self.path.removeprefix("/v1")
                with (
                    httpx.Client(timeout=300) as client,
                    client.stream(method, proxy.upstream + path, content=body,
                                  headers={"content-type": "application/json"}) as r,
                ):  # fmt: skip
                    self.send_response(r.status_code)
                    self.send_header("content-type", r.headers.get("content-type", "application/json"))
                    self.end_headers()  # HTTP/1.0: the body ends when the connection closes
                    for part in r.iter_raw():
                        self.wfile.write(part)
                        self.wfile.flush()

            def do_GET(self) -> None:
                self._forward("GET")

            def do_POST(self) -> None:
                self._forward("POST")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def prompts(self) -> list[str]:
        """The user message of every chat completion request so far."""
        with self._lock:
            return [m["content"] for r in self.requests for m in r.get("messages", []) if m.get("role") == "user"]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
