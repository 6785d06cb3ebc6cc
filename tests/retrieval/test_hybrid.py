"""Keyword and hybrid search: the keyword index beside the shards, kept fresh by the tail.

The fake embedder's vectors share nothing between texts without common words, so a word
found here was found by the keyword index, not by luck of the dense path.
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import tantivy

from indexing.ivf import BuildOptions, build_index
from indexing.keyword import (
    KeywordIndex,
    defined_names,
    document,
    identifier_query,
    index_key,
    pristine_name,
    query_names,
    terms,
)
from indexing.manifest import ManifestError, load_manifest, publish
from indexing.reader import Hit
from indexing.snapshot import plan
from indexing.store import LocalStore
from pipelines.storage import ObjectStoreSettings
from retrieval import engine as engine_module
from retrieval.acl import ANONYMOUS, Principal
from retrieval.cache import ShardCache
from retrieval.engine import SearchEngine
from retrieval.errors import SearchError
from retrieval.filters import MetadataFilter
from retrieval.keyword import KeywordCopies
from retrieval.ranking import Ranking, index_keys, tail_keys
from retrieval.views import FUSION_WEIGHTS, EngineOptions, fusion_options
from serving.fake_embedder import FakeEmbedder
from tests.retrieval.lakes import Doc, DocLake

OPTS = BuildOptions(nlist=8, iterations=5, shard_bytes=8_000, progress=False, reuse_centroids=True)
HR = Principal("hana", frozenset({"hr"}))
#: reciprocal rank fusion's keyword weights (chosen by benchmarks/quality.py): a plain sentence's,
#: a sentence's that holds a code-like token (os.replace), an identifier's
RRF = FUSION_WEIGHTS["rrf"]
KEYWORD, CODE, IDENTIFIER = RRF["keyword_weight"], RRF["code_weight"], RRF["identifier_weight"]


def corpus(n: int = 200, seed: int = 0) -> list[Doc]:
    rng = random.Random(seed)
    docs = []
    for pk in range(n):
        text = f"note {pk} " + " ".join(f"w{rng.randrange(300)}" for _ in range(8))
        docs.append(Doc(pk, text, ("hr",) if pk % 10 == 0 else ()))
    return docs


def build(lake: DocLake, index: Path, **changes: object) -> int:
    store = LocalStore(str(index))
    opts = dataclasses.replace(OPTS, **changes)  # type: ignore[arg-type]
    return publish(store, build_index(plan(lake.lake), store.root, ObjectStoreSettings(), opts))


def engine_for(lake: DocLake, index: Path, cache: Path | None = None, **options: object) -> SearchEngine:
    engine = SearchEngine(
        lake.lake, LocalStore(str(index)), lake.embedder, ShardCache(cache) if cache else None,
        EngineOptions(nprobe=2, **options),  # type: ignore[arg-type]
    )  # fmt: skip
    engine.start(background=False)
    return engine


@pytest.fixture(params=["flat", "sq8"])
def setup(request: pytest.FixtureRequest, tmp_path: Path, ray_local: None):  # type: ignore[no-untyped-def]
    lake = DocLake(str(tmp_path / "lake"), FakeEmbedder(dim=32))
    docs = corpus()
    docs[42] = Doc(42, "how to call os.replace with dirs_exist_ok set")
    docs[50] = Doc(50, "the EAGAIN payroll secret", ("hr",))
    lake.write(docs)
    build(lake, tmp_path / "index", codec=request.param)
    return engine_for(lake, tmp_path / "index"), lake, docs


def ids(result) -> list[str]:  # type: ignore[no-untyped-def]
    return [r["chunk_id"] for r in result.results]


def test_queries_are_tokenised_like_documents_and_never_parsed() -> None:
    assert terms("os.replace(dirs_exist_ok=True)") == ["os", "replac", "dir", "exist", "ok", "true"]
    assert terms('title:"x" AND -y (z') == ["titl", "x", "and", "y", "z"]  # no field, phrase or boolean syntax
    assert terms("?!") == []


def test_the_query_analyser_agrees_with_the_fields_tokenizer(tmp_path: Path) -> None:
    """Documents are tokenised by tantivy's built-in en_stem, queries by our rebuilt copy of it."""
    index = KeywordIndex(tmp_path, create=True)
    text = "Running os.replace(dirs_exist_ok=True) FAILED with EAGAIN; Ünïcode naïve cafés 3.14 x" + "y" * 50
    index.add([document(7, "Titles Matter", text, None)])
    for term in terms(text) + terms("Titles Matter"):
        assert index.search([term], frozenset(), 5).keys.tolist() == [7], term
    assert len(index.search(["yyyy"], frozenset(), 5)) == 0  # a token over 40 bytes is dropped by both


def test_definitions_are_indexed_by_the_names_they_define() -> None:
    assert defined_names(".. function:: replace(src, dst)\n\n   Rename src.", ":mod:`os` --- OS") == [
        "os.replace",
        "replace",
    ]
    assert defined_names("   .. method:: IMAP4.read(size)", ":mod:`imaplib` --- IMAP4") == [
        "imaplib.imap4.read",
        "imap4.read",
        "read",
    ]
    assert defined_names(".. module:: os.path\n.. function:: join(a)", "whatever") == [
        "os.path", "path", "os.path.join", "path.join", "join",
    ]  # fmt: skip
    assert defined_names(".. cmdoption:: -u\n", ":mod:`sys`") == ["-u"]  # options are not qualified
    assert defined_names("async def fetch(url):\n    pass\nclass Pool:", "os.path — Paths") == [
        "os.path.fetch", "path.fetch", "fetch", "os.path.pool", "path.pool", "pool",
    ]  # fmt: skip
    assert defined_names("### `shutil.copytree(src, dst)`\nCopies.", None) == ["shutil.copytree", "copytree"]
    assert defined_names("It calls os.replace(src, dst) and def is a keyword.", ":mod:`os`") == []  # a mention


