"""The Postgres source (``streamrag cdc postgres``): one JSON line per figure, against a
baseline measured in the same run.

    .venv/bin/python benchmarks/source.py [--rows 20000] [--rate 1000] [--seconds 15]

- snapshot: rows/s of the initial snapshot of a --rows table (every row acknowledged by Kafka).
- backlog: --rows single-row updates made while the source was stopped, then the source
  started: changes/s until the slot's confirmed position passed the last of them (every
  change decoded, converted, produced and acknowledged), against ``pg_recvlogical`` reading
  the same backlog through its own slot with the same plugin and publication (Postgres's own
  client: the server's decoding and the transfer, nothing else: the ceiling here).
- paced: changes at --rate/s (10-row transactions) for --seconds while the source runs:
  COMMIT → produced lag (p50/p95/p99, from the commit timestamp in ``source.ts_ms`` and
  the Kafka message timestamp) and whether it kept up. Target: 1,000 changes/s on 2 cores.

Postgres is Debian's, as a local cluster with fsync on (``pipelines.pgcluster``); the broker
is the embedded Tansu.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psycopg2
from confluent_kafka import Consumer, TopicPartition

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipelines.broker import free_port, start_broker  # noqa: E402
from pipelines.pgcluster import LocalPostgres, docs_table  # noqa: E402

CLI = [sys.executable, "-m", "retrieval.cli"]
TOPIC = "cdc.bench.public.docs"


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def confirmed(db: Any, slot: str) -> int:
    with db.cursor() as cur:
        cur.execute(
            "SELECT confirmed_flush_lsn - '0/0'::pg_lsn FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        )
        row = cur.fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def wal_lsn(db: Any) -> int:
    with db.cursor() as cur:
        cur.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")
        return int(cur.fetchone()[0])


def start_source(dsn: str, bootstrap: str, work: Path) -> subprocess.Popen[bytes]:
    log = (work / "source.log").open("ab")
    return subprocess.Popen([*CLI, "cdc", "postgres", "--dsn", dsn, "--publication", "bench", "--slot", "bench",
                             "--bootstrap", bootstrap, "--topic-prefix", "cdc.bench", "--state-dir",
                             str(work / "state")], stdout=log, stderr=log, start_new_session=True)  # fmt: skip


def stop(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(60)


def wait_until(check: Any, timeout: float, proc: subprocess.Popen[bytes], work: Path) -> float:
    t0 = time.monotonic()
    while not check():
        if proc.poll() is not None:
            raise RuntimeError(f"the source exited: {(work / 'source.log').read_text()[-2000:]}")
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"timed out; {(work / 'source.log').read_text()[-2000:]}")
        time.sleep(0.01)
    return time.monotonic() - t0


def updates(db: Any, rows: int, per_tx: int, tag: str) -> int:
    """Single-row UPDATEs in transactions of ``per_tx``; returns an LSN the last one's commit
    record ends after (so a slot confirmed past it has every change)."""
    last = 0
    with db.cursor() as cur:
        cur.execute("SET synchronous_commit = off")  # making the backlog fast: its durability is not measured
        for lo in range(1, rows + 1, per_tx):
            cur.execute("BEGIN")
            for pk in range(lo, min(rows, lo + per_tx - 1) + 1):
                cur.execute("UPDATE docs SET body = %s WHERE id = %s", (f"{tag} {pk}: " + "x" * 200, pk))
            cur.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn")
            last = int(cur.fetchone()[0])
            cur.execute("COMMIT")
        cur.execute("SET synchronous_commit = on")
    return last


def lags(bootstrap: str, since_ms: int, expected: int, timeout: float = 60) -> list[float]:
    """COMMIT → produced (seconds) of the change events on the topic committed after ``since_ms``."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-lag", "enable.auto.commit": False})
    meta = consumer.list_topics(TOPIC, timeout=10).topics[TOPIC]
    consumer.assign([TopicPartition(TOPIC, p, 0) for p in meta.partitions])
    out: list[float] = []
    deadline = time.monotonic() + timeout
    while len(out) < expected and time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is None or msg.error() or msg.value() is None:
            continue
        value = json.loads(msg.value())
        commit_ms = value["source"]["ts_ms"]
        if value["op"] == "u" and commit_ms >= since_ms:
            out.append((msg.timestamp()[1] - commit_ms) / 1000)
    consumer.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=1000.0, help="paced: changes per second")
    parser.add_argument("--seconds", type=float, default=15.0, help="paced: how long")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="srbench-source-"))
    port = free_port()
    broker = start_broker(port)
    bootstrap = f"127.0.0.1:{port}"
    server = LocalPostgres().start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        db = psycopg2.connect(server.dsn())
        db.autocommit = True
        with db.cursor() as cur:
            cur.execute(docs_table() + " CREATE PUBLICATION bench FOR TABLE docs")
            cur.execute("INSERT INTO docs SELECT g, 'Doc ' || g, repeat('y', 200), '{}' "
                        "FROM generate_series(1, %s) g", (args.rows,))  # fmt: skip

        # snapshot
        proc = start_source(server.dsn(), bootstrap, work)
        procs.append(proc)
        state = work / "state" / "bench.json"
        took = wait_until(state.exists, 600, proc, work)
        emit(bench="source_snapshot", rows=args.rows, seconds=round(took, 2), rows_per_s=round(args.rows / took),
             note="from process start (imports, connect, slot creation included)")  # fmt: skip
        stop(proc)
        procs.remove(proc)

        # backlog: ours vs pg_recvlogical on a slot of its own, created before the changes
        with db.cursor() as cur:
            cur.execute("SELECT pg_create_logical_replication_slot('baseline', 'pgoutput')")
        start_lsn = wal_lsn(db)
        last_commit = updates(db, args.rows, 1, "backlog")
        end_lsn = wal_lsn(db)
        bindir = server.bindir
        t0 = time.monotonic()
        base = subprocess.run(
            [str(bindir / "pg_recvlogical"), "-d", server.dsn(), "--slot", "baseline", "--start", "-f", os.devnull,
             "-o", "proto_version=1", "-o", "publication_names=bench",
             "-E", f"{end_lsn >> 32:X}/{end_lsn & 0xFFFFFFFF:X}", "--no-loop"],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        baseline_s = time.monotonic() - t0
        if base.returncode != 0:
            raise RuntimeError(f"pg_recvlogical: {base.stderr[-1000:]}")
        proc = start_source(server.dsn(), bootstrap, work)
        procs.append(proc)
        wait_until(lambda: (work / "source.log").read_text().count("streaming slot") >= 2, 60, proc, work)
        took = wait_until(lambda: confirmed(db, "bench") > last_commit, 600, proc, work)
        emit(bench="source_backlog", changes=args.rows, wal_mb=round((end_lsn - start_lsn) / 2**20, 1),
             seconds=round(took, 2), changes_per_s=round(args.rows / took),
             baseline="pg_recvlogical (pgoutput, same publication)", baseline_seconds=round(baseline_s, 2),
             baseline_changes_per_s=round(args.rows / baseline_s), ratio=round(baseline_s / took, 2),
             note="from the source's first read of the slot; single-row transactions")  # fmt: skip

        # paced, with the source running
        since_ms = int(time.time() * 1000)
        total = int(args.rate * args.seconds)
        per_tx = 10
        t0 = time.monotonic()
        with db.cursor() as cur:
            for i in range(0, total, per_tx):
                due = t0 + i / args.rate
                time.sleep(max(0.0, due - time.monotonic()))
                cur.execute("BEGIN")
                for j in range(per_tx):
                    pk = (i + j) % args.rows + 1
                    cur.execute("UPDATE docs SET body = %s WHERE id = %s", (f"paced {i + j}: " + "z" * 200, pk))
                cur.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn")
                last_commit = int(cur.fetchone()[0])
                cur.execute("COMMIT")
        offered_s = time.monotonic() - t0
        behind = wait_until(lambda: confirmed(db, "bench") > last_commit, 600, proc, work)
        found = lags(bootstrap, since_ms, total)
        p = np.percentile(np.array(found) * 1000, [50, 95, 99]) if found else [None] * 3
        lag_ms = dict(zip(("p50", "p95", "p99"), [round(x) for x in p], strict=True))
        emit(bench="source_paced", offered_per_s=round(total / offered_s), changes=total, per_transaction=per_tx,
             seen=len(found), commit_to_produced_ms=lag_ms,
             caught_up_after_s=round(behind, 2), target="1000 changes/s on 2 cores")  # fmt: skip
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        server.stop()
        broker.terminate()
        broker.wait(30)


if __name__ == "__main__":
    main()
