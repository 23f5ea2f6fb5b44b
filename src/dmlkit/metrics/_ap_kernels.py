"""Numba kernels of full-ranking average precision (:mod:`dmlkit.metrics.average_precision`):
the counting. The state they read is prepared by :mod:`dmlkit.metrics._ap_positives`.

Per query row the state is its positives, sorted by float64 closeness (descending, ties by
the smaller reference index), with two float32 bounds each: ``up[p]`` (a tile value ``x <
up[p]`` is certainly ranked after positive ``p``) and ``dn[p]`` (``x > dn[p]``: certainly
ranked before it). A float32 tile value ``x`` is within ``tol`` of its float64 closeness, so
``up[p] = round_down(v_p - tol)`` and ``dn[p] = round_up(v_p + tol)``; the state keeps ``up``
and a width a row, ``dn[p] = band_top(up[p], band[i])`` at least as high
(:func:`dmlkit.metrics._ap_positives.band_widths`).

For every negative ``j`` of a row the kernel finds ``e(j)``, the number of the row's positives
ranked before ``j``, and counts it: ``cnt[e] += 1``. Positive ``p`` itself ranks after ``p``
positives, so its 1-based rank is ``rank_p = sum_{e <= p} (cnt[e] + 1)`` and

    AP = (1/R) sum_p (p + 1) / rank_p.

``e(j)`` comes from a per-row bucket table (``B`` equal buckets between the lowest and the
highest bound): a bucket that holds no positive's bound gives ``e`` at once (one load and one
increment per reference); the entries of the other buckets are listed and placed afterwards by
a short forward scan over the bounds, and only a value within ``tol`` of a positive's closeness
is re-scored in float64 and compared exactly (ties by the original index): such entries are held
until the end of the tile and re-scored in reference order (:func:`_flush_exact`). The
references are in class order, so a query's positives (and, on a self-search, the query itself)
are one interval of columns: :func:`count_rows` sets it to ``-inf`` in the tile and a positive
never reaches the table (each lies within its own band, so it would always be listed: 2.5 % of
all pairs at R = 499, 27 % of the listed entries). Before the table, the entries certainly
between two of the lowest positives are counted by interval and dropped, eight at a time
(:func:`_peel_lowest`): most survivors crowd there. References below the lowest bound rank after
every positive and cost one comparison: a tile row is compacted eight entries at a time (:func:`dmlkit.metrics._simd.compress8`), keeping each survivor's value
and column. A self-search tile also serves the column block: :func:`count_columns` transposes
8 x 8 blocks in registers (:func:`dmlkit.metrics._simd.transpose8`) and compacts each column.

Measured on a 2-core EPYC (Zen 3, no AVX-512), one thread, ns per tile pair at N = 20k, d = 128,
R = 49, tiles captured in the pipeline: rows 1.3-1.6 (0.9 of them the compaction and reading the
fresh tile) and columns 1.8-2.0, against 2.4 and 3.2 with scalar compaction. Measured slower or
no better: a transposing copy before counting the columns as rows; index-only compaction with
values gathered afterwards; branch-free placement of every survivor through the first two
bounds after the table's positive (1.5-2x slower: longer address chains into ``cnt``); four
interleaved count arrays; 16-column strips; finer tables (2048 to 16384 buckets, also at R =
499); tiles of 256, 512 or 2048; counting each row's 8 lowest positives by vectorised
comparisons and placing only the entries above them, on the whole row or on the compacted
survivors (slower in both; dropping the four lowest intervals from the compacted list in one
pass is what helps); one pass over a symmetric tile for its rows and columns (1,024 live
column lists miss L1); software prefetch of the next row's state (also at the next eight columns:
faster on a captured tile with the state evicted, not in the pipeline); exact re-scorings deferred
to a loop after each row's listed entries (the tile-wide deferral in reference order is what
helps); the band positives' closeness copied when an entry is held; counting the values between
the two lowest positives during the row's compaction (one more pair of vector comparisons on
every entry, not only on the survivors); counting
strips of a tile right after their product. See benchmarks/README.md.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from dmlkit.metrics._ap_positives import band_top
from dmlkit.metrics._kernels import _closeness64
from dmlkit.metrics._numba_cache import CACHE
from dmlkit.metrics._simd import COMPRESS_TABLE, compress8, compress8_peel, prefetch, transpose8

__all__ = [
    "Counting", "Deferred", "ap_from_counts", "count_columns", "count_rows", "counting_scratch",
    "counting_scratch_bytes", "deferred_scratch",
]


class Counting(NamedTuple):
    """What the counting kernels read and write for a group of query rows."""

    pos_ptr: np.ndarray  #: each row's positives start here (int64, rows + 1)
    pos_ref: np.ndarray  #: their references, closest first (float64 closeness; ties by index)
    pos_val: np.ndarray  #: their float64 closeness, or empty: recomputed when needed
    up: np.ndarray  #: float32 bound below which a tile value ranks after the positive
    band: np.ndarray  #: per row, the float32 width: above ``band_top(up[p], band)`` it ranks before it
    lo: np.ndarray  #: each row's lowest bound (inf without positives)
    scale: np.ndarray  #: each row's bucket scale
    table: np.ndarray  #: each row's bucket table (:mod:`dmlkit.metrics._ap_positives`)
    cnt: np.ndarray  #: per row, the negatives after e positives, then a spare slot
    query: np.ndarray  #: the float32 query rows
    reference: np.ndarray  #: the float32 reference rows, in class order
    euclidean: bool  #: closeness is minus the squared distance (else an inner product)
    pos_first: np.ndarray  #: per query, its class's first reference (int64; an empty interval
    pos_last: np.ndarray  #: per query, one past its class's last one   ...without a positive)
    ref_index: np.ndarray  #: each reference's index in the caller's order (ties rank by it)
    tied: np.ndarray  #: per row, 1 where a negative ties a positive exactly (uint8; set here)


class Deferred(NamedTuple):
    """One worker's entries awaiting an exact comparison (see :func:`_flush_exact`)."""

    count: np.ndarray  #: int64[1]: how many are held
    row: np.ndarray  #: each one's row state
    query: np.ndarray  #: its query (global row)
    ref: np.ndarray  #: its reference
    value: np.ndarray  #: its float32 tile value
    first: np.ndarray  #: the first positive (absolute position) whose band holds the value
    exact: np.ndarray  #: its float64 closeness, computed at the flush
    order: np.ndarray  #: the held entries by reference
    bins: np.ndarray  #: a counting sort's bins over the references of one tile


