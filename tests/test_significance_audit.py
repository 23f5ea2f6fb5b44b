"""``dmlkit compare``'s "significant" and its "95 % CI", checked against an independent
computation and by simulation (the statistics audit).

Was: a hierarchical percentile bootstrap's interval plus Welch's t-test over the seeds' means.
Welch treats the test set as fixed and the bootstrap resamples 3 seeds as if they were the
population: equal methods were called different 8 % of the time at 5 seeds, the "95 %" interval
covered 80 % at 3 seeds, and Holm's correction, applied to Welch's p-values that are ~0 when the
queries dominate, let 21 % of families of four equal methods hold a "significant" pair. Now one
t statistic over seeds and queries gives the interval, the p-value and (Holm-corrected) the verdict.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

import dmlkit.protocol.compare as compare_module
from _reference import bench_entries
from dmlkit.protocol.compare import compare_results
from dmlkit.protocol.config import bench_config_from_dict
from dmlkit.protocol.results import build_results
from dmlkit.protocol.splits import make_bench_split
from dmlkit.protocol.stats import seed_query_t_test


def test_the_interval_and_p_value_follow_the_formula():
    """se^2 = var(A_s)/S_a + var(B_s)/S_b + var(d_q)/Q, Welch-Satterthwaite df, by hand."""
    rng = np.random.default_rng(3)
    a, b = rng.uniform(size=(3, 40)), rng.uniform(size=(4, 40)) + 0.1
    res = seed_query_t_test(a, b, confidence=0.9)
    parts = [np.var(a.mean(1), ddof=1) / 3, np.var(b.mean(1), ddof=1) / 4,
             np.var(a.mean(0) - b.mean(0), ddof=1) / 40]
    var = sum(parts)
    df = var ** 2 / (parts[0] ** 2 / 2 + parts[1] ** 2 / 3 + parts[2] ** 2 / 39)
    diff, se = a.mean() - b.mean(), math.sqrt(var)
    half = stats.t.ppf(0.95, df) * se
    assert (res.diff, res.se, res.df) == pytest.approx((diff, se, df), rel=1e-12)
    assert (res.low, res.high) == pytest.approx((diff - half, diff + half), rel=1e-12)
    assert res.p == pytest.approx(2 * stats.t.sf(abs(diff) / se, df), rel=1e-12)
    assert res.excludes_zero == (res.p < 0.1) and res.significant == (res.p < 0.1)


def test_without_query_or_seed_variance_it_is_welch_or_the_paired_t_test():
    """The two limits are scipy's own tests: scores constant over the queries leave Welch's
    t-test of the seeds' means; seeds that all score alike leave the paired t-test over queries."""
    rng = np.random.default_rng(4)
    seeds_a, seeds_b = rng.normal(0.5, 0.02, size=4), rng.normal(0.48, 0.03, size=6)
    res = seed_query_t_test(np.repeat(seeds_a[:, None], 30, 1), np.repeat(seeds_b[:, None], 30, 1))
    assert res.p == pytest.approx(stats.ttest_ind(seeds_a, seeds_b, equal_var=False).pvalue, rel=1e-9)
    qa, qb = rng.uniform(size=50), rng.uniform(size=50)
    res = seed_query_t_test(np.tile(qa, (3, 1)), np.tile(qb, (5, 1)))
    paired = stats.ttest_rel(qa, qb)
    assert res.p == pytest.approx(paired.pvalue, rel=1e-9) and res.df == pytest.approx(49)
    low, high = paired.confidence_interval(0.95)
    assert (res.low, res.high) == pytest.approx((low, high), rel=1e-9)


def test_nothing_varies():
    same = seed_query_t_test(np.ones((3, 5)), np.ones((3, 5)))
    assert (same.diff, same.low, same.high, same.p, same.df) == (0.0, 0.0, 0.0, 1.0, None)
    assert same.significant is False
    shifted = seed_query_t_test(np.ones((3, 5)), np.zeros((3, 5)))
    assert shifted.p == 0.0 and shifted.significant is True and shifted.low == shifted.high == 1.0


def _equal_methods(rng, names, seeds, queries, sd_seed, sd_method_query):
    """Per-query scores of methods of equal quality: a seed offset, the shared query difficulty,
    each method's own luck on each query, and noise."""
    shared = rng.normal(0, 0.1, queries)
    return {n: sd_seed * rng.normal(size=(seeds, 1)) + shared + rng.normal(0, sd_method_query, queries)
            + 0.05 * rng.normal(size=(seeds, queries)) for n in names}


@pytest.fixture
def simulated_compare(tmp_path, monkeypatch):
    """``compare_results`` over four methods whose per-query scores the test sets (the
    embeddings' scoring is replaced; everything after it is ``compare``'s own)."""
    names = ["m0", "m1", "m2", "m3"]
    cfg = bench_config_from_dict({"name": "sim", "fixed": {"data": {"dataset": "omniglot"},
                                  "model": {"embedding_size": 8}},
                                  "protocol": {"seeds": [0, 1, 2], "trials": 1},
                                  "methods": [{"name": n, "loss": {"name": "triplet"}} for n in names]})
    labels = np.repeat(np.arange(12), 4)
    results = build_results(cfg, make_bench_split(range(24), "halves", folds=2),
                            bench_entries(tmp_path, cfg, labels, 12, [(n, 1.0) for n in names]),
                            bench_dir=tmp_path)
    current: dict[str, np.ndarray] = {}

    def scores(entry, mode, name="the method"):
        key = name.split("'")[1]
        q = current[key].shape[1]
        items = compare_module._TestItems(Path("sim.npz"), np.zeros(q), np.arange(q), False)
        return {m: current[key] for m in ("precision_at_1", "r_precision", "map_at_r")}, items

    monkeypatch.setattr(compare_module, "_method_scores", scores)

    def run(per_method: dict[str, np.ndarray]) -> list[dict]:
        current.clear()
        current.update(per_method)
        return compare_results([results], methods=list(per_method), metrics=["map_at_r"],
                               modes=["separated"])["comparisons"]

    return run


def test_four_equal_methods_hold_a_significant_pair_at_most_at_the_nominal_rate(simulated_compare):
    """Query-dominated (each method right on other test queries, seeds nearly alike), 5 seeds:
    Welch's p over the seeds' means was ~0, so Holm changed nothing and 21 % of families of six
    equal pairs held a "significant" one (5 % nominal; 36 of these 200)."""
    rng = np.random.default_rng(11)
    families = 200
    flagged = sum(any(c["significant"] for c in simulated_compare(
        _equal_methods(rng, ["m0", "m1", "m2", "m3"], 5, 300, 0.0005, 0.2))) for _ in range(families))
    assert flagged / families <= 0.08


def test_the_interval_covers_equal_methods_at_three_seeds(simulated_compare):
    """Seed-dominated (the docs' benchmarks: seeds vary more than the test queries), 3 seeds:
    the bootstrap's "95 % CI" excluded the true difference 0 in 20 % of comparisons (52 of these 300)."""
    rng = np.random.default_rng(12)
    pairs = 300
    missed = sum(simulated_compare(_equal_methods(rng, ["m0", "m1"], 3, 300, 0.02, 0.035))[0]["excludes_zero"]
                 for _ in range(pairs))
    assert missed / pairs <= 0.10
