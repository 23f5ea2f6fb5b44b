"""Confidence intervals, per-query retrieval scores and the paired bootstrap."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from dmlkit.exceptions import ShapeError
from dmlkit.protocol.stats import (
    MIN_SEEDS_FOR_SIGNIFICANCE,
    mean_ci,
    paired_bootstrap,
    per_query_scores,
    seed_query_t_test,
)


def test_mean_ci_matches_scipy_t_interval():
    values = [0.2653, 0.2621, 0.2690, 0.2644, 0.2601]
    mean, half = mean_ci(values)
    lo, hi = stats.t.interval(0.95, df=4, loc=np.mean(values), scale=stats.sem(values))
    assert mean == pytest.approx(np.mean(values))
    assert half == pytest.approx((hi - lo) / 2)
    # by hand: t_{0.975, 4} = 2.7764
    assert half == pytest.approx(2.776445 * np.std(values, ddof=1) / math.sqrt(5), rel=1e-5)


def test_mean_ci_single_repeat_is_not_available():
    assert mean_ci([0.5]) == (0.5, None)
    mean, half = mean_ci([0.5, 0.5])
    assert mean == 0.5 and half == 0.0
    with pytest.raises(ShapeError):
        mean_ci([])


def _brute(emb, labels):
    emb = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    sims = emb @ emb.T
    out = {"precision_at_1": [], "r_precision": [], "map_at_r": []}
    for q in range(len(labels)):
        order = [i for i in np.lexsort((np.arange(len(labels)), -sims[q])) if i != q]
        r = int((labels == labels[q]).sum() - 1)
        if r == 0:
            continue
        c = (labels[order[:r]] == labels[q]).astype(float)
        out["precision_at_1"].append(float(labels[order[0]] == labels[q]))
        out["r_precision"].append(c.sum() / r)
        out["map_at_r"].append(sum(c[i] * c[: i + 1].sum() / (i + 1) for i in range(r)) / r)
    return {k: np.array(v) for k, v in out.items()}


def test_per_query_scores_match_brute_force():
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(7), [5, 3, 4, 6, 2, 1, 5])  # class 5 has no positive
    emb = rng.normal(size=(labels.size, 6)).astype(np.float32) + labels[:, None] * 0.3
    scores, valid = per_query_scores(emb, labels)
    ref = _brute(emb.astype(np.float64), labels)
    assert valid.sum() == labels.size - 1
    for key in ref:
        np.testing.assert_allclose(scores[key], ref[key], atol=1e-6)


def test_per_query_scores_worked_example_of_the_seed():
    # one query with R = 10 positives; 10 results of which the 1st and 10th are correct ->
    # P@1 = 100, R-Precision = 20, MAP@R = (1 + 2/10) / 10 = 12 (seed 000's table)
    angles = np.concatenate([[0.0], 0.01 * np.arange(1, 30)])
    emb = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    labels = np.full(30, 1)
    labels[0] = 0  # the query
    labels[1] = 0  # 1st result correct
    labels[10] = 0  # 10th result correct
    labels[20:28] = 0  # the other 8 positives far away (ranks 20-27)
    scores, _ = per_query_scores(emb, labels)
    q0 = {k: v[0] for k, v in scores.items()}
    assert q0["precision_at_1"] == 1.0
    assert q0["r_precision"] == pytest.approx(0.2)
    assert q0["map_at_r"] == pytest.approx(0.12)


def test_per_query_scores_agree_with_dmlkit_metrics():
    metrics = pytest.importorskip("dmlkit.metrics")
    if not hasattr(metrics, "evaluate"):
        pytest.skip("dmlkit.metrics.evaluate not available")
    rng = np.random.default_rng(1)
    labels = np.repeat(np.arange(20), 6)
    emb = rng.normal(size=(labels.size, 8)).astype(np.float32) + 0.5 * rng.normal(size=(20, 8))[labels]
    scores, _ = per_query_scores(emb, labels)
    ref = metrics.evaluate(emb, labels, metrics=["precision_at_1", "r_precision", "map_at_r"])
    for key in scores:
        assert scores[key].mean() == pytest.approx(ref[key], abs=1e-6)


def test_paired_bootstrap():
    rng = np.random.default_rng(0)
    a = rng.uniform(size=500)
    same = paired_bootstrap(a, a, seed=1)
    assert same.diff == 0.0 and same.low == 0.0 and same.high == 0.0 and not same.excludes_zero
    b = np.clip(a - 0.05 + rng.normal(0, 0.01, size=500), 0, 1)
    res = paired_bootstrap(a, b, resamples=1000, seed=3)
    assert res.excludes_zero and res.low > 0 and res.low < res.diff < res.high
    # reference implementation with the same generator
    d = a - b
    idx = np.random.default_rng(3).integers(0, 500, size=(1000, 500))
    lo, hi = np.quantile(d[idx].mean(axis=1), [0.025, 0.975])
    assert (res.low, res.high) == pytest.approx((lo, hi))
    assert paired_bootstrap(a, b, seed=3) == res  # seeded: reproducible
    noise = paired_bootstrap(a, rng.permutation(a), seed=0)
    assert noise.low < 0 < noise.high  # a reshuffle of the same scores: no real difference
    with pytest.raises(ShapeError):
        paired_bootstrap(a, a[:-1])


def test_the_seed_query_t_test_includes_the_seed_variance():
    rng = np.random.default_rng(0)
    base = rng.uniform(0.2, 0.8, size=500)  # per-query difficulty, shared by both methods
    # the methods differ only by which training seeds got lucky: per-seed offsets of +-0.3
    a = base + np.array([0.3, -0.2, 0.25, -0.1, 0.05])[:, None]
    b = base + np.array([0.0, 0.1, -0.15, 0.2, -0.05])[:, None]
    # a bootstrap over queries of the seed-averaged scores sees a constant +0.04: never "significant"
    queries_only = paired_bootstrap(a.mean(0), b.mean(0), seed=0)
    assert queries_only.excludes_zero and queries_only.significant is None
    res = seed_query_t_test(a, b)
    assert res.diff == pytest.approx(a.mean() - b.mean())
    assert res.low < 0 < res.high and res.significant is False and res.p > 0.5
    assert res.to_dict()["variance"] == "seeds and queries" and res.seeds == (5, 5)


def test_the_seed_query_t_test_finds_a_real_difference_and_refuses_two_seeds():
    rng = np.random.default_rng(1)
    base = rng.uniform(0.2, 0.8, size=400)
    a = base + 0.10 + rng.normal(0, 0.01, size=(5, 1)) + rng.normal(0, 0.05, size=(5, 400))
    b = base + rng.normal(0, 0.01, size=(6, 1)) + rng.normal(0, 0.05, size=(6, 400))
    res = seed_query_t_test(a, b)
    assert res.significant is True and 0.05 < res.low < res.diff < res.high < 0.15 and res.p < 1e-4
    # two seeds: the interval is reported, "significant" is never claimed
    two = seed_query_t_test(a[:2], b[:2])
    assert MIN_SEEDS_FOR_SIGNIFICANCE == 3 and two.excludes_zero and two.significant is None
    with pytest.raises(ShapeError):
        seed_query_t_test(a, b[:, :-1])
