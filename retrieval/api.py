"""The HTTP API (FastAPI): ``/v1/search``, ``/v1/answer``, ``/v1/lineage/…``, probes, ``/metrics``,
and the lineage explorer's page (``/ui``: static files that read this API with the caller's
token, so it shows exactly what the API would).

Every error is JSON ``{"error": "..."}`` with a 4xx status saying what was wrong (5xx
only for the server's own faults, without internals).

Where work runs, so that no kind of load starves another:

- probes (``/livez``, ``/readyz``, ``/healthz``) and authentication are ``async`` and do no
  I/O: they answer on the event loop, never queued behind I/O or the model (at most behind
  searches that run there from memory, a few milliseconds each);
- a search runs on the event loop while all it needs is in memory (shards, the query's
  embedding, an up-to-date keyword copy): handing it to a worker thread and back cost more
  CPU than the search itself (the loop's wake-up through its self-pipe, and a GIL hand-off
  at every native call while other requests' threads wait). The first time it would wait
  for anything (``serving.waiting``: a store or disk read, the embedder, tail rows the
  keyword copy lacks) it starts again on a worker thread, as do ``as_of`` searches and all of
  them with ``search_on_loop`` off (``serve --search-on-workers``);
- lineage routes are plain ``def`` routes, run in FastAPI's thread pool;
- answers (and each step of an SSE stream, which blocks until the model's next token) run
  in a pool of their own (``answer_threads``), so long-lived streams can hold all of it
  without delaying searches or probes.

Probes, as Kubernetes uses them: ``/livez`` is 200 while the process serves HTTP at all
(restart only a wedged process); ``/readyz`` is 200 once the index is loaded and the tail
caught up (503 before: no traffic yet, no restart either); ``/healthz`` is the detail
page (problems with the lake, the index store, the generator, the audit log), whose
error texts only authenticated callers see.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, Literal

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from indexing.lists import ListIntegrityError
from indexing.store import StoreError
from pipelines import secrets
from retrieval import metrics
from retrieval.acl import ANONYMOUS, Principal
from retrieval.answer import Answerer
from retrieval.auth import Tokens, bearer
from retrieval.engine import SearchEngine
from retrieval.errors import SearchError
from retrieval.filters import FilterError, MetadataFilter
from retrieval.http import SSE_EVENT, ApiError, BodyLimit, RateLimiter, RequestTiming, error, sse
from retrieval.lineage import AUDITOR, Lineage
from retrieval.schemas import (
    ERRORS,
    AnswerLineage,
    AnswerResponse,
    ChunkLineage,
    DeadLetters,
    Health,
    Live,
    Ready,
    SearchResponse,
    SourceLineage,
    WhoAmI,
)
from serving.generator import GeneratorError
from serving.waiting import WouldWait, without_waiting

log = logging.getLogger(__name__)

MODE_HELP = (
    "hybrid: keyword (BM25) and vector search fused by reciprocal rank; dense: vector search; keyword: BM25 "
    "(default: the service's --mode)"
)
FILTER_HELP = (
    'only chunks whose document metadata matches: {"key": value or [any of these values]}, every key must match'
)


def where(raw: dict[str, Any] | None) -> MetadataFilter | None:
    try:
        return MetadataFilter.parse(raw)
    except FilterError as exc:
        raise ApiError(422, str(exc)) from exc


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: str = Field(min_length=1, max_length=4096, description="what to search for")
    k: int = Field(default=10, ge=1, le=100, description="how many results")
    as_of: int | None = Field(default=None, ge=0, description="answer as of this lake version (audits)")
    filter: dict[str, Any] | None = Field(default=None, description=FILTER_HELP)
    mode: Literal["hybrid", "dense", "keyword"] | None = Field(default=None, description=MODE_HELP)


class AnswerRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    question: str = Field(min_length=1, max_length=2000, description="the question to answer")
    k: int = Field(default=5, ge=1, le=20, description="how many sources to ground the answer on")
    stream: bool = Field(default=False, description="stream tokens as server-sent events")
    as_of: int | None = Field(default=None, ge=0, description="answer from the lake as of this version")
    filter: dict[str, Any] | None = Field(default=None, description=FILTER_HELP)
    style: Literal["generate", "extract"] | None = Field(
        default=None,
        description="generate: a model writes the answer, its sentences checked against the sources; extract: "
        "no model, the sources' sentences that best answer the question, each cited with its character span "
        "(default: the service's --answer-style)",
    )
    mode: Literal["hybrid", "dense", "keyword"] | None = Field(default=None, description=MODE_HELP)
    unsupported: Literal["flag", "drop"] = Field(
        default="flag",
        description="generated sentences no source supports: flag (kept, listed under flagged) or drop "
        "(left out of the answer, listed under dropped)",
    )


# The service's components reach routes as dependencies (set on ``app.state`` by
# create_app). They are async: resolving them never takes a thread from a pool.


async def get_engine(request: Request) -> SearchEngine:
    engine: SearchEngine = request.app.state.engine
    return engine


async def get_answerer(request: Request) -> Answerer:
    answerer: Answerer | None = request.app.state.answerer
    if answerer is None:
        raise ApiError(404, "answers are not enabled on this service (it was started without a generator)")
    return answerer


async def get_lineage(request: Request) -> Lineage:
    lineage: Lineage | None = request.app.state.lineage
    if lineage is None:
        raise ApiError(404, "lineage is not enabled on this service")
    return lineage


def caller(request: Request) -> Principal | None:
    """The principal a request's token names; ANONYMOUS without auth; None if unauthenticated."""
    tokens: Tokens | None = request.app.state.tokens
    if tokens is None:
        return ANONYMOUS
    token = bearer(request.headers.get("authorization"))
    return None if token is None else tokens.principal(token)


