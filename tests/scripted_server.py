"""A TCP server on loopback that answers each HTTP request with scripted raw bytes.

It fails the way real servers fail: a response cut off mid-body, a connection reset
(RST) mid-stream as when a pod is killed, a body that is not what the headers promise.
Each accepted connection reads one request, then plays the next script::

    with ScriptedServer() as server:
        server.play(headers(200, "application/json", length=100) + b'{"choi', reset=True)
        ...  # a client pointed at server.url gets a read error half-way through the body
"""

from __future__ import annotations

import queue
import socket
import struct
import threading
from dataclasses import dataclass
from types import TracebackType


@dataclass(frozen=True)
class Script:
    parts: tuple[bytes, ...]  # written one after the other, with a short pause between them
    reset: bool = False  # end with an RST (SO_LINGER 0) instead of a clean close
    pause_s: float = 0.05


def headers(status: int, content_type: str, length: int | None = None, extra: str = "") -> bytes:
    lines = [f"HTTP/1.1 {status} X", f"Content-Type: {content_type}", "Connection: close"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


def sse(*events: str) -> bytes:
    return b"".join(f"data: {e}\n\n".encode() for e in events)


class ScriptedServer:
    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self._sock.settimeout(0.2)
        self.port = int(self._sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._scripts: queue.Queue[Script] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="scripted-server", daemon=True)
        self.requests = 0

    def play(self, *parts: bytes, reset: bool = False) -> None:
        self._scripts.put(Script(parts, reset))

    def __enter__(self) -> ScriptedServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object | type[BaseException] | TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            with conn:
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        while len(body) < length:
            body += conn.recv(65536)
        self.requests += 1
        script = self._scripts.get(timeout=5)
        for part in script.parts:
            conn.sendall(part)
            self._stop.wait(script.pause_s)
        if script.reset:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
