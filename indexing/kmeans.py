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
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
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


#: rows whose sums ``partial_sums`` adds in float32 before adding them to its float64 total:
#: within about 1e-6 (relative) of float64 throughout, where float32 over all the rows
#: drifts on big lists (one list of 60k vectors: 1.4e-6 against 9.3e-6). Summing in float64
#: cast all the vectors to a fresh float64 copy on every step: at 1M × 384 and 4,000 lists
#: that cast (mostly the page faults of its copies) was the largest single cost of two-level
#: k-means (7 of a build's 47 CPU seconds)
SUM_BLOCK = 8_192


def partial_sums(vectors: Matrix, centroids: Matrix, level: CoarseLevel | None = None) -> PartialSums:
    """One Lloyd step's sums over ``vectors``: each assigned exactly, or through ``level``."""
    k, d = centroids.shape
    sums = np.zeros((k, d), dtype=np.float64)
    counts = np.zeros(k, dtype=np.int64)
    if len(vectors) == 0:
        return PartialSums(sums, counts, 0.0)
    dist, idx = assign(vectors, centroids, level)
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    # One-hot (k x rows) sparse matrix times the vectors: a scatter-add at memory speed
    # (np.add.at is ~20x slower), in float32 over at most SUM_BLOCK rows, added up in float64
    for lo in range(0, len(idx), SUM_BLOCK):
        block = idx[lo : lo + SUM_BLOCK]
        onehot = scipy.sparse.csr_matrix(
            (np.ones(len(block), dtype=np.float32), (block, np.arange(len(block)))), shape=(k, len(block))
        )
        sums += onehot @ vectors[lo : lo + len(block)]
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
    #: two-level k-means: the coarse cell each list was trained in (None for flat k-means)
    cells: npt.NDArray[np.int64] | None = None

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
    """k-means++ seeding on a sample (cost k x len(pool) x d, bounded by the sample size).

    Each pick is drawn with probability proportional to the squared distance to the
    nearest pick so far: one draw against the running sum (``rng.choice`` with weights
    checked its weights on every call), distances updated in place: 8 ms against 21 ms
    for a two-level cell of 4,000 points and 63 lists."""
    n = len(pool)
    centroids = np.empty((k, pool.shape[1]), dtype=np.float32)
    sq_norms = np.einsum("ij,ij->i", pool, pool)
    best = np.full(n, np.inf, dtype=np.float32)
    dist = np.empty(n, dtype=np.float32)
    pick = int(rng.integers(n))
    for j in range(k):
        centroids[j] = pool[pick]
        if j + 1 == k:
            break
        np.dot(pool, pool[pick], out=dist)
        dist *= -2
        dist += sq_norms
        dist += sq_norms[pick]
        np.minimum(best, dist, out=best)
        np.maximum(best, 0, out=best)
        running = np.cumsum(best, dtype=np.float64)
        total = float(running[-1])
        pick = int(np.searchsorted(running, rng.random() * total, side="right")) if total > 0 else int(rng.integers(n))
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
    measure: bool = True,
) -> KMeansResult:
    """Lloyd's k-means: k-means++ seeding on a sample, empty-cluster repair, relative-objective stop.

    ``reduce`` (default ``data.assign_partial``) computes the summed partial sums of all
    data for given centroids; distributed data does the fan-out there. ``measure``: one
    more pass for the objective and counts of the returned centroids; without it they are
    those of the last step's centroids (a caller that assigns every vector afterwards
    measures the final ones then, and saves a pass over the data).
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
    if not measure:
        return KMeansResult(centroids, history[-1], done, history, counts, time.perf_counter() - started)
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
#: a coarse level may cost at most this much recall@10 at the nprobe an index is built for
#: (estimated on a check sample by ``RecallCost``); its probe widens until it does
MAX_RECALL_LOSS = 0.005
#: ... and may make queries scan at most this much more (relative growth of the lists'
#: imbalance factor, which is what a query following the data scans per probed list): a
#: vector whose nearest list lies in an unprobed cell lands in the nearest list across the
#: cell's border, and such vectors pile up in a few border lists (1M synthetic, 4,000 lists:
#: imbalance 1.53 exact, 2.23 / 1.70 / 1.56 through 2 / 4 / 8 cells; at probe 2, queries at
#: nprobe 8 scanned 15.4k vectors instead of 9.5k)
MAX_SCAN_GROWTH = 0.05
#: cells probed when two-level k-means refines its lists over the sample through its own
#: cells (a Lloyd step needs good labels, not exact ones)
REFINE_PROBE = 4
#: besides the nprobe a build is for, the recall loss of its assignment is reported at these
REPORTED_NPROBES = (8, 32)
#: queries of a ``RecallCost`` measurement (each with its 10 nearest vectors of the check sample)
REACH_QUERIES = 500
#: ``RecallCost``: a query near a vector is taken to probe the vector's own nprobe / NEAR_MARGIN
#: nearest lists (measured: see ``RecallCost``)
NEAR_MARGIN = 4
#: a coarse level's margins, tried narrowest first once its probe is good enough: a vector
#: skips a probed cell whose coarse centroid lies further than (1 + margin) times the squared
#: distance of its nearest one. Vectors deep inside a cell then compare with one or two
#: cells' lists, those near a border with every probed cell's (1M synthetic, 4,000 lists,
#: probe 8, 100k vectors: at margin 0.02, 4.65 cells probed on average instead of 8, the
#: nearest list found for 98.9% against 99.1%, the lists' imbalance 1.597 against 1.588)
MARGINS = (0.005, 0.01, 0.02, 0.04)
#: ... when it spares at least this share of the probed cells
MARGIN_SAVES = 0.1
#: vectors assigned per block: a block's rows gathered for each of its cells stay in the
#: caches (1M × 384, 4,000 lists, probe 8: 200k vectors in 0.97 s at 8,192 against 1.58 s at 65,536)
ASSIGN_BLOCK = 8_192


@contextmanager
def one_thread_each() -> Iterator[ThreadPoolExecutor]:
    """A pool of one worker per core, each running BLAS and faiss's OpenMP on one thread.

    threadpoolctl's limit is process-wide for OpenBLAS, but OpenMP's thread count belongs to
    each thread: set in the caller, it leaves pool workers at the machine's count, so every
    faiss call in a worker started a team of its own (4 threads on 2 cores, spinning in
    ``sched_yield``). Set in each worker too, assigning 200k vectors through a coarse level
    took 0.97 s instead of 1.49 s (docs/PITFALLS.md)."""
    with (
        threadpool_limits(1),
        ThreadPoolExecutor(max(1, os.cpu_count() or 1), initializer=faiss.omp_set_num_threads, initargs=(1,)) as pool,
    ):
        yield pool


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
        # a refinement step measures the lists next: no pass of the cell's own only to measure them
        return train_kmeans(
            LocalData(sample[cell == c]), int(share[c]), iterations, seed=seed + 1 + c, progress=False,
            measure=refine == 0,
        )  # fmt: skip

    # Cells are small problems: one BLAS/OpenMP thread each and cells in parallel ran 2.9x
    # faster here than the libraries' own threads on each cell in turn (200k x 384, k 1789).
    with (
        one_thread_each() as pool,
        tqdm(total=k1, desc=f"k-means k={k} (two-level)", disable=not progress, leave=False) as bar,
    ):
        results = []
        for result in pool.map(split, [c for c in range(k1) if share[c] > 0]):
            results.append(result)
            bar.update(1)
    history = [sum(r.objective for r in results)]
    rounds = max(r.iterations for r in results)
    centroids = np.ascontiguousarray(np.concatenate([r.centroids for r in results]), dtype=np.float32)
    kept = [c for c in range(k1) if share[c] > 0]
    cells = np.repeat(np.array(kept, dtype=np.int64), share[kept])
    counts = np.concatenate([r.counts for r in results]).astype(np.int64)
    # Each refinement step is one pass over the sample, its points assigned through the
    # cells they were trained in (``REFINE_PROBE`` nearest cells: S·(√k + probe·√k)
    # distances, not S·k; 6.5 s → about 2 s at 256k × 4,000 lists). The objective and
    # counts returned are those of the centroids before the last step, through the cells
    # (a build measures the final ones over all data when it assigns).
    objective = history[0]
    for _ in range(refine):
        level = CoarseLevel.from_cells(centroids, cells, counts)
        level.probe = min(REFINE_PROBE, len(level.cells))
        step = partial_sums(sample, centroids, level)
        objective, counts = step.objective, step.counts
        history.append(objective)
        nonempty = counts > 0
        centroids[nonempty] = (step.sums[nonempty] / counts[nonempty, None]).astype(np.float32)
    return KMeansResult(centroids, objective, rounds, history, counts, time.perf_counter() - started, cells)


class RecallCost:
    """What assigning a sample's vectors to other lists than their nearest costs a search at
    nprobe, estimated two ways, the larger counting.

    - **Far neighbours.** The queries are the first ``REACH_QUERIES`` vectors of the sample
      and their neighbours their 10 nearest other vectors of it; a neighbour is reached when
      its list is among the query's nprobe nearest lists (``reach``: recall@10 of an IVF
      index over the sample). The cost is the reach lost against exact labels.
    - **Near queries.** A vector whose list is not among its own nprobe / ``NEAR_MARGIN``
      nearest lists is taken to be missed by queries close to it (``missed``).

    Each alone failed where the other held (recall@10 lost against exact assignment, IVF
    over all vectors, measured 2026-12-05): on the Python docs (40k real embeddings, 802
    lists, section titles as queries) cells probed 1 / 2 / 4 lost 0.015 / 0.009 / 0.002 at
    nprobe 128, the far-neighbour estimate said 0.017 / 0.007 / 0.002 and the near one at
    most 0.0003; at 1M synthetic (4,000 lists, queries beside a document) they lost 0.0004
    / 0.0008 at nprobe 128 and 0.045 / 0.012 at 32, the near estimate said 0.010 / 0.0004
    and 0.067 / 0.013, and the far one was negative (a 10k sample's neighbours of a query
    lie in other topics there, and their lists are reached by chance).
    """

    def __init__(self, sample: Matrix, centroids: Matrix, nprobes: Sequence[int], queries: int = REACH_QUERIES):
        sample = np.ascontiguousarray(sample, dtype=np.float32)
        self.nprobes = list(nprobes)
        lists: Any = faiss.IndexFlatL2(centroids.shape[1])
        lists.add(np.ascontiguousarray(centroids, dtype=np.float32))
        #: each sample vector's nearest lists, nearest first (as many as near queries probe)
        self.own: npt.NDArray[np.int64] = lists.search(sample, max(1, max(self.nprobes) // NEAR_MARGIN))[1]
        q = sample[:queries]
        k = min(10, len(sample) - 1)
        self.masks: dict[int, npt.NDArray[np.bool_]] = {}
        self.neighbours = np.zeros((len(q), 0), dtype=np.int64)
        if k >= 1:
            index: Any = faiss.IndexFlatL2(sample.shape[1])
            index.add(sample)
            _, found = index.search(q, k + 1)
            # each query's k nearest others (it is usually first; exact duplicates may sort before it)
            mine = found == np.arange(len(q))[:, None]
            self.neighbours = np.stack([row[~m][:k] for row, m in zip(found, mine, strict=True)])
            _, probed = lists.search(q, max(self.nprobes))
            for nprobe in self.nprobes:
                mask = np.zeros((len(q), len(centroids)), dtype=bool)
                np.put_along_axis(mask, probed[:, :nprobe], True, axis=1)
                self.masks[nprobe] = mask
        self.base = self.reach(self.own[:, 0])

    def reach(self, labels: npt.NDArray[np.int64]) -> dict[int, float]:
        """Share of the queries' neighbours reached at each nprobe when they sit in ``labels``'s lists."""
        rows = np.arange(len(self.neighbours))[:, None]
        return {p: float(mask[rows, labels[self.neighbours]].mean()) for p, mask in self.masks.items()}

    def missed(self, labels: npt.NDArray[np.int64], within: int) -> float:
        """Share of the sample whose list is not among its own ``within`` nearest."""
        return 1.0 - float(np.mean(np.any(self.own[:, :within] == labels[:, None], axis=1)))

    def __call__(self, labels: npt.NDArray[np.int64]) -> dict[int, float]:
        """The estimated recall@10 lost at each nprobe."""
        got = self.reach(labels)
        return {
            p: max(self.base.get(p, 0.0) - got.get(p, 0.0), self.missed(labels, max(1, p // NEAR_MARGIN)))
            for p in self.nprobes
        }


def _members(cell_of_list: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], list[npt.NDArray[np.int64]]]:
    """The cells that hold lists, and each one's lists."""
    cells = np.unique(cell_of_list)
    return cells, [np.flatnonzero(cell_of_list == c) for c in cells]


