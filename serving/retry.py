"""Retrying a failed operation: the one policy every package uses, on tenacity.

Each caller states what differs (which failures are worth another try, and when to give
up: after a number of attempts, after a patience in seconds, or by its own rule); the
backoff, its cap and jitter, the warning logged before each wait and the injectable sleep
are the same everywhere. ``Retrying`` objects are used as iterators::

    for attempt in retrying(...):
        with attempt:
            ...  # an exception here is retried or re-raised as the policy says

so a body may keep state between attempts (the lake writer checks whether its previous
attempt landed) and a generator may yield inside it (the generator's stream).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

from tenacity import (
    RetryCallState,
    Retrying,
    retry_base,
    retry_if_exception,
    stop_after_attempt,
    stop_before_delay,
    stop_never,
)
from tenacity.stop import stop_base

__all__ = ["RetryCallState", "Retrying", "attempts", "patience", "retrying", "stop_base", "stop_when"]


class _Backoff:
    """``first_s · 2ⁿ`` capped at ``max_s``, each wait scaled by a random factor in 1 ± ``jitter``."""

    def __init__(self, first_s: float, max_s: float, jitter: float) -> None:
        self.first_s, self.max_s, self.jitter = first_s, max_s, jitter

    def __call__(self, state: RetryCallState) -> float:
        delay = min(self.max_s, self.first_s * 2.0 ** (state.attempt_number - 1))
        return delay * random.uniform(1 - self.jitter, 1 + self.jitter) if self.jitter else delay


def attempts(n: int) -> stop_base:
    """Give up after ``n`` attempts in all."""
    return stop_after_attempt(max(1, n))


def patience(seconds: float) -> stop_base:
    """Give up when the next wait would end ``seconds`` after the first attempt began (0: one attempt)."""
    return stop_before_delay(seconds) if seconds > 0 else stop_after_attempt(1)


def stop_when(rule: Callable[[RetryCallState], bool]) -> stop_base:
    """Give up by the caller's own rule (it sees the failure, the attempt and the coming wait)."""

    class _Rule(stop_base):
        def __call__(self, state: RetryCallState) -> bool:
            return rule(state)

    return _Rule()


def retrying(
    *,
    retry_on: Callable[[BaseException], bool],
    stop: stop_base = stop_never,
    first_s: float = 0.5,
    max_s: float = 30.0,
    jitter: float = 0.0,
    log: logging.Logger | None = None,
    what: str = "operation",
    sleep: Callable[[float], None] = time.sleep,
) -> Retrying:
    """A retry loop: failures for which ``retry_on`` is true are retried until ``stop``.

    The last failure is re-raised as it was (never wrapped in tenacity's ``RetryError``),
    so callers handle the same exceptions whether or not a retry happened.
    """
    predicate: retry_base = retry_if_exception(retry_on)

    def before_sleep(state: RetryCallState) -> None:
        if log is not None and state.outcome is not None:
            log.warning(
                "%s failed (attempt %d: %s); retrying in %.1f s",
                what, state.attempt_number, state.outcome.exception(), state.upcoming_sleep,
            )  # fmt: skip

    return Retrying(
        retry=predicate,
        stop=stop,
        wait=_Backoff(first_s, max_s, jitter),
        sleep=sleep,
        before_sleep=before_sleep,
        reraise=True,
    )
