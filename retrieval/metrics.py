"""Prometheus metrics of the retrieval service (one registry per process)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUEST_SECONDS = Histogram(
    "streamrag_http_request_seconds",
    "HTTP request latency, by route and status class",
    ["route", "status"],
    buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30),
)
SEARCH_SECONDS = Histogram(
    "streamrag_search_seconds",
    "Engine search latency, by stage",
    ["stage"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
)
SEARCH_THREADS = Counter(
    "streamrag_search_requests_by_thread_total",
    "/v1/search requests by where they ran: the event loop (all in memory), a worker after the loop found "
    "something to wait for, or a worker at once (as_of, --search-on-workers)",
    ["thread"],
)  # loop | worker after loop | worker
NPROBE_WIDENED = Counter(
    "streamrag_search_nprobe_widened_total", "Searches that probed more lists to find k visible results"
)
CACHE_REQUESTS = Counter(
    "streamrag_shard_cache_requests_total", "Shard loads, by where the shard came from", ["result"]
)  # memory | disk | fetch
CACHE_FETCHED_BYTES = Counter("streamrag_shard_cache_fetched_bytes_total", "Bytes fetched from the index store")
CACHE_MEMORY_BYTES = Gauge("streamrag_shard_cache_memory_bytes", "Bytes of shards held in memory")
CACHE_DISK_BYTES = Gauge("streamrag_shard_cache_disk_bytes", "Bytes of shard files in the disk cache")
CACHE_EVICTIONS = Counter(
    "streamrag_shard_cache_evictions_total", "Shards (memory, disk) and compressed lists (list) evicted", ["tier"]
)
RANGE_READS = Counter(
    "streamrag_index_range_reads_total",
    "Byte ranges of compressed shards (lists, re-rank vectors) read, by where they came from",
    ["tier"],
)  # disk | store
RANGE_REQUESTS = Counter(
    "streamrag_index_range_requests_total", "Ranged GETs sent to the index store (near ranges share one)"
)
TAIL_ROWS = Gauge("streamrag_tail_rows", "Chunk versions in the fresh tail (newer than the index)")
TAIL_LAG = Gauge(
    "streamrag_tail_lag_seconds", "Staleness of the tail: time since a poll last found it up to date with the lake"
)
TAIL_POLL_ERRORS = Counter("streamrag_tail_poll_errors_total", "Failed polls of the lake")
TAIL_STAGE_SECONDS = Histogram(
    "streamrag_tail_stage_seconds",
    "Work per tail update, by stage: read (the new commits from the lake, appended to the tail), "
    "follow (the keyword copy brought up to it), notice_to_visible (the oldest commit notice not yet "
    "applied received → every version named so far searchable)",
    ["stage"],
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
)
INDEX_VERSION = Gauge("streamrag_index_version", "Index version being served")
LAKE_VERSION = Gauge("streamrag_lake_version", "Newest lake version the service has read")
INDEX_SWAPS = Counter("streamrag_index_swaps_total", "Switches to a newly published index version")
ANSWER_SECONDS = Histogram(
    "streamrag_answer_seconds",
    "Answer latency, by stage (retrieve, extract, first_token, total)",
    ["stage"],
    buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60),
)
ANSWERS = Counter("streamrag_answers_total", "Answers, by outcome", ["status"])  # answered | no_answer | failed
FLAGGED_SENTENCES = Counter("streamrag_answer_flagged_sentences_total", "Answer sentences no source supports")
AUDIT_QUEUE = Gauge("streamrag_audit_queue", "Answer records waiting to be written to the audit table")
AUDIT_WRITTEN = Counter("streamrag_audit_written_total", "Answer records written to the audit table")
AUDIT_FAILURES = Counter("streamrag_audit_write_failures_total", "Failed writes to the audit table (retried)")
AUDIT_DROPPED = Counter(
    "streamrag_audit_dropped_total", "Answer records dropped because the audit queue was full (logged in full)"
)
AUDIT_QUARANTINED = Counter(
    "streamrag_audit_quarantined_total",
    "Answer records that could never be written to the audit table, set aside in the audit dead-letter file",
)
RATE_LIMITED = Counter("streamrag_http_rate_limited_total", "Requests refused with 429 (per-principal rate limit)")
