"""Postgres's logical replication protocol (``pgoutput``, version 1) and column values as JSON.

Pure functions over bytes, used by :mod:`pipelines.pgsource`:

- :func:`parse` decodes one message of the stream a replication slot sends (begin, commit,
  relation, insert, update, delete, truncate; type and origin messages are parsed and
  ignored), as the protocol documents it ("Logical Replication Message Formats");
- :func:`to_json` turns a column's text form (what pgoutput sends, and what ``col::text``
  returns in the snapshot: one conversion for both) into the JSON value Debezium's JSON
  converter would emit, or raises :class:`Unsupported` saying why it cannot. Numbers,
  booleans, strings, enums, domains and one-dimensional arrays of those convert; ``numeric``
  stays a string (Debezium's ``decimal.handling.mode=string``: no precision lost); temporal
  types stay in Postgres's ISO text form (Debezium's ``ZonedTimestamp`` style); ``bytea`` is
  base64 (as Debezium's bytes). Composite, range, geometric and search types have no
  faithful JSON form here and are reported, never guessed.
"""

from __future__ import annotations

import base64
import math
import struct
from dataclasses import dataclass
from typing import Any

#: microseconds between the Unix epoch and Postgres's (2000-01-01)
PG_EPOCH_US = 946_684_800_000_000


class ProtocolError(ValueError):
    """A message that does not follow the pgoutput protocol."""


class Unsupported(ValueError):
    """A value the source cannot represent as JSON faithfully."""


@dataclass(frozen=True)
class Column:
    name: str
    type_oid: int
    key: bool  # part of the replica identity


@dataclass(frozen=True)
class Relation:
    oid: int
    schema: str
    table: str
    replica_identity: str  # d (default: primary key), n (nothing), f (full), i (index)
    columns: tuple[Column, ...]


#: one column of a tuple: None (SQL NULL), UNCHANGED (a TOASTed value the update did not
#: change: pgoutput leaves it out), or the value's text form
UNCHANGED = object()
Tuple = tuple[Any, ...]


@dataclass(frozen=True)
class Begin:
    final_lsn: int
    commit_ts_ms: int
    xid: int


@dataclass(frozen=True)
class Commit:
    lsn: int
    end_lsn: int
    commit_ts_ms: int


@dataclass(frozen=True)
class Insert:
    relation: int
    new: Tuple


@dataclass(frozen=True)
class Update:
    relation: int
    old: Tuple | None  # the old row (REPLICA IDENTITY FULL) or its key columns; None if neither was sent
    new: Tuple
    old_is_key: bool = False


@dataclass(frozen=True)
class Delete:
    relation: int
    old: Tuple
    old_is_key: bool = False


@dataclass(frozen=True)
class Truncate:
    relations: tuple[int, ...]
    cascade: bool
    restart_identity: bool


@dataclass(frozen=True)
class Ignored:
    kind: str


Message = Begin | Commit | Relation | Insert | Update | Delete | Truncate | Ignored


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.data):
            raise ProtocolError(f"message ends at byte {len(self.data)}, {n} more bytes expected at {self.at}.")
        out = self.data[self.at : self.at + n]
        self.at += n
        return out

    def int8(self) -> int:
        return int(self.take(1)[0])

    def int16(self) -> int:
        return int(struct.unpack(">h", self.take(2))[0])

    def int32(self) -> int:
        return int(struct.unpack(">i", self.take(4))[0])

    def uint32(self) -> int:
        return int(struct.unpack(">I", self.take(4))[0])

    def int64(self) -> int:
        return int(struct.unpack(">q", self.take(8))[0])

    def string(self) -> str:
        end = self.data.find(b"\0", self.at)
        if end < 0:
            raise ProtocolError("a string is not terminated.")
        out = self.data[self.at : end].decode("utf-8")
        self.at = end + 1
        return out

    def tuple(self) -> Tuple:
        values: list[Any] = []
        for _ in range(self.int16()):
            kind = self.take(1)
            if kind == b"n":
                values.append(None)
            elif kind == b"u":
                values.append(UNCHANGED)
            elif kind == b"t":
                values.append(self.take(self.int32()).decode("utf-8"))
            elif kind == b"b":  # only with the binary option, which the source does not ask for
                raise ProtocolError("a binary column value: the source asks for text values only.")
            else:
                raise ProtocolError(f"unknown tuple column kind {kind!r}.")
        return tuple(values)


