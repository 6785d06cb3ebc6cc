"""k-means behind a tiny data interface: local, Ray-distributed and GPU data plug in unchanged.

The algorithm asks its data for four things only (as faiss's contrib/clustering does):
``count()``, ``dim()``, ``sample(n, seed)`` and ``assign_partial(centroids)``, which
returns per-cluster partial sums, counts and the objective for the data's share. The
driver reduces partial sums; no process ever holds all vectors unless the data is local.

>>> import numpy as np
>>> x = np.random.default_rng(0).standard_normal((500, 8)).astype("float32")
>>> result = train_kmeans(LocalData(x), k=4, seed=1, progress=False)
>>> result.centroids.shape
(4, 8)
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import faiss
import numpy as np
import numpy.typing as npt
import scipy.sparse
from threadpoolctl import threadpool_limits
from tqdm import tqdm

log = logging.getLogger(__name__)

Matrix = npt.NDArray[np.float32]


class KMeansError(ValueError):
    """k-means cannot run on this data (too few points, mismatched dimensions)."""


@dataclass
class PartialSums:
    """One data share's contribution to a Lloyd step."""

    sums: npt.NDArray[np.float64]  # (k, d)
    counts: npt.NDArray[np.int64]  # (k,)
    objective: float  # sum of squared distances to the nearest centroid

    def __add__(self, other: PartialSums) -> PartialSums:
        return PartialSums(self.sums + other.sums, self.counts + other.counts, self.objective + other.objective)

    @staticmethod
    def total(parts: Sequence[PartialSums]) -> PartialSums:
        """The sum of every data share's contribution (at least one)."""
        out = parts[0]
        for part in parts[1:]:
            out = out + part
        return out


class KMeansData(Protocol):
    def count(self) -> int: ...

    def dim(self) -> int: ...

    def sample(self, n: int, seed: int) -> Matrix: ...

    def assign_partial(self, centroids: Matrix) -> PartialSums: ...


def nearest(vectors: Matrix, centroids: Matrix) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """(squared distance, index) of each vector's nearest centroid; faiss, on GPU when present."""
    index: Any = faiss.IndexFlatL2(centroids.shape[1])
    if faiss.get_num_gpus() > 0:  # pragma: no cover - CI has no GPU
        index = faiss.index_cpu_to_all_gpus(index)
    index.add(np.ascontiguousarray(centroids, dtype=np.float32))
    dist, idx = index.search(np.ascontiguousarray(vectors, dtype=np.float32), 1)
    return dist[:, 0], idx[:, 0]


def partial_sums(vectors: Matrix, centroids: Matrix) -> PartialSums:
    k, d = centroids.shape
    sums = np.zeros((k, d), dtype=np.float64)
    counts = np.zeros(k, dtype=np.int64)
    if len(vectors) == 0:
        return PartialSums(sums, counts, 0.0)
    dist, idx = nearest(vectors, centroids)
    # One-hot (k x n) sparse matrix times the vectors: a BLAS-speed scatter-add in float64
    # (np.add.at is ~20x slower, and float32 accumulation loses precision on big lists).
    onehot = scipy.sparse.csr_matrix(
        (np.ones(len(idx), dtype=np.float64), (idx, np.arange(len(idx)))), shape=(k, len(idx))
    )
    sums[:] = onehot @ vectors.astype(np.float64)
    counts += np.bincount(idx, minlength=k)
    return PartialSums(sums, counts, float(dist.astype(np.float64).sum()))


class LocalData:
    """Vectors in this process."""

    def __init__(self, vectors: Matrix) -> None:
        self.vectors = np.ascontiguousarray(vectors, dtype=np.float32)

    def count(self) -> int:
        return len(self.vectors)

    def dim(self) -> int:
        return int(self.vectors.shape[1])

    def sample(self, n: int, seed: int) -> Matrix:
        return self.vectors[sample_indices(len(self.vectors), n, seed)]

    def assign_partial(self, centroids: Matrix) -> PartialSums:
        return partial_sums(self.vectors, centroids)


