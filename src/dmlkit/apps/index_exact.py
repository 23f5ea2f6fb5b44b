"""Exact scoring on an :class:`~dmlkit.apps.index.EmbeddingIndex`'s stored float32 vectors.

* :func:`exact_search`: the exact ``k`` nearest rows, closest first, ties by row: the ranking
  by the float64 closeness :mod:`dmlkit.metrics` orders by (:func:`closeness64`), so the same
  neighbours as its near-tie-settled results. A float32 scan picks ``2k + 16`` candidates,
  float64 scores order them, and a proven error bound checks that no other row can be among
  the ``k`` (below). The scan is faiss's brute-force kNN (``faiss.knn``: SIMD inner products
  or L2 with a heap per query, BLAS for 20+ queries; no copy of the vectors) when faiss is
  installed and the scan ranks like the distance: raw vectors for ``dot`` / ``euclidean``
  without normalisation, and rows unit-norm within float32 rounding (:func:`unit_tolerance`)
  for the normalised distances. Otherwise a numpy matmul with the cached ``1/|x|`` factors
  picks the candidates (few queries) or :func:`dmlkit.metrics.knn` searches blockwise (many).
* :func:`candidate_scores`: the scores of given candidate rows (IVF-PQ's exact re-ranking of
  its ``rerank * k`` candidates, "re-ranking with source coding", Jegou et al., ICASSP 2011).

Scores: cosine ``<q, x> / (|q| |x|)``; dot ``<q, x>``; euclidean ``|q - x|``; with
``unit=True`` (cosine, or ``normalize=True``) both sides are L2-normalised first.

**Completeness.** Every scan value lies within a bound ``e`` of its row's float64 closeness
(:func:`_scan_error`: :func:`dmlkit.distances.rounding_bound` of the float32 product in any
summation order, the rows' deviation from unit norm for a raw inner-product scan of unit
distances, and the roundings of normalisation and conversion). A row the scan left out has a
scan value of at most the last candidate's, so a float64 closeness of at most that plus
``e``: when this is below the ``k``-th float64 closeness among the candidates, no row left out
belongs to the ``k`` (the argument of :func:`dmlkit.metrics.near_ties.settle_near_ties`).
Otherwise (near-duplicates, ties) the query is searched again, exactly: every row whose float32
closeness is within ``e`` of that ``k``-th value is re-scored (:func:`_complete`). A fixed
``2k + 16`` alone missed the nearest row behind 40 rows of norm ``1 + 4.5e-6`` that a raw
inner product ranked ahead of it, and near-duplicates came out of float64 order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from dmlkit.distances import get_distance, rounding_bound
from dmlkit.exceptions import DataError, DependencyError, ShapeError, require
from dmlkit.validation import check_embeddings, normalize_rows

__all__ = [
    "InverseNorms", "RowNorms", "candidate_scores", "closeness64", "exact_search", "first_kept",
    "row_norms", "to_numpy_embeddings",
]

SMALL_EXACT = 2**22  # numpy path: Q x M <= this many scores in one matmul, else the blockwise kNN
CANDIDATE_MARGIN = 16  # candidates = 2k + this; the float64 scores order them
U32 = 2.0**-24  # float32's unit roundoff
#: The largest norm of a row normalised in float64 and rounded to float32
#: (:func:`dmlkit.validation.normalize_rows`: each entry within ``u`` of ``x / |x|``).
UNIT_NORM = 1 + 2 * U32
#: What separate normalisations and the scans' last roundings add to a unit distance's scan
#: error, in units of the closeness (at most ~8 u on every path; :func:`_candidates`): the
#: same row normalised by two calls (an entry may round either way, 2 u per side), the
#: ``1/|x|`` factor and its product (2 u), and for ``euclidean`` the unit rows' ``|x|^2`` being
#: 1 only within 2 u (``1 - |a - b|^2 / 2 = <a, b> + (2 - |a|^2 - |b|^2) / 2``).
NORMALISATION_SLACK = 10 * U32
#: Magnitudes within which a float32 scan neither underflows nor overflows (float32 holds
#: 1.2e-38 to 3.4e38): the products ``|q| |x|`` of a scan of unit distances, and the nonzero
#: row norms (a unit query's products are about ``|x|``). Rows beyond it are searched by
#: :func:`dmlkit.metrics.knn`, which normalises in float64 first.
SCAN_NORMS = (1e-30, 1e30)
RESCORE_BLOCK = 1024  # queries per float64 re-scoring block at most (bounds its Q x C x D memory)
RESCORE_BYTES = 2**25  # float64 bytes of one block's gathered (B, C, D) candidates at most (32 MiB)


def to_numpy_embeddings(x: Any, name: str) -> np.ndarray:
    """``x`` as a float32 ``(N, D)`` array, validated by :func:`dmlkit.validation.check_embeddings`.

    Fast path (the per-query hot path of a service): a C-contiguous float32 numpy array whose
    values are all finite and well inside float32's range is used as is; anything else goes
    through the shared validation, which raises its one-line error or converts.
    """
    if hasattr(x, "ndim") and x.ndim == 1:
        raise ShapeError(f"{name} must be a non-empty (M, D) array, got shape {tuple(x.shape)}: "
                         "reshape a single vector with x[None]")
    if (isinstance(x, np.ndarray) and x.dtype == np.float32 and x.ndim == 2 and x.size
            and x.flags.c_contiguous and bool(x.max() < 1e15) and bool(x.min() > -1e15)):  # NaN fails
        return x
    return np.ascontiguousarray(check_embeddings(x, name).detach().cpu().numpy(), dtype=np.float32)


@dataclass(frozen=True)
class RowNorms:
    """Per-row facts of the stored vectors: ``sq = |x|^2`` (float64), ``factor`` (float32:
    ``1/|x|`` for unit distances, else ``|x|^2 / 2``), whether every row is unit-norm within
    float32 rounding (:func:`unit_tolerance`), the smallest and largest nonzero row norms (1
    when there are none) and the largest deviation of a norm from 1."""

    sq: np.ndarray
    factor: np.ndarray
    unit_rows: bool
    low: float = 1.0
    high: float = 1.0
    #: ``max | |x| - 1 |`` over the rows (what a raw inner-product scan adds to its error)
    deviation: float = 0.0

    @property
    def scan_safe(self) -> bool:
        """Whether every nonzero row norm is within :data:`SCAN_NORMS` (a float32 scan of unit
        queries against the rows picks the right candidates)."""
        return SCAN_NORMS[0] <= self.low and self.high <= SCAN_NORMS[1]


def _refuse_damaged(bad: np.ndarray, rows: np.ndarray) -> None:
    """A :class:`DataError` naming the first stored row flagged ``bad`` (same shape as ``rows``):
    a non-finite vector, checked on build and on load into memory, so a damaged memory-mapped
    file (its NaN row would otherwise never be returned)."""
    if bad.any():
        raise DataError(f"stored vector {int(rows[bad].flat[0])} of the index is not finite: the "
                        "index file is damaged; rebuild it")


def _inverse_norm(sq: np.ndarray) -> np.ndarray:
    """``1/|x|`` from ``|x|^2`` (float64), finite in float32: 0 for zero rows (whose scores are
    0), at most float32's largest value. ``1/sqrt(1e-300)`` overflowed float32 to inf, and the
    zero row's ``0 * inf`` scored NaN, which the candidate scan ranked above every real row."""
    with np.errstate(divide="ignore"):
        inv = np.where(sq > 0, 1 / np.sqrt(sq), 0.0)
    return np.minimum(inv, np.finfo(np.float32).max)


