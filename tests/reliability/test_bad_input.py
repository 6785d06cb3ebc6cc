"""Real-world malformed CDC messages through the real job: each one a dead letter with its
reason and original bytes (table and topic), the job keeps running, good events land."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from confluent_kafka import Producer

from pipelines.broker import ensure_topics
from pipelines.envelopes import envelope as debezium_envelope
from pipelines.lake import CHUNKS, DEAD_LETTERS, Lake
from tests.integration.helpers import cli, count_dlq, ingest_args

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

TOPIC = "cdc.app.public.docs_badinput"


def good(pk: int) -> bytes:
    row = {"id": pk, "title": f"Good {pk}", "body": f"Valid document number {pk} about lighthouses.", "acl": ""}
    return json.dumps(debezium_envelope("c", row, lsn=100 + pk)).encode()


def envelope(**over: object) -> bytes:
    """A valid create event with some fields replaced by the malformed values under test."""
    base = debezium_envelope("c", {"id": 1, "title": "t", "body": "b", "acl": []}, lsn=5, ts_ms=1)
    base.update(over)
    return json.dumps(base).encode()


BAD: list[tuple[str, bytes | None, bytes]] = [
    ("truncated JSON", b"k1", b'{"before": null, "after": {"id": 1, "title": "x"'),
    ("not JSON", b"k2", b"<html>502 Bad Gateway</html>"),
    ("invalid UTF-8", b"k3", b'{"op": "c", "after": {"id": 3, "body": "\xff\xfe\xfa"}}'),
    ("binary garbage", b"k4", bytes(range(256))),
    ("deeply nested", b"k5", b"[" * 50_000 + b"]" * 50_000),
    ("huge field, wrong type", b"k6", envelope(after={"id": 6, "title": ["x"] * 50_000, "body": "b"})),
    ("unknown op", b"k7", envelope(op="x")),
    ("missing op", b"k8", json.dumps({"before": None, "after": {"id": 8}, "source": {"lsn": 1}}).encode()),
    ("missing primary key", b"k9", envelope(after={"title": "no id", "body": "b"})),
    ("wrong type of ACL", b"k10", envelope(after={"id": 10, "body": "b", "acl": {"group": "x"}})),
    ("null after on create", b"k11", envelope(after=None)),
    ("array at top level", b"k12", b"[1, 2, 3]"),
    ("number at top level", b"k13", b"42"),
    ("empty object", b"k14", b"{}"),
    ("source is a string", b"k15", envelope(source="docs")),
    ("NaN in JSON", b"k16", b'{"op": "c", "after": {"id": NaN}}'),
    ("ACL column missing (fails closed)", b"k17", envelope(after={"id": 17, "title": "t", "body": "secret?"})),
    ("ACL column null (fails closed)", b"k18", envelope(after={"id": 18, "title": "t", "body": "b", "acl": None})),
]


def test_every_malformed_message_is_a_dead_letter_and_the_job_goes_on(broker: str, tmp_path: Path) -> None:
    ensure_topics(broker, [TOPIC], partitions=2)
    producer = Producer({"bootstrap.servers": broker, "message.max.bytes": 5_000_000})
    sent_good = 0
    for i, (_, key, value) in enumerate(BAD):
        producer.produce(TOPIC, key=json.dumps({"id": 1000 + i}).encode(), value=good(1000 + i))
        producer.produce(TOPIC, key=key, value=value)
        sent_good += 1
    assert producer.flush(30) == 0
    lake_dir = tmp_path / "lake"
    out = cli(*ingest_args(broker, TOPIC, str(lake_dir), tmp_path / "recovery", idle=5), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr

    lake = Lake.at(str(lake_dir))
    letters = lake.read(DEAD_LETTERS).to_pylist()
    assert len(letters) == len(BAD), [letter["error"] for letter in letters]
    by_value = {bytes(letter["value"]): letter for letter in letters}
    for name, _, value in BAD:
        assert value in by_value, f"{name}: not dead-lettered with its original bytes"
        assert by_value[value]["error"], f"{name}: no reason given"
    docs = set(lake.read(CHUNKS, columns=["doc_id"]).column("doc_id").to_pylist())
    assert docs == {f"public.docs/{1000 + i}" for i in range(sent_good)}
    headers = count_dlq(broker, TOPIC + ".dlq")
    assert len(headers) == len(BAD) and all(h["streamrag.error"] for h in headers)
