"""Statistics of the protocol: confidence intervals over repeats, per-query retrieval scores,
and the paired bootstrap used by ``dmlkit compare``.

* :func:`mean_ci` -- mean and the half-width of the two-sided 95 % Student-t confidence
  interval over independent repeats: ``t_{0.975, n-1} * s / sqrt(n)`` with ``s`` the sample
  standard deviation (``ddof = 1``); undefined (``None``) for a single repeat. This is the
  "+-" of the Reality Check tables (Musgrave et al. 2020).
* :func:`per_query_scores` -- Precision@1, R-Precision and MAP@R of every query (Musgrave et
  al. 2020, section 3.2): with ``R`` the number of references of the query's class (the query
  excluded) and ``c_i`` = 1 when the ``i``-th nearest reference is of that class,
  ``P@1 = c_1``, ``RP = (1/R) sum_{i<=R} c_i``, ``MAP@R = (1/R) sum_{i<=R} c_i P(i)`` with
  ``P(i) = (1/i) sum_{j<=i} c_j``. Queries without a positive are dropped (``valid`` mask).
* :func:`paired_bootstrap` -- percentile bootstrap (Efron & Tibshirani 1993) of the mean
  difference of two methods' per-query scores, resampling the same queries for both methods
  (paired), seeded. It sees the variance of the test queries only.
* :func:`hierarchical_bootstrap` -- the same difference with both sources of variance a
  benchmark has: each method's training seeds are resampled (independently per method: seed
  ``s`` of one method shares nothing with seed ``s`` of another but the data) and, inside, the
  test queries (the same resampled queries for both methods). A two-level bootstrap of
  multi-level data (Davison & Hinkley, *Bootstrap Methods and their Application*, 1997, sec.
  3.8; Saravanan et al., *Application of the hierarchical bootstrap to multi-level data in
  neuroscience*, NBDC 2020). This is what ``dmlkit compare`` reports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dmlkit.exceptions import ConfigError, ShapeError
from dmlkit.limits import MAX_RESAMPLES
from dmlkit.metrics import per_query
from dmlkit.validation import check_integer

__all__ = [
    "PER_QUERY_METRICS",
    "MIN_SEEDS_FOR_SIGNIFICANCE",
    "BootstrapResult",
    "check_confidence",
    "check_resamples",
    "hierarchical_bootstrap",
    "holm_adjusted",
    "mean_ci",
    "paired_bootstrap",
    "per_query_scores",
    "welch_p",
]

#: Metrics :func:`per_query_scores` can compute (the seed's table columns).
PER_QUERY_METRICS: tuple[str, ...] = ("precision_at_1", "r_precision", "map_at_r")

#: Fewer training seeds than this per method and a bootstrap over seeds cannot tell seed noise
#: from a real difference (2 seeds give 3 distinct resamples): never called "significant".
MIN_SEEDS_FOR_SIGNIFICANCE = 3


def check_confidence(confidence: Any) -> float:
    """``confidence`` as a fraction strictly between 0 and 1, else one :class:`ConfigError` line:
    a percentage (95) gave a NaN interval in :func:`mean_ci` and failed inside numpy in the
    bootstraps; 0 made :attr:`BootstrapResult.significant` accept any p-value."""
    if isinstance(confidence, bool) or not isinstance(confidence, int | float | np.floating) \
            or not 0 < confidence < 1:
        raise ConfigError(f"confidence must be a fraction strictly between 0 and 1 (0.95 for a 95 % CI), "
                          f"got {confidence!r}")
    return float(confidence)


def check_resamples(resamples: Any) -> int:
    """``resamples`` as an integer from 1 to :data:`~dmlkit.limits.MAX_RESAMPLES`, else one
    :class:`ConfigError` line (10^10 resamples failed allocating 75 GiB with a traceback)."""
    return check_integer(resamples, "resamples", hint=" (the CLI's default is 1000)", most=MAX_RESAMPLES)


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float | None]:
    """``(mean, half_width)`` of the Student-t confidence interval; ``None`` width when n < 2."""
    from scipy import stats

    confidence = check_confidence(confidence)
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        raise ShapeError("mean_ci needs at least one value")
    mean = float(arr.mean())
    if arr.size < 2:
        return mean, None
    sem = float(arr.std(ddof=1)) / math.sqrt(arr.size)
    t = float(stats.t.ppf(0.5 + confidence / 2.0, df=arr.size - 1))
    return mean, t * sem


def per_query_scores(embeddings: Any, labels: Any) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Per-query P@1, R-Precision and MAP@R with cosine similarity, query excluded from references.

    :func:`dmlkit.metrics.per_query` (exact, ties by the lower reference index, near-ties in
    float64; never an ``N x N`` matrix). Returns ``(scores, valid)``: each score array has one
    value per query with a positive (``valid`` marks them among all rows).
    """
    scores, r_q = per_query(embeddings, labels, metrics=list(PER_QUERY_METRICS), distance="cosine")
    valid = np.asarray(r_q) > 0
    return {m: np.asarray(scores[m], dtype=np.float64)[valid] for m in PER_QUERY_METRICS}, valid


