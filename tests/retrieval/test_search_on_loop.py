"""Searches on the event loop (``retrieval.api``, ``serving.waiting``): a search whose shards,
query embedding and keyword copy are in memory answers on the loop's thread; the first time
it would wait for anything it starts again on a worker thread, with the same answer."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from indexing.reader import COMBINE_RETRY_S
from indexing.store import LocalStore
from retrieval import metrics
from retrieval.api import create_app
from retrieval.cache import ShardCache
from retrieval.engine import SearchEngine
from retrieval.query_embedding import QueryEmbedder
from serving.fake_embedder import FakeEmbedder
from serving.waiting import WouldWait, may_wait, without_waiting
from tests.retrieval.lakes import Doc, DocLake
from tests.retrieval.test_hybrid import build, corpus, engine_for

WORKER = "AnyIO worker thread"


def where_ran() -> dict[str, float]:
    return {
        label: metrics.SEARCH_THREADS.labels(label)._value.get() for label in ("loop", "worker after loop", "worker")
    }


def ran_since(before: dict[str, float]) -> dict[str, int]:
    return {label: int(count - before[label]) for label, count in where_ran().items() if count != before[label]}


def warm_thread(engine: SearchEngine, mode: str = "hybrid") -> str:
    """Where a warm search runs: a compressed index re-ranks its candidates by their float
    vectors, read from the cache's disk tier (``--rerank``), so such searches go to workers."""
    flat = engine.current_view().reader.manifest.codec == "flat"
    return "loop" if flat or mode == "keyword" else "worker after loop"


def body(response: Any) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    found = response.json()
    found.pop("took_ms")
    return found


