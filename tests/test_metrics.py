"""Retrieval metrics and exact kNN against slow references written from the definitions."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch

from dmlkit.distances import DotProductSimilarity
from dmlkit.exceptions import ConfigError, DataError, NonFiniteError, ShapeError
from dmlkit.metrics import evaluate, exact_topk, faiss_available, knn, per_class, per_query

#: raw inner product (no normalisation): exact in float32 on small integer vectors
DOT = DotProductSimilarity(normalize_embeddings=False)

BACKENDS = ["torch", "numba", pytest.param("faiss", marks=pytest.mark.skipif(not faiss_available(), reason="faiss"))]


# -- slow references ------------------------------------------------------------------------------
def ref_closeness(q: np.ndarray, r: np.ndarray, distance: str) -> np.ndarray:
    q64, r64 = q.astype(np.float64), r.astype(np.float64)
    if distance == "cosine":
        q64 = q64 / np.linalg.norm(q64, axis=1, keepdims=True)
        r64 = r64 / np.linalg.norm(r64, axis=1, keepdims=True)
        return q64 @ r64.T
    if distance == "dot":
        return q64 @ r64.T
    if distance == "euclidean":  # LpDistance normalises by default
        q64 = q64 / np.linalg.norm(q64, axis=1, keepdims=True)
        r64 = r64 / np.linalg.norm(r64, axis=1, keepdims=True)
        return -np.sqrt(((q64[:, None, :] - r64[None, :, :]) ** 2).sum(-1))
    raise AssertionError(distance)


def ref_rankings(q, r, same, distance="cosine"):
    """Every query's full ranking: sorted by (closeness desc, index asc), self removed."""
    c = ref_closeness(q, r, distance)
    out = []
    for i in range(q.shape[0]):
        cand = [j for j in range(r.shape[0]) if not (same and j == i)]
        out.append(sorted(cand, key=lambda j: (-c[i, j], j)))
    return out


def ref_metrics(q, ql, r=None, rl=None, ks=(1, 2, 4, 8), distance="cosine"):
    same = r is None
    if same:
        r, rl = q, ql
    ranks = ref_rankings(q, r, same, distance)
    per = {n: [] for n in ["precision_at_1", "r_precision", "map_at_r", "map"]
           + [f"recall_at_{k}" for k in ks] + [f"precision_at_{k}" for k in ks]}
    skipped = 0
    for i, ranking in enumerate(ranks):
        rel = [int(rl[j] == ql[i]) for j in ranking]
        big_r = sum(rel)
        if big_r == 0:
            skipped += 1
            continue
        per["precision_at_1"].append(rel[0])
        for k in ks:
            per[f"recall_at_{k}"].append(float(any(rel[:k])))
            per[f"precision_at_{k}"].append(sum(rel[:k]) / k)
        per["r_precision"].append(sum(rel[:big_r]) / big_r)
        ap_r = sum(sum(rel[: i + 1]) / (i + 1) for i in range(big_r) if rel[i]) / big_r
        per["map_at_r"].append(ap_r)
        ap = sum(sum(rel[: i + 1]) / (i + 1) for i in range(len(rel)) if rel[i]) / big_r
        per["map"].append(ap)
    out = {k: float(np.mean(v)) if v else math.nan for k, v in per.items()}
    out["num_queries_without_positive"] = skipped
    return out


ALL_RETRIEVAL = ["precision_at_1", "recall_at_k", "precision_at_k", "r_precision", "map_at_r", "map"]


def _compare(got, want):
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-12), key


