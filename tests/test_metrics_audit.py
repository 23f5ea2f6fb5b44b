"""Audit of the evaluation metrics: each test pins a bug that gave a silent wrong number, a
traceback, or behaviour that contradicted the docs."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch

from dmlkit.exceptions import ConfigError
from dmlkit.metrics import evaluate, fpr_at_tpr, per_class, per_query


def _small():
    x = np.array([[1, 0], [0.9, 0.1], [0, 1], [0.1, 0.9], [1, 1]], np.float32)
    return x, np.array([0, 0, 1, 1, 1])


def test_per_class_runs_with_full_float32_products(monkeypatch):
    """per_class searched under the caller's matmul precision: with "high" (TF32 on a GPU) the
    near-tie re-search's float32 products lose the error bound it relies on."""
    ev = importlib.import_module("dmlkit.metrics.evaluate")  # the package's `evaluate` is the function
    seen = []
    inner = ev._retrieval_per_query

    def spy(*args, **kwargs):
        seen.append(torch.get_float32_matmul_precision())
        return inner(*args, **kwargs)

    monkeypatch.setattr(ev, "_retrieval_per_query", spy)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        x, y = _small()
        per_class(x, y)
        after = torch.get_float32_matmul_precision()
    finally:
        torch.set_float32_matmul_precision(before)
    assert seen == ["highest"]
    assert after == "high"  # the caller's setting is restored


@pytest.mark.parametrize("ks", [(2.5,), (1, 1.9), (True,), ("2",), (0,), (math.inf,)])
def test_k_values_that_are_not_whole_numbers_are_refused(ks):
    """k_values=(2.5,) was truncated to recall_at_2 without a word."""
    x, y = _small()
    with pytest.raises(ConfigError, match="k_values must be positive integers"):
        evaluate(x, y, metrics=["recall_at_k"], k_values=ks)


def test_numpy_integer_k_values_are_accepted():
    x, y = _small()
    for ks in (np.array([1, 2]), (1.0, np.float32(2))):  # whole numbers, whatever their type
        res = evaluate(x, y, metrics=["precision_at_k"], k_values=ks)
        assert list(res)[:2] == ["precision_at_1", "precision_at_2"]


def test_per_query_and_per_class_without_any_positive_match_evaluate():
    """One row: evaluate() reports NaN, per_query / per_class raised 'no row other than the query
    itself' (so `dmlkit evaluate --per-class` printed the table, then failed)."""
    x = np.ones((1, 3), np.float32)
    assert math.isnan(evaluate(x, [4], metrics=["precision_at_1", "map_at_r"])["precision_at_1"])
    scores, r_q = per_query(x, [4], metrics=["precision_at_1", "map_at_r"])
    assert r_q.tolist() == [0]
    assert all(np.isnan(v).all() and v.shape == (1,) for v in scores.values())
    table = per_class(x, ["only"])
    assert set(table) == {"only"}
    assert math.isnan(table["only"]["precision_at_1"])
    assert table["only"]["num_queries"] == table["only"]["num_queries_without_positive"] == 1


def test_fpr_at_a_tiny_tpr_accepts_at_least_one_positive():
    """The rounding slack made a TPR below 1e-9 need zero positives: the origin, FPR 0, where
    the first threshold reaching it already accepts a negative."""
    scores = np.array([3.0, 2.0, 1.0, 0.0])
    labels = np.array([0, 1, 1, 0])
    assert fpr_at_tpr(scores, labels, 1e-12) == 0.5
    assert fpr_at_tpr(scores, labels, 0.5) == 0.5
    assert fpr_at_tpr(scores, labels, 1.0) == 0.5


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_cosine_exact_ties_as_documented(backend):
    """docs/metrics.md: cosine keeps exact ties between rows that normalise exactly, but not every
    exact tie (it said it kept them all): e_1 and (1,1,1,1,1,1,-1,-1,-1) both have cosine 1/3 with
    nine ones, and the rounded rows rank the second first whatever the indices."""
    q = np.ones((1, 9), np.float32)
    e1 = np.eye(9, dtype=np.float32)[0]
    b = np.array([1, 1, 1, 1, 1, 1, -1, -1, -1], np.float32)
    for refs, labels in ((np.stack([e1, b]), [0, 1]), (np.stack([b, e1]), [1, 0])):  # e_1 is class 0
        assert evaluate(q, [0], refs, labels, metrics=["precision_at_1"], backend=backend)["precision_at_1"] == 0.0
    # norms 1 and 2 (one and four non-zeros): both normalise exactly, the tie stays, index first
    q4 = np.ones((1, 4), np.float32)
    c = np.array([1, 1, 1, -1], np.float32)
    for refs, labels, want in ((np.stack([e1[:4], c]), [0, 1], 1.0), (np.stack([c, e1[:4]]), [1, 0], 0.0)):
        assert evaluate(q4, [0], refs, labels, metrics=["precision_at_1"], backend=backend)["precision_at_1"] == want