@dataclass
class CoarseLevel:
    """Lists grouped into cells, each with a coarse centroid: a vector's list is the nearest
    centroid among those of its ``probe`` nearest cells, N·(cells + probe·lists/cells)
    distances instead of N·lists.

    The cells are two-level k-means's own (``from_cells``) or, for centroids trained flat or
    reused, cells found by k-means over the centroids (``group``; on data without structure
    one such cell takes nearly every list, see docs/PITFALLS.md, and the level then loses
    to exact assignment). ``calibrate`` chooses the probe by the recall it costs at the
    nprobe the index is built for and by how much more queries would scan, and times the
    level against exact assignment: fewer distances are not always less time (exact
    assignment is one large BLAS product).
    """

    centroids: Matrix
    coarse: Matrix
    cells: list[npt.NDArray[np.int64]]
    probe: int = 1
    #: of the probed cells, skip those further than (1 + margin) × the nearest's squared
    #: distance (None: probe them all); chosen by ``calibrate`` from ``MARGINS``
    margin: float | None = None
    #: cells a vector of the check sample compared with on average (after ``calibrate``)
    cells_probed: float = 0.0
    #: "training" (two-level k-means's cells) or "grouped" (k-means over the centroids)
    source: str = "grouped"
    #: what ``calibrate`` measured on its check sample: the share assigned as exactly, the
    #: nprobe the probe was chosen for, the recall lost at it and at ``REPORTED_NPROBES``
    agreement: float = 1.0
    nprobe: int = 0
    recall_loss: dict[int, float] = field(default_factory=dict)
    #: relative growth of the lists' imbalance factor against exact assignment (estimated)
    scan_growth: float = 0.0
    #: seconds to assign the check sample exactly and through this level
    exact_s: float = 0.0
    level_s: float = 0.0

    @property
    def faster(self) -> bool:
        return self.level_s < self.exact_s

    @property
    def usable(self) -> bool:
        """Faster than exact assignment, at a recall cost within ``MAX_RECALL_LOSS`` and a scan
        growth within ``MAX_SCAN_GROWTH`` (after ``calibrate``)."""
        return self.faster and self.good_enough(MAX_RECALL_LOSS, MAX_SCAN_GROWTH)

    def good_enough(self, max_loss: float, max_growth: float) -> bool:
        return self.recall_loss.get(self.nprobe, 1.0) <= max_loss and self.scan_growth <= max_growth

    @classmethod
    def from_cells(
        cls, centroids: Matrix, cells: npt.NDArray[np.int64], counts: npt.NDArray[np.int64] | None = None
    ) -> CoarseLevel:
        """The level of given cells (``cells[i]``: list i's cell): each cell's coarse centroid
        is the mean of its lists' centroids weighted by their sizes (``counts``), that is the
        mean of its vectors."""
        centroids = np.ascontiguousarray(centroids, dtype=np.float32)
        weights = np.ones(len(centroids)) if counts is None else np.asarray(counts, dtype=np.float64) + 1e-9
        members = _members(cells)[1]
        coarse = np.stack([np.average(centroids[m], axis=0, weights=weights[m]) for m in members])
        return cls(centroids, np.ascontiguousarray(coarse, dtype=np.float32), members, source="training")

    @classmethod
    def group(cls, centroids: Matrix, seed: int = 0) -> CoarseLevel:
        """About √k cells found by k-means over the k centroids themselves."""
        centroids = np.ascontiguousarray(centroids, dtype=np.float32)
        k1 = max(1, round(math.sqrt(len(centroids))))
        grouping = train_kmeans(LocalData(centroids), k1, iterations=10, seed=seed, progress=False)
        keep, members = _members(nearest(centroids, grouping.centroids)[1])
        return cls(centroids, grouping.centroids[keep], members)

    def calibrate(
        self, check: Matrix, nprobe: int, max_loss: float = MAX_RECALL_LOSS, stop_when_slower: bool = True,
        max_growth: float = MAX_SCAN_GROWTH,
    ) -> CoarseLevel:  # fmt: skip
        """Widen the probe from 1 until assigning ``check`` through this level costs at most
        ``max_loss`` of recall@10 at ``nprobe`` (``RecallCost``) and grows the lists'
        imbalance factor by at most ``max_growth``, or (``stop_when_slower``) until the level
        is no faster than exact assignment, when ``usable`` is false. Probing every cell is
        exact. A probe found good enough then takes the narrowest margin (``MARGINS``) that
        keeps it so while sparing cells.

        The imbalance of counts over a sample of n vectors exceeds the data's by about
        lists / n (sampling noise); the growth is measured on the check sample as a
        difference (measured at 1M: 0.63 / 0.14 / 0.02 on 10k against 0.70 / 0.16 / 0.03
        over all vectors at probe 2 / 4 / 8) over the data's imbalance estimated that way."""
        self.nprobe = max(1, min(nprobe, len(self.centroids)))
        self.probe, self.margin = 1, None
        if len(check) == 0:
            self.probe = len(self.cells)
            return self
        check = np.ascontiguousarray(check, dtype=np.float32)
        nprobes = sorted({self.nprobe, *(p for p in REPORTED_NPROBES if p < self.nprobe)})
        started = time.perf_counter()
        exact = nearest(check, self.centroids)[1]
        self.exact_s = time.perf_counter() - started
        cost = RecallCost(check, self.centroids, nprobes)
        k = len(self.centroids)
        exact_imbalance = imbalance(np.bincount(exact, minlength=k))
        data_imbalance = max(1.0, exact_imbalance - k / len(check))

        def measure() -> None:
            started = time.perf_counter()
            labels = self.search(check)[1]
            self.level_s = time.perf_counter() - started
            self.agreement = float(np.mean(labels == exact))
            self.recall_loss = {p: round(loss, 4) for p, loss in cost(labels).items()}
            grown = imbalance(np.bincount(labels, minlength=k)) - exact_imbalance
            self.scan_growth = round(max(0.0, grown) / data_imbalance, 4)
            self.cells_probed = round(float(np.mean(np.sum(self.probed(check)[1] >= 0, axis=1))), 2)

        while True:
            measure()
            slower = stop_when_slower and not self.faster
            if self.good_enough(max_loss, max_growth) and self.probe > 1:
                self._narrow(measure, max_loss, max_growth)
            if self.good_enough(max_loss, max_growth) or slower or self.probe >= len(self.cells):
                return self
            self.probe = min(2 * self.probe, len(self.cells))

    def _narrow(self, measure: Callable[[], None], max_loss: float, max_growth: float) -> None:
        """The narrowest of ``MARGINS`` that keeps this (good enough) probe good enough and
        spares at least ``MARGIN_SAVES`` of the cells; none when no margin does (what was
        measured is then that of no margin again). Counted, not timed: the same data and
        centroids make the same choice."""
        plain = (self.level_s, self.agreement, self.recall_loss, self.scan_growth, self.cells_probed)
        for margin in MARGINS:
            self.margin = margin
            measure()
            if self.good_enough(max_loss, max_growth) and self.cells_probed <= (1 - MARGIN_SAVES) * self.probe:
                return
        self.margin = None
        self.level_s, self.agreement, self.recall_loss, self.scan_growth, self.cells_probed = plain

    def probed(self, vectors: Matrix, coarse: Any = None) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
        """Each vector's ``probe`` nearest cells (squared distance, cell), nearest first; -1
        for a cell the margin skips."""
        if coarse is None:
            coarse = faiss.IndexFlatL2(self.coarse.shape[1])
            coarse.add(self.coarse)
        dist, cells = coarse.search(np.ascontiguousarray(vectors, dtype=np.float32), self.probe)
        if self.margin is not None:
            far = dist > np.maximum(dist[:, :1], 0) * (1 + self.margin)
            far[:, 0] = False  # the nearest cell always, even at a distance of 0 (or a rounding below)
            cells[far] = -1
        return dist, cells

    def search(self, vectors: Matrix) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
        """(squared distance, index) of each vector's assigned centroid.

        Blocks of vectors run in parallel, one BLAS/OpenMP thread each: a block's work is
        small products (its vectors of each cell against that cell's lists), where the
        libraries' threads cost more than they give (as for two-level k-means's cells; see
        docs/PITFALLS.md), and parallel blocks also overlap each block's serial numpy work."""
        n = len(vectors)
        best_d = np.full(n, np.inf, dtype=np.float32)
        best_i = np.full(n, -1, dtype=np.int64)
        coarse: Any = faiss.IndexFlatL2(self.coarse.shape[1])
        coarse.add(self.coarse)

        def one(lo: int) -> None:
            block = np.ascontiguousarray(vectors[lo : lo + ASSIGN_BLOCK], dtype=np.float32)
            probed = self.probed(block, coarse)[1]
            # (row, cell) pairs grouped by cell, those a margin skips (-1) first
            order = np.argsort(probed, axis=None, kind="stable")
            rows_of = order // self.probe
            bounds = np.searchsorted(probed.ravel()[order], np.arange(len(self.cells) + 1))
            for c, members in enumerate(self.cells):
                rows = rows_of[bounds[c] : bounds[c + 1]]
                if len(rows) == 0:
                    continue
                d, i = nearest(block[rows], self.centroids[members])
                target = rows + lo  # blocks write disjoint rows
                better = d < best_d[target]
                best_d[target[better]] = d[better]
                best_i[target[better]] = members[i[better]]

        with one_thread_each() as pool:
            list(pool.map(one, range(0, n, ASSIGN_BLOCK)))
        return best_d, best_i


def assign(
    vectors: Matrix, centroids: Matrix, level: CoarseLevel | None = None
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """Each vector's list: through ``level`` when given, else exact."""
    return level.search(vectors) if level is not None else nearest(vectors, centroids)
