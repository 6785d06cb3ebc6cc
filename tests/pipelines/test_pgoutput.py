"""The pgoutput decoder and the text → JSON value conversion (pure; no database)."""

from __future__ import annotations

import struct

import pytest

from pipelines.debezium import SOURCE_ERROR_HEADER, decode
from pipelines.mapping import MappingConfig
from pipelines.pgoutput import (
    BUILTIN,
    PG_EPOCH_US,
    UNCHANGED,
    Begin,
    Commit,
    Delete,
    Insert,
    PgType,
    ProtocolError,
    Relation,
    Truncate,
    Unsupported,
    Update,
    parse,
    parse_array,
    to_json,
)
from pipelines.records import DeadLetter, KafkaCoordinates


def cstr(text: str) -> bytes:
    return text.encode() + b"\0"


def tuple_data(*values: object) -> bytes:
    out = struct.pack(">h", len(values))
    for v in values:
        if v is None:
            out += b"n"
        elif v is UNCHANGED:
            out += b"u"
        else:
            raw = str(v).encode()
            out += b"t" + struct.pack(">i", len(raw)) + raw
    return out


def test_begin_commit_and_relation_messages() -> None:
    ts_us = 1_700_000_000_000_000 - PG_EPOCH_US
    begin = parse(b"B" + struct.pack(">qqI", 0x1_0000_0010, ts_us, 4242))
    assert begin == Begin(0x1_0000_0010, 1_700_000_000_000, 4242)
    assert parse(b"C" + struct.pack(">bqqq", 0, 10, 20, ts_us)) == Commit(10, 20, 1_700_000_000_000)
    relation = (
        b"R" + struct.pack(">I", 16384) + cstr("public") + cstr("docs") + b"f" + struct.pack(">h", 2)
        + b"\x01" + cstr("id") + struct.pack(">Ii", 23, -1)
        + b"\x00" + cstr("body") + struct.pack(">Ii", 25, -1)
    )  # fmt: skip
    rel = parse(relation)
    assert isinstance(rel, Relation) and (rel.schema, rel.table, rel.replica_identity) == ("public", "docs", "f")
    assert [(c.name, c.type_oid, c.key) for c in rel.columns] == [("id", 23, True), ("body", 25, False)]


def test_row_messages_keep_nulls_unchanged_toast_and_old_rows() -> None:
    rel = struct.pack(">I", 7)
    assert parse(b"I" + rel + b"N" + tuple_data(1, None, "ü")) == Insert(7, ("1", None, "ü"))
    update = parse(b"U" + rel + b"O" + tuple_data(1, "old") + b"N" + tuple_data(1, UNCHANGED))
    assert update == Update(7, ("1", "old"), ("1", UNCHANGED), False)
    assert parse(b"U" + rel + b"N" + tuple_data(2, "x")) == Update(7, None, ("2", "x"))
    assert parse(b"D" + rel + b"K" + tuple_data(3, None)) == Delete(7, ("3", None), True)
    assert parse(b"T" + struct.pack(">ib", 2, 1) + struct.pack(">II", 7, 8)) == Truncate((7, 8), True, False)


@pytest.mark.parametrize(
    "data",
    [b"", b"Z", b"I" + struct.pack(">I", 7) + b"X", b"B\x00\x01", b"D" + struct.pack(">I", 7) + b"N",
     b"R" + struct.pack(">I", 1) + b"public"],
)  # fmt: skip
def test_malformed_messages_raise_a_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse(data)


def test_values_convert_as_debeziums_json_converter_would() -> None:
    t = BUILTIN
    assert to_json("t", t[16], {}) is True and to_json("f", t[16], {}) is False
    assert to_json("-42", t[23], {}) == -42 and to_json("9007199254740993", t[20], {}) == 9007199254740993
    assert to_json("2.5", t[701], {}) == 2.5
    exact = "12345678901234567890.000000001"
    assert to_json(exact, t[1700], {}) == exact  # no precision lost
    assert to_json('{"a": 1}', t[3802], {}) == '{"a": 1}'
    assert to_json("2026-12-05 10:00:00+00", t[1184], {}) == "2026-12-05 10:00:00+00"
    assert to_json("\\x68690a", t[17], {}) == "aGkK"  # base64, as Debezium's bytes
    assert to_json('{hr,"b c",NULL,"q\\"uote"}', t[1009], {}) == ["hr", "b c", None, 'q"uote']
    assert to_json("{1,2}", t[1007], {}) == [1, 2]
    assert to_json("{}", t[1009], {}) == []
    mood = PgType(90001, "mood", "E", "e")
    assert to_json("happy", mood, {}) == "happy"
    short = PgType(90002, "short_text", "S", "d", base=25)
    assert to_json("x", short, {}) == "x"


@pytest.mark.parametrize(
    ("text", "pg_type", "why"),
    [
        ("NaN", BUILTIN[701], "no JSON form"),
        ("Infinity", BUILTIN[700], "no JSON form"),
        ("(1,2)", PgType(600, "point", "G", "b"), "point"),
        ("[1,5)", PgType(3904, "int4range", "R", "r"), "range"),
        ("(1,x)", PgType(90003, "pair", "C", "c"), "composite"),
        ("{{1,2},{3,4}}", BUILTIN[1007], "multi-dimensional"),
        ("[0:1]={1,2}", BUILTIN[1007], "explicit bounds"),
        ("x", PgType(90004, "dom", "S", "d", base=424242), "unknown"),
    ],
)
def test_values_without_a_faithful_json_form_are_reported(text: str, pg_type: PgType, why: str) -> None:
    with pytest.raises(Unsupported, match=why):
        to_json(text, pg_type, {})


def test_array_literals() -> None:
    assert parse_array("{a,b}") == ["a", "b"]
    assert parse_array('{"",NULL,"NULL"}') == ["", None, "NULL"]
    assert parse_array('{"a,b","c\\\\d"}') == ["a,b", "c\\d"]


def test_a_change_the_source_could_not_represent_is_a_dead_letter_with_its_reason() -> None:
    coords = KafkaCoordinates("cdc.db.public.docs", 0, 5)
    value = b'{"op": "c", "after": {"id": "1", "p": "(1,2)"}}'
    letter = decode(None, value, coords, MappingConfig(), ((SOURCE_ERROR_HEADER, b"column 'p': type point"),))
    assert isinstance(letter, DeadLetter) and "column 'p': type point" in letter.error and letter.value == value
