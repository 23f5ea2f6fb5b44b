"""Numba kernels of the metrics: exact top-k selection, float64 pair scores, pair histograms.

**Top-k selection** (:func:`dmlkit.metrics.knn`'s ``"numba"`` backend).

A candidate neighbour - closeness ``v`` (float32, larger = closer) of reference ``j`` - is
packed into one int64 *key* whose integer order is the ranking order:

    key(v, j) = (ordered_bits(v) << 32) | (2^32 - 1 - j)

``ordered_bits`` maps the IEEE-754 bits of ``v`` to an int32 with the same order as the floats
(negative floats have their 31 low bits flipped; ``-0.0`` is first turned into ``+0.0``), so
a larger key is a larger closeness and, at equal closeness, a *smaller* reference index. Keys
of one query row are all distinct, so "the ``k`` largest keys" is the exact, deterministic
top-``k`` with ties broken by index, whatever order the candidates arrive in.

Every query row owns a *reservoir*: a buffer of ``cap = 2k`` keys and a threshold key.
Scanning a tile of closeness values, a vectorisable comparison against the row's float
threshold rejects almost everything; the rare survivors are appended; a full buffer is cut
back to its ``k`` largest keys by quickselect, and the smallest of those becomes the new
threshold (amortised O(1) per append, against O(log k) for a heap; Gionis-style reservoir
selection, as in faiss's ``ReservoirTopN``). A row may also start from a *guessed* threshold
(see :func:`dmlkit.metrics.knn`): the result is exact whenever the row still holds at least
``k`` keys at the end, which the caller checks.

The kernels release the GIL, so the caller runs them on several Python threads; a tile's two
row blocks must not be updated by two threads at once (the caller holds a lock per block).
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from dmlkit.metrics._numba_cache import CACHE  # before the first kernel: a writable cache, or none

__all__ = [
    "EDGE_COSINE", "EDGE_EUCLIDEAN", "EDGE_IP", "EDGE_NONE", "EDGE_SQUARED", "LOWEST_KEY", "exact_bin",
    "histogram_tile", "pack_keys", "pair_scores64", "scan_tile", "select_rows",
    "unpack_rows", "unpack_values",
]

_ID_MASK = np.int64(0xFFFFFFFF)


@intrinsic
def _float_bits(typingctx, value):
    """The IEEE-754 bits of a float32 as an int32 (an LLVM bitcast: no memory round trip)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(types.float32), codegen


@intrinsic
def _bits_float(typingctx, bits):
    """The float32 whose IEEE-754 bits are the int32 ``bits``."""
    if bits != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@numba.njit(inline="always")
def _ordered_bits(v: np.float32) -> np.int64:
    b = np.int64(_float_bits(np.float32(v + np.float32(0.0))))  # + 0.0 turns -0.0 into +0.0
    if b < 0:
        b ^= 0x7FFFFFFF
    return b


@numba.njit(inline="always")
def _pack(v: np.float32, j: np.int64) -> np.int64:
    return (_ordered_bits(v) << 32) | (_ID_MASK - j)


@numba.njit(inline="always")
def _value(key: np.int64) -> np.float32:
    b = np.int32(key >> 32)
    if b < 0:
        b ^= np.int32(0x7FFFFFFF)
    return _bits_float(np.int32(b))


@numba.njit(nogil=True, cache=CACHE, boundscheck=False)
def pack_keys(values: np.ndarray, index: int) -> np.ndarray:
    """``key(v, index)`` for every ``v`` of a float32 vector (thresholds: ``index = 2^32 - 1``)."""
    out = np.empty(values.shape[0], np.int64)
    for i in range(values.shape[0]):
        out[i] = _pack(values[i], np.int64(index))
    return out


@numba.njit(nogil=True, cache=CACHE, boundscheck=False)
def unpack_values(keys: np.ndarray) -> np.ndarray:
    """The float32 closeness packed in each key of a vector."""
    out = np.empty(keys.shape[0], np.float32)
    for i in range(keys.shape[0]):
        out[i] = _value(keys[i])
    return out


