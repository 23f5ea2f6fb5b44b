"""k-reciprocal re-ranking: the streamed sparse version against a dense plain reference."""

from __future__ import annotations

import numpy as np
import pytest

from dmlkit.apps.reid import evaluate_reid, k_reciprocal_blocks, k_reciprocal_distances
from dmlkit.exceptions import ConfigError


def dense_rerank(q, g, k1, k2, lam):
    """Zhong et al. 2017 on dense N x N matrices, written from the paper's equations."""
    x = np.concatenate([q, g]).astype(np.float64)
    n, n_q = len(x), len(q)
    d2 = ((x[:, None] - x[None]) ** 2).sum(-1)
    od = d2 / d2.max(1, keepdims=True)
    rank = np.argsort(od, axis=1, kind="stable")

    def neighbours(k):  # mask[i, j]: j is among the k + 1 nearest of i (itself included)
        mask = np.zeros((n, n), dtype=bool)
        np.put_along_axis(mask, rank[:, : k + 1], True, axis=1)
        return mask & mask.T  # k-reciprocal

    recip_full, recip_half = neighbours(k1), neighbours(int(np.around(k1 / 2)))

    def recip(i, k):
        return np.flatnonzero((recip_full if k == k1 else recip_half)[i])

    v = np.zeros((n, n))
    for i in range(n):
        r = recip(i, k1)
        exp = set(r.tolist())
        for j in r:
            rj = recip(j, int(np.around(k1 / 2)))
            if len(set(rj.tolist()) & set(r.tolist())) > 2 / 3 * len(rj):
                exp |= set(rj.tolist())
        idx = np.array(sorted(exp))
        w = np.exp(-od[i, idx])
        v[i, idx] = w / w.sum()
    if k2 > 1:
        v = np.stack([v[rank[i, :k2]].mean(0) for i in range(n)])
    mins = np.minimum(v[:n_q, None, :], v[None, n_q:, :]).sum(-1)
    maxs = np.maximum(v[:n_q, None, :], v[None, n_q:, :]).sum(-1)
    jac = 1 - mins / maxs
    return (1 - lam) * jac + lam * od[:n_q, n_q:]


@pytest.mark.parametrize(("k1", "k2", "lam"), [(20, 6, 0.3), (5, 1, 0.5), (8, 3, 0.0)])
def test_matches_dense_reference(k1, k2, lam):
    rng = np.random.default_rng(k1)
    centres = rng.standard_normal((8, 6))
    ids_q, ids_g = rng.integers(0, 8, 25), rng.integers(0, 8, 70)
    q = (centres[ids_q] + 0.7 * rng.standard_normal((25, 6))).astype(np.float32)
    g = (centres[ids_g] + 0.7 * rng.standard_normal((70, 6))).astype(np.float32)
    want = dense_rerank(q, g, k1, k2, lam)
    got = k_reciprocal_distances(q, g, k1=k1, k2=k2, lambda_value=lam, memory_budget=8000)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # streamed in blocks of a few query rows
    rows = [a for a, _ in k_reciprocal_blocks(q, g, k1=k1, k2=k2, lambda_value=lam,
                                               memory_budget=8000)]
    assert len(rows) > 1 and rows == sorted(rows)


def test_rerank_improves_map_on_clustered_data():
    rng = np.random.default_rng(0)
    n_ids = 30
    centres = rng.standard_normal((n_ids, 16))
    g_ids = np.repeat(np.arange(n_ids), 8)
    q_ids = np.repeat(np.arange(n_ids), 2)
    g = centres[g_ids] + 0.9 * rng.standard_normal((g_ids.size, 16))
    q = centres[q_ids] + 0.9 * rng.standard_normal((q_ids.size, 16))
    plain = evaluate_reid(q, g, q_ids, g_ids)
    reranked = evaluate_reid(q, g, q_ids, g_ids, rerank={"k1": 20, "k2": 6})
    assert reranked.mAP > plain.mAP + 0.02  # the method's purpose: a better full ranking


def test_rerank_errors():
    q, g = np.zeros((3, 4)), np.ones((5, 4))
    with pytest.raises(ConfigError):
        k_reciprocal_distances(q, g, metric="dot")
    with pytest.raises(ConfigError):
        k_reciprocal_distances(q, g, k1=0)
    with pytest.raises(ConfigError):
        k_reciprocal_distances(q, g, lambda_value=2.0)