def unit_tolerance(d: int) -> float:
    """The largest ``| |x|^2 - 1 |`` of a ``d``-dimensional row that counts as unit-norm for the
    raw inner-product scan: what normalising in float32 leaves. A norm summed in float32 in any
    order is within ``gamma_d ~ d u`` of ``|x|^2`` (relative), its square root and the division
    round once each (``u``), so the result's ``|x|^2`` is within ``(d + 4) u`` of 1 to first
    order: :func:`dmlkit.distances.rounding_bound` of the row with itself (``1.01 (d + 4) u``,
    1.2e-6 at d = 16, 7.9e-6 at d = 128). Rows further off are scanned with their ``1/|x|``
    factors (the fixed 1e-5 let rows of norm ``1 + 4.5e-6`` at d = 16 through, whose raw
    inner products outranked the nearest row)."""
    return rounding_bound("ip", d, 1.0, 1.0)


def row_norms(x: np.ndarray, unit: bool) -> RowNorms:
    """:class:`RowNorms` of ``x`` (one pass over the vectors)."""
    sq = np.einsum("ij,ij->i", x, x, dtype=np.float64)
    _refuse_damaged(~np.isfinite(sq), np.arange(x.shape[0]))
    factor = _inverse_norm(sq) if unit else sq / 2
    unit_rows = bool(sq.size == 0 or np.abs(sq - 1).max() <= unit_tolerance(x.shape[1]))
    deviation = float(np.abs(np.sqrt(sq) - 1).max()) if sq.size else 0.0
    nonzero = np.sqrt(sq[sq > 0])
    low, high = (float(nonzero.min()), float(nonzero.max())) if nonzero.size else (1.0, 1.0)
    return RowNorms(sq, factor.astype(np.float32), unit_rows, low, high, deviation)


