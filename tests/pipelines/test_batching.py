"""Adaptive micro-batches (pipelines/batching.py): a lone change goes at once, a backlog batches."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import bytewax.operators as op
from bytewax.dataflow import Dataflow
from bytewax.operators import _CollectState
from bytewax.testing import TestingSink, TestingSource, run_main

from pipelines.batching import _AdaptiveCollect, _Batch, _resumed, adaptive_collect

TIMEOUT = timedelta(milliseconds=200)


def test_every_item_comes_out_once_in_order_per_key() -> None:
    flow = Dataflow("adaptive")
    items = [("a" if i % 3 else "b", i) for i in range(100)]
    up = op.input("in", flow, TestingSource(items, batch_size=7))
    out: list = []
    op.output("out", adaptive_collect("batch", up, TIMEOUT, 8), TestingSink(out))
    run_main(flow)
    for key in "ab":
        batches = [b for k, b in out if k == key]
        assert all(1 <= len(b) <= 8 for b in batches)
        assert [x for b in batches for x in b] == [i for k, i in items if k == key]


def test_the_wait_shrinks_to_zero_when_quiet_and_grows_to_the_timeout_under_a_backlog() -> None:
    logic: _AdaptiveCollect[int] = _AdaptiveCollect(_Batch(), TIMEOUT, 8)
    # quiet: one item per activation, emitted when due, and due at once
    for i in range(3):
        before = datetime.now(UTC)
        assert logic.on_item(i) == ([], False)
        due = logic.notify_at()
        assert due is not None and due - before < timedelta(milliseconds=50)
        assert logic.on_notify()[0] == [[i]]
        assert logic.notify_at() is None
    assert logic.state.linger == timedelta(0)
    # a backlog: full batches go at once, and the wait grows toward the timeout
    waits = []
    for n in range(12):
        emitted = [b for i in range(8) for b in logic.on_item(n * 8 + i)[0]]
        assert emitted == [list(range(n * 8, n * 8 + 8))]
        waits.append(logic.state.linger)
    assert waits == sorted(waits) and waits[0] > timedelta(0) and waits[-1] == TIMEOUT
    # the backlog drains: small batches bring the wait back down to zero
    for i in range(20):
        logic.on_item(i)
        logic.on_notify()
    assert logic.state.linger == timedelta(0)


def test_a_batch_held_by_bytewax_collect_before_an_upgrade_is_taken_over() -> None:
    """Recovery directories written with ``op.collect`` hold a _CollectState at the same step id."""
    flow = Dataflow("legacy")
    up = op.input("in", flow, TestingSource([("a", 1)]))
    collected = adaptive_collect("batch", up, TIMEOUT, 8)
    assert collected.stream_id.startswith("legacy.batch.stateful")  # where collect kept its state
    logic = _resumed(_CollectState(acc=[10, 11], timeout_at=datetime.now(UTC)), TIMEOUT, 8)
    assert logic.notify_at() is not None and logic.on_notify()[0] == [[10, 11]]
    ours = _resumed(_Batch([], None, timedelta(milliseconds=40)), TIMEOUT, 8)
    assert ours.state.linger == timedelta(milliseconds=40) and ours.notify_at() is None
    assert _resumed(None, TIMEOUT, 8).state.items == []
