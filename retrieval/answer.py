"""Grounded answers: search → numbered sources → generator → validated citations → audit.

Two styles: ``generate`` (a model writes the answer from the sources) and ``extract``
(no model: the sources' sentences that best answer the question, ``serving.extractive``,
each cited with its exact character span in the chunk).

The caller's search runs first (ACLs applied there), so the prompt only ever holds text
the caller may see; with nothing visible the answer is an explicit "no answer" and the
generator is not called. Citations do not rely on the model: every answer sentence is
attributed to the sources that support it (``serving.citations``), markers the model
wrote are kept only when valid and supported, and unsupported sentences are flagged.
Every outcome (answered, no answer, failed) is one record in the audit log.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from retrieval import metrics
from retrieval.acl import Principal
from retrieval.audit import AuditLog, now
from retrieval.engine import SearchEngine
from retrieval.errors import SearchError
from retrieval.filters import MetadataFilter
from retrieval.query_embedding import QueryEmbedder
from retrieval.results import SearchResult, SourceRef
from serving.citations import Attribution, attribute, is_code, strip_markers
from serving.extractive import Extract, extract
from serving.generator import Generator, GeneratorError
from serving.prompt import Source, build_messages, prompt_hash

log = logging.getLogger(__name__)

NO_ANSWER = "I found no sources you are allowed to see that could answer this question."
#: a generated answer whose every sentence was dropped as unsupported (``"unsupported": "drop"``)
NOTHING_SUPPORTED = "The sources I found do not support any sentence of the model's answer."
#: an extractive answer whose sources hold nothing to quote (only headings, code, markup)
NOTHING_TO_QUOTE = 'The sources I found hold no sentence to quote for this question; try "style": "generate".'
STYLES = ("generate", "extract")
#: what happens to a generated sentence no source supports: listed under "flagged", or removed
UNSUPPORTED = ("flag", "drop")


@dataclass(frozen=True)
class AnswerOptions:
    #: characters of each source put in the prompt (SmolLM2's context is 2048 tokens)
    max_source_chars: int = 1200
    #: a source supports a sentence with both similarity and overlap (see serving.citations;
    #: calibrated on SmolLM2's answers to the Python FAQ: benchmarks/answer.py, usefulness)
    threshold: float = 0.3
    marker_threshold: float = 0.3
    min_overlap: float = 0.65
    max_question_chars: int = 2000
    max_k: int = 20
    #: the style of a request that names none
    style: str = "generate"
    #: most sentences in an extractive answer
    extract_sentences: int = 3


@dataclass
class Prepared:
    """A question after retrieval, before generation."""

    answer_id: str
    question: str
    principal: Principal
    k: int
    as_of: int | None
    result: SearchResult
    sources: list[Source]
    messages: list[dict[str, str]]
    prompt_hash: str
    started: float
    retrieve_s: float
    timings: dict[str, float] = field(default_factory=dict)
    style: str = "generate"
    unsupported: str = "flag"


class _Embeds:
    """The query embedder's lock around sentence/source embedding (one model call at a time)."""

    def __init__(self, queries: QueryEmbedder) -> None:
        self.queries = queries

    def embed(self, texts: list[str]) -> np.ndarray:
        return self.queries.embed_texts(texts)


