"""Exact ROC analysis of pair scores: the ROC curve, ROC AUC and FPR at a given TPR (FPR95).

A pair scorer returns one score per pair; higher means "more likely a match" (pass
``higher_is_positive=False`` for distances). A threshold ``t`` predicts a match for every
pair with ``score >= t``, so all pairs that share a score are accepted or rejected together:
every operating point below is one that a real threshold achieves (ties are never split).

FPR95 is the standard figure of merit of patch matching (Brown, Hua, Winder, "Discriminative
learning of local image descriptors", TPAMI 2011; Zagoruyko & Komodakis, CVPR 2015; Mishchuk
et al., HardNet, NeurIPS 2017): the false-positive rate at the largest threshold whose
true-positive rate (recall) is at least 95 %.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from dmlkit.exceptions import ConfigError, DataError, NonFiniteError, ShapeError

__all__ = ["RocCurve", "fpr95", "fpr_at_tpr", "roc_auc", "roc_curve"]


def _as_scores_and_labels(scores: Any, labels: Any, higher_is_positive: bool) -> tuple[np.ndarray, np.ndarray]:
    """Validated float64 scores (higher = positive) and boolean labels, both ``(N,)``."""
    if hasattr(scores, "detach"):
        scores = scores.detach().cpu().numpy()
    if hasattr(labels, "detach"):
        labels = labels.detach().cpu().numpy()
    s = np.asarray(scores)
    y = np.asarray(labels)
    if s.ndim != 1:
        raise ShapeError(f"scores must be 1-D (one score per pair), got shape {s.shape}")
    if y.shape != s.shape:
        raise ShapeError(f"labels must have the shape of the scores {s.shape}, got {y.shape}")
    if s.dtype.kind not in "fiub":
        raise ShapeError(f"scores must be numbers, got dtype {s.dtype}")
    if s.dtype.kind in "iu" and s.size and max(abs(int(s.min())), abs(int(s.max()))) > 2**53:
        # float64 holds every integer up to 2^53 only: 2^53 + 1 and 2^53 became a tie (AUC 0.5)
        raise DataError("integer scores beyond 2**53 are not all distinct in float64, where the ROC "
                        "is computed: subtract their minimum, or pass them as floats")
    s = s.astype(np.float64)
    if not np.all(np.isfinite(s)):
        raise NonFiniteError(
            f"{int((~np.isfinite(s)).sum())} score(s) are NaN or infinite: fix the scorer "
            "(e.g. a diverged model) before computing the ROC"
        )
    if y.dtype.kind == "b":
        yb = y
    else:
        values = np.unique(y)
        if not (np.all(np.isin(values, [0, 1])) or np.all(np.isin(values, [-1, 1]))):
            raise DataError(
                f"labels must be binary (1 = match; 0 or -1 = non-match), got values {values[:5].tolist()}"
            )
        yb = y == 1
    n_pos = int(yb.sum())
    if n_pos == 0 or n_pos == len(yb):
        raise DataError(
            f"the ROC needs both positive and negative pairs, got {n_pos} positive of {len(yb)}"
        )
    return (s if higher_is_positive else -s), yb.astype(bool)


@dataclass(frozen=True)
class RocCurve:
    """The exact ROC: one point per distinct score, plus the origin.

    ``thresholds[k]`` accepts the pairs with ``score >= thresholds[k]``; ``tpr[k]`` and
    ``fpr[k]`` are measured at it. ``thresholds[0]`` accepts nothing (``+inf``; ``-inf`` for
    distances). Thresholds are in the caller's units (distances when ``higher_is_positive=False``, where a pair is
    accepted when ``distance <= threshold``).
    """

    fpr: np.ndarray
    tpr: np.ndarray
    thresholds: np.ndarray
    tp: np.ndarray
    fp: np.ndarray
    num_positive: int
    num_negative: int


def roc_curve(scores: Any, labels: Any, *, higher_is_positive: bool = True) -> RocCurve:
    """The exact ROC curve of pair ``scores`` against binary ``labels`` (1 = match).

    ``TPR(t) = TP(t) / P`` and ``FPR(t) = FP(t) / N`` where ``TP(t)`` (``FP(t)``) counts the
    positive (negative) pairs with ``score >= t``; ``t`` runs over the distinct scores from
    the highest down, so tied pairs move together. ``O(N log N)`` (one stable sort).
    """
    s, y = _as_scores_and_labels(scores, labels, higher_is_positive)
    order = np.argsort(-s, kind="stable")
    s_sorted = s[order]
    y_sorted = y[order]
    # the last index of each run of equal scores
    last = np.flatnonzero(np.r_[s_sorted[1:] != s_sorted[:-1], True])
    tp = np.cumsum(y_sorted)[last]
    fp = (last + 1) - tp
    p, n = int(y.sum()), int((~y).sum())
    tp = np.r_[0, tp].astype(np.int64)
    fp = np.r_[0, fp].astype(np.int64)
    thr = np.r_[np.inf, s_sorted[last]]
    if not higher_is_positive:
        thr = -thr
    return RocCurve(fpr=fp / n, tpr=tp / p, thresholds=thr, tp=tp, fp=fp, num_positive=p, num_negative=n)


def roc_auc(scores: Any, labels: Any, *, higher_is_positive: bool = True) -> float:
    """Area under the exact ROC curve, ties counted one half.

    ``AUC = P(s+ > s-) + 0.5 P(s+ = s-)`` over independent positive/negative pairs, i.e. the
    Mann-Whitney U statistic divided by ``P N`` (Hanley & McNeil, Radiology 1982); equal to
    the trapezoidal area under :func:`roc_curve` and to ``sklearn.metrics.roc_auc_score``.
    """
    from scipy.stats import rankdata

    s, y = _as_scores_and_labels(scores, labels, higher_is_positive)
    ranks = rankdata(s, method="average")
    p, n = int(y.sum()), int((~y).sum())
    u = float(ranks[y].sum()) - p * (p + 1) / 2.0
    return u / (p * n)


def fpr_at_tpr(scores: Any, labels: Any, tpr: float = 0.95, *, higher_is_positive: bool = True) -> float:
    """False-positive rate at the first threshold (from the strictest) whose TPR reaches ``tpr``.

    ``FPR = FP / (FP + TN)`` (the fraction of non-matching pairs accepted) at the largest
    threshold ``t`` with ``TP(t) / (TP(t) + FN(t)) >= tpr``. Pairs tied at ``t`` are all
    accepted, so the value is the one a real threshold achieves, never an interpolation.
    The TPR comparison is done in integers (``TP >= ceil(tpr * P)``, with ``tpr`` the decimal it
    is written as: ``0.95 = 19/20``), so 95 % of 20 positives is exactly 19 and 99.9 % of
    1,000,999 is 999,999, free of float rounding.

    Note: seed 003 writes the denominator as ``TN + FN``; this is the standard definition
    ``FP + TN`` (number of negatives), as used by Brown et al. and Zagoruyko & Komodakis.

    With fewer than ``1 / (1 - tpr)`` positives (20 for FPR95) no positive may be rejected at
    the target, so the value is the FPR at TPR 100 %, set by the lowest-scoring positive alone:
    a warning says so.
    """
    if not 0.0 < float(tpr) <= 1.0:
        raise ConfigError(f"tpr must be in (0, 1], got {tpr}")
    curve = roc_curve(scores, labels, higher_is_positive=higher_is_positive)
    p = curve.num_positive
    # the rate as the decimal it was written as (0.95 is 19/20, not the binary float just below
    # it), so ceil(rate * P) is exact for any P: a float slack of 1e-9 P absorbed the rounding
    # but took one positive too few from about a million positives; at least one positive (a
    # tiny rate must not read the origin, FPR 0, where no pair is accepted)
    rate = Fraction(repr(float(tpr)))
    need = max(1, math.ceil(rate * p))
    if need >= p and rate < 1:
        warnings.warn(f"FPR at TPR {100 * float(tpr):g} %: {p} matching pairs resolve true positive "
                      f"rates in steps of {100 / p:.2g} %, so it is the FPR with every matching pair "
                      "accepted (TPR 100 %), set by the lowest-scoring one; score at least "
                      f"{math.ceil(1 / (1 - rate))} matching pairs", stacklevel=2)
    k = int(np.searchsorted(curve.tp, need, side="left"))
    return float(curve.fp[k] / curve.num_negative)


def fpr95(scores: Any, labels: Any, *, higher_is_positive: bool = True) -> float:
    """FPR at 95 % recall: :func:`fpr_at_tpr` with ``tpr = 0.95`` (Brown et al., TPAMI 2011)."""
    return fpr_at_tpr(scores, labels, 0.95, higher_is_positive=higher_is_positive)