def tied_data(n=120, d=4, classes=25, seed=0):
    """Small integer vectors: dot products are exact in float32 and full of ties."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-1, 2, size=(n, d)).astype(np.float32)
    y = rng.integers(0, classes, size=n)
    y[:5] = 1000 + np.arange(5)  # five classes of size 1
    return x, y


# -- the worked example of the Reality Check -----------------------------------------------------
@pytest.mark.parametrize(
    "correct, recall1, rp, mapr",
    [
        ([1], 1.0, 0.1, 0.1),
        ([1, 10], 1.0, 0.2, 0.12),
        ([1, 2], 1.0, 0.2, 0.2),
        (list(range(1, 11)), 1.0, 1.0, 1.0),
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_reality_check_table(correct, recall1, rp, mapr, backend):
    """Seed 000, table "Retrieval results": R = 10 references of the query's class."""
    # references on a line: position p (1-based) has similarity 100 - p to the query [1]
    ranked_labels = [0 if p in correct else 1 for p in range(1, 11)]
    ranked_labels += [0] * (10 - len(correct)) + [1] * 5  # the remaining positives come later
    ref = np.array([[100.0 - p] for p in range(1, len(ranked_labels) + 1)], dtype=np.float32)
    res = evaluate(np.array([[1.0]], dtype=np.float32), [0], ref, ranked_labels,
                   metrics=["recall_at_1", "r_precision", "map_at_r"], distance=DOT, backend=backend)
    assert res["recall_at_1"] == recall1
    assert res["r_precision"] == pytest.approx(rp, abs=1e-15)
    assert res["map_at_r"] == pytest.approx(mapr, abs=1e-15)


# -- kNN --------------------------------------------------------------------------------------------
def test_exact_topk_breaks_ties_by_index():
    v = torch.tensor([[0.5, 0.75, 0.5, 0.5, 0.125, 0.75]])
    top_v, top_i = exact_topk(v, 4)
    assert top_i.tolist() == [[1, 5, 0, 2]]
    assert top_v.tolist() == [[0.75, 0.75, 0.5, 0.5]]
    top_v, top_i = exact_topk(v, 2, indices=torch.tensor([[9, 8, 7, 6, 5, 4]]))
    assert top_i.tolist() == [[4, 8]]


def test_knn_torch_matches_reference_with_ties():
    x, _ = tied_data()
    res = knn(x, None, 7, distance=DOT, backend="torch", memory_budget=2**20)
    want = [r[:7] for r in ref_rankings(x, x, True, "dot")]
    assert res.indices.tolist() == want
    c = ref_closeness(x, x, "dot")
    np.testing.assert_array_equal(res.values.numpy(), np.take_along_axis(c, np.array(want), 1))


@pytest.mark.parametrize("distance", ["cosine", "euclidean", "dot", "snr"])
@pytest.mark.parametrize("same", [True, False])
def test_knn_backends_agree(distance, same):
    rng = np.random.default_rng(3)
    q = rng.normal(size=(400, 16)).astype(np.float32)
    r = None if same else rng.normal(size=(450, 16)).astype(np.float32)
    a = knn(q, r, 12, distance=distance, backend="torch", memory_budget=2**20)
    if distance == "snr" or not faiss_available():
        b = knn(q, r, 12, distance=distance, backend="torch")  # default budget: other tiling
    else:
        order = torch.randperm(400) if same else None
        b = knn(q, r, 12, distance=distance, backend="faiss", memory_budget=2**20, order=order)
    assert torch.equal(a.indices, b.indices)
    torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)
    if distance in ("cosine", "euclidean"):
        want = [row[:12] for row in ref_rankings(q, q if same else r, same, distance)]
        assert a.indices.tolist() == want
        assert a.higher_is_closer == (distance == "cosine")


def test_knn_excludes_self_by_index_not_value():
    x = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.6, 0.8]], dtype=np.float32)
    for backend in ["torch", "faiss"] if faiss_available() else ["torch"]:
        res = knn(x, None, 3, backend=backend)
        assert res.indices[0, 0] == 1 and res.indices[1, 0] == 0  # the duplicate, not itself
        assert all(i not in row for i, row in enumerate(res.indices.tolist()))


