"""The search engine: IVF shards from object storage + the fresh lake tail, ACLs applied.

A query is embedded with the index's model, its nearest lists are probed in the shards
that hold them (fetched through the shard cache), and the tail of the lake newer than
the index is searched exactly. Chunks the caller may not see, and index copies of chunks
the tail has superseded (updated, re-permissioned, deleted), are excluded *inside* the
shard scan (``retrieval.masks``); when the allowed set is so sparse that the probed lists
hold fewer than k of them, more lists are probed, up to all of them (an exact search over
what the caller may see). Results carry their lineage (``retrieval.results``). Which index
version and tail a query searches is the business of ``retrieval.views``.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from indexing.keyword import identifier_query, mentions_code
from indexing.manifest import ManifestError, default_nprobe
from indexing.reader import Allow, Hit, IndexReader, ShardSource, take_rows
from indexing.store import NotFound, ObjectStore
from pipelines.lake import Lake
from retrieval import metrics
from retrieval.acl import ANONYMOUS, Principal
from retrieval.errors import SearchError
from retrieval.filters import MetadataFilter
from retrieval.keyword import keyword_search
from retrieval.masks import shard_filter
from retrieval.query_embedding import QueryEmbedder
from retrieval.ranking import Ranking, index_keys, reference, tail_keys
from retrieval.results import RESULT_COLUMNS, SearchResult, result_record
from retrieval.tail import TailState
from retrieval.views import MODES, EngineOptions, View, Views
from serving.embedder import Embedder


class SearchEngine(Views):
    """Searches the views :class:`Views` keeps: ``search`` for text, ``search_vector`` for a vector."""

    def __init__(
        self,
        lake: Lake,
        index_store: ObjectStore,
        embedder: Embedder,
        source: ShardSource | None = None,
        options: EngineOptions | None = None,
    ) -> None:
        super().__init__(lake, index_store, embedder, source, options or EngineOptions())
        self.queries = QueryEmbedder(embedder)

    def search(
        self,
        query: str,
        k: int = 10,
        principal: Principal = ANONYMOUS,
        as_of: int | None = None,
        with_vectors: bool = False,
        where: MetadataFilter | None = None,
        mode: str | None = None,
    ) -> SearchResult:
        """Top-k visible chunks (matching ``where``, if given) by ``mode`` (default: the
        service's); ``with_vectors`` also returns their stored embeddings (answers need them)."""
        if not isinstance(query, str) or not query.strip():
            raise SearchError("query must be a non-empty string.")
        if len(query) > self.options.max_query_chars:
            raise SearchError(f"query is {len(query)} characters; the limit is {self.options.max_query_chars}.")
        if not 1 <= k <= self.options.max_k:
            raise SearchError(f"k must be between 1 and {self.options.max_k}.")
        mode = mode or self.options.mode
        if mode not in MODES:
            raise SearchError(f"mode must be one of {', '.join(MODES)}; got {mode!r}.")
        t0 = time.perf_counter()
        view = self.view_at(as_of) if as_of is not None else self.current_view()
        if mode != "dense" and not view.reader.manifest.keyword:
            if mode == "keyword":
                raise SearchError(
                    f"index version {view.index_version} has no keyword index (built before keyword search "
                    "existed): build a new version (streamrag index build) or search with mode dense.",
                    status=409,
                )
            mode = "dense"  # hybrid on such a version: the response's mode says so
        t1 = time.perf_counter()
        vector = self.queries.embed(query) if mode != "keyword" else None
        t2 = time.perf_counter()
        try:
            result = self.search_view(view, query, vector, k, principal, with_vectors, where, mode)
        except (ManifestError, NotFound) as exc:
            if as_of is None or view.index_version == self._require_reader().manifest.version:
                raise
            # An old version's files went while this request used it (past the GC grace period).
            serving = self._require_reader().manifest.version
            raise self._collected(view.index_version, as_of, self._kept_versions(serving)) from exc
        t3 = time.perf_counter()
        result.timings = {"view_s": t1 - t0, "embed_s": t2 - t1, "search_s": t3 - t2}
        metrics.SEARCH_SECONDS.labels("embed").observe(t2 - t1)
        metrics.SEARCH_SECONDS.labels("search").observe(t3 - t2)
        return result

    def search_vector(
        self,
        view: View,
        vector: np.ndarray,
        k: int,
        principal: Principal,
        with_vectors: bool = False,
        where: MetadataFilter | None = None,
    ) -> SearchResult:
        """Dense search for a query vector."""
        return self.search_view(view, None, vector, k, principal, with_vectors, where, "dense")

    def search_view(
        self,
        view: View,
        query: str | None,
        vector: np.ndarray | None,
        k: int,
        principal: Principal,
        with_vectors: bool,
        where: MetadataFilter | None,
        mode: str,
    ) -> SearchResult:
        reader, tail = view.reader, view.tail
        allow = shard_filter(tail, principal.groups, where)
        tail_allowed = tail.allowed(principal.groups)
        if where is not None and tail.n:
            tail_allowed = tail_allowed & where.mask(tail.table.column("metadata"), tail.n)
        lists: dict[str, Ranking] = {}
        nprobe = 0
        if mode != "keyword":
            assert vector is not None
            depth = k if mode != "hybrid" else max(k, self.options.fusion_depth)
            feedback = mode == "hybrid" and self.options.feedback_docs > 0
            found, nprobe, stored = self._dense(reader, tail, vector, depth, k, allow, tail_allowed, feedback)
            lists["dense"] = self._feedback(vector, found, stored) if stored is not None else found
        if mode != "dense":
            assert query is not None
            t = time.perf_counter()
            lists["keyword"] = keyword_search(
                self.keywords,
                reader,
                tail,
                query,
                k if mode != "hybrid" else max(k, self.options.keyword_depth),
                principal.groups,
                allow if where is not None else None,
                tail_allowed,
            )
            metrics.SEARCH_SECONDS.labels("keyword").observe(time.perf_counter() - t)
        if mode == "hybrid":
            picked = self._fuse(lists, k, self._keyword_weight(query or ""))
        else:
            picked = _ranked(lists[mode], mode, k)
        results, vectors = self._materialize(view, picked, with_vectors)
        # Only the tail rows this caller may see are counted: the total would tell an outsider
        # how many hidden chunks changed since the index.
        visible_tail = int(tail_allowed.sum())
        return SearchResult(results, reader.manifest.version, tail.version, nprobe, visible_tail, {}, vectors, mode)

    def _dense(
        self,
        reader: IndexReader,
        tail: TailState,
        vector: np.ndarray,
        depth: int,
        need: int,
        allow: Allow,
        tail_allowed: np.ndarray,
        with_vectors: bool = False,
    ) -> tuple[Ranking, int, np.ndarray | None]:
        """The ``depth`` nearest visible chunks (cosine similarity, best first), the lists
        probed, and (``with_vectors``) the chunks' stored vectors: more lists while the probed
        ones hold fewer than ``need`` (hybrid fusion takes ``depth`` candidates when they are
        there, but widens only for the ``k`` it returns)."""
        nlist = reader.manifest.nlist
        nprobe = min(self.options.nprobe or default_nprobe(nlist), nlist)
        query = np.ascontiguousarray(vector[None, :], dtype=np.float32)
        while True:
            found, stored = reader.search_arrays(query, depth, nprobe, allow, self.options.rerank, None, with_vectors)
            if len(found[0]) >= need or nprobe >= nlist:
                break
            nprobe = min(nlist, nprobe * 4)
            metrics.NPROBE_WIDENED.inc()
        tail_rows, tail_distances = tail.search(vector, depth, tail_allowed)
        distances = np.concatenate([found[0].distances.astype(np.float64), tail_distances])
        keys = np.concatenate([index_keys(found[0].shards, found[0].ids), tail_keys(tail_rows)])
        order = np.argsort(distances, kind="stable")[:depth]
        best = Ranking(1.0 - distances[order] / 2.0, keys[order])
        if not with_vectors:
            return best, nprobe, None
        assert stored is not None
        tail_vectors = tail.vectors[tail_rows] if len(tail_rows) else np.zeros((0, len(vector)), np.float32)
        return best, nprobe, np.concatenate([stored[0], tail_vectors])[order]

    def _feedback(self, vector: np.ndarray, found: Ranking, stored: np.ndarray) -> Ranking:
        """Rocchio's pseudo-relevance feedback: the dense candidates ``found`` (with their
        ``stored`` vectors) ranked again by the query moved towards the mean vector of the best
        ``feedback_docs`` of them, unit length again. They are chunks the caller may see, so the
        new ranking depends on nothing hidden from them. Searching again with the moved query
        ranked no better on the Python docs' quality sets (FAQ nDCG@10 0.668 against 0.671 for
        these candidates re-ranked, both at weight 0.6) and cost a second search."""
        if not len(found):
            return found
        mean = stored[: self.options.feedback_docs].mean(axis=0)
        moved = np.asarray(vector, np.float32) + self.options.feedback_weight * mean
        norm = float(np.linalg.norm(moved))
        if norm == 0:
            return found
        scores = (stored @ (moved / norm)).astype(np.float64)
        order = np.argsort(-scores, kind="stable")
        return Ranking(scores[order], found.keys[order])

    def _keyword_weight(self, query: str) -> float:
        """The keyword ranking's weight for this query: an identifier's, a sentence's that holds
        a code-like token, or a plain sentence's (benchmarks/quality.py chose each)."""
        if identifier_query(query):
            return self.options.identifier_weight
        return self.options.code_weight if mentions_code(query) else self.options.keyword_weight

    def _fuse(self, lists: dict[str, Ranking], k: int, keyword_weight: float) -> list[Picked]:
        """Weighted fusion: linear (the sum of weight × the score min-max normalised over that
        retriever's candidates) or reciprocal rank (the sum over retrievers of weight / (rrf_k +
        rank)), the keyword ranking at ``keyword_weight`` (``_keyword_weight``). Ties go to the
        better dense rank, then to the first ranking that found them. In arrays: only the
        ``k`` results become Python objects."""
        weights = {"dense": self.options.dense_weight, "keyword": keyword_weight}
        linear = self.options.fusion == "linear"
        names = list(lists)
        shares = []
        for name in names:
            found, weight = lists[name], weights[name]
            if not linear:
                shares.append(weight / (self.options.rrf_k + np.arange(1, len(found) + 1)))
            elif len(found) and found.scores.max() > found.scores.min():
                low, high = found.scores.min(), found.scores.max()
                shares.append((found.scores - low) * (weight / (high - low)))
            else:  # one score: the full weight
                shares.append(np.full(len(found), weight))
        keys, first, inverse = np.unique(np.concatenate([lists[n].keys for n in names]), return_index=True,
                                         return_inverse=True)  # fmt: skip
        total = np.bincount(inverse, weights=np.concatenate(shares), minlength=len(keys))
        places = {}  # retriever → each key's index in its ranking (-1: not in it)
        start = 0
        for name in names:
            at = places[name] = np.full(len(keys), -1)
            at[inverse[start : start + len(lists[name])]] = np.arange(len(lists[name]))
            start += len(lists[name])
        dense = places["dense"] if "dense" in places else np.full(len(keys), -1)
        best = np.lexsort((first, np.where(dense >= 0, dense, 1 << 30), -total))[:k]
        # a linear total carries BM25's scores, which weigh words by documents the caller may not
        # see: such a result shows its place (1 / rank), as keyword search does
        return [(1.0 / rank if linear else float(total[u]), *reference(int(keys[u])),
                 {name: _shown(name, int(at[u]) + 1, float(lists[name].scores[at[u]]))
                  for name, at in places.items() if at[u] >= 0})
                for rank, u in enumerate(best.tolist(), 1)]  # fmt: skip

    def _materialize(
        self, view: View, picked: list[Picked], with_vectors: bool
    ) -> tuple[list[dict[str, Any]], np.ndarray | None]:
        """The picked candidates as results (lineage rows read once per origin), and their vectors."""
        reader, tail = view.reader, view.tail
        index_hits = [ref for _, _, ref, _ in picked if isinstance(ref, Hit)]
        index_rows = iter(reader.rows(index_hits, RESULT_COLUMNS))
        tail_refs = [ref for _, _, ref, _ in picked if not isinstance(ref, Hit)]
        tail_rows = iter(take_rows(tail.table, tail_refs, [*RESULT_COLUMNS, "lake_version"]))
        results = []
        version = reader.manifest.version
        for score, origin, _, retrievers in picked:  # both row lists are in picked order
            if origin == "index":
                record = result_record(next(index_rows), score, reader.manifest.lake_version, version, origin)
            else:
                row = next(tail_rows)
                record = result_record(row, score, row["lake_version"], version, origin)
            record["retrievers"] = retrievers
            results.append(record)
        vectors = None
        if with_vectors and picked:
            index_vectors = iter(reader.vectors(index_hits))
            tail_vectors = iter(tail.vectors[tail_refs]) if tail_refs else iter(())
            vectors = np.stack([next(index_vectors) if origin == "index" else next(tail_vectors)
                                for _, origin, _, _ in picked])  # fmt: skip
        return results, vectors


#: a result to return: (score, origin, ref, {retriever: {"rank", "score"}})
Picked = tuple[float, str, "Hit | int", dict[str, dict[str, float]]]


def _ranked(found: Ranking, name: str, k: int) -> list[Picked]:
    scores, keys = found.scores[:k].tolist(), found.keys[:k].tolist()
    return [(score if name == "dense" else 1.0 / rank, *reference(key), {name: _shown(name, rank, score)})
            for rank, (score, key) in enumerate(zip(scores, keys, strict=True), 1)]  # fmt: skip


def _shown(name: str, rank: int, score: float) -> dict[str, float]:
    """A retriever's rank for a result, and its score unless that could reveal hidden documents:
    BM25 weighs a word by how many documents hold it, those the caller may not see included."""
    if name == "keyword":
        return {"rank": rank}
    return {"rank": rank, "score": round(float(score), 6)}
