"""Numba kernels that prepare the state of full-ranking average precision
(:mod:`dmlkit.metrics.average_precision`; the counting is :mod:`dmlkit.metrics._ap_kernels`).

Per query row: its positives (the references of its class, :func:`gather_positives`), their
float64 closeness (:func:`positive_scores`), sorted closest first with ties by the smaller
reference index (:func:`sort_positives`), two float32 bounds each within which a float32 tile
value may rank either side of the positive (:func:`bounds`; the state keeps the lower one and
a width a row, :func:`band_widths`), and a bucket table that places a
tile value among them in constant time away from every band (:func:`build_tables`). Measured
at 50k queries x 499 positives, one thread: sort 0.32-0.37 s, bounds 0.07-0.10 s, tables
0.88-1.06 s (benchmarks/README.md, "Sixth version").
"""

from __future__ import annotations

import math

import numba
import numpy as np

from dmlkit.metrics._kernels import _bits_float, _closeness64, _float_bits
from dmlkit.metrics._numba_cache import CACHE

__all__ = [
    "band_top", "band_widths", "bounds", "build_tables", "gather_positives", "positive_scores",
    "sort_positives",
]


#: Buckets of :func:`sort_positives` holding more positives than this are merge-sorted, so
#: clustered values cannot make its insertion sort quadratic.
_CROWDED_BUCKET = 16


@numba.njit(nogil=True, cache=CACHE, boundscheck=False)
def sort_positives(pos_ptr: np.ndarray, pos_val: np.ndarray, pos_ref: np.ndarray) -> None:
    """Sort each row's positives by closeness, descending, in place; the input references are
    ascending within a row and the sort is stable, so ties stay ordered by index.

    A stable counting sort into about one bucket a positive (equal widths between the row's
    extremes; the bucket is a monotone function of the value), then an insertion sort, which
    only moves positives within their bucket. Comparison sorts mispredict about once a
    comparison on random closeness: numba's ``argsort(kind="mergesort")`` took 65-78 ns a
    positive at 499 a row, a branch-free merge sort 45-90; this one 14-16. Values are finite
    (float64 closeness of finite float32 rows); a bucket of more than ``_CROWDED_BUCKET`` is
    merge-sorted first, so clustered values cost ``O(n log n)``, not ``O(n^2)``."""
    longest = 0
    for i in range(pos_ptr.shape[0] - 1):
        longest = max(longest, pos_ptr[i + 1] - pos_ptr[i])
    spare_val = np.empty(longest, pos_val.dtype)
    spare_ref = np.empty(longest, pos_ref.dtype)
    bucket = np.empty(longest, np.int64)
    start = np.empty(longest + 1, np.int64)
    for i in range(pos_ptr.shape[0] - 1):
        lo, hi = pos_ptr[i], pos_ptr[i + 1]
        n = hi - lo
        if n < 2:
            continue
        val, ref = pos_val[lo:hi], pos_ref[lo:hi]
        high, low = val[0], val[0]
        for k in range(1, n):
            high = max(high, val[k])
            low = min(low, val[k])
        if high == low:  # all equal: already in index order
            continue
        scale = n / (high - low)
        if not np.isfinite(scale):  # a subnormal range: one crowded bucket
            scale = 0.0
        start[: n + 1] = 0
        for k in range(n):  # bucket 0 holds the largest values
            b = n - 1 - min(np.int64((val[k] - low) * scale), n - 1)
            bucket[k] = b
            start[b + 1] += 1
        for b in range(n):
            start[b + 1] += start[b]
        for k in range(n):  # stable scatter
            b = bucket[k]
            spare_val[start[b]] = val[k]
            spare_ref[start[b]] = ref[k]
            start[b] += 1
        b0 = 0
        for b in range(n):  # a crowded bucket (clustered values): a stable O(m log m) sort
            b1 = start[b]
            if b1 - b0 > _CROWDED_BUCKET:
                order = np.argsort(-spare_val[b0:b1], kind="mergesort")
                spare_val[b0:b1] = spare_val[b0:b1][order]
                spare_ref[b0:b1] = spare_ref[b0:b1][order]
            b0 = b1
        for k in range(n):  # stable insertion sort, descending: moves stay within a bucket
            v, r = spare_val[k], spare_ref[k]
            m = k
            while m > 0 and val[m - 1] < v:
                val[m] = val[m - 1]
                ref[m] = ref[m - 1]
                m -= 1
            val[m] = v
            ref[m] = r


@numba.njit(nogil=True, cache=CACHE)
def gather_positives(
    row0: int,
    pos_first: np.ndarray,
    pos_last: np.ndarray,
    exclude_self: bool,
    pos_ptr: np.ndarray,
    pos_ref: np.ndarray,
) -> None:
    """Fill each row's positives: the references ``pos_first[gi]:pos_last[gi]`` of query ``gi =
    row0 + i`` (ascending; the query itself left out with ``exclude_self``)."""
    for i in range(pos_ptr.shape[0] - 1):
        gi = row0 + i
        out = pos_ptr[i]
        for j in range(pos_first[gi], pos_last[gi]):
            if exclude_self and j == gi:
                continue
            pos_ref[out] = j
            out += 1