def test_knn_caps_k_and_validates():
    x = np.eye(3, dtype=np.float32)
    assert knn(x, None, 10).k == 2
    with pytest.raises(ConfigError):
        knn(x, None, 0)
    with pytest.raises(ConfigError):
        knn(x, None, 1, backend="annoy")
    with pytest.raises(ShapeError):
        knn(x, np.ones((2, 4), dtype=np.float32), 1)
    with pytest.raises(DataError):
        knn(x[:1], None, 1)


# -- metrics against the references ---------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_metrics_with_ties_and_singletons(backend):
    x, y = tied_data()
    got = evaluate(x, y, metrics=ALL_RETRIEVAL, distance=DOT, backend="torch")
    want = ref_metrics(x, y, distance="dot")
    _compare(got, want)
    assert got["num_queries_without_positive"] >= 5  # the five singletons, maybe more
    assert got["num_queries"] == len(y)
    if backend == "faiss":  # same numbers where no two references tie exactly
        rng = np.random.default_rng(5)
        xc = rng.normal(size=(300, 8)).astype(np.float32)
        yc = rng.integers(0, 30, size=300)
        a = evaluate(xc, yc, metrics=ALL_RETRIEVAL, backend="faiss")
        b = evaluate(xc, yc, metrics=ALL_RETRIEVAL, backend="torch")
        assert a == b
        _compare(a, ref_metrics(xc, yc))


def test_metrics_query_not_reference():
    rng = np.random.default_rng(7)
    q = rng.normal(size=(150, 6)).astype(np.float32)
    ql = rng.integers(0, 12, size=150)
    r = rng.normal(size=(260, 6)).astype(np.float32)
    rl = rng.integers(0, 10, size=260)  # classes 10 and 11 have no reference: R = 0
    got = evaluate(q, ql, r, rl, metrics=ALL_RETRIEVAL, memory_budget=2**20)
    want = ref_metrics(q, ql, r, rl)
    _compare(got, want)
    assert got["num_queries_without_positive"] == int(np.isin(ql, [10, 11]).sum()) > 0


def test_euclidean_metrics_match_reference():
    rng = np.random.default_rng(11)
    x = rng.normal(size=(200, 5)).astype(np.float32)
    y = rng.integers(0, 15, size=200)
    _compare(evaluate(x, y, metrics=ALL_RETRIEVAL, distance="euclidean"),
             ref_metrics(x, y, distance="euclidean"))


def test_blocking_does_not_change_results():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(900, 8)).astype(np.float32)
    y = rng.integers(0, 40, size=900)
    small = evaluate(x, y, metrics=ALL_RETRIEVAL, backend="torch", memory_budget=2**20)
    large = evaluate(x, y, metrics=ALL_RETRIEVAL, backend="torch", memory_budget=2**30)
    assert small == large


def test_all_queries_without_positive():
    x = np.eye(4, dtype=np.float32)
    res = evaluate(x, [0, 1, 2, 3])
    assert res["num_queries_without_positive"] == 4
    assert math.isnan(res["map_at_r"])


def test_per_query_and_per_class():
    x, y = tied_data(seed=4)
    scores, r_q = per_query(x, y, metrics=["map_at_r", "precision_at_1"], distance=DOT)
    assert np.isnan(scores["map_at_r"][r_q == 0]).all()
    assert np.nanmean(scores["map_at_r"]) == pytest.approx(
        evaluate(x, y, metrics=["map_at_r"], distance=DOT)["map_at_r"], abs=1e-12
    )
    table = per_class(x, y, distance=DOT)
    for c, row in table.items():
        sel = (y == c) & (r_q > 0)
        assert row["num_queries"] == int((y == c).sum())
        if sel.any():
            assert row["map_at_r"] == pytest.approx(scores["map_at_r"][sel].mean(), abs=1e-12)
        else:
            assert math.isnan(row["map_at_r"])


