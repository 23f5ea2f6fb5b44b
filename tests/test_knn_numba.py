"""The numba kNN backend: packed keys, reservoir selection, bfloat16 prefilter, guessed thresholds."""

from __future__ import annotations

import importlib
import tracemalloc

import numpy as np
import pytest
import torch

from dmlkit.metrics import _kernels, evaluate, knn
from test_metrics import (
    ALL_RETRIEVAL,
    DOT,
    _compare,
    ref_closeness,
    ref_metrics,
    ref_rankings,
    tied_data,
)

knn_module = importlib.import_module("dmlkit.metrics.knn")
tiles_module = importlib.import_module("dmlkit.metrics._tiles")


# -- keys -----------------------------------------------------------------------------------------
def test_keys_order_by_value_then_smaller_index():
    values = np.array([-np.inf, -3.5, -1e-30, -0.0, 0.0, 1e-30, 0.25, 0.25, 7.0, np.inf], np.float32)
    index = np.array([0, 4, 9, 2, 1, 3, 8, 5, 6, 7])
    keys = np.array([_kernels.pack_keys(values[i : i + 1], int(index[i]))[0] for i in range(len(values))])
    want = sorted(range(len(values)), key=lambda i: (values[i], -index[i]))  # -0.0 == 0.0
    assert list(np.argsort(keys, kind="stable")) == want
    np.testing.assert_array_equal(_kernels.unpack_values(keys), values + np.float32(0.0))
    assert _kernels.LOWEST_KEY <= keys.min()


def test_select_rows_keeps_the_k_largest():
    rng = np.random.default_rng(0)
    for k, n in [(1, 1), (1, 9), (5, 5), (5, 40), (37, 74), (100, 150)]:
        buf = rng.permutation(np.arange(-500, 500, dtype=np.int64))[: 2 * n].reshape(2, n).copy()
        want = np.sort(buf, axis=1)[:, -k:]
        _kernels.select_rows(buf, np.array([n, n]), k)
        np.testing.assert_array_equal(np.sort(buf[:, :k], axis=1), want)


# -- the backend against torch and the slow reference ----------------------------------------------
@pytest.mark.parametrize("distance", ["cosine", "euclidean", "dot"])
@pytest.mark.parametrize("same", [True, False])
@pytest.mark.parametrize("k", [1, 12, 399])
def test_numba_matches_torch(distance, same, k):
    rng = np.random.default_rng(11)
    q = rng.normal(size=(400, 16)).astype(np.float32)
    r = None if same else rng.normal(size=(450, 16)).astype(np.float32)
    a = knn(q, r, k, distance=distance, backend="torch")
    b = knn(q, r, k, distance=distance, backend="numba", memory_budget=2**20)  # tiles of 362 rows
    torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)
    if k < 399:  # the same ranks, up to references within float32 rounding of each other
        assert_same_up_to_near_ties(q, r, same, distance, a.indices, b.indices)
    else:  # everything ranked: float32 near-ties may order differently between tilings
        assert torch.equal(a.indices.sort(1).values, b.indices.sort(1).values)
    if same:
        assert not (b.indices == torch.arange(400)[:, None]).any()


def assert_same_up_to_near_ties(q, r, same, distance, a, b, tol=1e-6):
    """Two kNN results rank the same references up to float32 near-ties: at every rank the
    float64 closeness of both neighbours agrees within ``tol`` (two float32 BLAS calls with other
    tile shapes - or another CPU - may order references closer than their rounding either way),
    and neither holds a duplicate or, in a self-search, the query itself."""
    c = ref_closeness(q, q if r is None else r, distance)
    a, b = np.asarray(a), np.asarray(b)
    rows = np.arange(a.shape[0])[:, None]
    np.testing.assert_allclose(c[rows, a], c[rows, b], rtol=0, atol=tol)
    for idx in (a, b):
        assert all(len(set(row)) == len(row) for row in idx.tolist())
        if same:
            assert not (idx == np.arange(idx.shape[0])[:, None]).any()
    mismatch = float((a != b).mean())
    assert mismatch < 0.01, mismatch  # near-ties are rare: most ranks agree exactly


