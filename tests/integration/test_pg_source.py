"""The Postgres source against a real Postgres and the real broker: what it publishes is
what the ingest job decodes as Debezium's, and a lake fed by it equals the database."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import REGISTRY

from pipelines.debezium import decode
from pipelines.lake import Lake
from pipelines.mapping import MappingConfig
from pipelines.pgsource import PostgresSource, SourceError, SourceOptions
from pipelines.records import ChangeEvent, DeadLetter, KafkaCoordinates
from tests.integration.helpers import cli, ingest_args, kill_group, read_topic, start
from tests.integration.test_ingest import chunker_for
from tests.oracle import assert_lake_matches
from tests.pgdb import Database, new_database

pytestmark = pytest.mark.integration


def decoded(bootstrap: str, topic: str) -> list[ChangeEvent | DeadLetter]:
    found = []
    for m in read_topic(bootstrap, topic):
        coords = KafkaCoordinates(m.topic(), m.partition(), m.offset())
        found.append(decode(m.key(), m.value(), coords, MappingConfig(), tuple(m.headers() or ())))
    return found


class Running:
    """The source on a thread (stop() for a clean stop)."""

    def __init__(self, options: SourceOptions) -> None:
        self.source = PostgresSource(options)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.source.run()
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.error = exc

    def wait_sent(self, count: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.source.sent < count and time.monotonic() < deadline and self.error is None:
            time.sleep(0.05)
        assert self.error is None and self.source.sent >= count, (self.error, self.source.sent)

    def stop(self) -> None:
        self.source.stop()
        self.thread.join(30)
        self.source.close()
        assert self.error is None, self.error


def options(db: Database, broker: str, tmp_path: Path, **extra: Any) -> SourceOptions:
    return SourceOptions(db.dsn, "streamrag", f"slot_{db.name}", broker, state_dir=tmp_path / "state", **extra)


COUNTED = [
    ("streamrag_cdc_events_total", {"op": "r"}),
    ("streamrag_cdc_events_total", {"op": "u"}),
    ("streamrag_cdc_events_total", {"op": "d"}),
    ("streamrag_cdc_events_total", {"op": "c"}),
    ("streamrag_cdc_events_total", {"op": "t"}),
    ("streamrag_cdc_unrepresentable_total", {}),
    ("streamrag_cdc_commit_to_acknowledged_seconds_count", {}),
]


def test_snapshot_then_changes_decode_as_debeziums(postgres, broker: str, tmp_path: Path) -> None:
    db = new_database(postgres)
    db.execute("INSERT INTO docs VALUES (1, 'One', 'first body', '{}'), (2, 'Two', 'second', '{hr}'), "
               "(3, 'Three', 'third', '{}')")  # fmt: skip
    db.execute("CREATE TABLE shapes (id int PRIMARY KEY, title text, body text, acl text[], p point)")
    before = [REGISTRY.get_sample_value(name, labels) or 0.0 for name, labels in COUNTED]
    running = Running(options(db, broker, tmp_path))
    running.wait_sent(3)
    db.execute("UPDATE docs SET body = 'first body, edited' WHERE id = 1")  # may land at the slot's very LSN
    db.execute("DELETE FROM docs WHERE id = 2")
    db.execute("UPDATE docs SET id = 30 WHERE id = 3")  # a new primary key: d + tombstone + c
    db.execute("INSERT INTO shapes VALUES (1, 't', 'b', '{}', point(1, 2))")  # no JSON form: a dead letter
    db.execute("TRUNCATE shapes")
    running.wait_sent(3 + 1 + 2 + 3 + 2)
    running.stop()  # waits for every acknowledgement and confirms the slot past them
    confirmed = running.source.confirmed_lsn
    counted = [(REGISTRY.get_sample_value(n, ls) or 0.0) - b for (n, ls), b in zip(COUNTED, before, strict=True)]
    # r, u, d (a delete and a key change), c (the key change), t, dead letters, transactions acknowledged
    assert counted == [3, 1, 2, 1, 1, 1, 5], counted
    assert confirmed > 0 and REGISTRY.get_sample_value("streamrag_cdc_confirmed_lsn") == confirmed
    slot = db.rows("SELECT confirmed_flush_lsn - '0/0'::pg_lsn FROM pg_replication_slots WHERE slot_name = %s",
                   (f"slot_{db.name}",))  # fmt: skip
    assert int(slot[0][0]) == confirmed  # the server has it: a restart re-sends nothing

    events = decoded(broker, f"cdc.{db.name}.public.docs")
    by_pk: dict[str, list[ChangeEvent]] = {}
    for e in events:
        assert isinstance(e, ChangeEvent), e
        by_pk.setdefault(e.source_pk, []).append(e)
    one = by_pk["1"]
    assert [e.op for e in one] == ["upsert", "upsert"] and one[1].text.endswith("first body, edited")
    assert one[0].position is not None and one[1].position is not None and one[0].position < one[1].position
    two = by_pk["2"]
    assert [(e.op, e.tombstone) for e in two] == [("upsert", False), ("delete", False), ("delete", True)]
    assert two[0].acl == ("hr",)
    assert [(e.op, e.tombstone) for e in by_pk["3"]] == [("upsert", False), ("delete", False), ("delete", True)]
    assert [e.op for e in by_pk["30"]] == ["upsert"] and by_pk["30"][0].title == "Three"

    shapes = decoded(broker, f"cdc.{db.name}.public.shapes")
    assert len(shapes) == 2 and all(isinstance(s, DeadLetter) for s in shapes)
    errors = sorted(s.error for s in shapes)  # type: ignore[union-attr]  # (unkeyed: either partition, either order)
    assert "op 't'" in errors[0] and "column 'p': type point" in errors[1], errors
    raw = json.loads(read_topic(broker, f"cdc.{db.name}.public.docs")[0].value())
    assert raw["source"]["connector"] == "postgresql" and raw["source"]["snapshot"] in ("true", "last")
    assert raw["op"] == "r" and raw["source"]["db"] == db.name and raw["source"]["table"] == "docs"


def test_a_restart_streams_what_changed_while_it_was_down_without_a_new_snapshot(
    postgres, broker: str, tmp_path: Path
) -> None:
    db = new_database(postgres)
    db.execute("INSERT INTO docs VALUES (1, 'One', 'a', '{}')")
    running = Running(options(db, broker, tmp_path))
    running.wait_sent(1)
    running.stop()
    db.execute("UPDATE docs SET body = 'b' WHERE id = 1")  # while the source is down: the slot keeps it
    db.execute("INSERT INTO docs VALUES (2, 'Two', 'c', '{}')")
    running = Running(options(db, broker, tmp_path))
    running.wait_sent(2)
    time.sleep(0.5)
    running.stop()
    events = [e for e in decoded(broker, f"cdc.{db.name}.public.docs") if isinstance(e, ChangeEvent)]
    assert sorted((e.source_pk, e.text.split("\n")[-1]) for e in events) == [("1", "a"), ("1", "b"), ("2", "c")]


def test_a_lost_slot_after_the_snapshot_is_refused_not_silently_resnapshotted(
    postgres, broker: str, tmp_path: Path
) -> None:
    db = new_database(postgres)
    running = Running(options(db, broker, tmp_path))
    time.sleep(1)
    running.stop()
    db.execute("SELECT pg_drop_replication_slot(%s)", (f"slot_{db.name}",))
    source = PostgresSource(options(db, broker, tmp_path))
    with pytest.raises(SourceError, match="is gone"):
        source.run()
    source.close()


def test_sql_through_the_source_and_the_ingest_job_gives_a_lake_equal_to_the_database(
    postgres, broker: str, real_embedder, tmp_path: Path
) -> None:
    """The CLI as a user runs it: ``cdc postgres`` and ``ingest`` side by side, SQL changes
    (inserts, updates, an ACL change, deletes, a re-created row) while both run."""
    db = new_database(postgres)
    db.execute("INSERT INTO docs SELECT g, 'Doc ' || g, 'Body of document ' || g || '. It talks about topic '"
               " || (g % 7) || '.', CASE WHEN g % 5 = 0 THEN '{hr}'::text[] ELSE '{}' END "
               "FROM generate_series(1, 40) g")  # fmt: skip
    topic = f"cdc.{db.name}.public.docs"
    log = tmp_path / "source.log"
    source = start(["cdc", "postgres", "--dsn", db.dsn, "--publication", "streamrag", "--slot", f"s_{db.name}",
                    "--bootstrap", broker, "--state-dir", str(tmp_path / "state")], None, log)  # fmt: skip
    try:
        for i in range(1, 41, 3):
            db.execute("UPDATE docs SET body = body || ' Edited.' WHERE id = %s", (i,))
        db.execute("UPDATE docs SET acl = '{ops}' WHERE id = 2")
        db.execute("DELETE FROM docs WHERE id IN (5, 6, 7)")
        db.execute("INSERT INTO docs VALUES (6, 'Doc 6 again', 'A new life for six.', '{}')")
        db.execute("BEGIN; UPDATE docs SET title = 'Doc 8 renamed' WHERE id = 8; DELETE FROM docs WHERE id = 9; COMMIT")
        lake_dir = tmp_path / "lake"
        out = cli(*ingest_args(broker, topic, str(lake_dir), tmp_path / "recovery", idle=6))
        assert out.returncode == 0, out.stderr[-3000:]
    finally:
        kill_group(source)
    lake = Lake.at(str(lake_dir))
    expected = SimpleNamespace(expected=db.docs(), malformed=0)
    assert_lake_matches(lake, expected, chunker_for(real_embedder, str(lake_dir)))  # type: ignore[arg-type]


def test_the_command_says_what_is_wrong(postgres, broker: str, tmp_path: Path) -> None:
    """Bad input gets a sentence and a non-zero exit, never a traceback."""
    db = new_database(postgres)
    base = ["cdc", "postgres", "--slot", "s_cli", "--bootstrap", broker, "--state-dir", str(tmp_path)]
    missing = cli(*base, "--publication", "streamrag", env={"STREAMRAG_PG_DSN": ""})
    assert missing.returncode == 2 and "--dsn (or $STREAMRAG_PG_DSN) is required" in missing.stderr
    nopub = cli(*base, "--dsn", db.dsn, "--publication", "nosuch")
    assert nopub.returncode == 1 and "publication 'nosuch' does not exist: CREATE PUBLICATION" in nopub.stderr
    down = cli(*base, "--dsn", "host=127.0.0.1 port=1 user=x dbname=x password=hunter2-secret", "--publication", "p")
    assert down.returncode == 1 and "error: " in down.stderr and "Connection refused" in down.stderr
    assert "hunter2-secret" not in down.stderr
    for out in (missing, nopub, down):
        assert "Traceback" not in out.stderr


def test_schema_changes_are_followed_and_a_dropped_text_column_is_a_dead_letter(
    postgres, broker: str, tmp_path: Path
) -> None:
    """An added column flows on (the ingest job ignores unmapped columns); once the text
    column is dropped, a change is a dead letter that says so, not a document emptied."""
    db = new_database(postgres)
    db.execute("INSERT INTO docs VALUES (1, 'One', 'first', '{}')")
    running = Running(options(db, broker, tmp_path))
    running.wait_sent(1)
    db.execute("ALTER TABLE docs ADD COLUMN summary text")
    db.execute("UPDATE docs SET body = 'second', summary = 's' WHERE id = 1")
    db.execute("ALTER TABLE docs DROP COLUMN body")
    db.execute("UPDATE docs SET title = 'One, renamed' WHERE id = 1")
    running.wait_sent(3)
    running.stop()
    events = decoded(broker, f"cdc.{db.name}.public.docs")
    assert isinstance(events[1], ChangeEvent) and events[1].text == "second"
    assert isinstance(events[2], DeadLetter) and "no text column (body) is in the row" in events[2].error
