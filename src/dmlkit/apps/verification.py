"""Verification: are two samples the same identity? Thresholds chosen by k-fold cross-validation.

The protocol of face verification benchmarks such as LFW (Huang et al. 2007), as described in
seed 003: pairs are split into ``k`` folds; for each fold the similarity threshold that
maximises accuracy on the other ``k - 1`` folds is applied to it, so the threshold never sees
the pairs it is scored on. Also reported: ROC AUC, the equal error rate (EER) and the true
accept rate at fixed false accept rates (TAR@FAR), all threshold-free or on all pairs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from dmlkit.exceptions import DataError, ShapeError

__all__ = ["VerificationResult", "kfold_threshold_accuracy", "make_pairs", "pair_scores", "verify"]


def make_pairs(labels: Any, num_pairs: int = 6000, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Balanced pairs ``(i, j, same)``: ``num_pairs // 2`` positive and as many negative pairs.

    Positives are drawn uniformly without replacement among all same-class pairs ``i < j``
    (all of them when there are fewer); negatives uniformly among different-class pairs,
    as many as positives.
    """
    y = np.asarray(labels)
    if y.ndim != 1 or len(y) < 2:
        raise ShapeError(f"labels must be (N,) with N >= 2, got shape {y.shape}")
    rng = np.random.default_rng(seed)
    pos_i, pos_j = [], []
    for c in np.unique(y):
        members = np.flatnonzero(y == c)
        if len(members) > 1:
            a, b = np.triu_indices(len(members), k=1)
            pos_i.append(members[a])
            pos_j.append(members[b])
    if not pos_i:
        raise DataError("no class has two samples: verification needs positive pairs")
    pi, pj = np.concatenate(pos_i), np.concatenate(pos_j)
    n_pos = min(num_pairs // 2, len(pi))
    if n_pos < 1:
        raise ValueError(f"num_pairs must be at least 2, got {num_pairs}")
    pick = rng.choice(len(pi), size=n_pos, replace=False)
    pi, pj = pi[pick], pj[pick]
    if len(np.unique(y)) < 2:
        raise DataError("all samples share one class: verification needs negative pairs")
    ni, nj = [], []
    need = n_pos
    while need > 0:
        a = rng.integers(0, len(y), size=2 * need)
        b = rng.integers(0, len(y), size=2 * need)
        ok = y[a] != y[b]
        ni.append(a[ok][:need])
        nj.append(b[ok][:need])
        need -= int(min(ok.sum(), need))
    ni_a, nj_a = np.concatenate(ni), np.concatenate(nj)
    i = np.concatenate([pi, ni_a])
    j = np.concatenate([pj, nj_a])
    same = np.concatenate([np.ones(n_pos, bool), np.zeros(len(ni_a), bool)])
    order = rng.permutation(len(i))
    return i[order], j[order], same[order]


def pair_scores(embeddings: Any, i: np.ndarray, j: np.ndarray, distance: str = "cosine") -> np.ndarray:
    """Scores of pairs, larger = more likely the same (distances are negated)."""
    import torch

    from dmlkit.distances import get_distance

    dist = get_distance(distance)
    x = torch.as_tensor(np.asarray(embeddings, dtype=np.float32))
    with torch.no_grad():
        values = dist.paired(x[torch.as_tensor(i)], x[torch.as_tensor(j)])
    return dist.closeness(values).numpy().astype(np.float64)


def _best_threshold(scores: np.ndarray, same: np.ndarray) -> tuple[float, float]:
    """The threshold ``t`` (predict same when ``score >= t``) with the highest accuracy."""
    order = np.argsort(-scores, kind="stable")
    s, y = scores[order], same[order]
    # predicting the top-n as "same": correct = positives among top-n + negatives below
    tp = np.concatenate([[0], np.cumsum(y)])
    tn_below = (~y).sum() - np.concatenate([[0], np.cumsum(~y)])
    acc = (tp + tn_below) / len(y)
    # only cut between distinct scores
    valid = np.ones(len(y) + 1, bool)
    valid[1:-1] = s[:-1] != s[1:]
    n = int(np.flatnonzero(valid)[np.argmax(acc[valid])])
    if n == 0:
        t = s[0] + 1e-6
    elif n == len(y):
        t = s[-1] - 1e-6
    else:
        t = (s[n - 1] + s[n]) / 2
    return float(t), float(acc[n])


def kfold_threshold_accuracy(scores: Any, same: Any, folds: int = 10) -> dict[str, Any]:
    """Accuracy with thresholds chosen on the other folds (LFW protocol); folds are contiguous."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(same, dtype=bool)
    if s.shape != y.shape or s.ndim != 1:
        raise ShapeError(f"scores and same must be equal (P,) arrays, got {s.shape} and {y.shape}")
    if folds < 2 or folds > len(s):
        raise ValueError(f"folds must be in [2, {len(s)}], got {folds}")
    parts = np.array_split(np.arange(len(s)), folds)
    accs, thresholds = [], []
    for k in range(folds):
        test = parts[k]
        train = np.concatenate([p for m, p in enumerate(parts) if m != k])
        t, _ = _best_threshold(s[train], y[train])
        thresholds.append(t)
        accs.append(float(((s[test] >= t) == y[test]).mean()))
    return {"accuracy": float(np.mean(accs)), "accuracy_std": float(np.std(accs)),
            "threshold": float(np.mean(thresholds)), "fold_accuracies": accs, "fold_thresholds": thresholds}


@dataclass
class VerificationResult:
    """Verification scores of one embedding set (fractions in [0, 1])."""

    accuracy: float
    accuracy_std: float
    threshold: float
    roc_auc: float
    eer: float
    tar_at_far: dict[str, float]
    num_pairs: int
    folds: int
    fold_accuracies: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def verify(embeddings: Any, labels: Any, *, num_pairs: int = 6000, folds: int = 10,
           distance: str = "cosine", far_targets: tuple[float, ...] = (1e-3, 1e-2, 1e-1),
           seed: int = 0) -> VerificationResult:
    """Balanced pairs from ``labels``, k-fold threshold accuracy, ROC AUC, EER and TAR@FAR."""
    from sklearn.metrics import roc_auc_score, roc_curve

    i, j, same = make_pairs(labels, num_pairs, seed)
    scores = pair_scores(embeddings, i, j, distance)
    kfold = kfold_threshold_accuracy(scores, same, folds=min(folds, len(scores)))
    fpr, tpr, _ = roc_curve(same, scores)
    fnr = 1 - tpr
    e = int(np.argmin(np.abs(fnr - fpr)))
    eer = float((fpr[e] + fnr[e]) / 2)
    tar = {f"{far:g}": float(tpr[np.searchsorted(fpr, far, side="right") - 1]) for far in far_targets}
    return VerificationResult(
        accuracy=kfold["accuracy"], accuracy_std=kfold["accuracy_std"], threshold=kfold["threshold"],
        roc_auc=float(roc_auc_score(same, scores)), eer=eer, tar_at_far=tar, num_pairs=len(scores),
        folds=min(folds, len(scores)), fold_accuracies=kfold["fold_accuracies"],
    )