@dataclass(frozen=True)
class BootstrapResult:
    """Mean difference ``a - b`` with its percentile bootstrap CI.

    ``seeds`` is ``(seeds of a, seeds of b)`` for a bootstrap over seeds and queries (``None``
    for queries only). ``significant`` is ``True``/``False`` only when the interval includes
    the seed variance of at least :data:`MIN_SEEDS_FOR_SIGNIFICANCE` seeds per method, and
    ``None`` ("too few seeds to tell") otherwise; ``True`` needs the interval to exclude 0
    *and* Welch's t-test over the seeds' means (``seed_test_p``) to reject equal means at
    ``1 - confidence``. The percentile bootstrap alone resamples 3 seeds as if they were the
    population: with equal methods it called 20 % of differences significant at 3 seeds and
    10 % at 5 (5 % nominal); with the t-test the rate is at most nominal.
    """

    diff: float
    low: float
    high: float
    resamples: int
    confidence: float
    seeds: tuple[int, int] | None = None
    seed_test_p: float | None = None

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    @property
    def resampling(self) -> str:
        return "queries" if self.seeds is None else "seeds and queries"

    @property
    def significant(self) -> bool | None:
        if self.seeds is None or min(self.seeds) < MIN_SEEDS_FOR_SIGNIFICANCE:
            return None
        return self.excludes_zero and self.seed_test_p is not None and self.seed_test_p < 1.0 - self.confidence

    def to_dict(self) -> dict[str, Any]:
        return {
            "diff": self.diff, "ci_low": self.low, "ci_high": self.high,
            "excludes_zero": self.excludes_zero, "significant": self.significant,
            "resampling": self.resampling, "seed_test_p": self.seed_test_p,
            "seeds_a": None if self.seeds is None else self.seeds[0],
            "seeds_b": None if self.seeds is None else self.seeds[1],
            "resamples": self.resamples, "confidence": self.confidence,
        }


