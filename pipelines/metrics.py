"""Prometheus metrics of the streaming job (one registry per process)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

EVENTS = Counter("streamrag_ingest_events_total", "Kafka messages read, by outcome", ["outcome"])
DEAD_LETTERS = Counter("streamrag_ingest_dead_letters_total", "Messages sent to the dead-letter topic and table")
CHUNKS = Counter("streamrag_ingest_chunks_total", "Chunk versions, by what was done", ["action"])
BATCH_SIZE = Histogram(
    "streamrag_ingest_embed_batch_chunks",
    "Chunks embedded per micro-batch",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
)
COMMITS = Counter("streamrag_ingest_lake_commits_total", "Delta commits, by table", ["table"])
ROWS = Counter("streamrag_ingest_lake_rows_total", "Rows committed, by table", ["table"])
REPLAYED = Counter("streamrag_ingest_replayed_rows_skipped_total", "Replayed rows already in the lake")
LAG = Histogram(
    "streamrag_ingest_event_to_commit_seconds",
    "Source event time to Delta commit",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300, 3600),
)
FETCH_DELAY = Histogram(
    "streamrag_ingest_fetch_delay_seconds",
    "A message's Kafka timestamp (produce time) to the job reading it",
    buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
)
COMMIT_SECONDS = Histogram(
    "streamrag_ingest_commit_seconds",
    "Time committing one micro-batch to a Delta table (retries included), by table",
    ["table"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60),
)
EMBED_SECONDS = Histogram("streamrag_ingest_embed_seconds", "Time embedding one micro-batch")
NOTICES = Counter(
    "streamrag_commit_notices_total", "Commit notices: sent and failed (ingest), received (serve)", ["outcome"]
)
NOTICE_DELAY = Histogram(
    "streamrag_commit_notice_delay_seconds",
    "Lake commit to its notice reaching a serving replica",
    buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
EXPIRED_STATES = Counter(
    "streamrag_ingest_deleted_states_expired_total",
    "Deleted documents whose state was dropped after the retention (--deleted-state-retention-hours)",
)

# The Postgres source (``streamrag cdc postgres``)
CDC_EVENTS = Counter("streamrag_cdc_events_total", "Change events published, by Debezium op (r c u d t)", ["op"])
CDC_UNREPRESENTABLE = Counter(
    "streamrag_cdc_unrepresentable_total", "Changes published as dead letters (streamrag-error header)"
)
CDC_CONFIRMED_LSN = Gauge("streamrag_cdc_confirmed_lsn", "The slot's confirmed flush position (acknowledged by Kafka)")
CDC_COMMIT_TO_ACK = Histogram(
    "streamrag_cdc_commit_to_acknowledged_seconds",
    "A transaction's COMMIT to Kafka acknowledging its last event",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30),
)
