"""Debezium change events as a Postgres connector writes them: one builder for every producer.

``streamrag produce`` files, the demo, the tests and the benchmarks all make their CDC
events here, so what they send is what Debezium sends (and what :mod:`pipelines.debezium`
decodes)::

    value = envelope("u", after={"id": 7, "title": "T", "body": "…", "acl": []}, lsn=1234)
    key, value = message({"id": 7}, value)   # bytes, as a Kafka producer sends them
    line = produce_line({"id": 7}, value)    # one line of a `streamrag produce` file
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

Op = Literal["c", "u", "d", "r"]


def envelope(
    op: Op,
    after: dict[str, Any] | None = None,
    before: dict[str, Any] | None = None,
    *,
    lsn: int,
    table: str = "docs",
    schema: str = "public",
    db: str = "app",
    ts_ms: int | None = None,
    wrapped: bool = False,
) -> dict[str, Any]:
    """A Debezium Postgres change event (``wrapped``: inside Kafka Connect's schema/payload)."""
    ts = int(time.time() * 1000) if ts_ms is None else ts_ms
    source = {"connector": "postgresql", "db": db, "schema": schema, "table": table, "lsn": lsn, "ts_ms": ts}
    value = {"before": before, "after": after, "source": source, "op": op, "ts_ms": ts}
    return {"schema": {"type": "struct", "name": "envelope"}, "payload": value} if wrapped else value


def message(key: dict[str, Any], value: dict[str, Any] | None) -> tuple[bytes, bytes | None]:
    """(key, value) bytes as a Kafka producer sends them; a None value is a tombstone."""
    return json.dumps(key).encode(), None if value is None else json.dumps(value).encode()


def produce_line(key: dict[str, Any] | None, value: dict[str, Any] | None) -> str:
    """One line of a ``streamrag produce`` file (a bare envelope when there is no key)."""
    if key is None:
        return json.dumps(value)
    return json.dumps({"key": key, "value": value})
