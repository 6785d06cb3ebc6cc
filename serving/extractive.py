"""Extractive answers: the sentences of the caller's sources that best answer the question.

No generator: each candidate is a verbatim span of a source's chunk text (a sentence or a
list item of its prose: headings, code, tables and the lead-ins that only point at what follows, "like this::",
are not quoted alone), scored by the embedding
similarity of the span to the question, plus a share of its whole source's similarity (a
sentence means more in a passage about the question). The best span is kept, and up to ``limit`` - 1 more that
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
#: share of a span's score that comes from its whole source's similarity to the question, and how
#: close to the best span's score another must be to be kept. Chosen on the even-numbered FAQ
#: questions (benchmarks/answer.py, FAQ pages and whole docs): the answer then cites a gold chunk
#: more often than retrieval's top-m, m the chunks it cites (0.25 and 0.08 before: less often)
CONTEXT_WEIGHT = 0.6
WINDOW = 0.12


@dataclass(frozen=True)
class Span:
    start: int
    end: int
    kind: str  # "text" | "code" | "heading" | "markup"


@dataclass(frozen=True)
class Extract:
    n: int  # the source's number
    start: int  # character span in the source's chunk text
    end: int
    text: str  # exactly text[start:end] of the source
    score: float

    @property
    def plain(self) -> str:
        """The extract with its line breaks as spaces (extracts are prose)."""
        return " ".join(self.text.split())


def sentence_spans(text: str) -> list[Span]:
    """Sentences of a chunk text as character spans. Paragraphs (blank-line separated; list
    items on their own) are split at sentence ends. Headings (Markdown ``#`` lines, reST
    titles with their under- and overlines) and code (fenced blocks, reST literal blocks
    after ``::``, doctest sessions, indented blocks) are kept whole with their kind."""
    spans: list[Span] = []
    literal_next = False  # the previous text paragraph ended with "::": a literal (code) block follows
    for lines in (part for paragraph in _paragraphs(text) for part in _split_titles(text, paragraph)):
        kind = _kind(text, lines, literal_next)
        literal_next = kind == "text" and text[lines[-1][0] : lines[-1][1]].rstrip().endswith("::")
        if kind == "text":
            spans.extend(_paragraph_text(text, lines))
        else:
            _add(spans, text, lines[0][0], lines[-1][1], kind)
    return spans


def _split_titles(text: str, lines: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """A paragraph cut around the reST titles inside it (a line over an underline, with its
    overline if any), each title a paragraph of its own."""
    if text[lines[0][0] : lines[0][1]].strip().startswith(_FENCE):
        return [lines]
    out: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    for i, line in enumerate(lines):
        if i >= 1 and current and _is_underline(text, line) and not _is_underline(text, lines[i - 1]):
            title = [current.pop()]
            if current and _is_underline(text, current[-1]):
                title.insert(0, current.pop())  # its overline
            if current:
                out.append(current)
            out.append([*title, line])
            current = []
        else:
            current.append(line)
    if current:
        out.append(current)
    return out


_UNDERLINE = re.compile(r"[=\-~^*+#\"':.]{3,}")
#: a sentence that only points at what follows it (code, a list)
_LEAD_IN = re.compile(r"\b(?:this|these|follows|following|below|example|e\.g\.)\s*::?$", re.I)
#: a span that ends in a question mark (closing quotes or markup may follow): a question answers nothing
_QUESTION = re.compile(r"\?[\"'`*)\]]*\s*$")
#: a table's border: ``+----+---+`` (reST grid), ``==== ====`` (reST simple), ``|---|---|`` (Markdown)
_TABLE = re.compile(r"^\s*(\+[-=+]{2,}|={2,}( +={2,})+\s*$|\|[-:| ]{3,}\|\s*$)")
_FENCE = "```"


def _paragraphs(text: str) -> list[list[tuple[int, int]]]:
    """Blank-line separated paragraphs as lists of (start, end) line spans; a fenced code
    block is one paragraph, blank lines and all."""
    out: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    fenced = False
    offset = 0
    for line in text.splitlines(keepends=True):
        start, offset = offset, offset + len(line)
        body = line.rstrip("\r\n")
        if body.strip().startswith(_FENCE):
            if not fenced and current:
                out.append(current)
                current = []
            current.append((start, start + len(body)))
            if fenced:
                out.append(current)
                current = []
            fenced = not fenced
        elif fenced:
            current.append((start, start + len(body)))
        elif not body.strip():
            if current:
                out.append(current)
                current = []
        else:
            current.append((start, start + len(body)))
    if current:
        out.append(current)
    return out


def _kind(text: str, lines: list[tuple[int, int]], literal: bool) -> str:
    first = text[lines[0][0] : lines[0][1]]
    if first.strip().startswith(_FENCE):
        return "code"
    if first.startswith(".. "):
        return "markup"  # a reST directive, label or comment
    if _TABLE.match(first) or all(_TABLE.match(text[a:b]) or text[a:b].lstrip().startswith("|") for a, b in lines):
        return "table"  # a reST grid or simple table, a Markdown table: cells, not sentences
    if first.lstrip().startswith("#") and len(lines) == 1:
        return "heading"
    if _is_underline(text, lines[-1]) or (len(lines) == 1 and _is_underline(text, lines[0])):
        return "heading"  # (what _split_titles cut out)
    indented = sum(1 for a, b in lines if text[a:b][:1] in (" ", "\t"))
    if literal or first.lstrip().startswith(">>>") or indented * 2 > len(lines):
        return "code"
    return "text"


def _is_underline(text: str, line: tuple[int, int]) -> bool:
    """A reST title's under- or overline: one punctuation character repeated."""
    body = text[line[0] : line[1]].strip()
    return bool(_UNDERLINE.fullmatch(body)) and len(set(body)) == 1


def _items(text: str, lines: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """A paragraph's lines grouped into list items (a paragraph without items: one group)."""
    items: list[list[tuple[int, int]]] = []
    for line in lines:
        if not items or _LIST_ITEM.match(text[line[0] : line[1]]):
            items.append([])
        items[-1].append(line)
    return items


def _paragraph_text(text: str, lines: list[tuple[int, int]]) -> list[Span]:
    """The spans of a text paragraph given as lines (what follows a reST title in one paragraph)."""
    out: list[Span] = []
    for item in _items(text, lines):
        start, end = item[0][0], item[-1][1]
        for match in _BOUNDARY.finditer(text, start, end):
            _add(out, text, start, match.end(), "text")
            start = match.end()
        _add(out, text, start, end, "text")
    return out


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
    window: float = WINDOW,
    min_chars: int = 20,
    max_chars: int = 800,
) -> list[Extract]:
    """The best spans of ``sources`` ((number, chunk text), best-ranked first) for a question
    vector, in reading order."""
    candidates: list[tuple[int, int, Span]] = []  # (source position, number, span)
    for at, (n, text) in enumerate(sources):
        for span in sentence_spans(text):
            if span.kind != "text" or not min_chars <= span.end - span.start <= max_chars:
                continue
            if _LEAD_IN.search(text, span.start, span.end):
                continue  # "defined like this::" says nothing without what follows
            if _QUESTION.search(text, span.start, span.end):
                continue  # a question (a FAQ's title quoted in another) answers nothing
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