def _ts_ms(pg_us: int) -> int:
    return (pg_us + PG_EPOCH_US) // 1000


def parse(data: bytes) -> Message:
    """One pgoutput message (the payload of an XLogData message)."""
    if not data:
        raise ProtocolError("an empty message.")
    r = _Reader(data)
    kind = r.take(1)
    if kind == b"B":
        return Begin(r.int64(), _ts_ms(r.int64()), r.uint32())
    if kind == b"C":
        r.int8()  # flags: unused
        return Commit(r.int64(), r.int64(), _ts_ms(r.int64()))
    if kind == b"R":
        oid, schema, table = r.uint32(), r.string(), r.string()
        identity = chr(r.int8())
        columns = []
        for _ in range(r.int16()):
            flags, name, type_oid = r.int8(), r.string(), r.uint32()
            r.int32()  # type modifier
            columns.append(Column(name, type_oid, bool(flags & 1)))
        return Relation(oid, schema, table, identity, tuple(columns))
    if kind == b"I":
        oid = r.uint32()
        if r.take(1) != b"N":
            raise ProtocolError("an insert without its new tuple.")
        return Insert(oid, r.tuple())
    if kind == b"U":
        oid = r.uint32()
        marker = r.take(1)
        old, old_is_key = None, False
        if marker in (b"K", b"O"):
            old, old_is_key = r.tuple(), marker == b"K"
            marker = r.take(1)
        if marker != b"N":
            raise ProtocolError("an update without its new tuple.")
        return Update(oid, old, r.tuple(), old_is_key)
    if kind == b"D":
        oid = r.uint32()
        marker = r.take(1)
        if marker not in (b"K", b"O"):
            raise ProtocolError("a delete without its old tuple or key.")
        return Delete(oid, r.tuple(), marker == b"K")
    if kind == b"T":
        count, options = r.int32(), r.int8()
        return Truncate(tuple(r.uint32() for _ in range(count)), bool(options & 1), bool(options & 2))
    if kind in (b"Y", b"O", b"M"):
        return Ignored(kind.decode())
    raise ProtocolError(f"unknown message kind {kind!r}.")


# -- values ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PgType:
    """What the catalog says about a type (``pg_type``)."""

    oid: int
    name: str
    category: str  # typcategory: B boolean, N numeric, S string, D date/time, A array, U user, E enum, …
    kind: str  # typtype: b base, d domain, e enum, c composite, r range, m multirange, p pseudo
    element: int = 0  # an array's element type
    base: int = 0  # a domain's base type


#: the built-in types by OID (stable across Postgres versions); others come from the catalog
BUILTIN = {
    t.oid: t
    for t in (
        PgType(16, "bool", "B", "b"),
        PgType(17, "bytea", "U", "b"),
        PgType(18, "char", "S", "b"),
        PgType(19, "name", "S", "b"),
        PgType(20, "int8", "N", "b"),
        PgType(21, "int2", "N", "b"),
        PgType(23, "int4", "N", "b"),
        PgType(25, "text", "S", "b"),
        PgType(26, "oid", "N", "b"),
        PgType(114, "json", "U", "b"),
        PgType(700, "float4", "N", "b"),
        PgType(701, "float8", "N", "b"),
        PgType(1042, "bpchar", "S", "b"),
        PgType(1043, "varchar", "S", "b"),
        PgType(1082, "date", "D", "b"),
        PgType(1083, "time", "D", "b"),
        PgType(1114, "timestamp", "D", "b"),
        PgType(1184, "timestamptz", "D", "b"),
        PgType(1186, "interval", "T", "b"),
        PgType(1266, "timetz", "D", "b"),
        PgType(1700, "numeric", "N", "b"),
        PgType(2950, "uuid", "U", "b"),
        PgType(3802, "jsonb", "U", "b"),
        PgType(142, "xml", "U", "b"),
        PgType(869, "inet", "I", "b"),
        PgType(650, "cidr", "I", "b"),
        PgType(829, "macaddr", "U", "b"),
        PgType(790, "money", "N", "b"),
        PgType(1000, "_bool", "A", "b", 16),
        PgType(1005, "_int2", "A", "b", 21),
        PgType(1007, "_int4", "A", "b", 23),
        PgType(1016, "_int8", "A", "b", 20),
        PgType(1009, "_text", "A", "b", 25),
        PgType(1014, "_bpchar", "A", "b", 1042),
        PgType(1015, "_varchar", "A", "b", 1043),
        PgType(1021, "_float4", "A", "b", 700),
        PgType(1022, "_float8", "A", "b", 701),
        PgType(1231, "_numeric", "A", "b", 1700),
        PgType(2951, "_uuid", "A", "b", 2950),
    )
}

