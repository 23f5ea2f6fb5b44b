"""Full-ranking mean average precision (``map``) without sorting any row.

For a query with ``R`` same-class references, the average precision over the *full* ranking is

    AP = (1/R) sum_{p=1..R} p / rank_p = (1/R) sum_{p=1..R} p / (p + n_p),

where ``rank_p`` is the rank of the ``p``-th closest positive and ``n_p`` the number of
negatives ranked above it (ties by the smaller reference index, as everywhere in
:mod:`dmlkit.metrics`). So AP needs only, for every negative, *how many positives are closer* -
not a sort of the ``M`` references (``O(M log M)`` per query; the previous implementation did
not finish within 280 s at N = 50k). Per query:

1. the ``R`` positives' closeness in float64 (from the float32 embeddings), sorted;
2. every negative of a float32 closeness tile that is not below the lowest positive is placed
   among the sorted positives by a branch-free binary search (``O(log R)``); negatives below
   every positive change no precision and cost one comparison;
3. ``n_p`` are prefix sums of those placements.

Exact: a negative within the float32 rounding bound ``tol`` of a positive is compared with it
in float64 (ties by index), so the result is the AP of the float64 ranking whatever the BLAS
summation order (``tol`` is the worst-case error of a float32 inner product of length ``d``,
``(d + 4) 2^-24 |x| |y|``, Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
sec. 3.1). On a self-search each symmetric tile serves both of its row blocks (half the
arithmetic), as in the kNN (:mod:`dmlkit.metrics.knn`).
"""

from __future__ import annotations

import math
import threading
from queue import SimpleQueue

import numpy as np
import torch

from dmlkit.metrics._threads import run_threads, single_threaded_torch
from dmlkit.metrics.knn import _Tiles

__all__ = ["closeness_tolerance", "full_ranking_map"]

#: Bytes of per-positive state (float64 value, int64 reference, int64 count, int64 row).
_STATE_BYTES = 32
#: Bytes of per-row state (pointer, threshold, result).
_ROW_BYTES = 24


def closeness_tolerance(kind: str, d: int, q_max_norm: float, r_max_norm: float) -> float:
    """Worst-case difference between a float32 tile closeness and its float64 value.

    ``kind`` ``"ip"``: ``<x, y>`` summed in float32 in any order is within
    ``gamma_d sum |x_t y_t| <= (d + 1) u |x| |y|`` (``u = 2^-24``); ``"l2"`` (``2<x, y> - |x|^2 -
    |y|^2``): within ``(d + 4) u (|x| + |y|)^2``. Three extra ``u`` and 1 % cover the final
    roundings.
    """
    u = 2.0**-24
    scale = q_max_norm * r_max_norm if kind == "ip" else (q_max_norm + r_max_norm) ** 2
    return 1.01 * (d + 4) * u * scale + 1e-300


