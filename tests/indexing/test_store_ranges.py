"""Byte-range reads from both stores, and coalescing of near ranges into one request."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from indexing.store import NotFound, ObjectStore, coalesce, get_ranges, open_store
from pipelines.storage import ObjectStoreSettings

DATA = bytes(range(256)) * 1024  # 256 KiB


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "local":
        return open_store(str(tmp_path / "store"))
    server = request.getfixturevalue("s3_server")
    settings = ObjectStoreSettings(server.endpoint, "test", "test", None, "us-east-1")
    return open_store(f"{server.create_bucket('ranges')}/idx", settings)


def test_a_range_is_exactly_those_bytes(store: ObjectStore) -> None:
    store.put("f", DATA)
    assert store.get_range("f", 0, 10) == DATA[:10]
    assert store.get_range("f", 1000, 4096) == DATA[1000:5096]
    assert store.get_range("f", len(DATA) - 5, 5) == DATA[-5:]
    assert store.get_range("f", 7, 0) == b""
    assert store.get_range("f", len(DATA) - 5, 100) == DATA[-5:]  # short: the caller's checksum refuses it
    with pytest.raises(NotFound):
        store.get_range("missing", 0, 10)


def test_near_ranges_share_a_request_and_far_ones_run_in_parallel(store: ObjectStore) -> None:
    store.put("f", DATA)
    wanted = [(200_000, 100), (0, 10), (5, 20), (40, 8), (100_000, 50), (100_060, 10)]
    with ThreadPoolExecutor(4) as pool:
        blobs, requests, moved = get_ranges(store, "f", wanted, pool, gap=1000)
    assert blobs == [DATA[s : s + n] for s, n in wanted]
    assert requests == 3  # [0, 48), [100000, 100070), [200000, 200100)
    assert moved == 48 + 70 + 100


def test_coalesce() -> None:
    assert coalesce([(10, 5), (0, 5), (100, 1), (16, 0)], gap=5) == [(0, 15), (100, 1)]
    assert coalesce([(0, 100), (10, 5)], gap=0) == [(0, 100)]  # contained
    assert coalesce([], gap=10) == []


def test_a_local_key_cannot_escape_the_store_root(tmp_path: Path) -> None:
    from indexing.store import LocalStore, StoreError

    (tmp_path / "outside").write_bytes(b"secret")
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "link").symlink_to(tmp_path)  # a link inside the store that leads out of it
    store = LocalStore(str(tmp_path / "store"))
    store.put("a/b", b"inside")
    assert store.get("a/../a/b") == b"inside"
    (tmp_path / "store" / "file-link").symlink_to(tmp_path / "outside")  # a file link leading out
    for key in ("../outside", "a/../../outside", "link/outside", str(tmp_path / "outside"), "/outside", "file-link"):
        with pytest.raises(StoreError, match="escapes the store root"):
            store.get(key)
    with pytest.raises(StoreError, match="escapes the store root"):
        store.put("../planted", b"x")
    assert not (tmp_path / "planted").exists()
