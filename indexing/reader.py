"""Read an index version from object storage and search it (the retrieval service's view).

The manifest and centroids are loaded once; shards are fetched on demand, verified against
the manifest's sha256, and searched with precomputed list assignments
(``search_preassigned``), so each shard only scans the lists a query probes.

Filters (ACLs, chunks superseded after the snapshot) are applied *inside* the scan with a
faiss ID selector: the top-k comes from the allowed vectors of the probed lists, so a
filter never costs recall the way filtering an over-fetched top-k does. An incremental
version's dead rows (chunks changed since the build that wrote a shared shard) are one
more such filter, and its delta shards are searched for every probed list.
"""

from __future__ import annotations

import contextvars
import io
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from typing import Any, Protocol, TypeVar
from zoneinfo import ZoneInfo

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from indexing.lists import (
    ByteBudget,
    CodeRun,
    Fetched,
    ListData,
    ListTable,
    RangeRead,
    ResidentLists,
    load_codec,
    pq_size,
    scan_runs,
)
from indexing.manifest import FileRef, Manifest, ShardRef, get_verified, load_manifest
from indexing.npy import load_array
from indexing.sparse import RangeFetch
from indexing.store import ObjectStore, get_ranges
from serving.waiting import may_wait

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class LoadedShard:
    index: Any  # faiss.IndexIVFFlat (None for a ranged shard: see ``lists``)
    #: the id map (None until first needed, for a shard whose id map is row blocks read by range)
    id_map: pa.Table | None
    #: memoized per-shard data derived from ``ids`` (filter masks), owned by callers
    derived: dict[Any, Any] = field(default_factory=dict)
    #: a compressed shard's lists, fetched by range as queries probe them
    lists: ResidentLists | None = None
    #: fetches the whole id map of a row-block shard (searches never do: they read their lists'
    #: filter columns and row blocks; a replica adding an incremental version's delta shards
    #: to its keyword copy does)
    load_ids: Callable[[], pa.Table] | None = None
    #: held while what is made once on first use is made: the whole id map, the direct map
    _once: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def ids(self) -> pa.Table:
        """The whole id map. A row-block shard's queries read only their lists' filter
        columns and their results' row blocks; this fetches all of it, once."""
        if self.id_map is None:
            assert self.load_ids is not None
            with self._once:
                if self.id_map is None:
                    self.id_map = self.load_ids()
        return self.id_map

    @property
    def row_blocks(self) -> bool:
        """Lineage and filter columns come by range (a compressed shard of format 4)."""
        return self.lists is not None and self.lists.table.columns

    @property
    def nbytes(self) -> int:
        """Memory held for the shard itself (a ranged shard's lists and row blocks are
        counted as they arrive; a row-block shard's whole id map, if it is ever needed, too)."""
        ids = int(self.id_map.nbytes) if self.id_map is not None and self.load_ids is None else 0
        if self.lists is not None:
            return self.lists.table.nbytes + ids
        # 8 bytes an entry: the direct map ``flat_vectors`` makes when stored vectors are first
        # asked for (hybrid's feedback, an answer's sources)
        return int(self.index.ntotal) * (int(self.index.code_size) + 8) + ids


def flat_vectors(shard: LoadedShard, faiss_ids: np.ndarray) -> np.ndarray:
    """The stored vectors of a float shard's entries, in one faiss call through the index's
    direct map (made on first use, 8 bytes an entry; searches never read it). A shard whose
    ids are not 0..n-1 has none: its entries are found one by one (``stored_vector``)."""
    direct = shard.derived.get(_DIRECT_MAP)
    if direct is None:
        with shard._once:
            direct = shard.derived.get(_DIRECT_MAP)
            if direct is None:
                try:
                    shard.index.make_direct_map(True)
                    direct = True
                except RuntimeError as exc:  # faiss: "direct map supported only for sequential ids"
                    log.info("shard entries looked up one by one: %s", exc)
                    direct = False
                shard.derived[_DIRECT_MAP] = direct
    if not direct:
        return np.stack([stored_vector(shard, int(i)) for i in faiss_ids])
    found: np.ndarray = shard.index.reconstruct_batch(faiss_ids)
    return found


#: ``LoadedShard.derived``'s key for whether its index has a direct map (``flat_vectors``)
_DIRECT_MAP = "direct map"


def stored_vector(shard: LoadedShard, faiss_id: int) -> np.ndarray:
    """The vector stored for one entry (IVF-Flat codes are the raw float32 vectors; a
    ranged shard fetches it from its vectors file).

    Entries of a list carry consecutive faiss ids (the builder sorts by list), so the
    entry's offset in its list is its id minus the list's first id.
    """
    if shard.lists is not None:
        rows = np.array([faiss_id], np.int64)
        found: np.ndarray = shard.lists.vectors(rows, shard.lists.digests_of(rows, {}))[0]
        return found
    list_no = int(shard.ids.column("list_no")[faiss_id].as_py())
    invlists: Any = shard.index.invlists
    n = int(invlists.list_size(list_no))
    ids = faiss.rev_swig_ptr(invlists.get_ids(list_no), n)
    codes = faiss.rev_swig_ptr(invlists.get_codes(list_no), n * int(invlists.code_size))
    offset = faiss_id - int(ids[0])
    if not 0 <= offset < n or int(ids[offset]) != faiss_id:
        offset = int(np.flatnonzero(ids == faiss_id)[0])
    vector: np.ndarray = np.frombuffer(codes, dtype=np.float32).reshape(n, -1)[offset].copy()
    return vector


