"""Per-shard filter masks: which entries of an index shard a query may return.

An entry is excluded if the caller's groups do not admit it (ACL), if the tail holds a
newer version of its chunk (superseded: updated, re-permissioned or deleted since the
index was built), or if it does not match the request's metadata filter. Masks are
memoised on the shard (bounded), keyed by exactly what determines them.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np

from indexing.lists import ListData, key_hashes
from indexing.reader import LoadedShard
from retrieval.acl import acl_mask
from retrieval.filters import MetadataFilter, table_mask
from retrieval.tail import INF_VERSION, TailState


class ShardFilter:
    """The allow-mask a reader applies to each shard it scans (None = all allowed): over a
    shard's whole id map (``__call__``), or over some lists of a row-block shard from their
    filter columns (``over_lists``: no id map is read; a metadata filter reads those lists'
    row blocks)."""

    def __init__(self, tail: TailState, groups: frozenset[str], where: MetadataFilter | None = None) -> None:
        self.tail = tail
        self.groups = groups
        self.where = where
        self.filter_key = ("metadata", where.key) if where is not None else None  # once per query, not per shard
        self.stale_any = tail.supersedes_any
        self._keys: tuple[_SupersededKeys | None] | None = None  # the tail's, once per query

    def _superseded_keys(self) -> _SupersededKeys | None:
        if self._keys is None:
            self._keys = (_superseded(self.tail),)
        return self._keys[0]

    def _matching(self, shard: LoadedShard) -> np.ndarray:
        assert self.where is not None
        return table_mask(self.where, shard.ids)  # an index built before metadata existed: nothing matches

    def __call__(self, _: int, shard: LoadedShard) -> np.ndarray | None:
        groups = self.groups
        visible = _memo(shard, ("acl", groups), lambda: _restricting(acl_mask(shard.ids.column("acl"), groups)))
        mask = visible if visible.size else None
        if self.filter_key is not None:
            matches = _memo(shard, self.filter_key, lambda: self._matching(shard))
            mask = matches if mask is None else mask & matches
        if self.stale_any:
            stale = _stale(shard, self.tail)
            if stale is not None:
                mask = ~stale if mask is None else mask & ~stale
        return mask

    def over_lists(self, _: int, shard: LoadedShard, lists: Mapping[int, ListData]) -> np.ndarray | None:
        """The mask for the rows of ``lists`` (lists of a row-block shard a query fetched,
        with their filter columns); rows of other lists are left out (the scan reads only
        these lists)."""
        resident = shard.lists
        assert resident is not None
        groups = self.groups
        admitted = _memo(shard, ("acl-numbers", groups), lambda: acl_mask(resident.acls(), groups))
        restricted = not admitted.all()
        stale_keys = self._superseded_keys() if self.stale_any else None
        mask = None
        if restricted or stale_keys is not None:
            rows, acl, keys = resident.columns_of(lists)
            ok = admitted[acl] if restricted else np.ones(len(rows), bool)
            if stale_keys is not None:
                ok &= ~stale_keys.stale(keys, self.tail.version)
            if not ok.all():
                mask = np.zeros(resident.table.firsts[-1] + resident.table.counts[-1], bool)
                mask[rows] = ok
        if self.filter_key is not None:
            rows, matches = self._matching_lists(shard, lists)
            if mask is None:
                mask = np.zeros(resident.table.firsts[-1] + resident.table.counts[-1], bool)
                mask[rows] = matches
            else:
                mask[rows] &= matches
        return mask

    def ready(self, shard: LoadedShard, lists: Mapping[int, ListData]) -> bool:
        """Whether ``over_lists`` can decide these lists without fetching (their metadata
        matches are remembered, or no metadata filter)."""
        if self.filter_key is None:
            return True
        memo = shard.derived.get((*self.filter_key, "lists"))
        return memo is not None and all(n in memo for n in lists)

    def matching_rows(self, shard: LoadedShard, rows: np.ndarray) -> np.ndarray:
        """Whether each of ``rows`` of a row-block shard matches the metadata filter, from
        their row blocks (fetched by range), not the whole id map."""
        assert shard.lists is not None and self.where is not None
        return table_mask(self.where, shard.lists.records(rows, columns=["metadata"]))

    def _matching_lists(self, shard: LoadedShard, lists: Mapping[int, ListData]) -> tuple[np.ndarray, np.ndarray]:
        """(rows, whether each matches the metadata filter) of ``lists``, decided from those
        rows' id-map blocks, fetched by range (the whole id map is never read); remembered per
        list and filter."""
        resident = shard.lists
        assert resident is not None and self.filter_key is not None
        table = resident.table
        memo: dict[int, np.ndarray] = _memo(shard, (*self.filter_key, "lists"), dict)
        at = {n: n - table.list_start for n in lists}
        ranges = {n: (int(table.firsts[i]), int(table.counts[i])) for n, i in at.items()}
        missing = [n for n in ranges if n not in memo]
        if missing:
            rows = np.concatenate([np.arange(f, f + c, dtype=np.int64) for f, c in (ranges[n] for n in missing)])
            matches = self.matching_rows(shard, rows)
            start = 0
            for n in missing:
                memo[n] = matches[start : start + ranges[n][1]]
                start += ranges[n][1]
        if not ranges:
            return np.zeros(0, np.int64), np.zeros(0, bool)
        rows = np.concatenate([np.arange(f, f + c, dtype=np.int64) for f, c in ranges.values()])
        return rows, np.concatenate([memo[n] for n in ranges])


def shard_filter(tail: TailState, groups: frozenset[str], where: MetadataFilter | None = None) -> ShardFilter:
    """The allow-mask a reader applies to each shard it scans (None = all allowed)."""
    return ShardFilter(tail, groups, where)


#: a memoised ACL mask that restricts nothing (checking a whole mask per query cost more
#: than the rest of the filter)
_ALL_VISIBLE = np.zeros(0, bool)


def _restricting(visible: np.ndarray) -> np.ndarray:
    """The mask, or an empty one when it allows every row."""
    return _ALL_VISIBLE if visible.all() else visible


class _Staleness:
    """When each entry of a shard became stale, for the tails of one base version.

    ``since[row]`` is the first lake version after the base that wrote a newer version of
    the row's chunk (never: the maximum int64). The tail's lake history after its base is
    the same for every tail of that base (live or ``as_of``), so one array serves them all:
    a tail at version V excludes the rows with ``since <= V``. Each commit is applied once,
    by looking its chunk ids up (a hash → row table built when the shard is first used).
    """

    def __init__(self, shard: LoadedShard, base: int) -> None:
        ids = shard.ids.column("chunk_id")
        self.ids = ids.to_pylist()
        hashes = np.fromiter((hash(i) for i in self.ids), np.int64, len(self.ids))
        self.order = np.argsort(hashes, kind="stable")
        self.hashes = hashes[self.order]
        self.since = np.full(len(self.ids), INF_VERSION, np.int64)
        self.applied = base  # commits up to this lake version are in ``since``
        self.masks: dict[int, np.ndarray | None] = {}
        self.lock = threading.Lock()

    def rows(self, chunk_ids: list[str]) -> list[int]:
        wanted = np.fromiter((hash(i) for i in chunk_ids), np.int64, len(chunk_ids))
        lo = np.searchsorted(self.hashes, wanted, "left")
        hi = np.searchsorted(self.hashes, wanted, "right")
        found: list[int] = []
        for chunk_id, a, b in zip(chunk_ids, lo.tolist(), hi.tolist(), strict=True):
            found.extend(int(r) for r in self.order[a:b] if self.ids[r] == chunk_id)  # hash collisions checked
        return found

    def mask(self, tail: TailState) -> np.ndarray | None:
        with self.lock:
            if tail.version > self.applied:
                for version, chunk_ids in tail.superseding(self.applied):
                    rows = self.rows(chunk_ids)
                    if rows:
                        self.since[rows] = np.minimum(self.since[rows], version)
                self.applied = tail.version
            if tail.version not in self.masks:
                stale = self.since <= tail.version
                self.masks[tail.version] = stale if stale.any() else None
                while len(self.masks) > 4:  # the live tail's few newest versions, and an as_of or two
                    del self.masks[next(iter(self.masks))]
            return self.masks[tail.version]


class _SupersededKeys:
    """The chunk-id hashes (``indexing.lists.key_hashes``) of the chunks a tail log holds
    newer versions of, each with the first lake version after the base that wrote one: a
    row-block shard's rows are stale at version V where their hash maps to a version <= V.
    One per tail log (its snapshots, live or ``as_of``, share it), extended commit by commit."""

    def __init__(self, base: int) -> None:
        self.keys = np.zeros(0, np.int64)
        self.since = np.zeros(0, np.int64)
        self.applied = base
        self.lock = threading.Lock()

    def update(self, tail: TailState) -> _SupersededKeys | None:
        with self.lock:
            if tail.version > self.applied:
                new = tail.superseding(self.applied)
                if new:
                    keys = np.concatenate([self.keys, *(key_hashes(ids) for _, ids in new)])
                    since = np.concatenate([self.since, *(np.full(len(ids), v, np.int64) for v, ids in new)])
                    order = np.lexsort((since, keys))  # a hash's first entry is its earliest version
                    self.keys, self.since = keys[order], since[order]
                self.applied = tail.version
        return self if len(self.keys) else None

    def stale(self, keys: np.ndarray, version: int) -> np.ndarray:
        """Which of the hashes are stale at ``version``."""
        held, since = self.keys, self.since  # replaced whole by update, never changed in place
        at = np.minimum(np.searchsorted(held, keys), len(held) - 1)
        stale: np.ndarray = (held[at] == keys) & (since[at] <= version)
        return stale


_SUPERSEDED: weakref.WeakKeyDictionary[Any, _SupersededKeys] = weakref.WeakKeyDictionary()


def _superseded(tail: TailState) -> _SupersededKeys | None:
    """The tail's superseded chunk-id hashes up to its version (None: none)."""
    with _MEMO_LOCK:
        found = _SUPERSEDED.get(tail.log)
        if found is None:
            found = _SUPERSEDED[tail.log] = _SupersededKeys(tail.base_version)
    return found.update(tail)


def _stale(shard: LoadedShard, tail: TailState) -> np.ndarray | None:
    """Entries of the shard that the tail holds a newer version of (None: none)."""
    key = ("stale", tail.base_version)
    staleness: _Staleness | None = shard.derived.get(key)
    if staleness is None:
        made = _Staleness(shard, tail.base_version)  # outside the lock: it hashes every chunk id once
        with _MEMO_LOCK:
            staleness = shard.derived.setdefault(key, made)
    return staleness.mask(tail)


_MEMO_LOCK = threading.Lock()
_MEMO_SIZE = 64
_T = TypeVar("_T")


def _memo(shard: LoadedShard, key: tuple[Any, ...], make: Callable[[], _T]) -> _T:
    """Per-shard memo of filter masks (bounded; the oldest entries go first)."""
    found = shard.derived.get(key)
    if found is None:
        found = make()
        with _MEMO_LOCK:
            shard.derived[key] = found
            while len(shard.derived) > _MEMO_SIZE:
                oldest = next(k for k in shard.derived if k[0] != "stale")  # staleness is kept: it is incremental
                del shard.derived[oldest]
    return found