class InverseNorms:
    """``1/|x|`` of rows of ``x``, computed the first time a row is asked for.

    Re-ranking needs it only for its candidates, so a memory-mapped index reads the pages of
    the rows it re-ranks, not the whole matrix (:func:`row_norms` is one pass over all rows).
    """

    #: Rows per computation step (bounds the gathered copy: 64 Ki x D floats).
    STEP = 65536

    def __init__(self, x: np.ndarray) -> None:
        self.x = x
        self.value = np.full(x.shape[0], np.nan, dtype=np.float32)

    def of(self, rows: np.ndarray) -> np.ndarray:
        """``1/|x[rows]|`` (any shape of row indices)."""
        found = self.value[rows]
        missing = np.isnan(found)
        if missing.any():
            need = np.unique(rows[missing])
            for a in range(0, need.size, self.STEP):
                part = need[a : a + self.STEP]
                block = np.asarray(self.x[part])
                sq = np.einsum("ij,ij->i", block, block, dtype=np.float64)
                _refuse_damaged(~np.isfinite(sq), part)
                self.value[part] = _inverse_norm(sq)
            found = self.value[rows]
        return found


@functools.cache
def _faiss_or_none() -> Any:
    try:
        return require("faiss", "faiss")
    except DependencyError:
        return None


def _scan_metric(x: np.ndarray, distance: str, unit: bool, norms: RowNorms) -> int | None:
    """The faiss metric whose brute-force scan of ``x`` ranks like the distance, or ``None``."""
    faiss = _faiss_or_none()
    if faiss is None or x.dtype != np.float32 or not x.flags.c_contiguous:
        return None
    if unit:  # <q, x> ranks like cosine and like -|q/|q| - x| when every |x| = 1
        return faiss.METRIC_INNER_PRODUCT if norms.unit_rows else None
    return faiss.METRIC_L2 if distance == "euclidean" else faiss.METRIC_INNER_PRODUCT