def float32_rankings(q, r, same, distance):
    """The numba backend's ranking with bfloat16 tiles: float64 scores rounded once to float32,
    ties by index."""
    c = ref_closeness(q, r, distance).astype(np.float32)
    return [
        sorted((j for j in range(r.shape[0]) if not (same and j == i)), key=lambda j: (-c[i, j], j))
        for i in range(q.shape[0])
    ]


def test_numba_exact_ties_by_index():
    x, _ = tied_data()  # small integer vectors: every dot product exact, many exact ties
    res = knn(x, None, 7, distance=DOT, backend="numba", memory_budget=2**20)
    assert res.indices.tolist() == [r[:7] for r in ref_rankings(x, x, True, "dot")]


def test_numba_excludes_self_by_index_not_value():
    x = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.6, 0.8]], dtype=np.float32)
    res = knn(x, None, 3, backend="numba")
    assert res.indices[0, 0] == 1 and res.indices[1, 0] == 0
    assert all(i not in row for i, row in enumerate(res.indices.tolist()))


def test_numba_metrics_match_reference():
    x, y = tied_data()
    _compare(evaluate(x, y, metrics=ALL_RETRIEVAL, distance=DOT, backend="numba"), ref_metrics(x, y, distance="dot"))


def test_numba_rejects_other_distances_and_devices():
    from dmlkit.exceptions import ConfigError

    with pytest.raises(ConfigError, match="numba backend"):
        knn(np.eye(4, dtype=np.float32), None, 1, distance="snr", backend="numba")


# -- bfloat16 prefilter ----------------------------------------------------------------------------
@pytest.fixture
def force_bf16(monkeypatch):
    monkeypatch.setattr(knn_module, "_BF16_MIN_PAIRS", 0)
    monkeypatch.setattr(knn_module, "_bf16_is_faster", lambda d: True)


@pytest.mark.parametrize("distance", ["cosine", "dot"])
@pytest.mark.parametrize("same", [True, False])
def test_bf16_prefilter_is_exact(force_bf16, distance, same):
    rng = np.random.default_rng(5)
    q = rng.normal(size=(600, 24)).astype(np.float32)
    q *= rng.uniform(0.1, 10.0, size=(600, 1)).astype(np.float32)  # norms vary: per-tile bounds
    r = None if same else (rng.normal(size=(500, 24)) * rng.uniform(0.1, 10.0, (500, 1))).astype(np.float32)
    want = float32_rankings(q, q if same else r, same, distance)
    dist = DOT if distance == "dot" else distance
    for k in (1, 30):
        a = knn(q, r, k, distance=dist, backend="torch")
        b = knn(q, r, k, distance=dist, backend="numba", memory_budget=2**20)
        assert b.indices.tolist() == [row[:k] for row in want]
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)


def test_bf16_prefilter_keeps_entries_its_rounding_pushed_below_the_threshold(force_bf16):
    """Similarities packed in [0.995, 0.998), where bfloat16 rounds them all to 0.99609: the
    threshold after the first tile is above that, so a slack smaller than the error bound would
    drop the true neighbours of the second tile."""
    rng = np.random.default_rng(4)
    cos = rng.uniform(0.995, 0.998, size=700)
    ref = np.zeros((700, 8), np.float32)
    ref[:, 0], ref[:, 1] = cos, np.sqrt(1 - cos**2)
    q = np.eye(8, dtype=np.float32)[:1].repeat(3, 0)
    q[1, 2], q[2, 3] = 1e-3, -1e-3
    res = knn(q, ref, 30, distance="cosine", backend="numba", memory_budget=2**20)
    assert res.indices.tolist() == [row[:30] for row in float32_rankings(q, ref, False, "cosine")]


def test_bf16_values_are_rounded_float64_scores(force_bf16):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(300, 40)).astype(np.float32)
    res = knn(x, None, 5, distance=DOT, backend="numba")
    want = np.take_along_axis(x.astype(np.float64) @ x.T.astype(np.float64), res.indices.numpy(), 1)
    np.testing.assert_array_equal(res.values.numpy(), want.astype(np.float32))


