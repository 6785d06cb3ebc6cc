"""Citation parsing and attribution on fixed model outputs."""

from __future__ import annotations

import numpy as np
import pytest

from serving.citations import (
    attribute,
    content_terms,
    is_code,
    markers,
    overlap,
    split_blocks,
    split_sentences,
    strip_markers,
)
from serving.fake_embedder import FakeEmbedder
from serving.prompt import INSTRUCTIONS, Source, build_messages, prompt_hash

SOURCES = [
    Source(1, "Penguins", "Penguins are flightless seabirds that swim with their wings in cold southern oceans."),
    Source(2, "Espresso", "Espresso is coffee brewed by forcing hot water through finely ground coffee beans."),
    Source(3, "Volcano", "A volcano erupts lava ash and gases from a magma chamber below the crust."),
]


def test_sentences_keep_their_markers() -> None:
    text = "Penguins swim with wings [1]. Espresso uses hot water [2][3].\nIt is strong! Really? Yes 3.5 cups."
    assert split_sentences(text) == [
        "Penguins swim with wings [1].", "Espresso uses hot water [2][3].", "It is strong!", "Really?", "Yes 3.5 cups.",
    ]  # fmt: skip
    assert markers("a [2][3] b [1, 2] c [7; 2]") == [2, 3, 1, 7]
    assert markers("no markers here, [x] or [] either") == []
    assert strip_markers("Espresso uses hot water [2][3].") == "Espresso uses hot water."


def test_paragraphs_wrapped_lines_lists_and_code_blocks() -> None:
    text = (
        "You can read a file line by line, which is\nmemory efficient [1]. Like this:\n\n"
        "```python\nwith open(p) as f:\n    for line in f: [2]\n```\n"
        "- first item. Second sentence.\n- second item\n\nLast words"
    )
    blocks = split_blocks(text)
    assert blocks == [
        ["You can read a file line by line, which is memory efficient [1].", "Like this:"],
        ["```python\nwith open(p) as f:\n    for line in f: [2]\n```"],
        ["- first item.", "Second sentence."], ["- second item"], ["Last words"],
    ]  # fmt: skip
    assert is_code(blocks[1][0]) and not is_code(blocks[0][0])
    assert split_blocks("```\nunterminated\ncode") == [["```\nunterminated\ncode"]]


def test_correct_wrong_missing_and_invented_markers() -> None:
    answer = (
        "Penguins are flightless seabirds that swim with their wings [1]. "  # right
        "Espresso is coffee brewed by forcing hot water through finely ground beans [3]. "  # wrong number
        "A volcano erupts lava ash and gases from a magma chamber. "  # no marker
        "Penguins swim in cold southern oceans [9]. "  # marker naming no source
        "Bananas grow on tall herbs in tropical plantations [2]."  # unsupported
    )
    result = attribute(answer, SOURCES, FakeEmbedder(dim=256))
    s = result.sentences
    assert [x.sources[:1] for x in s[:4]] == [[1], [2], [3], [1]]
    assert s[1].unsupported == [3] and 3 not in s[1].sources
    assert s[3].invalid == [9]
    assert s[4].flagged and s[4].unsupported == [2]
    assert result.flagged == [s[4].text]
    assert result.cited == [1, 2, 3]


def test_no_sources_means_every_sentence_is_flagged() -> None:
    result = attribute("Anything at all [1].", [], FakeEmbedder(dim=64))
    assert result.sentences[0].flagged and result.sentences[0].invalid == [1]
    assert attribute("", SOURCES, FakeEmbedder(dim=64)).sentences == []


def test_prompt_puts_fixed_text_first_and_hashes_what_is_sent() -> None:
    messages = build_messages("  Do penguins fly? ", SOURCES[:2])
    assert messages[0] == {"role": "system", "content": INSTRUCTIONS}
    user = messages[1]["content"]
    assert user.startswith("Sources:\n\n[1] Penguins\n") and user.endswith("Question: Do penguins fly?")
    assert user.index("[1]") < user.index("[2]") < user.index("Question:")
    assert prompt_hash(messages) == prompt_hash(build_messages("Do penguins fly?", SOURCES[:2]))
    assert prompt_hash(messages) != prompt_hash(build_messages("Do penguins swim?", SOURCES[:2]))


@pytest.mark.parametrize("threshold", [0.5, 0.9])
def test_threshold_controls_support(threshold: float) -> None:
    answer = "Penguins are seabirds that swim."
    support = attribute(answer, SOURCES, FakeEmbedder(dim=256), threshold=threshold).sentences[0]
    assert support.flagged == (threshold == 0.9)


class Alike:
    """Every text embeds to the same vector: similarity says nothing, only the words can."""

    def embed(self, texts: list[str]) -> np.ndarray:
        return np.ones((len(texts), 4), np.float32) / 2.0


def test_similarity_alone_is_no_support_the_words_must_be_in_the_source() -> None:
    answer = (
        "Penguins are flightless seabirds that swim with their wings [1]. "  # the source says so
        "Penguins are mammals that live in deserts and migrate south [1]. "  # on topic, not said
        "Yes."  # nothing to check
    )
    said, invented, empty = attribute(answer, SOURCES, Alike()).sentences
    assert said.sources == [1] and said.written == [1] and said.overlaps == {1: 1.0}
    assert invented.flagged and invented.unsupported == [1] and invented.sources == []
    assert empty.flagged and content_terms("Yes.") == frozenset()
    loose = attribute(answer, SOURCES, Alike(), min_overlap=0.1).sentences[1]
    assert loose.sources == [1] and loose.unsupported == []


def test_overlap_is_found_within_one_span_of_the_source() -> None:
    source = (
        "Lists are mutable sequences. Tuples are immutable. Strings hold text. Sets hold unique items. "
        "Dictionaries map keys to values."
    )
    assert content_terms("The lists were mutating") == {"list", "mutat"}
    assert overlap(content_terms("Lists are mutable and tuples immutable."), source) == 1.0
    # words from the first and the fifth sentence are never within three consecutive sentences
    assert overlap(content_terms("Lists map keys."), source) == pytest.approx(2 / 3)
    assert overlap(frozenset(), source) == 0.0
