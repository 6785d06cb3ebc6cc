"""When an ``--until-idle`` partition may end: only once it has read everything the broker holds;
and an offset that retention deleted before the job read it stops the job."""

from __future__ import annotations

import time
from typing import Any

import pytest
from bytewax.connectors.kafka import KafkaError, KafkaSourceMessage
from confluent_kafka import KafkaError as ConfluentKafkaError
from confluent_kafka import KafkaException, Producer, TopicPartition

from pipelines.broker import ensure_topics
from pipelines.kafka_io import IdleStoppingKafkaSource, KafkaIOError, _IdlePartition


def drain(part: _IdlePartition, limit_s: float = 60) -> list[Any]:
    """Every item the partition yields until it ends (fails if it never does)."""
    items: list[Any] = []
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            items.extend(part.next_batch())
        except StopIteration:
            return items
        time.sleep(0.005)
    raise AssertionError(f"the partition did not end in {limit_s} s")


def test_a_partition_first_polled_after_its_idle_time_reads_everything_before_it_ends(broker: str) -> None:
    """Recovery and model loading can take longer than ``--until-idle``: the first empty polls of
    a consumer still connecting must not end the partition (before: 0 of 300 events, exit 0)."""
    topic = "idle-late-first-poll"
    ensure_topics(broker, [topic], partitions=1)
    producer = Producer({"bootstrap.servers": broker})
    for i in range(300):
        producer.produce(topic, value=f"event {i}".encode())
    assert producer.flush(10) == 0

    # The broker holds each fetch until it has 10 MB or 2 s have passed: a consumer whose
    # first fetch has not come back yet, as on a loaded machine.
    slow_fetch = {"fetch.min.bytes": "10000000", "fetch.wait.max.ms": "2000"}
    source = IdleStoppingKafkaSource([broker], [topic], idle_s=0.5, add_config=slow_fetch)
    [name] = source.list_parts()
    part = source.build_part("input", name, None)
    time.sleep(1.0)  # the worker is busy elsewhere for twice the idle time
    items = drain(part)
    part.close()
    assert [item.value for item in items] == [f"event {i}".encode() for i in range(300)]


class _Consumer:
    def __init__(self, high: int, fail: bool = False) -> None:
        self.high, self.fail = high, fail

    def get_watermark_offsets(self, part: TopicPartition, timeout: float, cached: bool) -> tuple[int, int]:
        if self.fail:
            raise KafkaException("broker unreachable")
        return 0, self.high

    def position(self, parts: list[TopicPartition]) -> list[TopicPartition]:
        return [TopicPartition(parts[0].topic, parts[0].partition, -1001)]


class _Partition:
    """Bytewax's Kafka partition as the wrapper sees it: polls that come back empty."""

    def __init__(self, consumer: _Consumer, offset: int, batches: list[list[Any]] | None = None) -> None:
        self._consumer, self._topic, self._part_idx, self._offset = consumer, "t", 0, offset
        self._batches = batches or []

    def next_batch(self) -> list[Any]:
        if not self._batches:
            return []
        batch = self._batches.pop(0)
        last = batch[-1]
        self._offset = (last.msg if isinstance(last, KafkaError) else last).offset + 1  # as bytewax does, errors too
        return batch

    def snapshot(self) -> Any:
        return self._offset

    def close(self) -> None:
        pass


def test_an_idle_partition_behind_the_high_watermark_keeps_reading_until_it_catches_up() -> None:
    consumer = _Consumer(high=10)
    inner = _Partition(consumer, offset=7)
    part = _IdlePartition(inner, idle_s=0.05)  # type: ignore[arg-type]
    part.next_batch()
    time.sleep(0.1)
    assert part.next_batch() == []  # idle, but 3 events are unread: no end
    inner._offset = 10
    time.sleep(0.1)
    with pytest.raises(StopIteration):
        part.next_batch()


def test_a_broker_that_cannot_say_where_a_partition_ends_fails_the_run_instead_of_ending_it() -> None:
    consumer = _Consumer(high=10, fail=True)
    part = _IdlePartition(_Partition(consumer, offset=10), idle_s=0.05)  # type: ignore[arg-type]
    part.UNCONFIRMED_LIMIT_S = 0.3
    part.next_batch()
    time.sleep(0.1)
    assert part.next_batch() == []  # not confirmed yet: read on
    time.sleep(0.4)
    with pytest.raises(KafkaIOError, match="has not said where it ends"):
        part.next_batch()


def _consumer_error(code: int, text: str) -> KafkaError[bytes | None, bytes | None]:
    return KafkaError(
        ConfluentKafkaError(code, text), KafkaSourceMessage(None, None, topic="t", offset=-1001, partition=0)
    )


def test_an_offset_that_retention_deleted_stops_the_job_instead_of_skipping_ahead() -> None:
    """librdkafka's default on an offset no longer on the topic is to jump to the partition's end,
    past every retained change; the source asks it to report that instead, and stops."""
    source = IdleStoppingKafkaSource(["127.0.0.1:1"], ["t"], add_config={"fetch.wait.max.ms": "10"})
    assert source._add_config == {"auto.offset.reset": "error", "fetch.wait.max.ms": "10"}
    accepted = IdleStoppingKafkaSource(["127.0.0.1:1"], ["t"], add_config={"auto.offset.reset": "earliest"})
    assert accepted._add_config["auto.offset.reset"] == "earliest"  # the operator may accept the loss

    transient = _consumer_error(ConfluentKafkaError._TRANSPORT, "broker down")
    part = _IdlePartition(_Partition(_Consumer(high=10), offset=7, batches=[[transient]]), idle_s=None)  # type: ignore[arg-type]
    assert part.next_batch() == [transient]  # other consumer errors go on to the flow, which logs them
    lost = _consumer_error(ConfluentKafkaError._AUTO_OFFSET_RESET, "Fetch position offset 7 is out of range")
    part = _IdlePartition(_Partition(_Consumer(high=10), offset=7, batches=[[lost]]), idle_s=None)  # type: ignore[arg-type]
    accept = "auto.offset.reset=earliest in the --kafka-config file"
    with pytest.raises(KafkaIOError, match=rf"t\[0\]: offset 7 is no longer on the topic .*{accept}"):
        part.next_batch()


def test_a_consumer_error_does_not_move_the_position_that_a_snapshot_records() -> None:
    """bytewax takes the last item's offset + 1 as the partition's position, and a consumer error
    carries offset -1001: a snapshot between the error and the next message would record -1000
    (librdkafka's OFFSET_STORED), and a resume would start wherever auto.offset.reset says."""
    message = KafkaSourceMessage(b"k", b"v", topic="t", offset=7, partition=0)
    transient = _consumer_error(ConfluentKafkaError._TRANSPORT, "broker down")
    inner = _Partition(_Consumer(high=10), offset=5, batches=[[message, transient], [transient]])
    part = _IdlePartition(inner, idle_s=None)  # type: ignore[arg-type]
    assert part.next_batch() == [message, transient]
    assert part.snapshot() == 8
    assert part.next_batch() == [transient]
    assert part.snapshot() == 8