def test_streaming_without_any_positive_matches_evaluate():
    """A one-row shard directory raised 'no row other than the query itself' where the same
    embeddings in an .npz gave NaN (and 1 query without a positive)."""
    from dmlkit.metrics import evaluate_streaming, per_query_streaming

    x = np.ones((1, 3), np.float32)
    want = evaluate(x, [4], metrics=["precision_at_1", "map_at_r"])
    got = evaluate_streaming(x, [4], metrics=["precision_at_1", "map_at_r"])
    assert list(got) == list(want)
    assert math.isnan(got["precision_at_1"]) and math.isnan(got["map_at_r"])
    assert got["num_queries"] == got["num_queries_without_positive"] == 1
    scores, r_q = per_query_streaming(np.eye(3, dtype=np.float32), [0, 1, 2], metrics=["precision_at_1"])
    assert r_q.tolist() == [0, 0, 0] and np.isnan(scores["precision_at_1"]).all()


@pytest.mark.parametrize("bad", [(0.0, math.inf), (-math.inf, 1.0), (-1e308, 1e308), (0.0, 1e-300)])
def test_histogram_range_must_be_finite(bad):
    """range=(0, inf) gave NaN bin edges and pos_neg_js = 0.0 (a RuntimeWarning, no error)."""
    from dmlkit.metrics import pos_neg_histograms

    x, y = _small()
    with pytest.raises(ConfigError, match="range must be finite"):
        pos_neg_histograms(x, y, range=bad)


def test_clustering_runs_dmlkit_kmeans_even_with_faiss_installed(monkeypatch):
    """docs/guide.md said faiss k-means ran when installed; "auto" is dmlkit's own Lloyd k-means."""
    from dmlkit.metrics import cluster_metrics, faiss_available

    if faiss_available():
        import faiss

        def refuse(*args, **kwargs):
            raise AssertionError("faiss k-means used")

        monkeypatch.setattr(faiss, "Kmeans", refuse)
    x, y = _small()
    assert 0.0 <= cluster_metrics(x, y, ["nmi"], restarts=1)["nmi"] <= 1.0


def test_roc_first_threshold_accepts_nothing_in_the_callers_units():
    """RocCurve's docstring said thresholds[0] = +inf; for distances it is -inf (distance <= -inf)."""
    from dmlkit.metrics import roc_curve

    d = np.array([0.1, 0.5, 0.9])
    c = roc_curve(d, [1, 0, 0], higher_is_positive=False)
    assert c.thresholds[0] == -np.inf and not (d <= c.thresholds[0]).any()
    assert c.tp[0] == c.fp[0] == 0 and c.tp[1] == 1 and c.thresholds[1] == 0.1
    assert roc_curve(-d, [1, 0, 0]).thresholds[0] == np.inf


@pytest.mark.parametrize("seed", [-1, 1.5])
def test_negative_kmeans_seed_is_one_config_error(seed):
    """`dmlkit evaluate -m nmi --seed -1` ended in numpy's ValueError traceback (exit 1)."""
    from dmlkit.metrics import cluster_metrics

    x, y = _small()
    with pytest.raises(ConfigError, match="seed must be a non-negative integer"):
        cluster_metrics(x, y, ["nmi"], restarts=1, seed=seed)