def test_looking_for_definitions_only_where_they_can_be_finds_what_every_pattern_finds() -> None:
    """``definitions`` skips a pattern when the text lacks a substring the pattern needs: on
    random texts made of definition-like pieces it must find exactly what running every
    pattern finds."""
    from indexing.keyword import _DEFINITIONS, definitions

    pieces = [".. function:: f(x)", "..  method:: g", ".. py:class:: C", "   .. data:: D", "def h():",
              "async  def i(", "class J:", "\tclass\tK", "# `l(", "### m.n(a)", "####### o(", "#p(", "de", "f",
              "cla", "ss ", "#", ".", ". ", "(", "`", " ", "\n", "\n  ", "text", "é", "_q", "r.s"]  # fmt: skip
    rng = random.Random(11)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        assert definitions(text) == [name for p in _DEFINITIONS for name in p.findall(text)], repr(text)


def test_a_query_is_an_identifier_when_it_is_a_name_not_a_sentence() -> None:
    assert query_names("os.replace") == ["os.replace", "replace"] and identifier_query("os.replace")
    assert query_names("EAGAIN") == ["eagain"] and identifier_query("EAGAIN")
    assert query_names("--user") == ["--user"] and identifier_query("dirs_exist_ok")
    assert identifier_query("shutil.copytree dirs_exist_ok") and not identifier_query("json loads")
    sentence = "How do I use os.path.join on Windows?"
    assert not identifier_query(sentence) and query_names(sentence) == ["os.path.join", "path.join", "join"]
    assert query_names("Why are default values shared?") == [] and query_names("floating-point") == []
    assert not identifier_query("?!") and query_names("?!") == []


def test_an_index_built_before_the_names_field_still_answers(tmp_path: Path) -> None:
    """Field ids are positional: ``names`` comes last, so an older index's fields keep theirs."""
    builder = tantivy.SchemaBuilder()
    for field in ("title", "text"):
        builder.add_text_field(field, tokenizer_name="en_stem", index_option="freq")
    for field in ("acl", "chunk"):
        builder.add_text_field(field, tokenizer_name="raw", index_option="basic")
    builder.add_unsigned_field("key", indexed=True, fast=True)
    tantivy.Index(builder.build(), path=str(tmp_path), reuse=False)
    old = KeywordIndex(tmp_path)
    assert not old.has_names
    old.add([document(1, None, ".. function:: replace(src)", ["hr"]), document(2, None, "replace it", None)])
    assert old.search(terms("os.replace"), frozenset(), 5, names=query_names("os.replace")).keys.tolist() == [2]
    assert set(old.search(terms("replace"), frozenset({"hr"}), 5).keys.tolist()) == {1, 2}


def test_a_definition_outranks_chunks_that_only_mention_its_name(tmp_path: Path, ray_local: None) -> None:
    lake = DocLake(str(tmp_path / "lake"), FakeEmbedder(dim=32))
    docs = corpus()
    definition = Doc(60, ".. module:: os\n\n.. function:: replace(src, dst)\n\n   Rename the file src to dst.")
    docs[60] = definition
    for pk in range(61, 70):  # mentions, each saying the name more often than the definition does
        docs[pk] = Doc(pk, f"see os.replace: os.replace and replace again, os.replace(a, b) {pk}")
    lake.write(docs)
    build(lake, tmp_path / "index")
    # reciprocal rank fusion: its scores show the weight each kind of query gave the keyword ranking
    engine = engine_for(lake, tmp_path / "index", **fusion_options("rrf"))
    assert ids(engine.search("os.replace", k=3, mode="keyword"))[0] == definition.chunk_id
    hybrid = engine.search("os.replace", k=10)  # an identifier: the keyword ranking weighs IDENTIFIER
    (top,) = [r for r in hybrid.results if r["chunk_id"] == definition.chunk_id]
    dense = top["retrievers"].get("dense")
    assert top["retrievers"]["keyword"]["rank"] == 1
    assert top["score"] == pytest.approx(IDENTIFIER / 11 + (1 / (10 + dense["rank"]) if dense else 0), abs=1e-6)
    sentence = engine.search("where is os.replace documented", k=50)  # a sentence naming code
    (top,) = [r for r in sentence.results if r["chunk_id"] == definition.chunk_id]
    dense, keyword = top["retrievers"].get("dense"), top["retrievers"]["keyword"]
    expected = CODE / (10 + keyword["rank"]) + (1 / (10 + dense["rank"]) if dense else 0)
    assert top["score"] == pytest.approx(expected, abs=1e-6)
    plain = engine.search("where is the replace function documented", k=50)  # no code-like token
    for r in plain.results:
        ranks = r["retrievers"]
        expected = (KEYWORD / (10 + ranks["keyword"]["rank"]) if "keyword" in ranks else 0) + (
            1 / (10 + ranks["dense"]["rank"]) if "dense" in ranks else 0
        )
        assert r["score"] == pytest.approx(expected, abs=1e-6)
    # a definition that arrives with the stream is found by its name at once; a hidden one is not
    fresh = Doc(70, ".. module:: shutil\n.. function:: copytree(src, dst, dirs_exist_ok=False)", ("hr",))
    lake.write([fresh])
    assert engine._tail is not None and engine._tail.poll()
    assert ids(engine.search("shutil.copytree", k=1, mode="keyword", principal=HR)) == [fresh.chunk_id]
    assert fresh.chunk_id not in ids(engine.search("shutil.copytree", k=50, mode="keyword"))
    assert fresh.chunk_id not in ids(engine.search("copytree", k=50))
    # deleted in the tail: its index row is superseded, by name as by text
    lake.write([definition], op="delete")
    engine._tail.poll()
    assert definition.chunk_id not in ids(engine.search("os.replace", k=50, mode="keyword"))
    engine.stop()


