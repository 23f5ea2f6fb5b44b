"""Numba kernels of the re-identification protocol (ranks of the positives, Jaccard sums).

Both kernels release the GIL; the callers run them on a few Python threads over row ranges.
"""

from __future__ import annotations

import numba
import numpy as np

from dmlkit.metrics._numba_cache import CACHE  # a writable cache folder, or none (no crash)

__all__ = ["jaccard_rows", "rank_rows"]


@numba.njit(nogil=True, cache=CACHE, boundscheck=False)
def rank_rows(scores, row0, row1, sign, q_ids, q_cams, q_lo, q_hi, by_id, g_ids, g_cams, g_junk,
              same_cam, trapezoid, first, ap, inp, npos, tied):  # pragma: no cover - compiled
    """Ranks of the positives of query rows ``row0 .. row1 - 1`` of a score block.

    ``sign * scores[r, j]`` (float32 or float64, compared in that precision) is the closeness
    (larger = closer) of query ``r`` and gallery item ``j``; the ranking is by closeness, ties by gallery index. The candidate positives of row
    ``r`` are ``by_id[q_lo[r]:q_hi[r]]`` (gallery indices with the query's id, ascending).
    Junk items (``g_junk``, and same id + same camera when ``same_cam``) are removed before
    ranking. A positive's 0-based rank is the number of kept items ranked before it:
    positives are sorted by (closeness desc, index asc); every kept negative is
    binary-searched into that order (``O(G log P)`` per query, no sort of the row) and the
    counts are prefix-summed. ``tied[r]``: a kept negative scores exactly as a positive (the
    two are then ordered by gallery index, not by the features).
    """
    n_gallery = scores.shape[1]
    for r in range(row0, row1):
        row = scores[r]
        qid = q_ids[r]
        qcam = q_cams[r]
        k = 0
        ps = np.empty(q_hi[r] - q_lo[r], dtype=scores.dtype)  # float32 or float64 scores
        pj = np.empty(q_hi[r] - q_lo[r], dtype=np.int64)
        for t in range(q_lo[r], q_hi[r]):
            j = by_id[t]
            if g_junk[j] or (same_cam and g_cams[j] == qcam):
                continue
            ps[k] = sign * row[j]
            pj[k] = j
            k += 1
        npos[r] = k
        tied[r] = False
        if k == 0:
            first[r] = -1
            ap[r] = np.nan
            inp[r] = np.nan
            continue
        ps = ps[:k]
        pj = pj[:k]
        order = np.argsort(-ps, kind="mergesort")  # stable: equal scores keep index order
        ps = ps[order]
        pj = pj[order]
        lowest = ps[k - 1]
        counts = np.zeros(k + 1, dtype=np.int64)
        for j in range(n_gallery):
            if g_junk[j] or g_ids[j] == qid:
                continue
            s = sign * row[j]
            if s < lowest:  # below every positive: the common case, no search
                counts[k] += 1
                continue
            lo = 0
            hi = k
            while lo < hi:  # first positive that does NOT rank before item j
                mid = (lo + hi) >> 1
                if ps[mid] > s or (ps[mid] == s and pj[mid] < j):
                    lo = mid + 1
                else:
                    hi = mid
            counts[lo] += 1
            if (lo < k and ps[lo] == s) or (lo > 0 and ps[lo - 1] == s):
                tied[r] = True
        ahead = 0
        total = 0.0
        rank = 0
        for m in range(k):
            ahead += counts[m]
            rank = m + ahead
            precision = (m + 1) / (rank + 1.0)
            if trapezoid:
                old = m / rank if rank > 0 else 1.0
                total += 0.5 * (old + precision)
            else:
                total += precision
            if m == 0:
                first[r] = rank
        ap[r] = total / k
        inp[r] = k / (rank + 1.0)


@numba.njit(nogil=True, cache=CACHE, boundscheck=False)
def jaccard_rows(row0, row1, q_ptr, q_col, q_val, inv_ptr, inv_row, inv_val, col0, n_cols,
                 out):  # pragma: no cover - compiled
    """``out[r - row0, c] = sum_k min(V[r, k], V[col0 + c, k])`` for rows ``row0 .. row1 - 1``.

    ``V`` is given twice: by rows (CSR ``q_ptr, q_col, q_val``) for the query rows and by
    columns (``inv_*``: for each column ``k`` the rows holding it, an inverted index) for the
    gallery rows. Only gallery rows ``col0 .. col0 + n_cols - 1`` are accumulated.
    """
    for r in range(row0, row1):
        acc = out[r - row0]
        for t in range(q_ptr[r], q_ptr[r + 1]):
            k = q_col[t]
            v = q_val[t]
            for u in range(inv_ptr[k], inv_ptr[k + 1]):
                c = inv_row[u] - col0
                if c < 0 or c >= n_cols:
                    continue
                w = inv_val[u]
                acc[c] += v if v < w else w


@numba.njit(nogil=True, cache=CACHE, boundscheck=False)
def _reciprocal(nn, i, k, out):  # pragma: no cover - compiled
    """``R(i)``: the items ``j`` of ``nn[i, :k]`` with ``i`` in ``nn[j, :k]``; returns the count."""
    n = 0
    for a in range(k):
        j = nn[i, a]
        for b in range(k):
            if nn[j, b] == i:
                out[n] = j
                n += 1
                break
    return n


@numba.njit(nogil=True, cache=CACHE, boundscheck=False)
def expanded_reciprocal_sets(nn, k_full, k_half, buf, lengths):  # pragma: no cover - compiled
    """Expanded k-reciprocal sets ``R*(i)`` (Zhong et al. 2017, Eq. 6), sorted, into ``buf``.

    ``nn``: ``(N, >= k_full)`` nearest items (self first); ``k_full = k1 + 1``,
    ``k_half = round(k1 / 2) + 1``. A candidate ``j in R(i, k1)`` adds ``R(j, k1 / 2)`` when
    more than 2/3 of the latter lies in ``R(i, k1)``.
    """
    n_items = nn.shape[0]
    main = np.empty(k_full, dtype=np.int64)
    cand = np.empty(k_half, dtype=np.int64)
    for i in range(n_items):
        n_main = _reciprocal(nn, i, k_full, main)
        length = 0
        for a in range(n_main):
            buf[i, length] = main[a]
            length += 1
        for a in range(n_main):
            n_cand = _reciprocal(nn, main[a], k_half, cand)
            shared = 0
            for b in range(n_cand):
                for c in range(n_main):
                    if cand[b] == main[c]:
                        shared += 1
                        break
            if shared > 2.0 / 3.0 * n_cand:
                for b in range(n_cand):
                    buf[i, length] = cand[b]
                    length += 1
        row = np.unique(buf[i, :length])
        for a in range(row.size):
            buf[i, a] = row[a]
        lengths[i] = row.size
