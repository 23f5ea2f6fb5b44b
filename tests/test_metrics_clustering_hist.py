"""Clustering metrics and positive/negative histograms against brute-force references."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.spatial.distance import jensenshannon
from sklearn.metrics import adjusted_mutual_info_score, normalized_mutual_info_score

from dmlkit.exceptions import ConfigError, DataError
from dmlkit.metrics import (
    cluster_metrics,
    evaluate,
    faiss_available,
    js_divergence,
    kmeans_labels,
    pair_f1,
    pos_neg_histograms,
)


# -- clustering -----------------------------------------------------------------------------------
def ref_pair_f1(labels, clusters):
    tp = fp = fn = 0
    for i, j in itertools.combinations(range(len(labels)), 2):
        same_c, same_k = labels[i] == labels[j], clusters[i] == clusters[j]
        tp += same_c and same_k
        fp += same_k and not same_c
        fn += same_c and not same_k
    if tp == 0:
        return 0.0
    p, r = tp / (tp + fp), tp / (tp + fn)
    return 2 * p * r / (p + r)


def test_pair_f1_matches_pair_enumeration():
    rng = np.random.default_rng(0)
    for _ in range(5):
        y = rng.integers(0, 6, size=70)
        c = rng.integers(0, 5, size=70)
        assert pair_f1(y, c) == pytest.approx(ref_pair_f1(y, c), abs=1e-12)
    assert pair_f1([0, 0, 1, 1], [5, 5, 7, 7]) == 1.0
    assert pair_f1([0, 1, 2], [0, 0, 0]) == 0.0  # no positive pair at all


def blobs(n_per=30, classes=5, d=8, spread=0.05, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(classes, d)) * 3
    y = np.repeat(np.arange(classes), n_per)
    x = centers[y] + spread * rng.normal(size=(y.size, d))
    return x.astype(np.float32), y


@pytest.mark.parametrize("backend", ["dmlkit", "sklearn", pytest.param("faiss", marks=pytest.mark.skipif(
    not faiss_available(), reason="faiss"))])
def test_separated_clusters_score_one(backend):
    x, y = blobs()
    res = cluster_metrics(x, y, restarts=2, backend=backend)
    assert res == pytest.approx({"nmi": 1.0, "ami": 1.0, "pair_f1": 1.0}, abs=1e-9)


def test_cluster_metrics_average_seeded_restarts():
    x, y = blobs(spread=2.5, seed=1)  # overlapping: the seed matters
    runs = [kmeans_labels(x, 5, seed=s, backend="sklearn") for s in (3, 4, 5)]
    want = {
        "nmi": np.mean([normalized_mutual_info_score(y, a) for a in runs]),
        "ami": np.mean([adjusted_mutual_info_score(y, a) for a in runs]),
        "pair_f1": np.mean([ref_pair_f1(y, a) for a in runs]),
    }
    got = cluster_metrics(x, y, restarts=3, seed=3, backend="sklearn")
    assert got == pytest.approx(want, abs=1e-12)
    assert cluster_metrics(x, y, restarts=3, seed=3, backend="sklearn") == got  # deterministic


def test_evaluate_clustering_keys():
    x, y = blobs()
    res = evaluate(x, y, metrics=["nmi", "ami", "pair_f1"], cluster_restarts=1)
    assert res["nmi"] == pytest.approx(1.0) and res["pair_f1"] == pytest.approx(1.0)
    with pytest.raises(DataError):
        cluster_metrics(x, y, restarts=0)


def test_dmlkit_kmeans_is_lloyd_with_exact_assignments():
    """Every returned label is the nearest final centroid (the mean of its cluster); seeds are
    reproducible and one k-means++ run separates well-separated blobs."""
    x, y = blobs(n_per=40, classes=12, d=6, spread=0.6, seed=2)
    a = kmeans_labels(x, 12, seed=7, backend="dmlkit")
    assert np.array_equal(a, kmeans_labels(x, 12, seed=7, backend="dmlkit"))
    centres = np.stack([x[a == c].astype(np.float64).mean(0) for c in np.unique(a)])
    d2 = ((x[:, None, :].astype(np.float64) - centres[None]) ** 2).sum(-1)
    # converged on this easy data: the labels are a fixed point of Lloyd's iteration
    assert np.array_equal(np.unique(a)[d2.argmin(1)], a)
    # equidistant blobs far apart against their spread: k-means++ seeds one per blob (a second
    # seed in a seeded blob has probability ~1e-4 per draw), whatever the seed
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(12), 30)
    x = (100 * np.eye(12)[y] + 0.3 * rng.normal(size=(y.size, 12))).astype(np.float32)
    for seed in range(5):
        assert normalized_mutual_info_score(y, kmeans_labels(x, 12, seed=seed)) == pytest.approx(1.0)


def test_dmlkit_kmeans_handles_duplicates_and_empty_clusters():
    x = np.repeat(np.eye(3, dtype=np.float32), [5, 5, 2], axis=0)  # 3 distinct points, k = 5
    a = kmeans_labels(x, 5, seed=0)
    assert a.shape == (12,) and a.min() >= 0 and a.max() < 5
    # rows that are equal end in the same cluster
    assert len(set(a[:5])) == 1 and len(set(a[5:10])) == 1 and len(set(a[10:])) == 1
    with pytest.raises(ConfigError, match="k-means backend"):
        kmeans_labels(x, 2, backend="annoy")


def test_ami_equals_scikit_learn_over_distinct_sizes():
    from dmlkit.metrics.clustering import adjusted_mutual_info

    rng = np.random.default_rng(0)
    for n, c, k in [(500, 10, 12), (3000, 60, 45), (40, 3, 3), (50, 1, 4), (50, 4, 1), (7, 7, 7)]:
        y = rng.integers(0, c, n)
        a = np.where(rng.random(n) < 0.6, y, rng.integers(0, k, n))
        assert adjusted_mutual_info(y, a) == pytest.approx(adjusted_mutual_info_score(y, a), abs=1e-10)


def test_ami_of_a_perfect_clustering_is_one_even_with_singleton_classes():
    """Every class a singleton, clustered perfectly: AMI is 0/0 in exact arithmetic and its
    rounding noise read 0.0 (n = 2), 1.25 (n = 10) or 0.98 (n = 100); scikit-learn's noise
    cancels to 1. A renaming of the labels is 1 exactly; AMI never exceeds 1."""
    from dmlkit.metrics.clustering import adjusted_mutual_info

    for n in (2, 10, 18, 19, 22, 100, 150):
        y = np.arange(n)
        assert adjusted_mutual_info(y, y) == 1.0
        assert adjusted_mutual_info(y, (7 * y + 3)[::-1]) == 1.0
    x = np.random.default_rng(0).normal(size=(10, 4)).astype(np.float32)
    # evaluate's k-means with k = N reproduces the labels whatever the embeddings: no number
    with pytest.warns(UserWarning, match="reproduces the labels whatever the embeddings"):
        assert np.isnan(evaluate(x, np.arange(10), metrics=["ami"], cluster_restarts=1)["ami"])
    rng = np.random.default_rng(1)
    for _ in range(200):
        n = int(rng.integers(2, 120))
        y, c = rng.integers(0, int(rng.integers(1, n + 1)), n), rng.integers(0, int(rng.integers(1, n + 1)), n)
        assert adjusted_mutual_info(y, c) == pytest.approx(adjusted_mutual_info_score(y, c), abs=1e-10)
        assert adjusted_mutual_info(y, c) <= 1.0


def test_clustering_spread_over_restarts():
    x, y = blobs(spread=2.5, seed=1)
    got = cluster_metrics(x, y, restarts=3, seed=3, backend="sklearn", spread=True)
    runs = [normalized_mutual_info_score(y, kmeans_labels(x, 5, seed=s, backend="sklearn")) for s in (3, 4, 5)]
    assert got["nmi_std"] == pytest.approx(np.std(runs, ddof=1), abs=1e-12)
    assert set(got) == {"nmi", "ami", "pair_f1", "nmi_std", "ami_std", "pair_f1_std"}
    res = evaluate(x, y, metrics=["nmi", "map_at_r"], cluster_restarts=2)
    assert list(res) == ["nmi", "map_at_r", "num_queries", "num_queries_without_positive", "nmi_std"]
    assert evaluate(x, y, metrics=["ami"], cluster_restarts=1)["ami_std"] == 0.0


# -- histograms ------------------------------------------------------------------------------------
def pair_values(q, ql, r=None, rl=None):
    qn = q / np.linalg.norm(q, axis=1, keepdims=True)
    if r is None:
        s = qn @ qn.T
        iu = np.triu_indices(len(q), 1)
        return s[iu], (ql[:, None] == ql[None, :])[iu]
    rn = r / np.linalg.norm(r, axis=1, keepdims=True)
    return (qn @ rn.T).ravel(), (ql[:, None] == rl[None, :]).ravel()


@pytest.mark.parametrize("same", [True, False])
def test_histograms_match_numpy(same):
    rng = np.random.default_rng(4)
    q = rng.normal(size=(300, 5)).astype(np.float32)
    ql = rng.integers(0, 9, size=300)
    r = rl = None
    if not same:
        r = rng.normal(size=(250, 5)).astype(np.float32)
        rl = rng.integers(0, 9, size=250)
    h = pos_neg_histograms(q, ql, r, rl, bins=20, memory_budget=2**20)
    vals, pos = pair_values(q.astype(np.float64), ql, None if r is None else r.astype(np.float64), rl)
    edges = np.linspace(-1, 1, 21)
    want_pos, _ = np.histogram(vals[pos], bins=edges)
    want_neg, _ = np.histogram(vals[~pos], bins=edges)
    # float32 vs float64 may move a value sitting on a bin edge by one bin
    assert np.abs(h.pos_counts - want_pos).sum() <= 2
    assert np.abs(h.neg_counts - want_neg).sum() <= 2
    assert h.num_positive_pairs == int(pos.sum()) and h.num_negative_pairs == int((~pos).sum())
    width = edges[1] - edges[0]
    assert (h.pos_density * width).sum() == pytest.approx(1.0)
    assert (h.neg_density * width).sum() == pytest.approx(1.0)
    assert h.js == pytest.approx(jensenshannon(h.pos_counts, h.neg_counts, base=2) ** 2, abs=1e-12)
    np.testing.assert_allclose(h.edges, edges)


def test_histograms_blockwise_equals_one_block():
    rng = np.random.default_rng(8)
    x = rng.normal(size=(900, 4)).astype(np.float32)
    y = rng.integers(0, 30, size=900)
    a = pos_neg_histograms(x, y, bins=50, memory_budget=2**20)  # many tiles
    b = pos_neg_histograms(x, y, bins=50, memory_budget=2**30)  # one tile
    np.testing.assert_array_equal(a.pos_counts, b.pos_counts)
    np.testing.assert_array_equal(a.neg_counts, b.neg_counts)
    assert a.num_positive_pairs + a.num_negative_pairs == 900 * 899 // 2


def test_histograms_other_distance_and_range():
    rng = np.random.default_rng(9)
    x = rng.normal(size=(80, 3)).astype(np.float32)
    y = rng.integers(0, 4, size=80)
    h = pos_neg_histograms(x, y, distance="euclidean", bins=10)
    assert h.edges[0] >= 0 and h.edges[-1] <= 2.0 + 1e-6  # distances of unit vectors
    assert h.num_positive_pairs + h.num_negative_pairs == 80 * 79 // 2
    h2 = pos_neg_histograms(x, y, bins=4, range=(0.0, 1.0))
    assert h2.edges.tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert h2.to_dict()["js"] == h2.js
    with pytest.raises(ConfigError):
        pos_neg_histograms(x, y, range=(1.0, 0.0))


def test_js_bounds_and_errors():
    assert js_divergence([1, 0], [0, 1]) == pytest.approx(1.0)
    assert js_divergence([3, 1], [6, 2]) == pytest.approx(0.0)
    # perfectly separated embeddings: positives at similarity 1, negatives at 0
    x = np.array([[1, 0], [1, 0], [0, 1], [0, 1]], dtype=np.float32)
    assert evaluate(x, [0, 0, 1, 1], metrics=["pos_neg_js"])["pos_neg_js"] == pytest.approx(1.0)
    with pytest.raises(DataError, match="no positive pair"):
        pos_neg_histograms(np.eye(3, dtype=np.float32), [0, 1, 2])
    with pytest.raises(DataError, match="no negative pair"):
        pos_neg_histograms(np.eye(3, dtype=np.float32), [0, 0, 0])


@pytest.mark.parametrize("same", [True, False])
def test_histogram_counts_compiled_equals_torch(same):
    """The CPU path (compiled kernel on threads) and the device path (torch ops) count alike,
    including values exactly on bin edges and at the clamped ends."""
    from dmlkit.distances import DotProductSimilarity
    from dmlkit.metrics.histograms import _count_cpu, _count_torch

    rng = np.random.default_rng(8)
    q = torch.from_numpy(rng.integers(-3, 4, size=(700, 3)).astype(np.float32))  # exact, on edges
    ql = torch.from_numpy(rng.integers(0, 9, size=700))
    r, rl = (q, ql) if same else (q[:450] + 1, ql[:450])
    dot = DotProductSimilarity(normalize_embeddings=False)
    for lo, hi, bins in [(-10.0, 10.0, 20), (-5.0, 7.0, 7)]:
        a = _count_cpu(dot, q, ql, r, rl, same, lo, hi, bins, 2**20)
        b = _count_torch(dot, q, ql, r, rl, same, lo, hi, bins, 2**20)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])
        assert a[1].sum() == (700 * 699 // 2 if same else 700 * 450)


def test_bf16_assignments_equal_float64_argmin(monkeypatch):
    """The k-means assignment with bfloat16 products (where a CPU has them) is the float64
    nearest centroid, ties by index - the same answer on every CPU."""
    import importlib

    clustering_module = importlib.import_module("dmlkit.metrics.clustering")
    tiles_module = importlib.import_module("dmlkit.metrics._tiles")

    rng = np.random.default_rng(6)
    x = rng.normal(size=(700, 20)).astype(np.float32)
    c = x[:40] + 0.3 * rng.normal(size=(40, 20)).astype(np.float32)
    c[7] = c[3]  # an exact tie: the smaller index wins
    x_aug = torch.from_numpy(np.concatenate([x, np.ones((700, 1), np.float32)], 1))
    c64 = c.astype(np.float64)
    c_aug = torch.from_numpy(np.concatenate([c, (-0.5 * (c64**2).sum(1, keepdims=True)).astype(np.float32)], 1))
    exact = x_aug.double().numpy() @ c_aug.double().numpy().T
    want = exact.argmax(1)  # first maximum: the smaller index
    for bf16 in (False, True):
        got = clustering_module._nearest(x_aug, c_aug, bf16).numpy()
        np.testing.assert_array_equal(got, want)
    # and through k-means itself, forced onto the bfloat16 path
    monkeypatch.setattr(clustering_module, "_BF16_MIN_PAIRS", 0)
    monkeypatch.setattr(tiles_module, "_bf16_is_faster", lambda d: True)
    a = kmeans_labels(x, 40, seed=1)
    monkeypatch.setattr(tiles_module, "_bf16_is_faster", lambda d: False)
    b = kmeans_labels(x, 40, seed=1)
    assert normalized_mutual_info_score(a, b) > 0.99  # same seeds; float32 near-ties may differ


def test_a_narrow_cone_is_warned_about_and_observed_bins_resolve_it():
    """Well-separated classes whose cosines all lie in [0.99, 1]: the metric's fixed bins put
    every pair in one or two bins (JS near 0) and say so; bins over the observed range (the
    report's and `dmlkit plot histograms`' picture) resolve the separation."""
    import warnings

    rng = np.random.default_rng(3)
    centres = rng.normal(size=(6, 32))
    y = np.repeat(np.arange(6), 20)
    x = (centres[y] + 0.05 * rng.normal(size=(120, 32))).astype(np.float32)
    cone = (x * 0.01 + np.ones(32, np.float32)).astype(np.float32)  # every cosine above 0.99
    with pytest.warns(UserWarning, match="cannot separate these positives from negatives"):
        fixed = pos_neg_histograms(cone, y)
    observed = pos_neg_histograms(cone, y, range="observed")
    assert fixed.js < 0.05 and observed.js > 0.5
    assert observed.edges[0] > 0.98 and observed.edges[-1] <= 1.0 + 1e-6
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a spread embedding: no warning
        pos_neg_histograms(x, y)
    with pytest.raises(ConfigError, match="observed"):
        pos_neg_histograms(x, y, range="widest")


# -- the whole-set metrics' own arguments (audit) ---------------------------------------------
def test_histogram_arguments_are_checked_as_evaluate_checks_them():
    """reference_labels without a reference and a third range entry were ignored; bins=True was
    torch's TypeError and a numpy integer refused."""
    from dmlkit.exceptions import ConfigError, ShapeError
    from dmlkit.metrics import pos_neg_histograms

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(24, 8)).astype(np.float32), np.repeat(np.arange(4), 6)
    with pytest.raises(ShapeError, match="reference_labels given without reference embeddings"):
        pos_neg_histograms(x, y, None, y)
    with pytest.raises(ConfigError, match=r"range must be \(low, high\)"):
        pos_neg_histograms(x, y, range=(-1, 1, 5))
    with pytest.raises(ConfigError, match="bins must be an integer from 2 to 1000000, got True"):
        pos_neg_histograms(x, y, bins=True)
    assert pos_neg_histograms(x, y, bins=np.int64(10)).js == pos_neg_histograms(x, y, bins=10).js


