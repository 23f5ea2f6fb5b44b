"""FPR95 and ROC AUC against brute-force references (every threshold, every pair)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from dmlkit.exceptions import ConfigError, DataError, NonFiniteError, ShapeError
from dmlkit.metrics import fpr95, fpr_at_tpr, roc_auc, roc_curve


def brute_fpr_at_tpr(scores: np.ndarray, labels: np.ndarray, target: float) -> float:
    """Try every distinct score as a threshold, strictest first."""
    pos, neg = labels == 1, labels != 1
    for t in sorted(set(scores.tolist()), reverse=True):
        accept = scores >= t
        tp, fp = (accept & pos).sum(), (accept & neg).sum()
        if tp >= target * pos.sum() - 1e-9:
            return fp / neg.sum()
    raise AssertionError("unreachable")


def brute_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    sp, sn = scores[labels == 1], scores[labels != 1]
    diff = sp[:, None] - sn[None, :]
    return float(((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size)


@pytest.mark.parametrize("seed", range(6))
def test_matches_brute_force_with_heavy_ties(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(20, 300))
    labels = rng.integers(0, 2, n)
    labels[:2] = [0, 1]
    # few distinct values: many ties, including ties across classes
    scores = rng.integers(0, 7, n).astype(np.float64) + 0.8 * labels
    scores = np.round(scores)
    for target in (0.5, 0.8, 0.95, 1.0):
        assert fpr_at_tpr(scores, labels, target) == pytest.approx(brute_fpr_at_tpr(scores, labels, target), abs=0)
    assert roc_auc(scores, labels) == pytest.approx(brute_auc(scores, labels), abs=1e-12)


def test_auc_equals_trapezoid_of_curve_and_sklearn() -> None:
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(1)
    labels = rng.integers(0, 2, 500)
    scores = np.round(rng.normal(size=500) + labels, 1)
    c = roc_curve(scores, labels)
    assert np.trapezoid(c.tpr, c.fpr) == pytest.approx(roc_auc(scores, labels), abs=1e-12)
    assert roc_auc(scores, labels) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    assert c.tpr[0] == 0 and c.fpr[0] == 0 and c.tpr[-1] == 1 and c.fpr[-1] == 1
    assert np.all(np.diff(c.tpr) >= 0) and np.all(np.diff(c.fpr) >= 0)


def test_known_values_and_exact_95_percent() -> None:
    # 20 positives: 95 % is exactly 19 positives, not 20 (float 0.95 * 20 = 19.000000000000004)
    pos = np.arange(20, dtype=float) + 10.0  # 10..29
    neg = np.array([9.5, 10.5, 0.0, 1.0])  # 10.5 sits above one positive (10.0), 9.5 below all
    scores = np.r_[pos, neg]
    labels = np.r_[np.ones(20), np.zeros(4)].astype(int)
    # threshold 11 accepts 19 positives and no negative; threshold 10 would accept 10.5 and 9.5 no
    assert fpr95(scores, labels) == 0.0
    assert fpr_at_tpr(scores, labels, 1.0) == 0.25  # threshold 10.0 accepts the negative 10.5
    # a tie between the 19th positive and a negative: both are accepted together
    scores2 = np.r_[pos, [11.0, 0.0, 1.0, 2.0]]
    assert fpr95(scores2, labels) == 0.25
    assert roc_auc(scores2, labels) == pytest.approx(1 - 0.5 * (1 / 80) - 1 / 80)


def test_distances_and_label_conventions() -> None:
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 2, 200)
    d = rng.random(200) + 0.3 * (1 - labels)
    a = fpr95(d, labels, higher_is_positive=False)
    assert a == fpr95(-d, labels)
    assert fpr95(-d, 2 * labels - 1) == a  # +-1 labels
    assert fpr95(torch.from_numpy(-d), torch.from_numpy(labels.astype(bool))) == a
    c = roc_curve(d, labels, higher_is_positive=False)
    # thresholds are distances, increasing: accepting d <= t
    assert np.all(np.diff(c.thresholds[1:]) > 0)
    k = 5
    assert c.tp[k] == int(((d <= c.thresholds[k]) & (labels == 1)).sum())


def test_perfect_and_inverted() -> None:
    labels = np.r_[np.ones(10), np.zeros(10)]
    good = np.r_[np.ones(10), np.zeros(10)] + np.arange(20) * 1e-3
    assert fpr95(good, labels) == 0.0 and roc_auc(good, labels) == 1.0
    assert fpr95(-good, labels) == 1.0 and roc_auc(-good, labels) == 0.0
    assert roc_auc(np.zeros(20), labels) == 0.5


def test_bad_input() -> None:
    with pytest.raises(DataError, match="both positive and negative"):
        fpr95(np.arange(5.0), np.ones(5))
    with pytest.raises(DataError, match="binary"):
        fpr95(np.arange(5.0), np.array([0, 1, 2, 1, 0]))
    with pytest.raises(NonFiniteError):
        roc_auc(np.array([0.0, np.nan]), np.array([0, 1]))
    with pytest.raises(ShapeError):
        roc_auc(np.zeros((2, 2)), np.array([0, 1]))
    with pytest.raises(ShapeError):
        roc_auc(np.zeros(3), np.array([0, 1]))
    with pytest.raises(ConfigError):
        fpr_at_tpr(np.arange(2.0), np.array([0, 1]), 0.0)


@pytest.mark.parametrize(("positives", "warned"), [(5, True), (19, True), (20, False), (200, False)])
def test_fpr95_says_when_too_few_positives_make_it_the_fpr_at_full_recall(positives, warned):
    """Below 20 matching pairs, 95 % of them is all of them (ceil(0.95 p) = p): the value is the
    FPR at TPR 100 %, set by the weakest match alone. It is still returned (the definition
    holds), with one warning that names the resolution and the count that resolves it."""
    rng = np.random.default_rng(positives)
    y = np.r_[np.ones(positives, bool), np.zeros(300, bool)]
    s = rng.standard_normal(y.size) + 2.0 * y
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        value = fpr95(s, y)
        at_full_recall = fpr_at_tpr(s, y, 1.0)
    messages = [str(w.message) for w in record]
    if warned:
        assert len(messages) == 1 and "TPR 100 %" in messages[0] and "at least 20 matching" in messages[0]
        assert value == at_full_recall
    else:
        assert messages == [] and value <= at_full_recall


@pytest.mark.parametrize("tpr, positives, need", [(0.999, 1_000_999, 999_999), (0.9, 10, 9),
                                                  (0.95, 20, 19), (0.3, 1_000_001, 300_001)])
def test_the_positives_needed_are_ceil_of_the_rate_as_written(tpr, positives, need):
    """A float slack of 1e-9 P took one positive too few from about a million positives
    (0.999 of 1,000,999 needs 999,999, it took 999,998: FPR 0 for 1); 0.9 is 9/10, not the
    binary float just above it."""
    s = np.r_[np.arange(positives, 0, -1, dtype=np.float64), 0.0]  # the k-th positive scores P-k+1
    y = np.r_[np.ones(positives, int), 0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s[-1] = positives - need + 1.5  # the negative just above the need-th positive: accepted
        assert fpr_at_tpr(s, y, tpr) == 1.0
        s[-1] = positives - need + 0.5  # just below it: not accepted
        assert fpr_at_tpr(s, y, tpr) == 0.0
