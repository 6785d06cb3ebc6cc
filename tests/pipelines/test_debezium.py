from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.debezium import decode, source_position
from pipelines.envelopes import Op
from pipelines.envelopes import envelope as debezium_envelope
from pipelines.mapping import MappingConfig
from pipelines.records import ChangeEvent, DeadLetter, KafkaCoordinates

K = KafkaCoordinates("cdc.app.public.docs", 0, 42)
M = MappingConfig()


def envelope(op: Op = "c", after: dict | None = None, before: dict | None = None, table: str = "docs") -> dict:
    return debezium_envelope(op, after, before, lsn=1234, ts_ms=1000, table=table)


def enc(obj: object) -> bytes:
    return json.dumps(obj).encode()


def test_bare_envelope_create() -> None:
    ev = decode(enc({"id": 7}), enc(envelope("c", {"id": 7, "title": "T", "body": "B", "acl": "b, a"})), K, M)
    assert isinstance(ev, ChangeEvent)
    assert (ev.source_table, ev.source_pk, ev.op, ev.doc_id) == ("public.docs", "7", "upsert", "public.docs/7")
    assert (ev.title, ev.text, ev.acl) == ("T", "B", ("a", "b"))
    assert ev.position == "pg:00000000000000001234" and ev.event_time_ms == 1000


def test_schema_payload_wrapper_and_snapshot_read() -> None:
    value = debezium_envelope("r", {"id": 1, "body": "x", "acl": ["g"]}, lsn=1, wrapped=True)
    key = {"schema": {"type": "struct"}, "payload": {"id": 1}}
    ev = decode(enc(key), enc(value), K, M)
    assert isinstance(ev, ChangeEvent) and ev.op == "upsert" and ev.acl == ("g",)


def test_delete_takes_key_from_before_when_no_key() -> None:
    ev = decode(None, enc(envelope("d", None, {"id": 3})), K, M)
    assert isinstance(ev, ChangeEvent) and ev.op == "delete" and ev.source_pk == "3"


def test_tombstone_is_a_delete_marker_not_an_error() -> None:
    ev = decode(enc({"id": 3}), None, K, M)
    assert isinstance(ev, ChangeEvent) and ev.tombstone and ev.position is None
    assert ev.doc_id == "public.docs/3"  # table from the topic's last two segments


def test_composite_keys_are_json() -> None:
    ev = decode(enc({"b": 2, "a": 1}), enc(envelope("c", {"a": 1, "b": 2, "body": "x", "acl": []})), K, M)
    assert isinstance(ev, ChangeEvent) and ev.source_pk == '{"a":1,"b":2}'


def test_per_table_mapping() -> None:
    mapping = MappingConfig.from_dict(
        {
            "tables": {
                "public.tickets": {
                    "id": ["ticket_id"],
                    "title": "subject",
                    "text": ["description", "notes"],
                    "acl": None,
                    "metadata": ["priority"],
                }
            }
        }
    )
    row = {"ticket_id": "T-1", "subject": "Broken", "description": "It broke.", "notes": "Fixed.", "priority": 2}
    ev = decode(None, enc(envelope("u", row, table="tickets")), K, mapping)
    assert isinstance(ev, ChangeEvent)
    assert (ev.source_pk, ev.title, ev.text, ev.acl) == ("T-1", "Broken", "It broke.\n\nFixed.", ())
    assert ev.metadata == (("priority", "2"),)


def test_positions_per_connector_sort_in_change_order() -> None:
    mysql = [{"file": "mysql-bin.000009", "pos": 900, "row": 0}, {"file": "mysql-bin.000010", "pos": 4, "row": 0}]
    positions = [source_position(s, None, K) for s in mysql]
    assert positions == sorted(positions)
    assert source_position({"scn": "17"}, None, K) < source_position({"scn": "170"}, None, K)
    assert source_position({}, 5, K).startswith("ts:")
    # Postgres with the commit LSN (streamrag's source): commit order first. A transaction that
    # began during the slot's creation commits after its consistent point (1000) with a change
    # at LSN 900: it must sort after the snapshot's row (999), and a second change of the row
    # in one transaction after the first.
    snapshot = source_position({"lsn": 999, "commit_lsn": 999}, None, K)
    early_change = source_position({"lsn": 900, "commit_lsn": 1200}, None, K)
    same_tx_later = source_position({"lsn": 950, "commit_lsn": 1200}, None, K)
    assert snapshot < early_change < same_tx_later
    assert source_position({"lsn": 900}, None, K) == "pg:00000000000000000900"  # Debezium's: change LSN only


