"""A shared offset of the embeddings moves no Euclidean answer, also on exact ties: the
dominant-offset centring (:func:`dmlkit.distances.dominant_offset`) is rounded to the rows'
spread, so integer rows stay integers and their tied distances stay tied for the tie rule
(few-shot prototypes, re-id ranking)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from dmlkit.apps import few_shot_accuracy
from dmlkit.apps.fewshot import prototype_predict
from dmlkit.apps.reid import evaluate_reid
from dmlkit.distances import LpDistance, dominant_offset


def test_the_offset_is_a_multiple_of_the_spread_quantum_and_still_centres():
    rows = torch.from_numpy(np.random.default_rng(0).integers(-2, 3, (200, 8)) + 1000.0).float()
    offset = dominant_offset(rows)
    assert torch.equal(offset, torch.round(offset))  # spread ~1.4 a coordinate: whole numbers
    assert (offset - 1000).abs().max() <= 1
    spread = 100 + 0.3 * torch.randn(300, 16, generator=torch.Generator().manual_seed(1))
    assert torch.equal(dominant_offset(spread), torch.full((16,), 100.0))  # quarter steps
    assert not dominant_offset(torch.randn(50, 4)).any()  # no dominant mean: no offset


@pytest.mark.parametrize("shift", [5.0, 64.0, 1000.0])
def test_integer_rows_keep_their_exact_euclidean_ties_under_a_shift(shift):
    rows = torch.from_numpy(np.random.default_rng(3).integers(-2, 3, (40, 5))).float()
    plain = LpDistance(normalize_embeddings=False, power=2)(rows)
    moved = LpDistance(normalize_embeddings=False, power=2)(rows + shift)
    assert torch.equal(plain, moved)


def test_few_shot_answers_and_tie_count_do_not_move_with_an_offset():
    rng = np.random.default_rng(0)
    moved = 0
    for _ in range(600):
        support = rng.integers(-2, 3, size=(3, 4)).astype(np.float32)
        query = rng.integers(-2, 3, size=(1, 4)).astype(np.float32)
        before = prototype_predict(support, [0, 1, 2], query)[0]
        after = prototype_predict(support + np.float32(1000), [0, 1, 2], query + np.float32(1000))[0]
        moved += before != after
    assert moved == 0  # was 11 of 2000 trials (exact ties ordered by rounding noise)
    y = np.repeat(np.arange(12), 10)
    x = np.random.default_rng(12).integers(-2, 3, size=(120, 8)).astype(np.float32)
    results = []
    for shift in (0.0, 5.0, 1000.0):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            accuracy = few_shot_accuracy(x + np.float32(shift), y, n_way=5, k_shot=2, n_query=3,
                                         episodes=300)["accuracy"]
        results.append((accuracy, [str(w.message) for w in caught if "exactly" in str(w.message)]))
    assert results[0] == results[1] == results[2]  # was 26 / 13 / 16 tied answers


def test_reid_ranking_of_integer_features_does_not_move_with_an_offset():
    rng = np.random.default_rng(8)
    pool = rng.integers(-2, 3, size=(15, 5)).astype(np.float32)
    gallery, query = pool[rng.integers(0, 15, 300)], pool[rng.integers(0, 15, 60)]
    gid, qid = rng.integers(-1, 25, 300), rng.integers(1, 25, 60)
    gcam, qcam = rng.integers(0, 4, 300), rng.integers(0, 4, 60)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = evaluate_reid(query, gallery, qid, gid, qcam, gcam)
        moved = evaluate_reid(query + np.float32(64), gallery + np.float32(64), qid, gid, qcam, gcam)
    assert np.array_equal(plain.first_hit, moved.first_hit)  # 8 of 60 first hits moved
    assert plain.mAP == moved.mAP
