"""What a replica serves: the index version and the tail after it, kept current, and views at any version.

:class:`Views` owns the serving state: it loads the newest index version, follows the
lake's tail, switches to newer versions as they are published (prefetching them first),
reports health, and resolves ``as_of`` requests to the view the service would have had
then. State is swapped whole: a query takes the tail, then the index reader
(:meth:`Views.current_view`), and searches that pair even while a new index version or
tail replaces them.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from indexing.manifest import ManifestError, latest_version, load_manifest, versions
from indexing.reader import IndexReader, ShardSource
from indexing.store import NotFound, ObjectStore
from pipelines.caches import LRU
from pipelines.context import query_model
from pipelines.lake import Lake
from retrieval import metrics
from retrieval.delta_log import TailError
from retrieval.errors import SearchError
from retrieval.keyword import KeywordCopies
from retrieval.tail import LakeTail, TailState, tail_at
from serving.embedder import Embedder

log = logging.getLogger(__name__)


#: the keyword ranking's default weights for each fusion (the dense ranking's is 1): a plain
#: sentence's, a sentence's that holds a code-like token, an identifier's. Each fusion scales
#: differently (a weight over rank + 10, a weight over a score in [0, 1]), so each has its own,
#: chosen by benchmarks/quality.py on dev halves of its query sets
FUSION_WEIGHTS: dict[str, dict[str, float]] = {
    "linear": {"keyword_weight": 0.75, "code_weight": 2.0, "identifier_weight": 3.0},
    "rrf": {"keyword_weight": 0.1, "code_weight": 1.5, "identifier_weight": 1.5},
}


def fusion_options(fusion: str, **weights: float | None) -> dict[str, Any]:
    """EngineOptions fields for ``fusion``: its default keyword weights, but those ``weights`` set."""
    chosen = {name: value for name, value in weights.items() if value is not None}
    return {"fusion": fusion, **FUSION_WEIGHTS[fusion], **chosen}


@dataclass(frozen=True)
class EngineOptions:
    #: lists probed per query; None = auto (see default_nprobe)
    nprobe: int | None = None
    #: a compressed index re-ranks this many × k candidates exactly (its float vectors, by
    #: range); None: by codec (indexing.reader.default_rerank: 4 for sq8/sq4, 10 for pqM)
    rerank: int | None = None
    max_k: int = 100
    max_query_chars: int = 4096
    tail_poll_s: float = 0.5
    index_poll_s: float = 5.0
    #: fetch every shard of a new index version before switching to it (if the cache can hold it)
    prefetch: bool = True
    prefetch_bytes: int = 2 << 30
    #: how /v1/search ranks when a request does not say: "hybrid", "dense" or "keyword"
    mode: str = "hybrid"
    #: hybrid: each retriever's candidates (at least k), and the fusion's constant and weights
    #: (chosen on dev halves of the Python docs' query sets: benchmarks/quality.py, fusion_choice
    #: and keyword_depth_choice). The keyword ranking's depth sets the floor of its min-max
    #: normalisation: at 15 rather than 100 a middling BM25 match no longer takes most of the
    #: keyword weight (FAQ nDCG@10 0.689 against 0.678, the other sets level or better), and
    #: tantivy collects fewer candidates
    fusion_depth: int = 100
    keyword_depth: int = 15
    #: "linear" (weights × scores min-max normalised per ranking) or "rrf" (reciprocal rank)
    fusion: str = "linear"
    rrf_k: int = 10
    dense_weight: float = 1.0
    #: hybrid: pseudo-relevance feedback (Rocchio): the query vector plus ``feedback_weight`` ×
    #: the mean vector of the ``feedback_docs`` nearest dense candidates (chunks the caller may
    #: see), unit length, ranks those candidates again (0: off). Chosen by benchmarks/quality.py
    #: (feedback_choice)
    feedback_docs: int = 1
    feedback_weight: float = 1.0
    #: the keyword ranking's weight for a plain sentence
    keyword_weight: float = FUSION_WEIGHTS["linear"]["keyword_weight"]
    #: the keyword ranking's weight for a query that is an identifier, not a sentence (``os.replace``,
    #: ``dirs_exist_ok``: indexing.keyword.identifier_query), whose definition BM25 finds and dense misses
    identifier_weight: float = FUSION_WEIGHTS["linear"]["identifier_weight"]
    #: the keyword ranking's weight for a sentence that holds a code-like token (``what does
    #: os.replace do``: indexing.keyword.mentions_code)
    code_weight: float = FUSION_WEIGHTS["linear"]["code_weight"]
    #: where replicas keep keyword index files (None: a temporary directory)
    keyword_dir: str | None = None
    #: keyword working copies held in memory (a tmpfs) while they fit; 0: all on disk
    keyword_memory_bytes: int = 0


#: search modes: fused keyword and vector, vector only, keyword (BM25) only
MODES = ("hybrid", "dense", "keyword")


@dataclass(frozen=True)
class View:
    """An index version and the tail after it: what one query searches."""

    reader: IndexReader
    tail: TailState

    @property
    def index_version(self) -> int:
        return self.reader.manifest.version

    @property
    def lake_version(self) -> int:
        return self.tail.version


class Views:
    """The serving state of one replica (the embedder is the index's model: versions built
    from another model's vectors are refused)."""

    def __init__(
        self,
        lake: Lake,
        index_store: ObjectStore,
        embedder: Embedder,
        source: ShardSource | None = None,
        options: EngineOptions = EngineOptions(),
    ) -> None:
        self.lake = lake
        self.store = index_store
        self.embedder = embedder
        self.source = source
        self.options = options
        self.ready = False
        self.index_error: str | None = None
        self._reader: IndexReader | None = None
        self._tail: LakeTail | None = None
        self._readers: LRU[int, IndexReader] = LRU(4)
        self._tails: LRU[tuple[int, int], TailState] = LRU(16)
        #: index version → the lake version it covers; shared by the watcher and requests
        self._lake_versions: dict[int, int] = {}
        self._versions_lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self.keywords = KeywordCopies(
            Path(options.keyword_dir) if options.keyword_dir else None, options.keyword_memory_bytes
        )

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, background: bool = True) -> None:
        """Load the newest index version's manifest and centroids, catch up with the tail."""
        reader = self._open(None)
        manifest = reader.manifest
        self._tail = LakeTail(
            self.lake, manifest.lake_version, manifest.dim, self.options.tail_poll_s, manifest.writer_seqs or None
        )
        while self._tail.poll():  # catch up fully: until then, changes after the index are unfiltered
            pass
        if self.options.mode != "dense":
            self.keywords.prepare(reader)  # before ready: the first hybrid query would wait for it
        self._reader = reader
        metrics.INDEX_VERSION.set(reader.manifest.version)
        self.ready = True
        log.info(
            "serving index version %d (lake version %d, %d vectors, %d shards) + tail to lake version %d",
            reader.manifest.version, reader.manifest.lake_version, reader.manifest.count,
            len(reader.manifest.shards), self._tail.state.version,
        )  # fmt: skip
        if background:
            self._tail.on_change = self._follow_tail
            self._tail.start()
            self._watcher = threading.Thread(target=self._watch_index, name="index-watcher", daemon=True)
            self._watcher.start()

    def _follow_tail(self, tail: TailState) -> None:
        """Bring the live view's keyword copy up to a new tail now, not on the next query."""
        reader = self._reader
        if reader is not None and tail.base_version == reader.manifest.lake_version:
            self.keywords.sync_existing(reader, tail)

    def notify(self, lake_version: int) -> None:
        """A commit notice named this lake version: the tail reads it now (see pipelines.notices)."""
        if self._tail is not None:
            self._tail.notify(lake_version)

    def stop(self) -> None:
        self._stop.set()
        if self._tail is not None:
            self._tail.stop()
        if self._watcher is not None:
            self._watcher.join(10)
        self.keywords.close()

    def _open(self, version: int | None) -> IndexReader:
        reader = IndexReader(self.store, version, source=self.source)
        model = str(self.embedder.identity)
        if query_model(reader.manifest.model) != model:  # contextual vectors are queried by the same model
            built = reader.manifest.model
            hint = "--dtype int8" if "+int8@" in built else "that model (--model, and --dtype as the ingest job had)"
            raise SearchError(
                f"index version {reader.manifest.version} was built from vectors of {built}, "
                f"but the query embedder is {model}; serve it with {hint}.",
                status=503,
            )
        stats = reader.manifest.stats
        built_for = int(stats.get("assign_nprobe") or 0) if stats.get("assign") == "coarse-level" else 0
        if self.options.nprobe and self.options.nprobe < built_for:
            log.warning(
                "index version %d assigned its vectors to lists for searches at nprobe >= %d; at --nprobe %d recall "
                "may drop more than the 0.005 allowed there (estimated at build: %s by nprobe)",
                reader.manifest.version, built_for, self.options.nprobe, stats.get("assign_recall_loss"),
            )  # fmt: skip
        with self._versions_lock:
            self._lake_versions[reader.manifest.version] = reader.manifest.lake_version
        return reader

    def check_for_new_index(self) -> bool:
        """Switch to a newer published index version, if any; True if switched."""
        current = self._require_reader()
        newest = latest_version(self.store)
        if newest is None or newest <= current.manifest.version:
            return False
        reader = self._open(newest)
        assert self._tail is not None
        if reader.manifest.lake_version < self._tail.state.base_version:
            # Built from an older snapshot (--lake-version): switching would lose the rows between.
            log.warning(
                "not switching to index version %d: it covers lake version %d, older than the %d served",
                newest, reader.manifest.lake_version, self._tail.state.base_version,
            )  # fmt: skip
            return False
        total = sum(f.bytes for s in reader.manifest.shards for f in s.opened())  # what opening every shard fetches
        if self.options.prefetch and total <= self.options.prefetch_bytes:
            reader.shards(range(len(reader.manifest.shards)))  # warm before the first query needs it
        if self.options.mode != "dense":
            self.keywords.prepare(reader)
        self._reader = reader  # queries that already hold the old pair finish on it
        self._tail.rebase(reader.manifest.lake_version, reader.manifest.writer_seqs or None)
        metrics.INDEX_SWAPS.inc()
        metrics.INDEX_VERSION.set(reader.manifest.version)
        log.info("switched to index version %d (lake version %d)", newest, reader.manifest.lake_version)
        return True

    def _watch_index(self) -> None:
        while not self._stop.wait(self.options.index_poll_s):
            try:
                self.check_for_new_index()
                self.index_error = None
            except Exception as exc:  # noqa: BLE001 - keep serving the current version
                if str(exc) != self.index_error:
                    log.warning("cannot check the index store for new versions (will retry): %s", exc)
                self.index_error = str(exc)

    # -- health --------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        if not self.ready or self._reader is None or self._tail is None:
            return {"status": "starting"}
        problems = []
        state = self._tail.state
        lag = time.monotonic() - state.checked_at
        if not self._tail.healthy:
            problems.append(f"lake: {self._tail.last_error}")
        elif lag > max(5.0, 10 * self.options.tail_poll_s):  # a poll that hangs (store unresponsive)
            problems.append(f"lake: not read successfully for {lag:.0f} s")
        if self.index_error:
            problems.append(f"index store: {self.index_error}")
        removals = self._tail.reader.removals
        if removals:
            problems.append(
                f"lake: version(s) {', '.join(map(str, removals[-5:]))} deleted rows from the chunks table "
                "(a DELETE or overwrite, which ingest never does): they are served until the next index build"
            )
        return {
            "status": "degraded" if problems else "ok",
            "problems": problems,
            "index_version": self._reader.manifest.version,
            "index_lake_version": self._reader.manifest.lake_version,
            "lake_version": state.version,
            "tail_rows": state.live_rows,
            "tail_lag_s": round(lag, 3),
        }

    # -- search ----------------------------------------------------------------------------

    def _require_reader(self) -> IndexReader:
        if not self.ready or self._reader is None:
            raise SearchError("the service is starting: the index is not loaded yet.", status=503)
        return self._reader

    def current_view(self) -> View:
        self._require_reader()
        assert self._tail is not None
        tail = self._tail.state  # tail first, then reader: see the module docstring
        reader = self._require_reader()
        if tail.base_version != reader.manifest.lake_version:
            tail = tail.rebased(reader.manifest.lake_version)
        return View(reader, tail)

    def view_at(self, lake_version: int) -> View:
        """The view the service would have had at ``lake_version``: newest index at or before it + tail."""
        current = self.current_view()
        if lake_version < 0:
            raise SearchError("as_of must be a lake version (an integer >= 0).")
        if lake_version > current.lake_version:
            raise SearchError(
                f"as_of={lake_version} is newer than the newest lake version read ({current.lake_version}).",
                status=404,
            )
        kept = self._kept_versions(current.index_version)
        candidates = [n for n, lv in kept.items() if lv <= lake_version]
        if not candidates:
            oldest = min(kept.values(), default=None)
            raise SearchError(
                f"no index version was built at or before lake version {lake_version} "
                f"(the oldest kept covers lake version {oldest}).",
                status=404,
            )
        number = max(candidates)
        if number == current.index_version:
            reader = current.reader
        else:
            try:
                reader = self._readers.get_or_make(number, lambda: self._open(number))
            except (ManifestError, NotFound) as exc:  # garbage-collected since it was listed
                raise self._collected(number, lake_version, self._kept_versions(current.index_version)) from exc
        base, dim = reader.manifest.lake_version, reader.manifest.dim
        # Rebuilt from the log, not cut from the live tail: that keeps only each chunk's
        # newest version, and the one current at lake_version may be an older one.
        try:
            tail = self._tails.get_or_make((base, lake_version), lambda: tail_at(self.lake, base, lake_version, dim))
        except TailError as exc:  # the log between the index and as_of was cleaned up
            raise SearchError(
                f"as_of={lake_version} needs the lake's log after version {base}, which is no longer there "
                f"(cleaned up): {exc}",
                status=404,
            ) from exc
        return View(reader, tail)

    def _kept_versions(self, serving: int) -> dict[int, int]:
        """Index versions in the store now (plus the one served) → the lake versions they cover."""
        listed = set(versions(self.store)) | {serving}
        with self._versions_lock:
            known = dict(self._lake_versions)
        for number in sorted(listed - known.keys()):
            try:
                known[number] = load_manifest(self.store, number).lake_version
            except ManifestError:  # deleted between the listing and now
                listed.discard(number)
        with self._versions_lock:
            for number in list(self._lake_versions):
                if number not in listed:  # garbage-collected: never chosen again
                    del self._lake_versions[number]
            self._lake_versions.update({n: lv for n, lv in known.items() if n in listed})
            return dict(self._lake_versions)

    @staticmethod
    def _collected(number: int, lake_version: int, kept: dict[int, int]) -> SearchError:
        others = ", ".join(f"{n} (lake version {lv})" for n, lv in sorted(kept.items()) if n != number)
        return SearchError(
            f"index version {number}, which as_of={lake_version} needs, has been deleted by garbage "
            f"collection (index build --keep); kept versions: {others or 'none'}.",
            status=404,
        )
