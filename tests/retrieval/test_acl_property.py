"""ACL property test: random documents, ACLs, later changes, principals and queries.

Invariants checked on every example, against an oracle computed from the lake itself:
- no result is a chunk its caller may not see (per the chunk's *current* ACL);
- visible matches are not lost to filtering: a caller who can see n chunks gets
  min(k, n) results (keyword search: n is the visible chunks holding a query word), and
  with every list probed the dense results are exactly the top-k of an exact search over
  the caller's visible set.

Every search mode (dense, keyword, hybrid) is held to the same invariants.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexing.ivf import BuildOptions, build_index
from indexing.manifest import publish
from indexing.snapshot import plan
from indexing.store import LocalStore
from pipelines.lake import current_chunks, embeddings
from pipelines.storage import ObjectStoreSettings
from retrieval.acl import Principal
from retrieval.engine import SearchEngine
from retrieval.views import MODES, EngineOptions
from serving.fake_embedder import FakeEmbedder
from tests.retrieval.lakes import Doc, DocLake

GROUPS = ["a", "b", "c", "d", "e"]


def random_acl(rng: random.Random) -> tuple[str, ...]:
    if rng.random() < 0.2:
        return ()
    return tuple(sorted(rng.sample(GROUPS, rng.randint(1, 2))))


@pytest.fixture(scope="module", params=["flat", "sq8", "sq8-incremental"])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, ray_local: None):  # type: ignore[no-untyped-def]
    """The same world indexed as float IVF, as range-read scalar-quantized lists, and as
    those lists built incrementally (shared shards with dead rows, plus a delta)."""
    tmp = tmp_path_factory.mktemp("acl")
    rng = random.Random(5)
    embedder = FakeEmbedder(dim=32)
    lake = DocLake(str(tmp / "lake"), embedder)
    docs = [Doc(pk, " ".join(f"w{rng.randrange(60)}" for _ in range(6)), random_acl(rng)) for pk in range(500)]
    lake.write(docs)
    store = LocalStore(str(tmp / "index"))
    codec, _, incremental = request.param.partition("-")
    opts = BuildOptions(nlist=20, iterations=5, shard_bytes=10_000, progress=False, codec=codec, reuse_centroids=True)
    publish(store, build_index(plan(lake.lake), store.root, ObjectStoreSettings(), opts))
    # After the index: re-permissioned documents, deletes and new documents, in the tail
    # (incremental: the first half of each in a new index version that shares the first one's shards).
    repermissioned = [Doc(d.pk, d.text, random_acl(rng)) for d in docs[:40]]
    added = [Doc(1000 + i, " ".join(f"w{rng.randrange(60)}" for _ in range(6)), random_acl(rng)) for i in range(30)]
    if incremental:
        lake.write(repermissioned[:20])
        lake.write(docs[40:50], op="delete")
        lake.write(added[:15])
        manifest = build_index(plan(lake.lake), store.root, ObjectStoreSettings(), opts)
        assert manifest.stats["incremental"] and manifest.stats["dead_rows"] == 30
        publish(store, manifest)
        repermissioned, added = repermissioned[20:], added[15:]
        lake.write(docs[50:60], op="delete")
    else:
        lake.write(docs[40:60], op="delete")
    lake.write(repermissioned)
    lake.write(added)
    engines = {}
    for name, nprobe in (("default", 2), ("exhaustive", 20)):
        engine = SearchEngine(lake.lake, store, embedder, None, EngineOptions(nprobe=nprobe))
        engine.start(background=False)
        engines[name] = engine
    live = current_chunks(lake.lake, columns=["chunk_id", "acl", "embedding", "text"])
    return engines, embedder, live


def matching(texts: list[str], query: str) -> list[bool]:
    """Which texts hold a word of the query (what keyword search can find)."""
    words = set(query.split())
    return [bool(words & set(t.split())) for t in texts]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    groups=st.frozensets(st.sampled_from(GROUPS), max_size=3),
    words=st.lists(st.integers(0, 59), min_size=1, max_size=6),
    k=st.integers(1, 60),
    mode=st.sampled_from(MODES),
)
def test_no_leak_and_no_visible_match_lost(world, groups: frozenset[str], words: list[int], k: int, mode: str) -> None:  # type: ignore[no-untyped-def]
    engines, embedder, live = world
    query = " ".join(f"w{w}" for w in words)
    acl = {cid: set(a or ()) for cid, a in zip(live["chunk_id"].to_pylist(), live["acl"].to_pylist(), strict=True)}
    visible = [i for i, cid in enumerate(live["chunk_id"].to_pylist()) if not acl[cid] or acl[cid] & groups]
    texts = live["text"].to_pylist()
    holding = matching(texts, query)
    expected = min(k, len(visible) if mode != "keyword" else sum(holding[i] for i in visible))
    who = Principal("p", groups)

    for engine in engines.values():
        result = engine.search(query, k, who, mode=mode)
        got = [r["chunk_id"] for r in result.results]
        assert all(cid in acl for cid in got), "a deleted or superseded chunk was returned"
        leaked = [cid for cid in got if acl[cid] and not acl[cid] & groups]
        assert not leaked, f"{who} saw {leaked} ({mode})"
        assert len(got) == len(set(got)) == expected, mode
        if mode == "keyword":
            assert all(matching([r["text"]], query)[0] for r in result.results)

    # Probing every list is exact search over the visible set: same scores as the oracle.
    vectors = embeddings(live.take(visible))
    q = embedder.embed([query])[0]
    oracle = np.sort(1.0 - (2.0 - 2.0 * vectors @ q) / 2.0)[::-1][:k]
    scores = [r["score"] for r in engines["exhaustive"].search(query, k, who, mode="dense").results]
    assert np.allclose(scores, oracle, atol=1e-4)


@pytest.fixture(scope="module", params=["flat", "sq8"])
def history(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, ray_local: None):  # type: ignore[no-untyped-def]
    """A lake whose index covers the first commit; later commits happen during the test."""
    tmp = tmp_path_factory.mktemp("acl-history")
    rng = random.Random(11)
    embedder = FakeEmbedder(dim=32)
    lake = DocLake(str(tmp / "lake"), embedder)
    docs = {pk: Doc(pk, " ".join(f"w{rng.randrange(40)}" for _ in range(5)), random_acl(rng)) for pk in range(200)}
    indexed_at = lake.write(list(docs.values()))
    store = LocalStore(str(tmp / "index"))
    # Builds during the test are incremental while at most a third of the chunks changed since the last full one.
    opts = BuildOptions(nlist=10, iterations=5, shard_bytes=6_000, progress=False, codec=request.param,
                        reuse_centroids=True, max_delta=0.33)  # fmt: skip
    publish(store, build_index(plan(lake.lake), store.root, ObjectStoreSettings(), opts))
    return lake, store, embedder, docs, indexed_at, opts


def _check(
    engine: SearchEngine, lake: DocLake, query: str, k: int, who: Principal, as_of: int | None, mode: str
) -> None:
    live = current_chunks(lake.lake, version=as_of, columns=["chunk_id", "acl", "text"])
    acl = {cid: set(a or ()) for cid, a in zip(live["chunk_id"].to_pylist(), live["acl"].to_pylist(), strict=True)}
    holding = dict(zip(live["chunk_id"].to_pylist(), matching(live["text"].to_pylist(), query), strict=True))
    visible = sum(1 for c, a in acl.items() if (not a or a & who.groups) and (mode != "keyword" or holding[c]))
    result = engine.search(query, k, who, as_of, mode=mode)
    got = [r["chunk_id"] for r in result.results]
    when = ("live" if as_of is None else f"as_of={as_of}") + f", {mode}"
    assert all(cid in acl for cid in got), f"{when}: a chunk deleted or superseded by then was returned"
    leaked = [cid for cid in got if acl[cid] and not acl[cid] & who.groups]
    assert not leaked, f"{when}: {who} saw {leaked}"
    assert len(got) == len(set(got)) == min(k, visible), when


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("commit"), st.integers(0, 2**31)),
            st.just(("restart", 0)),
            st.just(("build", 0)),
            st.tuples(st.just("live"), st.integers(0, 2**31)),
            st.tuples(st.just("as_of"), st.integers(0, 2**31)),
        ),
        min_size=3,
        max_size=12,
    )
)
def test_as_of_live_queries_and_restarts_interleaved_never_leak(history, steps: list[tuple[str, int]]) -> None:  # type: ignore[no-untyped-def]
    """Commits (re-permissions, deletes, re-creations, rewrites), replica restarts between
    them, and live and ``as_of`` queries in any order: every answer is the oracle's at its
    version. Each restart reads every commit since the index in one poll, so ``as_of`` tails
    and the live tail often cover different ranges of one base version. Index builds in
    between are mostly incremental: their versions share shards, each with its own dead rows."""
    lake, store, embedder, docs, indexed_at, opts = history
    engine = SearchEngine(lake.lake, store, embedder, None, EngineOptions(nprobe=2))
    engine.start(background=False)
    for kind, seed in steps:
        rng = random.Random(seed)
        if kind == "commit":
            changed = [docs[pk] for pk in rng.sample(sorted(docs), 6)]
            action = rng.choice(["acl", "delete", "rewrite"])
            if action == "delete":
                lake.write(changed, op="delete")
                changed = [Doc(d.pk, d.text, random_acl(rng)) for d in changed[:3]]  # some come back
            elif action == "rewrite":
                lake.write([Doc(d.pk, d.text, d.acl) for d in changed], op="delete")
                changed = [Doc(d.pk, " ".join(f"w{rng.randrange(40)}" for _ in range(5)), random_acl(rng))
                           for d in changed]  # fmt: skip
            else:
                changed = [Doc(d.pk, d.text, random_acl(rng)) for d in changed]
            lake.write(changed)
            docs.update({d.pk: d for d in changed})
            assert engine._tail is not None
            engine._tail.poll()
        elif kind == "build":
            publish(store, build_index(plan(lake.lake), store.root, ObjectStoreSettings(), opts))
            engine.check_for_new_index()
        elif kind == "restart":
            engine = SearchEngine(lake.lake, store, embedder, None, EngineOptions(nprobe=2))
            engine.start(background=False)
        else:
            who = Principal("p", frozenset(rng.sample(GROUPS, rng.randint(0, 2))))
            query = " ".join(f"w{rng.randrange(40)}" for _ in range(3))
            newest = engine.current_view().lake_version
            as_of = rng.randint(indexed_at, newest) if kind == "as_of" else None
            _check(engine, lake, query, rng.randint(1, 40), who, as_of, rng.choice(MODES))