def test_keyword_finds_identifiers_with_lineage(setup) -> None:  # type: ignore[no-untyped-def]
    engine, _, docs = setup
    result = engine.search("os.replace", k=3, mode="keyword")
    assert result.mode == "keyword" and ids(result)[0] == docs[42].chunk_id
    top = result.results[0]
    assert top["origin"] == "index" and top["source"]["pk"] == "42" and top["retrievers"] == {"keyword": {"rank": 1}}
    assert [r["score"] for r in result.results] == [1 / n for n in range(1, len(result.results) + 1)]
    assert engine.search("zzz-unknown-word", k=3, mode="keyword").results == []


def test_hybrid_fuses_both_retrievers_and_says_which_found_each(setup) -> None:  # type: ignore[no-untyped-def]
    engine, _, docs = setup
    result = engine.search(docs[42].text, k=5)  # the default mode
    assert result.mode == "hybrid" and ids(result)[0] == docs[42].chunk_id
    assert set(result.results[0]["retrievers"]) == {"dense", "keyword"}
    ranks = result.results[0]["retrievers"]
    assert ranks["dense"]["rank"] == ranks["keyword"]["rank"] == 1
    # linear fusion (the default) shows each result's place, not its total (which carries BM25's)
    places = [1 / n for n in range(1, len(result.results) + 1)]
    assert [r["score"] for r in result.results] == pytest.approx(places, abs=1e-6)
    assert all("score" not in r["retrievers"].get("keyword", {}) for r in result.results)
    dense_only = engine.search(docs[42].text, k=5, mode="dense")
    assert dense_only.mode == "dense" and all(set(r["retrievers"]) == {"dense"} for r in dense_only.results)


def test_hybrid_fuses_the_keyword_rankings_own_depth_of_candidates(setup, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``--keyword-depth``: hybrid takes the keyword ranking's best max(k, depth) candidates (the
    floor of its min-max normalisation), whatever ``--fusion-depth`` takes from the dense one;
    keyword mode ranks k."""
    engine, _, _ = setup
    asked: list[int] = []
    real = engine_module.keyword_search

    def spy(*args: Any, **kwargs: Any) -> Ranking:
        asked.append(args[4])
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "keyword_search", spy)
    query = "note w1 w2 w3 w4 w5"
    for depth, k in ((3, 5), (8, 5), (8, 12), (100, 5)):
        engine.options = dataclasses.replace(engine.options, keyword_depth=depth, fusion_depth=50)
        result = engine.search(query, k=k)
        assert asked.pop() == max(k, depth)
        ranks = [r["retrievers"]["keyword"]["rank"] for r in result.results if "keyword" in r["retrievers"]]
        assert ranks and max(ranks) <= max(k, depth)
        assert len(result.results) == k
    engine.search(query, k=5, mode="keyword")
    assert asked == [5]


def tail_ranking(candidates: list[tuple[float, int]]) -> Ranking:
    """(score, tail row) pairs, best first, as a retriever's ranking."""
    return Ranking(np.array([c[0] for c in candidates]), tail_keys(np.array([c[1] for c in candidates])))


def test_fusion_keys_tell_index_rows_from_tail_rows_and_ties_go_to_the_dense_rank() -> None:
    engine = SearchEngine.__new__(SearchEngine)
    engine.options = EngineOptions(**fusion_options("rrf"), dense_weight=1.0, rrf_k=10)
    # shard 3's faiss id 7, shard 0's id 2**32 - 1 (the largest), tail rows 0 and 5
    index = index_keys(np.array([3, 0]), np.array([7, 2**32 - 1]))
    assert index.tolist() == [index_key(3, 7), index_key(0, 2**32 - 1)]  # the keyword documents' keys
    dense = Ranking(np.array([0.9, 0.8, 0.7]), np.concatenate([index, tail_keys(np.array([5]))]))
    keyword = Ranking(np.array([4.0, 3.0]), np.concatenate([index[:1], tail_keys(np.array([0]))]))
    # shard 0's id (dense's second) and tail row 0 (keyword's second) tie: the dense rank goes first
    picked = engine._fuse({"dense": dense, "keyword": keyword}, 4, 1.0)
    assert [(origin, ref) for _, origin, ref, _ in picked] == [
        ("index", Hit(3, 7, 0.0)), ("index", Hit(0, 2**32 - 1, 0.0)), ("tail", 0), ("tail", 5)]  # fmt: skip
    assert picked[1][0] == picked[2][0] == pytest.approx(1 / 12)
    assert picked[0][3] == {"dense": {"rank": 1, "score": 0.9}, "keyword": {"rank": 1}}
    assert picked[2][3] == {"keyword": {"rank": 2}}