@pytest.fixture(params=["flat", "sq8"])
def engine(request: pytest.FixtureRequest, tmp_path: Path, ray_local: None) -> SearchEngine:
    lake = DocLake(str(tmp_path / "lake"), FakeEmbedder(dim=32))
    docs = corpus()
    docs[42] = Doc(42, "how to call os.replace with dirs_exist_ok set")
    lake.write(docs)
    build(lake, tmp_path / "index", codec=request.param)
    # a shard cache with a disk tier: an sq8 index's re-ranking reads its float vectors there
    found = engine_for(lake, tmp_path / "index", tmp_path / "cache")
    threads: list[str] = []
    search_view = found.search_view

    def noted(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return search_view(*args, **kwargs)

    found.search_view = noted  # type: ignore[method-assign]
    found.threads = threads  # type: ignore[attr-defined]
    return found


def test_a_search_runs_on_the_loop_once_all_it_needs_is_in_memory(engine: SearchEngine) -> None:
    threads: list[str] = engine.threads  # type: ignore[attr-defined]
    query = {"query": "os.replace dirs_exist_ok", "k": 5}
    with TestClient(create_app(engine, None)) as client:
        before = where_ran()
        first = body(client.post("/v1/search", json=query))
        # the query was not embedded yet: it went to a worker before searching anything
        assert ran_since(before) == {"worker after loop": 1}
        assert threads == [WORKER]
        before = where_ran()
        again = body(client.post("/v1/search", json=query))
        assert ran_since(before) == {warm_thread(engine): 1}
        if warm_thread(engine) == "loop":
            assert len(threads) == 2 and threads[1] != WORKER
        else:  # started on the loop, stopped at the re-rank's read, then again on a worker
            assert len(threads) == 3 and threads[1] != WORKER and threads[2] == WORKER
        assert again == first
        assert first["results"][0]["chunk_id"] == Doc(42, "how to call os.replace with dirs_exist_ok set").chunk_id

        # as_of may read the lake, which nothing guards: always on a worker
        before = where_ran()
        at = body(client.post("/v1/search", json={**query, "as_of": first["lake_version"]}))
        assert ran_since(before) == {"worker": 1}
        assert at["results"] == first["results"]

        # a bad request is answered from the loop as before: a 4xx with what was wrong
        wrong = client.post("/v1/search", json={**query, "mode": "fuzzy"})
        assert wrong.status_code in (400, 422) and "mode" in wrong.text


def test_a_query_whose_shard_is_not_in_memory_moves_to_a_worker(engine: SearchEngine) -> None:
    """The query's embedding is cached, but its shards are not in memory: the loop must not read them."""
    threads: list[str] = engine.threads  # type: ignore[attr-defined]
    engine.queries.embed("note 7")
    cache = engine.source
    assert isinstance(cache, ShardCache)
    for ref in engine.current_view().reader.manifest.shards:
        cache._drop(ref.index.sha256)  # as the memory budget evicts them
    with TestClient(create_app(engine, None)) as client:
        before = where_ran()
        first = body(client.post("/v1/search", json={"query": "note 7", "mode": "dense"}))
        assert ran_since(before) == {"worker after loop": 1}
        # started on the loop, stopped at the shard load, then again on a worker
        assert len(threads) == 2 and threads[0] != WORKER and threads[1] == WORKER
        before = where_ran()
        assert body(client.post("/v1/search", json={"query": "note 7", "mode": "dense"})) == first
        assert ran_since(before) == {warm_thread(engine, "dense"): 1}


@pytest.mark.parametrize("mode", ["dense", "hybrid", "keyword"])
def test_the_loop_answers_as_a_worker_does(engine: SearchEngine, mode: str) -> None:
    queries = ["note 3 w17", "os.replace", "w5 w9 w200", "dirs_exist_ok payroll", "nothing matches zzz"]
    with TestClient(create_app(engine, None, search_on_loop=False)) as client:
        # equal scores come in the order of the scan: shard by shard until every shard is in memory
        # and the reader combines their lists (COMBINE_RETRY_S after its last try), in one scan after
        for _ in range(2):
            for q in queries:
                body(client.post("/v1/search", json={"query": q, "mode": mode}))
            time.sleep(COMBINE_RETRY_S)
        before = where_ran()
        on_workers = [body(client.post("/v1/search", json={"query": q, "mode": mode})) for q in queries]
        assert ran_since(before) == {"worker": len(queries)}
    with TestClient(create_app(engine, None)) as client:
        before = where_ran()
        on_loop = [body(client.post("/v1/search", json={"query": q, "mode": mode})) for q in queries]
        ran = ran_since(before)  # each query embedded, and its shards loaded, by the worker runs
        assert sum(ran.values()) == len(queries)
        if warm_thread(engine, mode) == "loop":
            assert ran == {"loop": len(queries)}
        else:  # a compressed index's re-ranking reads from the disk tier when its candidates need it
            assert set(ran) <= {"loop", "worker after loop"}
    assert on_loop == on_workers


def test_nothing_waits_inside_without_waiting(tmp_path: Path) -> None:
    store = LocalStore(str(tmp_path))
    store.put("a", b"bytes")
    queries = QueryEmbedder(FakeEmbedder(dim=8))
    known = queries.embed("known")
    lock = threading.Lock()
    with without_waiting():
        with pytest.raises(WouldWait, match="reading a"):
            store.get("a")
        with pytest.raises(WouldWait):
            store.get_range("a", 0, 2)
        with pytest.raises(WouldWait, match="embedding"):
            queries.embed("new")
        assert (queries.embed("known") == known).all()
        with pytest.raises(WouldWait):
            may_wait("anything")
        lock.acquire()  # outside the guard's reach: plain locks still work
        lock.release()
    # outside, all of it is allowed again, and the flag did not leak out of the block
    assert store.get("a") == b"bytes" and queries.embed("new").shape == (8,)
    may_wait("anything")
    with pytest.raises(RuntimeError), without_waiting():
        raise RuntimeError("boom")
    may_wait("after an exception inside")


def test_a_stale_keyword_copy_is_not_brought_up_to_date_on_the_loop(engine: SearchEngine) -> None:
    """A tail update the copy lacks means a commit into it (milliseconds): a worker does it."""
    view = engine.current_view()
    copy = engine.keywords.copy_for(view.reader, view.tail)
    copy.rows -= 1  # as if the tail's newest row had not reached the copy yet
    copy.stale_upto -= 1
    with without_waiting(), pytest.raises(WouldWait, match="keyword copy"):
        copy.sync(view.tail)