def test_default_metrics_and_keys():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 4)).astype(np.float32)
    y = np.repeat(np.arange(6), 10)
    res = evaluate(torch.from_numpy(x), torch.from_numpy(y), k_values=(1, 5))
    assert list(res) == ["precision_at_1", "recall_at_1", "recall_at_5", "r_precision",
                         "map_at_r", "num_queries", "num_queries_without_positive"]
    assert all(0.0 <= res[k] <= 1.0 for k in list(res)[:5])


def test_input_errors():
    x = np.ones((4, 3), dtype=np.float32)
    bad = x.copy()
    bad[2, 1] = np.nan
    with pytest.raises(NonFiniteError, match="1 row"):
        evaluate(bad, [0, 0, 1, 1])
    inf = x.copy()
    inf[0, 0] = np.inf
    with pytest.raises(NonFiniteError):
        evaluate(x, [0, 0, 1, 1], inf, [0, 0, 1, 1])
    with pytest.raises(ShapeError):
        evaluate(x, [0, 1])
    with pytest.raises(ShapeError):
        evaluate(x[0], [0])
    with pytest.raises(ShapeError):
        evaluate(x, [0, 0, 1, 1], x)
    with pytest.raises(ShapeError):
        evaluate(x, [0.5, 0, 1, 1])
    with pytest.raises(ConfigError, match="unknown metric"):
        evaluate(x, [0, 0, 1, 1], metrics=["accuracy"])
    for name in ("recall_at_0", "precision_at_0", "precision_at_01"):  # Recall@0 read 0.0, P@0 NaN
        with pytest.raises(ConfigError, match=f"unknown metric '{name}'.*K >= 1"):
            evaluate(x, [0, 0, 1, 1], metrics=[name])
    with pytest.raises(ConfigError):
        evaluate(x, [0, 0, 1, 1], distance="manhattan")
    with pytest.raises(ConfigError):
        evaluate(x, [0, 0, 1, 1], memory_budget=10)


# -- full-ranking MAP without sorting (issue 11.27) ------------------------------------------------
@pytest.fixture(params=["small", "numba"])
def map_path(request, monkeypatch):
    """Full-ranking MAP through the small-input path (float64 scores, a sort) or the no-sort
    numba path that larger inputs take."""
    if request.param == "numba":
        import importlib

        monkeypatch.setattr(importlib.import_module("dmlkit.metrics.evaluate"), "SMALL_SEARCH_PAIRS", 0)
    return request.param


