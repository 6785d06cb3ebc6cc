"""Table → document mapping: which columns are the key, the text, the ACL, metadata.

Defaults (ARCHITECTURE.md): primary key ``id``, text from ``title`` and ``body``,
``acl`` = list of groups or a comma-separated string. A mapping file (YAML or JSON)
overrides them per table::

    default: {id: [id], title: title, text: [body], acl: acl}
    tables:
      public.tickets: {id: [ticket_id], title: subject, text: [description, resolution]}
      public.faq: {acl: null}               # no ACL column: every row is public
      public.wiki: {public: true}           # rows without an ACL value are public

ACLs fail closed. While a table's mapping names an ACL column, every row must carry it:
a row in which that column is missing or null is refused (a dead letter saying so),
because a renamed, dropped or excluded column must not silently publish every row. An
empty list or empty string is an explicit "public". Only a mapping that says
``acl: null`` (the table has no ACL column) or ``public: true`` (a missing or null ACL
means public) makes rows public without one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class MappingError(ValueError):
    """A row cannot be mapped to a document; the message says which column and why."""


@dataclass(frozen=True)
class TableMapping:
    """How one table's rows become documents."""

    id_columns: tuple[str, ...] = ("id",)
    title_column: str | None = "title"
    text_columns: tuple[str, ...] = ("body",)
    acl_column: str | None = "acl"
    metadata_columns: tuple[str, ...] = ()
    #: a row whose ACL column is missing or null is public (else it is refused)
    public: bool = False

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], base: TableMapping | None = None) -> TableMapping:
        base = base or cls()
        known = {"id", "title", "text", "acl", "metadata", "public"}
        unknown = set(raw) - known
        if unknown:
            raise MappingError(f"unknown mapping keys {sorted(unknown)}; allowed: {sorted(known)}.")

        def cols(key: str, default: tuple[str, ...]) -> tuple[str, ...]:
            value = raw.get(key, default)
            if isinstance(value, str):
                return (value,)
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise MappingError(f"mapping key {key!r} must be a column name or a list of them.")
            return tuple(value)

        def one(key: str, default: str | None) -> str | None:
            value = raw.get(key, default)
            if value is not None and not isinstance(value, str):
                raise MappingError(f"mapping key {key!r} must be one column name or null, got {value!r:.60}.")
            return value

        public = raw.get("public", base.public)
        if not isinstance(public, bool):
            raise MappingError(f"mapping key 'public' must be true or false, got {public!r:.60}.")
        ids = cols("id", base.id_columns)
        if not ids:
            raise MappingError("mapping key 'id' needs at least one column.")
        return cls(
            id_columns=ids,
            title_column=one("title", base.title_column),
            text_columns=cols("text", base.text_columns),
            acl_column=one("acl", base.acl_column),
            metadata_columns=cols("metadata", base.metadata_columns),
            public=public,
        )

    def primary_key(self, row: Mapping[str, Any]) -> str:
        """The key as a string; JSON (sorted keys) for composite keys."""
        values = {}
        for col in self.id_columns:
            if col not in row or row[col] is None:
                raise MappingError(f"primary key column {col!r} is missing or null.")
            values[col] = row[col]
        return key_string(values)

    def document(self, row: Mapping[str, Any]) -> tuple[str, str, tuple[str, ...], tuple[tuple[str, str], ...]]:
        """(title, text, acl, metadata) of a row."""
        if self.text_columns and not any(col in row for col in self.text_columns):
            # Debezium sends every column, null or not: none of them means a dropped column or the
            # wrong mapping, and publishing the row would empty the document silently.
            raise MappingError(
                f"no text column ({', '.join(self.text_columns)}) is in the row: dropped from the table, "
                "or this table needs its own mapping."
            )
        title = _text_value(row, self.title_column) if self.title_column else ""
        parts = [_text_value(row, col) for col in self.text_columns]
        text = "\n\n".join(p for p in parts if p)
        acl = self.acl(row)
        metadata = tuple((col, json.dumps(row.get(col), sort_keys=True, default=str)) for col in self.metadata_columns)
        return title, text, acl, metadata

    def acl(self, row: Mapping[str, Any]) -> tuple[str, ...]:
        """The row's groups; () = public. Fails closed (see the module docstring)."""
        if self.acl_column is None:
            return ()
        value = row.get(self.acl_column)
        if value is None and not self.public:
            state = "missing" if self.acl_column not in row else "null"
            raise MappingError(
                f"acl column {self.acl_column!r} is {state}: ACLs fail closed, so this row is not published. "
                "Send the column in every row (an empty list means public), or declare the table public in "
                "the mapping (acl: null, or public: true)."
            )
        return parse_acl(value)


