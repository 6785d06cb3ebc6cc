"""The streaming job as a Bytewax dataflow: Kafka → decode → per-document diff → embed → lake.

Run it with ``streamrag ingest`` or ``python -m bytewax.run "pipelines.flow:build_flow()"``
(settings from ``STREAMRAG_INGEST_*`` variables). The latter skips the job's preparation
(``pipelines.runner.prepare``): the lake's tables must exist, and a recovery directory reused
across kills can resume state from an unfinished epoch (``pipelines.recovery``).
"""

from __future__ import annotations

import copy
import logging
import math
import time
import zlib
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import cached_property, partial
from typing import TypeGuard, cast

import bytewax.operators as op
import pyarrow as pa
from bytewax.connectors.kafka import KafkaSourceMessage
from bytewax.dataflow import Dataflow, Stream, operator
from bytewax.inputs import Source
from bytewax.operators import KeyedStream, StatefulLogic
from confluent_kafka import TIMESTAMP_NOT_AVAILABLE

from pipelines import metrics
from pipelines.batching import adaptive_collect
from pipelines.chunking import Chunker
from pipelines.context import DEFAULT_WEIGHT, lake_weight
from pipelines.debezium import decode
from pipelines.docstate import DocState, apply_change
from pipelines.embedding import BatchEmbedder, dead_letter_rows
from pipelines.kafka_io import (
    DeadLetterProducer,
    IdleStoppingKafkaSource,
    KafkaIOError,
    SourceItem,
    kafka_coordinates,
    topic_retention_s,
)
from pipelines.lake import CHUNKS, DEAD_LETTERS, Lake, LakeError, check_model, models_in
from pipelines.lake_sink import LakeSink
from pipelines.mapping import MappingConfig
from pipelines.notices import NoticePublisher
from pipelines.records import ChangeEvent, DeadLetter, DocUpdate
from pipelines.settings import IngestSettings
from serving.embedder import Embedder, load_embedder

log = logging.getLogger(__name__)


