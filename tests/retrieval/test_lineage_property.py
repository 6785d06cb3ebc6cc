"""Lineage never reveals what its caller cannot see: a non-interference property test.

For random histories of chunk versions (inserts, updates, re-permissions, deletes, in any
order) and random answers that used them, every lineage query a caller makes against the
real lake must equal the same query against a lake holding only the versions that caller
may see, as if the hidden ones had never existed, and be a 404 in both or in neither.
Status, "current chunks", a chunk's newest version and an answer source's ``now`` are all
covered: any of them computed from a hidden row breaks the equality.
"""

from __future__ import annotations

import hashlib
import json
import random
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import write_deltalake
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipelines.lake import CHUNKS, CHUNKS_SCHEMA, Lake
from retrieval.acl import Principal, acl_mask
from retrieval.audit import ANSWERS, ANSWERS_SCHEMA, ensure_answers_table
from retrieval.errors import SearchError
from retrieval.lineage import Lineage

GROUPS = ["a", "b", "c"]
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def chunk_id(pk: int, text: int) -> str:
    return hashlib.sha256(f"{pk}:{text}".encode()).hexdigest()[:32]


def history(rng: random.Random, n: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        pk, text = rng.randrange(3), rng.randrange(3)
        acl = [] if rng.random() < 0.3 else sorted(rng.sample(GROUPS, rng.randint(1, 2)))
        op = "delete" if rng.random() < 0.25 else "upsert"
        rows.append({
            "chunk_id": chunk_id(pk, text), "doc_id": f"public.docs/{pk}", "source_table": "public.docs",
            "source_pk": str(pk), "position": f"pg:{100 + i:020d}", "op": op, "chunk_index": 0, "title": f"t{pk}",
            "text": f"text {pk}/{text}" if op == "upsert" else None, "content_hash": f"{pk}:{text}",
            "token_count": 3, "embedding": [0.0] * 4 if op == "upsert" else None, "model": "m",
            "acl": acl, "kafka_topic": "t", "kafka_partition": 0, "kafka_offset": i,
            "event_time": T0 + timedelta(seconds=i), "ingest_time": T0 + timedelta(seconds=i),
            "writer": "w", "writer_seq": i,
        })  # fmt: skip
    return rows


def answers(rng: random.Random, chunks: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    out = []
    upserts = [r for r in chunks if r["op"] == "upsert"]
    for i in range(n):
        used = rng.sample(upserts, min(len(upserts), rng.randint(1, 3)))
        sources = [
            {"n": j + 1, "chunk_id": r["chunk_id"], "doc_id": r["doc_id"], "source_table": r["source_table"],
             "source_pk": r["source_pk"], "position": r["position"], "kafka_topic": "t", "kafka_partition": 0,
             "kafka_offset": r["kafka_offset"], "lake_version": 0, "origin": "tail", "score": 0.5}
            for j, r in enumerate(used)
        ]  # fmt: skip
        out.append({
            "answer_id": f"ans{i}", "time": T0 + timedelta(minutes=i), "principal": rng.choice(["p", "q"]),
            "groups": [], "question": f"q{i}", "status": "answered", "answer": "a", "raw_answer": "a",
            "sources": sources, "citations": [{"n": 1, "chunk_id": s["chunk_id"], "support": 0.9} for s in sources[:1]],
            "sentences": "[]", "flagged_sentences": 0, "k": 3, "as_of": None, "lake_version": 0,
            "index_version": 1, "embedder": "m", "generator": "g", "generator_url": "u", "prompt_hash": "h",
            "streamed": False, "retrieve_ms": 1.0, "first_token_ms": 1.0, "total_ms": 1.0, "error": None,
        })  # fmt: skip
    return out


def make_lake(root: Path, chunks: list[dict[str, Any]], answer_rows: list[dict[str, Any]]) -> Lineage:
    lake = Lake.at(str(root))
    write_deltalake(lake.table_uri(CHUNKS), pa.Table.from_pylist(chunks, schema=CHUNKS_SCHEMA))
    ensure_answers_table(lake)
    if answer_rows:
        rows = pa.Table.from_pylist(answer_rows, schema=ANSWERS_SCHEMA)
        write_deltalake(lake.table_uri(ANSWERS), rows, mode="append")
    return Lineage(lake)


def outcome(lineage: Lineage, kind: str, params: tuple[str, ...], who: Principal) -> Any:
    try:
        return json.loads(json.dumps(getattr(lineage, kind)(*params, who), default=str))
    except SearchError as exc:
        assert exc.status == 404
        return "404"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), n=st.integers(1, 14), groups=st.frozensets(st.sampled_from(GROUPS), max_size=2))
