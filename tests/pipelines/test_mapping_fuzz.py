"""Property tests of the table → document mapping (issue 7: fuzz the decoder *and* the mapping).

Any mapping file either loads or is refused with a MappingError naming the key; any row under
any loaded mapping decodes to the document an independent oracle expects, or to a dead letter
whose reason names the column — never an "unexpected" error.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from pipelines.debezium import decode
from pipelines.envelopes import envelope
from pipelines.mapping import MappingConfig, MappingError, TableMapping
from pipelines.records import ChangeEvent, DeadLetter, KafkaCoordinates

K = KafkaCoordinates("cdc.app.public.docs", 0, 7)
COLUMNS = ["id", "tid", "title", "subject", "body", "notes", "acl", "groups", "prio"]

scalars = st.none() | st.booleans() | st.integers(-5, 10**12) | st.floats(allow_nan=False, allow_infinity=False)
json_values = st.recursive(
    scalars | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
column = st.sampled_from(COLUMNS)
# What a user may write for one mapping key: mostly sensible, sometimes wrong in type.
spec_value = (
    column | st.lists(column, max_size=3) | st.none() | st.integers() | st.lists(st.integers(), min_size=1, max_size=2)
)
table_spec = st.dictionaries(
    st.sampled_from(["id", "title", "text", "acl", "metadata"]) | st.sampled_from(["ids", "body"]),
    spec_value,
    max_size=5,
).flatmap(lambda spec: st.just(spec) | st.builds(lambda p: {**spec, "public": p}, st.booleans() | st.just("yes")))
mapping_raw = st.fixed_dictionaries(
    {},
    optional={
        "default": table_spec | st.none(),
        "tables": st.dictionaries(st.sampled_from(["public.docs", "docs", "public.other"]), table_spec | st.none()),
    },
)
cell = (
    st.none()
    | st.text(max_size=30)
    | st.integers(-5, 10**12)
    | st.lists(st.text(max_size=6), max_size=3)
    | st.just("a, b,,c ")
    | json_values
)
good_cell = {
    "id": st.integers(0, 10**6) | st.text(min_size=1, max_size=8),
    "tid": st.text(min_size=1, max_size=8),
    "title": st.text(max_size=20),
    "subject": st.text(max_size=20) | st.none(),
    "body": st.text(max_size=40),
    "notes": st.text(max_size=40) | st.none(),
    "acl": st.lists(st.sampled_from(["hr", "eng", " ", ""]), max_size=3) | st.just("hr, eng"),
    "groups": st.none() | st.just("ops"),
    "prio": json_values,
}
# A plausible row with some columns missing and a few cells replaced by anything at all.
rows = st.builds(
    lambda base, drop, noise: {k: v for k, v in {**base, **noise}.items() if k not in drop},
    st.fixed_dictionaries(good_cell),
    st.sets(column, max_size=3),
    st.dictionaries(column, cell, max_size=2),
)


def load(raw: dict[str, Any]) -> MappingConfig | None:
    try:
        return MappingConfig.from_dict(raw)
    except MappingError as exc:
        assert str(exc)
        return None


def oracle(mapping: TableMapping, row: dict[str, Any]) -> tuple[str, str, tuple[str, ...], tuple] | str:
    """The document a row should become, or the word the dead letter's reason must contain."""
    ids = {}
    for col in mapping.id_columns:
        if row.get(col) is None:
            return "primary key"
        if isinstance(row[col], (dict, list, bool)):
            return "primary key"
        ids[col] = row[col]
    pk = str(next(iter(ids.values()))) if len(ids) == 1 else json.dumps(ids, sort_keys=True, separators=(",", ":"))

    def text_of(col: str | None) -> str | None:
        value = row.get(col) if col else None
        return "" if value is None else value if isinstance(value, str) else None

    if mapping.text_columns and not any(c in row for c in mapping.text_columns):
        return "text column"  # every one missing (not null): a dropped column or the wrong mapping
    title = text_of(mapping.title_column)
    texts = [text_of(c) for c in mapping.text_columns]
    if title is None or any(t is None for t in texts):
        return "column"
    # Fail closed: a table whose mapping names an ACL column needs a value in every row,
    # unless the mapping declares the table public; with no ACL column every row is public.
    acl_value = row.get(mapping.acl_column) if mapping.acl_column else []
    if acl_value is None and not mapping.public:
        return "acl"
    if acl_value is None:
        acl: tuple[str, ...] = ()
    elif isinstance(acl_value, str):
        acl = tuple(sorted({g.strip() for g in acl_value.split(",") if g.strip()}))
    elif isinstance(acl_value, list) and all(isinstance(g, str) for g in acl_value):
        acl = tuple(sorted({g.strip() for g in acl_value if g.strip()}))
    else:
        return "acl"
    metadata = tuple((c, json.dumps(row.get(c), sort_keys=True, default=str)) for c in mapping.metadata_columns)
    return pk, "\n\n".join(t for t in texts if t), acl, (title, metadata)


@settings(max_examples=400, deadline=None)
@given(mapping_raw, rows, st.sampled_from(["c", "u", "r"]))
def test_any_mapping_and_row_give_the_oracles_document_or_an_explained_dead_letter(
    raw: dict[str, Any], row: dict[str, Any], op: str
) -> None:
    config = load(raw)
    if config is None:
        return
    envelope = {"before": None, "after": row, "op": op, "ts_ms": 1, "source": {"schema": "public", "table": "docs"}}
    out = decode(None, json.dumps(envelope).encode(), K, config)
    expected = oracle(config.for_table("public.docs"), row)
    if isinstance(expected, str):
        assert isinstance(out, DeadLetter), (raw, row, out)
        assert expected in out.error and "unexpected" not in out.error, out.error
        event(f"dead letter: {expected}")
        return
    assert isinstance(out, ChangeEvent), (raw, row, out)
    event("document")
    pk, text, acl, (title, metadata) = expected
    assert (out.source_pk, out.text, out.acl, out.title, out.metadata) == (pk, text, acl, title, metadata)


@settings(max_examples=300, deadline=None)
@given(mapping_raw, rows)
def test_deletes_under_any_mapping_need_only_the_key(raw: dict[str, Any], row: dict[str, Any]) -> None:
    config = load(raw)
    if config is None:
        return
    value = envelope("d", None, row, lsn=1, ts_ms=1)
    out = decode(None, json.dumps(value).encode(), K, config)
    expected = oracle(config.for_table("public.docs"), row)
    if expected == "primary key":
        assert isinstance(out, DeadLetter) and "primary key" in out.error and "unexpected" not in out.error
    else:
        assert isinstance(out, ChangeEvent) and out.op == "delete"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"default": {"title": ["a", "b"]}}, "'title' must be one column name or null"),
        ({"default": {"acl": 3}}, "'acl' must be one column name or null"),
        ({"default": {"text": [1]}}, "'text' must be a column name or a list of them"),
        ({"default": {"id": []}}, "'id' needs at least one column"),
        ({"default": {"ids": "x"}}, "unknown mapping keys ['ids']"),
        ({"tables": {"docs": "body"}}, "table 'docs' must map keys"),
        ({"tables": ["docs"]}, "'tables' must be an object"),
        ({"default": "x"}, "'default' must be an object"),
        ({"default": {"public": "yes"}}, "'public' must be true or false"),
    ],
)
def test_bad_mapping_files_are_refused_with_the_key_named(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(MappingError) as err:
        MappingConfig.from_dict(raw)
    assert message in str(err.value)
