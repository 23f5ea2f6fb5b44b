"""Regression tests of the applications audit: index labels, verification pairs and folds,
IVF held-out recall after a reload, kNN votes of negative labels, few-shot class coverage."""

from __future__ import annotations

import numpy as np
import pytest

from dmlkit.apps import EmbeddingIndex
from dmlkit.apps import verification as verification_module
from dmlkit.apps.verification import make_pairs, stratified_folds
from dmlkit.exceptions import ConfigError


def _unordered(i: np.ndarray, j: np.ndarray) -> list[tuple[int, int]]:
    return [(min(a, b), max(a, b)) for a, b in zip(i.tolist(), j.tolist())]


# -- verification pairs ------------------------------------------------------------------------
@pytest.mark.parametrize("enumerate_limit", [None, 0])  # listed outright / drawn with rejection
def test_make_pairs_negatives_are_distinct_unordered_pairs(monkeypatch, enumerate_limit):
    if enumerate_limit is not None:
        monkeypatch.setattr(verification_module, "_ENUMERATE_PAIRS", enumerate_limit)
    y = np.repeat(np.arange(20), 10)  # 20 people x 10: 900 positives, 18,000 negative pairs
    i, j, same = make_pairs(y, 1800, seed=0)
    neg = [p for p, s in zip(_unordered(i, j), same) if not s]
    assert len(neg) == 900 and len(set(neg)) == 900  # no repeat, in either order
    assert all(y[a] != y[b] for a, b in neg) and all(a != b for a, b in neg)
    again = make_pairs(y, 1800, seed=0)
    assert all(np.array_equal(u, v) for u, v in zip((i, j, same), again))  # deterministic by seed


def test_make_pairs_can_take_every_negative_and_refuses_more():
    y = np.array([0] * 6 + [1] * 3)  # 15 + 3 positive, 18 negative unordered pairs
    i, j, same = make_pairs(y, 36, seed=0)  # 18 + 18: every negative pair, once each
    neg = [p for p, s in zip(_unordered(i, j), same) if not s]
    assert len(neg) == 18 == len(set(neg))
    y2 = np.array([0] * 30 + [1])  # 435 positive pairs, only 30 negative
    with pytest.raises(ConfigError, match="only 30"):
        make_pairs(y2, 200, seed=0)


def test_stratified_folds_sizes_differ_by_at_most_one():
    for n_pos, n_neg, folds in [(3, 3, 5), (11, 9, 4), (1, 1, 2), (7, 0, 3), (0, 5, 2), (23, 41, 10)]:
        same = np.array([True] * n_pos + [False] * n_neg)
        ids = stratified_folds(same, folds)
        sizes = np.bincount(ids, minlength=folds)
        assert sizes.max() - sizes.min() <= 1, (n_pos, n_neg, folds, sizes)
        for mask in (same, ~same):  # each kind still spread evenly
            per = np.bincount(ids[mask], minlength=folds)
            assert per.max() - per.min() <= 1


# -- kNN classification ------------------------------------------------------------------------
def test_classify_counts_negative_labels():
    x = np.array([[1, 0], [0.99, 0.1], [0.98, 0.2], [0.9, 0.4], [0, 1]], np.float32)
    idx = EmbeddingIndex(x, np.array([-1, -1, 2, 2, 2]))
    q = np.array([[1, 0.05]], np.float32)
    assert idx.search(q, 3).labels.tolist() == [[-1, -1, 2]]
    assert idx.classify(q, k=3).tolist() == [-1]  # the majority of real labels, -1 included
    assert EmbeddingIndex(x, np.array([-2, -2, -3, -3, 5])).classify(q, k=1).tolist() == [-2]