def test_linear_fusion_adds_normalised_scores_and_shows_only_places() -> None:
    engine = SearchEngine.__new__(SearchEngine)
    engine.options = EngineOptions(**fusion_options("linear"))
    # tail rows 0-4; dense scores are cosines, keyword scores BM25's
    dense = tail_ranking([(0.9, 0), (0.8, 1), (0.5, 2)])
    keyword = tail_ranking([(12.0, 2), (9.0, 3), (3.0, 1)])
    picked = engine._fuse({"dense": dense, "keyword": keyword}, 4, 0.5)
    # min-max normalised: dense 1, 0.75, 0 (rows 0, 1, 2); keyword 1, 0.667, 0 (rows 2, 3, 1)
    totals = {0: 1.0, 1: 0.75 + 0.5 * 0.0, 2: 0.0 + 0.5 * 1.0, 3: 0.5 * (6 / 9)}
    assert [ref for _, _, ref, _ in picked] == sorted(totals, key=lambda row: -totals[row])
    assert [score for score, *_ in picked] == [1.0, 0.5, 1 / 3, 0.25]
    by_row = {ref: retrievers for _, _, ref, retrievers in picked}
    assert by_row[2] == {"dense": {"rank": 3, "score": 0.5}, "keyword": {"rank": 1}}
    # a heavier keyword ranking puts BM25's best first; one candidate in a ranking normalises to 1
    assert picked[0][2] == 0 and engine._fuse({"dense": dense, "keyword": keyword}, 1, 2.0)[0][2] == 2
    one_each = {"dense": dense.head(1), "keyword": tail_ranking([(3.0, 1)])}
    assert [ref for _, _, ref, _ in engine._fuse(one_each, 2, 0.5)] == [0, 1]


def test_feedback_moves_the_query_towards_the_best_chunks_the_caller_may_see(setup) -> None:  # type: ignore[no-untyped-def]
    # hybrid's dense candidates are ranked by the query plus 1.0 x the mean vector of the nearest
    # chunks (Rocchio): chunks the caller may see, never a hidden one
    engine, lake, _ = setup
    embed = lake.embedder.embed
    query = "zebra quokka alpha"
    hidden, best, next_best = (Doc(900, query, ("hr",)), Doc(901, "zebra quokka alpha gamma"),
                               Doc(902, "zebra beta gamma"))  # fmt: skip
    lake.write([hidden, best, next_best])
    engine._tail.poll()
    q = embed([query])[0]

    def check(principal: Principal, feedback: list[Doc]) -> dict[str, float]:
        """Each result's dense score is the one the query moved towards ``feedback`` gives it."""
        moved = q + engine.options.feedback_weight * embed([d.text for d in feedback]).mean(axis=0) if feedback else q
        moved /= np.linalg.norm(moved)
        found = engine.search(query, k=10, principal=principal, mode="hybrid")
        shown = {r["chunk_id"]: r["retrievers"]["dense"]["score"] for r in found.results if "dense" in r["retrievers"]}
        texts = {r["chunk_id"]: r["text"] for r in found.results}
        assert best.chunk_id in shown and next_best.chunk_id in shown
        assert shown == pytest.approx({c: float(embed([texts[c]])[0] @ moved) for c in shown}, abs=1e-4)
        return shown

    assert (engine.options.feedback_docs, engine.options.feedback_weight) == (1, 1.0)  # the defaults
    for docs in (1, 2, 0):
        engine.options = dataclasses.replace(engine.options, feedback_docs=docs)
        assert hidden.chunk_id not in check(ANONYMOUS, [best, next_best][:docs])
        assert hidden.chunk_id in check(HR, [hidden, best][:docs])
    # dense mode never moves the query
    assert engine.search(query, k=1, mode="dense", principal=HR).results[0]["score"] == pytest.approx(1.0, abs=1e-4)


def test_hybrid_queries_from_many_threads_answer_as_one_at_a_time(setup) -> None:  # type: ignore[no-untyped-def]
    # each hybrid query's keyword ranking runs on the engine's pool while its thread ranks by vector
    engine, _, docs = setup
    queries = [docs[i].text for i in range(0, 200, 5)] + ["os.replace", "EAGAIN payroll"]
    asks = [(q, p) for q in queries for p in (ANONYMOUS, HR)]

    def found(ask: tuple[str, Principal]) -> dict[str, dict[str, dict[str, float]]]:
        return {r["chunk_id"]: r["retrievers"] for r in engine.search(ask[0], k=5, principal=ask[1]).results}

    alone = [found(ask) for ask in asks]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(found, asks))
    for (query, _), one, other in zip(asks, together, alone, strict=True):
        # the fake embedder ties many dense scores, and faiss orders ties as it likes: the keyword
        # ranking (deterministic) and each chunk's dense score must match, and a note's own text
        # finds that note first
        assert len(one) == len(other) and one.keys() & other.keys()
        for chunk in one.keys() & other.keys():
            assert one[chunk].get("keyword") == other[chunk].get("keyword")
            assert one[chunk].get("dense", {}).get("score") == other[chunk].get("dense", {}).get("score")
        if query.startswith("note "):
            assert next(iter(one)) == next(iter(other))
    # a failing dense ranking fails the query (its keyword search has finished) and the next one works
    original = engine._dense
    engine._dense = lambda *args: (_ for _ in ()).throw(RuntimeError("shard read failed"))  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="shard read failed"):
        engine.search("os.replace", k=5)
    engine._dense = original  # type: ignore[method-assign]
    assert ids(engine.search("os.replace", k=1)) == [docs[42].chunk_id]


