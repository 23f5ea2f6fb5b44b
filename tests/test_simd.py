"""The eight-lane numba intrinsics of the map kernels (:mod:`dmlkit.metrics._simd`): both
compaction paths against numpy, the in-register transpose, and the choice of path."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from dmlkit.metrics import _simd
from dmlkit.metrics._simd import (
    COMPRESS_TABLE,
    compress8,
    compress8_peel,
    compress8_peel_portable,
    compress8_portable,
    prefetch,
    transpose8,
)


@numba.njit
def _compact(row: np.ndarray, low: np.float32, first_ref: int, portable: bool):
    vals = np.full(row.shape[0] + 8, np.float32(-7.0))
    refs = np.full(row.shape[0] + 8, -1, np.int32)
    n = 0
    for c in range(0, row.shape[0] - row.shape[0] % 8, 8):
        if portable:
            n = compress8_portable(vals, refs, n, row, c, low, COMPRESS_TABLE, first_ref + c)
        else:
            n = compress8(vals, refs, n, row, c, low, COMPRESS_TABLE, first_ref + c)
    return vals, refs, n


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("keep", [0.0, 0.03, 0.5, 1.0])
def test_compress8_keeps_the_entries_at_or_above_the_threshold_in_order(portable, keep):
    rng = np.random.default_rng(int(keep * 100) + portable)
    row = rng.standard_normal(8 * 37).astype(np.float32)
    row[::5] = np.round(row[::5], 1)  # exact ties with the threshold
    row[3], row[11], row[20] = -np.inf, np.inf, np.nan
    low = np.float32(np.nanquantile(row[np.isfinite(row)], 1 - keep)) if 0 < keep < 1 else (
        np.float32(np.inf) if keep == 0 else np.float32(-np.inf))
    vals, refs, n = _compact(row, low, 1000, portable)
    want = np.flatnonzero(row >= low)  # NaN is never kept
    assert n == want.size
    assert refs[:n].tolist() == (1000 + want).tolist()
    assert np.array_equal(vals[:n], row[want])


def test_both_paths_agree_on_every_mask():
    """All 256 masks of one 8-lane block, lane values distinct."""
    rows = np.array([[1.0 if mask >> lane & 1 else -1.0 for lane in range(8)] for mask in range(256)],
                    np.float32).reshape(-1)
    rows = rows + np.tile(np.arange(8, dtype=np.float32) * 1e-3, 256)
    a = _compact(rows, np.float32(0.0), 0, False)
    b = _compact(rows, np.float32(0.0), 0, True)
    assert a[2] == b[2] == 4 * 256
    assert np.array_equal(a[0][: a[2]], b[0][: b[2]]) and np.array_equal(a[1][: a[2]], b[1][: b[2]])


@numba.njit
def _peel(vals: np.ndarray, refs: np.ndarray, intervals: tuple, portable: bool) -> tuple:
    """Compact ``vals`` / ``refs`` in place (whole blocks of eight), dropping the four intervals."""
    n = 0
    counts = np.zeros(4, np.int64)
    for c in range(0, vals.shape[0] - 8 - (vals.shape[0] - 8) % 8, 8):
        if portable:
            n, c0, c1, c2, c3 = compress8_peel_portable(vals, refs, n, c, intervals, COMPRESS_TABLE)
        else:
            n, c0, c1, c2, c3 = compress8_peel(vals, refs, n, c, intervals, COMPRESS_TABLE)
        counts[0] += c0
        counts[1] += c1
        counts[2] += c2
        counts[3] += c3
    return n, counts


def _peel_with_numpy(row: np.ndarray, intervals: tuple) -> tuple:
    inside = [(row > np.float32(a)) & (row < np.float32(b)) for a, b in zip(intervals[::2], intervals[1::2])]
    return np.flatnonzero(~np.logical_or.reduce(inside)), [int(m.sum()) for m in inside]


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("intervals", [
    (-1.5, -0.5, -0.5, 0.0, 0.2, 0.9, 1.0, 1.0),  # adjacent, and one empty (low == high)
    (-9.0, 9.0, np.inf, -np.inf, 2.0, 1.0, np.inf, -np.inf),  # all inside one; empty ones
    (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0),  # nothing dropped
])
def test_compress8_peel_drops_and_counts_open_intervals_in_place(portable, intervals):
    """The list is compacted where it lies (the output trails the input): the entries strictly
    inside an interval are dropped and counted by interval; the rest (ties with an end, NaN)
    stay in order with their columns."""
    rng = np.random.default_rng(7 + portable)
    row = rng.standard_normal(8 * 41).astype(np.float32)
    row[::6] = np.round(row[::6], 1)  # exact ties with the ends
    row[5], row[13], row[30] = -np.inf, np.inf, np.nan
    vals = np.concatenate([row, np.zeros(8, np.float32)])
    refs = np.concatenate([np.arange(row.size, dtype=np.int32) * 3, np.zeros(8, np.int32)])
    ends = tuple(np.float32(v) for v in intervals)
    n, counts = _peel(vals, refs, ends, portable)
    want, want_counts = _peel_with_numpy(row, intervals)
    assert n == want.size and counts.tolist() == want_counts
    assert np.array_equal(vals[:n], row[want], equal_nan=True) and refs[:n].tolist() == (3 * want).tolist()


def test_compress8_peel_paths_agree_on_every_mask():
    """All 256 masks of one block: lane ``l`` of block ``m`` lies inside interval ``l % 4`` when
    bit ``l`` of ``m`` is set, between the intervals otherwise."""
    ends = tuple(np.float32(v) for v in (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0))
    rows = np.array([[2.0 * (lane % 4) + (0.5 if mask >> lane & 1 else 1.5) for lane in range(8)]
                     for mask in range(256)], np.float32).reshape(-1)
    out = []
    for portable in (False, True):
        vals = np.concatenate([rows, np.zeros(8, np.float32)])
        refs = np.arange(vals.size, dtype=np.int32)
        n, counts = _peel(vals, refs, ends, portable)
        out.append((n, counts.tolist(), vals[:n].copy(), refs[:n].copy()))
    assert out[0][0] == out[1][0] == 4 * 256 and out[0][1] == out[1][1] == [256] * 4
    assert np.array_equal(out[0][2], out[1][2]) and np.array_equal(out[0][3], out[1][3])


@numba.njit
def _transpose(s: np.ndarray, row: int, col: int) -> np.ndarray:
    block = np.zeros((8, 8), np.float32)
    transpose8(s, row, col, block)
    return block


@pytest.mark.parametrize(("row", "col"), [(0, 0), (5, 9), (32, 16)])
def test_transpose8_reads_an_8_by_8_block_column_wise(row, col):
    s = np.arange(40 * 25, dtype=np.float32).reshape(40, 25)
    assert np.array_equal(_transpose(s, row, col), s[row : row + 8, col : col + 8].T)


def test_the_permute_path_follows_the_cpu_numba_compiles_for(monkeypatch):
    monkeypatch.setattr(_simd.config, "CPU_NAME", "generic")
    monkeypatch.setattr(_simd.config, "CPU_FEATURES", "")
    assert not _simd.has_avx2()
    monkeypatch.setattr(_simd.config, "CPU_FEATURES", "+sse2,+avx,+avx2,+fma")
    assert _simd.has_avx2()
    monkeypatch.setattr(_simd.config, "CPU_FEATURES", "+sse2,-avx2")
    assert not _simd.has_avx2()


def test_compress_table_lists_the_set_lanes():
    for mask in (0, 1, 0b10110010, 255):
        lanes = [lane for lane in range(8) if mask >> lane & 1]
        assert COMPRESS_TABLE[mask, : len(lanes)].tolist() == lanes


def test_intrinsics_refuse_arrays_they_would_misread():
    """A strided view or another dtype is refused when the kernel is typed, not misread."""
    @numba.njit
    def strided(row):
        vals = np.zeros(16, np.float32)
        refs = np.zeros(16, np.int32)
        return compress8(vals, refs, 0, row, 0, np.float32(0.0), COMPRESS_TABLE, 0)

    with pytest.raises(numba.core.errors.TypingError, match="C-contiguous"):
        strided(np.zeros(32, np.float32)[::2])
    with pytest.raises(numba.core.errors.TypingError, match="float32"):
        strided(np.zeros(16, np.float64))

    @numba.njit
    def float64_threshold(row):
        vals = np.zeros(16, np.float32)
        refs = np.zeros(16, np.int32)
        return compress8(vals, refs, 0, row, 0, 0.5, COMPRESS_TABLE, 0)

    with pytest.raises(numba.core.errors.TypingError, match="float32 threshold"):
        float64_threshold(np.zeros(16, np.float32))

    @numba.njit
    def peel_float64(vals):
        refs = np.zeros(16, np.int32)
        return compress8_peel(vals, refs, 0, 0, (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0), COMPRESS_TABLE)

    with pytest.raises(numba.core.errors.TypingError, match="intervals must be"):
        peel_float64(np.zeros(16, np.float32))

    @numba.njit
    def view(s):
        block = np.zeros((8, 8), np.float32)
        transpose8(s, 0, 0, block)

    with pytest.raises(numba.core.errors.TypingError, match="C-contiguous"):
        view(np.zeros((16, 16), np.float32)[:, 1:])


@numba.njit
def _prefetch_then_sum(a: np.ndarray) -> int:
    for k in range(a.shape[0]):
        prefetch(a, k)
    return a.sum()


def test_prefetch_is_a_hint_that_changes_no_value():
    a = np.arange(1000, dtype=np.int32)
    assert _prefetch_then_sum(a) == a.sum()
    assert np.array_equal(a, np.arange(1000, dtype=np.int32))


def test_prefetch_refuses_arrays_it_would_misread():
    @numba.njit
    def strided(a):
        prefetch(a[::2], 0)

    with pytest.raises(numba.core.errors.TypingError, match="C-contiguous 1-d"):
        strided(np.zeros(8, np.float32))