class Answerer:
    def __init__(
        self,
        engine: SearchEngine,
        generator: Generator | None,
        audit: AuditLog | None,
        generator_identity: str | None = None,
        options: AnswerOptions = AnswerOptions(),
    ) -> None:
        self.engine = engine
        self.generator = generator
        self.audit = audit
        self.options = options
        self.last_error: str | None = None  # the generator's last failure, until it answers again
        self._identity = generator_identity

    @property
    def generator_identity(self) -> str | None:
        if self._identity is None and self.generator is not None:
            self._identity = self.generator.model
        return self._identity

    # -- stages ------------------------------------------------------------------------------

    def prepare(
        self,
        question: str,
        k: int,
        principal: Principal,
        as_of: int | None = None,
        where: MetadataFilter | None = None,
        style: str | None = None,
        unsupported: str = "flag",
        mode: str | None = None,
    ) -> Prepared:
        style = style or self.options.style
        if style not in STYLES:
            raise SearchError(f"style must be one of {', '.join(STYLES)}.")
        if unsupported not in UNSUPPORTED:
            raise SearchError(f"unsupported must be one of {', '.join(UNSUPPORTED)}.")
        if style == "generate" and self.generator is None:
            raise SearchError('this service runs without a generator: ask with "style": "extract".', status=400)
        if not isinstance(question, str) or not question.strip():
            raise SearchError("question must be a non-empty string.")
        if len(question) > self.options.max_question_chars:
            limit = self.options.max_question_chars
            raise SearchError(f"question is {len(question)} characters; the limit is {limit}.")
        if not 1 <= k <= self.options.max_k:
            raise SearchError(f"k must be between 1 and {self.options.max_k}.")
        t0 = time.perf_counter()
        result = self.engine.search(question, k, principal, as_of, with_vectors=True, where=where, mode=mode)
        sources = [
            Source(n, r.get("title") or "", clip(r["text"], self.options.max_source_chars))
            for n, r in enumerate(result.results, 1)
        ]
        messages = build_messages(question, sources)
        retrieve_s = time.perf_counter() - t0
        metrics.ANSWER_SECONDS.labels("retrieve").observe(retrieve_s)
        return Prepared(uuid.uuid4().hex, question, principal, k, as_of, result, sources, messages,
                        prompt_hash(messages), t0, retrieve_s, style=style, unsupported=unsupported)  # fmt: skip

    def answer(self, p: Prepared) -> dict[str, Any]:
        """Generate without streaming; raises GeneratorError (after auditing the failure)."""
        if not p.sources:
            return self._finish(p, None, streamed=False)
        if p.style == "extract":
            return self._extracted(p, streamed=False)
        assert self.generator is not None
        try:
            completion = self.generator.complete(p.messages)
            p.timings["first_token_s"] = time.perf_counter() - p.started  # not streamed: the whole text at once
            return self._finish(p, completion.text, streamed=False)
        except GeneratorError as exc:
            self._failed(p, str(exc), streamed=False)
            raise
        except Exception as exc:  # a bug of ours, not the generator's: a 500, but audited all the same
            self._failed(p, f"internal error: {type(exc).__name__}", streamed=False, generator_fault=False)
            raise

    def stream(self, p: Prepared) -> Iterator[tuple[str, dict[str, Any]]]:
        """Events: ("token", {"text"}) as the model writes, then ("done", answer) or ("error", {...})."""
        if not p.sources:
            yield "done", self._finish(p, None, streamed=True)
            return
        if p.style == "extract":  # found at once: each paragraph is one event, then the answer
            done = self._extracted(p, streamed=True)
            for i, paragraph in enumerate(done["answer"].split("\n\n")):
                yield "token", {"text": ("\n\n" if i else "") + paragraph}
            yield "done", done
            return
        assert self.generator is not None
        parts: list[str] = []
        try:
            for token in self.generator.stream(p.messages):
                if not parts:
                    p.timings["first_token_s"] = time.perf_counter() - p.started
                parts.append(token)
                yield "token", {"text": token}
            done = self._finish(p, "".join(parts), streamed=True)
        except GeneratorError as exc:
            self._failed(p, str(exc), streamed=True, partial="".join(parts))
            yield "error", {"error": str(exc), "answer_id": p.answer_id}
            return
        except GeneratorExit:  # the client went away mid-stream: still audited
            self._failed(p, "client disconnected during the stream", True, "".join(parts), generator_fault=False)
            raise
        except Exception as exc:
            log.exception("answer %s failed", p.answer_id)
            error = f"internal error: {type(exc).__name__}"
            self._failed(p, error, True, "".join(parts), generator_fault=False)
            yield "error", {"error": f"{error}; the server log has the details", "answer_id": p.answer_id}
            return
        yield "done", done

    # -- results -----------------------------------------------------------------------------

    def _extracted(self, p: Prepared, streamed: bool) -> dict[str, Any]:
        """The extractive answer: verbatim spans of the sources, each cited with its span."""
        results = p.result.results
        t0 = time.perf_counter()
        question = self.engine.queries.embed(p.question)
        found = extract(question, [(s.n, r["text"]) for s, r in zip(p.sources, results, strict=True)],
                        _Embeds(self.engine.queries), p.result.vectors, self.options.extract_sentences)  # fmt: skip
        p.timings["first_token_s"] = time.perf_counter() - p.started
        metrics.ANSWER_SECONDS.labels("extract").observe(time.perf_counter() - t0)
        if not found:
            return self._payload(p, "no_answer", NOTHING_TO_QUOTE, None, [], [], streamed)
        sentences = [
            {"text": e.text, "sources": [e.n], "scores": {str(e.n): e.score}, "flagged": False,
             "invalid_markers": [], "unsupported_markers": [], "span": [e.start, e.end]}
            for e in found
        ]  # fmt: skip
        citations = []
        for n in dict.fromkeys(e.n for e in found):
            r = results[n - 1]
            mine = [i for i, e in enumerate(found) if e.n == n]
            citations.append({
                "n": n, "chunk_id": r["chunk_id"], "doc_id": r["doc_id"], "title": r.get("title"),
                "source": r["source"], "lake_version": r["lake_version"], "index_version": r["index_version"],
                "support": max(found[i].score for i in mine), "sentences": mine,
                "spans": [[found[i].start, found[i].end] for i in mine],
            })  # fmt: skip
        shown = _extract_text(found)
        return self._payload(p, "answered", shown, None, citations, sentences, streamed)

    def _finish(self, p: Prepared, text: str | None, streamed: bool) -> dict[str, Any]:
        results = p.result.results
        if text is None:
            attribution = Attribution([])
            status, shown = "no_answer", NO_ANSWER
        else:
            # The sources' stored vectors (from the index and the tail) stand in for
            # re-embedding them: the same model made them from the same chunk text.
            attribution = attribute(text, p.sources, _Embeds(self.engine.queries), self.options.threshold,
                                    self.options.marker_threshold, p.result.vectors,
                                    self.options.min_overlap)  # fmt: skip
            drop = p.unsupported == "drop"
            shown = _with_citations(attribution, drop) or (NOTHING_SUPPORTED if drop else text.strip())
            status = "answered"
        citations = []
        for n in attribution.cited:
            r = results[n - 1]
            used = [i for i, s in enumerate(attribution.sentences) if n in s.sources]
            support = max(attribution.sentences[i].scores[n] for i in used)
            citations.append({
                "n": n, "chunk_id": r["chunk_id"], "doc_id": r["doc_id"], "title": r.get("title"),
                "source": r["source"], "lake_version": r["lake_version"], "index_version": r["index_version"],
                "support": support, "sentences": used,
            })  # fmt: skip
        sentences = [
            {"text": s.text if is_code(s.text) else strip_markers(s.text), "sources": s.sources,
             "scores": {str(n): v for n, v in s.scores.items()},
             "overlaps": {str(n): v for n, v in s.overlaps.items()}, "flagged": s.flagged, "invalid_markers": s.invalid,
             "unsupported_markers": s.unsupported, "dropped": s.flagged and p.unsupported == "drop"}
            for s in attribution.sentences
        ]  # fmt: skip
        return self._payload(p, status, shown, text, citations, sentences, streamed)

    def _payload(
        self,
        p: Prepared,
        status: str,
        shown: str,
        text: str | None,
        citations: list[dict[str, Any]],
        sentences: list[dict[str, Any]],
        streamed: bool,
    ) -> dict[str, Any]:
        """The answer as returned (and audited), whichever style made it."""
        total_s = time.perf_counter() - p.started
        results = p.result.results
        timings = _timings(p, total_s)
        generated = text is not None
        payload: dict[str, Any] = {
            "answer_id": p.answer_id,
            "style": p.style,
            "mode": p.result.mode,
            "no_answer": status == "no_answer",
            "answer": shown,
            "raw_answer": text,
            "citations": citations,
            "sentences": sentences,
            "flagged": [s["text"] for s in sentences if s["flagged"] and not s.get("dropped")],
            "dropped": [s["text"] for s in sentences if s.get("dropped")],
            "sources": [
                {
                    "n": s.n,
                    "chunk_id": r["chunk_id"],
                    "doc_id": r["doc_id"],
                    "title": r.get("title"),
                    "score": r["score"],
                }
                for s, r in zip(p.sources, results, strict=True)
            ],
            "model": self.generator_identity if generated else None,
            "lake_version": p.result.lake_version,
            "index_version": p.result.index_version,
            "timings": timings,
        }
        metrics.ANSWERS.labels(status).inc()
        if generated:
            self.last_error = None
        metrics.ANSWER_SECONDS.labels("total").observe(total_s)
        if "first_token_s" in p.timings:
            metrics.ANSWER_SECONDS.labels("first_token").observe(p.timings["first_token_s"])
        metrics.FLAGGED_SENTENCES.inc(len(payload["flagged"]) + len(payload["dropped"]))
        self._audit(p, status, shown, text, citations, sentences, streamed, timings, None)
        return payload

    def _failed(self, p: Prepared, error: str, streamed: bool, partial: str = "", generator_fault: bool = True) -> None:
        metrics.ANSWERS.labels("failed").inc()
        if generator_fault:
            self.last_error = error
        timings = _timings(p, time.perf_counter() - p.started)
        self._audit(p, "failed", None, partial or None, [], [], streamed, timings, error)

    def _audit(
        self,
        p: Prepared,
        status: str,
        shown: str | None,
        raw: str | None,
        citations: list[dict[str, Any]],
        sentences: list[dict[str, Any]],
        streamed: bool,
        timings: dict[str, float | None],
        error: str | None,
    ) -> None:
        # the id, and where the lineage explorer shows the answer (no question or text: logs go wider)
        log.info("answer %s %s for %s (%s, %d sources): /ui/answers/%s",
                 p.answer_id, status, p.principal.name, p.style, len(p.result.results), p.answer_id)  # fmt: skip
        if self.audit is None:
            return
        results = p.result.results
        self.audit.record({
            "answer_id": p.answer_id,
            "time": now(),
            "principal": p.principal.name,
            "groups": sorted(p.principal.groups),
            "question": p.question,
            "status": status,
            "answer": shown,
            "raw_answer": raw,
            "sources": [
                {"n": s.n, "chunk_id": r["chunk_id"], "doc_id": r["doc_id"],
                 **SourceRef.from_json(r["source"]).as_columns(), "lake_version": r["lake_version"],
                 "origin": r["origin"], "score": r["score"]}
                for s, r in zip(p.sources, results, strict=True)
            ],
            "citations": [{"n": c["n"], "chunk_id": c["chunk_id"], "support": c["support"]} for c in citations],
            "sentences": json.dumps(sentences),
            "flagged_sentences": sum(1 for s in sentences if s["flagged"]),
            "k": p.k,
            "as_of": p.as_of,
            "lake_version": p.result.lake_version,
            "index_version": p.result.index_version,
            "style": p.style,
            "mode": p.result.mode,
            "embedder": str(self.engine.embedder.identity),
            "generator": self._identity if status != "no_answer" and p.style == "generate" else None,
            "generator_url": self.generator.where if self.generator is not None and p.style == "generate" else None,
            "prompt_hash": p.prompt_hash if p.sources and p.style == "generate" else None,
            "streamed": streamed,
            **timings,
            "error": error,
        })  # fmt: skip