@numba.njit(nogil=True, cache=CACHE, boundscheck=False)
def positive_scores(
    query: np.ndarray, reference: np.ndarray, order: np.ndarray, row0: int, pos_ptr: np.ndarray,
    pos_ref: np.ndarray, euclidean: bool, pos_val: np.ndarray,
) -> None:
    """Float64 closeness of every positive of the rows ``order`` (query ``row0 + i`` for row
    ``i``): pass the rows grouped by class, and each class's references are read from cache
    by all its queries (in index order each positive was a cache miss: 75 ns a pair at R = 499)."""
    for t in range(order.shape[0]):
        i = order[t]
        a = query[row0 + i]
        for p in range(pos_ptr[i], pos_ptr[i + 1]):
            pos_val[p] = _closeness64(a, reference[pos_ref[p]], euclidean)


@numba.njit(inline="always")
def _round_down32(a: float) -> np.float32:
    """The largest float32 at or below the float64 ``a``: ``float32(a)``, one ulp down when it
    rounded up (branch-free on the bits; ``+0.0`` steps to ``-2^-149``)."""
    y = np.float32(a)
    bits = _float_bits(y)
    step = np.int32(np.float64(y) > a)
    out = bits - step if bits >= 0 else bits + step  # a select: no branch
    if bits == 0 and step:
        out = np.int32(-2147483647)  # -2^-149
    return _bits_float(np.int32(out))


@numba.njit(inline="always")
def _round_up32(b: float) -> np.float32:
    """The smallest float32 at or above the float64 ``b`` (``-0.0`` steps to ``2^-149``)."""
    z = np.float32(b)
    bits = _float_bits(z)
    step = np.int32(np.float64(z) < b)
    out = bits + step if bits >= 0 else bits - step
    if bits == np.int32(-2147483648) and step:
        out = np.int32(1)  # 2^-149
    return _bits_float(np.int32(out))


@numba.njit(nogil=True, cache=CACHE)
def bounds(pos_val: np.ndarray, tol: float, up: np.ndarray, dn: np.ndarray) -> None:
    """``up = round_down(v - tol)`` and ``dn = round_up(v + tol)``: the largest float32 at or
    below, and the smallest at or above, each float64 (one pass, no temporaries; the rounding
    direction is corrected on the bits, without a branch: a branch on it mispredicts half the
    time, 16 ns a positive against 2-3)."""
    for k in range(pos_val.shape[0]):
        up[k] = _round_down32(pos_val[k] - tol)
        dn[k] = _round_up32(pos_val[k] + tol)


@numba.njit(inline="always")
def band_top(up: np.float32, band: np.float32) -> np.float32:
    """The upper bound of a positive's band from its lower bound ``up`` and its row's ``band``
    (:func:`band_widths`): ``up + band`` in float32, ``inf`` for an infinite band (so that
    ``-inf + inf`` never gives NaN)."""
    return up + band if band < np.inf else np.float32(np.inf)


@numba.njit(nogil=True, cache=CACHE)
def band_widths(pos_ptr: np.ndarray, up: np.ndarray, dn: np.ndarray, band: np.ndarray) -> None:
    """Per row, a float32 ``band`` with ``band_top(up[p], band) >= dn[p]`` for every positive
    ``p`` of the row (the widest ``dn - up`` rounded up, then widened an ulp at a time until it
    holds), and ``dn[p]`` replaced by that ``band_top``.

    The state then keeps one float32 bound a positive (``up``) and one ``band`` a row instead of
    two bounds a positive (4 bytes less a positive: at 50k queries with 199 positives each, the
    state of one group fits the default budget). A wider band is still a correct one: a value
    above ``band_top`` is above ``dn``, so certainly ranked before the positive; a value inside
    it is compared in float64. Every ``dn - up`` is ``2 tol`` plus at most two float32 roundings,
    so the widening is a few ulps. ``float32(up + band)`` rounds monotonically and ``dn`` is a
    float32, so the check is exact; where it fails (an infinite ``up``), the band grows to
    ``inf``."""
    for i in range(pos_ptr.shape[0] - 1):
        p0, p1 = pos_ptr[i], pos_ptr[i + 1]
        width = np.float32(0.0)
        for p in range(p0, p1):
            width = max(width, _round_up32(np.float64(dn[p]) - np.float64(up[p])))
        for p in range(p0, p1):
            while width < np.inf and not band_top(up[p], width) >= dn[p]:
                width = _bits_float(np.int32(_float_bits(width) + 1))  # the next float32 up
        band[i] = width
        for p in range(p0, p1):
            dn[p] = band_top(up[p], width)