def sample_indices(total: int, n: int, seed: int) -> npt.NDArray[np.int64]:
    """n distinct global row numbers out of total, sorted; the same for any partitioning,
    so local and distributed data draw the very same sample for a seed."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(total, min(n, total), replace=False)).astype(np.int64)


def split_indices(indices: npt.NDArray[np.int64], counts: Sequence[int]) -> list[npt.NDArray[np.int64]]:
    """Global row numbers → per-partition local row numbers (partitions in order)."""
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return [indices[(indices >= lo) & (indices < hi)] - lo for lo, hi in itertools.pairwise(bounds)]


@dataclass
class KMeansResult:
    centroids: Matrix
    objective: float
    iterations: int
    history: list[float] = field(default_factory=list)
    counts: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    seconds: float = 0.0

    @property
    def imbalance(self) -> float:
        return imbalance(self.counts)


def imbalance(counts: npt.NDArray[np.int64]) -> float:
    """faiss's imbalance factor: k * sum(n_i^2) / N^2 (1.0 = perfectly even lists; 0.0 if empty)."""
    n = float(counts.sum())
    return float(len(counts) * np.square(counts.astype(np.float64)).sum() / (n * n)) if n else 0.0


def _split_empty(centroids: Matrix, counts: npt.NDArray[np.int64], rng: np.random.Generator) -> int:
    """Re-seed each empty cluster by splitting a large one (faiss's method): returns how many."""
    empty = np.flatnonzero(counts == 0)
    if len(empty) == 0:
        return 0
    sizes = counts.astype(np.float64)
    eps = 1.0 / 1024
    for j in empty:
        probs = np.maximum(sizes - 1, 0)
        if probs.sum() == 0:
            break
        c = int(rng.choice(len(counts), p=probs / probs.sum()))
        sign = np.where(np.arange(centroids.shape[1]) % 2 == 0, 1.0, -1.0).astype(np.float32)
        centroids[j] = centroids[c] * (1 + sign * eps)
        centroids[c] = centroids[c] * (1 - sign * eps)
        sizes[j] = sizes[c] / 2
        sizes[c] -= sizes[j]
    return len(empty)


#: above this k, seeding is a random sample: k-means++ would cost more than the iterations
PLUS_PLUS_MAX_K = 256


def kmeans_plus_plus(pool: Matrix, k: int, rng: np.random.Generator) -> Matrix:
    """k-means++ seeding on a sample (cost k x len(pool) x d, bounded by the sample size)."""
    first = int(rng.integers(len(pool)))
    centroids = np.empty((k, pool.shape[1]), dtype=np.float32)
    centroids[0] = pool[first]
    sq_norms = np.einsum("ij,ij->i", pool, pool)
    best = np.maximum(sq_norms - 2 * pool @ pool[first] + sq_norms[first], 0)
    for j in range(1, k):
        total = float(best.sum())
        pick = int(rng.choice(len(pool), p=best / total)) if total > 0 else int(rng.integers(len(pool)))
        centroids[j] = pool[pick]
        dist = np.maximum(sq_norms - 2 * pool @ pool[pick] + sq_norms[pick], 0)
        np.minimum(best, dist, out=best)
    return centroids


def _check_k(data: KMeansData, k: int) -> int:
    """The data's size, once it is known to make k clusters."""
    n = data.count()
    if k < 1:
        raise KMeansError("k must be at least 1.")
    if n < k:
        raise KMeansError(f"{n} vectors cannot make {k} clusters; lower --nlist.")
    return n


def train_kmeans(
    data: KMeansData,
    k: int,
    iterations: int = 25,
    tol: float = 1e-4,
    seed: int = 1234,
    progress: bool = True,
    reduce: Callable[[Matrix], PartialSums] | None = None,
) -> KMeansResult:
    """Lloyd's k-means: k-means++ seeding on a sample, empty-cluster repair, relative-objective stop.

    ``reduce`` (default ``data.assign_partial``) computes the summed partial sums of all
    data for given centroids; distributed data does the fan-out there.
    """
    n = _check_k(data, k)
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    if k <= PLUS_PLUS_MAX_K:
        pool = np.array(data.sample(min(n, max(16 * k, 10_000)), seed), dtype=np.float32)
        centroids = kmeans_plus_plus(pool, k, rng)
    else:  # k-means++ costs k passes over its pool; for big k, random seeds (as faiss does)
        centroids = np.array(data.sample(k, seed), dtype=np.float32)
    step = reduce or data.assign_partial
    history: list[float] = []
    counts = np.zeros(k, dtype=np.int64)
    bar = tqdm(total=iterations, desc=f"k-means k={k}", disable=not progress, leave=False)
    done = 0
    while done < iterations:
        done += 1
        part = step(centroids)
        counts = part.counts
        history.append(part.objective)
        nonempty = counts > 0
        centroids[nonempty] = (part.sums[nonempty] / counts[nonempty, None]).astype(np.float32)
        repaired = _split_empty(centroids, counts, rng)
        bar.update(1)
        bar.set_postfix(objective=f"{part.objective:.4g}", empty=repaired)
        if len(history) >= 2 and repaired == 0:
            prev, cur = history[-2], history[-1]
            if prev > 0 and (prev - cur) / prev < tol:
                break
    bar.close()
    final = step(centroids)  # objective and counts of the centroids we return
    return KMeansResult(
        centroids, final.objective, done, [*history, final.objective], final.counts, time.perf_counter() - started
    )


