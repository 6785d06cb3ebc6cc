"""Object-store settings: where the lake and index live (local path, file:// or s3://).

Settings are read once at the entry point (:meth:`ObjectStoreSettings.from_env`, the
standard ``AWS_*`` variables and ``AWS_ENDPOINT_URL``) and passed down.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse


class StorageError(Exception):
    """A storage URI or its settings are unusable."""


@dataclass(frozen=True)
class ObjectStoreSettings:
    endpoint_url: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = field(default=None, repr=False)  # never in logs or tracebacks
    session_token: str | None = field(default=None, repr=False)
    region: str | None = None
    #: how long index-store operations retry an unreachable store before giving up:
    #: 0 for the API (a request must not hang on S3), minutes for batch jobs.
    patience_s: float = 0.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ObjectStoreSettings:
        env = os.environ if env is None else env
        return cls(
            endpoint_url=env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL"),
            access_key_id=env.get("AWS_ACCESS_KEY_ID"),
            secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"),
            session_token=env.get("AWS_SESSION_TOKEN"),
            region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"),
        )

    def delta_options(self, uri: str) -> dict[str, str] | None:
        """storage_options for deltalake: None for local paths."""
        if not is_s3(uri):
            return None
        opts: dict[str, str] = {}
        if self.endpoint_url:
            opts["AWS_ENDPOINT_URL"] = self.endpoint_url
            if self.endpoint_url.startswith("http://"):
                opts["AWS_ALLOW_HTTP"] = "true"
        if self.access_key_id:
            opts["AWS_ACCESS_KEY_ID"] = self.access_key_id
        if self.secret_access_key:
            opts["AWS_SECRET_ACCESS_KEY"] = self.secret_access_key
        if self.session_token:
            opts["AWS_SESSION_TOKEN"] = self.session_token
        opts["AWS_REGION"] = self.region or "us-east-1"
        return opts


def is_s3(uri: str) -> bool:
    return uri.startswith(("s3://", "s3a://"))


def normalize_uri(uri: str) -> str:
    """A plain path or file:// URI → absolute local path; s3:// kept as it is."""
    if not uri:
        raise StorageError("empty storage URI; give a path, file:// or s3:// URI.")
    if is_s3(uri):
        parsed = urlparse(uri)
        if not parsed.netloc:
            raise StorageError(f"{uri!r} has no bucket; expected s3://bucket/prefix.")
        return "s3://" + parsed.netloc + parsed.path.rstrip("/")
    if uri.startswith("file://"):
        uri = urlparse(uri).path
    elif "://" in uri:
        raise StorageError(f"unsupported storage URI scheme in {uri!r}; use a path, file:// or s3://.")
    return str(Path(uri).expanduser().resolve())


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])