@numba.njit(inline="always")
def _first_reaching(base: float, step: float, inverse: float, shift: int, level: float,
                    strict: bool, b0: int, b1: int) -> int:
    """The first ``b`` in ``b0:b1`` whose ``base + (b + shift) * step`` (float64, evaluated so)
    is above ``level`` (at or above unless ``strict``); ``b1`` if none. The expression is
    nondecreasing in ``b`` (``step > 0``; roundings are monotone): an estimate (``inverse`` is
    about ``1 / step``), corrected by evaluating the expression itself."""
    g = (level - base) * inverse - shift
    b = b1
    if g < b1:  # false for NaN too
        b = max(b0, int(math.floor(g)) if g > b0 else b0)
    while b > b0 and (base + (b - 1 + shift) * step > level
                      or (not strict and base + (b - 1 + shift) * step == level)):
        b -= 1
    while b < b1 and not (base + (b + shift) * step > level
                          or (not strict and base + (b + shift) * step == level)):
        b += 1
    return b


@numba.njit(nogil=True, cache=CACHE)
def build_tables(
    pos_ptr: np.ndarray, up: np.ndarray, dn: np.ndarray, lo: np.ndarray, scale: np.ndarray,
    table: np.ndarray,
) -> None:
    """Each row's bucket table.

    Bucket of ``x >= lo[i]``: ``b = int((x - lo[i]) * scale[i])`` in float32, clamped to
    ``B - 1``. Both roundings are monotone and within ``2^-24`` relative, so every ``x`` of
    bucket ``b`` lies in ``[L_b, U_b]`` with ``L_b = lo + b / scale (1 - 2^-20)`` and
    ``U_b = lo + (b + 1) / scale (1 + 2^-20)`` (``L_0 = lo``; ``U = inf`` for the last bucket).
    With ``a_b`` = the positives with ``up[p] > U_b`` (certainly before every ``x`` of the
    bucket):

    * ``table[i, b] = a_b`` when ``dn[a_b] < L_b``: every ``x`` of the bucket is certainly
      before positive ``a_b`` and all after it, so ``e(x) = a_b`` with no further test;
    * ``table[i, b] = -1 - a_b`` otherwise: the scan goes on from ``a_b`` (and compares in
      float64 near a positive).

    The bounds are sorted (``up`` and ``dn`` nonincreasing), so the buckets of one ``a_b``
    form a run, split once by the test on ``dn[a_b]``: per positive, two boundaries (a
    product's estimate, corrected on the same float64 expressions) and two filled runs (at
    4096 buckets and 499 positives a row, 0.8 ns a bucket against 5 for a test per bucket).
    """
    n_buckets = table.shape[1]
    for i in range(pos_ptr.shape[0] - 1):
        p0, p1 = pos_ptr[i], pos_ptr[i + 1]
        if p1 == p0:
            lo[i] = np.inf
            scale[i] = 0.0
            continue
        low = up[p1 - 1]
        high = dn[p0]
        width = np.float64(high) - np.float64(low)
        sc = min(n_buckets / width, 1e30) if width > 0 else 1e30
        lo[i] = low
        scale[i] = np.float32(sc)
        # a bucket's width, with the margins (a product instead of a division per bucket: 3
        # more roundings of 2^-53 within the 2^-20 margins)
        wide_up = (1.0 / np.float64(scale[i])) * (1.0 + 2.0**-20)
        wide_dn = (1.0 / np.float64(scale[i])) * (1.0 - 2.0**-20)
        low64 = np.float64(low)
        inverse = np.float64(scale[i])
        tab = table[i]
        r = p1 - p0
        # U_b = low64 + (b + 1) wide_up for b < B - 1; a_b >= a + 1 iff up[a] > U_b, i.e. b <
        # t_a (the first b with U_b >= up[a], at most B - 1). Run of a: t_a <= b < t_(a-1).
        stop = n_buckets  # t_(a-1); t_(-1) = B (a_(B-1) = 0)
        for a in range(r + 1):
            if a < r:
                # first b in 0:B-1 with low64 + (b + 1) wide_up >= up[a], i.e. not "< up[a]"
                start = _first_reaching(low64, wide_up, inverse, 1, np.float64(up[p0 + a]), False,
                                        0, min(stop, n_buckets - 1))
            else:
                start = 0
            if start < stop:
                # clean from the first b with L_b > dn[a] (L_0 = low64, L_b = low64 + b wide_dn)
                clean = stop
                if a < r:
                    level = np.float64(dn[p0 + a])
                    if start == 0 and low64 > level:
                        clean = 0
                    else:
                        clean = _first_reaching(low64, wide_dn, inverse, 0, level, True,
                                                max(start, 1), stop)
                for b in range(start, stop):  # one loop with a select: the runs are short
                    tab[b] = a if b >= clean else -1 - a
                stop = start
            if stop == 0:
                break
