"""A deleted document's state is dropped a retention after its delete (never before the
source topics' retention), live documents' never; stale changes are refused until then."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from bytewax.testing import TestingSource, run_main
from prometheus_client import REGISTRY

import pipelines.flow as flow
from pipelines.docstate import DocState
from pipelines.flow import Runtime, _DocLogic, build_flow, deleted_state_retention
from pipelines.kafka_io import KafkaIOError
from pipelines.runner import prepare
from serving.fake_embedder import FakeEmbedder
from tests.pipelines.test_docstate import event
from tests.pipelines.test_flow import Published, settings_for

EXPIRED = "streamrag_ingest_deleted_states_expired_total"


def expired() -> float:
    return REGISTRY.get_sample_value(EXPIRED) or 0.0


@pytest.fixture
def rt(tmp_path: Path) -> Runtime:
    runtime = Runtime(settings_for(tmp_path), FakeEmbedder())
    runtime.state_retention_s = 60.0
    return runtime


def test_a_deleted_documents_state_expires_and_a_live_ones_never(rt: Runtime) -> None:
    logic = _DocLogic(rt, None)
    updates, discard = logic.on_item(event(1, "first text of the note"))
    assert updates and not discard and logic.notify_at() is None  # live: kept
    before = time.time()
    updates, discard = logic.on_item(event(2, op="delete"))
    assert updates and not discard
    due = logic.notify_at()
    assert due is not None and abs(due.timestamp() - (before + 60)) < 5
    # Until then a change older than the delete is refused, and the state stays.
    assert logic.on_item(event(1, "first text of the note")) == ([], False)
    assert logic.on_notify() == ([], False)
    # Once due, the state goes.
    assert logic.state is not None and logic.state.deleted_at_ms is not None
    logic.state.deleted_at_ms -= 61_000
    count = expired()
    assert logic.on_notify() == ([], True) and expired() == count + 1


def test_a_reinsert_makes_the_document_live_again(rt: Runtime) -> None:
    logic = _DocLogic(rt, None)
    logic.on_item(event(1, "text"))
    logic.on_item(event(2, op="delete"))
    updates, _ = logic.on_item(event(3, "text again, re-inserted"))
    assert updates and logic.state is not None and logic.state.live and logic.notify_at() is None


def test_state_from_an_older_recovery_directory_counts_from_now(rt: Runtime) -> None:
    logic = _DocLogic(rt, DocState("pg:00000000000000000002", live=False))  # pickled before deleted_at_ms
    due = logic.notify_at()
    assert due is not None and due > datetime.now(UTC) + timedelta(seconds=55)


def test_retention_zero_keeps_state_forever(rt: Runtime) -> None:
    rt.state_retention_s = None
    logic = _DocLogic(rt, None)
    logic.on_item(event(1, "text"))
    logic.on_item(event(2, op="delete"))
    assert logic.notify_at() is None


@pytest.mark.parametrize(
    ("hours", "topics", "expected"),
    [
        (192, 7 * 86400.0, 192 * 3600),  # the topics drop messages sooner: as configured
        (24, 14 * 86400.0, 14 * 86400 + 3600),  # they keep them longer: raised past their retention
        (24, math.inf, None),  # they keep them forever: so does the job
        (24, KafkaIOError("no DescribeConfigs"), 24 * 3600),  # the broker does not say: as configured
        (0, 86400.0, None),  # 0: forever
    ],
)
def test_the_retention_follows_the_source_topics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hours: float, topics: Any, expected: float | None
) -> None:
    def retention(*_: Any) -> float:
        if isinstance(topics, Exception):
            raise topics
        return float(topics)

    monkeypatch.setattr(flow, "topic_retention_s", retention)
    settings = settings_for(tmp_path, bootstrap="127.0.0.1:1", deleted_state_retention_hours=hours)
    assert deleted_state_retention(settings) == expected


def test_the_running_dataflow_drops_expired_state(tmp_path: Path) -> None:
    """Through bytewax: a delete, then a pause longer than the retention; the state is
    dropped while the job runs."""
    from bytewax.connectors.kafka import KafkaSourceMessage

    from pipelines.envelopes import envelope, message

    settings = prepare(settings_for(tmp_path, deleted_state_retention_hours=0.5 / 3600))
    topic = settings.topics[0]

    def msg(offset: int, op: Any, pk: int, text: str) -> KafkaSourceMessage[bytes, bytes | None]:
        row = {"id": pk, "title": "T", "body": text, "acl": []}
        value = envelope(op, before=row, lsn=offset) if op == "d" else envelope(op, after=row, lsn=offset)
        key, raw = message({"id": pk}, value)
        return KafkaSourceMessage(key=key, value=raw, topic=topic, partition=0, offset=offset)

    first = [msg(1, "c", 7, "the original text of note seven"), msg(2, "d", 7, "")]
    count = expired()
    pause = TestingSource.PAUSE(timedelta(seconds=1.5))  # longer than the retention
    source = TestingSource([*first, pause, msg(3, "c", 8, "unrelated")])
    run_main(build_flow(settings, source, Published(), FakeEmbedder()))
    assert expired() == count + 1
