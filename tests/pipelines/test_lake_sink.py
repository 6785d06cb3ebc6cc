"""The lake sink commits on a thread of its own, one commit in flight, in order; batches
handed over meanwhile land together in the next commit; and an epoch never ends
(snapshot) or a job never finishes (close) before its rows landed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pytest

from pipelines.lake_sink import _LakePartition


class SlowWriter:
    """A LakeWriter stand-in: each commit waits for ``gate`` and may fail."""

    app_id = "job:chunks:000"
    table_name = "dead_letters"  # no event_time column needed

    def __init__(self, fail_on: int | None = None) -> None:
        self.gate = threading.Event()
        self.seq = 0
        self.committed: list[list[int]] = []
        self.busy = 0
        self.most_busy = 0
        self.fail_on = fail_on
        self._lock = threading.Lock()

    @property
    def recovery_state(self) -> tuple[int, int]:
        return self.seq, self.seq

    def write(self, rows: pa.Table, before_commit: Callable[[pa.Table], None] | None = None) -> pa.Table:
        with self._lock:
            self.busy += 1
            self.most_busy = max(self.most_busy, self.busy)
        try:
            assert self.gate.wait(10)
            if self.fail_on == self.seq + 1:
                raise OSError("the object store said no")
            self.committed.append(rows.column("n").to_pylist())
            self.seq += 1
            return rows
        finally:
            with self._lock:
                self.busy -= 1


def batch(*ns: int) -> list[pa.Table]:
    return [pa.table({"n": list(ns)})]


def committing(writer: SlowWriter) -> None:
    """Wait until the commit thread is inside a commit (it took what was pending)."""
    deadline = time.monotonic() + 10
    while writer.busy == 0:
        assert time.monotonic() < deadline, "the commit thread never started a commit"
        time.sleep(0.001)


def in_thread(fn: Callable[[], Any]) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_the_worker_goes_on_while_a_commit_is_in_flight() -> None:
    writer = SlowWriter()
    part = _LakePartition(writer, None)  # type: ignore[arg-type]
    part.write_batch(batch(1, 2))  # returns although the commit cannot finish yet
    committing(writer)
    part.write_batch(batch(3))  # and so do the batches after it
    part.write_batch(batch(4, 5))
    assert writer.committed == []
    writer.gate.set()
    assert part.snapshot() == (2, 2)  # all landed before the epoch ends
    assert writer.committed == [[1, 2], [3, 4, 5]], "what waited for the commit in flight lands in one commit"
    assert writer.most_busy == 1
    part.write_batch(batch(6))  # a quiet stream: a lone batch commits at once
    assert part.snapshot() == (3, 3)
    assert writer.committed[-1] == [6]
    part.close()


def test_the_worker_waits_once_enough_rows_are_held() -> None:
    writer = SlowWriter()
    part = _LakePartition(writer, None, max_pending_rows=3)  # type: ignore[arg-type]
    part.write_batch(batch(1))  # in flight
    committing(writer)
    part.write_batch(batch(2, 3, 4))  # held: 3 rows
    blocked = in_thread(lambda: part.write_batch(batch(5)))
    blocked.join(0.3)
    assert blocked.is_alive(), "past max_pending_rows the worker must wait (backpressure)"
    writer.gate.set()
    blocked.join(10)
    assert not blocked.is_alive()
    part.snapshot()
    assert [n for rows in writer.committed for n in rows] == [1, 2, 3, 4, 5], "order kept"
    part.close()


def test_snapshot_waits_for_the_commit_in_flight() -> None:
    writer = SlowWriter()
    part = _LakePartition(writer, None)  # type: ignore[arg-type]
    part.write_batch(batch(1))
    states: list[Any] = []
    t = in_thread(lambda: states.append(part.snapshot()))
    t.join(0.3)
    assert states == [], "the epoch's offsets must not be recorded before its rows are in the lake"
    writer.gate.set()
    t.join(10)
    assert states == [(1, 1)]
    part.close()


@pytest.mark.parametrize("then", ["write_batch", "snapshot", "close"])
def test_a_failed_commit_is_raised_in_the_worker(then: str) -> None:
    writer = SlowWriter(fail_on=1)
    part = _LakePartition(writer, None)  # type: ignore[arg-type]
    part.write_batch(batch(1))  # in flight: will fail
    committing(writer)
    part.write_batch(batch(2))  # held for the next commit
    writer.gate.set()
    with pytest.raises(OSError, match="object store said no"):
        if then == "write_batch":
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # raised by the first call after the failure
                part.write_batch(batch(3))
                time.sleep(0.01)
        elif then == "snapshot":
            part.snapshot()
        else:
            part.close()
    time.sleep(0.1)
    assert writer.committed == [], "nothing after a failed commit may land"
    with pytest.raises(OSError, match="object store said no"):
        part.snapshot()  # nor may an epoch end as if it had
    part.close()  # the failure was raised already: close does not raise it again (bytewax would abort)


def test_a_job_whose_last_commit_fails_fails(tmp_path, monkeypatch) -> None:
    """End to end through bytewax: the failure of the final commit, still in flight when
    the input ends, fails the run instead of vanishing with the commit thread."""
    from bytewax.testing import TestingSource, run_main

    from pipelines.flow import build_flow
    from pipelines.lake_writer import LakeWriter
    from pipelines.runner import prepare
    from serving.fake_embedder import FakeEmbedder
    from tests.corpus import make_corpus
    from tests.pipelines.test_flow import Published, messages, settings_for

    def refuse(self: LakeWriter, rows: pa.Table, before_commit: Any = None) -> pa.Table:
        raise OSError("the object store said no")

    monkeypatch.setattr(LakeWriter, "write", refuse)
    settings = prepare(settings_for(tmp_path))
    one = messages(tmp_path, make_corpus(seed=3))[:1]  # one batch: its commit is the last thing in flight
    flow = build_flow(settings, TestingSource(one), Published(), FakeEmbedder())
    with pytest.raises(Exception) as failed:
        run_main(flow)
    chain, exc = [], failed.value
    while exc is not None:  # bytewax wraps it ("error snapshotting StatefulSink"), cause kept
        chain.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    assert any("object store said no" in text for text in chain), chain
