"""Re-id protocol: the streamed kernel against a plain reference (sort each row, apply the rules)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dmlkit.apps.reid import evaluate_reid, evaluate_reid_scores
from dmlkit.exceptions import ConfigError, DataError, NonFiniteError, ShapeError


def reference_protocol(dist, q_ids, g_ids, q_cams=None, g_cams=None, junk=(-1,), trapezoid=False):
    """Plain Market-1501 protocol: stable sort of each row, drop junk, score the positives."""
    first, aps, inps = [], [], []
    for i in range(dist.shape[0]):
        order = np.argsort(dist[i], kind="stable")
        drop = np.isin(g_ids[order], junk)
        if q_cams is not None:
            drop |= (g_ids[order] == q_ids[i]) & (g_cams[order] == q_cams[i])
        hits = g_ids[order][~drop] == q_ids[i]
        if not hits.any():
            first.append(-1), aps.append(np.nan), inps.append(np.nan)
            continue
        ranks = np.flatnonzero(hits)  # 0-based ranks of the positives
        i_th = np.arange(1, ranks.size + 1)
        precision = i_th / (ranks + 1)
        if trapezoid:
            old = np.where(ranks > 0, (i_th - 1) / np.maximum(ranks, 1), 1.0)
            aps.append(np.mean((old + precision) / 2))
        else:
            aps.append(np.mean(precision))
        first.append(ranks[0])
        inps.append(ranks.size / (ranks[-1] + 1))
    return np.array(first), np.array(aps), np.array(inps)


def _tied_data(seed, n_q=60, n_g=400, dim=3, n_ids=12, n_cams=4):
    rng = np.random.default_rng(seed)
    # small integer features: many exactly tied squared distances
    q = rng.integers(0, 3, (n_q, dim)).astype(np.float32)
    g = rng.integers(0, 3, (n_g, dim)).astype(np.float32)
    q_ids = rng.integers(1, n_ids + 2, n_q)  # ids n_ids, n_ids + 1: not in the gallery
    g_ids = rng.integers(-1, n_ids, n_g)  # -1 junk, 0 distractor
    return q, g, q_ids, g_ids, rng.integers(0, n_cams, n_q), rng.integers(0, n_cams, n_g)


@pytest.mark.parametrize("offset", [0.0, 100.0])
def test_a_shared_offset_changes_no_euclidean_ranking(offset):
    """Features sharing an offset of 100 (|g|^2 ~ 1.3e6, a float32 spacing of 0.125 in the
    expanded form) ranked squared distances of 0.7-0.9 at random: Rank-1 0.30 for 1.00."""
    rng = np.random.default_rng(0)
    ids = np.repeat(np.arange(50), 4)
    x = rng.normal(size=(50, 128))[ids] * 0.1 + rng.normal(size=(200, 128)) * 0.05
    cams = np.tile(np.arange(4), 50)
    q, g = x[::4], x[np.arange(200) % 4 != 0]
    dist = ((q[:, None] - g[None]) ** 2).sum(-1)  # float64, before the offset
    first, ap, _ = reference_protocol(dist, ids[::4], ids[np.arange(200) % 4 != 0], cams[::4],
                                      cams[np.arange(200) % 4 != 0])
    got = evaluate_reid((q + offset).astype(np.float32), (g + offset).astype(np.float32), ids[::4],
                        ids[np.arange(200) % 4 != 0], cams[::4], cams[np.arange(200) % 4 != 0])
    np.testing.assert_array_equal(got.first_hit, first)
    assert got.mAP == pytest.approx(float(np.mean(ap)), abs=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("trapezoid", [False, True])
def test_matches_reference_with_ties_cameras_and_junk(seed, trapezoid):
    q, g, q_ids, g_ids, q_cams, g_cams = _tied_data(seed)
    dist = ((q[:, None] - g[None]) ** 2).sum(-1)
    mode = "trapezoid" if trapezoid else "standard"
    got = evaluate_reid(q, g, q_ids, g_ids, q_cams, g_cams, ap_mode=mode, memory_budget=4096)
    first, ap, inp = reference_protocol(dist, q_ids, g_ids, q_cams, g_cams, trapezoid=trapezoid)
    np.testing.assert_array_equal(got.first_hit, first)
    np.testing.assert_allclose(got.ap, ap, rtol=1e-12, equal_nan=True)
    np.testing.assert_allclose(got.inp, inp, rtol=1e-12, equal_nan=True)
    valid = first >= 0
    assert got.num_valid_queries == valid.sum() and got.num_skipped_queries == (~valid).sum()
    assert got.num_skipped_queries > 0  # the data does produce queries without a positive
    assert got.mAP == pytest.approx(np.mean(ap[valid]))
    cmc = np.array([np.mean(first[valid] < k) for k in range(1, g.shape[0] + 1)])
    np.testing.assert_allclose(got.cmc, cmc)
    assert got.cmc.shape == (g.shape[0],) and got.cmc[-1] == 1.0


def test_precomputed_scores_both_signs_blocks_and_no_cameras():
    q, g, q_ids, g_ids, _, _ = _tied_data(5)
    dist = ((q[:, None] - g[None]) ** 2).sum(-1).astype(np.float32)
    first, ap, _ = reference_protocol(dist, q_ids, g_ids)  # no camera rule
    for result in (
        evaluate_reid_scores(dist, q_ids, g_ids),
        evaluate_reid_scores(torch.from_numpy(-dist), q_ids, g_ids, higher_is_closer=True),
        evaluate_reid_scores(((a, dist[a:a + 7]) for a in range(0, len(q), 7)), q_ids, g_ids),
        evaluate_reid(q, g, q_ids, g_ids),
    ):
        np.testing.assert_array_equal(result.first_hit, first)
        np.testing.assert_allclose(result.ap, ap, equal_nan=True)


def test_hand_computed_example():
    # one query (id 1, camera 0); gallery ranked by distance = its index
    g_ids = np.array([1, 2, -1, 1, 0, 1, 3, 1])
    g_cams = np.array([0, 1, 1, 1, 1, 2, 1, 1])  # item 0: same id + same camera -> junk
    dist = np.arange(8, dtype=np.float32)[None]
    r = evaluate_reid_scores(dist, np.array([1]), g_ids, np.array([0]), g_cams)
    # kept ranking: 2, 1*, 0, 1*, 3, 1*  -> positives at ranks 2, 4, 6 (1-based)
    assert r.first_hit.tolist() == [1]
    assert r.ap[0] == pytest.approx((1 / 2 + 2 / 4 + 3 / 6) / 3)
    assert r.inp[0] == pytest.approx(3 / 6)
    assert r.rank(1) == 0.0 and r.rank(2) == 1.0 and r.rank(100) == 1.0
    d = r.to_dict()
    assert d["rank_1"] == 0.0 and d["num_valid_queries"] == 1 and d["num_gallery"] == 8


def test_metrics_cosine_dot_and_memory_bound_agree():
    rng = np.random.default_rng(3)
    q, g = rng.standard_normal((40, 16)), rng.standard_normal((500, 16))
    q_ids, g_ids = rng.integers(0, 20, 40), rng.integers(0, 20, 500)
    q_cams, g_cams = rng.integers(0, 3, 40), rng.integers(0, 3, 500)
    qn = q / np.linalg.norm(q, axis=1, keepdims=True)
    gn = g / np.linalg.norm(g, axis=1, keepdims=True)
    for metric, dist in (("cosine", -qn @ gn.T), ("dot", -q @ g.T),
                         ("euclidean", ((q[:, None] - g[None]) ** 2).sum(-1))):
        first, ap, inp = reference_protocol(dist, q_ids, g_ids, q_cams, g_cams)
        for budget in (1, 2**20):  # one query row per block, or all at once
            r = evaluate_reid(q, g, q_ids, g_ids, q_cams, g_cams, metric=metric,
                              memory_budget=budget)
            np.testing.assert_array_equal(r.first_hit, first)
            np.testing.assert_allclose(r.ap, ap, rtol=1e-9, equal_nan=True)
            np.testing.assert_allclose(r.inp, inp, rtol=1e-9, equal_nan=True)


def test_perfect_embedding_scores_one():
    ids = np.repeat(np.arange(10), 4)
    cams = np.tile(np.arange(4), 10)
    emb = np.eye(10, dtype=np.float32)[ids]
    r = evaluate_reid(emb[::4], emb, ids[::4], ids, cams[::4], cams)
    assert r.rank(1) == 1.0 and r.mAP == 1.0 and r.mINP == 1.0
    assert (r.num_positives == 3).all()  # the same-camera copy is junk


def test_errors():
    q, g = np.zeros((2, 3)), np.zeros((4, 3))
    with pytest.raises(ShapeError):
        evaluate_reid(q, g, [1, 2], [1, 2, 3])
    with pytest.raises(ShapeError):
        evaluate_reid(q, np.zeros((4, 5)), [1, 2], [1, 2, 3, 4])
    with pytest.raises(ShapeError):
        evaluate_reid(q, g, [1, 2], [1, 2, 3, 4], [0, 0], None)
    with pytest.raises(NonFiniteError):
        evaluate_reid(np.full((2, 3), np.nan), g, [1, 2], [1, 2, 3, 4])
    with pytest.raises(ConfigError):
        evaluate_reid(q, g, [1, 2], [1, 2, 3, 4], metric="manhattan")
    with pytest.raises(ConfigError):
        evaluate_reid(q, g, [1, 2], [1, 2, 3, 4], ap_mode="interpolated")
    s = np.random.default_rng(1).normal(size=(4, 5)).astype(np.float32)
    with pytest.raises(ShapeError, match="scored twice"):  # passed as coverage: rows 2-3 never scored
        evaluate_reid_scores([(0, s[:2]), (0, s[:2])], [0, 1, 0, 1], [0, 1, 0, 1, 2])
    with pytest.raises(ShapeError, match="covered 2 query rows, expected 4"):
        evaluate_reid_scores([(0, s[:2])], [0, 1, 0, 1], [0, 1, 0, 1, 2])
    r = evaluate_reid(q, g, [7, 8], [1, 2, 3, 4])
    assert r.num_valid_queries == 0
    with pytest.raises(DataError, match="no query has a positive"):
        _ = r.mAP


def test_cosine_is_scale_invariant_and_raw_products_out_of_range_are_refused():
    """Issue 11, point 3, in the re-id protocol: cosine (or ``normalize=True``) gives the same
    ranking at any float32 scale; raw euclidean / dot products that would overflow or vanish
    into subnormals raise a clear error instead of ranking garbage."""
    rng = np.random.default_rng(0)
    q, g = rng.standard_normal((50, 16)).astype(np.float32), rng.standard_normal((200, 16)).astype(np.float32)
    qi, gi = rng.integers(0, 20, 50), rng.integers(0, 20, 200)
    qc, gc = np.zeros(50, int), np.ones(200, int)
    for metric, normalize in (("cosine", False), ("euclidean", True), ("dot", True)):
        expected = evaluate_reid(q, g, qi, gi, qc, gc, metric=metric, normalize=normalize)
        for scale in (1e19, 1e-20):
            got = evaluate_reid(q * scale, g * scale, qi, gi, qc, gc, metric=metric, normalize=normalize)
            assert got.mAP == expected.mAP and got.rank(1) == expected.rank(1), (metric, scale)
    for metric in ("euclidean", "dot"):
        for scale, word in ((1e19, "too large"), (1e-20, "too small")):
            with pytest.raises(NonFiniteError, match=word):
                evaluate_reid(q * scale, g * scale, qi, gi, qc, gc, metric=metric)
    # k-reciprocal re-ranking: the same rules
    expected = evaluate_reid(q, g, qi, gi, qc, gc, metric="cosine", rerank=True)
    got = evaluate_reid(q * 1e19, g * 1e19, qi, gi, qc, gc, metric="cosine", rerank=True)
    assert got.mAP == expected.mAP
    with pytest.raises(NonFiniteError, match="too large"):
        evaluate_reid(q * 1e19, g * 1e19, qi, gi, qc, gc, metric="euclidean", rerank=True)


def test_a_negative_scored_exactly_as_a_positive_is_counted_in_one_warning():
    """Such a pair is ranked by gallery index (deterministic), so the query's CMC and AP come
    from the gallery's order, not the features: the valid queries where it happens are counted
    (brute force over integer scores, which tie often; float64 and float32 blocks alike)."""
    import re
    import warnings

    rng = np.random.default_rng(0)
    q_ids, g_ids = rng.integers(0, 5, 30), rng.integers(0, 5, 40)
    scores = rng.integers(0, 1000, size=(30, 40)).astype(np.float64)
    want = sum(bool(np.isin(scores[r, g_ids != q_ids[r]], scores[r, g_ids == q_ids[r]]).any())
               for r in range(30) if (g_ids == q_ids[r]).any())
    assert 0 < want < 30
    for block in (scores, scores.astype(np.float32)):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            evaluate_reid_scores(block, q_ids, g_ids, higher_is_closer=True)
        messages = [str(w.message) for w in record if "scores exactly as" in str(w.message)]
        assert len(messages) == 1
        assert int(re.search(r"for (\d+) of", messages[0]).group(1)) == want
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # distinct scores: no tie, no warning
        evaluate_reid_scores(rng.permutation(1200).reshape(30, 40).astype(np.float64), q_ids, g_ids)


def test_collapsed_features_flag_every_valid_query():
    q, g = np.ones((6, 4), np.float32), np.ones((9, 4), np.float32)
    with pytest.warns(UserWarning, match=r"for 6 of 6 valid queries"):
        evaluate_reid(q, g, [0, 1, 2, 0, 1, 2], [0, 1, 2] * 3)