def load_shard(store: ObjectStore, ref: ShardRef, budget: ByteBudget | None = None) -> LoadedShard:
    """Fetch and verify one shard and its id map (a ranged shard: its list table, not its lists)."""
    return open_shard(store, ref, [get_verified(store, f) for f in ref.opened()], budget)


def open_shard(
    store: ObjectStore,
    ref: ShardRef,
    blobs: list[bytes],
    budget: ByteBudget | None = None,
    disk: Callable[[FileRef, RangeFetch], RangeRead] | None = None,
) -> LoadedShard:
    """A shard from the verified bytes of ``ref.opened()``, in that order."""
    if ref.ranged:
        table, ids, codec = (blobs[0], None, blobs[1]) if ref.id_blocks else blobs
        return open_ranged_shard(store, ref, table, ids, codec, budget, disk)
    index, ids = blobs
    return decode_shard(index, ids)


def decode_shard(index_blob: bytes, ids_blob: bytes) -> LoadedShard:
    index = faiss.deserialize_index(np.frombuffer(index_blob, dtype=np.uint8))
    return LoadedShard(index, pq.read_table(io.BytesIO(ids_blob)))


#: threads that issue a replica's ranged reads (shared: a query's fetches run side by side).
#: A cold query at 1M vectors makes ~160 requests of ~20 ms to S3 that wait, not compute:
#: 16 threads served them in 10 waves one after another
RANGE_THREADS = 64
#: threads that run one shard's part of a query (each waits on ranged reads, never issues
#: them itself): a query at nprobe 128 touches every shard of a 1M index (23) and ~100 at 5M
SHARD_THREADS = 64
#: shards a reader opens side by side: a compressed shard's small files (list table and
#: codec); float shards are whole 64 MB files, fetched ``fetch_threads`` at a time
RANGED_OPEN_THREADS = 64
_pools: dict[str, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


class ContextPool(ThreadPoolExecutor):
    """A thread pool whose tasks run in the submitter's context (``contextvars``): a search
    that must not wait (``serving.waiting``) must not wait in the threads it fans out to either."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        return super().submit(contextvars.copy_context().run, fn, *args, **kwargs)


def _pool(name: str, threads: int) -> ThreadPoolExecutor:
    with _pools_lock:
        if name not in _pools:
            _pools[name] = ContextPool(threads, thread_name_prefix=name)
        return _pools[name]


def range_pool() -> ThreadPoolExecutor:
    """Leaf requests only: a task here never waits on another task of this pool."""
    return _pool("range-get", RANGE_THREADS)


def shard_pool() -> ThreadPoolExecutor:
    """Per-shard work that waits on ``range_pool`` (two pools, so that waiting cannot deadlock)."""
    return _pool("shard-work", SHARD_THREADS)


def open_pool(threads: int) -> ThreadPoolExecutor:
    """Opening shards (a task may wait on ``range_pool``, never on this pool or ``shard_pool``):
    kept, so that a cold query does not start and join a thread per shard it opens."""
    return _pool(f"shard-open-{threads}", threads)


def open_ranged_shard(
    store: ObjectStore,
    ref: ShardRef,
    table_blob: bytes,
    ids_blob: bytes | None,
    codec_blob: bytes,
    budget: ByteBudget | None = None,
    disk: Callable[[FileRef, RangeFetch], RangeRead] | None = None,
) -> LoadedShard:
    """A compressed shard ready to search: its lists are fetched by range when probed, and
    so are its id map's row blocks when ``ref.id_blocks`` (else ``ids_blob`` is the id map).

    ``disk(file, fetch)``, when given, puts a local tier in front of a file's ranged reads
    (the shard cache's ``SparseCopy`` of it)."""
    assert ref.vectors is not None
    table = ListTable.from_bytes(table_blob)
    name, trained = load_codec(codec_blob, ref.codec.sha256 if ref.codec is not None else None)

    def ranged(file: FileRef) -> RangeRead:
        def fetch(ranges: list[tuple[int, int]], fresh: bool = False) -> tuple[list[bytes], int, int]:
            return get_ranges(store, file.key, ranges, range_pool())

        return disk(file, fetch) if disk is not None else fetch

    rows = ranged(ref.ids) if ref.id_blocks else None
    lists = ResidentLists(table, name, trained, ranged(ref.index), ranged(ref.vectors), budget, ref.index.sha256, rows)
    if ids_blob is not None:
        return LoadedShard(None, pq.read_table(io.BytesIO(ids_blob)), lists=lists)
    shard = LoadedShard(None, None, lists=lists)

    def whole() -> pa.Table:
        found = lists.id_map(ref.ids.bytes, ref.ids.sha256)
        if budget is not None:  # counted; evicted, it is fetched again when next needed
            budget.admit((ref.index.sha256, "ids"), int(found.nbytes), partial(setattr, shard, "id_map", None))
        return found

    shard.load_ids = whole
    return shard


class ShardSource(Protocol):
    """Where a reader gets its shards (the retrieval service plugs in its cache)."""

    def load(self, store: ObjectStore, ref: ShardRef) -> LoadedShard: ...

    def cached(self, ref: ShardRef) -> LoadedShard | None:
        """The shard if it is already in memory (no I/O), else None."""
        ...


class MemoSource:
    """Fetch each shard once and keep it (batch jobs, tests, benchmarks)."""

    def __init__(self) -> None:
        self._shards: dict[str, LoadedShard] = {}
        self._lock = threading.Lock()

    def cached(self, ref: ShardRef) -> LoadedShard | None:
        with self._lock:
            return self._shards.get(ref.index.sha256)

    def contains(self, ref: ShardRef) -> bool:
        with self._lock:
            return ref.index.sha256 in self._shards

    def load(self, store: ObjectStore, ref: ShardRef) -> LoadedShard:
        found = self.cached(ref)
        if found is None:
            found = load_shard(store, ref)
            with self._lock:
                found = self._shards.setdefault(ref.index.sha256, found)
        return found


@dataclass(frozen=True)
class Hit:
    shard: int
    faiss_id: int
    distance: float

    @property
    def score(self) -> float:
        """Cosine similarity (vectors are unit length; the metric is squared L2)."""
        return 1.0 - self.distance / 2.0


@dataclass(frozen=True)
class Found:
    """One query's hits as arrays, best first: shard numbers, faiss ids and squared L2
    distances (no ``Hit`` object each: hybrid search fuses 100 of them per query)."""

    shards: np.ndarray
    ids: np.ndarray
    distances: np.ndarray

    def hits(self) -> list[Hit]:
        found = zip(self.shards.tolist(), self.ids.tolist(), self.distances.tolist(), strict=True)
        return [Hit(s, i, d) for s, i, d in found]

    def __len__(self) -> int:
        return len(self.ids)


#: (shard number, shard) → bool mask over the shard's faiss ids, or None for "all allowed"
Allow = Callable[[int, LoadedShard], "np.ndarray | None"]


class ListAllow(Protocol):
    """An ``Allow`` that can also decide a row-block shard's rows from the filter columns of
    some of its lists (``over_lists``): a query then reads no whole id map."""

    def __call__(self, s: int, shard: LoadedShard) -> np.ndarray | None: ...

    def over_lists(self, s: int, shard: LoadedShard, lists: Mapping[int, ListData]) -> np.ndarray | None: ...


def bitmap_selector(mask: np.ndarray) -> tuple[Any, np.ndarray]:
    """A faiss selector for the True positions of ``mask``, and the buffer it points into.

    The buffer must outlive the selector (faiss keeps a raw pointer). Ids past the mask are
    not selected (faiss's ``n`` is the bitmap's length in bytes; the padding bits are 0).
    """
    bits = np.packbits(mask, bitorder="little")
    return faiss.IDSelectorBitmap(len(bits), faiss.swig_ptr(bits)), bits


#: a compressed index ranks this many × k candidates by their codes, then re-ranks them exactly
RERANK = 4
#: a product quantizer's codes order close neighbours more coarsely than a scalar one's: on
#: the docs' real embeddings (section titles as queries, nprobe 128) pq48 reached recall@10
#: 0.944–0.955 with 4 × k candidates and 0.969 with 10 × k (float IVF: 0.956)
PQ_RERANK = 10


def default_rerank(codec: str) -> int:
    """How many × k candidates a compressed index re-ranks exactly unless told otherwise."""
    return PQ_RERANK if pq_size(codec) is not None else RERANK


#: faiss, for the classes its type stubs lack
_FAISS: Any = faiss

#: how often a reader tries again to combine its shards after it could not (not all in memory)
COMBINE_RETRY_S = 1.0


class CombinedLists:
    """Every shard of a float index as one faiss IVF index, without a copy: each shard's
    lists ``[list_start, list_end)`` (a ``SliceInvertedLists`` of its own), stacked in list
    order (``VStackInvertedLists``). A query whose probed shards need no filter then costs
    one ``search_preassigned`` call, as in single-process faiss, instead of one per shard it
    probes (each about 10–20 µs of fixed cost on top of the scan; a query at nprobe 8 on 1M
    vectors in 23 shards probes 5–8 of them). Probed shards that a filter restricts are
    searched on their own, beside it.

    Results come as (list, offset) pairs (faiss's ``store_pairs``): the list gives the shard,
    the offset the faiss id, since a shard gives each list's entries consecutive ids (the
    builder sorts rows by list); a shard where that does not hold is refused. Faiss refuses
    a filter with ``store_pairs``, so filtered shards are searched one by one. The object
    holds its shards (they stay alive while it does); ``generation`` is the shard source's
    eviction count when it was built (a reader drops it when a shard has been evicted)."""

    def __init__(self, reader: IndexReader, members: dict[int, LoadedShard], generation: int) -> None:
        manifest = reader.manifest
        self.members = members
        self.generation = generation
        self._first = np.zeros(manifest.nlist, dtype=np.int64)  # each list's first faiss id
        self._parts: list[Any] = []
        stack: Any = _FAISS.InvertedListsPtrVector()
        total = 0
        for i, ref in enumerate(manifest.shards):
            invlists = members[i].index.invlists
            for list_no in range(ref.list_start, ref.list_end):
                size = invlists.list_size(list_no)
                if size:
                    ids = faiss.rev_swig_ptr(invlists.get_ids(list_no), size)
                    if ids[-1] - ids[0] != size - 1 or (size > 2 and not np.all(np.diff(ids) == 1)):
                        raise ValueError(f"list {list_no} of shard {i} does not hold consecutive ids")
                    self._first[list_no] = ids[0]
            part = _FAISS.SliceInvertedLists(invlists, ref.list_start, ref.list_end)
            self._parts.append(part)
            stack.push_back(part)
            total += members[i].index.ntotal
        self._stack_ptrs = stack
        self._stack = _FAISS.VStackInvertedLists(stack.size(), stack.data())
        self.index: Any = faiss.IndexIVFFlat(reader.quantizer, manifest.dim, manifest.nlist, faiss.METRIC_L2)
        self.index.is_trained = True
        self.index.replace_invlists(self._stack, False)
        self.index.ntotal = total
        self._shard_of_list = reader.shard_of_list

    def search(
        self, queries: np.ndarray, k: int, assign: np.ndarray, coarse: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(distances, faiss ids, shards) of each query's best k among the lists ``assign``
        names (left-packed, -1 pads; ids -1 where fewer were found)."""
        dist, pairs = _preassigned(self.index, queries, k, assign, coarse, faiss.SearchParametersIVF(), True)
        found = pairs >= 0
        list_no = np.where(found, pairs >> 32, 0)
        ids = np.where(found, self._first[list_no] + (pairs & 0xFFFFFFFF), -1)
        return dist, ids, self._shard_of_list[list_no]


def _preassigned(
    index: Any, queries: np.ndarray, k: int, assign: np.ndarray, coarse: np.ndarray, params: Any, pairs: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """(distances, labels) of ``index.search_preassigned`` over the lists ``assign`` names
    (left-packed, -1 pads): faiss ids, or (list << 32 | offset) with ``pairs``."""
    n = len(queries)
    assign = np.ascontiguousarray(assign, dtype=np.int64)
    coarse = np.ascontiguousarray(coarse, dtype=np.float32)
    params.nprobe = assign.shape[1]
    dist = np.empty((n, k), dtype=np.float32)
    labels = np.empty((n, k), dtype=np.int64)
    index.search_preassigned_c(
        n, faiss.swig_ptr(queries), k, faiss.swig_ptr(assign), faiss.swig_ptr(coarse),
        faiss.swig_ptr(dist), faiss.swig_ptr(labels), pairs, params,
    )  # fmt: skip
    return dist, labels


def _packed(lists: np.ndarray, coarse_d: np.ndarray, mine: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The probed lists ``mine`` selects, left-packed (-1 pads), with their coarse distances."""
    if len(lists) == 1:  # the service's case: plain boolean indexing
        return lists[mine][None, :], coarse_d[mine][None, :]
    width = int(mine.sum(axis=1).max())
    order = np.argsort(~mine, axis=1, kind="stable")[:, :width]
    packed = np.where(np.take_along_axis(mine, order, 1), np.take_along_axis(lists, order, 1), -1)
    return packed, np.take_along_axis(coarse_d, order, 1)


class IndexReader:
    def __init__(
        self, store: ObjectStore, version: int | None = None, source: ShardSource | None = None, fetch_threads: int = 8
    ) -> None:
        self.store = store
        self.manifest: Manifest = load_manifest(store, version)
        raw = get_verified(store, self.manifest.centroids)
        self.centroids = load_array(raw).astype(np.float32)
        self.quantizer = faiss.IndexFlatL2(self.manifest.dim)
        self.quantizer.add(self.centroids)
        self.source = source or MemoSource()
        #: the (non-delta) shard holding each list; an incremental version's delta shards hold any list
        self.shard_of_list = np.full(self.manifest.nlist, -1, dtype=np.int64)
        self.deltas: list[int] = []
        for i, ref in enumerate(self.manifest.shards):
            if ref.delta:
                self.deltas.append(i)
            else:
                self.shard_of_list[ref.list_start : ref.list_end] = i
        self.fetch_threads = fetch_threads
        self._alive: dict[int, np.ndarray | None] = {}
        self._alive_lock = threading.Lock()
        self._combined: CombinedLists | None = None
        self._combined_lock = threading.Lock()
        self._combine_after = 0.0

    def shard(self, i: int) -> LoadedShard:
        return self.source.load(self.store, self.manifest.shards[i])

    def shards(self, numbers: Iterable[int]) -> dict[int, LoadedShard]:
        """Several shards: those in memory at once, the others fetched concurrently."""
        found: dict[int, LoadedShard] = {}
        missing = []
        for i in numbers:
            shard = self.source.cached(self.manifest.shards[i])
            if shard is None:
                missing.append(i)
            else:
                found[i] = shard
        if len(missing) == 1:
            found[missing[0]] = self.shard(missing[0])
        elif missing:
            threads = self.fetch_threads if self.manifest.codec == "flat" else RANGED_OPEN_THREADS
            found.update(zip(missing, open_pool(threads).map(self.shard, missing), strict=True))
        return found

    def holding(self, lists: np.ndarray) -> dict[int, np.ndarray]:
        """For each shard holding some of the probed ``lists`` (-1 pads): a mask over ``lists``
        of the lists it holds."""
        shard_of = np.where(lists >= 0, self.shard_of_list[np.maximum(lists, 0)], -1)
        held = {s: shard_of == s for s in sorted(set(shard_of.ravel().tolist())) if s >= 0}  # np.unique: +4 µs
        for i in self.deltas:
            ref = self.manifest.shards[i]
            mine = (lists >= ref.list_start) & (lists < ref.list_end)
            if mine.any():
                held[i] = mine
        return held

    def alive(self, s: int) -> np.ndarray | None:
        """Mask of shard ``s``'s rows that are live in this version (None: all of them): an
        incremental version names rows of shared shards whose chunks changed since as dead."""
        ref = self.manifest.shards[s]
        if ref.dead is None:
            return None
        with self._alive_lock:
            if s in self._alive:
                return self._alive[s]
        dead = load_array(get_verified(self.store, ref.dead))
        alive = np.ones(ref.count, bool)
        alive[dead] = False
        with self._alive_lock:
            return self._alive.setdefault(s, alive)

    def row_mask(
        self, s: int, shard: LoadedShard, allow: Allow | None, lists: Mapping[int, ListData] | None = None
    ) -> np.ndarray | None:
        """Which rows of shard ``s`` a search may return: live in this version and allowed.
        With ``lists`` (lists of a row-block shard that a query fetched), only those lists'
        rows are decided, from their filter columns, if ``allow`` can (``ListAllow``)."""
        over = getattr(allow, "over_lists", None)
        mask: np.ndarray | None
        if lists is not None and over is not None and shard.row_blocks:
            mask = over(s, shard, lists)
        else:
            mask = allow(s, shard) if allow is not None else None
        alive = self.alive(s)
        if alive is not None:
            mask = alive if mask is None else mask & alive
        return mask

    def probe(self, queries: np.ndarray, nprobe: int) -> tuple[np.ndarray, np.ndarray]:
        """(distances, list numbers) of the nprobe nearest lists of each query."""
        nprobe = max(1, min(nprobe, self.manifest.nlist))
        dist, lists = self.quantizer.search(np.ascontiguousarray(queries, dtype=np.float32), nprobe)
        return dist, lists

    def search(
        self,
        queries: np.ndarray,
        k: int,
        nprobe: int = 16,
        allow: Allow | None = None,
        rerank: int | None = None,
        moved: Fetched | None = None,
    ) -> list[list[Hit]]:
        """Top-k hits per query across every shard holding a probed list.

        ``allow`` restricts each shard's candidates to a mask of its faiss ids. A compressed
        index ranks ``rerank`` (default: ``default_rerank``) × k candidates by their codes,
        then the best k of them by their exact float vectors (fetched by range); ``moved``
        counts the requests and bytes its fetches took.
        """
        return [found.hits() for found in self._search(queries, k, nprobe, allow, rerank, moved, False)[0]]

    def search_arrays(
        self,
        queries: np.ndarray,
        k: int,
        nprobe: int = 16,
        allow: Allow | None = None,
        rerank: int | None = None,
        moved: Fetched | None = None,
        with_vectors: bool = False,
    ) -> tuple[list[Found], list[np.ndarray] | None]:
        """``search``'s hits as arrays, and (``with_vectors``) each query's hits' stored vectors
        (a compressed index's are those its exact re-ranking read: no second read)."""
        return self._search(queries, k, nprobe, allow, rerank, moved, with_vectors)

    def _search(
        self,
        queries: np.ndarray,
        k: int,
        nprobe: int,
        allow: Allow | None,
        rerank: int | None,
        moved: Fetched | None,
        with_vectors: bool,
    ) -> tuple[list[Found], list[np.ndarray] | None]:
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        coarse_d, lists = self.probe(queries, nprobe)
        held = self.holding(lists)
        loaded = self.shards(held)
        if self.manifest.codec != "flat":
            rerank = rerank or default_rerank(self.manifest.codec)
            return self._search_ranged(queries, lists, held, loaded, k, allow, rerank, moved, with_vectors)
        found = self._search_flat(queries, lists, coarse_d, held, loaded, k, allow)
        return found, [self.found_vectors(one) for one in found] if with_vectors else None

    def _search_flat(
        self,
        queries: np.ndarray,
        lists: np.ndarray,
        coarse_d: np.ndarray,
        held: dict[int, np.ndarray],
        loaded: dict[int, LoadedShard],
        k: int,
        allow: Allow | None,
    ) -> list[Found]:
        n = len(queries)
        masks = {s: self.row_mask(s, shard, allow) for s, shard in loaded.items()}
        found_d, found_i, found_s = [], [], []
        plain = [s for s in loaded if masks[s] is None]
        combined = self._combined_for(loaded) if len(plain) > 1 else None
        if combined is not None:  # the unfiltered shards in one call, the filtered ones below
            if len(plain) == len(loaded):
                dist, ids, shards = combined.search(queries, k, lists, coarse_d)
            else:
                mine = np.logical_or.reduce([held[s] for s in plain])
                dist, ids, shards = combined.search(queries, k, *_packed(lists, coarse_d, mine))
            found_d.append(dist)
            found_i.append(ids)
            found_s.append(shards)
            loaded = {s: shard for s, shard in loaded.items() if masks[s] is not None}
            if not loaded:  # faiss's results come sorted: nothing to merge
                return _merge(n, found_d, found_i, found_s, k)
        for s, shard in loaded.items():
            params = faiss.SearchParametersIVF()
            mask = masks[s]
            keep: Any = None
            if mask is not None:
                if not mask.any():
                    continue
                params.sel, keep = bitmap_selector(mask)
            dist, ids = _preassigned(shard.index, queries, k, *_packed(lists, coarse_d, held[s]), params)
            del keep
            found_d.append(dist)
            found_i.append(ids)
            found_s.append(np.full_like(ids, s))
        return _merge(n, found_d, found_i, found_s, k)

    def _combined_for(self, loaded: dict[int, LoadedShard]) -> CombinedLists | None:
        """Every shard's lists as one index, if every shard is in memory (built then, at
        most once a ``COMBINE_RETRY_S``), and still the one the source holds."""
        if self.deltas:
            return None
        combined = self._combined
        generation = getattr(self.source, "generation", 0)
        if (
            combined is not None
            and combined.generation == generation
            and all(combined.members.get(s) is shard for s, shard in loaded.items())
        ):
            return combined
        if combined is not None and self._combined is combined:
            self._combined = None  # stale: let its shards go
        contains = getattr(self.source, "contains", None)
        now = time.monotonic()
        if contains is None or now < self._combine_after:
            return None
        may_wait("combining the shards' lists")  # CPU, but tens of ms: not on the event loop
        with self._combined_lock:
            if time.monotonic() < self._combine_after:
                return None  # another query has just tried
            self._combined, self._combine_after = None, now + COMBINE_RETRY_S
            if not all(contains(ref) for ref in self.manifest.shards):  # no LRU touch: a peek
                return None
            members = {i: self.source.cached(ref) for i, ref in enumerate(self.manifest.shards)}
            if any(m is None or m.index is None for m in members.values()):
                return None  # evicted meanwhile, or a ranged shard
            try:
                self._combined = CombinedLists(self, members, generation)  # type: ignore[arg-type]
            except ValueError as exc:
                log.info("searching shard by shard: %s", exc)
                self._combine_after = math.inf  # this version's shards never will combine
                return None
            return self._combined

    def _search_ranged(
        self,
        queries: np.ndarray,
        lists: np.ndarray,
        held: dict[int, np.ndarray],
        loaded: dict[int, LoadedShard],
        k: int,
        allow: Allow | None,
        rerank: int,
        moved: Fetched | None,
        with_vectors: bool = False,
    ) -> tuple[list[Found], list[np.ndarray] | None]:
        """Probed lists fetched by range (every shard's at once), scanned by their codes,
        the best ``rerank`` × k re-ranked exactly (and, ``with_vectors``, each query's hits'
        exact vectors)."""
        n = len(queries)
        pool = shard_pool()
        wanted = {s: sorted({int(x) for x in lists[held[s]]}) for s in loaded}
        ready = getattr(allow, "ready", None)

        def prepare(s: int, got: dict[int, ListData] | None = None) -> tuple[dict[int, ListData], np.ndarray | None]:
            """A shard's probed lists (``got``, else fetched) and its mask over them (fetching what it needs)."""
            if got is None:
                got = loaded[s].lists.lists(wanted[s], moved)  # type: ignore[union-attr]
            return got, self.row_mask(s, loaded[s], allow, got)

        # a shard whose probed lists, and what its filter needs of them, are in memory answers
        # at once (a thread hop costs more); the others fetch side by side
        prepared: dict[int, tuple[dict[int, ListData], np.ndarray | None]] = {}
        fetching = {}
        for s, shard in loaded.items():
            assert shard.lists is not None
            if shard.lists.holds(wanted[s]):
                got = shard.lists.lists(wanted[s], moved)
                if ready is None or ready(shard, got):
                    prepared[s] = prepare(s, got)
                    continue
            fetching[s] = pool.submit(prepare, s)
        prepared.update({s: f.result() for s, f in fetching.items()})
        resident = {s: prepared[s][0] for s in loaded}  # the shards' order, whatever answered first
        masks = {s: prepared[s][1] for s in loaded}
        depth = max(k, k * rerank)
        found_d, found_i, found_s = self._scan(queries, lists, held, loaded, resident, masks, depth)
        out: list[Found] = []
        vectors: list[np.ndarray] = []
        for q, scored in enumerate(_merge(n, found_d, found_i, found_s, depth)):
            if rerank <= 1:
                out.append(Found(scored.shards[:k], scored.ids[:k], scored.distances[:k]))
                if with_vectors:
                    vectors.append(self.found_vectors(out[-1]))
                continue
            picked = list(zip(scored.shards.tolist(), scored.ids.tolist(), strict=True))
            exact, stored = self._exact(queries[q], picked, loaded, resident, moved)
            order = np.argsort(exact, kind="stable")[:k]
            out.append(Found(scored.shards[order], scored.ids[order], exact[order]))
            vectors.append(stored[order])
        return out, vectors if with_vectors else None

    def _scan(
        self,
        queries: np.ndarray,
        lists: np.ndarray,
        held: dict[int, np.ndarray],
        loaded: dict[int, LoadedShard],
        resident: dict[int, dict[int, ListData]],
        masks: dict[int, np.ndarray | None],
        depth: int,
    ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
        """Each query's best ``depth`` rows of its probed lists by their codes: one scan per
        query (and codec) over every probed shard's lists, the allowed rows' codes (``masks``)
        taken out of a list a filter restricts; each row tagged with its shard in the high bits."""
        n = len(queries)
        codecs: dict[int, tuple[ResidentLists, list[int]]] = {}
        for s, shard in loaded.items():
            ranged = shard.lists
            assert ranged is not None
            mask = masks[s]
            if mask is None or mask.any():
                codecs.setdefault(id(ranged.trained), (ranged, []))[1].append(s)
        found_d, found_i, found_s = [], [], []
        for first, members in codecs.values():
            dist = np.empty((n, depth), np.float32)
            ids = np.empty((n, depth), np.int64)
            for q in range(n):
                runs: list[CodeRun] = []
                for s in members:
                    table = loaded[s].lists.table  # type: ignore[union-attr]
                    tag, mask, mine = s << _ROW_BITS, masks[s], resident[s]
                    for list_no in lists[q][held[s][q]].tolist():
                        data = mine.get(list_no)
                        if data is None:
                            continue  # an empty list
                        start = int(table.firsts[list_no - table.list_start])
                        keep = None if mask is None else mask[start : start + len(data.codes)]
                        if keep is None or keep.all():
                            runs.append(CodeRun(data.codes, tag + start))
                        elif keep.any():
                            runs.append(CodeRun(data.codes[keep], 0, tag + start + np.flatnonzero(keep)))
                dist[q], ids[q] = scan_runs(first.codec, first.trained, queries[q], runs, depth)
            found_d.append(dist)
            found_i.append(np.where(ids >= 0, ids & ((1 << _ROW_BITS) - 1), -1))
            found_s.append(np.where(ids >= 0, ids >> _ROW_BITS, -1))
        return found_d, found_i, found_s

    def _exact(
        self,
        query: np.ndarray,
        picked: list[tuple[int, int]],
        loaded: dict[int, LoadedShard],
        resident: dict[int, dict[int, ListData]],
        moved: Fetched | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Squared L2 distances from the query to the candidates' stored float vectors, and those vectors."""
        by_shard: dict[int, list[int]] = {}
        for at, (s, _) in enumerate(picked):
            by_shard.setdefault(s, []).append(at)

        stored = np.empty((len(picked), len(query)), np.float32)
        remote: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for s, ats in by_shard.items():  # vectors a disk tier holds: read here, at once
            lists = loaded[s].lists
            assert lists is not None
            rows = np.array([picked[a][1] for a in ats], np.int64)
            digests = lists.digests_of(rows, resident[s])
            vectors = lists.local_vectors(rows, digests)
            if vectors is None:
                remote[s] = rows, digests
            else:
                stored[ats] = vectors

        def fetch(s: int) -> np.ndarray:
            lists = loaded[s].lists
            assert lists is not None
            return lists.vectors(*remote[s], moved)

        # the others, from the store: side by side
        fetched = list(shard_pool().map(fetch, remote)) if len(remote) > 1 else [fetch(s) for s in remote]
        for s, vectors in zip(remote, fetched, strict=True):
            stored[by_shard[s]] = vectors
        return np.square(stored - query[None, :]).sum(axis=1), stored

    def rows(self, hits: list[Hit], columns: list[str] | None = None) -> list[dict[str, Any]]:
        """The id-map rows (chunk version and lineage) of hits, in order, with their score."""
        positions: dict[int, list[int]] = {}
        for at, hit in enumerate(hits):
            positions.setdefault(hit.shard, []).append(at)
        out: list[dict[str, Any]] = [{} for _ in hits]
        loaded = self.shards(positions)
        blocked = [s for s in positions if loaded[s].row_blocks]

        def records(s: int) -> pa.Table:
            """The hits' rows of a row-block shard: their blocks, fetched by range."""
            lists = loaded[s].lists
            assert lists is not None
            return lists.records(np.array([hits[at].faiss_id for at in positions[s]], np.int64))

        # a cold replica's results come from several shards: their blocks are fetched side by side
        fetched = list(shard_pool().map(records, blocked)) if len(blocked) > 1 else [records(s) for s in blocked]
        for s, found in zip(blocked, fetched, strict=True):
            ats = positions[s]
            for at, row in zip(ats, table_rows(found, columns), strict=True):
                row["score"] = hits[at].score
                out[at] = row
        for s, ats in positions.items():
            if loaded[s].row_blocks:
                continue
            shard = loaded[s]
            key = ("rows", tuple(columns or ()))  # built once per shard and column set
            lookup = shard.derived.get(key)
            if lookup is None:
                table = select_present(shard.ids, columns) if columns else shard.ids
                lookup = shard.derived.setdefault(key, ColumnarRows(table))
            for at, row in zip(ats, lookup.rows([hits[at].faiss_id for at in ats]), strict=True):
                row["score"] = hits[at].score
                out[at] = row
        return out

    def vectors(self, hits: list[Hit]) -> np.ndarray:
        """The stored vectors of hits, in order (no model call needed to compare with them)."""
        if not hits:
            return np.zeros((0, self.manifest.dim), np.float32)
        if self.manifest.codec != "flat":
            return self._exact_vectors(hits)
        shards = np.array([h.shard for h in hits], np.int64)
        return self.found_vectors(Found(shards, np.array([h.faiss_id for h in hits], np.int64), np.zeros(len(hits))))

    def found_vectors(self, found: Found) -> np.ndarray:
        """The stored vectors of a float index's hits (``Found``), in order."""
        if not len(found):
            return np.zeros((0, self.manifest.dim), np.float32)
        if self.manifest.codec != "flat":
            return self.vectors(found.hits())
        out = np.empty((len(found), self.manifest.dim), np.float32)
        numbers = np.unique(found.shards)
        for s, shard in self.shards(numbers.tolist()).items():
            ats = np.flatnonzero(found.shards == s) if len(numbers) > 1 else slice(None)
            out[ats] = flat_vectors(shard, np.ascontiguousarray(found.ids[ats], dtype=np.int64))
        return out

    def _exact_vectors(self, hits: list[Hit]) -> np.ndarray:
        loaded = self.shards({h.shard for h in hits})
        picked = [(h.shard, h.faiss_id) for h in hits]
        out = np.empty((len(hits), self.manifest.dim), np.float32)
        for s, shard in loaded.items():
            assert shard.lists is not None
            ats = [i for i, (hs, _) in enumerate(picked) if hs == s]
            rows = np.array([picked[a][1] for a in ats], np.int64)
            out[ats] = shard.lists.vectors(rows, shard.lists.digests_of(rows, {}))
        return out


#: a scan over several shards' lists gives each row the id shard << _ROW_BITS | row
_ROW_BITS = 40


def _merge(
    n: int, found_d: list[np.ndarray], found_i: list[np.ndarray], found_s: list[np.ndarray], k: int
) -> list[Found]:
    """Each query's best k over every shard's results (-1 ids are pads)."""
    if not found_d:
        none = np.zeros(0, np.int64)
        return [Found(none, none, np.zeros(0, np.float32)) for _ in range(n)]
    if len(found_d) == 1:  # one scan's results: sorted already
        dist, ids, shards = found_d[0][:, :k], found_i[0][:, :k], found_s[0][:, :k]
    else:
        ids = np.concatenate(found_i, axis=1)
        dist = np.where(ids >= 0, np.concatenate(found_d, axis=1), np.inf)
        best = np.argsort(dist, axis=1, kind="stable")[:, :k]
        dist, ids = np.take_along_axis(dist, best, 1), np.take_along_axis(ids, best, 1)
        shards = np.take_along_axis(np.concatenate(found_s, axis=1), best, 1)
    real = ids >= 0
    return [Found(shards[q][real[q]].astype(np.int64), ids[q][real[q]], dist[q][real[q]]) for q in range(n)]


def take_rows(table: pa.Table, indices: list[int], columns: list[str] | None = None) -> list[dict[str, Any]]:
    """Rows ``indices`` of a table as dicts (one take for all of them; optionally some columns)."""
    if not indices:
        return []
    if columns:
        table = select_present(table, columns)
    return table_rows(table.take(pa.array(indices, pa.int64())))


def table_rows(table: pa.Table, columns: list[str] | None = None) -> list[dict[str, Any]]:
    """Every row of a table as dicts (optionally some columns)."""
    if columns:
        table = select_present(table, columns)
    values = {name: python_values(table.column(name)) for name in table.column_names}
    return [dict(zip(values, row, strict=True)) for row in zip(*values.values(), strict=True)]


_UTC = ZoneInfo("UTC")
_UTC_EPOCH = datetime(1970, 1, 1, tzinfo=_UTC)


def python_values(column: pa.ChunkedArray | pa.Array) -> list[Any]:
    """A column's values as Python objects, as ``to_pylist`` gives them. UTC microsecond
    timestamps are built from their integers: pyarrow converts each through the time zone,
    which cost half of a search result's lineage lookup (32 of 61 µs for 10 rows)."""
    kind = column.type
    if pa.types.is_timestamp(kind) and kind.tz == "UTC" and kind.unit == "us":
        return [None if us is None else _UTC_EPOCH + timedelta(microseconds=us)
                for us in column.cast(pa.int64()).to_pylist()]  # fmt: skip
    values: list[Any] = column.to_pylist()
    return values


class ColumnarRows:
    """Rows of a table as dicts, as :func:`take_rows` gives them, read straight from the
    columns' buffers: a string is its slice of the data buffer, a number an element of a
    zero-copy numpy view. A search's lineage lookup (10 rows of 13 columns) took 90–120 µs
    per shard through ``Table.take`` and ``to_pylist`` (pyarrow's fixed cost per column),
    and 30 µs this way. Nothing is copied but the validity of columns with nulls (a byte a
    row), UTC timestamps as integers and numbers with nulls; a column of several chunks, or
    of another type, goes through ``take``."""

    def __init__(self, table: pa.Table) -> None:
        self.names = table.column_names
        self._columns = [_column_values(column) for column in table.columns]

    def rows(self, indices: list[int]) -> list[dict[str, Any]]:
        if not indices:
            return []
        at = np.asarray(indices, dtype=np.int64)
        values = [column(at) for column in self._columns]
        return [dict(zip(self.names, row, strict=True)) for row in zip(*values, strict=True)]


def _column_values(column: pa.ChunkedArray) -> Callable[[np.ndarray], list[Any]]:
    """A function from row numbers to the column's Python values at them."""
    kind = column.type
    if column.num_chunks != 1:
        return lambda at: python_values(column.take(pa.array(at)))
    array = column.chunk(0)
    valid = np.asarray(array.is_valid()) if array.null_count else None

    def with_nulls(values: list[Any], at: np.ndarray) -> list[Any]:
        if valid is None:
            return values
        return [v if ok else None for v, ok in zip(values, valid[at].tolist(), strict=True)]

    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        buffers = array.buffers()
        width = np.int32 if pa.types.is_string(kind) else np.int64
        offsets = np.frombuffer(buffers[1], dtype=width)[array.offset : array.offset + len(array) + 1]
        data = memoryview(buffers[2] if buffers[2] is not None else b"")

        def strings(at: np.ndarray) -> list[Any]:
            starts, ends = offsets[at].tolist(), offsets[at + 1].tolist()
            return with_nulls([str(data[a:b], "utf-8") for a, b in zip(starts, ends, strict=True)], at)

        return strings
    if pa.types.is_timestamp(kind) and kind.tz == "UTC" and kind.unit == "us":
        micros = array.cast(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False)
        return lambda at: with_nulls([_UTC_EPOCH + timedelta(microseconds=us) for us in micros[at].tolist()], at)
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        numbers = (array.fill_null(0) if valid is not None else array).to_numpy(zero_copy_only=False)
        return lambda at: with_nulls(numbers[at].tolist(), at)
    return lambda at: python_values(array.take(pa.array(at)))


def select_present(table: pa.Table, columns: list[str]) -> pa.Table:
    """The named columns a table has (an index built before a column existed lacks it)."""
    names = set(table.schema.names)  # once: ``column_names`` builds a new list at every call
    return table.select([c for c in columns if c in names])
