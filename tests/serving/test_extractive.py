"""Extractive answers: verbatim sentence spans, scored against the question."""

from __future__ import annotations

import numpy as np

from serving.extractive import extract, sentence_spans
from serving.fake_embedder import FakeEmbedder

DOC = """# Why are default values shared between objects?

Default values are created exactly once, when the function is defined. If that object is
changed, like a dictionary appended to, subsequent calls see the changed object.
- Use None as the default ("no value given").
- Then create a new list inside the function.

```python
def f(x=None):
    x = [] if x is None else x
```
A trailing sentence without a full stop"""


def test_spans_are_verbatim_sentences_items_and_whole_code_blocks() -> None:
    spans = sentence_spans(DOC)
    texts = [DOC[s.start : s.end] for s in spans]
    assert [s.kind for s in spans] == ["heading", "text", "text", "text", "text", "code", "text"]
    assert texts[1] == "Default values are created exactly once, when the function is defined."
    assert texts[2].startswith("If that object is\nchanged") and texts[2].endswith("changed object.")
    assert texts[3] == '- Use None as the default ("no value given").'
    assert texts[5].startswith("```python") and texts[5].endswith("```")
    assert texts[6] == "A trailing sentence without a full stop"
    assert all(t == t.strip() and t for t in texts)


def test_the_best_sentences_are_picked_in_reading_order_without_repeats() -> None:
    embedder = FakeEmbedder(dim=64)
    other = "Glaciers are slow rivers of ice. Default values are created exactly once, when the function is defined."
    sources = [(1, DOC), (2, other)]
    question = embedder.embed(["when are default values created"])[0]
    found = extract(question, sources, embedder, limit=3, window=1.0)
    assert found and all(dict(sources)[e.n][e.start : e.end] == e.text for e in found)
    texts = [e.text for e in found]
    assert texts.count("Default values are created exactly once, when the function is defined.") == 1  # no repeat
    assert all(not t.startswith("#") for t in texts)  # headings are not answers
    assert [(e.n, e.start) for e in found] == sorted((e.n, e.start) for e in found)
    best = max(found, key=lambda e: e.score)
    assert "created exactly once" in best.text
    # Only spans close to the best one's score are kept.
    assert len(extract(question, sources, embedder, limit=3, window=0.0)) == 1
    assert extract(question, [], embedder) == [] and extract(np.zeros(64, np.float32), [(1, "")], embedder) == []


REST = """Why are default values shared between objects?
----------------------------------------------

This type of bug commonly bites neophyte programmers.  Consider this function::

def foo(mydict={}):  # Danger: shared reference to one dict for all calls
       ... compute something ...
       return mydict

>>> f.readline()
   'This is the first line of the file.\\n'

For reading lines from a file, you can loop over the file object. This is memory
efficient.

.. _faq-cache-method-calls:

Lambda Expressions
------------------
Small anonymous functions can be created with the lambda keyword."""


def test_rest_titles_literal_blocks_and_doctests_are_not_prose() -> None:
    spans = sentence_spans(REST)
    kinds = [(s.kind, REST[s.start : s.end].split("\n")[0]) for s in spans]
    assert kinds == [
        ("heading", "Why are default values shared between objects?"),
        ("text", "This type of bug commonly bites neophyte programmers."),
        ("text", "Consider this function::"),
        ("code", "def foo(mydict={}):  # Danger: shared reference to one dict for all calls"),
        ("code", ">>> f.readline()"),
        ("text", "For reading lines from a file, you can loop over the file object."),
        ("text", "This is memory"),
        ("markup", ".. _faq-cache-method-calls:"),
        ("heading", "Lambda Expressions"),
        ("text", "Small anonymous functions can be created with the lambda keyword."),
    ], kinds
    embedder = FakeEmbedder(dim=64)
    found = extract(embedder.embed(["why are default values shared between objects"])[0], [(1, REST)], embedder)
    assert found and all(e.text == REST[e.start : e.end] and not e.text.startswith(("Why are", ">>>")) for e in found)


TABLES = """Each table below maps a name to its meaning.

+--------+----------------------+
| Name   | Meaning              |
+========+======================+
| ``?``  | a ternary operator   |
+--------+----------------------+

=====  =====
A      B
=====  =====

| Name | Meaning |
|------|---------|
| x    | the x   |

Static and class methods are defined like this::

    class C:
        @staticmethod
        def f(): ...

Merge them into an iterator of tuples and sort it::

    sorted(zip(a, b))
"""


def test_tables_and_lead_ins_are_not_quoted_alone() -> None:
    kinds = [(s.kind, TABLES[s.start : s.end].split("\n")[0]) for s in sentence_spans(TABLES)]
    assert [k for k, _ in kinds] == ["text", "table", "table", "table", "text", "code", "text", "code"], kinds
    embedder = FakeEmbedder(dim=64)
    question = embedder.embed(["how are static and class methods defined like this"])[0]
    quoted = [e.text for e in extract(question, [(1, TABLES)], embedder, limit=5, window=2.0)]
    # a lead-in that only points at what follows is left out; one that says something is kept
    assert "Merge them into an iterator of tuples and sort it::" in quoted
    assert not any("like this" in q or "|" in q or "+--" in q or "=====" in q for q in quoted), quoted


def test_a_question_is_not_quoted_as_an_answer() -> None:
    text = (
        'See also "Why is Python Installed on my Computer?" in the FAQ. '
        "Python is named after Monty Python's Flying Circus. "
        "Is it named after the snake? "
        "It is not named after the snake."
    )
    embedder = FakeEmbedder(dim=64)
    question = embedder.embed(["why is Python named after the snake"])[0]
    quoted = [e.text for e in extract(question, [(1, text)], embedder, limit=5, window=2.0)]
    assert all(not q.endswith("?") for q in quoted), quoted
    # a sentence that only mentions a question, and the answer, are quoted
    assert 'See also "Why is Python Installed on my Computer?" in the FAQ.' in quoted
    assert "It is not named after the snake." in quoted
