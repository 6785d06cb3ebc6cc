"""Debezium change events → :class:`ChangeEvent`, or a :class:`DeadLetter` saying why not.

Errors are data: :func:`decode` never raises on bad input. It accepts the bare envelope
(``before``, ``after``, ``source``, ``op``, ``ts_ms``) and Kafka Connect's
``{"schema": …, "payload": …}`` wrapper; ops ``c`` (create), ``u`` (update), ``d``
(delete) and ``r`` (snapshot read); a null value is a Kafka tombstone (not an error).

Positions order the changes of one document. They are strings that sort
lexicographically in change order, built from what the connector gives:

- Postgres: ``lsn`` → ``pg:<lsn, 20 digits>``; with ``commit_lsn`` (the transaction's commit
  record, which streamrag's Postgres source adds) → ``pg:<commit_lsn>:<lsn>``: a row's
  changes in commit order, which their own LSNs need not follow across a slot's snapshot
- MySQL/MariaDB: ``file``/``pos``/``row`` → ``binlog:<file>:<pos>:<row>``
- SQL Server: ``commit_lsn``/``change_lsn`` → ``mssql:<commit>:<change>``
- Oracle/Db2/others with ``scn`` → ``scn:<scn>``
- otherwise ``ts_ms`` and the Kafka offset → ``ts:<ts_ms>:<offset>``
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pipelines.mapping import MappingConfig, MappingError, key_string
from pipelines.records import ChangeEvent, DeadLetter, KafkaCoordinates

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
#: a header a source sets on a change it could not represent (``pipelines.pgsource``): its value says why
SOURCE_ERROR_HEADER = "streamrag-error"

_OPS = {"c": "upsert", "r": "upsert", "u": "upsert", "d": "delete"}


class DecodeError(ValueError):
    """Why a message is not a change event we can apply."""


def decode(
    key: bytes | None,
    value: bytes | None,
    kafka: KafkaCoordinates,
    mappings: MappingConfig,
    headers: tuple[tuple[str, bytes], ...] = (),
) -> ChangeEvent | DeadLetter:
    """Decode one Kafka message. Never raises: bad input comes back as a DeadLetter."""
    for name, reason in headers:
        if name == SOURCE_ERROR_HEADER:
            why = f"the source could not represent this change: {_text(reason)}"
            return DeadLetter(kafka, key, value, why, headers)
    try:
        return _decode(key, value, kafka, mappings)
    except (DecodeError, MappingError) as exc:
        return DeadLetter(kafka, key, value, str(exc), headers)
    except Exception as exc:  # noqa: BLE001 - errors are data here, whatever raised them
        return DeadLetter(kafka, key, value, f"unexpected {type(exc).__name__}: {exc}", headers)


def _decode(key: bytes | None, value: bytes | None, kafka: KafkaCoordinates, mappings: MappingConfig) -> ChangeEvent:
    key_obj = _parse_key(key)
    if value is None:
        return _tombstone(key_obj, kafka)
    envelope = unwrap(_parse_json(value, "value"))
    if envelope is None:
        return _tombstone(key_obj, kafka)
    if not isinstance(envelope, dict):
        raise DecodeError(f"value is a JSON {type(envelope).__name__}, expected an object.")

    op_code = envelope.get("op")
    if op_code not in _OPS:
        if op_code in ("t", "m"):
            raise DecodeError(f"op {op_code!r} (truncate/message) is not supported; apply it by hand.")
        raise DecodeError(f"unknown or missing op {op_code!r}; expected one of c, r, u, d.")
    source = envelope.get("source")
    if not isinstance(source, dict):
        raise DecodeError("missing or non-object 'source' block.")
    table = source_table(source, kafka.topic)
    mapping = mappings.for_table(table)
    ts_ms = _optional_int(envelope.get("ts_ms"), "ts_ms")
    if ts_ms is None:
        ts_ms = _optional_int(source.get("ts_ms"), "source.ts_ms")
    position = source_position(source, ts_ms, kafka)

    if _OPS[op_code] == "delete":
        before = envelope.get("before")
        if before is not None and not isinstance(before, dict):
            raise DecodeError("'before' of a delete must be an object or null.")
        pk = _primary_key(key_obj, before, mapping.id_columns)
        return ChangeEvent(table, pk, "delete", position, kafka, ts_ms)

    after = envelope.get("after")
    if not isinstance(after, dict):
        raise DecodeError(f"op {op_code!r} needs an 'after' object, got {type(after).__name__}.")
    pk = _primary_key(key_obj, after, mapping.id_columns)
    title, text, acl, metadata = mapping.document(after)
    return ChangeEvent(table, pk, "upsert", position, kafka, ts_ms, title, text, acl, metadata)


def _text(raw: bytes | None) -> str:
    return (raw or b"").decode("utf-8", "replace")[:1000]


def unwrap(obj: Any) -> Any:
    """Strip Kafka Connect's ``{"schema": …, "payload": …}`` wrapper if present."""
    if isinstance(obj, dict) and "payload" in obj and set(obj) <= {"schema", "payload"}:
        return obj["payload"]
    return obj


