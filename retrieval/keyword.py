"""Keyword (BM25) search over a view: the index version's keyword index plus the fresh tail.

Each (index version, tail log) pair a replica searches gets a working copy of the
version's keyword index (``indexing.keyword``) to which the replica adds, once, the
version's delta rows (an incremental build) and, as the tail grows, its rows: a copy is
brought up to a snapshot's rows before the snapshot is searched, so a changed document is
found by keyword as soon as the tail has it, and at work proportional to the new rows.

What a caller may see is decided exactly as for dense search. Inside tantivy's scan: the
caller's groups (ACL terms). Then an index row must be live in the version (an incremental
build's dead rows: a small file per shard) and not superseded at the snapshot's version:
each copy notes, as the tail's commits arrive, the keys of the index rows whose chunks they
changed (one lookup by chunk id per changed chunk, on the tail's thread) and the version
from which each is stale, so ``as_of`` snapshots of the same log see the rows current then.
Only a metadata filter opens the matching rows' shards (the metadata is in their id maps):
a keyword query otherwise moves no shard bytes until its results are read. A tail row must
be in the snapshot (``as_of`` snapshots see a prefix), the newest version of its chunk,
visible and matching. When too few candidates pass, the search widens (4× deeper, up to
every match), so a caller who can see ``depth`` matches gets them.

Superseded index rows are not excluded inside tantivy's scan (a term set of their chunk
ids): that cost every query time in proportion to the tail (0.25 ms for 10 chunk ids,
0.65 ms for 100, on 300 documents), where the noted keys cost one lookup per candidate.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import weakref
from pathlib import Path

import numpy as np

from indexing.keyword import (
    TAIL,
    KeywordIndex,
    Matches,
    document,
    fetch_pristine,
    query_names,
    shard_documents,
    terms,
    working_copy,
)
from indexing.reader import Allow, IndexReader, LoadedShard
from retrieval.ranking import SHARD_SHIFT, Ranking, empty, tail_keys
from retrieval.tail import TailLog, TailState
from serving.waiting import may_wait

log = logging.getLogger(__name__)

NEVER = np.iinfo(np.int64).max

#: the first keyword search fetches depth + this many candidates before widening: ACLs are
#: filtered inside the scan, so only superseded or dead index rows, a tail row's newer
#: versions and metadata filters can reject one
SLACK = 16


class _Copy:
    """One working copy: the version's keyword index, its delta rows, and tail rows [0, rows)."""

    def __init__(self, index: KeywordIndex, base_version: int) -> None:
        self.index = index
        self.rows = 0
        #: index row key → the lake version from which a newer version of its chunk supersedes it,
        #: for the tail's commits up to ``stale_upto`` (one lookup by chunk id per newly changed chunk)
        self.stale: dict[int, int] = {}
        self.stale_upto = base_version
        self.lock = threading.Lock()
        self._cleanup = weakref.finalize(self, _remove, index.path)

    def sync(self, tail: TailState) -> None:
        """Add the snapshot's tail rows this copy lacks (deletes carry no text: not indexed), and
        note which index rows its commits superseded."""
        if self.rows >= tail.n and self.stale_upto >= tail.version:
            return  # without the lock: the tail's thread holds it while it commits the next state
        may_wait("adding the tail's new rows to the keyword copy")  # a commit, or the tail's thread's
        with self.lock:
            start = self.rows
            if start < tail.n:
                rows = tail.table.slice(start, tail.n - start).select(["op", "title", "text", "acl"]).to_pydict()
                self.index.add(
                    document(TAIL | (start + j), title, text, acl)
                    for j, (op, title, text, acl) in enumerate(
                        zip(rows["op"], rows["title"], rows["text"], rows["acl"], strict=True)
                    )
                    if op == "upsert"
                )
                self.rows = tail.n
            if self.stale_upto < tail.version:
                for version, chunk_ids in tail.superseding(self.stale_upto):
                    for key in self.index.keys_of(chunk_ids):
                        self.stale.setdefault(key, version)
                self.stale_upto = tail.version

    def current(self, key: int, version: int) -> bool:
        """Whether index row ``key`` is still its chunk's newest version at lake ``version``."""
        return self.stale.get(key, NEVER) > version