@pytest.mark.parametrize("distance", ["cosine", "euclidean", "dot"])
@pytest.mark.parametrize("same", [True, False])
def test_full_map_matches_reference_with_row_groups_and_small_tiles(distance, same, monkeypatch, map_path):
    import dmlkit.metrics.average_precision as ap_module

    rng = np.random.default_rng(13)
    q = rng.normal(size=(260, 6)).astype(np.float32)
    ql = rng.integers(0, 14, size=260)
    r = None if same else rng.normal(size=(300, 6)).astype(np.float32)
    rl = None if same else rng.integers(0, 16, size=300)
    dist = DOT if distance == "dot" else distance
    want = ref_metrics(q, ql, r, rl, distance=distance)["map"]
    got = evaluate(q, ql, r, rl, metrics=["map"], distance=dist, memory_budget=2**20)["map"]
    assert got == pytest.approx(want, abs=1e-12)
    # state for only ~20 rows at a time: row groups, each against every reference tile
    monkeypatch.setattr(ap_module, "_STATE_BYTES", 2**20 // 2 // 400)
    grouped = evaluate(q, ql, r, rl, metrics=["map"], distance=dist, memory_budget=2**20)["map"]
    assert grouped == pytest.approx(want, abs=1e-12)
    # the sort-based path (other devices and distances) agrees
    torch_path = per_query(q, ql, r, rl, metrics=["map"], distance=dist)[0]["map"]
    assert np.nanmean(torch_path) == pytest.approx(want, abs=1e-12)


def test_full_map_orders_float32_near_ties_by_float64(map_path):
    """References whose inner products with the query differ far below float32 rounding (one
    ulp in one coordinate of d = 256), alternately positive and negative: the float32 tiles
    cannot order them, the float64 comparison does - so ``map`` is the float64 ranking's AP on
    any CPU and BLAS."""
    rng = np.random.default_rng(3)
    d, pairs = 256, 40
    q = rng.normal(size=(1, d)).astype(np.float32)
    base = rng.normal(size=(pairs, d)).astype(np.float32)
    twin = base.copy()
    coord = rng.integers(0, d, size=pairs)
    twin[np.arange(pairs), coord] = np.nextafter(base[np.arange(pairs), coord], np.float32(np.inf))
    refs = np.concatenate([base, twin])
    labels = np.concatenate([np.arange(pairs) % 2, 1 - np.arange(pairs) % 2])  # twins differ
    got = evaluate(q, [1], refs, labels, metrics=["map"], distance=DOT)["map"]
    want = ref_metrics(q, np.array([1]), refs, labels, distance="dot")["map"]
    assert got == pytest.approx(want, abs=1e-12)


def test_closeness_tolerance_bounds_float32_inner_products():
    from dmlkit.metrics.average_precision import closeness_tolerance

    rng = np.random.default_rng(0)
    for d in (3, 64, 700):
        a = rng.normal(size=(200, d)).astype(np.float32)
        b = np.abs(rng.normal(size=(200, d))).astype(np.float32)  # same-sign sums: the worst case
        a = np.abs(a)
        err = np.abs((torch.from_numpy(a) @ torch.from_numpy(b).T).double().numpy()
                     - a.astype(np.float64) @ b.astype(np.float64).T)
        na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
        assert (err <= closeness_tolerance("ip", d, na.max(), nb.max())).all()
        assert err.max() > 0 or d < 8  # the check is not vacuous


def clustered_with_ties(n: int = 3000, d: int = 32, classes: int = 60, seed: int = 0):
    """Clustered unit vectors with duplicated rows (exact ties) and near-duplicates (ties
    within float32 rounding), the cases where devices could order references differently."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, d, generator=g)
    labels = torch.randint(0, classes, (n,), generator=g)
    x = centres[labels] + 1.5 * torch.randn(n, d, generator=g)
    x[100:150] = x[:50]  # exact duplicates, some of another class
    labels[100:125] = (labels[:25] + 1) % classes
    x[200:250] = x[300:350] * (1 + 1e-7)  # the same direction within float32 rounding
    return torch.nn.functional.normalize(x, dim=1), labels


@pytest.mark.parametrize("distance", ["cosine", "euclidean", "dot"])
@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_metrics_do_not_depend_on_the_summation_order(distance, backend, monkeypatch):
    """Permuting the embedding dimensions permutes every float32 sum (the norms' and the
    products'), as another BLAS, thread count or a GPU would: with exact and near-duplicate
    references of other classes, every retrieval metric stays the same to the last bit
    (rows normalised in float64, near-ties and ``map`` ranked in float64). ``map`` takes the
    compiled kernel with the numba backend and the float64 sort of the GPU with torch."""
    if backend == "torch":
        monkeypatch.setattr(importlib.import_module("dmlkit.metrics.evaluate"), "SMALL_SEARCH_PAIRS", 2**40)
    x, y = clustered_with_ties(n=2500)
    metrics = ["precision_at_1", "recall_at_k", "r_precision", "map_at_r", "map"]
    expected = evaluate(x, y, metrics=metrics, distance=distance, backend=backend, k_values=(1, 5))
    for seed in range(2):
        perm = torch.randperm(x.shape[1], generator=torch.Generator().manual_seed(seed))
        got = evaluate(x[:, perm].contiguous(), y, metrics=metrics, distance=distance, backend=backend,
                       k_values=(1, 5))
        assert got == expected, (distance, backend, seed)