def test_js_of_huge_but_equal_histograms_is_zero():
    """Counts near 1e308 overflowed the sum: the normalised histogram was all zeros (JS 0.5)."""
    from dmlkit.metrics import js_divergence

    assert js_divergence([1e308, 1e308], [1.0, 1.0]) == 0.0
    assert js_divergence([1e308, 0.0], [0.0, 1.0]) == 1.0


def test_kmeans_arguments_are_one_error_each():
    """niter = -1 returned the all-zero start as a clustering; 4.0 clusters and 1-D input were
    torch's and numpy's own errors."""
    from dmlkit.exceptions import ConfigError, ShapeError
    from dmlkit.metrics import kmeans_labels

    x = np.random.default_rng(0).normal(size=(24, 8)).astype(np.float32)
    with pytest.raises(ConfigError, match="niter must be a non-negative integer, got -1"):
        kmeans_labels(x, 4, niter=-1)
    with pytest.raises(ConfigError, match="n_clusters must be a positive integer, got 4.0"):
        kmeans_labels(x, 4.0)
    with pytest.raises(ShapeError):
        kmeans_labels(x[:, 0], 4)


def test_the_restarts_seeds_are_checked_as_a_range():
    """seed = 2**32 - 1 with 2 restarts was refused as "got 4294967296", a seed nobody passed."""
    from dmlkit.exceptions import ConfigError

    x = np.random.default_rng(0).normal(size=(24, 8)).astype(np.float32)
    with pytest.raises(ConfigError, match=r"2 k-means restarts use seeds 4294967295 \.\.\. 4294967296"):
        evaluate(x, np.repeat(np.arange(4), 6), metrics=["nmi"], seed=2**32 - 1, cluster_restarts=2)


def test_integer_scores_beyond_float64s_integers_are_refused():
    """2^53 + 1 and 2^53 became one float64: AUC 0.5 for a perfect ranking."""
    from dmlkit.exceptions import DataError
    from dmlkit.metrics import roc_auc

    assert roc_auc(np.array([2**53, 2**53 - 1]), np.array([1, 0])) == 1.0
    with pytest.raises(DataError, match="integer scores beyond 2\\*\\*53"):
        roc_auc(np.array([2**53 + 1, 2**53]), np.array([1, 0]))