def test_acl_filters_inside_the_keyword_scan(setup) -> None:  # type: ignore[no-untyped-def]
    engine, lake, docs = setup
    for mode in ("keyword", "hybrid"):
        assert docs[50].chunk_id not in ids(engine.search("EAGAIN payroll", k=50, mode=mode))
        assert ids(engine.search("EAGAIN payroll", k=1, principal=HR, mode=mode)) == [docs[50].chunk_id]
    # 20 of 200 notes are HR's and every note says "note"
    hr = engine.search("note", k=100, principal=HR, mode="keyword")
    assert len(hr.results) == 100
    public = engine.search("note", k=100, mode="keyword")
    assert len(public.results) == 100 and not {d.chunk_id for d in docs if d.acl} & set(ids(public))
    # a group whose name is the public marker does not make a row public
    for group in ("public", "\x00public", "g:public"):
        lake.write([Doc(950, f"quasar memo for {group!r}", (group,))])
        engine._tail.poll()
        assert engine.search("quasar", k=5, mode="keyword").results == []
        member = Principal("m", frozenset({group}))
        assert ids(engine.search("quasar", k=5, principal=member, mode="keyword")) == [
            Doc(950, f"quasar memo for {group!r}", (group,)).chunk_id
        ]


def test_keyword_search_widens_until_k_pass_the_filters(setup) -> None:  # type: ignore[no-untyped-def]
    engine, lake, docs = setup
    deleted = [d for d in docs if not d.acl][:100]
    lake.write(deleted, op="delete")
    # 30 notes move to team ops (in the tail: their index copies are superseded)
    moved = [Doc(d.pk, d.text, d.acl, json.dumps({"team": "ops"})) for d in docs if not d.acl][100:130]
    lake.write(moved)
    engine._tail.poll()
    # 180 public notes, 100 deleted since the index: excluded inside the scan, all 80 others found
    found = engine.search("note", k=80, mode="keyword")
    assert len(found.results) == 80 and not {d.chunk_id for d in deleted} & set(ids(found))
    # a metadata filter rejects candidates after the scan: the first fetch (k + 16) holds
    # few of the 30 ops notes, and the search widens until it has 25
    ops = engine.search("note", k=25, mode="keyword", where=MetadataFilter.parse({"team": "ops"}))
    assert len(ops.results) == 25 and set(ids(ops)) <= {d.chunk_id for d in moved}


def test_the_tail_is_searchable_by_keyword_at_once_and_stale_copies_are_not(setup) -> None:  # type: ignore[no-untyped-def]
    engine, lake, docs = setup
    old = docs[42]
    new = Doc(42, "os.replace now documents xylophone behaviour")
    lake.write([old], op="delete")
    lake.write([new])
    lake.write([docs[7]], op="delete")
    lake.write([Doc(900, "a brand new quokka page")])
    assert engine._tail is not None and engine._tail.poll()
    found = engine.search("xylophone", k=3, mode="keyword")
    assert ids(found) == [new.chunk_id] and found.results[0]["origin"] == "tail"
    assert old.chunk_id not in ids(engine.search("dirs_exist_ok os.replace", k=50, mode="keyword"))
    assert docs[7].chunk_id not in ids(engine.search(docs[7].text, k=50, mode="keyword"))
    assert ids(engine.search("quokka", k=3, mode="hybrid"))[0] == Doc(900, "a brand new quokka page").chunk_id
    # the tail's rows score with the whole index's term statistics: a fresh row is not buried
    rewritten = engine.search("os.replace", k=1, mode="keyword")
    assert ids(rewritten) == [new.chunk_id]


def test_as_of_interleaved_with_live_keyword_queries(setup) -> None:  # type: ignore[no-untyped-def]
    engine, lake, _ = setup
    before = lake.write([Doc(300, "walrus memo v1")])
    engine._tail.poll()
    lake.write([Doc(300, "walrus memo v1")], op="delete")
    lake.write([Doc(300, "walrus memo v2", ("hr",))])
    engine._tail.poll()
    v1, v2 = Doc(300, "walrus memo v1").chunk_id, Doc(300, "walrus memo v2", ("hr",)).chunk_id
    for _ in range(2):  # as_of, live, as_of again: each sees its own version's rows
        assert ids(engine.search("walrus", k=5, as_of=before, mode="keyword")) == [v1]
        assert ids(engine.search("walrus", k=5, mode="keyword")) == []  # v2 is HR's
        assert ids(engine.search("walrus", k=5, principal=HR, mode="keyword")) == [v2]
        assert ids(engine.search("walrus", k=5, as_of=before - 1, mode="keyword")) == []


