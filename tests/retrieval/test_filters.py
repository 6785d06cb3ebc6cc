"""Metadata filters: their shape, and JSON-value equality."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from retrieval.filters import FilterError, MetadataFilter, parse_metadata


def test_values_compare_as_json_values() -> None:
    f = MetadataFilter.parse({"year": 2026, "team": ["eng", "ops"], "draft": False})
    assert f is not None
    assert f.matches(json.dumps({"year": 2026.0, "team": "ops", "draft": False, "extra": 1}))
    assert not f.matches(json.dumps({"year": "2026", "team": "ops", "draft": False}))  # a string is not a number
    assert not f.matches(json.dumps({"year": 2026, "team": "ops", "draft": 0}))  # 0 is not false
    assert not f.matches(json.dumps({"year": 2026, "team": "ops"}))  # a missing key matches nothing
    assert not f.matches(None) and not f.matches("not json") and not f.matches("[1]")
    nulls = MetadataFilter.parse({"owner": None})
    assert nulls is not None and nulls.matches('{"owner": null}') and not nulls.matches("{}")
    column = pa.array([None, '{"year": 2026, "team": "eng", "draft": false}', '{"year": 1}'] * 2)
    assert f.mask(column, 6).tolist() == [False, True, False] * 2
    assert f.mask(None, 2).tolist() == [False, False]  # an index built before metadata existed


def test_filters_have_a_stable_key_and_empty_means_none() -> None:
    a, b = MetadataFilter.parse({"b": [2, 1], "a": "x"}), MetadataFilter.parse({"a": ["x"], "b": [1, 2]})
    assert a is not None and b is not None and a.key == b.key
    assert MetadataFilter.parse(None) is None and MetadataFilter.parse({}) is None
    assert parse_metadata('{"a": 1}') == {"a": 1} and parse_metadata(None) == {} and parse_metadata("[") == {}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("team", "filter must be an object"),
        ({"team": []}, "between 1 and 100 values"),
        ({"team": {"nested": 1}}, "strings, numbers, booleans or null"),
        ({"team": [["x"]]}, "strings, numbers, booleans or null"),
        ({"": 1}, "non-empty strings"),
        ({f"k{i}": 1 for i in range(17)}, "at most 16"),
    ],
)
def test_bad_filters_say_what_is_wrong(raw: object, message: str) -> None:
    with pytest.raises(FilterError, match=message):
        MetadataFilter.parse(raw)