def test_cli_negative_seed_exits_2_with_one_line(tmp_path, capsys):
    from dmlkit.cli import main

    x, y = _small()
    np.savez(tmp_path / "e.npz", embeddings=x, labels=y)
    with pytest.raises(SystemExit) as exc:
        main(["evaluate", str(tmp_path / "e.npz"), "-m", "nmi", "--seed", "-1"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2
    assert "\n" not in err and "seed" in err and "Traceback" not in err


def test_streaming_non_finite_error_names_the_row_of_the_whole_set():
    """A NaN in row 37 streamed in blocks of 10 was reported as 'first row 7' of '10' rows."""
    from dmlkit.exceptions import NonFiniteError
    from dmlkit.metrics import evaluate_streaming

    x = np.arange(200, dtype=np.float32).reshape(50, 4) % 7 + 1
    y = np.arange(50) % 5
    x[37, 2] = np.nan
    for call in (lambda: evaluate_streaming(x, y, block_rows=10),
                 lambda: evaluate_streaming(x[:20], y[:20], x, y, block_rows=10)):
        with pytest.raises(NonFiniteError) as exc:
            call()
        assert "first row 37" in str(exc.value) and "rows 30-39" in str(exc.value)
    with pytest.raises(NonFiniteError, match="first row 37"):  # one block: the whole set's own check
        evaluate_streaming(x, y)


def test_kmeans_float32_assignment_is_the_float64_nearest_centroid():
    """docs/metrics.md: each k-means assignment is the exact nearest centroid. The float32 path
    took the float32 argmax: a row whose scores tie in float32 (1 + 0 and 1 + 2^-30) went to the
    lower column, where the bfloat16 path (float64 re-scores) chose the true nearest."""
    clustering = importlib.import_module("dmlkit.metrics.clustering")
    x_aug = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    c_aug = torch.tensor([[1.0, 0.0], [1.0, 2.0**-30]])
    for bf16 in (False, True):
        assert clustering._nearest(x_aug, c_aug, bf16).tolist() == [1, 1]


def test_kmeans_is_the_same_with_and_without_bfloat16_tiles(monkeypatch):
    """Both tile kinds now give the float64 assignment, so k-means runs are identical (they
    differed on float32 near-ties)."""
    from dmlkit.metrics import kmeans_labels

    clustering = importlib.import_module("dmlkit.metrics.clustering")
    tiles = importlib.import_module("dmlkit.metrics._tiles")
    rng = np.random.default_rng(6)
    x = rng.normal(size=(700, 20)).astype(np.float32)
    monkeypatch.setattr(clustering, "_BF16_MIN_PAIRS", 0)
    monkeypatch.setattr(tiles, "_bf16_is_faster", lambda d: True)
    a = kmeans_labels(x, 40, seed=1)
    monkeypatch.setattr(tiles, "_bf16_is_faster", lambda d: False)
    b = kmeans_labels(x, 40, seed=1)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("p", [[1.0, -1.0, 2.0], [1.0, math.nan, 1.0], [1.0, math.inf, 1.0]])
def test_js_divergence_refuses_non_finite_or_negative_counts(p):
    """js_divergence([1, nan, 1], ...) returned 0.0 ("identical") without a word."""
    from dmlkit.exceptions import DataError
    from dmlkit.metrics import js_divergence

    with pytest.raises(DataError, match="finite, non-negative"):
        js_divergence(p, [1.0, 1.0, 1.0])
    with pytest.raises(DataError, match="finite, non-negative"):
        js_divergence([1.0, 1.0, 1.0], p)
    assert js_divergence([1, 0, 0], [0, 0, 3]) == 1.0


def test_observed_range_of_equal_huge_values_is_one_bin():
    """Every pair at 2e20 (raw dot products): the observed range lo + 1 == lo, ZeroDivisionError."""
    from dmlkit.distances import DotProductSimilarity
    from dmlkit.metrics import pos_neg_histograms

    x = np.full((4, 2), 1e10, np.float32)
    h = pos_neg_histograms(x, [0, 0, 1, 1], distance=DotProductSimilarity(normalize_embeddings=False), bins=10)
    assert h.js == 0.0 and h.pos_counts[0] == 2 and h.neg_counts[0] == 4
    assert np.isfinite(h.edges).all() and h.edges[-1] > h.edges[0]


@pytest.mark.parametrize("metric", ["recall_at_k", "precision_at_k"])
def test_an_empty_k_values_is_refused_not_dropped(metric):
    """recall_at_k over k_values=() expanded to no metric: dropped from the defaults without a word."""
    x, y = _small()
    with pytest.raises(ConfigError, match=f"{metric} needs at least one K"):
        evaluate(x, y, metrics=["precision_at_1", metric], k_values=())
