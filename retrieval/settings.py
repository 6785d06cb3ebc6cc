"""``streamrag serve`` and ``streamrag search`` settings.

Flags first, then ``STREAMRAG_SERVE_<OPTION>`` / ``STREAMRAG_SEARCH_<OPTION>`` variables,
then the defaults. The generator's URL, model and API key also keep their established
names (``STREAMRAG_GENERATOR_URL``, ``STREAMRAG_GENERATOR_MODEL``,
``STREAMRAG_GENERATOR_API_KEY``), which deployments set.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipelines.settings import DEFAULT_NOTICES_TOPIC


class EngineSettings(BaseSettings):
    """What every command that searches needs: the lake, the index and how to read them."""

    model_config = SettingsConfigDict(frozen=True, populate_by_name=True)

    lake: str = Field(description="the lake: path, file:// or s3://")
    index: str = Field(description="the index store: path, file:// or s3://")
    model: str | None = Field(None, description="query embedder: the index's model directory")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    dtype: str = Field("auto", pattern=r"^(auto|fp32|bf16|fp16|int8)$", description="query embedder precision")
    cpu_threads: int | None = Field(None, ge=1, le=1024, description="threads per query embedding on CPU")
    nprobe: int | None = Field(None, ge=1, description="IVF lists probed per query (default 16%, 32-128)")
    rerank: int | None = Field(
        None, ge=1, le=100, description="compressed indexes: re-rank this many × k candidates exactly (4; pqM: 10)"
    )
    cache_dir: Path | None = Field(None, description="disk cache for shards (~/.cache/streamrag/shards)")
    cache_memory_mb: int = Field(2048, ge=1)
    cache_disk_mb: int = Field(20480, ge=1)
    tail_poll: float | None = Field(
        None, gt=0, description="seconds between polls of the lake (0.5; 2 when following commit notices)"
    )
    index_poll: float = Field(5.0, gt=0, description="seconds between checks for a new index version")
    mode: str = Field("hybrid", pattern=r"^(hybrid|dense|keyword)$", description="search mode (serve: the default)")
    keyword_weight: float | None = Field(
        None, ge=0, description="hybrid: the keyword ranking's weight for a sentence (dense: 1; default by fusion)"
    )
    identifier_weight: float | None = Field(
        None, ge=0, description="hybrid: the keyword ranking's weight for a query that is an identifier"
    )
    code_weight: float | None = Field(
        None, ge=0, description="hybrid: the keyword ranking's weight for a sentence that holds a code-like token"
    )
    fusion: str = Field("linear", pattern=r"^(rrf|linear)$", description="hybrid: how rankings are fused")
    rrf_k: int = Field(10, ge=1, description="hybrid: reciprocal rank fusion's constant")
    fusion_depth: int = Field(100, ge=1, le=1000, description="hybrid: candidates taken from the dense ranking")
    keyword_depth: int = Field(15, ge=1, le=1000, description="hybrid: candidates taken from the keyword ranking")
    feedback_docs: int = Field(
        1, ge=0, le=100, description="hybrid: chunks whose mean vector moves the query (relevance feedback; 0: off)"
    )
    feedback_weight: float = Field(1.0, ge=0, description="hybrid: the feedback chunks' weight beside the query's 1")
    keyword_memory_mb: int = Field(
        256, ge=0, description="keyword working copies kept in memory (/dev/shm) while they fit; 0: on disk"
    )


class ServeSettings(EngineSettings):
    model_config = SettingsConfigDict(env_prefix="STREAMRAG_SERVE_", frozen=True, populate_by_name=True)

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    tokens: Path | None = Field(None, description="bearer tokens → principal and groups (YAML/JSON)")
    rate_limit: float = Field(0.0, ge=0, description="requests/s per principal (0: off)")
    #: every search on a worker thread (default: on the event loop while all it needs is in memory)
    search_on_workers: bool = False
    generator_url: str | None = Field(
        None, validation_alias=AliasChoices("generator_url", "STREAMRAG_SERVE_GENERATOR_URL", "STREAMRAG_GENERATOR_URL")
    )
    generator_model: str | None = Field(
        None,
        validation_alias=AliasChoices(
            "generator_model", "STREAMRAG_SERVE_GENERATOR_MODEL", "STREAMRAG_GENERATOR_MODEL"
        ),
    )
    generator_api_key: str | None = Field(  # from the environment only: never a flag
        None,
        repr=False,
        validation_alias=AliasChoices("STREAMRAG_SERVE_GENERATOR_API_KEY", "STREAMRAG_GENERATOR_API_KEY"),
    )
    max_tokens: int = Field(256, ge=1, description="longest answer in tokens")
    generator_threads: int | None = Field(None, ge=1, description="CPU threads of the embedded generator")
    no_answers: bool = False
    #: answers without a model: only ``style: extract``
    no_generator: bool = False
    #: a request's default style; None: extract with the embedded generator, generate with --generator-url
    answer_style: str | None = Field(None, pattern=r"^(generate|extract)$")
    no_audit: bool = False
    audit_dead_letters: Path | None = None
    bootstrap: str | None = Field(None, description="Kafka bootstrap servers: follow the ingest job's commit notices")
    notices_topic: str = Field(DEFAULT_NOTICES_TOPIC, min_length=1)
    kafka_config: dict[str, str] = Field(default_factory=dict, repr=False)  # may hold SASL passwords


class SearchSettings(EngineSettings):
    model_config = SettingsConfigDict(env_prefix="STREAMRAG_SEARCH_", frozen=True, populate_by_name=True)

    query: str = Field(min_length=1)
    k: int = Field(10, ge=1, le=100)
    groups: str = ""
    as_of: int | None = Field(None, ge=0)
    filter: str | None = Field(None, description="metadata filter as JSON")
