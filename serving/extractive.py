"""Extractive answers: the sentences of the caller's sources that best answer the question.

No generator: each candidate is a verbatim span of a source's chunk text (a sentence, a
list item, or a fenced code block whole), scored by the embedding similarity of the span
to the question, plus a share of its whole source's similarity (a sentence means more in
a passage about the question). The best span is kept, and up to ``limit`` - 1 more that
score within ``window`` of it and repeat none already kept, in reading order (by source,
then by position). Every extract carries its source number and character span, so its
citation is exact by construction.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from serving.citations import Embeds

_BOUNDARY = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[A-Z0-9\"'(`*])")
_LIST_ITEM = re.compile(r"^\s*([-*\u2022]|\d+[.)])\s")
#: share of a span's score that comes from its whole source's similarity to the question
CONTEXT_WEIGHT = 0.25


@dataclass(frozen=True)
class Span:
    start: int
    end: int
    kind: str  # "text" | "code" | "heading"


@dataclass(frozen=True)
class Extract:
    n: int  # the source's number
    start: int  # character span in the source's chunk text
    end: int
    text: str  # exactly text[start:end] of the source
    score: float

    @property
    def plain(self) -> str:
        """The extract with its line breaks as spaces (code blocks keep theirs)."""
        return self.text if self.text.lstrip().startswith("```") else " ".join(self.text.split())


def sentence_spans(text: str) -> list[Span]:
    """Sentences of a chunk text as character spans: paragraphs (blank-line separated, list
    items and Markdown headings on their own) split at sentence ends; fenced code blocks whole."""
    spans: list[Span] = []
    block_start: int | None = None
    block_end = 0
    code_start: int | None = None

    def flush() -> None:
        nonlocal block_start
        if block_start is None:
            return
        start = block_start
        for match in _BOUNDARY.finditer(text, block_start, block_end):
            _add(spans, text, start, match.end(), "text")  # closing quotes stay, the space is trimmed
            start = match.end()
        _add(spans, text, start, block_end, "text")
        block_start = None

    offset = 0
    for line in text.splitlines(keepends=True):
        line_start, offset = offset, offset + len(line)
        stripped = line.strip()
        if code_start is not None:
            if stripped.startswith("```"):
                _add(spans, text, code_start, line_start + len(line.rstrip()), "code")
                code_start = None
            continue
        if stripped.startswith("```"):
            flush()
            code_start = line_start
        elif not stripped:
            flush()
        elif stripped.startswith("#"):
            flush()
            _add(spans, text, line_start, line_start + len(line.rstrip()), "heading")
        else:
            if _LIST_ITEM.match(line):
                flush()
            if block_start is None:
                block_start = line_start
            block_end = line_start + len(line.rstrip())
    if code_start is not None:
        _add(spans, text, code_start, len(text.rstrip()), "code")
    flush()
    return spans


def _add(spans: list[Span], text: str, start: int, end: int, kind: str) -> None:
    """A span with the whitespace at its ends left out (nothing if it is empty)."""
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    if end > start:
        spans.append(Span(start, end, kind))


def extract(
    question: np.ndarray,
    sources: list[tuple[int, str]],
    embeds: Embeds,
    source_vectors: np.ndarray | None = None,
    limit: int = 3,
    window: float = 0.08,
    min_chars: int = 20,
    max_chars: int = 800,
) -> list[Extract]:
    """The best spans of ``sources`` ((number, chunk text), best-ranked first) for a question
    vector, in reading order."""
    candidates: list[tuple[int, int, Span]] = []  # (source position, number, span)
    for at, (n, text) in enumerate(sources):
        for span in sentence_spans(text):
            if span.kind == "heading" or not min_chars <= span.end - span.start <= max_chars:
                continue
            candidates.append((at, n, span))
    if not candidates:
        return []
    texts = [sources[at][1][s.start : s.end] for at, _, s in candidates]
    vectors = embeds.embed([" ".join(t.split()) for t in texts])
    scores = vectors @ question
    if source_vectors is not None and len(source_vectors) == len(sources):
        context = source_vectors @ question
        scores = (1 - CONTEXT_WEIGHT) * scores + CONTEXT_WEIGHT * context[[at for at, _, _ in candidates]]
    order = np.argsort(-scores, kind="stable")
    picked: list[int] = []
    for i in order.tolist():
        if len(picked) >= limit or scores[i] < scores[order[0]] - window:
            break
        plain = " ".join(texts[i].split()).lower()
        if any(" ".join(texts[j].split()).lower() == plain or float(vectors[i] @ vectors[j]) > 0.95 for j in picked):
            continue
        picked.append(i)
    picked.sort(key=lambda i: (candidates[i][0], candidates[i][2].start))
    return [
        Extract(candidates[i][1], candidates[i][2].start, candidates[i][2].end, texts[i], round(float(scores[i]), 4))
        for i in picked
    ]
