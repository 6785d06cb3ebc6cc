"""Contextual chunk vectors: the mix, which chunks an edit rewrites, and the rows the job writes."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from bytewax.testing import TestingSource, run_main

from indexing.ivf import BuildOptions, build_index
from indexing.manifest import publish
from indexing.snapshot import plan
from indexing.store import LocalStore
from pipelines.chunking import Chunker
from pipelines.context import (
    DEFAULT_WEIGHT,
    context_weight,
    contextual,
    contextual_documents,
    lake_weight,
    model_with_context,
    query_model,
)
from pipelines.docstate import apply_change
from pipelines.embedding import BatchEmbedder
from pipelines.flow import Runtime, build_flow
from pipelines.lake import CHUNKS, Lake, LakeError, current_chunks, models_in
from pipelines.records import DocUpdate
from pipelines.runner import prepare
from pipelines.storage import ObjectStoreSettings
from retrieval.cache import ShardCache
from retrieval.engine import SearchEngine
from retrieval.errors import SearchError
from retrieval.views import EngineOptions
from serving.fake_embedder import FakeEmbedder
from tests.corpus import make_corpus
from tests.oracle import assert_lake_matches
from tests.pipelines.test_docstate import doc, event
from tests.pipelines.test_flow import Published, messages, run, settings_for


@pytest.fixture
def chunker() -> Chunker:
    return Chunker(FakeEmbedder().count_tokens, max_tokens=80, overlap_tokens=16)


def unit(rng: np.random.Generator, n: int, dim: int = 8) -> np.ndarray:
    x = rng.normal(size=(n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_a_corpus_mixes_each_chunk_with_its_neighbours_in_its_own_document_only() -> None:
    v = unit(np.random.default_rng(0), 6)
    docs = ["a", "a", "a", "b", "c", "c"]
    mixed = contextual_documents(v, docs, 1.0)
    assert np.allclose(np.linalg.norm(mixed, axis=1), 1.0, atol=1e-6)
    assert np.allclose(mixed[0], contextual(v[0], [v[1]], 1.0))
    assert np.allclose(mixed[1], contextual(v[1], [v[0], v[2]], 1.0))
    assert np.allclose(mixed[2], contextual(v[2], [v[1]], 1.0))  # not b's chunk after it
    assert np.allclose(mixed[3], v[3])  # a document of one chunk keeps its vector
    assert np.allclose(mixed[4], contextual(v[4], [v[5]], 1.0))
    expected = v[1] + 1.0 * (v[0] + v[2]) / 2
    assert np.allclose(mixed[1], expected / np.linalg.norm(expected), atol=1e-6)
    assert contextual_documents(v, docs, 0.0) is v


def test_the_model_a_row_records_carries_the_weight_and_queries_use_the_model_alone() -> None:
    model = str(FakeEmbedder().identity)
    assert model_with_context(model, 0.0) == model and context_weight(model) == 0.0
    marked = model_with_context(model, 1.0)
    assert marked != model and query_model(marked) == model and context_weight(marked) == 1.0
    assert model_with_context(model, 0.5) != marked  # two weights never mix in one lake
    assert lake_weight([marked]) == 1.0 and lake_weight([model]) == 0.0
    assert lake_weight([]) is None and lake_weight([model, marked]) is None  # empty; mixed (refused later)
    assert lake_weight([model + "+context=x"]) is None


def test_with_context_an_edit_rewrites_the_changed_chunks_neighbours_with_their_neighbours(chunker: Chunker) -> None:
    paras = doc(3)
    state, first, _ = apply_change(None, event(10, "\n\n".join(paras)), chunker, context=True)
    assert state is not None and first is not None
    order = sorted(first.versions, key=lambda v: v.chunk_index)
    for at, v in enumerate(order):  # every chunk carries the chunks beside it
        assert v.neighbours == tuple((n.content_hash, n.text) for n in order[max(0, at - 1) : at + 2] if n is not v)

    paras[9] = "Entirely new words about lighthouses, tides and the keeper's log."
    plain, without, _ = apply_change(state, event(20, "\n\n".join(paras)), chunker)
    after, with_context, _ = apply_change(state, event(20, "\n\n".join(paras)), chunker, context=True)
    assert plain is not None and without is not None and after is not None and with_context is not None
    assert plain.chunks == after.chunks  # the same chunks, only more rows
    old = {h for _, h in state.chunks.values()}
    by_index = {index: chash for index, chash in after.chunks.values()}
    changed = {v.chunk_index for v in with_context.versions if v.op == "upsert" and v.content_hash not in old}
    assert changed
    near = {j for i in changed for j in (i - 1, i + 1) if j in by_index} - changed
    upserts = {v.chunk_index for v in with_context.versions if v.op == "upsert"}
    plain_upserts = {v.chunk_index for v in without.versions if v.op == "upsert"}
    assert near and near <= upserts and not near & plain_upserts  # only context made these rows
    assert upserts == plain_upserts | near
    for v in with_context.versions:
        if v.op == "upsert":
            assert [h for h, _ in v.neighbours] == [
                by_index[j] for j in (v.chunk_index - 1, v.chunk_index + 1) if j in by_index
            ]

    _, nothing, outcome = apply_change(after, event(30, "\n\n".join(paras)), chunker, context=True)
    assert nothing is None and outcome == "unchanged"


def test_the_job_writes_mixed_vectors_and_embeds_each_text_once(chunker: Chunker) -> None:
    fake = FakeEmbedder()
    paras = doc(4, 12)
    _, update, _ = apply_change(None, event(10, "\n\n".join(paras)), chunker, context=True)
    assert update is not None and len(update.versions) >= 3
    batch = BatchEmbedder(fake, context_weight=1.0)
    rows = batch.rows([update])
    assert set(rows.column("model").to_pylist()) == {model_with_context(str(fake.identity), 1.0)}
    assert sum(fake.batches) == len(update.versions)  # each chunk once, neighbours from the same batch
    got = np.array(rows.column("embedding").to_pylist(), dtype=np.float32)
    own = fake.embed([v.text for v in update.versions])
    raw = {v.content_hash: own[i] for i, v in enumerate(update.versions)}
    for i, v in enumerate(update.versions):
        expected = contextual(raw[v.content_hash], [raw[h] for h, _ in v.neighbours], 1.0)
        assert np.allclose(got[i], expected, atol=1e-6)
        assert not np.allclose(got[i], raw[v.content_hash], atol=1e-3)  # mixed: every chunk has a neighbour

    fake.batches.clear()
    batch.rows([update])
    assert fake.batches == []  # the raw vectors are cached, not the mixed ones: nothing embedded again

    paras[5] = "A paragraph about something else entirely, with no words in common."
    cold = BatchEmbedder(fake, context_weight=1.0)  # a restarted job: an empty cache
    _, edit, _ = apply_change(None, event(20, "\n\n".join(paras)), chunker, context=True)
    assert edit is not None
    one = random.Random(0).choice([v for v in edit.versions if v.neighbours])
    fake.batches.clear()
    row = cold.rows([DocUpdate(edit.doc_id, edit.kafka, edit.event_time_ms, (one,))])
    assert sum(fake.batches) == 1 + len(one.neighbours)  # its neighbours embedded for the mix
    mixed = np.array(row.column("embedding").to_pylist()[0], dtype=np.float32)
    neighbours = fake.embed([t for _, t in one.neighbours])
    assert np.allclose(mixed, contextual(fake.embed([one.text])[0], list(neighbours), 1.0), atol=1e-6)


@pytest.mark.parametrize("workers", [1, 2])
def test_after_inserts_edits_and_deletes_every_current_vector_mixes_its_current_neighbours(
    tmp_path: Path, workers: int
) -> None:
    """The dataflow over a corpus of edits: the lake's current rows are what the corpus says,
    and each one's vector is its chunk's mixed with the chunks beside it *now* (no row left
    with the vector of a neighbour that an edit replaced)."""
    corpus = make_corpus(seed=11 + workers)
    settings = prepare(settings_for(tmp_path, context_weight=1.0))
    embedder = FakeEmbedder()
    run(build_flow(settings, TestingSource(messages(tmp_path, corpus), batch_size=5), Published(), embedder), workers)
    lake = Lake.at(settings.lake)
    assert_lake_matches(lake, corpus, Runtime(settings, embedder).chunker)
    rows = current_chunks(lake, columns=["doc_id", "chunk_index", "text", "embedding", "model"]).to_pylist()
    rows.sort(key=lambda r: (r["doc_id"], r["chunk_index"]))
    assert {r["model"] for r in rows} == {model_with_context(str(embedder.identity), 1.0)}
    expected = contextual_documents(embedder.embed([r["text"] for r in rows]), [r["doc_id"] for r in rows], 1.0)
    got = np.array([r["embedding"] for r in rows], dtype=np.float32)
    stale = [r["doc_id"] for r, e, g in zip(rows, expected, got, strict=True) if not np.allclose(e, g, atol=1e-5)]
    assert stale == []
    assert len(lake.read(CHUNKS, columns=["op"])) > len(rows)  # edits happened

    with pytest.raises(LakeError, match=r"\+context="):  # the lake keeps its weight
        build_flow(prepare(settings_for(tmp_path, context_weight=0.5)), TestingSource([]), Published(), embedder)


def test_without_the_option_a_new_lake_gets_the_default_and_a_lake_keeps_its_weight(tmp_path: Path) -> None:
    embedder = FakeEmbedder()
    model = str(embedder.identity)
    corpus = make_corpus(seed=6, docs=4, updates=0, deletes=0)
    for lake, given, expected in (("new", None, DEFAULT_WEIGHT), ("plain", 0.0, 0.0), ("half", 0.5, 0.5)):
        settings = prepare(settings_for(tmp_path / lake, context_weight=given))
        run_main(build_flow(settings, TestingSource(messages(tmp_path, corpus)), Published(), embedder))
        assert models_in(Lake.at(settings.lake)) == {model_with_context(model, expected)}
        again = prepare(settings_for(tmp_path / lake))  # restarted without the option: the lake's weight
        assert Runtime(again, embedder).context_weight == expected
        build_flow(again, TestingSource([]), Published(), embedder)  # not refused


def test_a_contextual_lake_is_indexed_and_searched_with_the_model_alone(tmp_path: Path, ray_local: None) -> None:
    """The index records the lake's model with its weight; the service queries it with the
    embedder alone (the weight is no query model), and still refuses another model."""
    corpus = make_corpus(seed=5, docs=40)
    settings = prepare(settings_for(tmp_path, context_weight=1.0))
    embedder = FakeEmbedder()
    run_main(build_flow(settings, TestingSource(messages(tmp_path, corpus)), Published(), embedder))
    lake = Lake.at(settings.lake)
    store = LocalStore(str(tmp_path / "index"))
    opts = BuildOptions(nlist=4, iterations=3, progress=False)
    manifest = build_index(plan(lake), store.root, ObjectStoreSettings(), opts)
    publish(store, manifest)
    assert manifest.model == model_with_context(str(embedder.identity), 1.0) and manifest.dim == embedder.identity.dim
    engine = SearchEngine(lake, store, embedder, ShardCache(tmp_path / "cache"), EngineOptions(nprobe=4, mode="dense"))
    engine.start(background=False)
    rows = [
        r for r in current_chunks(lake, columns=["chunk_id", "text", "embedding", "acl"]).to_pylist() if not r["acl"]
    ]
    stored = np.array([r["embedding"] for r in rows], dtype=np.float32)
    try:
        for row in rows[:5]:  # every list probed: exactly the top 3 public rows by the stored (mixed) vectors
            scores = stored @ embedder.embed([row["text"]])[0]
            by_id = {r["chunk_id"]: float(x) for r, x in zip(rows, scores, strict=True)}
            found = engine.search(row["text"], k=3).results
            assert [r["score"] for r in found] == pytest.approx(sorted(scores, reverse=True)[:3], abs=1e-5)
            assert all(by_id[r["chunk_id"]] == pytest.approx(r["score"], abs=1e-5) for r in found)  # ties aside
    finally:
        engine.stop()
    with pytest.raises(SearchError, match=r"built from vectors of fake-hashing.*\+context=1"):
        SearchEngine(lake, store, FakeEmbedder(dim=16)).start(background=False)
