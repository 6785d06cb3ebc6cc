"""Object storage for index files: four operations, chosen by URI scheme.

A backend is get / put (optionally only if absent) / list / delete over keys relative to
a root URI. ``file://`` (or a plain path) and ``s3://`` are built in; the index builder and
the shard reader take a store as an argument rather than building one inside.

Errors are translated at the edge into this small hierarchy::

    StoreError
    ├── NotFound            the key does not exist
    ├── AlreadyExists       put(if_absent=True) found the key taken
    └── StoreUnavailable    the store could not be reached or refused the request
"""

from __future__ import annotations

import bisect
import logging
import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, TypeVar

from pipelines.storage import ObjectStoreSettings, is_s3, normalize_uri
from serving.retry import patience, retrying
from serving.waiting import may_wait

log = logging.getLogger(__name__)
T = TypeVar("T")


class StoreError(Exception):
    """An object-store operation failed."""


class NotFound(StoreError):
    pass


class AlreadyExists(StoreError):
    pass


class StoreUnavailable(StoreError):
    pass


class ObjectStore(ABC):
    """Keys are '/'-separated paths relative to ``root``."""

    root: str

    @abstractmethod
    def get(self, key: str) -> bytes: ...

    @abstractmethod
    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Bytes ``[start, start + length)`` of a file (fewer only past its end: callers verify)."""

    @abstractmethod
    def put(self, key: str, data: bytes | bytearray | memoryview, if_absent: bool = False) -> None:
        """Write ``data`` under ``key``, whole, before returning: the caller may reuse its buffer."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]: ...

    @abstractmethod
    def delete(self, key: str) -> None: ...

    def uri(self, key: str) -> str:
        return f"{self.root.rstrip('/')}/{key}"


class LocalStore(ObjectStore):
    """A directory. Writes go to a temporary file first, then an atomic rename (or link,
    for put-if-absent), so a reader never sees half a file."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._dir = Path(root)
        self._resolved: Path | None = None  # the root's real path, resolved once (a resolve per key is enough)
        self._dirs: dict[str, Path] = {}  # each key directory's real path, checked to be inside the root

    def _path(self, key: str) -> Path:
        """The key's file, refused if it would lie outside the root (``..``, an absolute key, a
        symbolic link leading out). A key's directory is resolved once: a full ``resolve`` per
        key (an ``lstat`` per path component) cost a cold query's reads ~10% of their CPU."""
        root = self._resolved
        if root is None:
            root = self._resolved = self._dir.resolve()
        parent, _, name = key.rpartition("/")
        if name in ("", ".", "..") or key.startswith("/"):
            return self._inside(root, (root / key).resolve(), key)
        base = self._dirs.get(parent)
        if base is None:
            base = self._inside(root, (root / parent).resolve() if parent else root, key)
            if len(self._dirs) >= 4096:
                self._dirs.clear()
            self._dirs[parent] = base
        path = base / name
        return self._inside(root, path.resolve(), key) if path.is_symlink() else path

    @staticmethod
    def _inside(root: Path, path: Path, key: str) -> Path:
        if not path.is_relative_to(root):
            raise StoreError(f"key {key!r} escapes the store root.")
        return path

    def get(self, key: str) -> bytes:
        may_wait(f"reading {key}")
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError as exc:
            raise NotFound(f"{self.uri(key)} does not exist.") from exc
        except OSError as exc:
            raise StoreUnavailable(f"cannot read {self.uri(key)}: {exc}") from exc

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        may_wait(f"reading {key}")
        try:
            with self._path(key).open("rb") as fh:
                fh.seek(start)
                return fh.read(length)
        except FileNotFoundError as exc:
            raise NotFound(f"{self.uri(key)} does not exist.") from exc
        except OSError as exc:
            raise StoreUnavailable(f"cannot read {self.uri(key)}: {exc}") from exc

    def put(self, key: str, data: bytes | bytearray | memoryview, if_absent: bool = False) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            if if_absent:
                try:
                    os.link(tmp, path)  # fails if the key exists: atomic create
                except FileExistsError as exc:
                    raise AlreadyExists(f"{self.uri(key)} already exists.") from exc
                finally:
                    os.unlink(tmp)
            else:
                os.replace(tmp, path)
        except StoreError:
            raise
        except OSError as exc:
            raise StoreUnavailable(f"cannot write {self.uri(key)}: {exc}") from exc

    def list(self, prefix: str = "") -> Iterator[str]:
        base = self._dir
        if not base.is_dir():
            return
        for path in sorted(base.rglob("*")):
            if path.is_file() and not path.name.startswith("."):
                key = path.relative_to(base).as_posix()
                if key.startswith(prefix):
                    yield key

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StoreUnavailable(f"cannot delete {self.uri(key)}: {exc}") from exc


#: HTTP connections an S3 store keeps open: one per thread of the reader's ranged-read pool
#: (``indexing.reader.RANGE_THREADS``)
MAX_CONNECTIONS = 64