def paired_bootstrap(
    a: Any, b: Any, *, resamples: int = 1000, confidence: float = 0.95, seed: int = 0, chunk: int = 100
) -> BootstrapResult:
    """Paired percentile bootstrap of ``mean(a) - mean(b)`` over the same resampled queries."""
    resamples, confidence = check_resamples(resamples), check_confidence(confidence)
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ShapeError(f"paired scores must be two equal-length 1-D arrays, got {a.shape} and {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ShapeError("per-query scores must be finite")
    d = a - b
    rng = np.random.default_rng(seed)
    means = np.empty(resamples, dtype=np.float64)
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        idx = rng.integers(0, d.size, size=(stop - start, d.size))
        means[start:stop] = d[idx].mean(axis=1)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return BootstrapResult(float(d.mean()), float(low), float(high), resamples, confidence)


def hierarchical_bootstrap(
    a: Any, b: Any, *, resamples: int = 1000, confidence: float = 0.95, seed: int = 0
) -> BootstrapResult:
    """Percentile bootstrap of ``mean(a) - mean(b)`` over training seeds *and* test queries.

    ``a`` is ``(S_a, Q)`` and ``b`` is ``(S_b, Q)``: one row of per-query scores per training
    seed, the same ``Q`` queries in the same order. Each resample draws ``Q`` queries with
    replacement (the same for both methods: the pairing of the test set), ``S_a`` of a's seeds
    and ``S_b`` of b's seeds with replacement (independently), and takes
    ``mean_{s in seeds_a} mean_{q} a[s, q] - mean_{s in seeds_b} mean_{q} b[s, q]``.
    The point estimate is the difference of the grand means.
    """
    resamples, confidence = check_resamples(resamples), check_confidence(confidence)
    a = np.atleast_2d(np.asarray(a, dtype=np.float64))
    b = np.atleast_2d(np.asarray(b, dtype=np.float64))
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1] or a.size == 0 or b.size == 0:
        raise ShapeError(f"need (seeds, queries) score arrays over the same queries, got {a.shape} and {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ShapeError("per-query scores must be finite")
    rng = np.random.default_rng(seed)
    n_queries = a.shape[1]
    chunk = max(1, min(100, 4_000_000 // (max(a.shape[0], b.shape[0]) * n_queries)))  # ~32 MB
    means = np.empty(resamples, dtype=np.float64)
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        c = stop - start
        q = rng.integers(0, n_queries, size=(c, n_queries))
        # per resample and seed: the mean over the resampled queries -> (c, S)
        a_q = a[:, q].mean(axis=2).T
        b_q = b[:, q].mean(axis=2).T
        wa = _seed_weights(rng, c, a.shape[0])
        wb = _seed_weights(rng, c, b.shape[0])
        means[start:stop] = (wa * a_q).sum(axis=1) - (wb * b_q).sum(axis=1)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return BootstrapResult(float(a.mean() - b.mean()), float(low), float(high), resamples, confidence,
                           seeds=(a.shape[0], b.shape[0]), seed_test_p=welch_p(a.mean(axis=1), b.mean(axis=1)))


def welch_p(a: Any, b: Any) -> float | None:
    """Two-sided p-value of Welch's t-test of equal means (``scipy.stats.ttest_ind`` with
    ``equal_var=False``; Welch, Biometrika 1947) of two samples, e.g. per-seed scores; ``None``
    with fewer than 2 values on a side. Two samples without spread: 0 if their values differ,
    else 1 (the t statistic is then infinite or undefined)."""
    from scipy.stats import ttest_ind

    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.size < 2 or b.size < 2:
        return None
    if a.var() == 0 and b.var() == 0:
        return 0.0 if a[0] != b[0] else 1.0
    return float(ttest_ind(a, b, equal_var=False).pvalue)


def _seed_weights(rng: np.random.Generator, resamples: int, n_seeds: int) -> np.ndarray:
    """``(resamples, n_seeds)`` weights of seeds drawn with replacement (counts / n_seeds)."""
    draws = rng.integers(0, n_seeds, size=(resamples, n_seeds))
    counts = np.zeros((resamples, n_seeds), dtype=np.float64)
    np.add.at(counts, (np.arange(resamples)[:, None], draws), 1.0)
    return counts / n_seeds


def holm_adjusted(p_values: Any) -> np.ndarray:
    """Holm's step-down adjusted p-values of a family of tests (Holm, *A simple sequentially
    rejective multiple test procedure*, Scand. J. Statist. 1979): with the ``m`` p-values sorted
    ascending, ``p~_(i) = max_{j <= i} min(1, (m - j + 1) p_(j))``. Rejecting where ``p~ <
    alpha`` keeps the chance of any false "significant" in the family at most ``alpha``, under
    any dependence between the tests; with one test it is the p-value itself."""
    p = np.asarray(p_values, dtype=np.float64).reshape(-1)
    order = np.argsort(p, kind="stable")
    m = p.size
    stepped = np.minimum(1.0, (m - np.arange(m)) * p[order])
    out = np.empty(m)
    out[order] = np.maximum.accumulate(stepped) if m else stepped
    return out
