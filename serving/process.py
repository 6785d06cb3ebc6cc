"""Child processes that never outlive their parent, and free loopback ports."""

from __future__ import annotations

import ctypes
import socket
from collections.abc import Callable


def die_with_parent(signum: int) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets ``signum`` when its parent dies, even by kill -9."""

    def preexec() -> None:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signum)  # PR_SET_PDEATHSIG

    return preexec


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def bind_error(host: str, port: int) -> OSError | None:
    """Why host:port cannot be listened on (in use, no such address), or None if it can."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc
    return None
