"""The JSON the HTTP API answers with, as pydantic models: they are the OpenAPI document's
response schemas, and the API fuzzer checks every response against them.

Models allow fields beyond those declared (``extra="allow"``), so a field added to a
payload is never dropped on the way out; the declared ones are what clients can rely on.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorBody(Out):
    error: str
    details: list[str] | None = None
    answer_id: str | None = None


class KafkaRef(Out):
    topic: str
    partition: int
    offset: int


class SourceOut(Out):
    table: str
    pk: str
    position: str
    event_time: str | None = None
    kafka: KafkaRef


class RetrieverRank(Out):
    rank: int
    score: float | None = None


class SearchHit(Out):
    chunk_id: str
    doc_id: str
    title: str | None = None
    text: str
    chunk_index: int | None = None
    score: float
    source: SourceOut
    metadata: dict[str, Any]
    lake_version: int
    index_version: int
    origin: Literal["index", "tail"]
    retrievers: dict[str, RetrieverRank] = Field(
        default_factory=dict,
        description="each retriever that found the chunk: its rank (1 = best) and, for dense, its cosine similarity",
    )


class SearchResponse(Out):
    mode: Literal["hybrid", "dense", "keyword"] = Field(
        description="how results were ranked (hybrid on an index version without a keyword index: dense)"
    )
    results: list[SearchHit]
    index_version: int
    lake_version: int
    nprobe: int
    tail_rows: int
    took_ms: float


class Citation(Out):
    n: int
    chunk_id: str
    doc_id: str
    title: str | None = None
    source: SourceOut
    lake_version: int
    index_version: int
    support: float
    sentences: list[int]
    #: extractive answers: [start, end) of each cited sentence in the chunk's text
    spans: list[list[int]] | None = None


class AnswerSentence(Out):
    text: str
    sources: list[int]
    scores: dict[str, float]
    #: generated answers: the share of the sentence's content words found in a span of each supporting source
    overlaps: dict[str, float] | None = None
    flagged: bool
    invalid_markers: list[int]
    unsupported_markers: list[int]
    #: extractive answers: [start, end) of the sentence in its source's chunk text (verbatim)
    span: list[int] | None = None
    #: left out of the answer: no source supports it and the request said "unsupported": "drop"
    dropped: bool = False


class AnswerSource(Out):
    n: int
    chunk_id: str
    doc_id: str
    title: str | None = None
    score: float


class AnswerResponse(Out):
    answer_id: str
    style: Literal["generate", "extract"] = "generate"
    mode: Literal["hybrid", "dense", "keyword"] = "dense"
    no_answer: bool
    answer: str
    raw_answer: str | None = None
    citations: list[Citation]
    sentences: list[AnswerSentence]
    flagged: list[str]
    dropped: list[str] = []
    sources: list[AnswerSource]
    model: str | None = None
    lake_version: int
    index_version: int
    timings: dict[str, float | None]


class ChunkVersionOut(Out):
    chunk_id: str
    doc_id: str
    op: Literal["upsert", "delete"]
    chunk_index: int | None = None
    title: str | None = None
    text: str | None = None
    content_hash: str | None = None
    acl: list[str]
    metadata: dict[str, Any]
    source: SourceOut
    ingest_time: str | None = None
    embedding_model: str | None = None
    writer: dict[str, Any]


class AnswerUse(Out):
    """An answer whose prompt held a chunk version of the thing asked about."""

    answer_id: str
    time: str | None = None
    principal: str
    question: str
    status: str
    chunk_ids: list[str]
    #: the chunk versions it used (chunk id and position): which version of the thing asked about
    versions: list[dict[str, str]] = []
    cited: bool
    lake_version: int | None = None
    index_version: int | None = None


class SourceLineage(Out):
    table: str
    pk: str
    status: Literal["live", "deleted"]
    current_chunks: list[str]
    chunk_versions: list[ChunkVersionOut]
    answers: list[AnswerUse]


class ChunkLineage(Out):
    chunk_id: str
    status: Literal["live", "deleted"]
    versions: list[ChunkVersionOut]
    answers: list[AnswerUse]


class UsedSource(Out):
    """A source of an answer; only ``n`` and ``visible: false`` when the caller may not see it."""

    n: int
    visible: bool
    chunk_id: str | None = None
    now: Literal["current", "updated", "deleted"] | None = None


class AnswerLineage(Out):
    answer_id: str
    time: str | None = None
    principal: str
    groups: list[str] | None = None
    question: str
    status: str
    style: Literal["generate", "extract"] = "generate"
    mode: Literal["hybrid", "dense", "keyword"] = "dense"
    answer: str | None = None
    raw_answer: str | None = None
    error: str | None = None
    lake_version: int | None = None
    index_version: int | None = None
    as_of: int | None = None
    models: dict[str, str | None]
    prompt_hash: str | None = None
    timings_ms: dict[str, float | None]
    citations: list[UsedSource]
    sources: list[UsedSource]
    sentences: list[dict[str, Any]]


class WhoAmI(Out):
    principal: str
    groups: list[str]
    auditor: bool


class DeadLetterOut(Out):
    topic: str
    partition: int
    offset: int
    error: str
    ingest_time: str | None = None


class DeadLetters(Out):
    total: int
    dead_letters: list[DeadLetterOut]


class Live(Out):
    status: Literal["alive"]


class Ready(Out):
    status: Literal["ready", "starting"]
    index_version: int | None = None
    lake_version: int | None = None


class Health(Out):
    status: Literal["ok", "degraded", "starting"]
    problems: list[str] | None = None
    index_version: int | None = None
    index_lake_version: int | None = None
    lake_version: int | None = None
    tail_rows: int | None = None
    tail_lag_s: float | None = None


#: every error the API answers with, documented on every route
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": about}
    for status, about in (
        (401, "missing or invalid bearer token"),
        (404, "not found, or not visible to the caller (never 403)"),
        (413, "request body over 64 KiB"),
        (422, "the request is not of the accepted shape; the error says which field"),
        (429, "rate limit exceeded (Retry-After says when to retry)"),
        (500, "a fault of the server's own, without internals"),
        (502, "the generator failed (answers)"),
        (503, "starting: the index is not loaded yet"),
    )
}