def _parse_json(raw: bytes, what: str) -> Any:
    if len(raw) > MAX_MESSAGE_BYTES:
        raise DecodeError(f"{what} is {len(raw)} bytes, over the {MAX_MESSAGE_BYTES}-byte limit.")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError(f"{what} is not valid UTF-8 ({exc.reason} at byte {exc.start}).") from exc
    try:
        return json.loads(text, parse_constant=_no_constants)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise DecodeError(f"{what} is not valid JSON: {exc}") from exc


def _no_constants(name: str) -> Any:
    """Python's json accepts NaN and Infinity; JSON (and Debezium) has neither."""
    raise DecodeError(f"{name} is not valid JSON.")


def _parse_key(key: bytes | None) -> dict[str, Any] | None:
    """The message key as column → value, or None when absent (the row's key is used)."""
    if key is None or key == b"":
        return None
    obj = unwrap(_parse_json(key, "key"))
    if obj is None:
        return None
    if not isinstance(obj, dict) or not obj:
        raise DecodeError(f"key must be a non-empty JSON object of key columns, got {obj!r:.80}.")
    return obj


def _primary_key(key_obj: Mapping[str, Any] | None, row: Mapping[str, Any] | None, id_columns: tuple[str, ...]) -> str:
    if key_obj is not None:
        return key_string(key_obj)
    if row is None:
        raise DecodeError("no message key and no row to take the primary key from.")
    values = {}
    for col in id_columns:
        if row.get(col) is None:
            raise DecodeError(f"primary key column {col!r} is missing or null in the row.")
        values[col] = row[col]
    return key_string(values)


def _tombstone(key_obj: Mapping[str, Any] | None, kafka: KafkaCoordinates) -> ChangeEvent:
    if key_obj is None:
        raise DecodeError("tombstone (null value) without a key.")
    table = topic_table(kafka.topic)
    return ChangeEvent(table, key_string(key_obj), "delete", None, kafka, None, tombstone=True)


def source_table(source: Mapping[str, Any], topic: str) -> str:
    """``schema.table`` (Postgres, SQL Server) or ``db.table`` (MySQL); else from the topic."""
    table = source.get("table") or source.get("collection")
    if not table:
        return topic_table(topic)
    if not isinstance(table, str):
        raise DecodeError("'source.table' must be a string.")
    scope = source.get("schema") or source.get("db")
    return f"{scope}.{table}" if isinstance(scope, str) and scope else table


def topic_table(topic: str) -> str:
    """``cdc.db.schema.table`` → ``schema.table`` (the last two segments)."""
    parts = topic.split(".")
    return ".".join(parts[-2:]) if len(parts) >= 2 else topic


def _optional_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and value.isdigit():
            return int(value)
        raise DecodeError(f"{name} must be an integer, got {value!r:.40}.")
    if value < 0:
        raise DecodeError(f"{name} must not be negative, got {value}.")
    return value


def source_position(source: Mapping[str, Any], ts_ms: int | None, kafka: KafkaCoordinates) -> str:
    """A string that sorts in change order for changes of one row (module docstring)."""
    lsn = _optional_int(source.get("lsn"), "source.lsn") if "lsn" in source else None
    if lsn is not None:
        commit = _optional_int(source.get("commit_lsn"), "source.commit_lsn") if "commit_lsn" in source else None
        return f"pg:{lsn:020d}" if commit is None else f"pg:{commit:020d}:{lsn:020d}"
    if source.get("file") and source.get("pos") is not None:
        pos = _optional_int(source.get("pos"), "source.pos") or 0
        row = _optional_int(source.get("row"), "source.row") or 0
        return f"binlog:{source['file']}:{pos:020d}:{row:010d}"
    if source.get("commit_lsn") or source.get("change_lsn"):
        return f"mssql:{source.get('commit_lsn') or ''}:{source.get('change_lsn') or ''}"
    if source.get("scn") is not None:
        scn = _optional_int(source.get("scn"), "source.scn") or 0
        return f"scn:{scn:030d}"
    if ts_ms is None:
        raise DecodeError("no source position: 'source' has no lsn, binlog file/pos, scn or ts_ms.")
    return f"ts:{ts_ms:020d}:{kafka.offset:020d}"