#: The key below every finite candidate: closeness ``-inf`` at index ``2^32 - 1``.
LOWEST_KEY = int(pack_keys(np.array([-np.inf], np.float32), 0xFFFFFFFF)[0])


@numba.njit(inline="always")
def _select_largest(buf: np.ndarray, n: int, k: int) -> None:
    """Quickselect (Hoare partition, median-of-three): the ``k`` largest of ``buf[:n]`` to ``buf[:k]``."""
    lo, hi = 0, n - 1
    target = k - 1
    while lo < hi:
        mid = (lo + hi) >> 1
        a, b, c = buf[lo], buf[mid], buf[hi]
        if a < b:
            a, b = b, a
        if b < c:
            b = c
            if a < b:
                b = a
        pivot = b
        i, j = lo, hi
        while i <= j:
            while buf[i] > pivot:
                i += 1
            while buf[j] < pivot:
                j -= 1
            if i <= j:
                buf[i], buf[j] = buf[j], buf[i]
                i += 1
                j -= 1
        if target <= j:
            hi = j
        elif target >= i:
            lo = i
        else:
            break


@numba.njit(inline="always")
def _compact(buf: np.ndarray, n: int, k: int) -> np.int64:
    """Keep the ``k`` largest keys of a full buffer; returns the smallest kept (the new threshold)."""
    _select_largest(buf, n, k)
    low = buf[0]
    for i in range(1, k):
        if buf[i] < low:
            low = buf[i]
    return low


@numba.njit(nogil=True, cache=CACHE, boundscheck=False)
def _compact_row(buf, thr_key, thr, row, k) -> int:
    """Cut ``row``'s full reservoir to its ``k`` largest keys and raise its threshold."""
    low = _compact(buf[row], buf.shape[1], k)
    thr_key[row] = low
    thr[row] = _value(low)
    return k


@numba.njit(inline="always")
def _scan_mask(mask: np.ndarray, nc: int) -> None:
    """Zero the tail of ``mask`` past ``nc`` (the word scan reads whole 8-byte words)."""
    for c in range(nc, mask.shape[0]):
        mask[c] = 0


def _tile_float(x):  # pragma: no cover - replaced by the overload below inside numba
    raise NotImplementedError


@overload(_tile_float, inline="always")
def _tile_float_overload(x):
    """A tile entry as float32: itself, or the float32 of a bfloat16 stored as its uint16 bits."""
    if x == types.uint16:
        return lambda x: _bits_float(np.int32(np.int32(x) << np.int32(16)))
    return lambda x: x


@numba.njit(nogil=True, cache=CACHE, boundscheck=False, fastmath=True)
def _dot64(a: np.ndarray, b: np.ndarray) -> np.float64:
    """``sum_t a_t b_t`` accumulated in float64 (any summation order: far below float32 ulps)."""
    acc = 0.0
    for t in range(a.shape[0]):
        acc += np.float64(a[t]) * np.float64(b[t])
    return acc


