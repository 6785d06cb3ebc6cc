"""Commit notices: the ingest job announces each lake commit on a small Kafka topic.

Serving replicas follow the topic and read the commit a notice names at once, instead of
finding it at their next poll of the Delta log. A notice is only a hint: the log stays
the truth, and replicas keep polling it at a slower pace, so a lost notice costs at most
one poll interval and a duplicated or reordered one costs nothing (a replica reads each
lake version once, whatever wakes it). Notices name the lake they belong to, so one topic
can serve several lakes on one broker.

Replicas read the topic from its end without a consumer group (no offsets to commit, no
rebalances to wait for): each replica sees every notice published while it runs.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass

from confluent_kafka import OFFSET_END, Consumer, KafkaError, Producer, TopicPartition

from pipelines import metrics
from pipelines.settings import DEFAULT_NOTICES_TOPIC
from pipelines.storage import normalize_uri

log = logging.getLogger(__name__)

DEFAULT_TOPIC = DEFAULT_NOTICES_TOPIC


@dataclass(frozen=True)
class CommitNotice:
    lake: str  # normalised lake URI
    table: str
    version: int  # the table version the commit created (or a later one)
    writer: str
    rows: int
    committed_at_ms: int

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes | None) -> CommitNotice | None:
        """The notice in ``raw``, or None if it is not one (it is ignored, never fatal)."""
        try:
            data = json.loads(raw or b"")
            notice = cls(
                str(data["lake"]), str(data["table"]), int(data["version"]), str(data["writer"]),
                int(data["rows"]), int(data["committed_at_ms"]),
            )  # fmt: skip
        except (ValueError, TypeError, KeyError):
            return None
        return notice if notice.version >= 0 else None


class NoticePublisher:
    """Publishes notices without waiting for them: a notice that fails is logged and counted."""

    def __init__(self, bootstrap: str, topic: str, config: dict[str, str] | None = None) -> None:
        self.topic = topic
        self._config = {"bootstrap.servers": bootstrap, "linger.ms": "0", "acks": "1", **(config or {})}
        self._producer: Producer | None = None

    def publish(self, notice: CommitNotice) -> None:
        try:
            if self._producer is None:
                self._producer = Producer(self._config)
            self._producer.produce(self.topic, value=notice.encode(), key=notice.lake.encode(), on_delivery=_delivered)
            self._producer.poll(0)  # serve earlier delivery reports
        except Exception as exc:  # noqa: BLE001 - a notice is a hint: never fail a commit for it
            metrics.NOTICES.labels("failed").inc()
            log.warning("commit notice for %s version %d not sent: %s", notice.table, notice.version, exc)

    def close(self, timeout_s: float = 2.0) -> None:
        if self._producer is not None:
            self._producer.flush(timeout_s)


def _delivered(err: KafkaError | None, _msg: object) -> None:
    if err is None:
        metrics.NOTICES.labels("sent").inc()
    else:
        metrics.NOTICES.labels("failed").inc()
        log.warning("commit notice not delivered (replicas will find the commit at their next poll): %s", err)


class NoticeFollower:
    """Calls ``on_version(version)`` for each notice about ``table`` of ``lake``, in a thread."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        lake: str,
        table: str,
        on_version: Callable[[int], None],
        config: dict[str, str] | None = None,
    ) -> None:
        self.topic = topic
        self.lake = normalize_uri(lake)
        self.table = table
        self.on_version = on_version
        self.received = 0
        self.last_error: str | None = None
        self._config = {
            "bootstrap.servers": bootstrap,
            "group.id": f"streamrag-notices-{uuid.uuid4().hex[:12]}",  # required; never joined (assign)
            "enable.auto.commit": "false",
            "fetch.wait.max.ms": "10",  # a notice is small and wanted now
            "fetch.min.bytes": "1",
            **(config or {}),
        }
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="commit-notices", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _assign(self, consumer: Consumer) -> bool:
        topics = consumer.list_topics(self.topic, timeout=5).topics
        meta = topics.get(self.topic)
        if meta is None or meta.error is not None or not meta.partitions:
            return False
        consumer.assign([TopicPartition(self.topic, p, OFFSET_END) for p in meta.partitions])
        return True

    def _run(self) -> None:
        consumer = Consumer(self._config)
        try:
            while not self._stop.is_set():
                try:
                    if self._assign(consumer):
                        break
                    self._note_error(f"topic {self.topic} does not exist yet")
                except Exception as exc:  # noqa: BLE001 - the broker may be down: polling covers it
                    self._note_error(str(exc))
                self._stop.wait(5.0)
            log.info("following commit notices on %s", self.topic)
            while not self._stop.is_set():
                msg = consumer.poll(0.5)
                if msg is None:
                    continue
                if msg.error() is not None:
                    self._note_error(str(msg.error()))
                    continue
                notice = CommitNotice.decode(msg.value())
                if notice is None or notice.lake != self.lake or notice.table != self.table:
                    continue
                self.received += 1
                self.last_error = None
                metrics.NOTICES.labels("received").inc()
                metrics.NOTICE_DELAY.observe(max(0.0, time.time() - notice.committed_at_ms / 1000))
                self.on_version(notice.version)
        finally:
            consumer.close()

    def _note_error(self, error: str) -> None:
        if error != self.last_error:
            log.warning("commit notices unavailable (the lake is still polled): %s", error)
        self.last_error = error
