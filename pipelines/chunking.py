"""Chunking that is stable under local edits.

A document is split on structure (headings, paragraphs, then sentences, then word
windows for run-on text) into *units*, and units are packed into chunks of at most
``max_tokens`` tokens, measured with the embedder's own tokenizer.

Packing greedily from the top would be unstable: inserting a paragraph near the start
would shift every later boundary and re-embed the whole document. Instead, the units are
first cut into *segments* at content-defined points: before every heading, and after a
unit with a probability proportional to its size (``tokens / target``, decided by a hash
of that unit's text alone, so the same unit always decides the same way). Segments average
``target`` tokens (half the budget). Each segment is then packed greedily into chunks of at
most the budget, independently of every other segment. An edit therefore changes the
chunks of the segment it falls in (plus the next chunk's overlap), and no others.

Each chunk after the first starts with the last sentence of the previous chunk when that
sentence is short (``overlap_tokens``), so a thought split across a boundary is found
from either side.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

TokenCounter = Callable[[Sequence[str]], list[int]]

_BLANK_LINES = re.compile(r"\n[ \t]*\n+")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])")
_RST_UNDERLINE = re.compile(r"^([=\-~^\"'*+#`:.])\1{2,}\s*$")
_MD_HEADING = re.compile(r"^#{1,6}\s+\S")


@dataclass(frozen=True)
class Chunk:
    index: int
    text: str
    content_hash: str
    token_count: int


@dataclass(frozen=True)
class _Unit:
    text: str
    tokens: int
    heading: bool


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def is_heading(block: str) -> bool:
    """A Markdown ``# heading`` line or a reST title (underlined, optionally overlined)."""
    lines = [ln for ln in block.strip("\n").split("\n") if ln.strip()]
    if len(lines) == 1:
        return bool(_MD_HEADING.match(lines[0]))
    if len(lines) == 2:
        return bool(_RST_UNDERLINE.match(lines[1])) and len(lines[0]) <= 200
    if len(lines) == 3:
        return bool(_RST_UNDERLINE.match(lines[0]) and _RST_UNDERLINE.match(lines[2]))
    return False


class Chunker:
    """Split documents into token-bounded, edit-stable chunks.

    >>> from serving.fake_embedder import FakeEmbedder
    >>> chunker = Chunker(FakeEmbedder().count_tokens, max_tokens=40)
    >>> [c.index for c in chunker.chunk("One paragraph.\\n\\nAnother one.")]
    [0]
    """

    def __init__(
        self,
        count_tokens: TokenCounter,
        max_tokens: int = 200,
        overlap_tokens: int = 32,
    ) -> None:
        if max_tokens < 16:
            raise ValueError("max_tokens must be at least 16.")
        if not 0 <= overlap_tokens < max_tokens // 2:
            raise ValueError("overlap_tokens must be between 0 and max_tokens / 2.")
        self.count_tokens = count_tokens
        self.max_tokens = max_tokens
        self.overlap_tokens = overlap_tokens
        #: mean segment size in tokens: small enough that segments rarely need splitting
        self.target_tokens = (max_tokens - overlap_tokens) // 2

    def chunk(self, text: str) -> list[Chunk]:
        units = self._units(text)
        if not units:
            return []
        groups = self._pack(units)
        bodies = ["\n\n".join(u.text for u in g) for g in groups]
        overlaps = [""] + [self._overlap(g) for g in groups[:-1]]
        counts = self.count_tokens([o for o in overlaps if o]) if self.overlap_tokens else []
        texts: list[str] = []
        tokens: list[int] = []
        it = iter(counts)
        for body, group, overlap in zip(bodies, groups, overlaps, strict=True):
            size = sum(u.tokens for u in group)
            if overlap:
                n = next(it)
                if n <= self.overlap_tokens and n + size <= self.max_tokens:
                    body = f"{overlap}\n\n{body}"
                    size += n
            texts.append(body)
            tokens.append(size)
        return [Chunk(i, t, content_hash(t), n) for i, (t, n) in enumerate(zip(texts, tokens, strict=True))]

    # -- splitting -------------------------------------------------------------------

    def _units(self, text: str) -> list[_Unit]:
        blocks = [b.strip() for b in _BLANK_LINES.split(text.replace("\r\n", "\n"))]
        blocks = [b for b in blocks if b]
        if not blocks:
            return []
        counts = self.count_tokens(blocks)
        units: list[_Unit] = []
        for block, n in zip(blocks, counts, strict=True):
            if n <= self.max_tokens:
                units.append(_Unit(block, n, is_heading(block)))
            else:
                units.extend(self._split_long(block))
        return units

    def _split_long(self, block: str) -> list[_Unit]:
        sentences = [s.strip() for s in _SENTENCE_END.split(block) if s.strip()]
        counts = self.count_tokens(sentences)
        units: list[_Unit] = []
        for sentence, n in zip(sentences, counts, strict=True):
            if n <= self.max_tokens:
                units.append(_Unit(sentence, n, False))
            else:
                units.extend(self._split_words(sentence))
        return units

    def _split_words(self, sentence: str) -> list[_Unit]:
        """Run-on text: windows of words, each under the budget (measured, then shrunk)."""
        words = sentence.split()
        units: list[_Unit] = []
        start = 0
        step = max(1, self.max_tokens // 2)
        while start < len(words):
            size = min(step, len(words) - start)
            while True:
                piece = " ".join(words[start : start + size])
                n = self.count_tokens([piece])[0]
                if n <= self.max_tokens or size == 1:
                    break
                size = max(1, size * self.max_tokens // (n + 1))
            if n > self.max_tokens:  # a single "word" longer than the budget: cut by characters
                piece = piece[: self.max_tokens * 2]
                n = self.count_tokens([piece])[0]
            units.append(_Unit(piece, n, False))
            start += size
        return units

    # -- packing ---------------------------------------------------------------------

    def _ends_segment(self, unit: _Unit) -> bool:
        """Stateless: a hash of the unit's text, compared with its share of the target."""
        digest = hashlib.blake2b(unit.text.encode("utf-8"), digest_size=8).digest()
        draw = int.from_bytes(digest, "big") / 2**64
        return draw < unit.tokens / self.target_tokens

    def _segments(self, units: list[_Unit]) -> list[list[_Unit]]:
        segments: list[list[_Unit]] = []
        current: list[_Unit] = []
        for unit in units:
            if current and unit.heading:
                segments.append(current)
                current = []
            current.append(unit)
            if not unit.heading and self._ends_segment(unit):
                segments.append(current)
                current = []
        if current:
            segments.append(current)
        return segments

    def _pack(self, units: list[_Unit]) -> list[list[_Unit]]:
        budget = self.max_tokens - self.overlap_tokens
        groups: list[list[_Unit]] = []
        for segment in self._segments(units):
            current: list[_Unit] = []
            size = 0
            for unit in segment:
                if current and size + unit.tokens > budget:
                    groups.append(current)
                    current, size = [], 0
                current.append(unit)
                size += unit.tokens
            groups.append(current)
        return groups

    def _overlap(self, group: list[_Unit]) -> str:
        last = group[-1]
        if last.heading or not self.overlap_tokens:
            return ""
        sentences = [s.strip() for s in _SENTENCE_END.split(last.text) if s.strip()]
        if len(group) == 1 and len(sentences) <= 1:
            return ""  # the whole previous chunk: repeating it adds nothing
        return sentences[-1] if sentences else ""
