"""A database per test in the session's Postgres, with the demo's ``docs`` table."""

from __future__ import annotations

import itertools
from typing import Any

import psycopg2

from pipelines.pgcluster import LocalPostgres, docs_table

_numbers = itertools.count()

DOCS = docs_table()


class Database:
    """One database: ``execute`` runs a statement in its own transaction (autocommit)."""

    def __init__(self, server: LocalPostgres, name: str) -> None:
        self.name = name
        self.dsn = server.dsn(name)
        self.conn = psycopg2.connect(self.dsn)
        self.conn.autocommit = True

    def execute(self, sql: str, args: Any = None) -> None:
        with self.conn.cursor() as cur:
            cur.execute(sql, args)

    def rows(self, sql: str, args: Any = None) -> list[tuple[Any, ...]]:
        with self.conn.cursor() as cur:
            cur.execute(sql, args)
            return cur.fetchall()

    def docs(self) -> dict[str, tuple[str, str, tuple[str, ...]]]:
        """What the lake must hold: pk → (title, body, acl), as ``tests.oracle`` expects."""
        return {str(i): (t, b, tuple(a)) for i, t, b, a in self.rows("SELECT id, title, body, acl FROM docs")}

    def close(self) -> None:
        self.conn.close()


def new_database(server: LocalPostgres, schema: str = DOCS, publication: str = "streamrag") -> Database:
    name = f"t{next(_numbers)}"
    server.create_database(name)
    db = Database(server, name)
    db.execute(schema)
    db.execute(f"CREATE PUBLICATION {publication} FOR ALL TABLES")
    return db
