from __future__ import annotations

import random

import pytest

from pipelines.chunking import Chunker, is_heading
from serving.fake_embedder import FakeEmbedder
from tests.corpus import paragraph


@pytest.fixture
def chunker() -> Chunker:
    return Chunker(FakeEmbedder().count_tokens, max_tokens=80, overlap_tokens=16)


def long_doc(seed: int, paragraphs: int = 30) -> list[str]:
    rng = random.Random(seed)
    return [paragraph(rng) for _ in range(paragraphs)]


def test_chunks_fit_the_budget_and_cover_the_text(chunker: Chunker) -> None:
    paras = long_doc(1)
    chunks = chunker.chunk("\n\n".join(paras))
    assert len(chunks) > 3
    for c in chunks:
        assert chunker.count_tokens([c.text])[0] <= chunker.max_tokens
        assert c.token_count <= chunker.max_tokens
    joined = "\n\n".join(c.text for c in chunks)
    for p in paras:
        assert p in joined or all(s in joined for s in p.split(". "))
    assert [c.index for c in chunks] == list(range(len(chunks)))


def test_chunking_is_deterministic(chunker: Chunker) -> None:
    text = "\n\n".join(long_doc(2))
    assert chunker.chunk(text) == chunker.chunk(text)


@pytest.mark.parametrize("seed", range(8))
def test_editing_one_paragraph_changes_only_nearby_chunks(chunker: Chunker, seed: int) -> None:
    rng = random.Random(seed + 1000)
    paras = long_doc(seed, 40)
    before = chunker.chunk("\n\n".join(paras))
    edited = list(paras)
    edited[rng.randrange(len(paras))] = paragraph(rng)
    after = chunker.chunk("\n\n".join(edited))
    old = {c.content_hash for c in before}
    changed = [c for c in after if c.content_hash not in old]
    # One paragraph is ~1/40 of the document: the chunks holding it (and at most the
    # neighbours whose overlap or boundary it moves) change, never most of the document.
    assert 1 <= len(changed) <= 3, (len(changed), len(after))


def test_inserting_a_paragraph_at_the_top_keeps_later_chunks(chunker: Chunker) -> None:
    paras = long_doc(3, 40)
    before = {c.content_hash for c in chunker.chunk("\n\n".join(paras))}
    after = chunker.chunk("\n\n".join([paragraph(random.Random(99)), *paras]))
    changed = [c for c in after if c.content_hash not in before]
    assert len(changed) <= 3 < len(after)


def test_headings_start_chunks() -> None:
    chunker = Chunker(FakeEmbedder().count_tokens, max_tokens=200, overlap_tokens=0)
    text = "Intro\n=====\n\nShort intro.\n\nUsage\n-----\n\nShort usage.\n\n# Markdown heading\n\nMore."
    chunks = chunker.chunk(text)
    assert [c.text.split("\n")[0] for c in chunks] == ["Intro", "Usage", "# Markdown heading"]
    assert is_heading("Title\n=====") and is_heading("# Title") and not is_heading("Just text.")


def test_run_on_text_is_split_by_words() -> None:
    chunker = Chunker(FakeEmbedder().count_tokens, max_tokens=32, overlap_tokens=0)
    text = " ".join(["word"] * 500)  # no sentence or paragraph breaks at all
    chunks = chunker.chunk(text)
    assert len(chunks) > 10
    assert all(chunker.count_tokens([c.text])[0] <= 32 for c in chunks)


def test_empty_text_has_no_chunks(chunker: Chunker) -> None:
    assert chunker.chunk("") == [] and chunker.chunk("\n\n  \n") == []


def test_real_tokenizer_budget(real_embedder) -> None:
    chunker = Chunker(real_embedder.count_tokens, max_tokens=120, overlap_tokens=20)
    chunks = chunker.chunk("\n\n".join(long_doc(5, 20)))
    assert all(real_embedder.count_tokens([c.text])[0] <= 120 for c in chunks)