async def principal(request: Request) -> Principal:
    """The caller, authenticated (401 otherwise) and within the rate limit (429 otherwise)."""
    tokens: Tokens | None = request.app.state.tokens
    found = ANONYMOUS
    if tokens is not None:
        token = bearer(request.headers.get("authorization"))
        if token is None:
            raise ApiError(401, "missing bearer token (Authorization: Bearer <token>)", {"WWW-Authenticate": "Bearer"})
        known = tokens.principal(token)
        if known is None:
            raise ApiError(401, "invalid bearer token", {"WWW-Authenticate": 'Bearer error="invalid_token"'})
        found = known
    limiter: RateLimiter | None = request.app.state.limiter
    if limiter is not None:
        wait = limiter.allow(found.name)
        if wait:
            metrics.RATE_LIMITED.inc()
            raise ApiError(429, f"rate limit of {limiter.rate:g} requests/s exceeded; retry in {wait:.1f} s",
                           {"Retry-After": str(max(1, round(wait)))})  # fmt: skip
    return found


Caller = Annotated[Principal, Depends(principal)]
EngineDep = Annotated[SearchEngine, Depends(get_engine)]
AnswererDep = Annotated[Answerer, Depends(get_answerer)]
LineageDep = Annotated[Lineage, Depends(get_lineage)]


UI_DIR = Path(__file__).parent / "ui"
UI_TYPES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
            "app.css": "text/css; charset=utf-8"}  # fmt: skip
#: the explorer loads nothing from elsewhere and runs no inline script; no page may frame it
UI_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@functools.cache
def ui_asset(name: str) -> bytes:
    return (UI_DIR / name).read_bytes()