def test_a_snapshot_taken_before_an_update_keeps_the_index_row_it_had(setup) -> None:  # type: ignore[no-untyped-def]
    """The copy notes superseded index rows by the version that superseded them: a query that
    took its snapshot before the update (still running when the tail moved on) sees the old
    row, one after it sees only the new, and neither sees both or neither."""
    engine, lake, docs = setup
    old, new = docs[42], Doc(42, "os.replace now documents xylophone behaviour")
    held = engine.current_view()

    def held_search(query: str) -> list[str]:
        return ids(engine.search_view(held, query, None, 50, ANONYMOUS, False, None, "keyword"))

    assert old.chunk_id in held_search(old.text)
    lake.write([old], op="delete")  # an update, as the ingest job writes one: its old chunk goes
    lake.write([new])
    engine._tail.poll()
    assert ids(engine.search("xylophone", k=3, mode="keyword")) == [new.chunk_id]
    assert old.chunk_id in held_search(old.text) and held_search("xylophone") == []
    assert old.chunk_id not in ids(engine.search(old.text, k=50, mode="keyword"))


def test_incremental_versions_add_their_delta_rows_and_drop_their_dead_rows(tmp_path: Path, ray_local: None) -> None:
    lake = DocLake(str(tmp_path / "lake"), FakeEmbedder(dim=32))
    docs = corpus()
    lake.write(docs)
    build(lake, tmp_path / "index")
    lake.write([docs[3]], op="delete")
    lake.write([Doc(3, "narwhal rewritten note")])
    lake.write([docs[4]], op="delete")
    version = build(lake, tmp_path / "index")
    manifest = load_manifest(LocalStore(str(tmp_path / "index")), version)
    assert (
        manifest.stats["incremental"]
        and manifest.keyword == load_manifest(LocalStore(str(tmp_path / "index")), 1).keyword
    ), "an incremental version shares its base's keyword index"
    engine = engine_for(lake, tmp_path / "index")
    assert engine.current_view().tail.n == 0
    found = engine.search("narwhal", k=3, mode="keyword")
    assert ids(found) == [Doc(3, "narwhal rewritten note").chunk_id] and found.results[0]["origin"] == "index"
    for gone in (docs[3], docs[4]):
        assert gone.chunk_id not in ids(engine.search(gone.text, k=50, mode="keyword"))


def test_restart_reuses_fetched_files_and_a_corrupt_file_is_refused(tmp_path: Path, ray_local: None) -> None:
    lake = DocLake(str(tmp_path / "lake"), FakeEmbedder(dim=32))
    docs = corpus()
    lake.write(docs)
    build(lake, tmp_path / "index")
    kw = tmp_path / "kw"
    for _ in range(2):  # the second start finds the files on disk
        engine = engine_for(lake, tmp_path / "index", tmp_path / "cache", keyword_dir=str(kw))
        assert ids(engine.search(docs[9].text, k=1, mode="keyword")) == [docs[9].chunk_id]
        engine.stop()
    assert len(list(kw.glob("pristine-*"))) == 1
    assert not list(kw.glob("work-*")), "working copies are removed at stop"
    manifest = load_manifest(LocalStore(str(tmp_path / "index")))
    victim = max(manifest.keyword, key=lambda f: f.bytes)

    def corrupt(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))

    # a local file damaged between runs is noticed before use, and fetched again
    local = next(kw.glob("pristine-*")) / victim.key.rsplit("/", 1)[1]
    corrupt(local)
    engine = engine_for(lake, tmp_path / "index", tmp_path / "cache", keyword_dir=str(kw))
    assert ids(engine.search(docs[9].text, k=1, mode="keyword")) == [docs[9].chunk_id]
    assert local.read_bytes() == (tmp_path / "index" / victim.key).read_bytes()
    # a new version's files replace the old version's on disk
    lake.write([Doc(999, "an okapi")])
    build(lake, tmp_path / "index", reuse_centroids=False)
    assert engine.check_for_new_index()
    assert [p.name for p in kw.glob("pristine-*")] == [pristine_name(engine.current_view().reader.manifest.keyword)]
    assert ids(engine.search("okapi", k=1, mode="keyword")) == [Doc(999, "an okapi").chunk_id]
    engine.stop()
    # a damaged file in the store is refused: a fresh replica must fetch it
    corrupt(tmp_path / "index" / load_manifest(LocalStore(str(tmp_path / "index"))).keyword[0].key)
    with pytest.raises(ManifestError, match="checksum"):
        engine_for(lake, tmp_path / "index")


def test_modes_are_checked_and_old_versions_without_a_keyword_index_say_so(tmp_path: Path, ray_local: None) -> None:
    lake = DocLake(str(tmp_path / "lake"), FakeEmbedder(dim=32))
    docs = corpus(50)
    lake.write(docs)
    build(lake, tmp_path / "index", keyword=False)
    engine = engine_for(lake, tmp_path / "index")
    with pytest.raises(SearchError, match="mode must be one of") as bad:
        engine.search("x", mode="fuzzy")
    assert bad.value.status == 422
    with pytest.raises(SearchError, match="no keyword index") as old:
        engine.search("note", mode="keyword")
    assert old.value.status == 409
    fallback = engine.search(docs[1].text, k=1)  # hybrid by default: dense alone, and the result says so
    assert fallback.mode == "dense" and ids(fallback) == [docs[1].chunk_id]


def test_the_tail_thread_adds_new_rows_to_the_keyword_copy_before_a_query(tmp_path: Path, ray_local: None) -> None:
    lake = DocLake(str(tmp_path / "lake"), FakeEmbedder(dim=32))
    lake.write(corpus(50))
    build(lake, tmp_path / "index")
    engine = SearchEngine(lake.lake, LocalStore(str(tmp_path / "index")), lake.embedder, None,
                          EngineOptions(nprobe=2, tail_poll_s=0.05))  # fmt: skip
    engine.start(background=True)
    try:
        engine.search("note", k=1, mode="keyword")  # the live view's copy exists from here on
        view = engine.current_view()
        copy = engine.keywords.copy_for(view.reader, view.tail)
        lake.write([Doc(77, "a pangolin appears")])
        deadline = time.monotonic() + 20
        while copy.rows == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert copy.rows == 1, "the tail's thread did not add the new row"
        assert ids(engine.search("pangolin", k=1, mode="keyword")) == [Doc(77, "a pangolin appears").chunk_id]
    finally:
        engine.stop()


