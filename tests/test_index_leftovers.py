"""Two places where the index said one thing and did another: an all-zero query on a cosine
index scored every item 0 and returned the first rows as "nearest" (only the service refused
it), and an ``nprobe`` above the IVF cell count was reported as given while faiss scanned every
cell."""

from __future__ import annotations

import numpy as np
import pytest

from dmlkit.apps import EmbeddingIndex
from dmlkit.embeddings import save_embeddings
from dmlkit.exceptions import DataError


def _emb(n: int = 200, d: int = 8) -> np.ndarray:
    return np.random.default_rng(0).normal(size=(n, d)).astype(np.float32)


@pytest.mark.parametrize("distance, normalize, refused", [
    ("cosine", True, True), ("euclidean", True, True), ("euclidean", False, False), ("dot", False, False),
])
def test_search_refuses_an_all_zero_query_where_only_directions_count(distance, normalize, refused):
    idx = EmbeddingIndex(_emb(), distance=distance, normalize=normalize)
    queries = _emb(5)
    queries[3] = -0.0
    if refused:
        with pytest.raises(DataError, match=r"^query row 3 is all zeros \(1 such row\(s\)\): a "):
            idx.search(queries, 4)
        queries[3, 0] = 1e-40  # tiny is not zero: it has a direction
        assert idx.search(queries, 4).indices.shape == (5, 4)
    else:  # a zero vector has a distance / inner product like any other
        res = idx.search(queries, 4)
        assert res.indices.shape == (5, 4) and np.isfinite(res.scores).all()


def test_query_cli_refuses_a_zero_query_row_in_one_line(tmp_path, run_cli):
    x = _emb()
    save_embeddings(tmp_path / "ref.npz", x, np.arange(200) % 10)
    q = x[:6].copy()
    q[4] = 0
    save_embeddings(tmp_path / "q.npz", q, np.arange(6))
    code, _, err = run_cli(["index", str(tmp_path / "ref.npz"), "-o", str(tmp_path / "idx")])
    assert code == 0, err
    code, out, err = run_cli(["query", str(tmp_path / "idx"), str(tmp_path / "q.npz"), "-k", "3", "--json"])
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [err.strip()] and "query row 4 is all zeros" in err


def test_nprobe_above_the_cell_count_is_reported_as_scanned():
    pytest.importorskip("faiss")
    x = _emb(2000, 16)
    with pytest.warns(UserWarning, match=r"nprobe=64 is more than the index's 8 cells: every cell is scanned"):
        idx = EmbeddingIndex(x, kind="ivf_flat", nlist=8, nprobe=64, recall_queries=50)
    assert idx.params["nprobe"] == 8
    exact = EmbeddingIndex(x).search(x[:50], 5)
    np.testing.assert_array_equal(idx.search(x[:50], 5).indices, exact.indices)  # every cell: exact


@pytest.mark.parametrize("seed", ["-1", str(2**31), str(2**64)])
def test_index_seed_out_of_faiss_range_is_one_error_line(tmp_path, run_cli, seed):
    """Was: --seed -1 a ValueError traceback (numpy), 2**31 an OverflowError (faiss's C int)."""
    save_embeddings(tmp_path / "ref.npz", _emb(), np.arange(200) % 10)
    code, out, err = run_cli(["index", str(tmp_path / "ref.npz"), "-o", str(tmp_path / "idx"),
                              "--kind", "ivf_flat", "--nlist", "4", f"--seed={seed}"])
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [err.strip()]
    assert "seed must be a non-negative integer below 2**31" in err
    assert not (tmp_path / "idx").exists()


def test_index_seed_at_faiss_limit_builds():
    x = _emb()
    index = EmbeddingIndex(x, np.arange(200) % 10, kind="ivf_flat", nlist=4, seed=2**31 - 1)
    assert index.search(x[:3], k=1).indices.shape == (3, 1)
