"""Ray-distributed k-means data: actors each hold one partition and return partial sums.

Local Ray by default (the machine's cores, no dashboard); ``--ray-address`` joins a
cluster. Each actor loads its own partition (e.g. a list of lake files read straight from
object storage), so vectors never funnel through the driver.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from indexing.kmeans import Matrix, PartialSums, partial_sums, sample_indices, split_indices

log = logging.getLogger(__name__)

#: Builds a partition where it will live: an array of vectors, or an object with a
#: ``vectors`` attribute (e.g. :class:`indexing.snapshot.Partition`).
Loader = Callable[[], Any]


def start_ray(address: str | None = None, work_dir: Path | None = None, num_cpus: int | None = None) -> None:
    """Connect to a cluster, or start local Ray quietly (no dashboard, no auth token file)."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
    if address:
        ray.init(address=address, **kwargs)
        return
    if work_dir is not None:
        work_dir.mkdir(parents=True, exist_ok=True)
        kwargs["_temp_dir"] = str(work_dir)
    ray.init(num_cpus=num_cpus or os.cpu_count() or 1, **kwargs)


def _shard_actor() -> Any:
    import ray

    @ray.remote
    class Shard:
        def __init__(self, loader: Loader, threads: int) -> None:
            import faiss

            faiss.omp_set_num_threads(threads)
            self.part = loader()
            raw = self.part.vectors if hasattr(self.part, "vectors") else self.part
            self.vectors = np.ascontiguousarray(raw, dtype=np.float32)

        def count(self) -> int:
            return len(self.vectors)

        def dim(self) -> int:
            return int(self.vectors.shape[1]) if self.vectors.ndim == 2 else 0

        def take(self, rows: npt.NDArray[np.int64]) -> Matrix:
            return self.vectors[rows]

        def assign_partial(self, centroids: Matrix) -> PartialSums:
            return partial_sums(self.vectors, centroids)

        def call(self, fn: Callable[..., Any], *args: Any) -> Any:
            """Run fn(partition, *args) where the partition lives (list assignment, shard blocks)."""
            return fn(self.part, *args)

    return Shard


class RayData:
    """k-means data spread over Ray actors, one per partition."""

    def __init__(self, loaders: Sequence[Loader], threads_per_actor: int = 1) -> None:
        import ray

        actor = _shard_actor()
        self.actors = [actor.remote(loader, threads_per_actor) for loader in loaders]
        self._counts = [int(c) for c in ray.get([a.count.remote() for a in self.actors])]
        dims = {int(d) for d, c in zip(ray.get([a.dim.remote() for a in self.actors]), self._counts, strict=True) if c}
        if len(dims) > 1:
            raise ValueError(f"partitions disagree on the vector dimension: {sorted(dims)}")
        self._dim = dims.pop() if dims else 0

    def count(self) -> int:
        return sum(self._counts)

    def counts(self) -> list[int]:
        return list(self._counts)

    def dim(self) -> int:
        return self._dim

    def sample(self, n: int, seed: int) -> Matrix:
        import ray

        local = split_indices(sample_indices(self.count(), n, seed), self._counts)
        parts = ray.get([a.take.remote(rows) for a, rows in zip(self.actors, local, strict=True)])
        return np.concatenate([p for p in parts if len(p)]).astype(np.float32)

    def assign_partial(self, centroids: Matrix) -> PartialSums:
        import ray

        ref = ray.put(centroids)
        parts: list[PartialSums] = ray.get([a.assign_partial.remote(ref) for a in self.actors])
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def map(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """fn(partition, *args) on every partition, results in partition order."""
        import ray

        refs = [ray.put(a) for a in args]
        return list(ray.get([actor.call.remote(fn, *refs) for actor in self.actors]))

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