def test_a_keyword_query_opens_only_the_shards_of_its_results(tmp_path: Path, ray_local: None) -> None:
    """ACLs are filtered inside tantivy's scan and superseded rows by the keys the copy noted
    from the tail: no shard is opened to decide what a caller may see, only to read the
    results (a metadata filter needs them)."""
    lake = DocLake(str(tmp_path / "lake"), FakeEmbedder(dim=32))
    docs = corpus()
    lake.write(docs)
    build(lake, tmp_path / "index", nlist=32, shard_bytes=1_000)
    lake.write([docs[1]], op="delete")  # "note" matches every row; one is superseded, HR's are hidden
    engine = SearchEngine(lake.lake, LocalStore(str(tmp_path / "index")), lake.embedder, None,
                          EngineOptions(nprobe=2, prefetch=False))  # fmt: skip
    engine.start(background=False)
    view = engine.current_view()
    shards = len(view.reader.manifest.shards)
    result = engine.search("note", k=3, mode="keyword")
    opened = len(view.reader.source._shards)  # type: ignore[attr-defined]
    assert shards >= 10 and len(result.results) == 3 and 1 <= opened <= 3
    assert docs[1].chunk_id not in ids(engine.search("note", k=100, mode="keyword"))


def test_making_one_views_copy_does_not_block_another_views_queries(tmp_path: Path) -> None:
    """An ``as_of`` view of an older version fetches that version's keyword files: live
    queries must not wait for it (nor for each other), and one view's copy is made once."""
    copies = KeywordCopies(tmp_path)
    release = threading.Event()
    made: list[str] = []

    class Stub:
        def __init__(self, build: str) -> None:
            self.manifest = SimpleNamespace(build_id=build)

        def sync(self, tail: object) -> None:
            pass

    def make(reader: Stub, base_version: int) -> Stub:
        made.append(reader.manifest.build_id)
        if reader.manifest.build_id == "old":
            assert release.wait(30)
        return reader

    copies._make = make  # type: ignore[assignment,method-assign]

    class Log:  # a tail log: any object a weak reference can hold
        pass

    log = Log()
    tail = SimpleNamespace(log=log, n=0, base_version=0)
    old = threading.Thread(target=copies.copy_for, args=(Stub("old"), tail))
    twin = threading.Thread(target=copies.copy_for, args=(Stub("old"), tail))
    old.start()
    twin.start()
    copies.copy_for(Stub("new"), tail)  # type: ignore[arg-type]
    assert "new" in made and old.is_alive()  # made while "old" was being made
    copies.prepare(SimpleNamespace(manifest=SimpleNamespace(keyword=[])))  # type: ignore[arg-type]
    release.set()
    old.join(30)
    twin.join(30)
    assert sorted(made) == ["new", "old"]  # the twin waited for the first "old" copy


