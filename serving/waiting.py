"""Work that must not wait: the retrieval service answers a search on its event loop's
thread while everything the search needs is in memory, and hands it to a worker thread the
moment it would wait for anything else.

Inside ``without_waiting()``, each place that would wait (object-store and disk reads, the
query embedder, a lock another thread may hold for long, work of tens of milliseconds)
calls ``may_wait()`` first, which raises ``WouldWait`` there instead, and the caller starts
the work again where waiting is allowed. Everywhere else it is a no-op.
The flag is a context variable: it follows the request's task, not the thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_NO_WAITING: ContextVar[bool] = ContextVar("streamrag_no_waiting", default=False)


class WouldWait(Exception):
    """Work inside ``without_waiting()`` reached something that would wait (named in the message)."""


@contextmanager
def without_waiting() -> Iterator[None]:
    token = _NO_WAITING.set(True)
    try:
        yield
    finally:
        _NO_WAITING.reset(token)


def may_wait(what: str) -> None:
    """Called before ``what`` waits: raises ``WouldWait`` inside ``without_waiting()``."""
    if _NO_WAITING.get():
        raise WouldWait(what)