class Runtime:
    """What the steps of one process share; the model loads on first use."""

    def __init__(self, settings: IngestSettings, embedder: Embedder | None = None) -> None:
        self.settings = settings
        if embedder is not None:
            self.__dict__["embedder"] = embedder  # fills the cached property
        self.mappings = MappingConfig.load(settings.mapping_file)
        self.lake = Lake.at(settings.lake, settings.object_store())
        #: seconds a deleted document's state is kept (None: forever); see ``deleted_state_retention``
        hours = settings.deleted_state_retention_hours
        self.state_retention_s: float | None = hours * 3600 if hours else None

    @cached_property
    def embedder(self) -> Embedder:
        return load_embedder(
            self.settings.model,
            device=self.settings.device,
            dtype=self.settings.dtype,
            **({"token_budget": self.settings.embed_token_budget} if self.settings.embed_token_budget else {}),
            cpu_threads=self.settings.cpu_threads,
        )

    @cached_property
    def chunker(self) -> Chunker:
        max_tokens = min(self.settings.chunk_max_tokens, self.embedder.max_tokens)
        overlap = min(self.settings.chunk_overlap_tokens, max_tokens // 2 - 1)
        return Chunker(self.embedder.count_tokens, max_tokens=max_tokens, overlap_tokens=overlap)

    @cached_property
    def context_weight(self) -> float:
        """``--context-weight``, else the lake's (a lake keeps one), else a new lake's default."""
        if self.settings.context_weight is not None:
            return self.settings.context_weight
        try:
            found = lake_weight(models_in(self.lake))
        except LakeError:  # no tables yet: a new lake (the model check refuses any mix later)
            found = None
        return DEFAULT_WEIGHT if found is None else found

    @cached_property
    def batch_embedder(self) -> BatchEmbedder:
        batch = BatchEmbedder(self.embedder, self.settings.vector_cache_size, self.context_weight)
        check_model(self.lake, batch.model)  # the context weight included: a lake keeps one
        return batch

    # -- step functions ---------------------------------------------------------------

    def decode(self, item: SourceItem) -> ChangeEvent | DeadLetter | None:
        coords = kafka_coordinates(item)
        if coords is None or not isinstance(item, KafkaSourceMessage):
            # A consumer error, not a message: librdkafka retries it by itself.
            log.warning("Kafka consumer error: %s", getattr(item, "err", item))
            metrics.EVENTS.labels("consumer-error").inc()
            return None
        msg = item
        if msg.timestamp is not None and msg.timestamp[0] != TIMESTAMP_NOT_AVAILABLE:
            metrics.FETCH_DELAY.observe(max(0.0, time.time() - msg.timestamp[1] / 1000))
        headers = tuple((k, v if isinstance(v, bytes) else bytes(v or b"")) for k, v in (msg.headers or []))
        result = decode(msg.key, msg.value, coords, self.mappings, headers)
        metrics.EVENTS.labels("dead-letter" if isinstance(result, DeadLetter) else "decoded").inc()
        return result

    def apply(self, state: DocState | None, event: ChangeEvent) -> tuple[DocState | None, list[DocUpdate]]:
        new_state, update, outcome = apply_change(state, event, self.chunker, self.context_weight > 0)
        metrics.EVENTS.labels(outcome).inc()
        if update is None:
            return new_state, []
        if new_state is not None and new_state.live:
            written = sum(1 for v in update.versions if v.op == "upsert")
            metrics.CHUNKS.labels("unchanged").inc(len(new_state.chunks) - written)
        return new_state, [update]

    def embed(self, updates: list[DocUpdate]) -> list[tuple[str, pa.Table]]:
        """A worker's updates as ``chunks`` rows, at most ``batch_max_events`` updates per
        call of the model, split by the writer that commits each document (its rows keep
        their order)."""
        out: list[tuple[str, pa.Table]] = []
        step = self.settings.batch_max_events
        for start in range(0, len(updates), step):
            rows = self.batch_embedder.rows(updates[start : start + step])
            writers = [self.writer_key(doc) for doc in rows.column("doc_id").to_pylist()]
            if len(set(writers)) == 1:
                out.append((writers[0], rows))
                continue
            for writer in sorted(set(writers)):
                out.append((writer, rows.take([i for i, w in enumerate(writers) if w == writer])))
        return out

    def writer_key(self, name: str) -> str:
        return f"{zlib.crc32(name.encode()) % self.settings.writers:03d}"


class _DocLogic(StatefulLogic[ChangeEvent, DocUpdate, DocState]):
    """One document's state; a deleted document's is dropped ``retention_s`` after its delete.

    The state of a deleted document only serves to refuse a change older than the delete
    (a duplicate or a late event). Kept forever, it grows with every document ever deleted.
    Once the source topics no longer hold any event older than the delete (their retention,
    see ``pipelines.kafka_io.topic_retention_s``), no such event can arrive, and the state
    goes. (A change *newer* than the delete is a re-insert: it is applied, state or not.)
    """

    def __init__(self, rt: Runtime, state: DocState | None) -> None:
        self._rt = rt
        self.state = _stamped(state)  # a deleted state from an older recovery directory counts from now

    def on_item(self, value: ChangeEvent) -> tuple[list[DocUpdate], bool]:
        state, updates = self._rt.apply(self.state, value)
        self.state = _stamped(state)
        return updates, state is None

    def on_notify(self) -> tuple[list[DocUpdate], bool]:
        due = self.notify_at()
        if due is not None and datetime.now(UTC) >= due:
            metrics.EXPIRED_STATES.inc()
            return [], StatefulLogic.DISCARD
        return [], StatefulLogic.RETAIN

    def notify_at(self) -> datetime | None:
        retention = self._rt.state_retention_s
        state = self.state
        if retention is None or state is None or state.live or state.deleted_at_ms is None:
            return None
        return datetime.fromtimestamp(state.deleted_at_ms / 1000 + retention, UTC)

    def snapshot(self) -> DocState:
        assert self.state is not None
        return copy.deepcopy(self.state)


def _stamped(state: DocState | None) -> DocState | None:
    """A deleted document's state with the time of its deletion (now, if it has none yet)."""
    if state is not None and not state.live and state.deleted_at_ms is None:
        state.deleted_at_ms = int(time.time() * 1000)
    return state


@operator
def apply_to_doc(step_id: str, up: KeyedStream[ChangeEvent], rt: Runtime) -> KeyedStream[DocUpdate]:
    """``stateful_flat_map`` of ``Runtime.apply`` with deleted documents' state expiring. The
    inner step keeps ``stateful_flat_map``'s name, so recovery directories written before
    it resume."""
    return op.stateful("stateful", up, partial(_DocLogic, rt))


#: a message may outlive its topic's retention by a cleaner run or a late segment deletion
TOPIC_RETENTION_MARGIN_S = 3600.0


def deleted_state_retention(settings: IngestSettings) -> float | None:
    """Seconds to keep a deleted document's state (None: forever): the configured retention,
    raised to the source topics' own retention (plus a margin) when they keep messages longer."""
    hours = settings.deleted_state_retention_hours
    if not hours:
        return None
    wanted = hours * 3600
    try:
        topics = topic_retention_s(settings.bootstrap, settings.topics, settings.kafka_config)
    except KafkaIOError as exc:
        log.warning("%s; deleted documents' state is dropped %.0f h after the delete: the source topics must not "
                    "keep messages longer (--deleted-state-retention-hours)", exc, hours)  # fmt: skip
        return wanted
    if math.isinf(topics):
        log.info("the source topics keep messages forever: so does the job keep deleted documents' state")
        return None
    if topics + TOPIC_RETENTION_MARGIN_S > wanted:
        log.info("the source topics keep messages up to %.0f h: deleted documents' state is kept that long plus %.0f h",
                 topics / 3600, TOPIC_RETENTION_MARGIN_S / 3600)  # fmt: skip
        return topics + TOPIC_RETENTION_MARGIN_S
    return wanted


def _resumed_micro_batches(updates: KeyedStream[DocUpdate], rt: Runtime, timeout: timedelta) -> KeyedStream[pa.Table]:
    """Rows of the micro-batches that a recovery directory written before embedding moved
    to every worker still holds: that step batched updates per writer before ``embed``, and
    its snapshot may hold updates read but not yet embedded. The step stays, under its
    step id, so that they are embedded and committed on resume; nothing new enters it."""
    nothing = op.filter("micro-batch-resumes-only", updates, lambda _: False)
    held = adaptive_collect("micro-batch", nothing, timeout, rt.settings.batch_max_events)  # (writer, [DocUpdate])
    return op.map_value("embed-resumed", held, rt.batch_embedder.rows)


def is_change(item: ChangeEvent | DeadLetter) -> TypeGuard[ChangeEvent]:
    return isinstance(item, ChangeEvent)


def build_flow(
    settings: IngestSettings | None = None,
    source: Source[SourceItem] | None = None,
    publish_dead_letters: Callable[[pa.Table], None] | None = None,
    embedder: Embedder | None = None,
) -> Dataflow:
    """The ingest dataflow for these settings (from the environment when not given).

    ``source``, ``publish_dead_letters`` and ``embedder`` replace the Kafka input, the
    dead-letter topic and the model (tests use in-memory ones).
    """
    settings = settings or IngestSettings()
    rt = Runtime(settings, embedder)
    batch_timeout = timedelta(milliseconds=settings.batch_timeout_ms)
    if source is None:
        rt.state_retention_s = deleted_state_retention(settings)
        source = IdleStoppingKafkaSource(
            brokers=[settings.bootstrap],
            topics=settings.topics,
            idle_s=settings.until_idle_s,
            add_config={**settings.kafka_config, "fetch.wait.max.ms": str(settings.fetch_wait_ms)},
        )
    if publish_dead_letters is None:
        publish_dead_letters = DeadLetterProducer(
            settings.bootstrap, settings.dlq_suffix, settings.kafka_config
        ).publish

    flow = Dataflow("streamrag-ingest")
    msgs = op.input("kafka-in", flow, source)  # KafkaSourceMessage | KafkaError
    decoded: Stream[ChangeEvent | DeadLetter] = op.filter_map("decode", msgs, rt.decode)  # ChangeEvent | DeadLetter
    split = op.branch("split-dead-letters", decoded, is_change)
    by_doc = op.key_on("key-by-doc", split.trues, lambda e: e.doc_id)  # (doc_id, ChangeEvent)
    updates = apply_to_doc("apply-to-doc", by_doc, rt)  # (doc_id, DocUpdate)
    # Embedding runs where each document's state is, so on every worker (a writer's worker
    # used to embed all of its documents: --writers processes ran the model, whatever the
    # workers). A worker embeds what an activation brings it together: a lone change at
    # once, a Kafka poll's backlog in one go (at most --batch-max-events updates per call);
    # the rows then go to the writer of their document (see ``Runtime.embed``).
    docs = op.key_rm("drop-doc-key", updates)  # DocUpdate
    rows = op.flat_map_batch("embed", docs, rt.embed)  # (writer, pa.Table)
    rows = op.merge("rows", rows, _resumed_micro_batches(updates, rt, batch_timeout))
    notices: Callable[[], NoticePublisher] | None = None  # one publisher per sink partition
    if settings.notices_topic and isinstance(source, IdleStoppingKafkaSource):  # tests' own sources have no broker
        notices = partial(NoticePublisher, settings.bootstrap, settings.notices_topic, settings.kafka_config)

    op.output("lake-chunks", rows, LakeSink(rt.lake, CHUNKS, settings, notices=notices))

    dead = cast(Stream[DeadLetter], split.falses)  # a TypeGuard narrows only the trues
    letters = op.key_on(
        "key-dead-letters", dead, lambda d: rt.writer_key(f"{d.kafka.topic}/{d.kafka.partition}")
    )  # (writer, DeadLetter)
    letter_batches = op.collect("dead-letter-batch", letters, batch_timeout, 256)  # (writer, [DeadLetter])
    letter_rows = op.map_value("dead-letter-rows", letter_batches, dead_letter_rows)  # (writer, pa.Table)
    dl_sink = LakeSink(rt.lake, DEAD_LETTERS, settings, before_commit=publish_dead_letters)
    op.output("lake-dead-letters", letter_rows, dl_sink)
    return flow
