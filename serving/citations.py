"""Citations that do not depend on the model writing them correctly.

Small models rarely write correct ``[n]`` markers, and a sentence can be *about* a source's
topic without saying what the source says. Each answer sentence is therefore checked
against the sources actually sent, and a source supports it only with two kinds of evidence:

- **similarity**: the sentence's embedding is close to the source's (``threshold``);
- **overlap**: most of the sentence's content words (stemmed, stop words left out) occur in
  one span of the source, at most ``SPAN_SENTENCES`` consecutive sentences of it
  (``min_overlap``). Similarity alone attributed 49% of SmolLM2's sentences to the Python
  FAQ at a citation precision of 0.29; with the overlap, 18% at 0.88 (benchmarks/answer.py,
  usefulness and ``--rejudge``, which chose the defaults).

Then:

- the markers it carries are parsed; a marker naming no source sent is *invalid*, and a
  marker naming a source that does not support the sentence (similarity below
  ``marker_threshold`` or overlap below ``min_overlap``) is *unsupported*; both are dropped;
- the sentence's support is every source that supports it, best first;
- a sentence with no support is *flagged*, never silently kept as if grounded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import tantivy

from serving.prompt import Source


class Embeds(Protocol):
    """Anything that embeds a list of texts to unit vectors (an Embedder, or a locked wrapper)."""

    def embed(self, texts: list[str]) -> np.ndarray: ...


_MARKER = re.compile(r"\[(\d+(?:\s*[,;]\s*\d+)*)\]")
_SENTENCE = re.compile(r"(?<=[.!?])(?:\s*\[\d+(?:\s*[,;]\s*\d+)*\])*\s+(?=[A-Z0-9\"'(])")


_LIST_ITEM = re.compile(r"^([-*\u2022]|\d+[.)])\s")

#: consecutive source sentences a sentence's content words must be found in
SPAN_SENTENCES = 3
#: words that carry no claim of their own (stemmed, as content_terms compares)
_STOP = frozenset(
    "a an the and or but if then else of to in on at by for with from as is are was were be been being it its "
    "this that these those there their they them he she we you your our i me my not no do doe did done can could "
    "will would should may might must have has had which who whom whose what when where why how all ani each "
    "some such than too veri so just also into over under about after befor between out up down onli own same "
    "other more most both few further onc here now us use one yes".split()
)
_ANALYZER = (
    tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple())
    .filter(tantivy.Filter.lowercase())
    .filter(tantivy.Filter.stemmer("english"))
    .build()
)
_SOURCE_SENTENCE = re.compile(r"(?<=[.!?:])\s+|\n\s*\n")


def content_terms(text: str) -> frozenset[str]:
    """The stemmed words of ``text`` that carry its content (no stop words, no single letters)."""
    return frozenset(t for t in _ANALYZER.analyze(text) if t not in _STOP and (len(t) > 1 or t.isdigit()))


def overlap(terms: frozenset[str], source: str) -> float:
    """The largest share of ``terms`` found within ``SPAN_SENTENCES`` consecutive sentences of
    ``source`` (0 for a sentence with no content words: nothing in it can be checked)."""
    if not terms:
        return 0.0
    spans = [content_terms(part) for part in _SOURCE_SENTENCE.split(source) if part.strip()]
    best = 0
    for start in range(len(spans)):
        window: set[str] = set()
        for part in spans[start : start + SPAN_SENTENCES]:
            window |= part
            best = max(best, len(terms & window))
        if best == len(terms):
            break
    return best / len(terms)


def _sentences(paragraph: str) -> list[str]:
    out = []
    start = 0
    for match in _SENTENCE.finditer(paragraph):
        end = match.start() + len(match.group(0).rstrip())
        piece = paragraph[start:end].strip()
        if piece:
            out.append(piece)
        start = match.end()
    tail = paragraph[start:].strip()
    if tail:
        out.append(tail)
    return out


def split_blocks(text: str) -> list[list[str]]:
    """Paragraphs (blank-line separated; list items start their own) as lists of sentences.

    Lines wrapped inside a paragraph are joined, so a sentence broken over two lines stays
    one sentence; a fenced code block (```) is kept whole, verbatim, as one unit.
    """
    blocks: list[list[str]] = []
    paragraph: list[str] = []
    code: list[str] | None = None

    def end_paragraph() -> None:
        if paragraph:
            found = _sentences(" ".join(paragraph))
            if found:
                blocks.append(found)
            paragraph.clear()

    for line in text.split("\n"):
        stripped = line.strip()
        if stripped.startswith("```"):
            if code is None:
                end_paragraph()
                code = [line]
            else:
                blocks.append(["\n".join([*code, line])])
                code = None
            continue
        if code is not None:
            code.append(line)
        elif not stripped:
            end_paragraph()
        else:
            if _LIST_ITEM.match(stripped):
                end_paragraph()
            paragraph.append(stripped)
    if code is not None:
        blocks.append(["\n".join(code)])
    end_paragraph()
    return blocks


def split_sentences(text: str) -> list[str]:
    """Sentences of an answer, markers kept with the sentence they follow."""
    return [sentence for block in split_blocks(text) for sentence in block]


def is_code(unit: str) -> bool:
    return unit.lstrip().startswith("```")


def markers(sentence: str) -> list[int]:
    found: list[int] = []
    for group in _MARKER.findall(sentence):
        for n in re.split(r"\s*[,;]\s*", group):
            if int(n) not in found:
                found.append(int(n))
    return found


def strip_markers(sentence: str) -> str:
    return re.sub(r"\s+([.,;:!?])", r"\1", " ".join(_MARKER.sub(" ", sentence).split()))


@dataclass
class SentenceSupport:
    text: str
    sources: list[int]  # supporting source numbers, best first
    scores: dict[int, float]  # similarity to each supporting source
    written: list[int]  # markers the model wrote
    invalid: list[int] = field(default_factory=list)  # markers naming no source sent
    unsupported: list[int] = field(default_factory=list)  # markers naming a source that does not support it
    block: int = 0  # paragraph (or code block) it belongs to
    overlaps: dict[int, float] = field(default_factory=dict)  # share of its content words in a span of each

    @property
    def flagged(self) -> bool:
        return not self.sources


@dataclass
class Attribution:
    sentences: list[SentenceSupport]

    @property
    def cited(self) -> list[int]:
        """Source numbers supporting at least one sentence, in order of first use."""
        seen: list[int] = []
        for s in self.sentences:
            for n in s.sources:
                if n not in seen:
                    seen.append(n)
        return seen

    @property
    def flagged(self) -> list[str]:
        return [s.text for s in self.sentences if s.flagged]


def attribute(
    answer: str,
    sources: list[Source],
    embedder: Embeds,
    threshold: float = 0.3,
    marker_threshold: float = 0.3,
    source_vectors: np.ndarray | None = None,
    min_overlap: float = 0.65,
) -> Attribution:
    blocks = split_blocks(answer)
    sentences = [sentence for block in blocks for sentence in block]
    block_of = [i for i, block in enumerate(blocks) for _ in block]
    if not sentences:
        return Attribution([])
    numbers = [s.n for s in sources]
    if source_vectors is None:
        source_vectors = embedder.embed([s.text for s in sources]) if sources else np.zeros((0, 1), np.float32)
    plain = [strip_markers(s) or s for s in sentences]
    vectors = embedder.embed(plain)
    sims = vectors @ source_vectors.T if len(sources) else np.zeros((len(sentences), 0), np.float32)
    out = []
    for i, sentence in enumerate(sentences):
        written = markers(sentence)
        invalid = [n for n in written if n not in numbers]
        score = {n: float(sims[i, j]) for j, n in enumerate(numbers)}
        terms = content_terms(plain[i])
        # overlap is the costlier check: only for sources similar enough to matter
        shared = {s.n: overlap(terms, s.text) for s in sources if score[s.n] >= min(threshold, marker_threshold)}
        evident = {n for n, share in shared.items() if share >= min_overlap}
        kept = [n for n in written if n in evident and score[n] >= marker_threshold]
        unsupported = [n for n in written if n in score and n not in kept]
        by_evidence = [n for n in evident if score[n] >= threshold]
        support = sorted(set(kept) | set(by_evidence), key=lambda n: -score[n])
        out.append(SentenceSupport(sentence, support, {n: round(score[n], 4) for n in support}, written, invalid,
                                   unsupported, block_of[i], {n: round(shared[n], 4) for n in support}))  # fmt: skip
    return Attribution(out)