class S3Store(ObjectStore):
    """An S3 (or S3-compatible) prefix via boto3; put-if-absent uses ``If-None-Match: *``.

    botocore retries each request a few times (seconds). With ``settings.patience_s`` > 0
    an operation that still finds the store unreachable is retried with capped exponential
    backoff until that much time has passed, so a batch job rides out an outage of minutes.
    Every operation is idempotent, put-if-absent included: a retry of a put that landed
    comes back as AlreadyExists, which the caller resolves (see ``manifest.publish``).
    """

    def __init__(self, root: str, settings: ObjectStoreSettings) -> None:
        import boto3
        from botocore.config import Config

        self.root = root
        self.patience_s = settings.patience_s
        without_scheme = root.split("://", 1)[1]
        self._bucket, _, prefix = without_scheme.partition("/")
        self._prefix = prefix.strip("/")
        self._client: Any = boto3.client(
            "s3",
            endpoint_url=settings.endpoint_url,
            aws_access_key_id=settings.access_key_id,
            aws_secret_access_key=settings.secret_access_key,
            aws_session_token=settings.session_token,
            region_name=settings.region or "us-east-1",
            # connections: one per thread that issues ranged reads (botocore's default is 10; past
            # it, requests open and drop a connection each)
            config=Config(
                retries={"max_attempts": 5, "mode": "standard"},
                connect_timeout=5,
                read_timeout=30,
                max_pool_connections=MAX_CONNECTIONS,
            ),
        )

    def _key(self, key: str) -> str:
        return f"{self._prefix}/{key}" if self._prefix else key

    def _translate(self, exc: Exception, key: str) -> StoreError:
        from botocore.exceptions import BotoCoreError, ClientError

        if isinstance(exc, ClientError):
            code = exc.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchKey", "404", "NotFound"):
                return NotFound(f"{self.uri(key)} does not exist.")
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                return AlreadyExists(f"{self.uri(key)} already exists.")
            return StoreUnavailable(f"S3 refused {self.uri(key)}: {code} {exc}")
        if isinstance(exc, BotoCoreError):
            return StoreUnavailable(f"cannot reach S3 for {self.uri(key)}: {exc}")
        return StoreError(f"{self.uri(key)}: {exc}")

    def _patiently(self, what: str, key: str, op: Callable[[], T]) -> T:
        def translated() -> T:
            try:
                return op()
            except Exception as exc:
                raise self._translate(exc, key) from exc

        for attempt in retrying(
            retry_on=lambda exc: isinstance(exc, StoreUnavailable),
            stop=patience(self.patience_s),
            max_s=10.0,
            jitter=0.2,
            log=log,
            what=f"{what} {self.uri(key)}",
        ):
            with attempt:
                return translated()
        raise AssertionError("unreachable: retrying() re-raises the last failure")

    def get(self, key: str) -> bytes:
        may_wait(f"fetching {key}")

        def op() -> bytes:
            body: bytes = self._client.get_object(Bucket=self._bucket, Key=self._key(key))["Body"].read()
            return body

        return self._patiently("get", key, op)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        may_wait(f"fetching {key}")

        def op() -> bytes:
            span = f"bytes={start}-{start + length - 1}"
            body: bytes = self._client.get_object(Bucket=self._bucket, Key=self._key(key), Range=span)["Body"].read()
            return body

        return self._patiently("get", key, op)

    def put(self, key: str, data: bytes | bytearray | memoryview, if_absent: bool = False) -> None:
        extra = {"IfNoneMatch": "*"} if if_absent else {}
        body = bytes(data) if isinstance(data, memoryview) else data  # botocore takes bytes, bytearray or a file
        self._patiently(
            "put", key, lambda: self._client.put_object(Bucket=self._bucket, Key=self._key(key), Body=body, **extra)
        )

    def list(self, prefix: str = "") -> Iterator[str]:
        strip = len(self._prefix) + 1 if self._prefix else 0

        def op() -> list[str]:  # whole listings, so a retry never yields a key twice
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self._bucket, Prefix=self._key(prefix)
            )
            return [obj["Key"][strip:] for page in pages for obj in page.get("Contents", [])]

        yield from self._patiently("list", prefix, op)

    def delete(self, key: str) -> None:
        self._patiently("delete", key, lambda: self._client.delete_object(Bucket=self._bucket, Key=self._key(key)))


def open_store(uri: str, settings: ObjectStoreSettings | None = None) -> ObjectStore:
    """The store for a URI: a path or file:// → LocalStore, s3:// → S3Store."""
    root = normalize_uri(uri)
    if is_s3(root):
        return S3Store(root, settings or ObjectStoreSettings())
    return LocalStore(root)


#: ranges closer than this are fetched as one request (a request costs more than the gap's bytes)
COALESCE_GAP = 64 << 10


def coalesce(ranges: list[tuple[int, int]], gap: int = COALESCE_GAP) -> list[tuple[int, int]]:
    """(start, length) ranges merged where they overlap or lie within ``gap`` bytes, sorted."""
    merged: list[tuple[int, int]] = []
    for start, length in sorted(r for r in ranges if r[1] > 0):
        if merged and start <= merged[-1][0] + merged[-1][1] + gap:
            first, size = merged[-1]
            merged[-1] = (first, max(size, start + length - first))
        else:
            merged.append((start, length))
    return merged


def get_ranges(
    store: ObjectStore, key: str, ranges: list[tuple[int, int]], pool: Executor | None = None, gap: int = COALESCE_GAP
) -> tuple[list[bytes], int, int]:
    """The bytes of each (start, length) range of one file, in order; requests and bytes moved.

    Near ranges share a request (``coalesce``); the requests run on ``pool`` in parallel.
    """
    spans = coalesce(ranges, gap)

    def fetch(span: tuple[int, int]) -> bytes:
        return store.get_range(key, *span)

    blobs = list(pool.map(fetch, spans)) if pool is not None and len(spans) > 1 else [fetch(s) for s in spans]
    starts = [s for s, _ in spans]
    out = []
    for start, length in ranges:
        i = bisect.bisect_right(starts, start) - 1
        offset = start - spans[i][0] if i >= 0 else 0
        out.append(blobs[i][offset : offset + length] if length > 0 and i >= 0 else b"")
    return out, len(spans), sum(len(b) for b in blobs)
