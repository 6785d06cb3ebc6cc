"""A Postgres source: a consistent snapshot, then the changes of a logical replication slot,
published to Kafka as Debezium change events (``streamrag cdc postgres``).

The events are the ones Debezium's Postgres connector writes with its JSON converter
(schemas off): ``before``/``after`` (``before`` holds the old row under REPLICA IDENTITY
FULL, its key otherwise), ``op`` ``r`` (snapshot) / ``c`` / ``u`` / ``d`` / ``t`` (truncate),
``source`` with ``lsn``, ``txId``, ``ts_ms``, ``snapshot``, ``db``, ``schema``, ``table``,
keyed by the primary key (``{"id": 7}``), one topic per table (``<prefix>.<schema>.<table>``),
a tombstone after each delete; an update that changes the primary key is a delete of the old
key, its tombstone and a create. The ingest job cannot tell them from Debezium's.

Nothing lost, nothing applied twice:

- **Snapshot.** The slot is created with an exported snapshot; every published table is read
  in that snapshot (a REPEATABLE READ transaction, ``itersize`` rows at a time) and each row
  sent with a position just before the slot's consistent point (the stream's first change
  can be at that very LSN), so the stream starts exactly where the snapshot ends. Only once
  every snapshot row is acknowledged by Kafka does the source write its state file
  (``<state-dir>/<slot>.json``); a source killed before that drops the slot and snapshots
  again at the next start (the rows come again with a newer position and the same content:
  the ingest job writes nothing for an unchanged document).
- **Order.** Each event's ``source`` also carries ``commit_lsn``, its transaction's commit
  record, and the ingest job orders a row's changes by (commit LSN, change LSN): a
  transaction that began while the slot was being created can commit after the slot's
  consistent point (so it is streamed, not in the snapshot) with changes whose own LSNs
  precede that point; by change LSN alone they would sort before the snapshot's rows and be
  dropped as stale.
- **Stream.** Changes are produced as they are decoded, without waiting; each transaction
  counts its events' delivery reports, and every ``flush_interval_s`` (or when the stream is
  quiet) the slot's confirmed flush position moves to the end of the last transaction whose
  events, and every earlier transaction's, Kafka acknowledged.
  A kill -9 at any point re-sends at most the transactions after that position, which the
  ingest job already skips by position (Postgres re-sends whole transactions). The producer
  is idempotent (no duplicates from its own retries). A failed delivery stops the source
  with an error before the position moves.
- **What cannot be represented** (a column type without a JSON form, an unchanged TOASTed
  value without the old row to copy it from) is still published, on the table's topic with a
  ``streamrag-error`` header saying why: the ingest job writes it to the dead-letter table
  with that reason. TRUNCATE is published as Debezium does (``op: t``) and the ingest job
  dead-letters it ("apply it by hand"). Schema changes are followed (each relation message
  replaces the columns the source knows) and logged.

A slot that disappeared after the snapshot (dropped by hand, or invalidated by
``max_slot_wal_keep_size``) lost the changes made meanwhile: the source refuses to start
and says so (``--resnapshot`` starts over, knowingly).
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import signal
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from pipelines import metrics
from pipelines.broker import ensure_topics
from pipelines.debezium import SOURCE_ERROR_HEADER
from pipelines.kafka_io import PRODUCER_DEFAULTS, KafkaIOError
from pipelines.pgoutput import (
    UNCHANGED,
    Begin,
    Column,
    Commit,
    Delete,
    Insert,
    PgType,
    Relation,
    Truncate,
    Unsupported,
    Update,
    parse,
    to_json,
)

log = logging.getLogger(__name__)

ERROR_HEADER = SOURCE_ERROR_HEADER
CONNECTOR_VERSION = "streamrag-pg-1"


class SourceError(RuntimeError):
    """The source cannot start or go on (the message says what to do)."""


@dataclass
class SourceOptions:
    dsn: str
    publication: str
    slot: str
    bootstrap: str
    topic_prefix: str | None = None  # default: cdc.<database>
    state_dir: Path = Path(".streamrag/cdc")
    kafka_config: dict[str, str] = field(default_factory=dict)
    snapshot_batch_rows: int = 1000
    flush_interval_s: float = 0.05
    resnapshot: bool = False
    partitions: int = 2  # of the topics the source creates
    metrics_port: int | None = None  # Prometheus metrics on metrics_host:port
    metrics_host: str = "127.0.0.1"


@dataclass
class _Table:
    relation: Relation
    keys: tuple[str, ...]  # primary key columns (in key order)
    topic: str


def _ident(name: str) -> str:
    """A quoted SQL identifier (names come from the catalog, and may hold any character)."""
    return '"' + name.replace('"', '""') + '"'


#: what Postgres accepts as a replication slot's name
SLOT_NAME = re.compile(r"[a-z0-9_]{1,63}")


def _lsn_text(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def _lsn_int(text: str) -> int:
    high, low = text.split("/")
    return int(high, 16) << 32 | int(low, 16)


class PostgresSource:
    """One slot's snapshot and stream into Kafka (module docstring). ``run`` until ``stop``."""

    def __init__(self, options: SourceOptions, producer: Any = None) -> None:
        import psycopg2

        if not SLOT_NAME.fullmatch(options.slot):
            raise SourceError(f"slot name {options.slot!r}: lower-case letters, digits and _ only (at most 63).")
        self.options = options
        self._pg = psycopg2
        self._conn = psycopg2.connect(options.dsn)
        self._conn.autocommit = True
        self.database = self._one("SELECT current_database()")
        self.prefix = options.topic_prefix or f"cdc.{self.database}"
        if producer is None:
            from confluent_kafka import Producer

            producer = Producer(
                {"bootstrap.servers": options.bootstrap, **PRODUCER_DEFAULTS, "linger.ms": "5", **options.kafka_config}
            )
        self.producer = producer
        self._errors: list[str] = []
        self._stop = threading.Event()
        self._types: dict[int, PgType] = {}
        self._tables: dict[int, _Table] = {}
        self._tx: Begin | None = None
        #: the open transaction's [end LSN (at its commit), events not yet acknowledged, commit time (ms)]
        self._counting: list[int] | None = None
        #: committed transactions in commit order, each [end LSN, events not yet acknowledged, commit ms]
        self._unacked: deque[list[int]] = deque()
        self.sent = 0  # events produced (tombstones included)
        self.confirmed_lsn = 0

    # -- set-up -------------------------------------------------------------------------

    def _one(self, sql: str, args: tuple[Any, ...] = ()) -> Any:
        with self._conn.cursor() as cur:
            cur.execute(sql, args)
            row = cur.fetchone()
            return None if row is None else row[0]

    def _check(self) -> list[tuple[str, str]]:
        """The publication's tables; clear errors for what the database lacks."""
        if self._one("SHOW wal_level") != "logical":
            raise SourceError("wal_level is not 'logical': set it in postgresql.conf and restart Postgres.")
        if not self._one("SELECT count(*) FROM pg_publication WHERE pubname = %s", (self.options.publication,)):
            raise SourceError(
                f"publication {self.options.publication!r} does not exist: "
                f"CREATE PUBLICATION {self.options.publication} FOR TABLE <tables>;"
            )
        with self._conn.cursor() as cur:
            cur.execute(
                "SELECT p.schemaname, p.tablename, c.relreplident FROM pg_publication_tables p "
                "JOIN pg_namespace n ON n.nspname = p.schemaname "
                "JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = p.tablename "
                "WHERE p.pubname = %s ORDER BY 1, 2",
                (self.options.publication,),
            )
            rows = cur.fetchall()
        for schema, table, identity in rows:
            if identity != "f":
                log.warning(
                    "%s.%s: REPLICA IDENTITY is not FULL: updates and deletes carry only the key in 'before' "
                    "(ALTER TABLE %s.%s REPLICA IDENTITY FULL)",
                    schema,
                    table,
                    schema,
                    table,
                )
        return [(s, t) for s, t, _ in rows]

    def _state_path(self) -> Path:
        return self.options.state_dir / f"{self.options.slot}.json"

    def _load_state(self) -> dict[str, Any] | None:
        try:
            state = json.loads(self._state_path().read_text())
        except FileNotFoundError:
            return None
        return state if isinstance(state, dict) else None

    def _save_state(self, state: dict[str, Any]) -> None:
        path = self._state_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".state-")
        with os.fdopen(fd, "w") as fh:
            json.dump(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    def _slot_exists(self) -> bool:
        return bool(self._one("SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", (self.options.slot,)))

    def pg_type(self, oid: int) -> PgType:
        found = self._types.get(oid)
        if found is None:
            with self._conn.cursor() as cur:
                cur.execute(
                    "SELECT oid, typname, typcategory, typtype, typelem, typbasetype FROM pg_type WHERE oid = %s",
                    (oid,),
                )
                row = cur.fetchone()
            if row is None:
                raise Unsupported(f"type oid {oid} is not in pg_type.")
            found = self._types[oid] = PgType(int(row[0]), row[1], row[2], row[3], int(row[4]), int(row[5]))
            for related in (found.element, found.base):
                if related and related not in self._types:
                    self.pg_type(related)
        return found

    def _primary_key(self, schema: str, table: str) -> tuple[str, ...]:
        with self._conn.cursor() as cur:
            cur.execute(
                "SELECT a.attname FROM pg_index i "
                "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
                "WHERE i.indrelid = %s::regclass AND i.indisprimary ORDER BY array_position(i.indkey, a.attnum)",
                (f"{_ident(schema)}.{_ident(table)}",),
            )
            return tuple(r[0] for r in cur.fetchall())

    # -- events ---------------------------------------------------------------------------

    def _row(self, table: _Table, values: tuple[Any, ...]) -> dict[str, Any]:
        """A tuple as column → JSON value (raises Unsupported)."""
        out: dict[str, Any] = {}
        for column, text in zip(table.relation.columns, values, strict=False):
            if text is None:
                out[column.name] = None
            elif text is UNCHANGED:
                raise Unsupported(
                    f"column {column.name!r} is a TOASTed value the change left out and the old row was not "
                    "sent (ALTER TABLE … REPLICA IDENTITY FULL)"
                )
            else:
                try:
                    out[column.name] = to_json(text, self.pg_type(column.type_oid), self._types)
                except (Unsupported, ValueError) as exc:
                    raise Unsupported(f"column {column.name!r}: {exc}") from exc
        return out

    def _source(self, table: _Table, lsn: int, ts_ms: int, snapshot: str) -> dict[str, Any]:
        """The event's ``source`` block; the transaction's id and commit record come from the
        transaction being decoded (none in the snapshot)."""
        tx = self._tx
        return {
            "version": CONNECTOR_VERSION,
            "connector": "postgresql",
            "name": self.prefix,
            "ts_ms": ts_ms,
            "snapshot": snapshot,
            "db": self.database,
            "sequence": None,
            "schema": table.relation.schema,
            "table": table.relation.table,
            "txId": tx.xid if tx is not None else None,
            "lsn": lsn,
            # the transaction's commit record (not Debezium's): changes of one row in commit order
            "commit_lsn": tx.final_lsn if tx is not None else lsn,
            "xmin": None,
        }

    def topic(self, schema: str, table: str) -> str:
        return f"{self.prefix}.{schema}.{table}"

    def _key(self, table: _Table, row: dict[str, Any] | None) -> bytes | None:
        if not table.keys or row is None or any(k not in row for k in table.keys):
            return None
        return json.dumps({k: row[k] for k in table.keys}, separators=(",", ":")).encode()

    def _send(
        self, topic: str, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]] | None = None
    ) -> None:
        while True:
            counting = self._counting
            delivered = self._on_delivery if counting is None else partial(self._acknowledged, counting)
            try:
                self.producer.produce(topic, value, key, on_delivery=delivered, headers=headers)
                if counting is not None:
                    counting[1] += 1
                break
            except BufferError:  # the local queue is full: let deliveries drain
                self.producer.poll(0.1)
        self.sent += 1
        self.producer.poll(0)

    def _on_delivery(self, err: Any, _msg: Any) -> None:
        if err is not None:
            self._errors.append(str(err))

    def _acknowledged(self, transaction: list[int], err: Any, _msg: Any) -> None:
        if err is not None:
            self._errors.append(str(err))
            return
        transaction[1] -= 1
        self._observe_acknowledged(transaction)

    @staticmethod
    def _observe_acknowledged(transaction: list[int]) -> None:
        """COMMIT → acknowledged, once the commit was read and its last event acknowledged
        (either may come second: the acknowledgement can arrive before the commit message)."""
        if transaction[1] == 0 and transaction[0]:
            metrics.CDC_COMMIT_TO_ACK.observe(max(0.0, time.time() - transaction[2] / 1000))

    def _acknowledged_up_to(self) -> int:
        """The end LSN of the last transaction whose events, and every earlier one's, Kafka has
        acknowledged (0: none since the last call); raises if a delivery failed."""
        self.producer.poll(0)  # runs the delivery callbacks
        self._raise_if_failed()
        end = 0
        while self._unacked and self._unacked[0][1] == 0:
            end = self._unacked.popleft()[0]
        return end

    def _event(self, table: _Table, op: str, before: Any, after: Any, lsn: int, ts_ms: int,
               snapshot: str = "false") -> None:  # fmt: skip
        """Publish one change (and a tombstone after a delete); what cannot be converted goes
        as a change with the ``streamrag-error`` header, the raw text values as its ``after``."""
        try:
            before_row = None if before is None else self._row(table, before)
            after_row = None if after is None else self._row(table, after)
        except Unsupported as exc:
            raw = {
                c.name: (None if v is UNCHANGED else v)
                for c, v in zip(table.relation.columns, after or before or (), strict=False)
            }
            value = {"op": op, "after": raw, "source": self._source(table, lsn, ts_ms, snapshot)}
            log.warning("%s at %s: %s (sent as a dead letter)", table.topic, _lsn_text(lsn), exc)
            self._send(table.topic, None, json.dumps(value).encode(), [(ERROR_HEADER, str(exc).encode())])
            metrics.CDC_UNREPRESENTABLE.inc()
            return
        if op == "u" and before_row is not None and table.keys:
            old_key, new_key = self._key(table, before_row), self._key(table, after_row)
            if old_key is not None and old_key != new_key:  # the primary key changed: as Debezium, d + tombstone + c
                self._publish(table, "d", before_row, None, lsn, ts_ms, snapshot)
                self._publish(table, "c", None, after_row, lsn, ts_ms, snapshot)
                return
        self._publish(table, op, before_row, after_row, lsn, ts_ms, snapshot)

    def _publish(self, table: _Table, op: str, before: dict[str, Any] | None, after: dict[str, Any] | None,
                 lsn: int, ts_ms: int, snapshot: str) -> None:  # fmt: skip
        envelope = {
            "before": before,
            "after": after,
            "source": self._source(table, lsn, ts_ms, snapshot),
            "op": op,
            "ts_ms": int(time.time() * 1000),
            "transaction": None,
        }
        key = self._key(table, after if after is not None else before)
        self._send(table.topic, key, json.dumps(envelope, separators=(",", ":")).encode())
        metrics.CDC_EVENTS.labels(op).inc()
        if op == "d" and key is not None:
            self._send(table.topic, key, None)

    def _flush(self) -> None:
        self._raise_if_failed(self.producer.flush(30))

    def _raise_if_failed(self, undelivered: int = 0) -> None:
        if undelivered or self._errors:
            raise KafkaIOError(
                f"{undelivered} change events undelivered and {len(self._errors)} failed "
                f"({'; '.join(self._errors[:3])}); the slot keeps them: restart the source."
            )

    # -- snapshot ---------------------------------------------------------------------------

    def _columns(self, schema: str, table: str) -> tuple[Column, ...]:
        with self._conn.cursor() as cur:
            cur.execute(
                "SELECT attname, atttypid FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
                "AND NOT attisdropped ORDER BY attnum",
                (f"{_ident(schema)}.{_ident(table)}",),
            )
            return tuple(Column(name, int(oid), False) for name, oid in cur.fetchall())

    def _snapshot(self, repl: Any, tables: list[tuple[str, str]]) -> None:
        """Create the slot and send every row of ``tables`` as of its consistent point."""
        slot = self.options.slot
        cur = repl.cursor()
        cur.execute(f'CREATE_REPLICATION_SLOT "{slot}" LOGICAL pgoutput EXPORT_SNAPSHOT')
        _, consistent, snapshot_name, _ = cur.fetchone()
        # The first change after the slot can be at the consistent point itself: snapshot rows go
        # just before it, so that change is never taken for a duplicate of its row's snapshot.
        lsn = _lsn_int(consistent) - 1
        log.info("slot %s created at %s; snapshot of %d table(s)", slot, consistent, len(tables))
        ts_ms = int(time.time() * 1000)
        reader = self._pg.connect(self.options.dsn)
        try:
            reader.set_session(isolation_level="REPEATABLE READ", readonly=True)
            with reader.cursor() as setup:
                setup.execute("SET TRANSACTION SNAPSHOT %s", (snapshot_name,))
            for index, (schema, name) in enumerate(tables):
                columns = self._columns(schema, name)
                table = _Table(Relation(0, schema, name, "f", columns), self._primary_key(schema, name),
                               self.topic(schema, name))  # fmt: skip
                select_list = ", ".join(f"{_ident(c.name)}::text" for c in columns) or "1"
                rows = reader.cursor(name=f"streamrag_snapshot_{index}")
                rows.itersize = self.options.snapshot_batch_rows
                rows.execute(f"SELECT {select_list} FROM {_ident(schema)}.{_ident(name)}")
                sent = 0
                pending: tuple[Any, ...] | None = None
                for row in rows:
                    if pending is not None:
                        self._event(table, "r", None, pending, lsn, ts_ms, "true")
                        sent += 1
                    pending = tuple(row)
                    if sent % self.options.snapshot_batch_rows == 0:
                        self.producer.poll(0)
                    if self._stop.is_set():
                        raise SourceError("stopped during the snapshot: it starts over at the next start.")
                if pending is not None:
                    last = "last" if index == len(tables) - 1 else "true"
                    self._event(table, "r", None, pending, lsn, ts_ms, last)
                    sent += 1
                rows.close()
                log.info("snapshot of %s.%s: %d rows", schema, name, sent)
            reader.commit()
        finally:
            reader.close()
        self._flush()
        self._save_state({"slot": slot, "snapshot_lsn": consistent, "snapshot_done": True, "database": self.database})
        log.info("snapshot done: %d events acknowledged; streaming from %s", self.sent, consistent)

    # -- stream -----------------------------------------------------------------------------

    def _table(self, oid: int) -> _Table:
        table = self._tables.get(oid)
        if table is None:
            raise SourceError(f"a change for relation {oid} before its relation message (protocol violation).")
        return table

    def _on_relation(self, rel: Relation) -> None:
        old = self._tables.get(rel.oid)
        if old is not None and [(c.name, c.type_oid) for c in old.relation.columns] != [
            (c.name, c.type_oid) for c in rel.columns
        ]:
            log.warning(
                "schema change on %s.%s: columns %s → %s",
                rel.schema,
                rel.table,
                [c.name for c in old.relation.columns],
                [c.name for c in rel.columns],
            )
        keys = self._primary_key(rel.schema, rel.table) or tuple(c.name for c in rel.columns if c.key)
        self._tables[rel.oid] = _Table(rel, keys, self.topic(rel.schema, rel.table))

    def handle(self, data: bytes, lsn: int) -> int | None:
        """Apply one pgoutput message; returns a transaction's end LSN at its commit."""
        message = parse(data)
        tx = self._tx
        ts_ms = tx.commit_ts_ms if tx is not None else int(time.time() * 1000)
        if isinstance(message, Begin):
            self._tx = message
            self._counting = [0, 0, message.commit_ts_ms]
        elif isinstance(message, Commit):
            self._tx = None
            if self._counting is not None:
                self._counting[0] = message.end_lsn
                self._unacked.append(self._counting)
                self._observe_acknowledged(self._counting)
                self._counting = None
            return message.end_lsn
        elif isinstance(message, Relation):
            self._on_relation(message)
        elif isinstance(message, Insert):
            self._event(self._table(message.relation), "c", None, message.new, lsn, ts_ms)
        elif isinstance(message, Update):
            table = self._table(message.relation)
            old = message.old
            new = message.new
            if old is not None and not message.old_is_key and UNCHANGED in new:  # fill TOASTed values from the old row
                new = tuple(o if n is UNCHANGED else n for o, n in zip(old, new, strict=False))
            before = self._key_row(table, old) if old is not None and message.old_is_key else old
            self._event(table, "u", before, new, lsn, ts_ms)
        elif isinstance(message, Delete):
            table = self._table(message.relation)
            old = self._key_row(table, message.old) if message.old_is_key else message.old
            self._event(table, "d", old, None, lsn, ts_ms)
        elif isinstance(message, Truncate):
            for oid in message.relations:
                table = self._table(oid)
                envelope = {"before": None, "after": None, "op": "t", "ts_ms": int(time.time() * 1000),
                            "source": self._source(table, lsn, ts_ms, "false")}  # fmt: skip
                log.warning("TRUNCATE of %s.%s at %s", table.relation.schema, table.relation.table, _lsn_text(lsn))
                self._send(table.topic, None, json.dumps(envelope).encode())
                metrics.CDC_EVENTS.labels("t").inc()
        return None

    @staticmethod
    def _key_row(table: _Table, values: tuple[Any, ...]) -> tuple[Any, ...]:
        """A key-only old tuple (REPLICA IDENTITY DEFAULT): the key columns' values, nulls elsewhere."""
        return tuple(v if c.key else None for c, v in zip(table.relation.columns, values, strict=False))

    def _stream(self, repl: Any) -> None:
        cur = repl.cursor()
        cur.start_replication(
            slot_name=self.options.slot,
            decode=False,
            options={"proto_version": "1", "publication_names": self.options.publication},
        )
        log.info("streaming slot %s", self.options.slot)
        last_feedback = time.monotonic()
        while not self._stop.is_set():
            msg = cur.read_message()
            if msg is not None:
                self.handle(msg.payload, msg.data_start)
            now = time.monotonic()
            if msg is None or now - last_feedback >= self.options.flush_interval_s:
                # The slot moves only past transactions whose every event Kafka acknowledged.
                if not self._confirm(cur) and now - last_feedback >= self.options.flush_interval_s:
                    cur.send_feedback()  # a keepalive when the status interval is due
                last_feedback = now
            if msg is None:
                select.select([repl], [], [], self.options.flush_interval_s)
        self._flush()
        self._confirm(cur)

    def _confirm(self, cur: Any) -> bool:
        """Move the slot past the acknowledged transactions, if any are new; whether it moved."""
        end = self._acknowledged_up_to()
        if end <= self.confirmed_lsn:
            return False
        cur.send_feedback(flush_lsn=end, force=True)  # forced: psycopg2 otherwise waits for its 10 s interval
        self.confirmed_lsn = end
        metrics.CDC_CONFIRMED_LSN.set(end)
        return True

    # -- running ----------------------------------------------------------------------------

    def run(self) -> None:
        from psycopg2.extras import LogicalReplicationConnection

        tables = self._check()
        ensure_topics(
            self.options.bootstrap,
            [self.topic(schema, table) for schema, table in tables],
            self.options.partitions,
            config=self.options.kafka_config,
        )
        state = self._load_state()
        done = bool(state and state.get("snapshot_done") and state.get("slot") == self.options.slot)
        exists = self._slot_exists()
        if done and not exists and not self.options.resnapshot:
            raise SourceError(
                f"replication slot {self.options.slot!r} is gone (dropped or invalidated) since its snapshot at "
                f"{state and state.get('snapshot_lsn')}: the changes made meanwhile were not kept. "
                "Restart with --resnapshot to snapshot again (rows deleted meanwhile are not deleted downstream)."
            )
        if exists and (not done or self.options.resnapshot):
            log.warning("slot %s has no completed snapshot here: dropping it and snapshotting again", self.options.slot)
            self._one("SELECT pg_drop_replication_slot(%s)", (self.options.slot,))
            exists = False
        repl = self._pg.connect(self.options.dsn, connection_factory=LogicalReplicationConnection)
        try:
            if not exists:
                self._snapshot(repl, tables)
            self._stream(repl)
        finally:
            repl.close()

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self._conn.close()


def run_source(options: SourceOptions) -> int:
    """``streamrag cdc postgres``: run until SIGTERM/SIGINT; 0 on a clean stop."""
    source = PostgresSource(options)
    if options.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(options.metrics_port, addr=options.metrics_host)

    def on_signal(_signum: int, _frame: object) -> None:
        source.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        source.run()
    finally:
        source.close()
    log.info("stopped: %d events sent, slot confirmed up to %s", source.sent, _lsn_text(source.confirmed_lsn))
    return 0