def bad(value: bytes | None, key: bytes | None = None) -> DeadLetter:
    out = decode(key, value, K, M)
    assert isinstance(out, DeadLetter), out
    assert out.value == value and out.kafka == K
    return out


def test_malformed_messages_are_dead_letters_with_reasons() -> None:
    assert "not valid JSON" in bad(b"{nope").error
    assert "not valid UTF-8" in bad(b"\xff\xfe").error
    assert "unknown or missing op" in bad(enc({**envelope(), "op": "x"})).error
    assert "truncate" in bad(enc({**envelope(), "op": "t"})).error
    assert "needs an 'after' object" in bad(enc(envelope("c", None))).error
    assert "primary key column 'id'" in bad(enc(envelope("c", {"body": "x"}))).error
    assert "text column 'body' is int" in bad(enc(envelope("c", {"id": 1, "body": 5, "acl": []}))).error
    assert "acl must be" in bad(enc(envelope("c", {"id": 1, "body": "x", "acl": {"x": 1}}))).error
    assert "no text column (body) is in the row" in bad(enc(envelope("c", {"id": 1, "acl": []}))).error
    assert "JSON list" in bad(enc([1, 2])).error
    assert "'source'" in bad(enc({"op": "c", "after": {"id": 1}})).error
    assert "tombstone" in bad(None).error
    bad_ts = {**envelope("c", {"id": 1}), "source": {"table": "t"}, "ts_ms": "x"}
    assert "ts_ms must be an integer" in bad(enc(bad_ts)).error


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=200), st.none()), st.one_of(st.binary(max_size=50), st.none()))
def test_garbage_bytes_never_raise(value: bytes | None, key: bytes | None) -> None:
    out = decode(key, value, K, M)
    assert isinstance(out, (ChangeEvent, DeadLetter))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "op": st.sampled_from(["c", "u", "d", "r", "t", "x"]) | json_values,
            "after": json_values | st.fixed_dictionaries({"id": json_values, "body": json_values, "acl": json_values}),
            "before": json_values,
            "source": json_values | st.fixed_dictionaries({"table": json_values, "lsn": json_values}),
            "ts_ms": json_values,
        },
    ),
    st.one_of(st.none(), json_values),
)
def test_structured_garbage_never_raises(value: dict, key: object) -> None:
    out = decode(None if key is None else enc(key), enc(value), K, M)
    assert isinstance(out, (ChangeEvent, DeadLetter))
    if isinstance(out, DeadLetter):
        assert out.error


def test_nan_and_infinity_are_not_json() -> None:
    for constant in ("NaN", "Infinity", "-Infinity"):
        raw = b'{"before": null, "after": {"id": %s, "body": "b"}, "source": {"lsn": 1}, "op": "c"}' % constant.encode()
        letter = decode(None, raw, K, M)
        assert isinstance(letter, DeadLetter) and "not valid JSON" in letter.error, letter


def test_acls_fail_closed_unless_the_mapping_declares_the_table_public() -> None:
    """A renamed or dropped ACL column must not publish every row (issue 13)."""
    missing, null = {"id": 1, "body": "salaries"}, {"id": 1, "body": "salaries", "acl": None}
    for row in (missing, null):
        letter = decode(None, enc(envelope("c", row)), K, M)
        assert (
            isinstance(letter, DeadLetter) and "acl column 'acl' is" in letter.error and "fail closed" in letter.error
        )
    explicit = decode(None, enc(envelope("c", {**missing, "acl": []})), K, M)
    assert isinstance(explicit, ChangeEvent) and explicit.acl == ()
    for spec in ({"acl": None}, {"public": True}):
        config = MappingConfig.from_dict({"tables": {"docs": spec}})
        for row in (missing, null):
            ev = decode(None, enc(envelope("c", row)), K, config)
            assert isinstance(ev, ChangeEvent) and ev.acl == (), spec
    public = MappingConfig.from_dict({"tables": {"docs": {"public": True}}})
    restricted = decode(None, enc(envelope("c", {**missing, "acl": "hr"})), K, public)
    assert isinstance(restricted, ChangeEvent) and restricted.acl == ("hr",)  # a value given is still honoured
    deleted = decode(None, enc(envelope("d", None, {"id": 1})), K, M)  # deletes need only the key
    assert isinstance(deleted, ChangeEvent) and deleted.op == "delete"