def key_string(values: Mapping[str, Any]) -> str:
    """A primary key as a string: the bare value for one column, JSON for several."""
    for col, value in values.items():
        if isinstance(value, (dict, list)) or isinstance(value, bool):
            raise MappingError(f"primary key column {col!r} has unsupported type {type(value).__name__}.")
    if len(values) == 1:
        return str(next(iter(values.values())))
    return json.dumps(dict(values), sort_keys=True, separators=(",", ":"))


def _text_value(row: Mapping[str, Any], col: str) -> str:
    value = row.get(col)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise MappingError(f"text column {col!r} is {type(value).__name__}, expected a string.")
    return value


def parse_acl(value: Any) -> tuple[str, ...]:
    """Groups from a list or a comma-separated string; empty (or None) = public."""
    if value is None:
        return ()
    if isinstance(value, str):
        groups = [g.strip() for g in value.split(",")]
    elif isinstance(value, list) and all(isinstance(g, str) for g in value):
        groups = [g.strip() for g in value]
    else:
        raise MappingError(
            f"acl must be a list of group names or a comma-separated string, got {type(value).__name__}."
        )
    return tuple(sorted({g for g in groups if g}))


@dataclass(frozen=True)
class MappingConfig:
    """The default mapping and per-table overrides (by ``schema.table`` or bare table)."""

    default: TableMapping = field(default_factory=TableMapping)
    tables: Mapping[str, TableMapping] = field(default_factory=dict)

    def for_table(self, qualified: str) -> TableMapping:
        if qualified in self.tables:
            return self.tables[qualified]
        bare = qualified.rsplit(".", 1)[-1]
        return self.tables.get(bare, self.default)

    @classmethod
    def load(cls, path: str | Path | None) -> MappingConfig:
        """Read a YAML or JSON mapping file; ``None`` gives the defaults."""
        if path is None:
            return cls()
        try:
            raw = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise MappingError(f"cannot read mapping file {path}: {exc}") from exc
        return cls.from_dict(raw or {})

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> MappingConfig:
        if not isinstance(raw, Mapping):
            raise MappingError("a mapping file must hold an object with 'default' and/or 'tables'.")
        unknown = set(raw) - {"default", "tables"}
        if unknown:
            raise MappingError(f"unknown top-level keys {sorted(unknown)}; a mapping file has default and tables.")
        default_raw = raw.get("default") or {}
        if not isinstance(default_raw, Mapping):
            raise MappingError("'default' must be an object of mapping keys (id, title, text, acl, metadata, public).")
        default = TableMapping.from_dict(default_raw)
        tables_raw = raw.get("tables") or {}
        if not isinstance(tables_raw, Mapping):
            raise MappingError("'tables' must be an object of table name → mapping keys.")
        tables = {}
        for name, spec in tables_raw.items():
            if not isinstance(spec or {}, Mapping):
                keys = "(id, title, text, acl, metadata, public)"
                raise MappingError(f"table {name!r} must map keys {keys}, got {spec!r:.60}.")
            tables[str(name)] = TableMapping.from_dict(spec or {}, default)
        return cls(default, tables)