def test_keyword_copies_in_memory_while_they_fit_answer_like_copies_on_disk(tmp_path: Path, ray_local: None) -> None:
    """A replica keeps its keyword working copies in memory (a tmpfs: a tail update's commit
    skips the disk's fsync) while twice their size fits the budget, else on disk; both answer
    the same, before and after fresh updates, and a dropped copy gives its budget back."""
    import gc

    lake = DocLake(str(tmp_path / "lake"), FakeEmbedder(dim=32))
    docs = corpus()
    lake.write(docs)
    build(lake, tmp_path / "index")
    memory = tmp_path / "memory"  # stands for /dev/shm: placement and budget are what is tested
    memory.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = memory / f"streamrag-keyword-{dead.pid}-killed"  # a replica killed before it could close
    alive = memory / "streamrag-keyword-1-running"  # another live process's
    for path in (left, alive):
        (path / "copy").mkdir(parents=True)
    engines = {
        budget: SearchEngine(
            lake.lake,
            LocalStore(str(tmp_path / "index")),
            lake.embedder,
            None,
            EngineOptions(nprobe=2, keyword_dir=str(tmp_path / f"kw-{budget}"), keyword_memory_bytes=budget),
        )
        for budget in (0, 1 << 30)
    }
    engines[1 << 30].keywords._memory_dir = memory
    for engine in engines.values():
        engine.start(background=False)

    def answers(engine: SearchEngine) -> list[list[str]]:
        return [ids(engine.search(q, k=5, mode="keyword", principal=HR)) for q in ("note", "alpha", "w7 w12")]

    def where(engine: SearchEngine) -> Path:
        return engine.keywords.copy_for(engine.current_view().reader, engine.current_view().tail).index.path

    assert answers(engines[0]) == answers(engines[1 << 30])
    assert memory in where(engines[1 << 30]).parents and memory not in where(engines[0]).parents
    assert not left.exists() and alive.exists()  # a dead replica's memory is given back, no one else's
    held = engines[1 << 30].keywords.in_memory
    assert held > 0 and engines[0].keywords.in_memory == 0
    lake.write([Doc(3, "note alpha rewritten"), Doc(500, "a new note alpha")])
    lake.write([docs[5]], op="delete")
    for engine in engines.values():
        engine._tail.poll()  # type: ignore[union-attr]
    assert answers(engines[0]) == answers(engines[1 << 30])
    assert any(Doc(500, "a new note alpha").chunk_id in found for found in answers(engines[0]))

    small = KeywordCopies(tmp_path / "kw-small", memory_bytes=held // 2, memory_dir=memory)
    reader, tail = engines[0].current_view().reader, engines[0].current_view().tail
    assert memory not in small.copy_for(reader, tail).index.path.parents and small.in_memory == 0  # too big: disk

    copies = engines[1 << 30].keywords
    copies._copies.clear()  # the views drop their copies (an index swap does)
    gc.collect()
    assert copies.in_memory == 0
    for engine in engines.values():
        engine.stop()
    assert list(memory.iterdir()) == [alive]  # closing removes the copies in memory too


def test_a_query_of_an_up_to_date_copy_does_not_wait_for_a_commit(setup) -> None:  # type: ignore[no-untyped-def]
    """The tail's thread holds the copy's lock while it commits the next state's rows; queries
    of the published state must not queue behind it."""
    engine, lake, _ = setup
    lake.write([Doc(901, "a walrus in the tail")])
    assert engine._tail is not None and engine._tail.poll()
    assert engine.search("walrus", k=1, mode="keyword").results  # the copy is up to date
    view = engine.current_view()
    copy = engine.keywords.copy_for(view.reader, view.tail)
    done = threading.Event()
    with copy.lock:  # a commit in progress
        searcher = threading.Thread(target=lambda: (engine.search("walrus", k=1, mode="keyword"), done.set()))
        searcher.start()
        finished = done.wait(10)
    searcher.join()
    assert finished, "a keyword query waited for the copy's lock"


def test_the_keyword_build_makes_its_documents_with_the_collector_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A million documents set off collections that scanned every object of the build's
    process (1.9 of a 1M build's 47 CPU seconds): none while they are made, and the
    collector is back on after."""
    import gc

    import indexing.keyword as keyword

    seen: list[bool] = []
    make = keyword.shard_documents

    def watched(shard: int, ids):  # type: ignore[no-untyped-def]
        for doc in make(shard, ids):
            seen.append(gc.isenabled())
            yield doc

    monkeypatch.setattr(keyword, "shard_documents", watched)
    lake = DocLake(str(tmp_path / "lake"), FakeEmbedder(dim=32))
    lake.write(corpus())
    build(lake, tmp_path / "index", executor="local")
    assert len(seen) == 200 and not any(seen)
    assert gc.isenabled()


def test_a_documents_acl_terms_make_it_public_a_groups_or_nobodys(tmp_path: Path) -> None:
    index = KeywordIndex(tmp_path, create=True)
    index.add([
        document(1, None, "ledger", None),  # no ACL: public
        document(2, None, "ledger", []),  # empty: public
        document(3, None, "ledger", ["hr", None]),  # hr's (a null group grants nothing)
        document(4, None, "ledger", [None]),  # only null groups: nobody's
    ])  # fmt: skip
    assert set(index.search(terms("ledger"), frozenset(), 10).keys.tolist()) == {1, 2}
    assert set(index.search(terms("ledger"), frozenset({"hr"}), 10).keys.tolist()) == {1, 2, 3}
    assert set(index.search(terms("ledger"), frozenset({"hr", "None", ""}), 10).keys.tolist()) == {1, 2, 3}


def test_an_index_of_public_documents_only_searches_without_the_acl_filter_until_one_is_not(tmp_path: Path) -> None:
    # tantivy's block-max WAND works only without the filter: skipped while every document is public
    path = tmp_path / "copy"
    index = KeywordIndex(path, create=True)
    assert index.all_public  # empty
    index.add([document(i, None, f"ledger entry {i} " + "audit " * (i % 5), None) for i in range(40)])
    assert index.all_public
    unfiltered = index.search(terms("ledger audit"), frozenset(), 10)
    index._state = (index.searcher, False)  # as if it held a restricted document: the filter's answer
    filtered = index.search(terms("ledger audit"), frozenset(), 10)
    assert filtered.keys.tolist() == unfiltered.keys.tolist() and filtered.scores.tolist() == unfiltered.scores.tolist()
    index._state = (index.searcher, True)
    for acl in (["hr"], [None]):  # a group's, nobody's
        index.add([document(100, None, "ledger audit audit audit audit audit", acl)])
        assert not index.all_public
        assert 100 not in set(index.search(terms("ledger audit"), frozenset(), 50).keys.tolist())
        assert index.search(terms("ledger audit"), frozenset({"hr"}), 1).keys[0] == (100 if acl == ["hr"] else 4)
        index.add([document(101, None, "ledger", None)])  # public documents after it keep the filter on
        assert not index.all_public
        index.close()
        reopened = KeywordIndex(path)  # a copy opened from disk counts its documents
        assert not reopened.all_public
        assert 100 not in reopened.search(terms("ledger audit"), frozenset(), 50).keys.tolist()
        path = tmp_path / f"fresh-{acl[0]}"  # the next kind of document goes into an all-public copy
        index = KeywordIndex(path, create=True)
        index.add([document(i, None, f"ledger entry {i} " + "audit " * (i % 5), None) for i in range(40)])
    index.close()
    assert KeywordIndex(path).all_public
