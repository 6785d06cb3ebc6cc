from __future__ import annotations

import numpy as np
import pytest

from indexing.kmeans import KMeansError, LocalData, partial_sums, sample_indices, split_indices, train_kmeans


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