@numba.njit(nogil=True, cache=CACHE, boundscheck=False)
def scan_tile(
    s: np.ndarray,
    row0: int,
    col0: int,
    exclude_self: bool,
    buf_a: np.ndarray,
    counts_a: np.ndarray,
    thr_key_a: np.ndarray,
    thr_a: np.ndarray,
    both: bool,
    buf_b: np.ndarray,
    counts_b: np.ndarray,
    thr_key_b: np.ndarray,
    thr_b: np.ndarray,
    k: int,
    mask: np.ndarray,
    slack: np.float32,
    query: np.ndarray,
    reference: np.ndarray,
) -> None:
    """Offer every entry of a closeness tile to the reservoirs of its rows (and columns).

    ``s[r, c]`` is the closeness of query ``row0 + r`` and reference ``col0 + c``; row ``r``'s
    reservoir is row ``r`` of ``buf_a`` (and ``counts_a``, ``thr_key_a``, ``thr_a``). With
    ``both`` (a self-search tile off the diagonal) the same entry is also reference ``row0 + r``
    for query ``col0 + c``, whose reservoir is row ``c`` of ``buf_b``. With ``exclude_self``
    the entry of a query with itself (equal global indices) is skipped. ``mask`` is a uint8
    scratch vector of length ``>= s.shape[1]`` rounded up to a multiple of 8.

    Two kinds of tile: float32 closeness (``slack = 0``; the entries are the values ranked),
    or an *approximate* inner-product tile in bfloat16 (uint16 bits) whose error is at most
    ``slack``: an entry then only has to come within ``slack`` of a threshold to survive, and
    each survivor's inner product is recomputed from the float32 rows ``query[row0 + r]`` and
    ``reference[col0 + c]`` in float64 and rounded once to float32 - the value that is ranked.
    """
    nr, nc = s.shape
    cap = buf_a.shape[1]
    recompute = slack > 0
    diag = exclude_self and row0 < col0 + nc and col0 < row0 + nr
    words = mask.view(np.uint64)
    n_words = (nc + 7) >> 3
    _scan_mask(mask, nc)
    # One pass per tile row: bit 0 of mask[c] = "may beat row r's threshold", bit 1 = "may
    # beat column c's threshold" (a self-search tile off the diagonal); then only the 8-entry
    # words holding a survivor are looked at. The row-side and column-side appends below are
    # the same code written twice on purpose: moved into a compiled helper (numba-inlined or
    # not) the scan measured 2-2.5x slower. The cold compaction stays a separate call for the
    # same reason, and a branch-free append measured slower too.
    for r in range(nr):
        t = thr_a[r] - slack
        row = s[r]
        if both:
            for c in range(nc):  # vectorised compares; survivors are rare
                x = _tile_float(row[c])
                mask[c] = (x >= t) | ((x >= thr_b[c] - slack) << 1)
        else:
            for c in range(nc):
                mask[c] = _tile_float(row[c]) >= t
        for w in range(n_words):
            if words[w] == 0:
                continue
            for c in range(8 * w, 8 * w + 8):  # mask is zero past nc
                hit = mask[c]
                if hit == 0 or (diag and row0 + r == col0 + c):
                    continue
                if recompute:
                    v = np.float32(_dot64(query[row0 + r], reference[col0 + c]))
                else:
                    v = np.float32(_tile_float(row[c]))
                if hit & 1:
                    key = _pack(v, col0 + c)
                    if key > thr_key_a[r]:
                        n = counts_a[r]
                        buf_a[r, n] = key
                        n += 1
                        if n == cap:
                            n = _compact_row(buf_a, thr_key_a, thr_a, r, k)
                        counts_a[r] = n
                if hit & 2:
                    key = _pack(v, row0 + r)
                    if key > thr_key_b[c]:
                        n = counts_b[c]
                        buf_b[c, n] = key
                        n += 1
                        if n == cap:
                            n = _compact_row(buf_b, thr_key_b, thr_b, c, k)
                        counts_b[c] = n


@numba.njit(nogil=True, cache=CACHE, boundscheck=False)
def select_rows(buf: np.ndarray, counts: np.ndarray, k: int) -> None:
    """Move each row's ``k`` largest keys to the front of its reservoir (unordered).

    Rows holding fewer than ``k`` keys (a guessed threshold that was too high) are left as
    they are; the caller recomputes them.
    """
    for r in range(buf.shape[0]):
        if counts[r] > k:
            _select_largest(buf[r], counts[r], k)


@numba.njit(nogil=True, cache=CACHE, boundscheck=False)
def unpack_rows(keys: np.ndarray, out_values: np.ndarray, out_indices: np.ndarray) -> None:
    """Rows of keys sorted ascending, unpacked closest first into values and indices."""
    k = keys.shape[1]
    for r in range(keys.shape[0]):
        for i in range(k):
            key = keys[r, k - 1 - i]
            out_values[r, i] = _value(key)
            out_indices[r, i] = _ID_MASK - (key & _ID_MASK)