def clip(text: str, limit: int) -> str:
    text = text.strip()
    if len(text) <= limit:
        return text
    cut = text[:limit]
    space = cut.rfind(" ")
    return (cut[:space] if space > limit * 0.8 else cut) + " …"


def _with_citations(attribution: Attribution, drop: bool = False) -> str:
    """The answer as returned: each sentence with the markers that survived validation,
    paragraphs and code blocks kept; with ``drop``, without the sentences no source supports."""
    blocks: dict[int, list[str]] = {}
    for s in attribution.sentences:
        if drop and s.flagged:
            continue
        cite = "".join(f"[{n}]" for n in sorted(s.sources))
        if is_code(s.text):
            text = f"{s.text}\n{cite}" if cite else s.text
        else:
            text = strip_markers(s.text)
            if cite and not text:  # the sentence was nothing but markers: keep the validated ones
                text = cite
            elif cite:
                end = text[-1] if text[-1] in ".!?" else ""
                text = f"{text[: len(text) - len(end)]} {cite}{end}"
            elif not text:
                continue
        blocks.setdefault(s.block, []).append(text)
    return "\n\n".join(" ".join(parts) for _, parts in sorted(blocks.items()))


def _extract_text(found: list[Extract]) -> str:
    """Extracts as paragraphs, one per run of the same source, each sentence cited."""
    paragraphs: list[list[str]] = []
    last = None
    for e in found:
        if e.n != last:
            paragraphs.append([])
            last = e.n
        paragraphs[-1].append(_cite(e.plain, e.n))
    return "\n\n".join(" ".join(p) for p in paragraphs)


def _cite(sentence: str, n: int) -> str:
    end = sentence[-1] if sentence[-1] in ".!?" else ""
    return f"{sentence[: len(sentence) - len(end)]} [{n}]{end}"


def _timings(p: Prepared, total_s: float) -> dict[str, float | None]:
    return {"retrieve_ms": _ms(p.retrieve_s), "first_token_ms": _ms(p.timings.get("first_token_s")),
            "total_ms": _ms(total_s)}  # fmt: skip


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)