def exact_search(x: np.ndarray, q: np.ndarray, k: int, distance: str, unit: bool, norms: RowNorms
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Exact ``(rows, scores)`` of the ``k`` nearest rows of ``x`` for each query, ``(Q, k)`` each:
    the float64 closeness order (:func:`closeness64`), ties by row (see the module for why the
    candidates are complete).

    Args:
        x: ``(M, D)`` float32 stored vectors; q: ``(Q, D)`` float32 queries.
        distance: ``cosine``, ``dot`` or ``euclidean``; unit: L2-normalise both sides first.
        norms: :func:`row_norms` of ``x`` (cached by the index).
    """
    m = x.shape[0]
    k = min(k, m)
    c = min(m, 2 * k + CANDIDATE_MARGIN)
    if not unit and not _raw_scan_safe(q, distance, norms):  # a float64 scan: no float32 bound needed
        pos, score = _rescore(x, q, _float64_candidates(x, q, c, distance), k, distance, unit)
        return pos, _to_values(score, distance)
    found = _candidates(x, q, c, distance, unit, norms)
    pos, score = _rescore(x, q, found.rows, k, distance, unit)
    if c < m:
        kth = bound_units(score[:, -1], distance, unit)
        open_rows = np.flatnonzero(found.last + found.error >= kth)  # a row left out may belong
        if open_rows.size:
            pos[open_rows], score[open_rows] = _complete(x, q[open_rows], kth[open_rows], k, distance, unit,
                                                         norms)
    return pos, _to_values(score, distance)


@dataclass(frozen=True)
class _Candidates:
    """A float32 scan's ``(Q, c)`` candidate rows and, per query, the scan closeness of its worst
    candidate (``last``) and the bound on | scan closeness - float64 closeness | of every row
    (``error``), both in :func:`bound_units`."""

    rows: np.ndarray
    last: np.ndarray
    error: np.ndarray


def bound_units(score: np.ndarray, distance: str, unit: bool) -> np.ndarray:
    """:func:`closeness64` values (larger = closer) in the units the scans' error bounds are in:
    the inner product for ``cosine`` / ``dot``; for ``euclidean`` ``1 - |a - b|^2 / 2`` of unit
    rows (an inner product of unit rows) and ``-|q - x|^2`` of raw ones. Increasing in the
    closeness, so the order is the same."""
    if distance != "euclidean":
        return score.astype(np.float64)
    sq = np.square(score, dtype=np.float64)
    return 1 - sq / 2 if unit else -sq


def _scan_error(kind: str, d: int, qn: Any, xn: float, extra: Any = 0.0) -> np.ndarray:
    """Bound on | scan closeness - float64 closeness |: :func:`dmlkit.distances.rounding_bound`
    of the float32 scan (any summation order), the same in float64 (:func:`closeness64`'s own
    rounding and the conversions of :func:`bound_units`) and ``extra``; ``qn`` the query norms
    (per query or one), ``xn`` the largest row norm."""
    qn = np.asarray(qn, dtype=np.float64)
    return rounding_bound(kind, d, qn, xn) + rounding_bound(kind, d, qn, xn, 2.0**-52) + extra


def _candidates(x: np.ndarray, q: np.ndarray, c: int, distance: str, unit: bool, norms: RowNorms
                ) -> _Candidates:
    """The ``c`` best rows per query by a float32 scan, with the scan's error bound. Unit
    distances scan with the normalised queries (the closeness's own scale; no product of
    tiny or huge queries under- or overflows) and count in inner products of unit rows."""
    m, d = x.shape
    euclid = distance == "euclidean"
    scan_q = normalize_rows(q) if unit else q
    qn = UNIT_NORM if unit else np.sqrt(np.einsum("ij,ij->i", q, q, dtype=np.float64))
    metric = _scan_metric(x, distance, unit, norms)
    if metric is not None:
        dist, rows = _faiss_or_none().knn(scan_q, x, c, metric)
        last = dist[:, -1].astype(np.float64)
        if unit:  # <q, x> of rows within unit_tolerance: off <q, x/|x|> by |q| | |x| - 1 |
            error = _scan_error("ip", d, qn, norms.high, qn * norms.deviation + NORMALISATION_SLACK)
        elif euclid:  # faiss's squared distances
            last, error = -last, _scan_error("l2", d, qn, norms.high)
        else:
            error = _scan_error("ip", d, qn, norms.high)
    elif q.shape[0] * m <= SMALL_EXACT and (norms.scan_safe or not unit):
        s = scan_q @ x.T
        if unit:  # <q, x / |x|>; zero rows of unit euclidean are 1 from every query: 1/2 in these units
            s *= norms.factor
            if euclid and not norms.sq.all():
                s[:, norms.sq == 0] = 0.5
        elif euclid:
            s -= norms.factor  # <q, x> - |x|^2 / 2 orders like -|q - x|^2
        rows = _top_rows(s, c) if c < m else np.tile(np.arange(m), (q.shape[0], 1))
        last = np.take_along_axis(s, rows, axis=1).min(axis=1).astype(np.float64)
        if unit:
            error = _scan_error("ip", d, qn, UNIT_NORM, NORMALISATION_SLACK)
        elif euclid:  # 2 <q, x> - |x|^2 - |q|^2 with the roundings of both terms: within the l2 bound
            last, error = 2 * last - qn * qn, _scan_error("l2", d, qn, norms.high)
        else:
            error = _scan_error("ip", d, qn, norms.high)
    else:
        rows, last, error = _knn_candidates(x, q, c, distance, unit, qn, norms)
    return _Candidates(np.asarray(rows, dtype=np.int64), last,
                       np.broadcast_to(error, (q.shape[0],)))


def _knn_candidates(x: np.ndarray, q: np.ndarray, c: int, distance: str, unit: bool, qn: Any,
                    norms: RowNorms) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_candidates` by :func:`dmlkit.metrics.knn` (blockwise, many queries): inner
    products, or squared Euclidean distances (``power=2``: no square root to undo)."""
    from dmlkit.metrics import knn  # lazy: numba kernels load only when a large exact search runs

    euclid = distance == "euclidean"
    dist = get_distance(distance, normalize_embeddings=unit, **({"power": 2} if euclid else {}))
    res = knn(q, x, k=c, distance=dist, exclude_self=False)
    last = res.values[:, -1].numpy().astype(np.float64)
    rows, d, xn = res.indices.numpy(), x.shape[1], UNIT_NORM if unit else norms.high
    if not euclid:
        return rows, last, _scan_error("ip", d, qn, xn, NORMALISATION_SLACK if unit else 0.0)
    if unit:  # 1 - |a - b|^2 / 2: half the squared distance's bound
        return rows, 1 - last / 2, _scan_error("l2", d, qn, xn) / 2 + NORMALISATION_SLACK
    return rows, -last, _scan_error("l2", d, qn, xn)


#: Stored rows per block of :func:`_complete`'s scan, and queries per chunk of it.
COMPLETE_ROWS = 16384
COMPLETE_QUERIES = 256


def _complete(x: np.ndarray, q: np.ndarray, floor: np.ndarray, k: int, distance: str, unit: bool,
              norms: RowNorms) -> tuple[np.ndarray, np.ndarray]:
    """The exact top ``k`` ``(rows, float64 closeness)`` of queries whose scan candidates were not
    provably complete. ``floor``: their ``k``-th float64 closeness among the candidates
    (:func:`bound_units`); the true ``k`` nearest all have at least that closeness, so a float32
    closeness of at least ``floor - e`` (``e`` this scan's bound): every such row is re-scored
    in float64 and the best ``k`` kept after each block of rows (memory bounded however many
    rows tie: all of them, for duplicated rows)."""
    m, d = x.shape
    euclid = distance == "euclidean"
    scan_q = normalize_rows(q) if unit else q
    q_sq = np.einsum("ij,ij->i", q, q, dtype=np.float64)
    qn = UNIT_NORM if unit else np.sqrt(q_sq)
    if unit:
        error = _scan_error("ip", d, qn, UNIT_NORM, NORMALISATION_SLACK)
    else:
        error = _scan_error("l2" if euclid else "ip", d, qn, norms.high)
    low = floor - error
    out_r = np.empty((q.shape[0], k), np.int64)
    out_s = np.empty((q.shape[0], k), np.float64)
    for a in range(0, q.shape[0], COMPLETE_QUERIES):
        sl = slice(a, a + COMPLETE_QUERIES)
        best_r = np.empty((q[sl].shape[0], 0), np.int64)
        best_s = np.empty(best_r.shape, np.float64)
        for b in range(0, m, COMPLETE_ROWS):
            xb = np.asarray(x[b:b + COMPLETE_ROWS], dtype=np.float32)
            if unit:
                xb = normalize_rows(xb)
                g = (scan_q[sl] @ xb.T).astype(np.float64)
                if euclid:  # zero rows: 1 from every query
                    g[:, ~xb.any(axis=1)] = 0.5
            else:
                g = (scan_q[sl] @ xb.T).astype(np.float64)
                if euclid:
                    g = 2 * g - q_sq[sl, None] - np.einsum("ij,ij->i", xb, xb, dtype=np.float64)
            keep = g >= low[sl, None]
            width = int(keep.sum(axis=1).max())
            if not width:
                continue
            order = np.argsort(~keep, axis=1, kind="stable")[:, :width]
            rows, s = _rescore(x, q[sl], order + b, width, distance, unit,
                               valid=np.take_along_axis(keep, order, axis=1))
            rows, s = np.concatenate([best_r, rows], 1), np.concatenate([best_s, s], 1)
            pick = np.lexsort((rows, -s), axis=1)[:, :k]
            best_r, best_s = np.take_along_axis(rows, pick, 1), np.take_along_axis(s, pick, 1)
        if best_s.shape[1] < k or bool(np.isneginf(best_s[:, -1]).any()):
            # cannot happen with the bound above; never return a short row
            raise RuntimeError("exact index search found fewer candidates than neighbours: please report")
        out_r[sl], out_s[sl] = best_r, best_s
    return out_r, out_s


#: How far past the largest stored norm a raw Euclidean query may lie for the float32 scan: its
#: ``|q|^2 + |x|^2 - 2 <q, x>`` carries an error of about ``u |q|^2``, while the rows' distances
#: differ by about ``|q|`` times their spread (a query of norm 1e10 against unit rows: every
#: candidate of faiss's L2 scan was arbitrary).
QUERY_REACH = 4.0


def _raw_scan_safe(q: np.ndarray, distance: str, norms: RowNorms) -> bool:
    """Whether a float32 scan of raw (unnormalised) vectors ranks ``q`` against the rows: every
    product ``|q| |x|`` (and, for ``euclidean``, every ``|q|^2`` and ``|x|^2``) within
    :data:`SCAN_NORMS`, and for ``euclidean`` no query beyond :data:`QUERY_REACH` times the
    largest row norm. Else float32 overflowed (a query of 2e19: faiss's L2 of 4e38 is inf, its
    rows -1, and the answer was empty), underflowed (rows near 1e-25: every score 0, the first
    rows returned) or cancelled (above)."""
    qn = np.sqrt(np.einsum("ij,ij->i", q, q, dtype=np.float64)) if q.size else np.zeros(0)
    qn = qn[qn > 0]
    if not qn.size:
        return True
    low, high = float(qn.min()), float(qn.max())
    ok = low * norms.low >= SCAN_NORMS[0] and high * norms.high <= SCAN_NORMS[1]
    if distance == "euclidean":
        ok = (ok and min(low, norms.low) ** 2 >= SCAN_NORMS[0] and max(high, norms.high) ** 2 <= SCAN_NORMS[1]
              and high <= QUERY_REACH * norms.high)
    return ok


#: Stored rows per float64 block of :func:`_float64_candidates`.
FLOAT64_ROWS = 65536


def _float64_candidates(x: np.ndarray, q: np.ndarray, c: int, distance: str) -> np.ndarray:
    """The ``c`` best rows per query by float64 scores of raw vectors (``<q, x>``, or ``-|q -
    x|^2`` for ``euclidean``), ties by row: the scan for magnitudes a float32 scan cannot
    rank (:func:`_raw_scan_safe`). Blocks of rows and queries (at most 32 MiB of scores); slow,
    and only for such indexes or queries."""
    m = x.shape[0]
    q64 = q.astype(np.float64)
    out = np.empty((q.shape[0], c), np.int64)
    per = max(1, RESCORE_BYTES // (8 * min(m, FLOAT64_ROWS)))
    for a in range(0, q.shape[0], per):
        best_s = np.empty((min(per, q.shape[0] - a), 0))
        best_r = np.empty(best_s.shape, np.int64)
        for b in range(0, m, FLOAT64_ROWS):
            xb = np.asarray(x[b:b + FLOAT64_ROWS], dtype=np.float64)
            s = q64[a:a + per] @ xb.T
            if distance == "euclidean":  # minus the squared distance, |q|^2 included: what float64
                # resolves of it, so rows it cannot tell apart tie here too (ties by row)
                s = 2 * s - np.einsum("ij,ij->i", xb, xb) - np.einsum("ij,ij->i", q64[a:a + per], q64[a:a + per])[:, None]
            s = np.concatenate([best_s, s], 1)
            rows = np.concatenate([best_r, np.broadcast_to(np.arange(b, b + xb.shape[0]), (s.shape[0], xb.shape[0]))], 1)
            keep = np.lexsort((rows, -s), axis=1)[:, :c]
            best_s, best_r = np.take_along_axis(s, keep, 1), np.take_along_axis(rows, keep, 1)
        out[a:a + per] = best_r
    return out


def _top_rows(s: np.ndarray, c: int) -> np.ndarray:
    """The ``c`` rows of largest score per query, ``(Q, c)``; among rows tied with the ``c``-th
    score the first ones, as the faiss scan and :func:`dmlkit.metrics.knn` keep them
    (``argpartition`` alone kept any of them: more than ``c`` equal rows, duplicates or zero
    vectors, left the first ones out, and ties by row were broken)."""
    m = s.shape[1]
    if np.isnan(s).any():  # inf - inf of raw vectors beyond float32's range: never a candidate ahead of a number
        s = np.where(np.isnan(s), -np.inf, s)
    cand = np.argpartition(s, m - c, axis=1)[:, m - c:]
    v = np.take_along_axis(s, cand, axis=1).min(axis=1, keepdims=True)  # the c-th largest score
    tied = s == v
    left_out = tied.sum(axis=1) > (np.take_along_axis(s, cand, axis=1) == v).sum(axis=1)
    if left_out.any():  # some rows tied with the c-th were left out: keep the first tied rows
        rows = np.flatnonzero(left_out)
        above = s[rows] > v[rows]
        room = c - above.sum(axis=1, keepdims=True)
        keep = above | (tied[rows] & (np.cumsum(tied[rows], axis=1) <= room))
        cand[rows] = np.nonzero(keep)[1].reshape(rows.size, c)
    return cand


def _rescore(x: np.ndarray, q: np.ndarray, cand: np.ndarray, k: int, distance: str, unit: bool,
             valid: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Order candidate rows ``cand (Q, C)`` by float64 closeness (:func:`closeness64`), ties by
    row; keep ``k``. ``valid``: which candidates count (the others score ``-inf``)."""
    k = min(k, cand.shape[1])
    pos_out = np.empty((q.shape[0], k), dtype=np.int64)
    val_out = np.empty((q.shape[0], k), dtype=np.float64)
    # queries per block: a large k on wide vectors made 1024 x (2k + 16) x D float64 (8 GB at
    # k = 500, D = 512) and as much again in temporaries
    block = max(1, min(RESCORE_BLOCK, RESCORE_BYTES // (8 * max(1, cand.shape[1] * x.shape[1]))))
    for a in range(0, q.shape[0], block):
        c = cand[a:a + block]
        score = closeness64(x, q[a:a + block], c, distance, unit)
        if valid is not None:
            score[~valid[a:a + block]] = -np.inf
        order = np.lexsort((c, -score), axis=1)[:, :k]
        pos_out[a:a + block] = np.take_along_axis(c, order, axis=1)
        val_out[a:a + block] = np.take_along_axis(score, order, axis=1)
    return pos_out, val_out


def _to_values(score: np.ndarray, distance: str) -> np.ndarray:
    """Float64 closeness as the index's float32 scores (the Euclidean distance is ``-closeness``)."""
    return (-score if distance == "euclidean" else score).astype(np.float32)


def closeness64(x: np.ndarray, q: np.ndarray, rows: np.ndarray, distance: str, unit: bool) -> np.ndarray:
    """Float64 closeness (larger = closer: minus the Euclidean distance) of queries ``q (Q, D)``
    and rows ``rows (Q, C)`` of ``x``, from the float32 vectors: what exact search orders by.

    The value :mod:`dmlkit.metrics` ranks by: the rows as it prepares them (unit distances:
    :func:`dmlkit.validation.normalize_rows`, normalised in float64 and rounded once) and each
    pair's closeness from one function of the pair (torch's row form of
    :class:`dmlkit.metrics.near_ties.PairScorer`: no numba for an index),
    so ties, exact ones included, fall as in :func:`dmlkit.metrics.knn`: with the rows
    normalised in float64 and summed by numpy, integer embeddings whose cosines tie exactly
    came out an ulp apart, and the flat index and ``knn`` disagreed on 4 of 40 queries.
    Memory ``Q C D`` float32: callers pass blocks."""
    # lazy: the metrics package loads only when an index re-scores (as exact_search's knn)
    import torch

    from dmlkit.metrics.near_ties import PairScorer  # lazy: as torch above

    nq, c = rows.shape
    gathered = np.ascontiguousarray(x[rows.reshape(-1)], dtype=np.float32)
    queries = np.ascontiguousarray(q, dtype=np.float32)
    if unit:
        gathered, queries = normalize_rows(gathered), normalize_rows(queries)
    euclidean = distance == "euclidean"
    score = PairScorer(torch.from_numpy(queries), torch.from_numpy(gathered), euclidean, compiled=False)(
        torch.arange(nq).repeat_interleave(c), torch.arange(nq * c)).numpy().reshape(nq, c)
    return -np.sqrt(-score) if euclidean else score


def candidate_scores(x: np.ndarray, q: np.ndarray, pos: np.ndarray, distance: str, unit: bool,
                     inverse_norms: InverseNorms | None, q_unit: np.ndarray | None = None) -> np.ndarray:
    """Scores of queries ``q (Q, D)`` against rows ``pos (Q, C)`` of ``x``; ``-1`` rows score worst.

    ``inverse_norms``: ``1/|x|`` of the rows, needed for unit distances (cosine).
    ``q_unit``: the already L2-normalised queries, when the caller has them (unit distances).
    """
    safe = np.maximum(pos, 0)
    if unit:
        if inverse_norms is None:
            raise ValueError("unit distances need the rows' inverse norms")
        qn = normalize_rows(q) if q_unit is None else q_unit
        inverse = inverse_norms.of(safe)
        cos = _gathered_dots(x, qn, safe) * inverse
        s = _unit_distance(x, q, safe, cos, inverse > 0) if distance == "euclidean" else cos
    elif distance == "euclidean":  # direct squared differences: no cancellation for close pairs
        s = np.sqrt(_gathered_dots(x, q, safe, l2=True))
    else:
        s = _gathered_dots(x, q, safe)
    # NaN only from a NaN row (a product of finite rows that overflows is inf, not NaN)
    _refuse_damaged(np.isnan(s) & (pos >= 0), pos)
    s = s.astype(np.float32, copy=False)
    s[pos < 0] = np.inf if distance == "euclidean" else -np.inf
    return s


#: Below this ``2 - 2 cos``, float32's cancellation leaves too few digits: recomputed directly.
NEAR_UNIT = 1e-2


def _unit_distance(x: np.ndarray, q: np.ndarray, rows: np.ndarray, cos: np.ndarray,
                   nonzero: np.ndarray) -> np.ndarray:
    """``|q/|q| - x/|x||`` from the float32 cosines, ``sqrt(2 - 2 cos)``, except where that is
    below :data:`NEAR_UNIT`: there from the float64 difference of the unit rows. In float32,
    ``2 - 2 cos`` of near duplicates came in steps of about 1.2e-7 (distances in steps of
    3.5e-4, an identical row at 3.5e-4 and rows 1e-4 apart in either order). A zero row
    (``nonzero`` false) stays zero when normalised, so its distance is ``|q/|q|| = 1``, as the
    flat search and :mod:`dmlkit.distances` score it (``sqrt(2 - 2 cos)`` assumed a unit row
    and gave it sqrt(2), behind every row at less than 90 degrees)."""
    sq = np.maximum(np.where(nonzero, 2 - 2 * cos, 1), 0)
    qi, cj = np.nonzero(sq < NEAR_UNIT)
    if qi.size:
        r = x[rows[qi, cj]].astype(np.float64)
        r /= np.maximum(np.sqrt((r * r).sum(1, keepdims=True)), 1e-300)
        u = q[qi].astype(np.float64)
        u /= np.maximum(np.sqrt((u * u).sum(1, keepdims=True)), 1e-300)
        sq = sq.astype(np.float64)
        sq[qi, cj] = ((r - u) ** 2).sum(1)
    return np.sqrt(sq)


def _gathered_dots(x: np.ndarray, q: np.ndarray, rows: np.ndarray, l2: bool = False) -> np.ndarray:
    """``out[i, j] = <q[i], x[rows[i, j]]>`` (``l2``: ``|q[i] - x[rows[i, j]]|^2``) in float32.

    faiss's ``fvec_inner_products_by_idx`` / ``fvec_L2sqr_by_idx`` (no ``(Q, C, D)`` gather in
    Python) when faiss is installed, else a numpy gather.
    """
    faiss = _faiss_or_none()
    if faiss is None or x.dtype != np.float32 or not x.flags.c_contiguous:
        cand = x[rows]
        if l2:
            return ((cand - q[:, None, :]) ** 2).sum(-1)
        return np.matmul(cand, q[:, :, None])[..., 0]
    q = np.ascontiguousarray(q, dtype=np.float32)
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    out = np.empty(rows.shape, dtype=np.float32)
    fn = faiss.fvec_L2sqr_by_idx if l2 else faiss.fvec_inner_products_by_idx
    fn(faiss.swig_ptr(out), faiss.swig_ptr(q), faiss.swig_ptr(x), faiss.swig_ptr(rows), x.shape[1], q.shape[0],
       rows.shape[1])
    return out


def first_kept(drop: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of a neighbour list, the columns of its first ``k`` entries where ``drop`` is
    false, in their order (a stable sort of ``drop``), and which of those ``k`` are dropped ones
    after all (a row with fewer than ``k`` kept entries): take the list's columns in that order
    and mask the second array with ``-1``."""
    order = np.argsort(drop, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(drop, order, axis=1)
