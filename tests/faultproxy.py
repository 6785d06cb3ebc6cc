"""A TCP proxy that injects faults into a plain-HTTP dependency (the moto S3 server).

Everything is forwarded byte for byte until a trap fires: when a client's bytes contain the
trap's pattern (a request line such as ``PUT /index/idx/versions/``), the proxy can

- ``hold``: stop forwarding that connection (the request never reaches the server) and set
  ``trap.hit``, so a test can kill the client while its request hangs;
- ``lose_answer``: forward the request, let the server answer, but drop the answer and the
  connection and go ``down`` for ``outage_s`` (the request landed; the client saw an error);
- ``refuse``: drop the connection unforwarded and go ``down`` for ``outage_s``.

``down()`` closes the listening socket and every open connection (new connections are
refused); ``up()`` listens on the same port again.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class Trap:
    pattern: bytes
    action: str  # hold | lose_answer | refuse
    outage_s: float = 10.0
    hit: threading.Event = field(default_factory=threading.Event)
    fired_at: float | None = None


class FaultProxy:
    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self.url = f"http://127.0.0.1:{self.port}"
        self.trap: Trap | None = None
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._answers: dict[socket.socket, threading.Event] = {}  # server sockets whose answers are swallowed
        self._listener: socket.socket | None = None
        self._closed = False
        self.up()

    # -- control -------------------------------------------------------------
    def up(self) -> None:
        if self._listener is not None:
            return
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            _close(listener)  # shutdown wakes the thread blocked in accept(); close alone would not
        with self._lock:
            conns, self._conns = set(self._conns), set()
        for conn in conns:
            _close(conn)

    def set_trap(self, pattern: bytes, action: str, outage_s: float = 10.0) -> Trap:
        self.trap = Trap(pattern, action, outage_s)
        return self.trap

    def close(self) -> None:
        self._closed = True
        self.trap = None
        self.down()

    # -- plumbing ------------------------------------------------------------
    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by down()
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                _close(client)
                continue
            server.settimeout(None)
            with self._lock:
                self._conns |= {client, server}
            threading.Thread(target=self._upstream, args=(client, server), daemon=True).start()
            threading.Thread(target=self._downstream, args=(server, client), daemon=True).start()

    def _upstream(self, client: socket.socket, server: socket.socket) -> None:
        tail = b""
        while True:
            try:
                data = client.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            window = tail + data
            tail = window[-256:]
            with self._lock:  # concurrent uploads: exactly one of them springs the trap
                trap = self.trap
                if trap is not None and trap.pattern in window:
                    self.trap = None
                else:
                    trap = None
            if trap is not None:
                self._fire(trap, client, server, data)
                return
            try:
                server.sendall(data)
            except OSError:
                break
        _close(client)
        _close(server)

    def _downstream(self, server: socket.socket, client: socket.socket) -> None:
        while True:
            try:
                data = server.recv(65536)
                if not data:
                    break
                answered = self._answers.get(server)
                if answered is not None:
                    answered.set()
                    continue
                client.sendall(data)
            except OSError:
                break
        _close(client)
        _close(server)

    def _fire(self, trap: Trap, client: socket.socket, server: socket.socket, data: bytes) -> None:
        trap.fired_at = time.monotonic()
        log.warning("fault proxy: %s on %r", trap.action, trap.pattern)
        if trap.action == "hold":
            trap.hit.set()  # keep both sockets open, forward nothing more
            return
        if trap.action == "lose_answer":
            answered = self._answers[server] = threading.Event()
            server.sendall(data)
            client.settimeout(0.01)
            deadline = time.monotonic() + 10
            while not answered.is_set() and time.monotonic() < deadline:
                try:  # the body may still be arriving: forward it
                    more = client.recv(65536)
                    if more:
                        server.sendall(more)
                except TimeoutError:
                    pass
                except OSError:
                    break
        self.down()
        trap.hit.set()
        if not self._closed:
            threading.Timer(trap.outage_s, self._back_up).start()

    def _back_up(self) -> None:
        if not self._closed:
            self.up()


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