_INTEGERS = {"int2", "int4", "int8", "oid"}
_FLOATS = {"float4", "float8"}
#: kept as Postgres prints them (strings in Debezium's JSON too)
_AS_TEXT = {"numeric", "money", "json", "jsonb", "uuid", "xml", "inet", "cidr", "macaddr", "interval"}


def to_json(text: str, pg_type: PgType, types: dict[int, PgType]) -> Any:
    """A column's text form as a JSON value (module docstring); ``types``: element and base types."""
    if pg_type.kind == "d":
        return to_json(text, _type(pg_type.base, types), types)
    if pg_type.kind == "e":
        return text
    name = pg_type.name
    if name == "bool":
        return text == "t"
    if name in _INTEGERS:
        return int(text)
    if name in _FLOATS:
        value = float(text)
        if not math.isfinite(value):
            raise Unsupported(f"{text} ({name}) has no JSON form.")
        return value
    if name == "bytea":
        if not text.startswith("\\x"):
            raise Unsupported("bytea not in hex output format (bytea_output = 'hex' is the default).")
        return base64.b64encode(bytes.fromhex(text[2:])).decode()
    if pg_type.category == "A" and pg_type.element:
        element = _type(pg_type.element, types)
        return [None if v is None else to_json(v, element, types) for v in parse_array(text)]
    if pg_type.category in ("S", "D") or name in _AS_TEXT:
        return text
    raise Unsupported(f"type {name} ({_KINDS.get(pg_type.kind, pg_type.kind)}) has no JSON form in this source.")


_KINDS = {"b": "base", "c": "composite", "r": "range", "m": "multirange", "p": "pseudo"}


def _type(oid: int, types: dict[int, PgType]) -> PgType:
    found = types.get(oid) or BUILTIN.get(oid)
    if found is None:
        raise Unsupported(f"type oid {oid} is unknown to the catalog.")
    return found


def parse_array(text: str) -> list[str | None]:
    """A one-dimensional array literal (``{a,"b c",NULL}``) → its elements' text forms."""
    if not text.startswith("{") or not text.endswith("}"):
        raise Unsupported(f"array literal {text[:40]!r} has explicit bounds or is not an array.")
    body = text[1:-1]
    out: list[str | None] = []
    if not body:
        return out
    i, n = 0, len(body)
    while i <= n:
        if i < n and body[i] == "{":
            raise Unsupported("multi-dimensional arrays have no JSON form in this source.")
        if i < n and body[i] == '"':
            i += 1
            chars = []
            while i < n and body[i] != '"':
                if body[i] == "\\":
                    i += 1
                chars.append(body[i])
                i += 1
            i += 1  # the closing quote
            out.append("".join(chars))
        else:
            end = body.find(",", i)
            end = n if end < 0 else end
            raw = body[i:end]
            out.append(None if raw == "NULL" else raw)
            i = end
        if i < n and body[i] != ",":
            raise Unsupported(f"array literal {text[:40]!r} is malformed.")
        i += 1
    return out