class _Slot:
    """Where a view's copy is made once: its lock is held while the copy is made."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.copy: _Copy | None = None


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


#: where working copies go while they fit ``memory_bytes``: a tmpfs, where the commit that adds
#: each tail update (on the tail's thread, before queries see the update) skips the disk's fsync
MEMORY_DIR = Path("/dev/shm")


#: a replica's directory in ``MEMORY_DIR``: this, its process id, "-", a random part
MEMORY_PREFIX = "streamrag-keyword-"


def _sweep_dead(memory_dir: Path) -> None:
    """Remove the in-memory copies of replicas that died without closing them (killed, out of
    memory): memory that nothing else would ever give back."""
    for path in memory_dir.glob(f"{MEMORY_PREFIX}*-*"):
        pid = path.name[len(MEMORY_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            log.info("removing %s: the replica that made it is gone", path)
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # alive, someone else's
            pass


class KeywordCopies:
    """The keyword working copies of one replica, under one local directory (and in memory
    while they fit ``memory_bytes``)."""

    def __init__(self, root: Path | None = None, memory_bytes: int = 0, memory_dir: Path = MEMORY_DIR) -> None:
        #: pristine copies live here (kept across restarts when ``root`` is given); working copies in
        #: ``work`` below it, or in ``memory_dir``. All are made on first use: a dense-only replica
        #: writes nothing.
        self.temporary = root is None
        self._root = root
        self._work: Path | None = None
        self._dirs = threading.Lock()
        self.memory_bytes = memory_bytes
        self._memory_dir = memory_dir
        self._memory_work: Path | None = None
        self.in_memory = 0  # bytes the working copies in memory hold against ``memory_bytes``
        self._copies: weakref.WeakKeyDictionary[TailLog, dict[str, _Slot]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()  # held only to look up slots: a copy is made under its slot's lock
        self._making = 0  # copies being made (prepare deletes no pristine directory meanwhile)
        self._checked: set[Path] = set()  # pristine directories verified by this process

    @property
    def root(self) -> Path:
        with self._dirs:
            if self._root is None:
                self._root = Path(tempfile.mkdtemp(prefix="streamrag-keyword-"))
            self._root.mkdir(parents=True, exist_ok=True)
            return self._root

    @property
    def work(self) -> Path:
        root = self.root
        with self._dirs:
            if self._work is None:
                self._work = Path(tempfile.mkdtemp(prefix="work-", dir=root))
            return self._work

    def copy_for(self, reader: IndexReader, tail: TailState) -> _Copy:
        """The working copy for this view, made on first use and brought up to ``tail``. Making
        one (an ``as_of`` view of an older version fetches its files) blocks only the queries
        of that view, not those of others."""
        build = reader.manifest.build_id
        with self._lock:
            slot = self._copies.setdefault(tail.log, {}).setdefault(build, _Slot())
        found = slot.copy
        if found is None:
            may_wait("making a keyword working copy")
            with slot.lock:
                found = slot.copy
                if found is None:
                    with self._lock:
                        self._making += 1
                    try:
                        found = slot.copy = self._make(reader, tail.base_version)
                    finally:
                        with self._lock:
                            self._making -= 1
        found.sync(tail)
        return found

    def sync_existing(self, reader: IndexReader, tail: TailState) -> None:
        """Bring this view's copy up to ``tail`` if it exists (the tail's thread calls this with
        each new state before queries see it, so no query pays for the new rows)."""
        with self._lock:
            slot = self._copies.get(tail.log, {}).get(reader.manifest.build_id)
        if slot is not None and slot.copy is not None:
            slot.copy.sync(tail)

    def prepare(self, reader: IndexReader) -> None:
        """Fetch the served version's keyword files ahead of its first query, and delete other
        versions' files (working copies keep theirs: hard links; an ``as_of`` view of an older
        version fetches its own again)."""
        if not reader.manifest.keyword:
            return
        keep = fetch_pristine(reader.store, reader.manifest.keyword, self.root, self._checked)
        with self._lock:
            if self._making:  # a copy may be linking files from what would go: the next version deletes them
                return
            for old in self.root.glob("pristine-*"):
                if old != keep:
                    self._checked.discard(old)
                    shutil.rmtree(old, ignore_errors=True)

    def _place(self, pristine: Path) -> tuple[Path, int]:
        """Where a working copy of ``pristine`` goes, and the bytes it holds in memory: memory (a
        full copy) while twice its size fits the budget (the tail's segments and their merges
        grow it) and the file system there has four times its size free; else beside the
        pristine copy (hard links)."""
        size = sum(f.stat().st_size for f in pristine.iterdir() if f.is_file())
        held = 2 * size
        with self._dirs:
            if self.memory_bytes and self.in_memory + held <= self.memory_bytes:
                try:
                    if self._memory_work is None:
                        _sweep_dead(self._memory_dir)
                        self._memory_work = Path(
                            tempfile.mkdtemp(prefix=f"{MEMORY_PREFIX}{os.getpid()}-", dir=self._memory_dir)
                        )
                    memory = self._memory_work
                    fits = shutil.disk_usage(memory).free >= 4 * size
                except OSError:  # no such file system here
                    fits = False
                if fits:
                    self.in_memory += held
                    return memory, held
        return self.work, 0

    def _release(self, held: int) -> None:
        with self._dirs:
            self.in_memory -= held

    def _make(self, reader: IndexReader, base_version: int) -> _Copy:
        manifest = reader.manifest
        pristine = fetch_pristine(reader.store, manifest.keyword, self.root, self._checked)
        where, held = self._place(pristine)
        try:
            copy = _Copy(working_copy(pristine, where), base_version)
        except BaseException:
            self._release(held)
            raise
        if held:
            weakref.finalize(copy, self._release, held)
        deltas = [s for s, ref in enumerate(manifest.shards) if ref.delta]
        for s, shard in reader.shards(deltas).items():  # an incremental version's rows the base's index lacks
            copy.index.add(shard_documents(s, shard.ids))
        return copy

    def close(self) -> None:
        with self._lock:
            self._copies = weakref.WeakKeyDictionary()
            doomed = [self._root if self.temporary else self._work, self._memory_work]
            self._work = self._memory_work = None
        for path in doomed:
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)


def keyword_search(
    copies: KeywordCopies,
    reader: IndexReader,
    tail: TailState,
    query: str,
    depth: int,
    groups: frozenset[str],
    allow: Allow | None,
    tail_allowed: np.ndarray,
) -> Ranking:
    """The ``depth`` best keyword matches the caller may see, best first (``allow``: the dense
    path's shard masks when a metadata filter needs them, else None)."""
    wanted, names = terms(query), query_names(query)
    if not wanted and not names:
        return empty()
    copy = copies.copy_for(reader, tail)
    limit = depth + SLACK
    while True:
        matches = copy.index.search(wanted, groups, limit, names)
        found = _visible(reader, tail, copy, matches, allow, tail_allowed)
        if len(found) >= depth or len(matches) < limit:
            return found.head(depth)
        limit *= 4


def _filtered(reader: IndexReader, s: int, shard: LoadedShard, allow: Allow, rows: np.ndarray) -> np.ndarray | None:
    """Shard ``s``'s mask for a metadata filter. Of a row-block shard, only the matched
    ``rows`` are decided, from their row blocks (fetched by range: not the whole id map); the
    keyword search itself applied the ACL, and ``copy.current`` the superseded rows."""
    matching_rows = getattr(allow, "matching_rows", None)
    if matching_rows is None or not shard.row_blocks:
        return reader.row_mask(s, shard, allow)
    rows = np.unique(rows)
    mask = np.zeros(int(rows[-1]) + 1 if len(rows) else 0, bool)
    mask[rows] = matching_rows(shard, rows)
    alive = reader.alive(s)
    return mask if alive is None else mask & alive[: len(mask)]


def _visible(
    reader: IndexReader,
    tail: TailState,
    copy: _Copy,
    matches: Matches,
    allow: Allow | None,
    tail_allowed: np.ndarray,
) -> Ranking:
    """The matches the caller may see, in order, as a ``Ranking``."""
    keys = matches.keys
    in_tail = keys >= np.uint64(TAIL)
    keep = np.zeros(len(keys), bool)
    rows = (keys[in_tail] - np.uint64(TAIL)).astype(np.int64)
    keep[in_tail] = _flags(tail_allowed[: tail.n], rows)  # a row past the snapshot is not in it
    index_at = np.flatnonzero(~in_tail)
    index_keys = keys[index_at].astype(np.int64)
    if copy.stale:  # rows that the tail's commits superseded by this snapshot's version
        current = np.fromiter((copy.current(key, tail.version) for key in index_keys.tolist()), bool, len(index_keys))
        index_at, index_keys = index_at[current], index_keys[current]
    shards = index_keys >> SHARD_SHIFT
    fids = index_keys & ((1 << SHARD_SHIFT) - 1)
    numbers = np.unique(shards).tolist()
    loaded = reader.shards(numbers) if allow is not None else {}  # a metadata filter: the id maps hold the metadata
    for s in numbers:
        ours = shards == s
        mask = _filtered(reader, s, loaded[s], allow, fids[ours]) if allow is not None else reader.alive(s)
        keep[index_at[ours]] = True if mask is None else _flags(mask, fids[ours])
    out = keys.astype(np.int64)  # an index row's key is its ranking key (a tail row's: below)
    out[in_tail] = tail_keys(rows)
    found = np.flatnonzero(keep)
    return Ranking(matches.scores[found], out[found])


def _flags(mask: np.ndarray, at: np.ndarray) -> np.ndarray:
    """``mask[at]``, False where ``at`` is past its end."""
    inside = at < len(mask)
    out = np.zeros(len(at), bool)
    out[inside] = mask[at[inside]]
    return out
