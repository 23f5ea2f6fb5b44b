"""The exact (``flat``) index returns the float64 ranking the metrics use, on every scan path.

A float32 scan picks candidates; a proven error bound decides whether a row it left out could
still belong among the ``k`` (:mod:`dmlkit.apps.index_exact`). Before, rows "unit-norm within
1e-5" were scanned by raw inner product with a fixed ``2k + 16`` candidates: 40 rows of norm
``1 + 4.5e-6`` hid the nearest row, and near-duplicates came out of float64 order.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dmlkit.apps import EmbeddingIndex, index_exact
from dmlkit.validation import normalize_rows

faiss = pytest.importorskip("faiss")


pytestmark = pytest.mark.usefixtures("one_faiss_thread")


def _float64_ranking(x: np.ndarray, q: np.ndarray, k: int, distance: str, unit: bool) -> np.ndarray:
    """Brute force over every row in float64 (numpy, independent of the index's code): the
    closeness of the rows as the metrics prepare them, ties by row."""
    if unit:
        x, q = normalize_rows(x), normalize_rows(q)
    x64, q64 = x.astype(np.float64), q.astype(np.float64)
    if distance == "euclidean":
        s = -((q64[:, None, :] - x64[None]) ** 2).sum(-1)
    else:
        s = q64 @ x64.T
    return np.array([np.lexsort((np.arange(len(x)), -row))[:k] for row in s])


def _rows_off_unit_norm() -> tuple[np.ndarray, np.ndarray]:
    """40 rows of norm 1 + 4.5e-6 at cosine 1 - 2e-6 to the query, row 40 of norm 1 at
    1 - 1e-6 (the nearest), 200 unit fillers (D = 16)."""
    rng = np.random.default_rng(0)
    d = 16
    u = rng.normal(size=d)
    u /= np.linalg.norm(u)

    def at(cos: float, norm: float) -> np.ndarray:
        v = rng.normal(size=d)
        v -= (v @ u) * u
        v /= np.linalg.norm(v)
        return norm * (cos * u + np.sqrt(1 - cos * cos) * v)

    rows = [at(1 - 2e-6, 1 + 4.5e-6) for _ in range(40)] + [at(1 - 1e-6, 1.0)]
    fill = rng.normal(size=(200, d))
    x = np.concatenate([np.array(rows), fill / np.linalg.norm(fill, axis=1, keepdims=True)])
    return x.astype(np.float32), u[None].astype(np.float32)


def test_flat_cosine_finds_the_nearest_row_behind_rows_slightly_off_unit_norm():
    x, q = _rows_off_unit_norm()
    res = EmbeddingIndex(x).search(q, 5)
    assert res.indices[0, 0] == 40
    np.testing.assert_array_equal(res.indices, _float64_ranking(x, q, 5, "cosine", True))


def test_unit_tolerance_is_float32_rounding_of_the_dimension():
    """Rows normalised in float32 count as unit rows (raw scan); 1 + 4.5e-6 at d = 16 does not."""
    x, _ = _rows_off_unit_norm()
    assert not index_exact.row_norms(x, True).unit_rows
    rng = np.random.default_rng(1)
    for d in (16, 128, 1024):
        unit = torch.nn.functional.normalize(torch.from_numpy(rng.normal(size=(500, d)).astype(np.float32)), dim=1)
        assert index_exact.row_norms(unit.numpy(), True).unit_rows


def _near_duplicates(with_zero_rows: bool) -> tuple[np.ndarray, np.ndarray]:
    """300 near-duplicates of one direction (and 20 exact copies of some), 400 others: float32
    closeness gaps of 1e-8 between the candidates, far below the scan's rounding."""
    rng = np.random.default_rng(0)
    d = 32
    u = rng.normal(size=d)
    parts = [u + 3e-4 * rng.normal(size=(300, d)), rng.normal(size=(400, d))]
    if with_zero_rows:
        parts.append(np.zeros((3, d)))
    x = np.concatenate(parts + [parts[0][:20]])
    x = torch.nn.functional.normalize(torch.tensor(x, dtype=torch.float32), dim=1).numpy()
    q = (u + 3e-4 * rng.normal(size=(12, d))).astype(np.float32)
    return x, q


@pytest.mark.parametrize("path", ["faiss", "numpy", "knn"])
@pytest.mark.parametrize(("distance", "normalize", "zero_rows"), [
    ("cosine", True, False), ("cosine", True, True), ("euclidean", True, True), ("dot", True, False),
    ("euclidean", False, False), ("dot", False, True),
])
def test_flat_search_is_the_float64_ranking_on_every_scan_path(monkeypatch, path, distance, normalize, zero_rows):
    x, q = _near_duplicates(zero_rows)
    if path == "numpy":
        monkeypatch.setattr(index_exact, "_faiss_or_none", lambda: None)
    elif path == "knn":
        monkeypatch.setattr(index_exact, "SMALL_EXACT", 0)
        monkeypatch.setattr(index_exact, "_scan_metric", lambda *a: None)
    unit = normalize or distance == "cosine"
    for data in (x, x * np.float32(3.0)):  # rows of unit norm (raw scan where faiss) and not
        res = EmbeddingIndex(data, distance=distance, normalize=normalize).search(q, 10)
        np.testing.assert_array_equal(res.indices, _float64_ranking(data, q, 10, distance, unit))


def test_a_complete_scan_is_not_searched_again(monkeypatch):
    """Well-separated candidates pass the bound: no second pass."""
    calls = []
    real = index_exact._complete
    monkeypatch.setattr(index_exact, "_complete", lambda *a: calls.append(1) or real(*a))
    x = np.random.default_rng(0).normal(size=(2000, 16)).astype(np.float32)
    q = x[:20] + np.float32(0.05)
    res = EmbeddingIndex(x).search(q, 5)
    assert not calls
    np.testing.assert_array_equal(res.indices, _float64_ranking(x, q, 5, "cosine", True))
