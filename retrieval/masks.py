"""Per-shard filter masks: which entries of an index shard a query may return.

An entry is excluded if the caller's groups do not admit it (ACL), if the tail holds a
newer version of its chunk (superseded: updated, re-permissioned or deleted since the
index was built), or if it does not match the request's metadata filter. Masks are
memoised on the shard (bounded), keyed by exactly what determines them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from indexing.reader import LoadedShard
from retrieval.acl import acl_mask
from retrieval.filters import MetadataFilter
from retrieval.tail import TailState


def shard_filter(
    tail: TailState, groups: frozenset[str], where: MetadataFilter | None = None
) -> Callable[[int, LoadedShard], np.ndarray | None]:
    """The allow-mask function a reader applies to each shard it scans (None = all allowed)."""
    superseded = tail.superseded
    # The superseded set is a function of the lake versions the tail covers, (base, version]:
    # two tails over the same range hold the same set. A generation number is no such key:
    # an ``as_of`` tail and the live tail can both be generation 1 of one base.
    stamp = (tail.base_version, tail.version)
    filter_key = ("metadata", where.key) if where is not None else None  # once per query, not per shard

    def matching(shard: LoadedShard) -> np.ndarray:
        assert where is not None
        ids = shard.ids  # an index built before metadata existed has no such column: nothing matches
        return where.mask(ids.column("metadata") if "metadata" in ids.column_names else None, ids.num_rows)

    def allow(_: int, shard: LoadedShard) -> np.ndarray | None:
        visible = _memo(shard, ("acl", groups), lambda: acl_mask(shard.ids.column("acl"), groups))
        mask = None if visible.all() else visible
        if filter_key is not None:
            matches = _memo(shard, filter_key, lambda: matching(shard))
            mask = matches if mask is None else mask & matches
        if superseded:
            stale = _memo(shard, ("superseded", stamp), lambda: _superseded(shard, superseded))
            if stale.any():
                mask = ~stale if mask is None else mask & ~stale
        return mask

    return allow


def _superseded(shard: LoadedShard, ids: frozenset[str]) -> np.ndarray:
    found = pc.is_in(shard.ids.column("chunk_id"), value_set=pa.array(sorted(ids), pa.string()))
    return np.asarray(pc.fill_null(found, False).to_numpy(zero_copy_only=False), dtype=bool)


_MEMO_LOCK = threading.Lock()
_MEMO_SIZE = 64


def _memo(shard: LoadedShard, key: tuple[Any, ...], make: Callable[[], np.ndarray]) -> np.ndarray:
    """Per-shard memo of filter masks (bounded; the oldest entries go first)."""
    found = shard.derived.get(key)
    if found is None:
        found = make()
        with _MEMO_LOCK:
            if key[0] == "superseded":  # only the newest tail's mask is worth keeping
                for old in [k for k in shard.derived if k[0] == "superseded"]:
                    del shard.derived[old]
            shard.derived[key] = found
            while len(shard.derived) > _MEMO_SIZE:
                del shard.derived[next(iter(shard.derived))]
    return found
