"""Settings: one object per command, validated at start-up, passed down.

Every command is configured the same way (``IngestSettings`` here; ``IndexBuildSettings``
in ``indexing.settings``; ``ServeSettings`` and ``SearchSettings`` in
``retrieval.settings``): a pydantic-settings model whose fields are the command's options,
read from its flags first, then from ``STREAMRAG_<COMMAND>_<OPTION>`` variables, then the
defaults. :func:`from_args` builds one from parsed flags and says which flag is wrong.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any, TypeVar

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipelines.storage import ObjectStoreSettings

DEFAULT_NOTICES_TOPIC = "streamrag.commits"  # pipelines.notices; next to the CDC topics


class IngestSettings(BaseSettings):
    """``streamrag ingest`` options; also read from ``STREAMRAG_INGEST_*`` variables so
    ``python -m bytewax.run "pipelines.flow:build_flow()"`` works without the CLI."""

    model_config = SettingsConfigDict(env_prefix="STREAMRAG_INGEST_", frozen=True)

    job_name: str = Field("ingest", pattern=r"^[A-Za-z0-9_.-]+$")
    bootstrap: str = "127.0.0.1:9092"
    topics: list[str] = Field(default_factory=list)
    lake: str = "./lake"
    mapping_file: str | None = None
    model: str | None = None
    device: str = "auto"
    dtype: str = Field("auto", pattern=r"^(auto|fp32|bf16|fp16|int8)$")
    cpu_threads: int | None = Field(None, ge=1, le=1024)
    workers: int = Field(1, ge=1, le=256)
    writers: int = Field(2, ge=1, le=256)
    recovery_dir: str | None = None
    epoch_interval_s: float = Field(2.0, gt=0)
    until_idle_s: float | None = Field(None, gt=0)
    #: how long a missing input topic is waited for (a source started beside the job creates it)
    topic_wait_s: float = Field(60.0, ge=0)
    batch_max_events: int = Field(256, ge=1)
    batch_timeout_ms: int = Field(200, ge=1)
    fetch_wait_ms: int = Field(100, ge=1, le=10_000)
    chunk_max_tokens: int = Field(200, ge=16)
    chunk_overlap_tokens: int = Field(24, ge=0)
    #: each chunk's vector mixed with its neighbours' at this weight (``pipelines.context``; 0: none;
    #: None: the lake's, or ``pipelines.context.DEFAULT_WEIGHT`` for a new lake)
    context_weight: float | None = Field(None, ge=0, le=4)
    embed_token_budget: int | None = Field(None, ge=64)  # None: the backend's (2048 on CPU, 8192 on GPU)
    vector_cache_size: int = Field(50_000, ge=0)
    dlq_suffix: str = ".dlq"
    notices_topic: str = Field(DEFAULT_NOTICES_TOPIC, pattern=r"^[A-Za-z0-9._-]*$")  # "": no notices
    #: a deleted document's state is dropped this long after its delete, and never before the
    #: source topics' own retention has passed (0: keep it forever)
    deleted_state_retention_hours: float = Field(192.0, ge=0)
    metrics_port: int | None = Field(None, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"
    kafka_config: dict[str, str] = Field(default_factory=dict, repr=False)  # may hold SASL passwords
    # Object store (the CLI fills these from the standard AWS_* variables).
    s3_endpoint_url: str | None = None
    s3_access_key_id: str | None = None
    s3_secret_access_key: str | None = Field(None, repr=False)
    s3_session_token: str | None = Field(None, repr=False)
    s3_region: str | None = None

    @field_validator("topics")
    @classmethod
    def _topics_given(cls, topics: list[str]) -> list[str]:
        if not topics:
            raise ValueError("at least one topic is required (--topic T).")
        return topics

    def object_store(self) -> ObjectStoreSettings:
        return ObjectStoreSettings(
            self.s3_endpoint_url,
            self.s3_access_key_id,
            self.s3_secret_access_key,
            self.s3_session_token,
            self.s3_region,
        )


S = TypeVar("S", bound=BaseSettings)

#: parsed-flag names that are never settings (argparse's own, output formats)
_NOT_SETTINGS = {"func", "command", "verbose", "json"}


class SettingsError(ValueError):
    """Settings that do not validate; the message names each flag and what is wrong."""


def from_args(cls: type[S], args: argparse.Namespace, cli_only: Iterable[str] = (), **extra: Any) -> S:
    """``cls`` from the flags given (None = not given: the variable or default applies)."""
    skip = _NOT_SETTINGS | set(cli_only)
    given = {k: v for k, v in vars(args).items() if k not in skip and not k.endswith("_command") and v is not None}
    try:
        return cls(**given, **extra)
    except ValidationError as exc:
        problems = [f"--{'-'.join(str(p) for p in e['loc']).replace('_', '-')}: {e['msg']}" for e in exc.errors()]
        raise SettingsError("; ".join(problems)) from exc
