"""Full-ranking MAP from each positive's rank (issue 11.27): the no-sort numba path against a
brute-force float64 ranking written from the definition, with ties, odd shapes and tables."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from dmlkit.distances import DotProductSimilarity, LpDistance
from dmlkit.metrics import per_query

#: raw inner product (no normalisation): the float64 reference sees the same rows
DOT = DotProductSimilarity(normalize_embeddings=False)


def brute_force_ap(q: np.ndarray, ql: np.ndarray, r: np.ndarray | None, rl: np.ndarray | None,
                   euclidean: bool = False) -> np.ndarray:
    """Per-query AP of the float64 ranking (closeness descending, ties by the smaller index;
    the query itself left out of a self-search); NaN without a positive."""
    same = r is None
    r, rl = (q, ql) if same else (r, rl)
    q64, r64 = q.astype(np.float64), r.astype(np.float64)
    if euclidean:
        close = -(((q64[:, None, :] - r64[None, :, :]) ** 2).sum(-1))
    else:
        close = q64 @ r64.T
    out = np.full(q.shape[0], np.nan)
    idx = np.arange(r.shape[0])
    for i in range(q.shape[0]):
        keep = idx != i if same else np.ones(r.shape[0], bool)
        order = idx[keep][np.lexsort((idx[keep], -close[i, keep]))]
        rel = rl[order] == ql[i]
        if rel.any():
            hits = np.cumsum(rel)
            out[i] = (hits[rel] / (np.flatnonzero(rel) + 1)).sum() / rel.sum()
    return out


@pytest.fixture
def numba_path(monkeypatch):
    """Send every input, however small, through the no-sort numba path."""
    monkeypatch.setattr(importlib.import_module("dmlkit.metrics.evaluate"), "SMALL_SEARCH_PAIRS", 0)


def _map(q, ql, r=None, rl=None, distance=DOT, **kw) -> np.ndarray:
    return per_query(q, ql, r, rl, metrics=["map"], distance=distance, **kw)[0]["map"]


def _map_equal_to_brute_force(q, ql, r=None, rl=None) -> np.ndarray:
    """``map`` per query, asserted equal to the float64 ranking's AP (NaN where no positive)."""
    got = _map(q, ql, r, rl)
    want = brute_force_ap(q, ql, r, rl)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    return got


