"""Metadata filters: which chunks a query may return, by their document's metadata columns.

A table's mapping may name metadata columns (``metadata: [team, year]``); the ingest job
stores them with every chunk version as one JSON object. A search or answer request may
then ask for ``"filter": {"team": "eng", "year": [2025, 2026]}``: every key must match,
a list means any of its values, and a chunk without the key does not match. Like ACLs,
filters are applied *inside* the shard scan (and the tail's), so a filter never costs
recall: the probe widens until k matches are found or every list has been searched.

Values compare as JSON values: ``3`` matches ``3.0`` but not ``"3"`` or ``true``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

MAX_KEYS = 16
MAX_VALUES = 100

Scalar = str | int | float | bool | None


class FilterError(ValueError):
    """The filter is not of the accepted shape; the message says which key and why."""


def _canonical(value: Any) -> tuple[Any, ...]:
    """A hashable form in which JSON-equal values are equal (and True is not 1)."""
    if value is None:
        return ("null",)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, (int, float)):
        return ("number", float(value))
    if isinstance(value, str):
        return ("string", value)
    return ("json", json.dumps(value, sort_keys=True))  # lists and objects: whole-value equality


@dataclass(frozen=True)
class MetadataFilter:
    #: (key, accepted values in canonical form), sorted by key
    conditions: tuple[tuple[str, frozenset[tuple[Any, ...]]], ...]

    @classmethod
    def parse(cls, raw: Any) -> MetadataFilter | None:
        """``{"key": value | [values]}`` → a filter; None or {} → no filter."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise FilterError("filter must be an object of metadata key → value or list of values.")
        if len(raw) > MAX_KEYS:
            raise FilterError(f"filter has {len(raw)} keys; at most {MAX_KEYS}.")
        conditions = []
        for key, wanted in sorted(raw.items()):
            if not isinstance(key, str) or not key:
                raise FilterError("filter keys must be non-empty strings (metadata column names).")
            values = wanted if isinstance(wanted, list) else [wanted]
            if not values or len(values) > MAX_VALUES:
                raise FilterError(f"filter[{key!r}] must list between 1 and {MAX_VALUES} values.")
            if not all(v is None or isinstance(v, (str, int, float, bool)) for v in values):
                raise FilterError(f"filter[{key!r}] values must be strings, numbers, booleans or null.")
            conditions.append((key, frozenset(_canonical(v) for v in values)))
        return cls(tuple(conditions)) if conditions else None

    @property
    def key(self) -> str:
        """A stable identity, to memoise masks by."""
        return json.dumps([[k, sorted(map(list, v))] for k, v in self.conditions])

    def matches(self, metadata: str | None) -> bool:
        if not metadata:
            return False
        try:
            found = json.loads(metadata)
        except ValueError:
            return False
        if not isinstance(found, dict):
            return False
        return all(k in found and _canonical(found[k]) in accepted for k, accepted in self.conditions)

    def mask(self, column: pa.Array | pa.ChunkedArray | None, rows: int) -> np.ndarray:
        """Which rows of a ``metadata`` column match (a table without the column matches nothing)."""
        if column is None:
            return np.zeros(rows, dtype=bool)
        memo: dict[str | None, bool] = {}  # documents repeat their metadata on every chunk
        out = np.empty(len(column), dtype=bool)
        for i, value in enumerate(column.to_pylist()):
            hit = memo.get(value)
            if hit is None:
                hit = memo[value] = self.matches(value)
            out[i] = hit
        return out


def table_mask(where: MetadataFilter, table: pa.Table) -> np.ndarray:
    """Which rows of an id map or a tail's table match (a table without ``metadata``: none)."""
    return where.mask(table.column("metadata") if "metadata" in table.column_names else None, table.num_rows)


def parse_metadata(value: str | None) -> dict[str, Any]:
    """A stored metadata JSON object as a dict ({} when there is none)."""
    if not value:
        return {}
    try:
        found = json.loads(value)
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}
