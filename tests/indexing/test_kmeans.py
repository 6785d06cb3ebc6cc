from __future__ import annotations

from collections.abc import Callable

import faiss
import numpy as np
import pytest

from indexing.distributed import huge_page_advice, small_pages
from indexing.kmeans import (
    MARGINS,
    MAX_RECALL_LOSS,
    MAX_SCAN_GROWTH,
    CoarseLevel,
    KMeansError,
    LocalData,
    PartialSums,
    RecallCost,
    imbalance,
    nearest,
    one_thread_each,
    partial_sums,
    quotas,
    sample_indices,
    split_indices,
    train_kmeans,
    train_two_level,
)


def clustered(n: int = 6000, d: int = 32, k: int = 200, seed: int = 0) -> np.ndarray:
    """Unit vectors around many overlapping topics, like sentence embeddings."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((k, d)).astype(np.float32) * 4
    labels = rng.integers(0, k, n)
    x = centers[labels] + rng.standard_normal((n, d)).astype(np.float32)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_same_seed_same_result() -> None:
    x = clustered()
    a = train_kmeans(LocalData(x), 16, seed=3, progress=False)
    b = train_kmeans(LocalData(x), 16, seed=3, progress=False)
    np.testing.assert_array_equal(a.centroids, b.centroids)
    assert a.objective == b.objective


def test_objective_close_to_faiss_and_decreasing() -> None:
    import faiss

    x = clustered()
    ours = train_kmeans(LocalData(x), 24, iterations=25, seed=1, progress=False)
    ref = faiss.Kmeans(x.shape[1], 24, niter=25, seed=1)
    ref.train(x)
    ref_obj = float(partial_sums(x, ref.centroids).objective)
    assert ours.objective <= ref_obj * 1.01
    assert all(b <= a * (1 + 1e-6) for a, b in zip(ours.history, ours.history[1:], strict=False))
    assert ours.counts.sum() == len(x) and (ours.counts > 0).all()
    assert 1.0 <= ours.imbalance < 2.0


def test_empty_clusters_are_repaired() -> None:
    # 3 distinct points repeated: most of 8 clusters start empty or duplicate.
    x = np.repeat(np.eye(3, 4, dtype=np.float32), 50, axis=0)
    x += np.random.default_rng(0).standard_normal(x.shape).astype(np.float32) * 1e-3
    result = train_kmeans(LocalData(x), 8, seed=0, progress=False)
    assert (result.counts > 0).sum() >= 3


def test_refuses_too_few_points() -> None:
    with pytest.raises(KMeansError, match="cannot make 10 clusters"):
        train_kmeans(LocalData(np.zeros((5, 4), dtype=np.float32)), 10, progress=False)


def test_samples_do_not_depend_on_partitioning() -> None:
    x = clustered(1000)
    idx = sample_indices(1000, 50, 7)
    parts = np.array_split(x, 4)
    local = split_indices(idx, [len(p) for p in parts])
    np.testing.assert_array_equal(np.concatenate([p[i] for p, i in zip(parts, local, strict=True)]), x[idx])
    np.testing.assert_array_equal(LocalData(x).sample(50, 7), x[idx])


def test_ray_and_local_paths_agree(ray_local: None) -> None:
    from indexing.distributed import RayData

    x = clustered(8000)
    parts = np.array_split(x, 3)
    data = RayData([(lambda p=p: p) for p in parts])
    try:
        assert data.count() == len(x) and data.dim() == x.shape[1]
        distributed = train_kmeans(data, 24, seed=5, progress=False)
        local = train_kmeans(LocalData(x), 24, seed=5, progress=False)
        assert abs(distributed.objective - local.objective) / local.objective < 0.01
        assert distributed.counts.sum() == len(x)
        sizes = data.map(lambda v: len(v))
        assert sizes == [len(p) for p in parts]
    finally:
        data.close()


def separated(n: int, d: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Points tightly around k unit-vector centres (a known answer), and the centres."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((k, d)).astype(np.float32)
    centers /= np.linalg.norm(centers, axis=1, keepdims=True)
    x = centers[rng.integers(0, k, n)] + rng.standard_normal((n, d)).astype(np.float32) * 0.02
    return x.astype(np.float32), centers


def test_quotas_share_k_by_population() -> None:
    q = quotas(np.array([1000, 10, 0, 1, 500]), 40)
    assert q.sum() == 40 and q[2] == 0 and q[1] >= 1 and q[3] == 1 and q[0] > q[4] > q[1]
    assert quotas(np.array([3, 3]), 6).tolist() == [3, 3]  # never more clusters than points
    with pytest.raises(KMeansError):
        quotas(np.array([2, 1]), 4)


def test_two_level_against_flat_kmeans() -> None:
    # Known clusters: k tight clusters. Flat k-means seeds a large k from a random sample,
    # which leaves some clusters with two seeds and others with none; the two-level split
    # seeds each coarse cell by k-means++ and so does at least as well.
    x, centers = separated(30_000, 32, 300)
    flat = train_kmeans(LocalData(x), 300, 20, seed=1, progress=False)
    two = train_two_level(LocalData(x), 300, 20, seed=1, progress=False)
    assert two.centroids.shape == (300, 32)
    truth = partial_sums(x, centers).objective
    ours = partial_sums(x, two.centroids).objective
    assert ours <= partial_sums(x, flat.centroids).objective and ours <= 3.5 * truth  # measured 3.1x, flat 7.5x
    # Overlapping topics (like embeddings): fine clusters are trained inside their coarse
    # cell on a sample of 64 points per list, so the objective is a few % above flat k-means
    # over all points; a refinement step over the sample with all lists closes part of it.
    x = clustered(30_000, 32, 1000)
    flat_obj = partial_sums(x, train_kmeans(LocalData(x), 300, 20, seed=1, progress=False).centroids).objective
    before = partial_sums(x, train_two_level(LocalData(x), 300, 20, seed=1, progress=False, refine=0).centroids)
    after = partial_sums(x, train_two_level(LocalData(x), 300, 20, seed=1, progress=False, refine=1).centroids)
    assert after.objective <= before.objective, (before.objective / flat_obj, after.objective / flat_obj)
    assert after.objective <= 1.06 * flat_obj, after.objective / flat_obj


def test_recall_cost_measures_far_neighbours_and_near_queries() -> None:
    """With exact labels, the share of neighbours ``RecallCost.reach`` says a search at
    nprobe reaches is recall@10 of a faiss IVF index over the sample at that nprobe (each
    query's nearest other vectors as truth); a vector's list outside its own nearest few
    counts as missed by queries near it."""
    x = clustered(4000, 32, 2000)  # nearly without structure: neighbours straddle lists
    centroids = train_kmeans(LocalData(x), 64, 10, seed=2, progress=False).centroids
    quantizer = faiss.IndexFlatL2(32)
    quantizer.add(centroids)
    _, own = quantizer.search(x, 16)
    cost = RecallCost(x, centroids, [1, 4, 16], queries=300)
    np.testing.assert_array_equal(cost.own, own[:, :4])  # 16 // NEAR_MARGIN
    got = cost.reach(own[:, 0])
    ivf = faiss.IndexIVFFlat(quantizer, 32, 64)
    ivf.is_trained = True
    ivf.add(x)
    for nprobe in (1, 4, 16):
        ivf.nprobe = nprobe
        _, found = ivf.search(x[:300], 11)  # the query itself, then what its probed lists hold nearest
        pairs = zip(found, cost.neighbours, strict=True)
        expected = np.mean([len(set(f.tolist()) & set(n.tolist())) / 10 for f, n in pairs])
        assert got[nprobe] == pytest.approx(expected)
    assert got[1] < got[4] < got[16] <= 1.0
    assert cost(own[:, 0]) == {1: 0.0, 4: 0.0, 16: 0.0}  # exact labels cost nothing
    second = own[:, 1]  # every vector in its second-nearest list
    assert cost.missed(second, 1) == 1.0 and cost.missed(second, 2) == 0.0
    lost = cost(second)
    assert lost[1] == 1.0 and lost[4] == 1.0  # 4 // NEAR_MARGIN = 1: near queries miss them all
    assert lost[16] == pytest.approx(max(got[16] - cost.reach(second)[16], 0.0))  # within 4: the far estimate


def test_a_coarse_level_over_training_cells_bounds_the_recall_it_costs() -> None:
    x = clustered(30_000, 32, 1000)
    trained = train_two_level(LocalData(x), 400, 10, seed=1, progress=False)
    assert trained.cells is not None and len(trained.cells) == 400
    level = CoarseLevel.from_cells(trained.centroids, trained.cells, trained.counts)
    assert level.source == "training"
    assert sorted(np.concatenate(level.cells).tolist()) == list(range(400))  # every list in one cell
    level.calibrate(x[:5000], nprobe=40, stop_when_slower=False)  # at this size exact assignment is faster
    assert level.nprobe == 40 and set(level.recall_loss) == {8, 32, 40}
    assert level.recall_loss[40] <= MAX_RECALL_LOSS and 1 <= level.probe < len(level.cells)
    # held out: the recall@10 the level's labels cost against exact labels, measured afresh
    held = x[5000:20_000]
    fresh = RecallCost(held, trained.centroids, [40])
    labels = level.search(held)[1]
    assert fresh(labels)[40] <= 2 * MAX_RECALL_LOSS
    # ... and what queries scan: the lists' imbalance factor grew by at most MAX_SCAN_GROWTH
    assert level.scan_growth <= MAX_SCAN_GROWTH
    exact = imbalance(np.bincount(nearest(held, trained.centroids)[1], minlength=400))
    assert imbalance(np.bincount(labels, minlength=400)) <= exact * (1 + 2 * MAX_SCAN_GROWTH)
    # a search that probes fewer lists needs more of the vectors in their nearest list
    narrow = CoarseLevel.from_cells(trained.centroids, trained.cells, trained.counts).calibrate(
        x[:5000], 1, stop_when_slower=False
    )
    assert narrow.probe >= level.probe
    everything = CoarseLevel(trained.centroids, level.coarse, level.cells, probe=len(level.cells))
    np.testing.assert_array_equal(everything.search(x)[1], nearest(x, trained.centroids)[1])  # every cell: exact


def test_a_margin_skips_the_probed_cells_far_beyond_the_nearest() -> None:
    x = clustered(30_000, 32, 1000)
    trained = train_two_level(LocalData(x), 400, 10, seed=1, progress=False)
    assert trained.cells is not None
    level = CoarseLevel.from_cells(trained.centroids, trained.cells, trained.counts)
    level.probe = 8
    every = level.search(x)[1]
    level.margin = 1e9  # skips nothing
    assert (level.probed(x)[1] >= 0).all()
    np.testing.assert_array_equal(level.search(x)[1], every)
    level.margin = 0.0  # the nearest cell alone (but for ties)
    kept = level.probed(x)[1]
    assert (kept[:, 0] >= 0).all() and np.mean(np.sum(kept >= 0, axis=1)) < 1.01
    one = CoarseLevel(trained.centroids, level.coarse, level.cells, probe=1).search(x)[1]
    assert np.mean(level.search(x)[1] == one) > 0.99
    level.margin = 0.05
    between = np.sum(level.probed(x)[1] >= 0, axis=1)
    assert 1 < between.mean() < 8
    on = level.coarse[:50]  # vectors on coarse centroids (distance 0) keep their nearest cell
    assert (level.probed(on)[1][:, 0] >= 0).all() and (level.search(on)[1] >= 0).all()
    # calibration keeps a margin only while the level stays good enough, and says what it probed
    level.calibrate(x[:5000], nprobe=40, stop_when_slower=False)
    assert level.margin is None or level.margin in MARGINS
    assert level.good_enough(MAX_RECALL_LOSS, MAX_SCAN_GROWTH)
    assert 1 <= level.cells_probed <= level.probe
    if level.margin is not None:
        assert level.cells_probed < level.probe


def test_centroids_without_training_cells_are_grouped_by_kmeans() -> None:
    x = clustered(30_000, 32, 1000)
    centroids = train_kmeans(LocalData(x), 400, 10, seed=1, progress=False).centroids
    level = CoarseLevel.group(centroids).calibrate(x[:3000], nprobe=40, stop_when_slower=False)
    assert level.source == "grouped" and sorted(np.concatenate(level.cells).tolist()) == list(range(400))
    assert level.recall_loss[40] <= MAX_RECALL_LOSS
    everything = CoarseLevel(centroids, level.coarse, level.cells, probe=len(level.cells))
    np.testing.assert_array_equal(everything.search(x)[1], nearest(x, centroids)[1])


def test_pool_workers_run_faiss_and_blas_on_one_thread_each() -> None:
    # OpenMP's thread count belongs to each thread: a limit set only in the caller left every
    # worker's faiss calls starting a team of the machine's size (oversubscribed, 2x slower)
    from threadpoolctl import threadpool_info

    with one_thread_each() as pool:
        omp = set(pool.map(lambda _: faiss.omp_get_max_threads(), range(8)))
        blas = set(pool.map(lambda _: max(i["num_threads"] for i in threadpool_info()), range(8)))
    assert omp == {1} and blas == {1}


def test_a_build_allocates_without_huge_page_advice_and_restores_it() -> None:
    before = huge_page_advice(True)
    try:
        with small_pages():
            assert huge_page_advice(False) is False  # numpy's advice is off inside
        assert huge_page_advice(True) is True  # and back as it was after
    finally:
        huge_page_advice(before)


def test_a_caller_that_assigns_afterwards_can_skip_the_measuring_pass() -> None:
    x = clustered(3000, 16, 20)
    calls: list[int] = []

    def counted(data: LocalData) -> Callable[[np.ndarray], PartialSums]:
        def step(centroids: np.ndarray) -> PartialSums:
            calls.append(1)
            return data.assign_partial(centroids)

        return step

    data = LocalData(x)
    measured = train_kmeans(data, 20, 6, tol=0.0, seed=4, progress=False, reduce=counted(data))
    assert len(calls) == 7 and measured.objective == partial_sums(x, measured.centroids).objective
    calls.clear()
    quick = train_kmeans(data, 20, 6, tol=0.0, seed=4, progress=False, reduce=counted(data), measure=False)
    assert len(calls) == 6  # the build's assignment measures the final centroids instead
    np.testing.assert_array_equal(quick.centroids, measured.centroids)
    assert quick.objective == measured.history[-2] >= measured.objective


def test_partial_sums_are_close_to_float64_and_copy_no_vectors() -> None:
    """Sums in float32 over blocks, added in float64: within 3e-6 of float64 throughout on a
    big list (60k vectors in one list: 1.4e-6 measured, float32 over all of them 9.3e-6),
    without the float64 copy of every vector a step used to make (twice the vectors' size)."""
    import tracemalloc

    rng = np.random.default_rng(3)
    x = rng.standard_normal((60_000, 256)).astype(np.float32) + 0.5
    for k in (1, 7):
        centroids = x[:k].copy()
        labels = nearest(x, centroids)[1]
        exact = np.stack([x[labels == j].astype(np.float64).sum(axis=0) for j in range(k)])
        tracemalloc.start()
        got = partial_sums(x, centroids)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert np.abs(got.sums - exact).max() <= 3e-6 * np.abs(exact).max()
        assert got.counts.tolist() == np.bincount(labels, minlength=k).tolist()
        assert peak < x.nbytes / 4, f"partial_sums allocated {peak / x.nbytes:.2f}x the vectors"