def test_bf16_used_only_for_inner_products(force_bf16, monkeypatch):
    seen = []
    real = knn_module._Tiles.__init__

    def spy(self, scorer, q, ref, bf16):
        seen.append(bf16)
        real(self, scorer, q, ref, bf16)

    monkeypatch.setattr(knn_module._Tiles, "__init__", spy)
    x = np.random.default_rng(0).normal(size=(50, 4)).astype(np.float32)
    knn(x, None, 3, distance="cosine", backend="numba")
    knn(x, None, 3, distance="euclidean", backend="numba")
    assert seen == [True, False]


# -- guessed thresholds ----------------------------------------------------------------------------
@pytest.mark.parametrize("bf16", [False, True])
def test_guessed_thresholds_and_fallback_rows_stay_exact(monkeypatch, bf16):
    if bf16:
        monkeypatch.setattr(knn_module, "_BF16_MIN_PAIRS", 0)
        monkeypatch.setattr(knn_module, "_bf16_is_faster", lambda d: True)
    monkeypatch.setattr(knn_module, "_GUESS_SAMPLE", 0.25)
    monkeypatch.setattr(knn_module, "_GUESS_MIN_EXPECTED", 0.0)
    real = knn_module._guess_thresholds
    calls = []

    def too_high_for_some(*args, **kwargs):
        guess = real(*args, **kwargs)
        calls.append(guess is not None)
        guess[::7] = 0.999  # above these rows' k-th closeness: they must be redone
        return guess

    monkeypatch.setattr(knn_module, "_guess_thresholds", too_high_for_some)
    redone = []
    real_rows = knn_module._knn_rows_torch

    def count_rows(scorer, q, ref, rows, *args):
        redone.append(rows.numel())
        return real_rows(scorer, q, ref, rows, *args)

    monkeypatch.setattr(knn_module, "_knn_rows_torch", count_rows)
    rng = np.random.default_rng(9)
    for same in (True, False):
        q = rng.normal(size=(700, 12)).astype(np.float32)
        r = None if same else rng.normal(size=(650, 12)).astype(np.float32)
        a = knn(q, r, 40, backend="torch")
        b = knn(q, r, 40, backend="numba", memory_budget=2**20)
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)
        if bf16:  # float64-rounded scores against float32 BLAS ones: same sets, near-ties may swap
            assert torch.equal(a.indices.sort(1).values, b.indices.sort(1).values)
        else:  # two float32 tilings: the same up to near-ties (CPU-dependent rounding)
            assert_same_up_to_near_ties(q, r, same, "cosine", a.indices, b.indices)
    assert calls == [True, True] and min(redone) >= 100