def deferred_scratch(side: int) -> Deferred:
    """Room for ``4 side`` held entries, from 4096 to 65536 (52 bytes each: at most 3.4 MB a
    worker; a full buffer is flushed, so this bounds memory, not what a tile may hold), for tiles
    up to ``side`` wide."""
    cap = min(max(4096, 4 * side), 65536)
    return Deferred(np.zeros(1, np.int64), np.empty(cap, np.int64), np.empty(cap, np.int64),
                    np.empty(cap, np.int64), np.empty(cap, np.float32), np.empty(cap, np.int64),
                    np.empty(cap, np.float64), np.empty(cap, np.int64),
                    np.empty(side + 2, np.int64))


#: How many held entries ahead :func:`_flush_exact` prefetches what an entry reads.
_PREFETCH_AHEAD = 8


@numba.njit(inline="always")
def _prefetch_lines(row: np.ndarray) -> None:
    """Prefetch every cache line of a 1-d C-contiguous ``row``."""
    for t in range(0, row.shape[0], 64 // row.itemsize):
        prefetch(row, t)


@numba.njit(nogil=True, cache=CACHE, boundscheck=False)
def _flush_exact(state: Counting, held: Deferred) -> None:
    """Count the held entries, each within ``tol`` of a positive's closeness, exactly.

    Their float64 closeness is computed in reference order (a counting sort of the held
    references, all from one tile): the reference rows are then read once each and in memory
    order. Re-scored where found, each was a cache miss on its reference row: at 499 positives a
    query and 16384-column tiles (0.2-0.3 % of all pairs held) the row pass took 7.6-8.5 s
    against 5.8-6.5 s now (50k queries, one thread). Then each is placed among the positives
    whose band holds it (:func:`_exact_rank`)."""
    n = held.count[0]
    if n == 0:
        return
    lowest, highest = held.ref[0], held.ref[0]
    for k in range(1, n):
        lowest = min(lowest, held.ref[k])
        highest = max(highest, held.ref[k])
    span = highest - lowest + 1
    bins = held.bins
    if span + 1 <= bins.shape[0]:
        bins[: span + 1] = 0
        for k in range(n):
            bins[held.ref[k] - lowest + 1] += 1
        for b in range(span):
            bins[b + 1] += bins[b]
        for k in range(n):
            b = held.ref[k] - lowest
            held.order[bins[b]] = k
            bins[b] += 1
    else:  # references from more than one tile (not expected): in the order held
        for k in range(n):
            held.order[k] = k
    for t in range(n):
        if t + _PREFETCH_AHEAD < n:  # the reference rows come in order; the query rows do not
            _prefetch_lines(state.query[held.query[held.order[t + _PREFETCH_AHEAD]]])
        k = held.order[t]
        held.exact[k] = _closeness64(state.query[held.query[k]], state.reference[held.ref[k]],
                                     state.euclidean)
    lean = state.pos_val.shape[0] == 0
    for k in range(n):
        if k + 2 * _PREFETCH_AHEAD < n:  # the state its first positive reads
            f = held.first[k + 2 * _PREFETCH_AHEAD]
            prefetch(state.pos_ref, f)
            prefetch(state.up, f)
            if not lean:
                prefetch(state.pos_val, f)
            prefetch(state.cnt, f + held.row[k + 2 * _PREFETCH_AHEAD])
            prefetch(state.ref_index, held.ref[k + 2 * _PREFETCH_AHEAD])
        if lean and k + _PREFETCH_AHEAD < n:  # the rows that recompute that positive's closeness
            g = state.pos_ref[held.first[k + _PREFETCH_AHEAD]]
            _prefetch_lines(state.reference[g])
            _prefetch_lines(state.query[held.query[k + _PREFETCH_AHEAD]])
            prefetch(state.ref_index, g)
        i = held.row[k]
        stop = state.pos_ptr[i + 1]
        e, tie = _exact_rank(state, held.query[k], held.ref[k], held.exact[k], held.value[k],
                             held.first[k], stop, state.band[i])
        if tie:
            state.tied[i] = 1
        if e < stop:
            state.cnt[e + i] += 1  # row i's count after e - pos_ptr[i] positives
    held.count[0] = 0


@numba.njit(nogil=True, cache=CACHE, boundscheck=False)
def _exact_rank(state: Counting, gi: int, j: int, v: float, x: np.float32, first: int,
                stop: int, band: np.float32) -> tuple[int, bool]:
    """Where reference ``j`` (tile value ``x``, float64 closeness ``v``) ranks for query ``gi``
    among the positives ``first:stop``, the first of them not certainly before it: ``first``
    plus the positives whose band holds ``x`` and whose float64 closeness ranks before ``j``'s
    (ties by the original index); and whether one of them ties ``v`` exactly (then the tie rule,
    not the embeddings, orders the two). A positive's closeness is read from ``pos_val`` or,
    where the state does not keep it, recomputed by the function that sorted it. An exact tie
    lies within the band, so every one is seen here."""
    up, pos_ref, pos_val, ref_index = state.up, state.pos_ref, state.pos_val, state.ref_index
    e = first
    q = first
    tie = False
    while q < stop and x <= band_top(up[q], band):
        k = pos_ref[q]
        pv = pos_val[q] if pos_val.shape[0] else _closeness64(state.query[gi], state.reference[k],
                                                             state.euclidean)
        tie |= pv == v
        if pv > v or (pv == v and ref_index[k] < ref_index[j]):
            e += 1
        q += 1
    return e, tie


@numba.njit(inline="always")
def _interval(up: np.ndarray, p0: int, big_r: int, band: np.float32, k: int) -> tuple:
    """``(band_top(up[R-1-k]), up[R-2-k])``: the open interval of values certainly between
    positives ``R-1-k`` and ``R-2-k`` (empty, ``(inf, -inf)``, past the highest positive)."""
    if k >= big_r - 1:
        return np.float32(np.inf), np.float32(-np.inf)
    return band_top(up[p0 + big_r - 1 - k], band), up[p0 + big_r - 2 - k]


@numba.njit(inline="always")
def _peel_lowest(vals: np.ndarray, refs: np.ndarray, n: int, up: np.ndarray, p0: int, big_r: int,
                 band: np.float32, cnt: np.ndarray, c0: int) -> int:
    """Count, without placing them, the entries of the row's four lowest intervals; return how
    many entries are left (compacted in place, in order).

    A value ``x`` with ``band_top(up[R-1-k]) < x < up[R-2-k]`` is certainly ranked before
    positive ``R-1-k`` (and every lower one: their bands end lower) and certainly after positive
    ``R-2-k`` (and every higher one: their bounds are higher), so ``e(x) = R-1-k`` exactly.
    One pass of :func:`dmlkit.metrics._simd.compress8_peel` counts and drops those of ``k = 0..3``.
    The survivors of a tile row crowd above the lowest positive: at 50k queries, R = 49 and 199,
    the lowest interval held 39 % and 30 % of the entries placed through the table, the lowest
    four 73 % and 64 %; each costs a table load and an increment of the same few counts.
    Captured 1024 x 1024 tiles of the pipeline, kernels with and without it interleaved in one
    process (one thread, minima of 30 calls, ns a pair): rows 1.24-1.25 -> 0.96-1.03 and columns
    1.61-1.85 -> 1.37-1.52 at R = 49; rows 2.05-2.20 -> 1.68-1.91, columns 2.6-3.0 -> 2.4-3.1 at
    R = 199. One compaction an interval (while one drops an eighth of the list) gained about half
    of that: each pass reloads the list it just wrote."""
    b0, a0 = _interval(up, p0, big_r, band, 0)
    b1, a1 = _interval(up, p0, big_r, band, 1)
    b2, a2 = _interval(up, p0, big_r, band, 2)
    b3, a3 = _interval(up, p0, big_r, band, 3)
    intervals = (b0, a0, b1, a1, b2, a2, b3, a3)
    whole = -(-n // 8) * 8
    vals[n:whole] = np.nan  # the last block's spare lanes (``vals`` has 8): kept, then dropped
    kept = n0 = n1 = n2 = n3 = 0
    for c in range(0, whole, 8):
        kept, m0, m1, m2, m3 = compress8_peel(vals, refs, kept, c, intervals, COMPRESS_TABLE)
        n0 += m0
        n1 += m1
        n2 += m2
        n3 += m3
    kept -= whole - n  # the padding, kept in order after every real entry
    for k, m in enumerate((n0, n1, n2, n3)):
        if k < big_r - 1:
            cnt[c0 + big_r - 1 - k] += m
    return kept


@numba.njit(nogil=True, cache=CACHE, boundscheck=False)
def _place(
    vals: np.ndarray,
    refs: np.ndarray,
    n: int,
    ref0: int,
    i: int,
    gi: int,
    state: Counting,
    buckets: np.ndarray,
    dirty: np.ndarray,
    held: Deferred,
) -> None:
    """Count ``n`` entries of query ``gi`` (row state ``i``) at or above its lowest bound.

    ``vals[u]`` is the float32 closeness of reference ``ref0 + refs[u]``, a negative (the
    positives were set to ``-inf``; :func:`ap_from_counts` places them). The row's state is
    prefetched first (a symmetric tile visits each row for only 1024 entries, and the state of
    the rows between two visits evicts it: captured 1024 x 1024 tiles at 199 positives a row,
    one thread, rows 2.56-2.75 against 2.77-3.47 ns a pair, columns 3.23-3.80 against
    3.84-4.14; no change over wide tiles or at 49 positives). The lowest intervals are counted
    first (:func:`_peel_lowest`), then two branch-free passes: the bucket and the table
    (``cnt[e] += 1`` for a bucket away from every positive; the others are listed with their
    table entry) and the listed entries, placed by a step over the next bound (a scan where a
    bucket holds more); one within ``tol`` of a positive is held for an exact comparison in
    float64 (:func:`_flush_exact`, when ``held`` is full and at the end of the tile; ties by the
    original index). Without a branch on the step and on the band, 3-6 % less time at R = 199
    and 0-8 % at R = 49 (captured tiles, interleaved, minima of 40 calls).
    """
    pos_ptr, up = state.pos_ptr, state.up
    lo, scale, table, cnt = state.lo, state.scale, state.table, state.cnt
    band = state.band[i]
    n_buckets = table.shape[1]
    top = np.float32(n_buckets - 1)
    low = lo[i]
    sc = scale[i]
    p0 = pos_ptr[i]
    big_r = pos_ptr[i + 1] - p0
    c0 = p0 + i  # the row's counts: cnt[c0 : c0 + R], then one spare slot
    tab = table[i]
    # the row's state towards the core before it is read at random
    for b in range(0, n_buckets, 64 // tab.itemsize):
        prefetch(tab, b)
    for e in range(c0, c0 + big_r + 1, 16):
        prefetch(cnt, e)
    for e in range(p0, p0 + big_r, 16):
        prefetch(up, e)
    n = _peel_lowest(vals, refs, n, up, p0, big_r, band, cnt, c0)
    n_dirty = 0
    for u in range(n):  # branch-free: a listed entry is counted in the spare slot
        e = np.int64(tab[np.uint32(min((vals[u] - low) * sc, top))])  # x >= low: bucket >= 0
        dirty[n_dirty] = u
        buckets[n_dirty] = e
        n_dirty += e < 0
        cnt[c0 + (e if e >= 0 else big_r)] += 1
    n_held = 0
    for t in range(n_dirty):  # branch-free again; the held ones are listed over the first ones
        u = dirty[t]
        x = vals[u]
        e = -1 - np.int64(buckets[t])
        e += x < up[p0 + e]  # one step over a bound: x >= up[R - 1], so e stays below R
        while x < up[p0 + e]:  # rare: more bounds in the bucket
            e += 1
        near = x <= band_top(up[p0 + e], band)  # within the band of positive e: held
        dirty[n_held] = u
        buckets[n_held] = e
        n_held += near
        cnt[c0 + (big_r if near else e)] += 1
    for t in range(n_held):
        u = dirty[t]
        h = held.count[0]
        if h == held.row.shape[0]:
            _flush_exact(state, held)
            h = 0
        held.row[h], held.query[h], held.ref[h] = i, gi, ref0 + refs[u]
        held.value[h], held.first[h] = vals[u], p0 + buckets[t]
        held.count[0] = h + 1


@numba.njit(inline="always")
def _append(vals: np.ndarray, refs: np.ndarray, k: int, n: int, x: np.float32, r: int,
            low: np.float32) -> int:
    """Branch-free append of ``(x, r)`` to compacted row ``k``; kept when ``x >= low``."""
    vals[k, n] = x
    refs[k, n] = r
    return n + (x >= low)


@numba.njit(nogil=True, cache=CACHE, boundscheck=False)
def count_rows(
    s: np.ndarray,
    row0: int,
    col0: int,
    state0: int,
    state: Counting,
    scratch: tuple,
) -> None:
    """Count every reference of a float32 closeness tile into its row's ``cnt`` (see the module).

    ``s[k, r, c]`` is the closeness of query ``row0 + r`` and reference ``col0 + k w + c``: the
    tile as blocks of ``w`` columns side by side (one block for a square tile; ``-inf`` pads
    the last); row state is indexed from global row ``state0``. Each query's positives (its
    class's interval of references, which holds the query itself on a self-search) are first
    set to ``-inf`` in ``s``, so they are never counted, here or by :func:`count_columns` on the
    same tile. A row's entries from every block are compacted into one list, then placed.
    ``scratch`` is :func:`counting_scratch` of at least the tile's longer side.
    """
    vals, refs, buckets, dirty, _, held = scratch
    lo = state.lo
    nb, nr, w = s.shape
    for k in range(nb):
        for r in range(nr):
            first = max(state.pos_first[row0 + r] - col0 - k * w, 0)
            last = min(state.pos_last[row0 + r] - col0 - k * w, w)
            for c in range(first, last):
                s[k, r, c] = -np.inf
    whole = w - w % 8
    for r in range(nr):
        i = row0 + r - state0
        low = lo[i]
        if low == np.inf:
            continue
        n = 0
        for k in range(nb):
            row = s[k, r]
            for c in range(0, whole, 8):  # the entries at or above the lowest bound, 8 at a time
                n = compress8(vals[0], refs[0], n, row, c, low, COMPRESS_TABLE, k * w + c)
            for c in range(whole, w):
                n = _append(vals, refs, 0, n, row[c], k * w + c, low)
        if n:
            _place(vals[0], refs[0], n, col0, i, row0 + r, state, buckets, dirty, held)
    _flush_exact(state, held)


@numba.njit(nogil=True, cache=CACHE, boundscheck=False)
def count_columns(
    s: np.ndarray,
    row0: int,
    col0: int,
    state0: int,
    state: Counting,
    scratch: tuple,
) -> None:
    """:func:`count_rows` for the transposed tile without transposing it: column ``c`` of ``s``
    is query ``col0 + c`` (state ``col0 + c - state0``) against references ``row0 + r`` (a
    self-search tile off the diagonal, after :func:`count_rows`: a query's class interval is
    the same set of rows as of columns, so its positives are already ``-inf``).

    Eight columns at a time: each 8 x 8 block is transposed in registers and its columns
    compacted eight entries at a time; the rows past the last whole block, and the columns past
    the last group of eight, one entry at a time.
    """
    vals, refs, buckets, dirty, block, held = scratch
    lo = state.lo
    nr, nc = s.shape
    for c0 in range(0, nc, 8):
        i0 = col0 + c0 - state0
        if c0 + 8 > nc:  # the last few columns, one at a time
            for k in range(nc - c0):
                low = lo[i0 + k]
                if low == np.inf:
                    continue
                n = 0
                for r in range(nr):
                    n = _append(vals, refs, k, n, s[r, c0 + k], r, low)
                if n:
                    _place(vals[k], refs[k], n, row0, i0 + k, col0 + c0 + k, state, buckets, dirty,
                           held)
            continue
        l0, l1, l2, l3 = lo[i0], lo[i0 + 1], lo[i0 + 2], lo[i0 + 3]
        l4, l5, l6, l7 = lo[i0 + 4], lo[i0 + 5], lo[i0 + 6], lo[i0 + 7]
        n0 = n1 = n2 = n3 = n4 = n5 = n6 = n7 = 0
        whole = nr - nr % 8
        for r in range(0, whole, 8):  # an 8 x 8 block: transposed in registers, then compacted
            transpose8(s, r, c0, block)
            n0 = compress8(vals[0], refs[0], n0, block[0], 0, l0, COMPRESS_TABLE, r)
            n1 = compress8(vals[1], refs[1], n1, block[1], 0, l1, COMPRESS_TABLE, r)
            n2 = compress8(vals[2], refs[2], n2, block[2], 0, l2, COMPRESS_TABLE, r)
            n3 = compress8(vals[3], refs[3], n3, block[3], 0, l3, COMPRESS_TABLE, r)
            n4 = compress8(vals[4], refs[4], n4, block[4], 0, l4, COMPRESS_TABLE, r)
            n5 = compress8(vals[5], refs[5], n5, block[5], 0, l5, COMPRESS_TABLE, r)
            n6 = compress8(vals[6], refs[6], n6, block[6], 0, l6, COMPRESS_TABLE, r)
            n7 = compress8(vals[7], refs[7], n7, block[7], 0, l7, COMPRESS_TABLE, r)
        for r in range(whole, nr):  # the last rows: eight compactions at once
            row = s[r]
            n0 = _append(vals, refs, 0, n0, row[c0], r, l0)
            n1 = _append(vals, refs, 1, n1, row[c0 + 1], r, l1)
            n2 = _append(vals, refs, 2, n2, row[c0 + 2], r, l2)
            n3 = _append(vals, refs, 3, n3, row[c0 + 3], r, l3)
            n4 = _append(vals, refs, 4, n4, row[c0 + 4], r, l4)
            n5 = _append(vals, refs, 5, n5, row[c0 + 5], r, l5)
            n6 = _append(vals, refs, 6, n6, row[c0 + 6], r, l6)
            n7 = _append(vals, refs, 7, n7, row[c0 + 7], r, l7)
        counts = (n0, n1, n2, n3, n4, n5, n6, n7)
        for k in range(8):
            n = counts[k]
            if n and lo[i0 + k] != np.inf:
                _place(vals[k], refs[k], n, row0, i0 + k, col0 + c0 + k, state, buckets, dirty,
                       held)
    _flush_exact(state, held)


def counting_scratch(side: int) -> tuple:
    """One worker's scratch for :func:`count_rows` / :func:`count_columns` on tiles of at most
    ``side`` rows and columns: eight compacted lines (values, columns; 8 spare lanes for
    :func:`dmlkit.metrics._simd.compress8`), the buckets and listed entries, an 8 x 8 block, the
    entries held for an exact comparison (:func:`deferred_scratch`)."""
    return (np.empty((8, side + 8), np.float32), np.empty((8, side + 8), np.int32),
            np.empty(side, np.int32), np.empty(side, np.int32), np.empty((8, 8), np.float32),
            deferred_scratch(side))


def counting_scratch_bytes(side: int) -> int:
    """The bytes of one worker's :func:`counting_scratch` for tiles of ``side``."""
    return sum(part.nbytes if isinstance(part, np.ndarray) else sum(a.nbytes for a in part)
               for part in counting_scratch(side))


@numba.njit(nogil=True, cache=CACHE)
def ap_from_counts(pos_ptr: np.ndarray, cnt: np.ndarray, out: np.ndarray) -> None:
    """``AP = (1/R) sum_p (p + 1) / rank_p`` with ``rank_p = sum_{e <= p} (cnt[e] + 1)`` (0 for
    R = 0): ``cnt`` counts the negatives, and positive ``e`` itself ranks after ``e`` positives.
    Row ``i``'s counts start at ``cnt[pos_ptr[i] + i]`` (each row has a spare slot after them)."""
    for i in range(out.shape[0]):
        p0, p1 = pos_ptr[i], pos_ptr[i + 1]
        total = 0.0
        rank = 0
        for p in range(p0, p1):
            rank += cnt[p + i] + 1
            total += (p - p0 + 1) / rank
        out[i] = total / (p1 - p0) if p1 > p0 else 0.0
