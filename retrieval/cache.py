"""The shard cache: object storage → local disk → memory, each tier bounded, LRU.

Files are named by their sha256 (from the manifest), so a file is verified once when it
arrives and is never stale: a new index version has new files. Loads of the same shard
by concurrent requests share one fetch.

A compressed (ranged) shard is opened from its small files (list table and codec; an
index of the older layout: its id map too); its lists and its id map's row blocks arrive by
range as queries need them and share the one memory budget with the shards:
``memory_bytes`` bounds all of them, least recently used first. With a directory, its
ranged reads (lists, the float vectors that re-rank, row blocks) also go through a sparse
local copy of each file (``indexing.sparse.SparseCopy``): a range read once is read from
disk after that, and the disk bound covers those copies too (by allocated bytes).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
from collections import OrderedDict
from functools import partial
from pathlib import Path

from indexing.lists import ByteBudget, RangeRead
from indexing.manifest import FileRef, ShardRef, get_verified, sha256
from indexing.reader import LoadedShard, open_shard, range_pool
from indexing.sparse import RangeFetch, SparseCopy
from indexing.store import ObjectStore
from retrieval import metrics
from serving.waiting import may_wait

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "streamrag" / "shards"


#: bound once: a query looks up every shard it probes
_MEMORY_HITS = metrics.CACHE_REQUESTS.labels("memory")
#: files that every shard of a build names (its codec parameters: a PQ's are 384 KB at
#: 384 dimensions) stay in memory once fetched, this many, so a cold replica opening 100
#: shards fetches each once, not once per shard
SHARED_FILES = 4


class ShardCache:
    def __init__(self, directory: Path | None, memory_bytes: int = 2 << 30, disk_bytes: int = 20 << 30) -> None:
        self.directory = directory
        self.memory_bytes = memory_bytes
        self.disk_bytes = disk_bytes
        self._memory: dict[str, LoadedShard] = {}
        self.budget = ByteBudget(memory_bytes, on_change=metrics.CACHE_MEMORY_BYTES.set, on_evict=_count_list_eviction)
        self._lock = threading.Lock()
        self._inflight: dict[str, threading.Lock] = {}
        self._shared: OrderedDict[str, bytes] = OrderedDict()  # sha256 → bytes (SHARED_FILES)
        self._shared_gates: dict[str, threading.Lock] = {}
        self._disk_held = 0
        #: shards evicted from memory so far (a reader's combined view of its shards holds
        #: them alive: it drops that view when this changes)
        self.generation = 0
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            self._disk_held = self._disk_usage()
            if self._disk_held > disk_bytes:  # a smaller bound than the last run's
                self._trim_disk()
            metrics.CACHE_DISK_BYTES.set(self._disk_held)

    # -- the ShardSource protocol ----------------------------------------------------

    def load(self, store: ObjectStore, ref: ShardRef) -> LoadedShard:
        key = ref.index.sha256
        found = self._from_memory(key)
        if found is not None:
            return found
        may_wait(f"loading shard {ref.index.key}")  # from the disk tier or the store
        with self._lock:
            gate = self._inflight.setdefault(key, threading.Lock())
        with gate:  # one fetch per shard; the others wait for it, then hit memory
            found = self._from_memory(key)
            if found is not None:
                return found
            try:
                # a ranged shard's lists come later; its small files come together, in one round trip
                files = ref.opened()
                shared = {ref.codec.sha256} if ref.codec is not None else set()
                got = list(range_pool().map(lambda f: self._file(store, f, f.sha256 in shared), files))
                shard = open_shard(store, ref, [blob for blob, _ in got], self.budget, self._ranged)
            finally:
                with self._lock:
                    self._inflight.pop(key, None)
            metrics.CACHE_REQUESTS.labels("disk" if all(from_disk for _, from_disk in got) else "fetch").inc()
            self._remember(key, shard)
            return shard

    def cached(self, ref: ShardRef) -> LoadedShard | None:
        return self._from_memory(ref.index.sha256)

    def contains(self, ref: ShardRef) -> bool:
        with self._lock:
            return ref.index.sha256 in self._memory

    @property
    def memory_held(self) -> int:
        """Bytes of shards and lists in memory."""
        return self.budget.held

    # -- tiers --------------------------------------------------------------------------

    def _from_memory(self, key: str) -> LoadedShard | None:
        with self._lock:
            found = self._memory.get(key)
        if found is not None:
            self.budget.touch(key)
            _MEMORY_HITS.inc()
        return found

    def _remember(self, key: str, shard: LoadedShard) -> None:
        with self._lock:
            if key in self._memory:
                return
            self._memory[key] = shard
        self.budget.admit(key, shard.nbytes, partial(self._drop, key))

    def _drop(self, key: str) -> None:
        """The budget evicted a shard: forget it, and its resident lists with it."""
        with self._lock:
            shard = self._memory.pop(key, None)
            self.generation += 1
        metrics.CACHE_EVICTIONS.labels("memory").inc()
        if shard is not None and shard.lists is not None:
            shard.lists.drop_all()

    def _file(self, store: ObjectStore, ref: FileRef, shared: bool = False) -> tuple[bytes, bool]:
        """The verified bytes of a file, and whether they came from a cache (disk, or for a
        ``shared`` file, memory: fetched once however many shards ask for it at once)."""
        if not shared:
            return self._tiered_file(store, ref)
        with self._lock:
            gate = self._shared_gates.setdefault(ref.sha256, threading.Lock())
        with gate:
            with self._lock:
                data = self._shared.get(ref.sha256)
                if data is not None:
                    self._shared.move_to_end(ref.sha256)
                    return data, True
            data, from_disk = self._tiered_file(store, ref)
            with self._lock:
                self._shared[ref.sha256] = data
                while len(self._shared) > SHARED_FILES:
                    gone, _ = self._shared.popitem(last=False)
                    self._shared_gates.pop(gone, None)
            return data, from_disk

    def _tiered_file(self, store: ObjectStore, ref: FileRef) -> tuple[bytes, bool]:
        """The verified bytes of a file, and whether they came from the disk cache."""
        path = self.directory / ref.sha256 if self.directory is not None else None
        if path is not None and path.exists():
            try:
                data = path.read_bytes()
            except OSError:
                data = b""
            if len(data) == ref.bytes and sha256(data) == ref.sha256:
                with contextlib.suppress(FileNotFoundError):  # trimmed by a concurrent load: bytes verified
                    os.utime(path)  # LRU by modification time
                return data, True
            log.warning("discarding corrupt cache file %s", path)
            path.unlink(missing_ok=True)
        data = get_verified(store, ref)
        metrics.CACHE_FETCHED_BYTES.inc(len(data))
        if path is not None:
            self._write(path, data)
        return data, False

    def _write(self, path: Path, data: bytes) -> None:
        assert self.directory is not None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".partial-")
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except OSError as exc:  # a full or read-only disk degrades to memory-only caching
            log.warning("cannot write the shard cache file %s: %s", path, exc)
            return
        self._grew(len(data))  # trims past the bound (a directory scan per write made a cold start quadratic)

    def _ranged(self, file: FileRef, fetch: RangeFetch) -> RangeRead:
        """Ranged reads of a compressed shard's file: counted, and through a sparse local
        copy of it when the cache has a directory."""

        def counted(ranges: list[tuple[int, int]], fresh: bool = False) -> tuple[list[bytes], int, int]:
            blobs, requests, nbytes = fetch(ranges)
            metrics.RANGE_READS.labels("store").inc(len(ranges))
            metrics.RANGE_REQUESTS.inc(requests)
            metrics.CACHE_FETCHED_BYTES.inc(nbytes)
            return blobs, requests, nbytes

        if self.directory is None:
            return counted
        path = self.directory / f"{file.sha256}.part"
        return SparseCopy(path, file.bytes, counted, self._grew, metrics.RANGE_READS.labels("disk").inc)

    def _grew(self, nbytes: int) -> None:
        """A sparse copy or a cached file took ``nbytes`` more of the disk; past the disk bound, trim."""
        with self._lock:
            self._disk_held += nbytes
            over = self._disk_held > self.disk_bytes
        if over:
            self._trim_disk()
        else:
            metrics.CACHE_DISK_BYTES.set(self._disk_held)

    def _disk_usage(self) -> int:
        assert self.directory is not None
        total = 0
        for p in self.directory.iterdir():
            if p.is_file() and not p.name.startswith("."):
                try:
                    total += _allocated(p.stat())
                except FileNotFoundError:
                    continue
        return total

    def _trim_disk(self) -> None:
        assert self.directory is not None
        files = []
        for p in self.directory.iterdir():
            if p.is_file() and not p.name.startswith("."):
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                files.append((st.st_mtime, _allocated(st), p))
        total = sum(size for _, size, _ in files)
        target = self.disk_bytes * 9 // 10  # some room, so that the next write does not trim again
        for _, size, p in sorted(files):
            if total <= target:
                break
            p.unlink(missing_ok=True)
            p.with_name(f".{p.name}.have").unlink(missing_ok=True)  # a sparse copy's log of what it holds
            total -= size
            metrics.CACHE_EVICTIONS.labels("disk").inc()
        with self._lock:
            self._disk_held = total
        metrics.CACHE_DISK_BYTES.set(total)


def _allocated(st: os.stat_result) -> int:
    """Bytes a file takes on disk (a sparse copy takes only what was written)."""
    return min(st.st_size, st.st_blocks * 512)


def _count_list_eviction(key: object) -> None:
    if isinstance(key, tuple):  # (shard, list): a compressed list left memory (shards count in _drop)
        metrics.CACHE_EVICTIONS.labels("list").inc()
