"""Read an index version from object storage and search it (the retrieval service's view).

The manifest and centroids are loaded once; shards are fetched on demand, verified against
the manifest's sha256, and searched with precomputed list assignments
(``search_preassigned``), so each shard only scans the lists a query probes.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from indexing.manifest import Manifest, get_verified, load_manifest
from indexing.store import ObjectStore


@dataclass
class LoadedShard:
    index: Any  # faiss.IndexIVFFlat (the SWIG stubs don't know the numpy wrappers)
    ids: pa.Table


@dataclass(frozen=True)
class Hit:
    shard: int
    faiss_id: int
    distance: float

    @property
    def score(self) -> float:
        """Cosine similarity (vectors are unit length; the metric is squared L2)."""
        return 1.0 - self.distance / 2.0


class IndexReader:
    def __init__(self, store: ObjectStore, version: int | None = None) -> None:
        self.store = store
        self.manifest: Manifest = load_manifest(store, version)
        raw = get_verified(store, self.manifest.centroids)
        self.centroids = np.load(io.BytesIO(raw)).astype(np.float32)
        self.quantizer = faiss.IndexFlatL2(self.manifest.dim)
        self.quantizer.add(self.centroids)
        self._shards: dict[int, LoadedShard] = {}

    def shard(self, i: int) -> LoadedShard:
        if i not in self._shards:
            ref = self.manifest.shards[i]
            blob = get_verified(self.store, ref.index)
            index = faiss.deserialize_index(np.frombuffer(blob, dtype=np.uint8))
            ids = pq.read_table(io.BytesIO(get_verified(self.store, ref.ids)))
            self._shards[i] = LoadedShard(index, ids)
        return self._shards[i]

    def probe(self, queries: np.ndarray, nprobe: int) -> tuple[np.ndarray, np.ndarray]:
        """(distances, list numbers) of the nprobe nearest lists of each query."""
        nprobe = max(1, min(nprobe, self.manifest.nlist))
        dist, lists = self.quantizer.search(np.ascontiguousarray(queries, dtype=np.float32), nprobe)
        return dist, lists

    def search(self, queries: np.ndarray, k: int, nprobe: int = 16) -> list[list[Hit]]:
        """Top-k hits per query across every shard holding a probed list."""
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        coarse_d, lists = self.probe(queries, nprobe)
        shard_of = np.array([self.manifest.shard_for_list(int(li)) if li >= 0 else -1 for li in lists.ravel()])
        shard_of = shard_of.reshape(lists.shape)
        hits: list[list[Hit]] = [[] for _ in range(len(queries))]
        for s in sorted({int(x) for x in shard_of.ravel() if x >= 0}):
            shard = self.shard(s)
            assign = np.where(shard_of == s, lists, -1).astype(np.int64)
            shard.index.nprobe = assign.shape[1]
            dist, ids = shard.index.search_preassigned(queries, k, assign, coarse_d)
            for q in range(len(queries)):
                hits[q].extend(Hit(s, int(i), float(d)) for d, i in zip(dist[q], ids[q], strict=True) if i >= 0)
        return [sorted(h, key=lambda x: x.distance)[:k] for h in hits]

    def rows(self, hits: list[Hit]) -> list[dict[str, object]]:
        """The id-map rows (chunk version and lineage) of hits, in order."""
        out = []
        for hit in hits:
            ids = self.shard(hit.shard).ids
            out.append({**ids.slice(hit.faiss_id, 1).to_pylist()[0], "score": hit.score})
        return out
