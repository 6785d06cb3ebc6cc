"""A throw-away local Postgres cluster for the demo and the tests (Debian's ``postgresql``).

It runs as an unprivileged user (Postgres refuses to run as root: as root, the server
runs as ``nobody``), listens on 127.0.0.1 only on a free port, trusts local connections
(no password: nothing else can reach it) and has ``wal_level = logical`` so the source
(:mod:`pipelines.pgsource`) can open a replication slot. Its data lives in a temporary
directory that :meth:`LocalPostgres.stop` removes.
"""

from __future__ import annotations

import glob
import logging
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class PostgresNotInstalled(RuntimeError):
    pass


def postgres_bindir() -> Path:
    """Where ``initdb`` and ``pg_ctl`` are (Debian keeps them out of PATH)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True)
    if found:
        return Path(found[0]).parent
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).resolve().parent
    raise PostgresNotInstalled(
        "Postgres is not installed: apt-get install postgresql (make demo and make test do this)."
    )


def docs_table(key_type: str = "int") -> str:
    """SQL that makes the ``docs`` table the ingest job's default mapping reads (key ``id``, title,
    body, ACL groups), with REPLICA IDENTITY FULL: updates and deletes carry the whole old row,
    as Debezium's events do."""
    return (
        f"CREATE TABLE docs (id {key_type} PRIMARY KEY, title text NOT NULL, body text NOT NULL, "
        "acl text[] NOT NULL DEFAULT '{}'); ALTER TABLE docs REPLICA IDENTITY FULL;"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalPostgres:
    """``start()``, use ``dsn(database)``, ``stop()`` (also a context manager)."""

    def __init__(self, port: int | None = None, durable: bool = True, user: str = "streamrag") -> None:
        self.port = port or _free_port()
        self.durable = durable  # fsync; off for tests (the server is never the thing killed there)
        self.user = user
        self.bindir = postgres_bindir()
        self.root: Path | None = None
        self._run_as: dict[str, Any] = {}

    @property
    def data(self) -> Path:
        assert self.root is not None
        return self.root / "data"

    def dsn(self, database: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user={self.user} dbname={database}"

    def create_database(self, name: str) -> str:
        """Make a database (``name``: a plain identifier); its connection string."""
        import psycopg2

        admin = psycopg2.connect(self.dsn())
        try:
            admin.autocommit = True  # CREATE DATABASE cannot run in a transaction
            with admin.cursor() as cur:
                cur.execute(f'CREATE DATABASE "{name}"')
        finally:
            admin.close()
        return self.dsn(name)

    def _run(self, *args: str) -> None:
        out = subprocess.run(
            [str(self.bindir / args[0]), *args[1:]], capture_output=True, text=True, timeout=120, **self._run_as
        )
        if out.returncode != 0:
            raise RuntimeError(f"{args[0]} failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}")

    def start(self) -> LocalPostgres:
        self.root = Path(tempfile.mkdtemp(prefix="streamrag-pg-"))
        if os.geteuid() == 0:  # Postgres will not run as root
            nobody = pwd.getpwnam("nobody")
            os.chown(self.root, nobody.pw_uid, nobody.pw_gid)
            self._run_as = {"user": nobody.pw_uid, "group": nobody.pw_gid, "cwd": str(self.root)}
        self._run("initdb", "-D", str(self.data), "-U", self.user, "--auth=trust", "-E", "UTF8", "--no-instructions")
        settings = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": "''",
            "wal_level": "logical",
            "max_replication_slots": "10",
            "max_wal_senders": "10",
            "fsync": "on" if self.durable else "off",
            "synchronous_commit": "on" if self.durable else "off",
            "full_page_writes": "on" if self.durable else "off",
        }
        with (self.data / "postgresql.conf").open("a") as fh:
            fh.writelines(f"{k} = {v}\n" for k, v in settings.items())
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-w", "-t", "60", "start")
        log.info("Postgres running on 127.0.0.1:%d (data in %s)", self.port, self.data)
        return self

    def stop(self) -> None:
        if self.root is None:
            return
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
        except RuntimeError as exc:
            log.warning("stopping Postgres: %s", exc)
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = None

    def log_tail(self, lines: int = 20) -> str:
        if self.root is None:
            return ""
        try:
            return "\n".join((self.root / "server.log").read_text().splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> LocalPostgres:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