@numba.njit(nogil=True, cache=CACHE, boundscheck=False, fastmath=True)
def _sqdist64(a: np.ndarray, b: np.ndarray) -> np.float64:
    """``sum_t (a_t - b_t)^2`` accumulated in float64 (any summation order, as :func:`_dot64`:
    vectorised: 20 ns at d = 128 against 118 in order)."""
    acc = 0.0
    for t in range(a.shape[0]):
        diff = np.float64(a[t]) - np.float64(b[t])
        acc += diff * diff
    return acc


@numba.njit(inline="always")
def _closeness64(a: np.ndarray, b: np.ndarray, euclidean: bool) -> np.float64:
    """Float64 closeness of two float32 rows: ``sum_t a_t b_t`` (cosine on normalised rows, dot
    product; the same inner product that ranks scan_tile's bfloat16 survivors), or minus the
    squared Euclidean distance ``-sum_t (a_t - b_t)^2``."""
    if euclidean:
        return -_sqdist64(a, b)
    return _dot64(a, b)


@numba.njit(nogil=True, cache=CACHE, boundscheck=False)
def pair_scores64(
    query: np.ndarray, reference: np.ndarray, rows: np.ndarray, refs: np.ndarray, euclidean: bool
) -> np.ndarray:
    """:func:`_closeness64` of the pairs ``(query[rows[p]], reference[refs[p]])``, accumulated in
    float64 from the float32 inputs - without the float64 copies of every row that a vectorised
    form needs."""
    out = np.empty(rows.shape[0], np.float64)
    for p in range(rows.shape[0]):
        out[p] = _closeness64(query[rows[p]], reference[refs[p]], euclidean)
    return out


#: How :func:`histogram_tile` re-bins a pair whose float32 value lies near a bin edge
#: (:class:`dmlkit.metrics.histograms.EdgeRule`): not at all, by the float64 inner product,
#: squared Euclidean distance, or Euclidean distance of the prepared rows, or the float64
#: cosine of the rows as given.
EDGE_NONE, EDGE_IP, EDGE_SQUARED, EDGE_EUCLIDEAN, EDGE_COSINE = 0, 1, 2, 3, 4


@numba.njit(inline="always")
def clamped_bin(position: float, least: int, most: int) -> int:
    """``position`` (a whole number or +-inf, a bin's floor) clamped to ``[least, most]`` *before*
    it becomes an integer: converting a float beyond the int64 range is undefined (x86 gives
    INT64_MIN, so a pair far above the range landed in the first bin; AArch64 saturates), as
    ``torch``'s ``floor().clamp_()`` then ``to(int64)`` (:func:`dmlkit.metrics.histograms._bin_index`)
    clamps first. NaN gives ``least``."""
    if position >= most:
        return most
    if position > least:
        return np.int64(position)
    return least


@numba.njit(inline="always")
def exact_bin(a: np.ndarray, b: np.ndarray, mode: int, low: float, scale: float, last: int) -> int:
    """The bin ``floor((v - low) * scale)``, clamped to ``[0, last]`` as a float
    (:func:`clamped_bin`; numba's ``math.floor`` converts to int64 first), of the float64 value ``v``
    of rows ``a`` and ``b`` (``mode``: :data:`EDGE_IP`, :data:`EDGE_COSINE`,
    :data:`EDGE_SQUARED` or :data:`EDGE_EUCLIDEAN`)."""
    if mode == EDGE_IP:
        v = _dot64(a, b)
    elif mode == EDGE_COSINE:  # a zero row's cosine is 0, as its normalised row is zero
        den = _dot64(a, a) * _dot64(b, b)
        v = _dot64(a, b) / math.sqrt(den) if den > 0 else 0.0
    else:
        v = _sqdist64(a, b)
        if mode == EDGE_EUCLIDEAN:
            v = math.sqrt(v)
    return clamped_bin(np.floor((v - low) * scale), 0, last)


