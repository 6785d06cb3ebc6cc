"""kill -9 of the Postgres source (mid-snapshot and mid-stream) and of the ingest job while
SQL changes flow: the lake ends equal to the database, with no chunk version twice."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipelines.lake import Lake
from tests.integration.helpers import ingest_args, kill_group, start
from tests.integration.test_ingest import chunker_for
from tests.oracle import assert_lake_matches
from tests.pgdb import Database, new_database

pytestmark = [pytest.mark.integration, pytest.mark.reliability]


def workload(db: Database, stop: threading.Event, seed: int, done: list[int]) -> None:
    """Random transactions over ids 1..300 until ``stop``: updates, ACL changes, deletes,
    re-creates, several changes of one row in one transaction, inserts."""
    rng = random.Random(seed)
    conn = db.conn
    n = 0
    while not stop.is_set():
        with conn.cursor() as cur:
            cur.execute("BEGIN")
            for _ in range(rng.randint(1, 4)):
                pk = rng.randint(1, 300)
                kind = rng.random()
                if kind < 0.45:
                    cur.execute("UPDATE docs SET body = body || %s WHERE id = %s", (f" Change {n}.", pk))
                elif kind < 0.55:
                    cur.execute("UPDATE docs SET acl = %s WHERE id = %s", (rng.choice([[], ["hr"], ["ops"]]), pk))
                elif kind < 0.7:
                    cur.execute("DELETE FROM docs WHERE id = %s", (pk,))
                else:
                    cur.execute(
                        "INSERT INTO docs VALUES (%s, %s, %s, '{}') "
                        "ON CONFLICT (id) DO UPDATE SET body = EXCLUDED.body",
                        (pk, f"Doc {pk}", f"Row {pk} written again by change {n}."),
                    )
                n += 1
            cur.execute("COMMIT")
        time.sleep(rng.uniform(0, 0.02))
    done.append(n)


def test_kill_9_of_the_source_and_the_ingest_job_under_sql_changes(
    postgres, broker: str, real_embedder, tmp_path: Path
) -> None:
    db = new_database(postgres)
    db.execute("INSERT INTO docs SELECT g, 'Doc ' || g, 'Body of row ' || g || '.', '{}' "
               "FROM generate_series(1, 300) g")  # fmt: skip
    # A large table the ingest job does not read, snapshotted first (by name): the snapshot
    # takes seconds, so a kill lands in it.
    db.execute("CREATE TABLE bulk (id int PRIMARY KEY, v text)")
    db.execute("INSERT INTO bulk SELECT g, 'v' || g FROM generate_series(1, 200000) g")
    topic = f"cdc.{db.name}.public.docs"
    source_args = ["cdc", "postgres", "--dsn", db.dsn, "--publication", "streamrag", "--slot", f"s_{db.name}",
                   "--bootstrap", broker, "--state-dir", str(tmp_path / "state")]  # fmt: skip
    log = tmp_path / "source.log"
    # Killed mid-snapshot: the next start drops the slot and snapshots again.
    source = start(source_args, None, log)
    deadline = time.monotonic() + 60
    while "created at" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    kill_group(source)
    text = log.read_text()
    assert "created at" in text and "snapshot done" not in text, text[-2000:]

    stop, done = threading.Event(), []
    writer = threading.Thread(target=workload, args=(db, stop, 7, done))
    writer.start()
    lake_dir, recovery = tmp_path / "lake", tmp_path / "recovery"
    ingest_log = tmp_path / "ingest.log"
    ingest = start(ingest_args(broker, topic, str(lake_dir), recovery, idle=3600), None, ingest_log)
    try:
        for round_ in range(3):  # the source killed mid-stream, three times; the ingest job once
            source = start(source_args, None, log)
            time.sleep(random.Random(round_).uniform(3, 6))
            kill_group(source)
            if round_ == 1:
                kill_group(ingest)
                ingest = start(ingest_args(broker, topic, str(lake_dir), recovery, idle=3600), None, ingest_log)
    finally:
        stop.set()
        writer.join(30)
    assert done and done[0] > 100, "the workload made too few changes to mean anything"
    kill_group(ingest)
    source = start(source_args, None, log)
    try:
        final = start(ingest_args(broker, topic, str(lake_dir), recovery, idle=8), None, ingest_log)
        assert final.wait(600) == 0, ingest_log.read_text()[-3000:]
    finally:
        kill_group(source)
    text = log.read_text()
    assert "dropping it and snapshotting again" in text and "snapshot done" in text, text[-3000:]
    expected = SimpleNamespace(expected=db.docs(), malformed=0)
    assert_lake_matches(Lake.at(str(lake_dir)), expected, chunker_for(real_embedder, str(lake_dir)))  # type: ignore[arg-type]
