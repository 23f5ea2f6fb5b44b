"""Statistics of the protocol: confidence intervals over repeats, per-query retrieval scores,
and the test behind ``dmlkit compare``.

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
  (paired), seeded. It sees the variance of the test queries only: never "significant".
* :func:`seed_query_t_test` -- the difference of two methods with both sources of variance a
  benchmark has, training seeds and test queries: a t-test over seeds and queries whose
  standard error adds each method's seed-to-seed variance and the variance of the two
  methods' per-query difference, with Welch-Satterthwaite degrees of freedom (Welch,
  Biometrika 1947; Satterthwaite, Biometrics Bulletin 1946). One statistic gives the
  interval and the p-value. This is what ``dmlkit compare`` reports.
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
from dmlkit.metrics._validation import check_budget
from dmlkit.validation import check_integer

__all__ = [
    "BOOTSTRAP_MEMORY_BUDGET",
    "PER_QUERY_METRICS",
    "MIN_SEEDS_FOR_SIGNIFICANCE",
    "BootstrapResult",
    "DifferenceTest",
    "check_confidence",
    "check_resamples",
    "holm_adjusted",
    "mean_ci",
    "paired_bootstrap",
    "per_query_scores",
    "seed_query_t_test",
]

#: Metrics :func:`per_query_scores` can compute (the seed's table columns).
PER_QUERY_METRICS: tuple[str, ...] = ("precision_at_1", "r_precision", "map_at_r")

#: Fewer training seeds than this per method and the seed-to-seed variance rests on one
#: difference (its t quantile is 12.7 at 95 %, and one lucky pair of runs still fools it): never
#: called "significant".
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
    return check_integer(resamples, "resamples", hint=" (1000 is usual)", most=MAX_RESAMPLES)


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
class _Difference:
    """A mean difference ``a - b`` and its interval ``[low, high]``."""

    diff: float
    low: float
    high: float

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


@dataclass(frozen=True)
class BootstrapResult(_Difference):
    """Mean difference ``a - b`` of paired per-query scores with its percentile bootstrap CI
    (:func:`paired_bootstrap`). It resamples the test queries only: how much a method moves
    between training runs is not in it, so it never says "significant" (``None``)."""

    resamples: int
    confidence: float

    @property
    def significant(self) -> None:
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"diff": self.diff, "ci_low": self.low, "ci_high": self.high,
                "excludes_zero": self.excludes_zero, "significant": None, "variance": "queries",
                "resamples": self.resamples, "confidence": self.confidence}


#: Working memory of :func:`paired_bootstrap`'s resampling (bytes): a resampled query costs
#: 16 (its int64 index and its float64 difference).
BOOTSTRAP_MEMORY_BUDGET = 64 * 2**20


def paired_bootstrap(
    a: Any, b: Any, *, resamples: int = 1000, confidence: float = 0.95, seed: int = 0,
    memory_budget: int = BOOTSTRAP_MEMORY_BUDGET,
) -> BootstrapResult:
    """Paired percentile bootstrap of ``mean(a) - mean(b)`` over the same resampled queries.

    With ``d = a - b`` over ``N`` queries, resample ``r`` draws ``N`` indices uniformly with
    replacement (one seeded stream, ``rng.integers(0, N)``) and takes the mean of ``d`` over
    them; the interval is the ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` quantiles
    of the ``resamples`` means (percentile bootstrap, Efron & Tibshirani 1993, ch. 13).

    The draws come in slabs of at most ``memory_budget / 16`` indices (``memory_budget`` bytes,
    at least 1 MiB; an index and its gathered difference take 16): whole resamples while one
    fits (``N`` up to 4M queries at the default 64 MiB), giving the means of drawing them all
    at once, else each resample in pieces of the one stream, summed piece by piece. Peak memory
    is the budget whatever ``N`` (a fixed 100 resamples at once took 1.6 kB a query: 15 GiB for
    10M queries).
    """
    resamples, confidence = check_resamples(resamples), check_confidence(confidence)
    slab = check_budget(memory_budget) // 16
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ShapeError(f"paired scores must be two equal-length 1-D arrays, got {a.shape} and {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ShapeError("per-query scores must be finite")
    d = a - b
    n = d.size
    rng = np.random.default_rng(seed)
    means = np.empty(resamples, dtype=np.float64)
    if n <= slab:  # whole resamples: the draws of one (resamples, N) matrix, in row blocks
        rows = slab // n
        for start in range(0, resamples, rows):
            stop = min(resamples, start + rows)
            means[start:stop] = d[rng.integers(0, n, size=(stop - start, n))].mean(axis=1)
    else:  # one resample in pieces: the same draws, summed piece by piece
        for r in range(resamples):
            total = 0.0
            for start in range(0, n, slab):
                total += float(d[rng.integers(0, n, size=min(slab, n - start))].sum())
            means[r] = total / n
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return BootstrapResult(float(d.mean()), float(low), float(high), resamples, confidence)


@dataclass(frozen=True)
class DifferenceTest(_Difference):
    """Mean difference ``a - b`` of two methods over training seeds and test queries, with the
    interval and the p-value of one t statistic (:func:`seed_query_t_test`).

    ``low``/``high`` is the ``confidence`` interval ``diff -+ t_{df} * se``; ``p`` the two-sided
    p-value of ``diff / se`` on ``df`` degrees of freedom (when nothing varies, ``se = 0`` and
    ``df`` is ``None``: ``p`` is 0 for a nonzero difference, 1 for none). ``significant`` is
    ``p < 1 - confidence`` (the same as the interval excluding 0) when each method has at
    least :data:`MIN_SEEDS_FOR_SIGNIFICANCE` seeds, and ``None`` ("too few seeds to tell")
    otherwise. ``variance`` names what the interval holds."""

    p: float
    se: float
    df: float | None
    confidence: float
    seeds: tuple[int, int]
    queries: int

    @property
    def variance(self) -> str:
        if min(self.seeds) > 1:
            return "seeds and queries"
        if max(self.seeds) > 1:
            return "seeds and queries, less the seed variance of the one-seed method (unknown)"
        return "queries only (one seed each: the seed variance is unknown)"

    @property
    def significant(self) -> bool | None:
        if min(self.seeds) < MIN_SEEDS_FOR_SIGNIFICANCE:
            return None
        return self.p < 1.0 - self.confidence

    def to_dict(self) -> dict[str, Any]:
        return {
            "diff": self.diff, "ci_low": self.low, "ci_high": self.high,
            "excludes_zero": self.excludes_zero, "significant": self.significant,
            "p": self.p, "se": self.se, "df": self.df, "variance": self.variance,
            "seeds_a": self.seeds[0], "seeds_b": self.seeds[1], "queries": self.queries,
            "confidence": self.confidence,
        }


def seed_query_t_test(a: Any, b: Any, *, confidence: float = 0.95) -> DifferenceTest:
    """t-test and t interval of ``mean(a) - mean(b)`` over training seeds *and* test queries.

    ``a`` is ``(S_a, Q)`` and ``b`` is ``(S_b, Q)``: one row of per-query scores per training
    seed, the same ``Q`` queries in the same order (a method's seeds share nothing with the
    other's but the test set). With ``A_s`` / ``B_s`` the seeds' mean scores and ``d_q`` each
    query's difference of the two methods' seed-mean scores::

        D  = mean(a) - mean(b)
        se = sqrt(var(A_s) / S_a + var(B_s) / S_b + var(d_q) / Q)      (ddof = 1 each)
        df = se^4 / sum_i(v_i^2 / df_i),  df_i = S_a - 1, S_b - 1, Q - 1 (Welch-Satterthwaite)
        interval D -+ t_{(1+confidence)/2, df} * se,  p = 2 P(T_df > |D| / se)

    The first two parts are how much each method moves between training runs on this test
    set (Welch's two-sample t-test, Biometrika 1947, with the seed means as the samples); the
    third how much the difference moves with the test queries drawn (the paired t-test's
    standard error); the degrees of freedom of the sum are Satterthwaite's (Biometrics
    Bulletin 1946). So the interval is about methods trained again and tested on new queries
    of the same classes of data. The seed-by-query noise enters both the seed and the query
    parts: slightly conservative. The rule this replaces (a hierarchical percentile bootstrap's
    interval and Welch's test over the seed means, which treats the test set as fixed) called
    8 % of equal methods different at 5 seeds (5 % nominal), and its "95 %" interval covered
    80 % at 3 seeds (docs/guide.md, "Comparing methods honestly", has the figures). A part with 0 degrees of freedom (one seed, one
    query) cannot be estimated and is left out (``variance`` then says so).
    """
    from scipy import stats

    confidence = check_confidence(confidence)
    a, b = _seed_query_scores(a, b)
    parts = np.array([a.mean(axis=1).var(ddof=1) if len(a) > 1 else 0.0,
                      b.mean(axis=1).var(ddof=1) if len(b) > 1 else 0.0,
                      (a.mean(axis=0) - b.mean(axis=0)).var(ddof=1) if a.shape[1] > 1 else 0.0])
    parts /= np.array([len(a), len(b), a.shape[1]], dtype=np.float64)
    dfs = np.array([len(a) - 1, len(b) - 1, a.shape[1] - 1], dtype=np.float64)
    diff, var = float(a.mean() - b.mean()), float(parts.sum())
    seeds, queries = (len(a), len(b)), a.shape[1]
    if var == 0.0:  # nothing varies: the difference is exact
        return DifferenceTest(diff, diff, diff, 0.0 if diff else 1.0, 0.0, None, confidence, seeds, queries)
    used = dfs > 0
    df = var ** 2 / float((parts[used] ** 2 / dfs[used]).sum())
    se = math.sqrt(var)
    half = float(stats.t.ppf(0.5 + confidence / 2.0, df)) * se
    p = float(2.0 * stats.t.sf(abs(diff) / se, df))
    return DifferenceTest(diff, diff - half, diff + half, p, se, df, confidence, seeds, queries)


def _seed_query_scores(a: Any, b: Any) -> tuple[np.ndarray, np.ndarray]:
    """``a``, ``b`` as finite float64 ``(seeds, queries)`` arrays over the same queries, else
    one :class:`ShapeError` line."""
    a = np.atleast_2d(np.asarray(a, dtype=np.float64))
    b = np.atleast_2d(np.asarray(b, dtype=np.float64))
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1] or a.size == 0 or b.size == 0:
        raise ShapeError(f"need (seeds, queries) score arrays over the same queries, got {a.shape} and {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ShapeError("per-query scores must be finite")
    return a, b


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