def test_lineage_is_what_a_lake_without_the_hidden_versions_would_say(
    seed: int, n: int, groups: frozenset[str]
) -> None:
    rng = random.Random(seed)
    chunks = history(rng, n)
    answer_rows = answers(rng, chunks, 3)
    who = Principal("p", groups)
    table = pa.Table.from_pylist(chunks, schema=CHUNKS_SCHEMA)
    visible = [r for r, ok in zip(chunks, acl_mask(table.column("acl"), groups), strict=True) if ok]
    with tempfile.TemporaryDirectory() as tmp:
        real = make_lake(Path(tmp) / "real", chunks, answer_rows)
        seen = make_lake(Path(tmp) / "seen", visible, answer_rows) if visible else None
        queries: list[tuple[str, tuple[str, ...]]] = [("source", ("public.docs", str(pk))) for pk in range(3)]
        queries += [("chunk", (chunk_id(pk, t),)) for pk in range(3) for t in range(3)]
        queries += [("answer", (a["answer_id"],)) for a in answer_rows]
        for kind, params in queries:
            got = outcome(real, kind, params, who)
            if seen is None:  # nothing visible at all: every chunk and source query is a 404
                if kind != "answer":
                    assert got == "404", (kind, params)
                continue
            expected = outcome(seen, kind, params, who)
            assert got == expected, f"{kind}{params} as {sorted(groups)} depends on hidden versions"


@pytest.fixture
def restricted(tmp_path: Path) -> Lineage:
    """Document 0: public at first, then restricted to 'hr', then deleted (as 'hr')."""
    rows = history(random.Random(0), 0)
    for i, (op, acl) in enumerate((("upsert", []), ("upsert", ["hr"]), ("delete", ["hr"]))):
        rows.append({
            "chunk_id": chunk_id(0, 0), "doc_id": "public.docs/0", "source_table": "public.docs", "source_pk": "0",
            "position": f"pg:{100 + i:020d}", "op": op, "chunk_index": 0, "title": "t", "text": "x" if op == "upsert"
            else None, "content_hash": "h", "token_count": 1, "embedding": [0.0] * 4 if op == "upsert" else None,
            "model": "m", "acl": acl, "kafka_topic": "t", "kafka_partition": 0, "kafka_offset": i,
            "event_time": T0, "ingest_time": T0 + timedelta(seconds=i), "writer": "w", "writer_seq": i,
        })  # fmt: skip
    answer_rows = answers(random.Random(1), rows[:1], 1)
    answer_rows[0]["principal"] = "p"
    return make_lake(tmp_path, rows, answer_rows)


def test_a_visible_old_version_does_not_betray_its_hidden_successors(restricted: Lineage) -> None:
    outsider, hr = Principal("p", frozenset()), Principal("p", frozenset({"hr"}))
    source = restricted.source("public.docs", "0", outsider)
    assert source["status"] == "live" and len(source["chunk_versions"]) == 1
    assert restricted.chunk(chunk_id(0, 0), outsider)["status"] == "live"
    assert restricted.answer("ans0", outsider)["sources"][0]["now"] == "current"
    # Those who may see the later versions see the whole story.
    assert restricted.source("public.docs", "0", hr)["status"] == "deleted"
    assert restricted.answer("ans0", hr)["sources"][0]["now"] == "deleted"
