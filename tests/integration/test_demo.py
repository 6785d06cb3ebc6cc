"""`streamrag demo` end to end on a small reST corpus shaped like the Python docs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.integration.helpers import cli

pytestmark = pytest.mark.integration

DOCS = {
    "faq/design": ("Design FAQ", "Why are default values shared between objects?",
                   "Default values are created exactly once, when the function is defined. If that object is "
                   "changed, like a dictionary, later calls see the changed object."),
    "faq/gui": ("GUI FAQ", "Which GUI toolkits exist for Python?",
                "Tkinter ships with Python. The internal GUI review board meets on Thursdays in room 4B."),
    "faq/windows": ("Windows FAQ", "How do I run a Python program under Windows?",
                    "Open a command prompt and type py followed by the script name. Staff laptops use the "
                    "internal launcher codenamed BLUEFALCON."),
    "glossary": ("Glossary", "lambda",
                 "An anonymous inline function consisting of a single expression which is evaluated when the "
                 "function is called. The syntax to create a lambda function is lambda parameters: expression."),
    "tutorial/inputoutput": ("Input and Output", "Reading and Writing Files",
                             "To read a file line by line, loop over the file object: for line in f: print(line). "
                             "This is memory efficient and fast. To decode JSON text, call json.loads(text)."),
    "tutorial/whatnow": ("What Now?", "Where to go next",
                         "Reading this tutorial has probably reinforced your interest in using Python. The "
                         "Python Package Index lists third-party modules."),
}  # fmt: skip


def write_corpus(root: Path) -> None:
    for doc_id, (title, question, answer) in DOCS.items():
        path = root / f"{doc_id}.rst.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{'=' * len(title)}\n{title}\n{'=' * len(title)}\n\n{question}\n{'-' * len(question)}\n\n"
                        f"{answer}\n")  # fmt: skip


def test_demo_shows_the_whole_story_and_exits_0(tmp_path: Path) -> None:
    write_corpus(tmp_path / "corpus")
    out = cli("demo", "--corpus", str(tmp_path / "corpus"), "--work", str(tmp_path / "work"),
              "--port", str(free_port()), "--max-tokens", "40", timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    for step in ("1. Start the dev broker", "2. Ingest", "3. Build the IVF index", "4. Ask questions",
                 "5. Search modes", "6. Live changes", "7. Lineage", "8. ACLs", "Summary"):  # fmt: skip
        assert step in text, f"missing step {step!r}:\n{text[-3000:]}"
    assert "6 documents" in text and "2 restricted to group 'staff': faq/gui, faq/windows" in text
    assert text.count("  Q: ") == 3 and text.count("answer id ") >= 3
    # the live changes are SQL statements against the demo's Postgres, through the Postgres source
    assert "table docs of Postgres on 127.0.0.1:" in text and "streamrag cdc postgres: snapshot" in text
    assert re.search(r"UPDATE docs … WHERE id = '\S+': the new sentence is found by search after \d+\.\d+ s", text)
    assert re.search(r"DELETE FROM docs WHERE id = '\S+': [1-9]\d* of its chunks were in the top 10, none after", text)
    assert re.search(r"INSERT INTO docs \('demo/streaming', …\): top search result after", text)
    assert "public.docs pk=" in text and "lake version" in text  # the lineage chain
    assert re.search(r"lineage explorer: http://127\.0\.0\.1:\d+/ui ", text) and "/ui/answers/" in text
    assert "none from faq/gui: True" in text and "HTTP 404" in text
    # the API name is searched in each mode: BM25 finds the one document that writes it
    assert "query 'json.loads' (mentioned only in tutorial/inputoutput)" in text
    assert re.search(r"keyword: tutorial/inputoutput(;|\n)", text)
    assert re.search(r"hybrid: .*\((dense #\d+, )?keyword #1", text)
    assert "room 4B" not in text.split("8. ACLs")[1]  # the restricted text never reaches alice
    freshness = r"freshness \(SQL COMMIT → visible in /v1/search\): update [\d.]+ s, delete [\d.]+ s, insert"
    assert re.search(freshness, text)
    assert "Traceback" not in out.stderr