def test_fallback_rows_drop_self_when_not_among_closest():
    """With raw dot products a row's own entry is not necessarily its closest."""
    x = np.array([[0.1, 0.0], [1.0, 0.0], [2.0, 0.0], [3.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    scorer = knn_module._Scorer(DOT)
    q = torch.from_numpy(x)
    v, i = knn_module._knn_rows_torch(scorer, q, q, torch.tensor([0, 3]), 2, True, 2**20)
    assert i.tolist() == [[3, 2], [2, 1]]
    v, i = knn_module._knn_rows_torch(scorer, q, q, torch.tensor([4]), 4, True, 2**20)
    assert i.tolist() == [[0, 1, 2, 3]]


def test_bf16_needs_its_error_bound_to_hold(monkeypatch):
    """The one-off check refuses bfloat16 tiles whose error exceeds the assumed bound."""
    probe = knn_module._bf16_is_faster.__wrapped__  # uncached
    monkeypatch.setattr(tiles_module, "_bf16_relative_bound", lambda d: 1e-9)
    assert probe(64) is False


# -- the one-off bfloat16 check: other CPUs and BLAS libraries (issue 11.1) -------------------------
def _bf16_accumulating_mm(a, b, out=None):
    """A BLAS that accumulates bfloat16 products in bfloat16 (rounds every partial sum)."""
    acc = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32)
    for t in range(a.shape[1]):
        acc = (acc + a[:, t : t + 1].float() * b[:, t].float()[None, :]).to(torch.bfloat16).float()
    res = acc.to(torch.bfloat16)
    if out is not None:
        out.copy_(res)
        return out
    return res


def _search_with_probe(monkeypatch, speedup, mm=None):
    """A large-enough search with the real (uncached) probe deciding, its speed measurement
    replaced; returns (was bfloat16 used, numba result, torch result, data)."""
    monkeypatch.setattr(knn_module, "_BF16_MIN_PAIRS", 0)
    monkeypatch.setattr(knn_module, "_bf16_is_faster", knn_module._bf16_is_faster.__wrapped__)
    monkeypatch.setattr(tiles_module, "_bf16_speedup", lambda d: speedup)
    if mm is not None:
        monkeypatch.setattr(tiles_module, "_bf16_mm", mm)
    seen = []
    real = knn_module._Tiles.__init__

    def spy(self, scorer, q, ref, bf16):
        seen.append(bf16)
        real(self, scorer, q, ref, bf16)

    monkeypatch.setattr(knn_module._Tiles, "__init__", spy)
    rng = np.random.default_rng(21)
    x = rng.normal(size=(500, 32)).astype(np.float32)
    got = knn(x, None, 10, backend="numba", memory_budget=2**20)
    want = knn(x, None, 10, backend="torch")
    return seen, got, want, x


def test_cpu_without_native_bf16_uses_float32_tiles(monkeypatch):
    """No bfloat16 dot-product instructions: the timing finds bf16 slower, tiles stay float32."""
    seen, got, want, x = _search_with_probe(monkeypatch, speedup=0.3)
    assert seen == [False]
    assert_same_up_to_near_ties(x, None, True, "cosine", got.indices, want.indices)
    torch.testing.assert_close(got.values, want.values, rtol=1e-5, atol=1e-5)


def test_blas_accumulating_in_bf16_is_refused_and_results_stay_exact(monkeypatch):
    """A fast bfloat16 BLAS that rounds its partial sums to bfloat16 breaks the error bound on
    near-parallel rows; the one-off check sees it and the search stays float32 and exact."""
    assert tiles_module._bf16_within_bound(64)  # this machine's BLAS: within the bound
    monkeypatch.setattr(tiles_module, "_bf16_mm", _bf16_accumulating_mm)
    assert not tiles_module._bf16_within_bound(64)
    seen, got, want, x = _search_with_probe(monkeypatch, speedup=5.0, mm=_bf16_accumulating_mm)
    assert seen == [False]
    assert_same_up_to_near_ties(x, None, True, "cosine", got.indices, want.indices)


def test_fast_accurate_bf16_is_used_and_exact(monkeypatch):
    """Where bfloat16 is fast and within its bound (AVX512-BF16, AMX), it is used; the ranking
    is then that of the float64 scores rounded once, on any CPU."""
    seen, got, _, x = _search_with_probe(monkeypatch, speedup=5.0)
    assert seen == [True]
    want = float32_rankings(x, x, True, "cosine")
    assert got.indices.tolist() == [row[:10] for row in want]


def test_bf16_probe_errors_mean_float32(monkeypatch):
    def broken(a, b, out=None):
        raise RuntimeError("no bfloat16 gemm on this CPU")

    seen, got, want, x = _search_with_probe(monkeypatch, speedup=5.0, mm=broken)
    assert seen == [False]
    torch.testing.assert_close(got.values, want.values, rtol=1e-5, atol=1e-5)


# -- memory ------------------------------------------------------------------------------------------
def test_many_queries_against_separate_references_keep_their_keys_within_the_budget():
    """Each query row holds max(2k, k + 32) int64 keys until its last tile: 20k queries took 5.3
    MB of them at a 1 MiB budget; in groups they fit half of it (at least 1024 rows)."""
    rng = np.random.default_rng(0)
    q = rng.normal(size=(20_000, 8)).astype(np.float32)
    r = rng.normal(size=(512, 8)).astype(np.float32)
    whole = knn(q, r, 1, backend="numba")
    tracemalloc.start()
    try:
        grouped = knn(q, r, 1, backend="numba", memory_budget=1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2.5 * 2**20, peak  # result 0.24 MB, keys 0.5 MB, tiles; was 6.1 MB
    assert torch.equal(grouped.indices, whole.indices) and torch.equal(grouped.values, whole.values)