def create_app(
    engine: SearchEngine,
    tokens: Tokens | None,
    answerer: Answerer | None = None,
    lineage: Lineage | None = None,
    rate_limit: float | None = None,
    answer_threads: int = 64,
    search_on_loop: bool = True,
    on_startup: Sequence[Callable[[], object]] = (),
    on_shutdown: Sequence[Callable[[], object]] = (),
) -> FastAPI:
    """The API over the given components; ``on_startup``/``on_shutdown`` run (in a thread)
    when the server starts and stops: loading the index, draining the audit log."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for step in on_startup:
            await anyio.to_thread.run_sync(step)
        try:
            yield
        finally:
            for step in on_shutdown:
                await anyio.to_thread.run_sync(step)

    app = FastAPI(
        title="streamrag",
        summary="Search a streaming RAG index: IVF shards in object storage plus the live lake tail.",
        version="1",
        lifespan=lifespan,
        responses=ERRORS,
    )
    app.state.engine, app.state.answerer, app.state.lineage = engine, answerer, lineage
    app.state.tokens, app.state.limiter = tokens, RateLimiter(rate_limit) if rate_limit else None
    app.add_middleware(BodyLimit)
    app.add_middleware(RequestTiming, histogram=metrics.REQUEST_SECONDS)  # added last: outside BodyLimit
    answer_pool = anyio.CapacityLimiter(answer_threads)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error(exc.status, str(exc), exc.headers)

    @app.exception_handler(SearchError)
    async def search_error(_: Request, exc: SearchError) -> JSONResponse:
        return error(exc.status, str(exc), {"Retry-After": "5"} if exc.status == 503 else None)

    @app.exception_handler(StoreError)
    async def store_error(_: Request, exc: StoreError) -> JSONResponse:
        # a probed list or vector not yet local while the index store is down: retry later
        log.warning("index store error during a request: %s", exc)
        return error(503, "the index store is unavailable; retry shortly.", {"Retry-After": "5"})

    @app.exception_handler(ListIntegrityError)
    async def corrupt(_: Request, exc: ListIntegrityError) -> JSONResponse:
        log.error("index data failed its integrity check: %s", exc)
        return error(502, "index data read from storage failed its integrity check; the server log has the details.")

    @app.exception_handler(GeneratorError)
    async def generator_error(_: Request, exc: GeneratorError) -> JSONResponse:
        return error(502, secrets.redact(f"the generator failed: {exc}"))

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for e in exc.errors():
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body"
            problems.append(f"{where}: {e.get('msg', 'invalid')}")
        return JSONResponse({"error": "; ".join(problems), "details": problems}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return error(500, "internal error; the server log has the details")

    @app.post("/v1/search", response_model=SearchResponse)
    async def search(body: SearchRequest, who: Caller, engine: EngineDep) -> dict[str, Any]:
        # On the event loop while everything it needs is in memory: a hand-off to a worker
        # thread and back cost more CPU than a cached query's search (module docstring).
        if search_on_loop and body.as_of is None:  # as_of may read the lake: not through may_wait
            try:
                with without_waiting():
                    found = run_search(body, who, engine)
            except WouldWait as exc:
                log.debug("search moved to a worker thread: %s", exc)
                metrics.SEARCH_THREADS.labels("worker after loop").inc()
            else:
                metrics.SEARCH_THREADS.labels("loop").inc()
                return found
        else:
            metrics.SEARCH_THREADS.labels("worker").inc()
        return await anyio.to_thread.run_sync(run_search, body, who, engine)

    def run_search(body: SearchRequest, who: Principal, engine: SearchEngine) -> dict[str, Any]:
        t0 = time.perf_counter()
        result = engine.search(body.query, body.k, who, body.as_of, where=where(body.filter), mode=body.mode)
        return {
            "mode": result.mode,
            "results": result.results,
            "index_version": result.index_version,
            "lake_version": result.lake_version,
            "nprobe": result.nprobe,
            "tail_rows": result.tail_rows,
            "took_ms": round((time.perf_counter() - t0) * 1000, 2),
        }

    @app.post(
        "/v1/answer",
        response_model=None,
        responses={200: {"model": AnswerResponse, "description": "the answer (JSON), or with stream: true server-sent "
                         "events: token {text} …, then done {the answer} or error {error, answer_id}",
                         "content": {"text/event-stream": {"schema": SSE_EVENT}}}},
    )  # fmt: skip
    async def answer(body: AnswerRequest, who: Caller, answerer: AnswererDep) -> Response:
        prepared = await anyio.to_thread.run_sync(  # errors here are plain JSON
            answerer.prepare,
            body.question,
            body.k,
            who,
            body.as_of,
            where(body.filter),
            body.style,
            body.unsupported,
            body.mode,
            limiter=answer_pool,
        )
        if body.stream:
            return StreamingResponse(
                sse(answerer.stream(prepared), answer_pool),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Answer-Id": prepared.answer_id},
            )
        try:
            done = await anyio.to_thread.run_sync(answerer.answer, prepared, limiter=answer_pool)
        except GeneratorError as exc:  # audited already; the id finds the audit row
            return JSONResponse({"error": secrets.redact(f"the generator failed: {exc}"),
                                 "answer_id": prepared.answer_id}, status_code=502,
                                headers={"X-Answer-Id": prepared.answer_id})  # fmt: skip
        shown = AnswerResponse.model_validate(done).model_dump(mode="json")
        return JSONResponse(shown, headers={"X-Answer-Id": prepared.answer_id})

    @app.get("/v1/lineage/answers/{answer_id}", response_model=AnswerLineage)
    def answer_lineage(answer_id: str, who: Caller, lineage: LineageDep) -> dict[str, Any]:
        return lineage.answer(answer_id, who)

    @app.get("/v1/lineage/sources/{table}/{pk:path}", response_model=SourceLineage)
    def source_lineage(table: str, pk: str, who: Caller, lineage: LineageDep) -> dict[str, Any]:
        return lineage.source(table, pk, who)

    @app.get("/v1/lineage/chunks/{chunk_id}", response_model=ChunkLineage)
    def chunk_lineage(chunk_id: str, who: Caller, lineage: LineageDep) -> dict[str, Any]:
        return lineage.chunk(chunk_id, who)

    @app.get("/v1/whoami", response_model=WhoAmI)
    def whoami(who: Caller) -> dict[str, Any]:
        """The caller's own principal and groups (the explorer shows them and its auditor views)."""
        return {"principal": who.name, "groups": sorted(who.groups), "auditor": AUDITOR in who.groups}

    @app.get("/v1/ops/dead-letters", response_model=DeadLetters)
    def dead_letters(who: Caller, lineage: LineageDep, limit: int = 50) -> dict[str, Any]:
        """The newest dead letters and why (auditors only: anyone else gets a 404). Their bytes
        are not returned: a refused row can hold any document's text."""
        if AUDITOR not in who.groups:
            raise ApiError(404, "not found")
        if not 1 <= limit <= 1000:
            raise ApiError(422, "limit must be between 1 and 1000")
        return lineage.dead_letters(limit)

    @app.get("/ui", include_in_schema=False)
    @app.get("/ui/{_path:path}", include_in_schema=False)
    def explorer(_path: str = "") -> Response:
        """The lineage explorer's page: the same shell for every view (the script reads the path
        and asks the API, with the caller's token, for what that caller may see)."""
        return Response(ui_asset("index.html"), media_type="text/html; charset=utf-8", headers=UI_HEADERS)

    @app.get("/ui-assets/{name}", include_in_schema=False)
    def explorer_asset(name: str) -> Response:
        if name not in UI_TYPES:
            raise ApiError(404, "not found")
        return Response(ui_asset(name), media_type=UI_TYPES[name], headers=UI_HEADERS)

    @app.get("/livez", response_model=Live)
    async def livez() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/readyz", response_model=Ready, responses={503: {"model": Ready}})
    async def readyz(engine: EngineDep) -> JSONResponse:
        if not engine.ready:
            return JSONResponse({"status": "starting"}, status_code=503, headers={"Retry-After": "5"})
        view = engine.current_view()
        return JSONResponse({"status": "ready", "index_version": view.index_version,
                             "lake_version": view.lake_version})  # fmt: skip

    @app.get("/healthz", response_model=Health, responses={503: {"model": Health}})
    async def healthz(request: Request, engine: EngineDep) -> JSONResponse:
        health = engine.health()
        if answerer is not None and health["status"] != "starting":
            if answerer.audit is not None and not answerer.audit.healthy:
                health["problems"].append(f"audit log: {answerer.audit.last_error}")
            if answerer.last_error:
                health["problems"].append(f"generator: {answerer.last_error}")
            if health["problems"]:
                health["status"] = "degraded"
        if "problems" in health:
            if caller(request) is None:  # raw errors name hosts, buckets and paths: not for strangers
                health["problems"] = [p.split(":", 1)[0] for p in health["problems"]]
                health.pop("tail_rows", None)  # how many chunks changed, hidden ones included
            else:
                health["problems"] = [secrets.redact(p) for p in health["problems"]]
        return JSONResponse(health, status_code=200 if health["status"] != "starting" else 503)

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