@numba.njit(nogil=True, cache=CACHE, boundscheck=False)
def histogram_tile(
    values: np.ndarray,
    query_labels: np.ndarray,
    reference_labels: np.ndarray,
    upper_only: bool,
    low: np.float32,
    scale: np.float32,
    positive: np.ndarray,
    total: np.ndarray,
    edge: tuple,
    row0: int,
    col0: int,
) -> None:
    """Add a tile of pair values to the positive-pair and all-pair histograms.

    Bin ``floor((v - low) * scale)`` in float32 arithmetic, clamped to ``[0, bins - 1]`` while
    still a float (:func:`clamped_bin`: a pair far outside the range, even at ``t = +inf``,
    takes the first or last bin; the same bins as :func:`dmlkit.metrics.histograms._bin_index`);
    with ``upper_only`` (a diagonal tile of a self-search) only entries above the diagonal count.

    ``edge`` is ``(mode, query_rows, reference_rows, margin, widest, low64, scale64)``
    (:class:`dmlkit.metrics.histograms.EdgeRule`; ``widest``, the widest margin as a float32,
    picks the pairs to test, -1 none) and the tile holds query rows from ``row0`` and reference
    rows from ``col0``: a value whose position ``t`` (in bins) lies within ``margin[k]`` of an
    inner edge ``k`` (``floor(t)`` or the next) takes the bin of its float64 value from the rows
    ``query_rows[row0 + r]`` and ``reference_rows[col0 + c]`` (:func:`exact_bin`), so the bin
    does not depend on the float32 product's summation order.
    """
    mode, q_rows, r_rows, margin, widest, low64, scale64 = edge
    last = total.shape[0] - 1
    for r in range(values.shape[0]):
        label = query_labels[r]
        for c in range(r + 1 if upper_only else 0, values.shape[1]):
            t = (values[r, c] - low) * scale
            below = np.floor(t)
            b = clamped_bin(below, 0, last)
            part = t - below  # exact: t and its floor share the exponent or less
            if part <= widest or np.float32(1) - part <= widest:
                # near edge floor(t) or the next (infinite margins: every pair)
                f = clamped_bin(below, -1, last + 1)  # beyond both tests below, as before
                t64 = np.float64(t)
                if (1 <= f <= last and t64 - f <= margin[f]) or \
                        (0 <= f < last and f + 1 - t64 <= margin[f + 1]):
                    b = exact_bin(q_rows[row0 + r], r_rows[col0 + c], mode, low64, scale64, last)
            total[b] += 1
            if reference_labels[c] == label:
                positive[b] += 1


# -- expected mutual information (AMI) ----------------------------------------------------------
@numba.njit(nogil=True, cache=CACHE)
def expected_mutual_information(
    sizes_a: np.ndarray, count_a: np.ndarray, sizes_b: np.ndarray, count_b: np.ndarray, n: int
) -> float:
    """E[MI] of two random labellings with the given cluster sizes (Vinh, Epps, Bailey, JMLR
    2010, eq. 24 - the sum scikit-learn evaluates), over *distinct* sizes.

    Every term depends on a cluster's size only, so a pair of distinct sizes ``(a, b)`` is
    evaluated once and weighted by how many cluster pairs share it: ``O(|A| |B| min(a, b))``
    for the distinct sizes against ``O(R C min(a, b))`` for every pair of clusters (with
    C = 2,000 classes of equal size, 4 million pairs become a few thousand).
    """
    emi = 0.0
    log_n = math.log(n)
    gln_n = math.lgamma(n + 1)
    for i in range(sizes_a.shape[0]):
        a = sizes_a[i]
        for j in range(sizes_b.shape[0]):
            b = sizes_b[j]
            weight = float(count_a[i]) * float(count_b[j])
            start = max(1, a - n + b)
            end = min(a, b) + 1
            gln_ab = (math.lgamma(a + 1) + math.lgamma(b + 1) + math.lgamma(n - a + 1)
                      + math.lgamma(n - b + 1) - gln_n)
            log_ab = math.log(a) + math.log(b)
            acc = 0.0
            for nij in range(start, end):
                term2 = log_n + math.log(nij) - log_ab
                gln = (gln_ab - math.lgamma(nij + 1) - math.lgamma(a - nij + 1)
                       - math.lgamma(b - nij + 1) - math.lgamma(n - a - b + nij + 1))
                acc += nij / n * term2 * math.exp(gln)
            emi += weight * acc
    return emi


