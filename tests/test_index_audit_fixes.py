"""Audit fixes of the index, its recall measurement, its files and its inputs: IVF-PQ's score
of a zero row, zero queries and bad settings of the recall measurement, fsync of a saved
index, the order of exact ties in approximate results, non-integer settings, and float64
input that float32 cannot hold."""

from __future__ import annotations

import numpy as np
import pytest

from dmlkit.apps import EmbeddingIndex

faiss = pytest.importorskip("faiss")


@pytest.fixture(scope="module", autouse=True)
def _one_faiss_thread():
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)


def _emb(n: int = 400, d: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, d)).astype(np.float32)


@pytest.mark.filterwarnings("ignore:nprobe=999 is more than")
@pytest.mark.parametrize("kind", ["flat", "ivf_flat", "hnsw", "ivf_pq"])
def test_a_zero_row_is_at_distance_one_from_every_query_in_every_kind(kind):
    """Normalised Euclidean: a zero row stays zero, |q/|q| - 0| = 1 (IVF-PQ's re-ranking said
    sqrt(2) and ranked it behind every row at less than 90 degrees)."""
    x = _emb()
    x[7] = 0
    q = _emb(3, seed=1)
    settings = {"ivf_flat": {"nprobe": 999}, "hnsw": {"ef_search": 999}, "ivf_pq": {"nprobe": 999, "rerank": 999}}
    idx = EmbeddingIndex(x, distance="euclidean", kind=kind, recall_queries=20, **settings.get(kind, {}))
    res = idx.search(q, 400)
    flat = EmbeddingIndex(x, distance="euclidean").search(q, 400)
    at = res.indices == 7
    np.testing.assert_allclose(res.scores[at], 1.0, atol=1e-6)
    np.testing.assert_array_equal(np.argwhere(at), np.argwhere(flat.indices == 7))

