"""A large tail searched through its own IVF index (retrieval/tail_index.py).

The index is approximate, so these tests check what must hold exactly (nothing a caller
may not see, nothing a snapshot does not cover, k results whenever k rows are allowed, a
row's own vector finds it first) and that recall against exact search stays high.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

import retrieval.tail as tail_module
import retrieval.tail_index as tail_index
from retrieval.tail import TailLog, TailState
from tests.retrieval.test_tail import DIM, GROUPS, commit_rows

ROWS = 3000


def exact(state: TailState, query: np.ndarray, k: int, allowed: np.ndarray) -> list[int]:
    dist = np.where(allowed, 2.0 - 2.0 * (state.vectors @ query), np.inf)
    top = np.argsort(dist, kind="stable")[:k]
    return [int(i) for i in top if np.isfinite(dist[i])]


@pytest.fixture
def small_thresholds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tail_index, "TAIL_INDEX_ROWS", 500)
    monkeypatch.setattr(tail_module, "EXACT_ALLOWED_ROWS", 40)


def grow(log: TailLog, rows: int, first_version: int, seed: int) -> int:
    """Append ``rows`` changes in commits of 1..50 rows (updates of earlier chunks, deletes, ACLs)."""
    rng = random.Random(seed)
    version, position, done = first_version, 0, 0
    while done < rows:
        size = min(rows - done, rng.randint(1, 50))
        changes = []
        for _ in range(size):
            position += 1
            chunk = rng.randrange(int(ROWS * 0.8))  # some chunks change more than once
            changes.append((chunk, seed * 1_000_000 + position, rng.random() < 0.05, rng.randrange(4)))
        version += 1
        log.append(commit_rows(changes, version, seed * 100_000 + version), version)
        done += size
    return version


def trained(log: TailLog) -> None:
    """Wait for the background training, then let the poller's refresh swap the index in."""
    thread = log.index._training
    assert thread is not None, "the tail never started training its index"
    thread.join(60)
    log.refresh_index()
    assert log.index.rows == log.n


def test_a_large_tail_is_searched_through_its_index(small_thresholds: None) -> None:
    log = TailLog(base_version=0, dim=DIM)
    version = grow(log, ROWS // 2, 0, seed=1)
    trained(log)
    before = log.snapshot()
    grow(log, ROWS // 2, version, seed=2)  # appended to the trained index, not retrained yet
    state = log.snapshot()
    assert log.index.rows == state.n
    for snapshot in (before, state):
        recalls = []
        for groups in GROUPS:
            allowed = snapshot.allowed(groups)
            for row in np.flatnonzero(allowed)[:: max(1, int(allowed.sum()) // 25)]:
                query = snapshot.vectors[row]
                found, distances = snapshot.search(query, 10, allowed)
                rows = found.tolist()
                assert rows[0] == row  # its own vector finds it first
                assert all(r < snapshot.n and allowed[r] for r in rows)  # never a row it may not see
                assert len(rows) == len(distances) == min(10, int(allowed.sum()))
                want = exact(snapshot, query, 10, allowed)
                assert np.allclose(distances, np.sort(distances))
                recalls.append(len(set(rows) & set(want)) / len(want))
        assert np.mean(recalls) >= 0.85, np.mean(recalls)  # random 8-d vectors: real embeddings do better


def test_few_allowed_rows_are_searched_exactly(small_thresholds: None) -> None:
    log = TailLog(base_version=0, dim=DIM)
    grow(log, ROWS, 0, seed=3)
    trained(log)
    state = log.snapshot()
    rng = np.random.default_rng(0)
    for size in (1, 5, 39, 200):  # below and above the exact-search bound
        allowed = np.zeros(state.n, bool)
        allowed[rng.choice(np.flatnonzero(state.live), size, replace=False)] = True
        query = rng.normal(size=DIM).astype(np.float32)
        query /= np.linalg.norm(query)
        rows, _ = state.search(query, 10, allowed)
        assert len(rows) == min(10, size)  # widened until every allowed row that can be is found
        assert all(allowed[rows])
        if size < 40:
            assert rows.tolist() == exact(state, query, 10, allowed)


def test_searches_while_the_tail_grows_and_retrains(small_thresholds: None) -> None:
    log = TailLog(base_version=0, dim=DIM)
    grow(log, 600, 0, seed=4)
    trained(log)
    stop = threading.Event()
    errors: list[BaseException] = []

    def searcher() -> None:
        rng = np.random.default_rng(1)
        try:
            while not stop.is_set():
                state = log.snapshot()
                allowed = state.allowed(GROUPS[3])
                query = rng.normal(size=DIM).astype(np.float32)
                rows, _ = state.search(query / np.linalg.norm(query), 10, allowed)
                assert all(rows < state.n) and all(allowed[rows])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=searcher) for _ in range(3)]
    for t in threads:
        t.start()
    grow(log, 2400, log.version, seed=5)  # past twice the trained rows: a retrain runs meanwhile
    trained(log)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors[0]
    assert log.index._trained_on >= 1200  # retrained on the grown tail