# -- k-means++ seeding ----------------------------------------------------------------------------
@numba.njit(nogil=True, cache=CACHE, boundscheck=False, fastmath=True)
def _sq_dist(a: np.ndarray, b: np.ndarray) -> np.float32:
    """Squared distance in float32 (SIMD; seeding needs no more precision)."""
    acc = np.float32(0.0)
    for t in range(a.shape[0]):
        diff = a[t] - b[t]
        acc += diff * diff
    return acc


@numba.njit(nogil=True, cache=CACHE, boundscheck=False)
def kmeans_plusplus(x: np.ndarray, first: int, uniforms: np.ndarray) -> np.ndarray:
    """k-means++ seeding (Arthur and Vassilvitskii, SODA 2007): row ``first``, then each next
    centre drawn with probability proportional to its squared distance to the nearest centre
    chosen so far, by inverse CDF of ``uniforms[i]`` in ``[0, 1)`` (``k - 1`` of them).
    Returns the ``k`` chosen row indices. ``O(k n d)``."""
    n = x.shape[0]
    k = uniforms.shape[0] + 1
    chosen = np.empty(k, np.int64)
    chosen[0] = first
    best = np.empty(n, np.float32)
    for i in range(n):
        best[i] = _sq_dist(x[i], x[first])
    for c in range(1, k):
        total = 0.0
        for i in range(n):
            total += np.float64(best[i])
        if total <= 0.0:  # fewer distinct points than centres: any row (duplicates a centre)
            pick = c % n
        else:
            target = uniforms[c - 1] * total
            acc = 0.0
            pick = n - 1
            for i in range(n):
                acc += np.float64(best[i])
                if acc > target and best[i] > 0.0:
                    pick = i
                    break
        chosen[c] = pick
        centre = x[pick]
        for i in range(n):
            dist = _sq_dist(x[i], centre)
            if dist < best[i]:
                best[i] = dist
    return chosen


# -- nearest centroid (k-means assignment) ------------------------------------------------------
@numba.njit(nogil=True, cache=CACHE, boundscheck=False)
def argmax_rows(
    s: np.ndarray, row0: int, slack: np.float32, query: np.ndarray, reference: np.ndarray, out: np.ndarray
) -> None:
    """Each tile row's closest reference, exactly: ``out[row0 + r]`` = the column of largest
    closeness, ties by the smaller column.

    ``s`` is a float32 tile (``slack = 0``: its values are ranked) or a bfloat16 tile (uint16
    bits) whose entries are within ``slack`` of the true inner products: every entry within
    ``2 slack`` of the row's approximate maximum is re-scored in float64 from ``query[row0 + r]``
    and ``reference[c]``; any other entry is below the approximate maximum's true value.
    """
    nr, nc = s.shape
    for r in range(nr):
        row = s[r]
        top = np.float32(-np.inf)
        for c in range(nc):  # vectorised maximum
            x = _tile_float(row[c])
            top = max(top, x)
        if slack == 0:
            for c in range(nc):
                if _tile_float(row[c]) == top:
                    out[row0 + r] = c
                    break
            continue
        low = top - 2 * slack
        near = 0
        for c in range(nc):  # vectorised count of the entries that could be the maximum
            near += _tile_float(row[c]) >= low
        if near == 1:  # only the maximum itself: no float64 score needed
            for c in range(nc):
                if _tile_float(row[c]) == top:
                    out[row0 + r] = c
                    break
            continue
        best = -np.inf
        pick = -1
        for c in range(nc):
            if _tile_float(row[c]) >= low:
                value = _dot64(query[row0 + r], reference[c])
                if value > best:
                    best = value
                    pick = c
        out[row0 + r] = pick


@numba.njit(nogil=True, cache=CACHE, boundscheck=False)
def cluster_sums(x: np.ndarray, assign: np.ndarray, sums: np.ndarray, counts: np.ndarray) -> None:
    """Add every row of ``x`` to ``sums[assign[i]]`` (float64) and count it."""
    for i in range(x.shape[0]):
        c = assign[i]
        counts[c] += 1
        row = sums[c]
        xi = x[i]
        for t in range(x.shape[1]):
            row[t] += xi[t]