# -- two levels: k-means and assignment for many lists ---------------------------------

#: from this many lists on, builds may train two-level k-means and assign through a coarse
#: level (LanceDB goes hierarchical above 256 too; below it, flat k-means costs little)
TWO_LEVEL_MIN_K = 256
#: training points per list for two-level k-means (faiss warns below 39 per centroid)
SAMPLE_PER_LIST = 64
#: training points per coarse cell (faiss's own cap per centroid)
COARSE_PER_CELL = 256
#: the coarse-level assignment must agree with exact nearest-centroid assignment on at least
#: this fraction of a check sample; the probe widens until it does (or becomes exhaustive)
MIN_AGREEMENT = 0.995
#: vectors assigned per block (bounds the gathered copies: block × probe × dim floats)
ASSIGN_BLOCK = 65_536


def two_level_sample(n: int, k: int, sample_per_list: int = SAMPLE_PER_LIST) -> int:
    """How many of n points two-level k-means trains k lists on (all n when that bound does not bind)."""
    return min(n, max(k, sample_per_list * k))


def quotas(sizes: npt.NDArray[np.int64], k: int) -> npt.NDArray[np.int64]:
    """k fine clusters shared among coarse cells by population (largest remainder): each
    non-empty cell gets at least 1 and at most its size."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if k > int(sizes.sum()):
        raise KMeansError(f"{int(sizes.sum())} points cannot make {k} clusters.")
    exact = sizes / max(1, int(sizes.sum())) * k
    out = np.minimum(np.maximum(np.floor(exact).astype(np.int64), (sizes > 0).astype(np.int64)), sizes)
    while (gap := k - int(out.sum())) != 0:
        if gap > 0:  # give to the cells furthest below their share that still have points
            room = np.where(out < sizes, exact - out, -np.inf)
            out[int(np.argmax(room))] += 1
        else:  # take from the cells furthest above their share that keep at least 1
            excess = np.where(out > 1, out - exact, -np.inf)
            out[int(np.argmax(excess))] -= 1
    return out


def train_two_level(
    data: KMeansData,
    k: int,
    iterations: int = 25,
    seed: int = 1234,
    progress: bool = True,
    sample_per_list: int = SAMPLE_PER_LIST,
    refine: int = 1,
) -> KMeansResult:
    """Hierarchical k-means on a bounded sample: √k coarse clusters, then each split into a
    population-sized share of the k lists, then ``refine`` Lloyd steps over the sample with
    all k lists (a fine cluster may then cross its coarse cell's boundary).

    One sample of at most ``sample_per_list`` × k points is drawn (one read of each data
    share); the coarse level costs S·√k and the fine level about S·k/√k distances per
    iteration, against N·k for flat k-means over all N points; each refinement step costs
    S·k. The returned objective is the sample's; builds measure the objective over all data
    when they assign.
    """
    n = _check_k(data, k)
    started = time.perf_counter()
    sample = np.ascontiguousarray(data.sample(two_level_sample(n, k, sample_per_list), seed), dtype=np.float32)
    k1 = max(1, min(k, round(math.sqrt(k))))
    # the coarse level needs no more than faiss's 256 points per centroid
    rng = np.random.default_rng(seed)
    coarse_rows = np.sort(rng.choice(len(sample), min(len(sample), COARSE_PER_CELL * k1), replace=False))
    coarse = train_kmeans(LocalData(sample[coarse_rows]), k1, iterations, seed=seed, progress=False)
    _, cell = nearest(sample, coarse.centroids)
    share = quotas(np.bincount(cell, minlength=k1), k)

    def split(c: int) -> KMeansResult:
        return train_kmeans(LocalData(sample[cell == c]), int(share[c]), iterations, seed=seed + 1 + c, progress=False)

    # Cells are small problems: one BLAS/OpenMP thread each and cells in parallel ran 2.9x
    # faster here than the libraries' own threads on each cell in turn (200k x 384, k 1789).
    with (
        threadpool_limits(1),
        ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool,
        tqdm(total=k1, desc=f"k-means k={k} (two-level)", disable=not progress, leave=False) as bar,
    ):
        results = []
        for result in pool.map(split, [c for c in range(k1) if share[c] > 0]):
            results.append(result)
            bar.update(1)
    history = [sum(r.objective for r in results)]
    rounds = max(r.iterations for r in results)
    centroids = np.ascontiguousarray(np.concatenate([r.centroids for r in results]), dtype=np.float32)
    # Each refinement step is one S·k pass; the objective and counts returned are those of
    # the centroids before the last step (a build measures the final ones when it assigns).
    objective, counts = history[0], np.zeros(k, dtype=np.int64)
    for _ in range(refine):
        step = partial_sums(sample, centroids)
        objective, counts = step.objective, step.counts
        history.append(objective)
        nonempty = counts > 0
        centroids[nonempty] = (step.sums[nonempty] / counts[nonempty, None]).astype(np.float32)
    return KMeansResult(centroids, objective, rounds, history, counts, time.perf_counter() - started)


@dataclass
class CoarseLevel:
    """Centroids grouped into about √k cells by k-means over the centroids themselves.

    A vector's list is the nearest centroid among those of its ``probe`` nearest cells:
    N·(√k + probe·k/√k) distances instead of N·k. ``fit`` widens the probe until the
    result agrees with exact assignment on a check sample (``MIN_AGREEMENT``) and times
    both on it: fewer distances are not always less time (exact assignment is one large
    BLAS product; a cell's is a small one, and big cells draw most vectors).
    """

    centroids: Matrix
    coarse: Matrix
    cells: list[npt.NDArray[np.int64]]
    probe: int = 1
    agreement: float = 1.0
    #: seconds to assign the check sample exactly and through this level
    exact_s: float = 0.0
    level_s: float = 0.0

    @property
    def faster(self) -> bool:
        return self.level_s < self.exact_s

    @classmethod
    def fit(cls, centroids: Matrix, check: Matrix, seed: int = 0, min_agreement: float = MIN_AGREEMENT) -> CoarseLevel:
        centroids = np.ascontiguousarray(centroids, dtype=np.float32)
        k1 = max(1, round(math.sqrt(len(centroids))))
        grouping = train_kmeans(LocalData(centroids), k1, iterations=10, seed=seed, progress=False)
        _, cell = nearest(centroids, grouping.centroids)
        cells = [np.flatnonzero(cell == c) for c in range(k1)]
        keep = [c for c in range(k1) if len(cells[c])]
        level = cls(centroids, grouping.centroids[keep], [cells[c] for c in keep])
        if len(check) == 0:
            level.probe = len(level.cells)
            return level
        started = time.perf_counter()
        exact = nearest(check, centroids)[1]
        level.exact_s = time.perf_counter() - started
        level.probe = min(2, len(level.cells))
        while True:
            started = time.perf_counter()
            level.agreement = float(np.mean(level.search(check)[1] == exact))
            level.level_s = time.perf_counter() - started
            if level.agreement >= min_agreement or level.probe >= len(level.cells):
                return level
            level.probe = min(2 * level.probe, len(level.cells))

    def search(self, vectors: Matrix) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
        """(squared distance, index) of each vector's assigned centroid."""
        n = len(vectors)
        best_d = np.full(n, np.inf, dtype=np.float32)
        best_i = np.full(n, -1, dtype=np.int64)
        coarse: Any = faiss.IndexFlatL2(self.coarse.shape[1])
        coarse.add(self.coarse)
        for lo in range(0, n, ASSIGN_BLOCK):
            block = np.ascontiguousarray(vectors[lo : lo + ASSIGN_BLOCK], dtype=np.float32)
            _, probed = coarse.search(block, self.probe)
            order = np.argsort(probed, axis=None, kind="stable")  # (row, cell) pairs grouped by cell
            rows_of = order // self.probe
            bounds = np.searchsorted(probed.ravel()[order], np.arange(len(self.cells) + 1))
            for c, members in enumerate(self.cells):
                rows = rows_of[bounds[c] : bounds[c + 1]]
                if len(rows) == 0:
                    continue
                d, i = nearest(block[rows], self.centroids[members])
                target = rows + lo
                better = d < best_d[target]
                best_d[target[better]] = d[better]
                best_i[target[better]] = members[i[better]]
        return best_d, best_i


def assign(
    vectors: Matrix, centroids: Matrix, level: CoarseLevel | None = None
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """Each vector's list: through ``level`` when given, else exact."""
    return level.search(vectors) if level is not None else nearest(vectors, centroids)