def full_ranking_map(
    scorer, q: torch.Tensor, r: torch.Tensor | None, query_labels: torch.Tensor,
    reference_labels: torch.Tensor, budget: int,
) -> torch.Tensor:
    """Per-query full-ranking AP (float64; 0 where a query has no positive).

    ``scorer`` is a symmetric :class:`dmlkit.metrics.knn._Scorer` (cosine, dot or Euclidean);
    ``q`` / ``r`` are its *prepared* float32 CPU rows; ``r=None`` is a self-search that leaves
    each query out of its own ranking.
    """
    # lazy: the numba kernels load only when a compiled path runs
    from dmlkit.metrics import _kernels

    same = r is None
    ref = q if same else r
    nq, m = q.shape[0], ref.shape[0]
    euclidean = scorer.kind == "l2"
    qn, rn = q.numpy(), ref.numpy()
    ql = query_labels.cpu().numpy().astype(np.int64, copy=False)
    rl = reference_labels.cpu().numpy().astype(np.int64, copy=False)
    classes, ref_codes = np.unique(rl, return_inverse=True)
    ref_codes = ref_codes.reshape(-1).astype(np.int64)
    pos = np.searchsorted(classes, ql).clip(0, max(classes.size - 1, 0))
    query_codes = np.where(classes[pos] == ql, pos, -1).astype(np.int64)
    class_count = np.bincount(ref_codes, minlength=classes.size).astype(np.int64)
    class_start = (np.cumsum(class_count) - class_count).astype(np.int64)
    by_class = np.argsort(ref_codes, kind="stable").astype(np.int64)
    r_count = np.where(query_codes >= 0, class_count[query_codes.clip(0)] - int(same), 0)
    r_count = r_count.clip(0).astype(np.int64)

    q_norm = float(q.norm(dim=1).max())
    r_norm = q_norm if same else float(ref.norm(dim=1).max())
    tol = closeness_tolerance(scorer.kind, q.shape[1], q_norm, r_norm)
    out = np.zeros(nq, dtype=np.float64)
    tiles = _Tiles(scorer, q, ref, bf16=False)

    # groups of query rows whose positive state fits in half the budget
    per_row = np.cumsum(r_count * _STATE_BYTES + _ROW_BYTES)
    groups, g0 = [], 0
    while g0 < nq:
        base = per_row[g0 - 1] if g0 else 0
        g1 = int(np.searchsorted(per_row, base + budget // 2, side="right"))
        g1 = min(nq, max(g1, g0 + 1))
        groups.append((g0, g1))
        g0 = g1

    with single_threaded_torch() as workers:
        tile = int(max(64, min(1024, math.isqrt(budget // (8 * workers)))))
        for g0, g1 in groups:
            if r_count[g0:g1].sum() == 0:
                continue
            group = _Group(g0, g1, r_count[g0:g1], query_codes, class_start, class_count, by_class,
                           same, qn, rn, euclidean, tol)
            group.scan(tiles, tile, workers, ql, rl, nq, m)
            _kernels.ap_from_gaps(group.pos_ptr, group.gaps, out[g0:g1])
    return torch.from_numpy(out)


class _Group:
    """The positives, lowest thresholds and gap counts of query rows ``g0:g1``."""

    def __init__(self, g0, g1, counts, query_codes, class_start, class_count, by_class, same,
                 qn, rn, euclidean, tol) -> None:
        # lazy: the numba kernels load only when a compiled path runs
        from dmlkit.metrics import _kernels

        self.g0, self.g1, self.same, self.tol = g0, g1, same, tol
        self.qn, self.rn, self.euclidean = qn, rn, euclidean
        pos_ptr = np.zeros(g1 - g0 + 1, dtype=np.int64)
        np.cumsum(counts, out=pos_ptr[1:])
        total = int(pos_ptr[-1])
        rows = np.empty(total, np.int64)
        pos_ref = np.empty(total, np.int64)
        _kernels.gather_positives(g0, query_codes, class_start, class_count, by_class, same,
                                  pos_ptr, rows, pos_ref)
        pos_val = _kernels.pair_scores64(qn, rn, rows, pos_ref, euclidean)
        order = np.lexsort((pos_ref, -pos_val, rows))  # per row: closest first, ties by index
        self.pos_val, self.pos_ref, self.pos_ptr = pos_val[order], pos_ref[order], pos_ptr
        # below the lowest positive by more than tol: after every positive, whatever the rounding
        lowest = np.full(g1 - g0, np.inf, dtype=np.float32)
        has = counts > 0
        low64 = self.pos_val[pos_ptr[1:][has] - 1] - tol
        low32 = low64.astype(np.float32)
        too_high = low32.astype(np.float64) > low64
        low32[too_high] = np.nextafter(low32[too_high], np.float32(-np.inf))
        lowest[has] = low32
        self.lowest = lowest
        self.gaps = np.zeros(total, dtype=np.int64)


    def scan(self, tiles, tile: int, workers: int, ql, rl, nq: int, m: int) -> None:
        """Every tile of these rows against every reference, on ``workers`` threads."""
        # lazy: the numba kernels load only when a compiled path runs
        from dmlkit.metrics import _kernels

        g0, g1 = self.g0, self.g1
        blocks = [(a0, min(g1, a0 + tile)) for a0 in range(g0, g1, tile)]
        symmetric = self.same and g0 == 0 and g1 == nq
        if symmetric:  # tiles b >= a only, by bands from the diagonal
            nb = len(blocks)
            tasks = [(bi, bi + band) for band in range(nb) for bi in range(nb - band)]
            col_blocks = blocks
        else:
            col_blocks = [(b0, min(m, b0 + tile)) for b0 in range(0, m, tile)]
            tasks = [(bi, bj) for bj in range(len(col_blocks)) for bi in range(len(blocks))]
        locks = [threading.Lock() for _ in blocks]
        scratch: SimpleQueue = SimpleQueue()
        for _ in range(workers):
            scratch.put(tiles.scratch(tile))

        def run(task: tuple[int, int]) -> None:
            bi, bj = task
            (a0, a1), (b0, b1) = blocks[bi], col_blocks[bj]
            buf = scratch.get()
            try:
                s = tiles.product(a0, a1, b0, b1, buf)
                both = symmetric and bi != bj
                second = locks[bj] if both else None
                with locks[bi]:  # bi <= bj: locks are always taken in the same order
                    if second is not None:
                        second.acquire()
                    try:
                        _kernels.ap_scan_tile(
                            s, a0, b0, g0, self.same, both, ql, rl, self.pos_ptr, self.pos_val,
                            self.pos_ref, self.lowest, self.gaps, self.tol, self.qn, self.rn,
                            self.euclidean,
                        )
                    finally:
                        if second is not None:
                            second.release()
            finally:
                scratch.put(buf)

        run_threads(run, tasks, workers)
