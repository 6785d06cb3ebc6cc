"""Kafka at the edges of the job: the source, the dead-letter producer, ``produce``."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
from bytewax.connectors.kafka import KafkaError, KafkaSource, KafkaSourceMessage, _list_parts
from bytewax.inputs import StatefulSourcePartition
from confluent_kafka import KafkaError as ConfluentKafkaError
from confluent_kafka import KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from pipelines import metrics
from pipelines.records import KafkaCoordinates

log = logging.getLogger(__name__)

SourceItem = KafkaSourceMessage[bytes | None, bytes | None] | KafkaError[bytes | None, bytes | None]

#: the pause after an empty poll of the source (see _IdlePartition.next_batch)
IDLE_POLL_MS = 10

#: librdkafka's default partitioner differs from Java's; Debezium (Java) uses murmur2.
PRODUCER_DEFAULTS = {"partitioner": "murmur2_random", "enable.idempotence": "true", "acks": "all"}


#: what librdkafka does when the offset to read from is no longer on the topic (retention
#: deleted it while the job was down or behind): report it (``ERR__AUTO_OFFSET_RESET``, which
#: stops the job, see ``_IdlePartition``) instead of its default, ``latest``, which jumps to the
#: end of the partition past every change still retained, silently. ``auto.offset.reset=earliest``
#: in the ``--kafka-config`` file (or ``STREAMRAG_KAFKA_AUTO_OFFSET_RESET=earliest``) accepts the
#: loss and reads what is left.
OFFSET_RESET = {"auto.offset.reset": "error"}


class KafkaIOError(RuntimeError):
    """A Kafka operation failed for good (after librdkafka's own retries)."""


def kafka_coordinates(item: SourceItem) -> KafkaCoordinates | None:
    if isinstance(item, KafkaError):
        return None
    return KafkaCoordinates(item.topic or "", int(item.partition or 0), int(item.offset or 0))


class _IdlePartition(StatefulSourcePartition[SourceItem, Any]):
    """Wraps a Kafka partition: sleeps when there is nothing to read, and ends after
    ``idle_s`` seconds without messages when that is set (batch runs, backfills, tests).

    An idle partition ends only once it has read up to the broker's high watermark: a
    consumer that is still connecting, or a worker too busy to poll, also sees empty
    batches, and ending then would finish a run with exit 0 and events unread. The idle
    clock starts at the first poll, not when the partition is built (recovery and model
    loading can take longer than ``idle_s``). If the broker cannot say where the partition
    ends for ``UNCONFIRMED_LIMIT_S`` (or ``idle_s`` if longer), the partition raises. So does
    a partition whose offset to read from is no longer on the topic (``OFFSET_RESET``)."""

    #: how long a partition may stay idle without the broker confirming it has been read to the end
    UNCONFIRMED_LIMIT_S = 60.0

    def __init__(self, inner: StatefulSourcePartition[SourceItem, Any], idle_s: float | None) -> None:
        self._inner = inner
        self._idle_s = idle_s
        self._last: float | None = None
        self._unconfirmed_since: float | None = None
        self._awake: datetime | None = None

    def next_batch(self) -> list[SourceItem]:
        reading_from = getattr(self._inner, "_offset", None)
        batch = list(self._inner.next_batch())
        errors = [item for item in batch if isinstance(item, KafkaError)]
        for item in errors:
            if item.err.code() == ConfluentKafkaError._AUTO_OFFSET_RESET:
                raise self._offset_lost(item, reading_from)
        if errors and reading_from is not None:
            # bytewax takes the last item's offset + 1 as the partition's position, errors too,
            # and a consumer error carries offset -1001: the position would become -1000 (librdkafka's
            # OFFSET_STORED) until the next message, and a snapshot taken meanwhile would resume
            # the partition wherever auto.offset.reset says, not where it was.
            read = [item.offset for item in batch if isinstance(item, KafkaSourceMessage) and item.offset is not None]
            self._inner._offset = max([reading_from, *(offset + 1 for offset in read)])  # type: ignore[attr-defined]
        now = time.monotonic()
        if self._last is None:
            self._last = now
        if batch:
            self._last = now
            self._awake = None
            return batch
        if self._idle_s is not None and now - self._last >= self._idle_s:
            if self._read_to_the_end(now):
                raise StopIteration()
            self._last = now  # events remain, or the broker did not answer: keep reading
        # Don't spin: the embedder needs the CPU more than an empty poll does. 10 ms costs
        # about 1% of a core and adds 5 ms on average to a change on a quiet stream.
        self._awake = datetime.now(UTC) + timedelta(milliseconds=IDLE_POLL_MS)
        return batch

    def _offset_lost(self, item: KafkaError[bytes | None, bytes | None], reading_from: int | None) -> KafkaIOError:
        """The error that stops the job when the offset to read from is gone (``OFFSET_RESET``),
        raised in the poll that returned it: bytewax takes an error's offset as the partition's
        position too, and a snapshot after this poll would record it."""
        where = f"{item.msg.topic or getattr(self._inner, '_topic', '?')}[{item.msg.partition}]"
        return KafkaIOError(
            f"{where}: offset {reading_from} is no longer on the topic ({item.err.str()}): retention deleted "
            "changes this job had not read, and reading on would leave the lake without them (a lost delete "
            "keeps a document searchable). Re-snapshot the source into a new lake and recovery directory, "
            "or accept the loss: auto.offset.reset=earliest in the --kafka-config file "
            "(STREAMRAG_KAFKA_AUTO_OFFSET_RESET=earliest)."
        )

    def _read_to_the_end(self, now: float) -> bool:
        """Whether the next offset to read is at the partition's high watermark."""
        consumer = getattr(self._inner, "_consumer", None)
        if consumer is None:  # not bytewax's Kafka partition (tests): idle is enough
            return True
        part = TopicPartition(self._inner._topic, self._inner._part_idx)  # type: ignore[attr-defined]
        try:
            low, high = consumer.get_watermark_offsets(part, timeout=5, cached=False)
            [position] = consumer.position([part])
        except KafkaException as exc:
            if self._unconfirmed_since is None:
                self._unconfirmed_since = now
            waited = now - self._unconfirmed_since
            if waited >= max(self.UNCONFIRMED_LIMIT_S, self._idle_s or 0.0):
                raise KafkaIOError(
                    f"{part.topic}[{part.partition}] is idle but the broker has not said where it ends "
                    f"for {waited:.0f} s ({exc}); stopping here could leave events unread"
                ) from exc
            log.warning("%s[%d] is idle; the broker did not say where it ends (%s): reading on",
                        part.topic, part.partition, exc)  # fmt: skip
            return False
        self._unconfirmed_since = None
        # The consumer's position skips what bytewax's own offset cannot (transaction markers).
        read = max(self._inner._offset, position.offset, low)  # type: ignore[attr-defined]
        if read < high:
            log.info("%s[%d] is idle at offset %d of %d: reading on", part.topic, part.partition, read, high)
            return False
        return True

    def next_awake(self) -> datetime | None:
        return self._awake

    def snapshot(self) -> Any:
        return self._inner.snapshot()

    def close(self) -> None:
        self._inner.close()


#: consumer properties the job sets that an admin client does not take
_CONSUMER_ONLY = frozenset({"fetch.wait.max.ms", *OFFSET_RESET})


class IdleStoppingKafkaSource(KafkaSource):
    """Bytewax's Kafka input, with ``idle_s`` (``--until-idle``) and no busy polling."""

    def __init__(
        self,
        brokers: Iterable[str],
        topics: Iterable[str],
        idle_s: float | None = None,
        add_config: dict[str, str] | None = None,
    ) -> None:
        super().__init__(
            list(brokers), list(topics), tail=True, add_config={**OFFSET_RESET, **(add_config or {})},
            batch_size=500, raise_on_errors=False,
        )  # fmt: skip
        self._idle_s = idle_s

    def list_parts(self) -> list[str]:
        """As bytewax lists them, without the consumer-only properties: its admin client takes
        the consumer's configuration, and librdkafka printed a CONFWARN for each, in every
        process, at every start."""
        config: dict[str, str | int | float | bool] = {"bootstrap.servers": ",".join(self._brokers)}
        config.update({k: v for k, v in self._add_config.items() if k not in _CONSUMER_ONLY})
        return list(_list_parts(AdminClient(config), self._topics))

    def build_part(self, step_id: str, for_part: str, resume_state: Any) -> _IdlePartition:  # type: ignore[override]
        return _IdlePartition(super().build_part(step_id, for_part, resume_state), self._idle_s)


class _CheckedBatch:
    """Produce messages and wait for every delivery report; raise if any failed."""

    def __init__(self, producer: Producer) -> None:
        self.producer = producer
        self.sent = 0
        self.errors: list[str] = []

    def _on_delivery(self, err: Any, _msg: Any) -> None:
        if err is not None:
            self.errors.append(str(err))

    def send(self, topic: str, **kwargs: Any) -> None:
        while True:
            try:
                self.producer.produce(topic, on_delivery=self._on_delivery, **kwargs)
                break
            except BufferError:  # local queue full: let deliveries drain
                self.producer.poll(0.1)
        self.sent += 1
        self.producer.poll(0)

    def wait(self, timeout_s: float, what: str, then: str) -> None:
        remaining = self.producer.flush(timeout_s)
        if remaining or self.errors:
            raise KafkaIOError(
                f"{remaining} {what} undelivered and {len(self.errors)} failed ({'; '.join(self.errors[:3])}); {then}."
            )


class DeadLetterProducer:
    """Publishes dead letters to ``<topic><suffix>`` and waits for every delivery.

    Bytewax's KafkaSink drops produce errors silently; a lost dead letter is a lost event,
    so this producer checks each delivery report and raises if any failed.
    """

    def __init__(
        self, bootstrap: str, suffix: str = ".dlq", config: dict[str, str] | None = None, timeout_s: float = 30.0
    ) -> None:
        self._config = {"bootstrap.servers": bootstrap, **PRODUCER_DEFAULTS, **(config or {})}
        self._suffix = suffix
        self._timeout_s = timeout_s
        self._producer: Producer | None = None

    def publish(self, rows: pa.Table) -> None:
        if rows.num_rows == 0:
            return
        if self._producer is None:
            self._producer = Producer(self._config)
        batch = _CheckedBatch(self._producer)
        for row in rows.to_pylist():
            headers = [(k, v.encode()) for k, v in json.loads(row["headers"] or "{}").items()]
            headers += [
                ("streamrag.error", row["error"].encode()),
                ("streamrag.source.topic", row["topic"].encode()),
                ("streamrag.source.partition", str(row["partition"]).encode()),
                ("streamrag.source.offset", str(row["offset"]).encode()),
            ]
            batch.send(row["topic"] + self._suffix, value=row["value"], key=row["key"], headers=headers)
        batch.wait(self._timeout_s, "dead letters", "the batch will be retried")
        metrics.DEAD_LETTERS.inc(rows.num_rows)


def read_jsonl_messages(path: Path) -> Iterator[tuple[int, bytes | None, bytes | None]]:
    """Lines of a ``produce`` file → (line number, key bytes, value bytes).

    A line is a Debezium envelope, a ``{"schema", "payload"}`` wrapper, or
    ``{"key": …, "value": …}`` (a null value is a tombstone). A line that is not JSON is
    sent as it is (raw bytes), so the job's dead-letter path can be exercised.
    """
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            line = raw.rstrip(b"\r\n")
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                yield lineno, None, line
                continue
            if isinstance(obj, dict) and set(obj) <= {"key", "value"} and "value" in obj:
                key, value = obj.get("key"), obj["value"]
                yield lineno, _json_bytes(key), None if value is None else _json_bytes(value)
            else:
                yield lineno, _derived_key(obj), line


def _json_bytes(value: Any) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value.encode()
    return json.dumps(value, separators=(",", ":")).encode()


def _derived_key(obj: Any) -> bytes | None:
    """Key a bare envelope by its row's ``id`` as Debezium would (``{"id": …}``)."""
    from pipelines.debezium import unwrap

    env = unwrap(obj)
    if not isinstance(env, dict):
        return None
    row = env.get("after") or env.get("before")
    if isinstance(row, dict) and row.get("id") is not None:
        return json.dumps({"id": row["id"]}, separators=(",", ":")).encode()
    return None


def produce_file(bootstrap: str, topic: str, path: Path, config: dict[str, str] | None = None) -> int:
    """Publish a JSON-lines file; return the number of messages delivered."""
    batch = _CheckedBatch(Producer({"bootstrap.servers": bootstrap, **PRODUCER_DEFAULTS, **(config or {})}))
    for _lineno, key, value in read_jsonl_messages(path):
        batch.send(topic, key=key, value=value)
    batch.wait(60, "messages", "nothing was lost silently; produce the file again")
    return batch.sent


#: Kafka's "no limit" for ``max.compaction.lag.ms``
_LONG_MAX = 2**63 - 1


def topic_retention_s(bootstrap: str, topics: list[str], config: dict[str, str] | None = None) -> float:
    """How long the longest-keeping of these topics may still hold a message, in seconds
    (``math.inf``: forever), from the broker's topic configs.

    A ``delete`` policy drops a message's segment once the segment's newest message is
    past ``retention.ms`` (-1: never), and a segment closes after ``segment.ms``. A compact-only
    topic drops an old message only once the cleaner has run over it, which
    ``max.compaction.lag.ms`` bounds (unbounded by default). Raises ``KafkaIOError`` when the
    broker does not say.
    """
    from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": bootstrap, **(config or {})})
    resources = [ConfigResource(ResourceType.TOPIC, t) for t in topics]
    longest = 0.0
    try:
        for future in admin.describe_configs(resources, request_timeout=10).values():
            entries = {k: v.value for k, v in future.result(timeout=15).items()}
            policy = entries.get("cleanup.policy") or "delete"
            if "delete" in policy:  # a segment goes whole, once its newest message is past retention
                ms = int(entries.get("retention.ms") or -1)
                bound = math.inf if ms < 0 else (ms + int(entries.get("segment.ms") or 0)) / 1000
            else:
                ms = int(entries.get("max.compaction.lag.ms") or _LONG_MAX)
                bound = math.inf if ms >= _LONG_MAX else ms / 1000
            longest = max(longest, bound)
    except Exception as exc:
        raise KafkaIOError(f"the broker did not describe topics {topics}: {exc}") from exc
    return longest
