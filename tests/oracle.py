"""Compare a lake's current state with what a corpus says it must be."""

from __future__ import annotations

from collections import Counter

from pipelines.chunking import Chunker
from pipelines.lake import CHUNKS, DEAD_LETTERS, Lake, current_chunks
from tests.corpus import Corpus

DOC_PREFIX = "public.docs/"


def expected_state(corpus: Corpus, chunker: Chunker) -> set[tuple[str, str, str, tuple[str, ...]]]:
    out = set()
    for pk, (title, body, acl) in corpus.expected.items():
        for chunk in chunker.chunk(body):
            out.add((DOC_PREFIX + pk, title, chunk.text, acl))
    return out


def lake_state(lake: Lake) -> set[tuple[str, str, str, tuple[str, ...]]]:
    live = current_chunks(lake, columns=["doc_id", "title", "text", "acl"]).to_pylist()
    return {(r["doc_id"], r["title"], r["text"], tuple(r["acl"])) for r in live}


def duplicate_versions(lake: Lake) -> list[tuple[object, ...]]:
    rows = lake.read(CHUNKS, columns=["chunk_id", "position", "op"]).to_pylist()
    counts = Counter((r["chunk_id"], r["position"], r["op"]) for r in rows)
    dl = lake.read(DEAD_LETTERS, columns=["topic", "partition", "offset"]).to_pylist()
    counts.update(("dl", r["topic"], r["partition"], r["offset"]) for r in dl)
    return [k for k, n in counts.items() if n > 1]


def assert_lake_matches(lake: Lake, corpus: Corpus, chunker: Chunker) -> None:
    expected = expected_state(corpus, chunker)
    actual = lake_state(lake)
    missing, extra = expected - actual, actual - expected
    assert not missing and not extra, (
        f"{len(missing)} missing, {len(extra)} extra; e.g. missing {sorted(missing)[:1]} extra {sorted(extra)[:1]}"
    )
    assert duplicate_versions(lake) == []
    letters = lake.read(DEAD_LETTERS, columns=["error", "value"]).to_pylist()
    assert len(letters) == corpus.malformed, [r["error"] for r in letters]
    assert all(r["error"] and r["value"] for r in letters)