def _tied(n: int, d: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Small integer vectors: inner products exact in float32 and full of exact ties."""
    rng = np.random.default_rng(seed)
    return rng.integers(-2, 3, size=(n, d)).astype(np.float32), rng.integers(0, classes, size=n)


@pytest.mark.parametrize("same", [True, False])
def test_exact_ties_are_ranked_by_index(numba_path, same):
    q, ql = _tied(300, 3, 12, 0)
    r, rl = (None, None) if same else _tied(400, 3, 14, 1)
    _map_equal_to_brute_force(q, ql, r, rl)
    # the data has exact ties between a positive and a negative of the same query
    rr, rrl = (q, ql) if same else (r, rl)
    close = q.astype(np.float64) @ rr.astype(np.float64).T
    tie = [(close[i, rrl == ql[i]][:, None] == close[i, rrl != ql[i]][None, :]).any()
           for i in range(q.shape[0])]
    assert sum(tie) > 50


@pytest.mark.parametrize("distance", [DOT, LpDistance(normalize_embeddings=False)])
def test_numba_path_equals_sort_path_on_ties(numba_path, monkeypatch, distance):
    """Integer rows: every float64 closeness is exact in both paths' formulas, so their
    rankings, ties by index included, and APs are identical."""
    q, ql = _tied(250, 4, 10, 2)
    fast = _map(q, ql, distance=distance)
    monkeypatch.setattr(importlib.import_module("dmlkit.metrics.evaluate"), "SMALL_SEARCH_PAIRS", 2**40)
    np.testing.assert_allclose(fast, _map(q, ql, distance=distance), rtol=0, atol=1e-12)
    want = brute_force_ap(q, ql, None, None, euclidean=isinstance(distance, LpDistance))
    np.testing.assert_allclose(fast, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("distance", [DOT, LpDistance(normalize_embeddings=False)])
def test_symmetric_tiles_count_columns_without_transposing(numba_path, monkeypatch, distance):
    """64-row tiles on a 300-row self-search: every off-diagonal tile is counted once by rows and
    once by its columns (8 x 8 blocks transposed in registers; the last block of 44 = 5 x 8 + 4
    columns has its last 4 columns counted one at a time, and its 44 rows leave 4 rows past the
    8 x 8 blocks), with exact ties; the same values as one tile and as the brute force."""
    import dmlkit.metrics.average_precision as ap

    q, ql = _tied(300, 4, 9, 3)
    one_tile = _map(q, ql, distance=distance)
    monkeypatch.setattr(ap, "_MAX_TILE", 64)
    tiled = _map(q, ql, distance=distance)
    np.testing.assert_array_equal(tiled, one_tile)
    want = brute_force_ap(q, ql, None, None, euclidean=isinstance(distance, LpDistance))
    np.testing.assert_allclose(tiled, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("same", [True, False])
def test_row_groups_scan_wide_column_blocks(numba_path, monkeypatch, same):
    """Row groups (state for ~40 rows at a time) scan 64-row tiles as wide as the tile half of a
    1 MiB budget allows (2048 columns on one worker, 1024 on two, 128 on sixteen), so 2,500
    references take two or more column blocks, the last a short one; the same values as the
    brute force, exact ties included."""
    import dmlkit.metrics.average_precision as ap

    q, ql = _tied(2500 if same else 200, 4, 20, 5)
    r, rl = (None, None) if same else _tied(2500, 4, 22, 6)
    monkeypatch.setattr(ap, "_MAX_TILE", 64)
    monkeypatch.setattr(ap, "_STATE_BYTES", 2**20 // 2 // 40 // 120)
    widths = []
    scan = ap._Group.scan

    def spy(self, tiles, tile, wide, workers, nq, m):
        widths.append((tile, wide, m))
        return scan(self, tiles, tile, wide, workers, nq, m)

    monkeypatch.setattr(ap._Group, "scan", spy)
    got = _map(q, ql, r, rl, memory_budget=2**20)
    assert len(widths) > 3 and all(tile == 64 and tile < wide < m for tile, wide, m in widths)
    want = brute_force_ap(q, ql, r, rl)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("buckets", [1, 2, 4096])
def test_bucket_table_is_only_an_accelerator(numba_path, monkeypatch, buckets):
    """One bucket (every value scanned from the first positive), two, or 4096 (many
    positives' bands split across buckets): identical per-query values."""
    import dmlkit.metrics.average_precision as ap

    rng = np.random.default_rng(4)
    q = rng.normal(size=(220, 8)).astype(np.float32)
    ql = rng.integers(0, 6, size=220)
    want = brute_force_ap(q, ql, None, None)
    monkeypatch.setattr(ap, "_MIN_BUCKETS", buckets)
    monkeypatch.setattr(ap, "_MAX_BUCKETS", buckets)
    np.testing.assert_allclose(_map(q, ql), want, rtol=0, atol=1e-12)


def test_single_positive_equal_positives_and_queries_without_positive(numba_path):
    rng = np.random.default_rng(5)
    r = rng.normal(size=(60, 5)).astype(np.float32)
    rl = np.arange(60) % 20
    r[rl == 3] = r[rl == 3][0]  # class 3: three identical rows (equal closeness, one band)
    rl[rl == 7] = [7, 100, 101]  # class 7 keeps one member: a single positive
    q = np.concatenate([r[:25] + 0.01, rng.normal(size=(3, 5)).astype(np.float32)])
    ql = np.concatenate([rl[:25], [7, 3, 555]])  # 555: no positive at all
    got = _map(q, ql, r, rl)
    want = brute_force_ap(q, ql, r, rl)
    assert np.isnan(got[-1]) and np.isnan(want[-1])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("scale", [1e-12, 1e18])
def test_tiny_and_huge_unnormalised_scales(numba_path, scale):
    """Closeness values near float32's limits: bucket scales are clamped, bounds stay exact."""
    rng = np.random.default_rng(6)
    q = (rng.normal(size=(80, 6)) * scale).astype(np.float32)
    ql = rng.integers(0, 5, size=80)
    np.testing.assert_allclose(_map(q, ql), brute_force_ap(q, ql, None, None), rtol=0, atol=1e-12)


def test_wide_table_rows_with_more_than_32k_positives(numba_path):
    """R >= 2^15 positives per query: int32 bucket tables instead of int16."""
    rng = np.random.default_rng(7)
    m = 33_500
    r = rng.normal(size=(m, 4)).astype(np.float32)
    rl = (rng.random(m) < 0.99).astype(np.int64)  # ~33,165 references of class 1
    assert (rl == 1).sum() >= 2**15
    q = rng.normal(size=(2, 4)).astype(np.float32)
    ql = np.array([1, 0])
    np.testing.assert_allclose(_map(q, ql, r, rl), brute_force_ap(q, ql, r, rl), rtol=0, atol=1e-12)


@pytest.mark.parametrize("same", [True, False])
def test_state_without_stored_closeness_recomputes_it(numba_path, monkeypatch, same):
    """Where leaving out the positives' float64 closeness lets the state fit one group, it is
    left out and the exact comparison recomputes it: the same values, exact ties included."""
    import dmlkit.metrics.average_precision as ap

    q, ql = _tied(300, 3, 12, 8)
    r, rl = (None, None) if same else _tied(400, 3, 14, 9)
    kept = []
    memory = ap._GroupMemory

    def spy(*args):
        kept.append(args[-1])
        return memory(*args)

    monkeypatch.setattr(ap, "_GroupMemory", spy)
    monkeypatch.setattr(ap, "_VALUE_BYTES", 2**20)  # with it, no group of rows would fit
    got = _map(q, ql, r, rl)
    assert kept == [False]
    want = brute_force_ap(q, ql, r, rl)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    monkeypatch.setattr(ap, "_VALUE_BYTES", 8)
    np.testing.assert_array_equal(_map(q, ql, r, rl), got)
    assert kept == [False, True]


@pytest.mark.parametrize("same", [True, False])
def test_held_exact_comparisons_flush_when_full(numba_path, monkeypatch, same):
    """Entries within float32 rounding of a positive are held and compared in float64 in
    reference order; a full buffer is flushed mid-tile. With room for 5, every tie (hundreds
    here) passes through full flushes: the same AP as the float64 ranking."""
    k = _kernels("_ap_kernels")
    scratch = k.deferred_scratch
    monkeypatch.setattr(k, "deferred_scratch", lambda side: k.Deferred(*(
        a if name in ("count", "bins") else a[:5] for name, a in zip(k.Deferred._fields, scratch(side)))))
    q, ql = _tied(300, 3, 12, 10)
    r, rl = (None, None) if same else _tied(400, 3, 14, 11)
    _map_equal_to_brute_force(q, ql, r, rl)


@pytest.mark.parametrize("seed", range(6))
def test_peeling_counts_only_values_certainly_between_two_positives(seed):
    """``_peel_lowest`` drops an entry only when it lies strictly above the band of positive
    ``R-1-k`` and strictly below the lower bound of positive ``R-2-k``, counts it there, and keeps
    every other entry in order (the bands' own values, ties with a bound, an empty interval where
    two bands overlap, the values above the peeled intervals)."""
    from dmlkit.metrics._ap_kernels import _peel_lowest

    rng = np.random.default_rng(seed)
    big_r = (2, 3, 4, 6, 9, 11)[seed]  # from one interval to more than four
    band = np.float32(0.02)
    up = np.sort(rng.random(big_r).astype(np.float32))[::-1].copy()
    if seed % 2:  # the two lowest bands overlap: the lowest interval is empty
        up[-2] = up[-1] + band / 2
    levels = np.concatenate([up, up + band, 1.5 * rng.random(40).astype(np.float32)])
    x = rng.choice(levels, size=int(rng.integers(1, 300))).astype(np.float32)
    x = x[x >= up[-1]]  # the entries a row's compaction keeps
    # whole blocks of eight, then ties with the ends of the peeled intervals in the scalar tail
    ends = [up[-k] for k in range(2, min(big_r, 5) + 1)] + [up[-k] + band for k in range(1, min(big_r, 3) + 1)]
    x = np.concatenate([x[: x.size - x.size % 8], ends[:7]]).astype(np.float32)
    n = x.size
    vals = np.concatenate([x, np.zeros(8, np.float32)])
    refs = np.concatenate([np.arange(n, dtype=np.int32), np.zeros(8, np.int32)])
    cnt = np.zeros(big_r + 1, np.int64)
    # the row's bounds after another row's (a higher one: read past the row, it would show)
    rows_up = np.concatenate([np.float32([2.0]), up])
    left = _peel_lowest(vals, refs, n, rows_up, 1, big_r, band, cnt, 0)
    kept = refs[:left]
    assert np.array_equal(vals[:left], x[kept]) and np.all(np.diff(kept) > 0)
    dropped = np.setdiff1d(np.arange(n), kept)
    e = (x[dropped, None] < up[None, :]).sum(1)  # the positives certainly ranked before each
    assert np.all(x[dropped] > up[np.minimum(e, big_r - 1)] + band)  # certainly after the rest
    assert np.array_equal(cnt, np.bincount(e, minlength=big_r + 1))
    assert dropped.size > 0 or not (seed % 2 == 0 and ((x > up[-1] + band) & (x < up[-2])).any())


def _ap_by_stable_sort(s, ql, rl, r):
    """The definition: each row sorted (descending, ties by index), precision at each positive."""
    import torch

    order = torch.argsort(s, dim=1, descending=True, stable=True)
    rel = (rl[order] == ql[:, None]) & torch.isfinite(s.gather(1, order))
    hits = rel.cumsum(1).to(torch.float64)
    ranks = torch.arange(1, s.shape[1] + 1, dtype=torch.float64)
    return torch.where(rel, hits / ranks, 0.0).sum(1) / r.clamp_min(1).to(torch.float64)


def test_full_ranking_ap_places_references_like_a_stable_sort():
    """The block function of small searches and GPUs (binary search among the sorted positives,
    exact float64 ties settled by index) against a stable sort, on rows with many ties (a few
    integer levels), excluded references (-inf), queries without positives, uneven classes."""
    import torch

    from dmlkit.metrics.retrieval import full_ranking_ap

    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        b, m = int(torch.randint(1, 30, (1,), generator=g)), int(torch.randint(1, 200, (1,), generator=g))
        if trial % 2:
            s = torch.randint(0, int(torch.randint(1, 6, (1,), generator=g)), (b, m), generator=g).double()
        else:
            s = torch.randn(b, m, generator=g, dtype=torch.float64)
        s[torch.rand(b, m, generator=g) < 0.05] = -torch.inf
        classes = int(torch.randint(1, 8, (1,), generator=g))
        ql, rl = torch.randint(0, classes + 1, (b,), generator=g), torch.randint(0, classes, (m,), generator=g)
        r = ((rl[None, :] == ql[:, None]) & torch.isfinite(s)).sum(1)
        expected = _ap_by_stable_sort(s, ql, rl, r)
        torch.testing.assert_close(full_ranking_ap(s, ql, rl, r), expected, rtol=0, atol=1e-12, msg=str(trial))


def test_full_ranking_ap_block_needs_no_tie_runs_without_equal_positives():
    """The GPU block path settles a reference tied with one positive without synchronising, and
    flags exactly the rows whose positives repeat a value (those need the exact tie runs)."""
    import torch

    from dmlkit.metrics.retrieval import full_ranking_ap_block

    g = torch.Generator().manual_seed(1)
    for trial in range(200):
        b, m = int(torch.randint(1, 20, (1,), generator=g)), int(torch.randint(2, 150, (1,), generator=g))
        classes = int(torch.randint(1, 6, (1,), generator=g))
        ql, rl = torch.randint(0, classes, (b,), generator=g), torch.randint(0, classes, (m,), generator=g)
        positive = rl[None, :] == ql[:, None]
        # distinct positives (a permutation of levels); negatives copy positives' values exactly
        s = torch.randperm(b * m, generator=g).double().reshape(b, m)
        copy_from = torch.randint(0, m, (b, m), generator=g)
        copies = (~positive) & positive.gather(1, copy_from) & (torch.rand(b, m, generator=g) < 0.5)
        s = torch.where(copies, s.gather(1, copy_from), s)
        s[(torch.rand(b, m, generator=g) < 0.05) & ~copies] = -torch.inf
        r = (positive & torch.isfinite(s)).sum(1)
        expected = _ap_by_stable_sort(s, ql, rl, r)
        ap, repeated, _ = full_ranking_ap_block(s, ql, rl, r, int(r.max()))
        assert not bool(repeated), trial
        torch.testing.assert_close(ap, expected, rtol=0, atol=1e-12, msg=str(trial))
        # two equal positives in one row: flagged, and the exact path still agrees
        rows, cols = positive.nonzero(as_tuple=True)
        for i in range(b):
            mine = cols[(rows == i) & torch.isfinite(s[i, cols])]
            if mine.numel() >= 2:
                s[i, mine[1]] = s[i, mine[0]]
                ap, repeated, _ = full_ranking_ap_block(s, ql, rl, r, int(r.max()))
                assert bool(repeated), trial
                exact = full_ranking_ap_block(s, ql, rl, r, int(r.max()), tie_runs=True)[0]
                torch.testing.assert_close(exact, _ap_by_stable_sort(s, ql, rl, r), rtol=0, atol=1e-12)
                break


# --- the preparation kernels against independent numpy definitions -------------------------

def _kernels(module: str = "_ap_positives"):
    """A kernel module of ``map``: the preparation (default) or the counting."""
    pytest.importorskip("numba")
    return importlib.import_module(f"dmlkit.metrics.{module}")


def _closeness_rows(seed: int, kind: str, sizes: np.ndarray) -> np.ndarray:
    """Per row, ``sizes[i]`` float64 values of one of several shapes (random, ties, equal,
    one outlier beside a tight cluster, signed zeros, huge, already sorted, ascending)."""
    rng = np.random.default_rng(seed)
    make = {
        "normal": lambda n: rng.normal(0.5, 0.1, n),
        "ties": lambda n: rng.choice(rng.normal(size=4), n),
        "equal": lambda n: np.full(n, 0.25),
        "outlier": lambda n: np.concatenate([[-0.9], 0.5 + rng.random(n - 1) * 1e-4]),
        "zeros": lambda n: rng.choice([0.0, -0.0, 1e-300, -1e-300], n),
        "huge": lambda n: rng.normal(0, 1e30, n),
        "descending": lambda n: np.sort(rng.random(n))[::-1],
        "ascending": lambda n: np.sort(rng.random(n)),
    }[kind]
    return np.concatenate([make(n) if n else np.empty(0) for n in sizes]).astype(np.float64)


_SHAPES = ["normal", "ties", "equal", "outlier", "zeros", "huge", "descending", "ascending"]


@pytest.mark.parametrize("kind", _SHAPES)
def test_sort_positives_is_a_stable_descending_sort(kind):
    k = _kernels()
    rng = np.random.default_rng(7)
    sizes = rng.integers(0, 400, 60)
    sizes[:3] = [0, 1, 2]
    ptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    val = _closeness_rows(1, kind, sizes)
    ref = np.concatenate([np.sort(rng.choice(10**6, n, replace=False)) for n in sizes]).astype(np.int32)
    got_val, got_ref = val.copy(), ref.copy()
    k.sort_positives(ptr, got_val, got_ref)
    for a, b in zip(ptr[:-1], ptr[1:]):
        order = np.lexsort((ref[a:b], -val[a:b]))  # closest first, ties by index
        np.testing.assert_array_equal(got_val[a:b], val[a:b][order])
        np.testing.assert_array_equal(got_ref[a:b], ref[a:b][order])


def _bounds_by_nextafter(val: np.ndarray, tol: float) -> tuple[np.ndarray, np.ndarray]:
    with np.errstate(over="ignore"):
        a, b = val - tol, val + tol
        up, dn = a.astype(np.float32), b.astype(np.float32)
    down = up.astype(np.float64) > a
    up[down] = np.nextafter(up[down], np.float32(-np.inf))
    raise_ = dn.astype(np.float64) < b
    dn[raise_] = np.nextafter(dn[raise_], np.float32(np.inf))
    return up, dn


@pytest.mark.parametrize("tol", [0.0, 1e-46, 7.9e-6, 1e-3])
def test_bounds_round_outwards_to_float32_bit_for_bit(tol):
    k = _kernels()
    rng = np.random.default_rng(2)
    exact32 = rng.normal(size=500).astype(np.float32).astype(np.float64)
    val = np.concatenate([rng.normal(size=5000), rng.normal(size=500) * 1e-40, exact32,
                          [0.0, -0.0, 1e-46, -1e-46, 2.0**-149, -(2.0**-149), 1e-300, -1e-300,
                           3.4e38, -3.4e38, 1e39, -1e39]])
    up, dn = np.empty(val.size, np.float32), np.empty(val.size, np.float32)
    k.bounds(val, tol, up, dn)
    want_up, want_dn = _bounds_by_nextafter(val, tol)
    np.testing.assert_array_equal(up.view(np.int32), want_up.view(np.int32))
    np.testing.assert_array_equal(dn.view(np.int32), want_dn.view(np.int32))


def _tables_by_definition(ptr, up, dn, n_buckets):
    """:func:`build_tables`'s documented table, bucket by bucket in numpy."""
    rows = ptr.size - 1
    lo, scale = np.empty(rows, np.float32), np.empty(rows, np.float32)
    table = np.empty((rows, n_buckets), np.int64)
    b = np.arange(n_buckets, dtype=np.float64)
    for i, (p0, p1) in enumerate(zip(ptr[:-1], ptr[1:])):
        if p1 == p0:
            lo[i], scale[i] = np.inf, 0.0
            continue
        u, w = up[p0:p1].astype(np.float64), dn[p0:p1].astype(np.float64)
        low = u[-1]
        width = w[0] - low
        sc = min(n_buckets / width, 1e30) if width > 0 else 1e30
        lo[i], scale[i] = up[p1 - 1], np.float32(sc)
        inv = 1.0 / np.float64(scale[i])
        upper = np.append(low + (b[:-1] + 1) * (inv * (1.0 + 2.0**-20)), np.inf)
        lower = np.where(b > 0, low + b * (inv * (1.0 - 2.0**-20)), low)
        a = np.searchsorted(-u, -upper, side="left")  # positives with up > upper
        clean = (a < u.size) & (w[np.minimum(a, u.size - 1)] < lower)
        table[i] = np.where(clean, a, -1 - a)
    return lo, scale, table


@pytest.mark.parametrize("kind", _SHAPES)
@pytest.mark.parametrize("n_buckets", [64, 4096])
def test_build_tables_equals_its_definition(kind, n_buckets):
    k = _kernels()
    rng = np.random.default_rng(5)
    sizes = rng.integers(0, 600, 40)
    sizes[:2] = [0, 1]
    ptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    val = _closeness_rows(3, kind, sizes)
    ref = np.concatenate([np.arange(n) for n in sizes]).astype(np.int32)
    k.sort_positives(ptr, val, ref)
    for tol in (0.0, 7.9e-6):
        up, dn = np.empty(val.size, np.float32), np.empty(val.size, np.float32)
        k.bounds(val, tol, up, dn)
        lo, scale = np.empty(sizes.size, np.float32), np.empty(sizes.size, np.float32)
        table = np.empty((sizes.size, n_buckets), np.int16)
        k.build_tables(ptr, up, dn, lo, scale, table)
        want_lo, want_scale, want_table = _tables_by_definition(ptr, up, dn, n_buckets)
        np.testing.assert_array_equal(lo, want_lo)
        np.testing.assert_array_equal(scale, want_scale)
        rows = sizes > 0  # a row without positives has no table (lo = inf skips it)
        np.testing.assert_array_equal(table[rows], want_table[rows])


@pytest.mark.parametrize("tol", [0.0, 1e-46, 7.9e-6, 1e-3])
def test_band_widths_cover_every_upper_bound_with_one_width_a_row(tol):
    """The state keeps each positive's lower bound and one width a row: ``band_top(up, band)``
    is at or above the positive's own upper bound ``dn`` (so a value above it is certainly ranked
    before the positive), wider than the row's widest band by a few ulps at most, never NaN
    (infinite bounds give an infinite band), and ``dn`` is replaced by ``band_top``."""
    k = _kernels()
    rng = np.random.default_rng(4)
    sizes = rng.integers(0, 300, 30)
    sizes[:3] = [0, 1, 2]
    ptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    val = np.concatenate([rng.normal(size=sizes[:-2].sum()) * 10.0 ** rng.integers(-30, 30),
                          rng.normal(size=sizes[-2]) * 1e-42, rng.normal(size=sizes[-1]) * 1e38])
    val[-1] = -1e39  # a lower bound of -inf
    up, dn = np.empty(val.size, np.float32), np.empty(val.size, np.float32)
    k.bounds(val, tol, up, dn)
    exact_dn = dn.copy()
    band = np.empty(sizes.size, np.float32)
    k.band_widths(ptr, up, dn, band)
    assert not np.isnan(band).any() and not np.isnan(dn).any()
    for i, (p0, p1) in enumerate(zip(ptr[:-1], ptr[1:])):
        if p1 == p0:
            continue
        u = up[p0:p1]
        with np.errstate(invalid="ignore", over="ignore"):
            top = np.where(np.isinf(band[i]), np.float32(np.inf), u + band[i])
        np.testing.assert_array_equal(dn[p0:p1], top)
        assert (top >= exact_dn[p0:p1]).all()
        if np.isfinite(band[i]):  # wider than the widest band by a few ulps at most
            widest = (exact_dn[p0:p1].astype(np.float64) - u.astype(np.float64)).max()
            assert band[i] <= widest * (1 + 2.0**-22) + 4 * np.spacing(np.abs(u).max())
    assert np.isinf(band[-1])  # the row with an infinite lower bound


@pytest.mark.parametrize("distance", [DOT, LpDistance(normalize_embeddings=False)])
def test_self_search_state_between_half_and_whole_budget_takes_symmetric_tiles(
        numba_path, monkeypatch, one_thread, distance):
    """A self-search whose state needs more than half of the budget but fits what its square
    tiles leave is counted in one group on symmetric tiles (half the products), not in row
    groups that each compute every product; the values stay the float64 ranking's."""
    import dmlkit.metrics.average_precision as ap

    q, ql = _tied(900, 4, 6, 11)  # ~150 positives a query
    budget, tile = 2**23, 256
    monkeypatch.setattr(ap, "_MAX_TILE", tile)
    r_count = np.bincount(ql)[ql] - 1

    def state(extra: int) -> int:
        return int((r_count * (ap._STATE_BYTES + extra + ap._VALUE_BYTES) + ap._ROW_BYTES + 2 * 1024).sum())

    extra = (budget * 3 // 4 - state(0)) // int(r_count.sum())
    assert budget // 2 < state(extra) < budget - ap._square_tile_bytes(tile)
    monkeypatch.setattr(ap, "_STATE_BYTES", ap._STATE_BYTES + extra)
    scans = []
    scan = ap._Group.scan

    def spy(self, tiles, tile, wide, workers, nq, m):
        scans.append((self.g0, self.g1, tile))
        return scan(self, tiles, tile, wide, workers, nq, m)

    monkeypatch.setattr(ap._Group, "scan", spy)
    got = _map(q, ql, distance=distance, memory_budget=budget)
    assert scans == [(0, 900, tile)]  # one group: square tiles, each serving two row blocks
    want = brute_force_ap(q, ql, None, None, euclidean=isinstance(distance, LpDistance))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    # a search against other references keeps half the budget for its tiles: row groups
    scans.clear()
    r, rl = _tied(900, 4, 6, 12)
    got = _map(q, ql, r, rl, distance=distance, memory_budget=budget)
    assert len(scans) > 1
    want = brute_force_ap(q, ql, r, rl, euclidean=isinstance(distance, LpDistance))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)



def _one_ulp_up(q: np.ndarray, axis: int) -> np.ndarray:
    out = q.copy()
    out[axis] = np.nextafter(out[axis], np.float32(np.inf))
    return out


#: a row, and for each distance the positive's and the negative's coordinate nudged one ulp up
#: (the negative's coordinate is smaller: it is nearer, exactly and in the row form)
_ULP_CASES = [
    (LpDistance(normalize_embeddings=False),
     [-0.9118091464042664, 0.12279684841632843, 1.605928897857666, 5.243561744689941,
      -2.5270700454711914, -5.418397903442383, -1.452256441116333, 0.2697852849960327]),
    ("euclidean",
     [1.539156436920166, -0.8927521109580994, -1.5900251865386963, -0.7084639072418213,
      5.449427604675293, -0.1494029015302658, 0.25985780358314514, -4.46121883392334]),
]


@pytest.mark.parametrize(("distance", "row"), _ULP_CASES)
def test_small_path_ranks_rows_an_ulp_apart_by_their_distance(distance, row):
    """The expanded Euclidean form cancels to an error of about |x|^2 d 2^-53, more than the
    squared distance of rows an ulp apart: the small-input path ranked the positive (nudged in
    a large coordinate) before the nearer negative (a small one): map 1.0 beside P@1 0."""
    q = np.array(row, np.float32)
    ref = np.stack([_one_ulp_up(q, 0), _one_ulp_up(q, 1), -q])
    got = per_query(q[None], [0], ref, [0, 1, 2], metrics=["precision_at_1", "map"], distance=distance)[0]
    assert got["precision_at_1"][0] == 0.0
    assert got["map"][0] == 0.5


@pytest.mark.parametrize("distance", ["euclidean", "cosine"])
def test_small_path_map_is_the_same_at_every_budget(distance):
    """Exact ties between distinct rows (integer rows of equal norm) were ordered by the float64
    product's rounding, which depends on the block's shape, so the budget moved ``map``."""
    x, y = _tied(300, 21, 75, 8)  # moved at 1 MiB (Euclidean)
    maps = [_map(x, y, distance=distance, memory_budget=b) for b in (256 * 2**20, 3 * 2**20, 2**20)]
    for other in maps[1:]:
        np.testing.assert_array_equal(other, maps[0])
