"""Where a build's partitions live: Ray actors, or this process. One interface, two executors.

``RayData``: local Ray by default (the machine's cores, no dashboard); ``--ray-address``
joins a cluster. Each actor loads its own partition (e.g. a list of lake files read
straight from object storage), so vectors never funnel through the driver.
``LocalPartitions``: the same calls in this process, for builds too small to repay Ray's
start-up (``choose_executor``).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from tqdm import tqdm

from indexing.kmeans import Matrix, PartialSums, one_thread_each, partial_sums, sample_indices, split_indices

log = logging.getLogger(__name__)

#: an ``auto`` build runs in-process while its vectors take at most this share of the
#: machine's memory. On one machine Ray's processes only add start-up, object transfers and
#: memory (benchmarks/index.py, 2 cores, 24 GiB: 40k vectors 3.5 s in-process against 8.6 s
#: on Ray, 1M 35.0–37.9 s against 39.7–41.3 s, 5M 146.9 s against 152.8 s); an in-process build's
#: peak was 1.6× its vectors (5M: 12.2 GB for 7.3 GB of vectors), so a quarter leaves room
#: for the rest of the machine. Above it, Ray (whose actors can be spread over a cluster).
LOCAL_MAX_MEMORY_SHARE = 0.25


def huge_page_advice(advise: bool) -> bool:
    """Whether numpy advises the kernel to back its large arrays with huge pages from now on;
    returns the previous setting (True where numpy has no such switch: it then advises)."""
    try:
        setter = importlib.import_module("numpy._core.multiarray")._set_madvise_hugepage
    except (ImportError, AttributeError):  # pragma: no cover - numpy without the switch
        return True
    return bool(setter(advise))


@contextmanager
def small_pages() -> Iterator[None]:
    """numpy's new arrays without huge-page advice while the block runs (a build).

    numpy asks the kernel to back arrays of 4 MB and up with 2 MB pages. Where transparent
    huge pages are "madvise" (the default here), faulting such fresh memory in cost 0.84 s of
    kernel time per 393 MB against 0.15 s in 4 KB pages on this project's VM, and a build
    allocates several times its vectors (samples, blocks, each shard's copy): the 1M × 384
    build took 26.1 s instead of 32.1 s, system time 12.1 s instead of 17.3 s
    (docs/PITFALLS.md); whatever fewer TLB misses huge pages save is inside those figures."""
    previous = huge_page_advice(False)
    try:
        yield
    finally:
        huge_page_advice(previous)


def machine_memory() -> int:
    """Bytes of memory this process may use: the machine's, or its container's limit
    (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``) when that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return int(total)


def choose_executor(
    executor: str, count: int, dim: int, ray_address: str | None = None, memory: int | None = None
) -> str:
    """``local`` or ``ray`` for a build of count × dim float32 vectors; a cluster address means Ray."""
    if executor != "auto":
        return executor
    if ray_address:
        return "ray"
    limit = LOCAL_MAX_MEMORY_SHARE * (memory if memory is not None else machine_memory())
    return "local" if count * dim * 4 <= limit else "ray"


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


def stop_ray() -> None:
    """Shut Ray down if this process started or joined it (without importing Ray otherwise:
    a build that never needed it does not pay for the import)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def _shard_actor() -> Any:
    import ray

    @ray.remote
    class Shard:
        def __init__(self, loader: Loader, threads: int) -> None:
            import faiss

            faiss.omp_set_num_threads(threads)
            huge_page_advice(False)  # this process only builds (see ``small_pages``)
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


class _Partitioned:
    """Sizes and dimension of partitioned data (what ``RayData`` and ``LocalPartitions`` share)."""

    def _shape(self, counts: list[int], dims: list[int]) -> None:
        self._counts = counts
        known = {d for d, c in zip(dims, counts, strict=True) if c}
        if len(known) > 1:
            raise ValueError(f"partitions disagree on the vector dimension: {sorted(known)}")
        self._dim = known.pop() if known else 0

    def count(self) -> int:
        return sum(self._counts)

    def counts(self) -> list[int]:
        return list(self._counts)

    def dim(self) -> int:
        return self._dim


class RayData(_Partitioned):
    """k-means data spread over Ray actors, one per partition."""

    remote = True  # partitions live in other processes: hand their blocks over as Ray objects

    def __init__(self, loaders: Sequence[Loader], threads_per_actor: int = 1) -> None:
        import ray

        actor = _shard_actor()
        self.actors = [actor.remote(loader, threads_per_actor) for loader in loaders]
        counts = [int(c) for c in ray.get([a.count.remote() for a in self.actors])]
        self._shape(counts, [int(d) for d in ray.get([a.dim.remote() for a in self.actors])])

    def sample(self, n: int, seed: int) -> Matrix:
        import ray

        local = split_indices(sample_indices(self.count(), n, seed), self._counts)
        parts = ray.get([a.take.remote(rows) for a, rows in zip(self.actors, local, strict=True)])
        return np.concatenate([p for p in parts if len(p)]).astype(np.float32)

    def assign_partial(self, centroids: Matrix) -> PartialSums:
        import ray

        ref = ray.put(centroids)
        return PartialSums.total(ray.get([a.assign_partial.remote(ref) for a in self.actors]))

    def map(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """fn(partition, *args) on every partition, results in partition order."""
        import ray

        refs = [ray.put(a) for a in args]
        return list(ray.get([actor.call.remote(fn, *refs) for actor in self.actors]))

    def run(self, fn: Callable[..., Any], calls: list[tuple[Any, ...]], desc: str, progress: bool) -> list[Any]:
        """fn(*args) for each args as Ray tasks (object refs among args resolve where they run)."""
        import ray

        task = ray.remote(fn)
        futures = [task.remote(*args) for args in calls]
        with tqdm(total=len(futures), desc=desc, disable=not progress, leave=False) as bar:
            pending = list(futures)
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                bar.update(len(done))
        return list(ray.get(futures))

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


class LocalPartitions(_Partitioned):
    """``RayData``'s interface over partitions held in this process (faiss and BLAS use the
    machine's threads; shard tasks run on a thread pool)."""

    remote = False

    def __init__(self, loaders: Sequence[Loader]) -> None:
        with ThreadPoolExecutor(max(1, min(len(loaders), os.cpu_count() or 1))) as pool:
            self.parts = list(pool.map(lambda load: load(), loaders))  # lake reads overlap (Arrow releases the GIL)
        self.vectors = [
            np.ascontiguousarray(p.vectors if hasattr(p, "vectors") else p, dtype=np.float32) for p in self.parts
        ]
        self._shape([len(v) for v in self.vectors], [int(v.shape[1]) if v.ndim == 2 else 0 for v in self.vectors])

    def sample(self, n: int, seed: int) -> Matrix:
        local = split_indices(sample_indices(self.count(), n, seed), self._counts)
        return np.concatenate([v[rows] for v, rows in zip(self.vectors, local, strict=True) if len(rows)])

    def assign_partial(self, centroids: Matrix) -> PartialSums:
        """Each partition's share on a worker of its own, one library thread each, as Ray's
        actors do (``one_thread_each``)."""
        with one_thread_each() as pool:
            return PartialSums.total(list(pool.map(lambda v: partial_sums(v, centroids), self.vectors)))

    def map(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        return [fn(part, *args) for part in self.parts]

    def run(self, fn: Callable[..., Any], calls: list[tuple[Any, ...]], desc: str, progress: bool) -> list[Any]:
        workers = min(len(calls), os.cpu_count() or 1) or 1
        results: list[Any] = [None] * len(calls)
        with (
            ThreadPoolExecutor(workers) as pool,
            tqdm(total=len(calls), desc=desc, disable=not progress, leave=False) as bar,
        ):
            futures = {pool.submit(fn, *args): i for i, args in enumerate(calls)}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                bar.update(1)
        return results

    def close(self) -> None:
        self.parts, self.vectors = [], []
