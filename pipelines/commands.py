"""CLI commands of the pipelines package: ``broker``, ``produce``, ``ingest``."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from pipelines.secrets import kafka_config
from pipelines.storage import ObjectStoreSettings

log = logging.getLogger(__name__)


def add_commands(sub: Any) -> None:
    p = sub.add_parser("broker", help="run the embedded Kafka-compatible dev broker (Tansu)")
    p.add_argument("--port", type=int, default=9092)
    p.add_argument("--host", default="127.0.0.1", help="listen address (loopback by default)")
    p.set_defaults(func=cmd_broker)

    p = sub.add_parser("produce", help="publish a Debezium JSON-lines file to a topic")
    p.add_argument("--bootstrap", required=True, metavar="H:P")
    p.add_argument("--topic", required=True)
    p.add_argument("file", type=Path, metavar="FILE.jsonl")
    add_kafka_config_arg(p)
    p.set_defaults(func=cmd_produce)

    p = sub.add_parser("cdc", help="change-data-capture sources that publish Debezium events")
    cdc = p.add_subparsers(dest="source", required=True)
    p = cdc.add_parser(
        "postgres",
        help="snapshot, then stream a logical replication slot's changes as Debezium events (pgoutput)",
        description="Publishes every table of a publication to <topic-prefix>.<schema>.<table>: first a "
        "consistent snapshot (op r), then each change (c/u/d, tombstones, t for TRUNCATE). The slot's position "
        "moves only after Kafka acknowledged the events before it, so a restart re-sends at most the "
        "unacknowledged transactions (the ingest job skips them by position).",
    )
    p.add_argument(
        "--dsn",
        default=os.environ.get("STREAMRAG_PG_DSN"),
        help="libpq connection string (default $STREAMRAG_PG_DSN; a password is better in $PGPASSWORD)",
    )
    p.add_argument("--publication", required=True, help="CREATE PUBLICATION <name> FOR TABLE …")
    p.add_argument("--slot", required=True, help="logical replication slot (created with the snapshot)")
    p.add_argument("--bootstrap", required=True, metavar="H:P")
    add_kafka_config_arg(p)
    p.add_argument("--topic-prefix", help="topics are <prefix>.<schema>.<table> (default cdc.<database>)")
    p.add_argument("--partitions", type=int, default=2, help="partitions of topics the source creates (2)")
    p.add_argument(
        "--state-dir",
        type=Path,
        default=Path(".streamrag/cdc"),
        help="where the source notes a completed snapshot (<slot>.json; default .streamrag/cdc)",
    )
    p.add_argument("--snapshot-batch-rows", type=int, default=1000, help="rows read per fetch in the snapshot")
    p.add_argument(
        "--flush-interval-ms",
        type=float,
        default=50,
        help="how often deliveries are awaited and the slot's position confirmed (50)",
    )
    p.add_argument("--metrics-port", type=int, help="Prometheus metrics on this port (off by default)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="where the metrics listen (0.0.0.0 in containers)")
    p.add_argument(
        "--resnapshot",
        action="store_true",
        help="drop the slot and snapshot again (after a slot was lost: rows deleted meanwhile are not deleted)",
    )
    p.set_defaults(func=cmd_cdc_postgres)

    p = sub.add_parser("ingest", help="run the streaming job: Kafka CDC topics → chunks → lake")
    p.add_argument("--bootstrap", required=True, metavar="H:P")
    p.add_argument("--topic", action="append", required=True, dest="topics", help="repeat for more topics")
    add_kafka_config_arg(p)
    p.add_argument("--lake", required=True, metavar="URI", help="path, file:// or s3://bucket/prefix")
    p.add_argument("--recovery-dir", metavar="DIR", help="local directory for resume state")
    p.add_argument("--workers", type=int, help="processes on this machine (default 1)")
    p.add_argument(
        "--until-idle",
        type=float,
        metavar="SECONDS",
        dest="until_idle_s",
        help="exit 0 after this many seconds without new messages",
    )
    p.add_argument(
        "--topic-wait",
        type=float,
        metavar="SECONDS",
        dest="topic_wait_s",
        help="wait this long for a missing --topic to be created, e.g. by a source started alongside "
        "(60; 0: fail at once)",
    )
    p.add_argument("--mapping", dest="mapping_file", metavar="FILE", help="table → document mapping (YAML/JSON)")
    p.add_argument("--model", help="embedding model directory (default: bundled all-MiniLM-L6-v2)")
    p.add_argument("--device", help="auto (default: CUDA fp16 when present), cpu or cuda")
    p.add_argument(
        "--dtype",
        help="auto (default: fp32 on CPUs, run by ONNX Runtime; fp16 on GPUs), fp32, bf16 (faster on AVX512-BF16 "
        "CPUs), fp16 or int8 (ONNX Runtime on CPUs, ~2x fp32; a distinct model: serve the index with --dtype int8 "
        "too)",
    )
    p.add_argument(
        "--cpu-threads",
        type=int,
        help="threads the model uses on CPU (default: every core; ONNX Runtime runs each text alone on one, so a "
        "lone change takes one thread and a backlog every core)",
    )
    p.add_argument("--writers", type=int, help="lake writers (fixed when the lake is created; default 2)")
    p.add_argument("--job-name", help="names this job's lake writers (default 'ingest')")
    p.add_argument("--metrics-port", type=int, help="Prometheus port (process i uses port + i)")
    p.add_argument("--metrics-host", help="Prometheus listen address (127.0.0.1; 0.0.0.0 in containers)")
    p.add_argument(
        "--process-id",
        type=int,
        help="this machine's process in a multi-machine cluster (with --addresses; e.g. a StatefulSet ordinal)",
    )
    p.add_argument("--addresses", help="host:port of every cluster process, ';'-separated, in process-id order")
    p.add_argument("--epoch-interval", type=float, dest="epoch_interval_s", help="seconds between snapshots (2)")
    p.add_argument("--batch-max-events", type=int, help="most changes per embedding micro-batch (256)")
    p.add_argument(
        "--batch-timeout-ms",
        type=int,
        help="longest wait to fill a micro-batch under a backlog (200); a lone change waits none",
    )
    p.add_argument(
        "--fetch-wait-ms",
        type=int,
        help="longest a Kafka fetch waits for data (100); Kafka answers as soon as data arrives, "
        "Tansu (the embedded broker) holds the fetch: 10 there",
    )
    p.add_argument(
        "--notices-topic",
        help="Kafka topic announcing each lake commit to serving replicas (streamrag.commits; '' for none)",
    )
    p.add_argument(
        "--deleted-state-retention-hours",
        type=float,
        help="drop a deleted document's state this long after its delete, and never before the source topics' "
        "retention (read from the broker) has passed: no event older than the delete can arrive then "
        "(192; 0: keep forever)",
    )
    p.add_argument("--chunk-max-tokens", type=int, help="chunk size budget in tokens (200)")
    p.add_argument(
        "--context-weight",
        type=float,
        help="mix each chunk's vector with its neighbours' in the document at this weight, so the later "
        "chunks of an answer are found with its first (1 raised dense nDCG@10 on the Python FAQ 0.50 -> 0.63); "
        "a lake keeps the weight it was started with (default: the lake's, 1 for a new lake; 0: none)",
    )
    add_openlineage_arg(p)
    p.set_defaults(func=cmd_ingest)


def add_kafka_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kafka-config",
        metavar="FILE",
        help="librdkafka client properties (key=value: security.protocol, sasl.*, ssl.*); "
        "STREAMRAG_KAFKA_<PROPERTY> variables override them",
    )


def add_openlineage_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--openlineage",
        metavar="TARGET",
        help="where OpenLineage run events go: off, file:PATH or http(s)://marquez:5000 "
        "(default $STREAMRAG_OPENLINEAGE, else file:~/.local/state/streamrag/openlineage.jsonl)",
    )


def cmd_broker(args: argparse.Namespace) -> int:
    from pipelines.broker import start_broker

    stop = {"flag": False}

    def on_signal(_signum: int, _frame: object) -> None:
        stop["flag"] = True

    # Handlers first: a SIGTERM right after the address is printed must still stop cleanly.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    proc = start_broker(args.port, args.host)
    print(f"{args.host}:{args.port}", flush=True)
    log.info("Tansu broker (memory storage) on %s:%d; Ctrl-C or SIGTERM stops it", args.host, args.port)
    while not stop["flag"] and proc.poll() is None:
        try:
            proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        proc.terminate()
        proc.wait(10)
        return 0
    log.error("broker exited with %s", proc.returncode)
    return 1


def cmd_produce(args: argparse.Namespace) -> int:
    from pipelines.kafka_io import produce_file

    if not args.file.is_file():
        raise SystemExit(f"error: no such file {args.file}")
    n = produce_file(args.bootstrap, args.topic, args.file, kafka_config(args.kafka_config))
    print(f"produced {n} messages to {args.topic}")
    return 0


def cmd_cdc_postgres(args: argparse.Namespace) -> int:
    from pipelines.pgsource import SourceError, SourceOptions, run_source

    if not args.dsn:
        print("error: --dsn (or $STREAMRAG_PG_DSN) is required", file=sys.stderr)
        return 2
    if args.partitions < 1 or args.snapshot_batch_rows < 1 or args.flush_interval_ms <= 0:
        print("error: --partitions and --snapshot-batch-rows must be >= 1, --flush-interval-ms > 0", file=sys.stderr)
        return 2
    options = SourceOptions(
        dsn=args.dsn,
        publication=args.publication,
        slot=args.slot,
        bootstrap=args.bootstrap,
        topic_prefix=args.topic_prefix,
        state_dir=args.state_dir,
        kafka_config=kafka_config(args.kafka_config),
        snapshot_batch_rows=args.snapshot_batch_rows,
        flush_interval_s=args.flush_interval_ms / 1000,
        resnapshot=args.resnapshot,
        partitions=args.partitions,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
    )
    try:
        return run_source(options)
    except SourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def cmd_ingest(args: argparse.Namespace) -> int:
    from pipelines.openlineage import LineageRun, kafka_topic, storage
    from pipelines.runner import run_ingest, run_member
    from pipelines.settings import IngestSettings, from_args
    from pipelines.storage import join

    store = ObjectStoreSettings.from_env()
    settings = from_args(
        IngestSettings,
        args,
        cli_only=("openlineage", "process_id", "addresses", "kafka_config"),
        kafka_config=kafka_config(args.kafka_config),
        s3_endpoint_url=store.endpoint_url,
        s3_access_key_id=store.access_key_id,
        s3_secret_access_key=store.secret_access_key,
        s3_session_token=store.session_token,
        s3_region=store.region,
    )
    run = LineageRun(f"ingest.{settings.job_name}", args.openlineage, processing="STREAMING")
    inputs = [kafka_topic(settings.bootstrap, t) for t in settings.topics]
    outputs = [storage(join(settings.lake, "chunks")), storage(join(settings.lake, "dead_letters"))]
    outputs += [kafka_topic(settings.bootstrap, t + settings.dlq_suffix) for t in settings.topics]
    if (args.process_id is None) != (args.addresses is None):
        print("error: --process-id and --addresses go together", file=sys.stderr)
        return 2
    run.start(inputs, outputs)
    try:
        if args.process_id is not None:
            status = run_member(settings, args.process_id, [a.strip() for a in args.addresses.split(";") if a.strip()])
        else:
            status = run_ingest(settings)
    except BaseException as exc:
        run.fail(inputs, outputs, exc)
        raise
    if status == 0:
        run.complete(inputs, outputs)
    else:
        run.fail(inputs, outputs, f"the ingest job exited with status {status}")
    return status
