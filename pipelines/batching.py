"""Micro-batches whose wait adapts to the backlog: a lone change goes at once, a flood batches.

Bytewax's ``collect`` waits a fixed timeout after each item, so a single change on a quiet
stream always waits that long before it is embedded and committed. Here the wait
(``linger``) follows the batches themselves:

- a batch emitted well below ``max_size`` means the stream is quiet: the linger halves,
  down to zero (a batch is then emitted at the end of the activation that brought its
  first item: whatever the Kafka poll returned together is embedded together);
- a batch that filled to half of ``max_size`` or more means a backlog: the linger
  doubles (from 5 ms), up to ``timeout``, so embedding and commits are amortised.

A full batch is always emitted at once. The linger is part of the recovered state.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Generic, TypeVar

from bytewax.dataflow import operator
from bytewax.operators import KeyedStream, StatefulLogic, stateful

V = TypeVar("V")

_FIRST_STEP = timedelta(milliseconds=5)


@dataclass
class _Batch(Generic[V]):
    items: list[V] = field(default_factory=list)
    due: datetime | None = None
    linger: timedelta = timedelta(0)


class _AdaptiveCollect(StatefulLogic[V, list[V], _Batch[V]]):
    def __init__(self, state: _Batch[V], timeout: timedelta, max_size: int) -> None:
        self.state, self.timeout, self.max_size = state, timeout, max_size

    def on_item(self, value: V) -> tuple[list[list[V]], bool]:
        if not self.state.items:
            self.state.due = datetime.now(UTC) + self.state.linger
        self.state.items.append(value)
        if len(self.state.items) >= self.max_size:
            return [self._emit()], StatefulLogic.RETAIN
        return [], StatefulLogic.RETAIN

    def on_notify(self) -> tuple[list[list[V]], bool]:
        return ([self._emit()] if self.state.items else []), StatefulLogic.RETAIN

    def on_eof(self) -> tuple[list[list[V]], bool]:
        return ([self._emit()] if self.state.items else []), StatefulLogic.RETAIN

    def notify_at(self) -> datetime | None:
        return self.state.due if self.state.items else None

    def snapshot(self) -> _Batch[V]:
        return copy.deepcopy(self.state)

    def _emit(self) -> list[V]:
        items, state = self.state.items, self.state
        if len(items) * 2 >= self.max_size:  # a backlog: wait longer, batch more
            state.linger = min(self.timeout, max(_FIRST_STEP, state.linger * 2))
        else:  # quiet: wait less
            state.linger = state.linger / 2 if state.linger > _FIRST_STEP else timedelta(0)
        state.items, state.due = [], None
        return items


@operator
def adaptive_collect(step_id: str, up: KeyedStream[V], timeout: timedelta, max_size: int) -> KeyedStream[list[V]]:
    """Like ``bytewax.operators.collect``, with a wait that adapts to the backlog (see the module).

    Its state lives at the same step id as ``collect``'s (``<step_id>.stateful``), and a
    state that ``collect`` snapshotted is taken over, so a recovery directory written
    before this operator existed resumes without losing the batch it held.
    """

    return stateful("stateful", up, lambda resume: _resumed(resume, timeout, max_size))


def _resumed(resume: object, timeout: timedelta, max_size: int) -> _AdaptiveCollect[V]:
    """The logic for a key, from its recovered state: ours, ``collect``'s, or none."""
    if isinstance(resume, _Batch):
        return _AdaptiveCollect(resume, timeout, max_size)
    items = list(getattr(resume, "acc", None) or [])  # bytewax.operators._CollectState
    return _AdaptiveCollect(_Batch(items, datetime.now(UTC) if items else None), timeout, max_size)
