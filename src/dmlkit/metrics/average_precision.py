"""Full-ranking mean average precision (``map``) from each positive's rank, without sorting rows.

For a query with ``R`` same-class references, the average precision over the *full* ranking is

    AP = (1/R) sum_{p=1..R} p / rank_p,    rank_p = 1 + #{references ranked before positive p},

with the positives in ranking order and ties broken by the smaller reference index, as
everywhere in :mod:`dmlkit.metrics` (the definition of Manning, Raghavan and Schuetze,
*Introduction to Information Retrieval*, 2008, sec. 8.4, over the whole reference set). So AP
needs each positive's rank, not a sort of the ``M`` references (``O(M log M)`` per query).
Per query (:mod:`dmlkit.metrics._ap_positives`, :mod:`dmlkit.metrics._ap_kernels`):

1. the ``R`` positives' closeness in float64 (from the float32 embeddings), sorted;
2. every reference of a float32 closeness tile at or above the lowest positive is placed among
   the sorted positives through a per-row bucket table (constant time away from a positive);
   references below every positive change no rank and cost one branch-free comparison;
3. ``rank_p`` are prefix sums of those placements (plus the positives before ``p``). The
   references are scanned in class order, so a query's positives are one interval of columns,
   set to ``-inf`` in each tile before counting: the scan never sees them.

Exact: a reference within the float32 rounding bound ``tol`` of a positive is compared with it
in float64 (ties by index), so the result is the AP of the float64 ranking whatever the BLAS
summation order (``tol`` is the worst-case error of a float32 inner product of length ``d``,
``(d + 4) 2^-24 |x| |y|``, Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
sec. 3.1). On a self-search each off-diagonal tile serves both of its row blocks (half the
matrix products; the second block reads the tile's columns eight at a time, without a
transposed copy), as in the kNN (:mod:`dmlkit.metrics.knn`).
"""

from __future__ import annotations

import math
import threading
from queue import SimpleQueue

import numpy as np
import torch

from dmlkit.distances import rounding_bound
from dmlkit.metrics._threads import run_threads, single_threaded_torch
from dmlkit.metrics._tiles import _Tiles

__all__ = ["closeness_tolerance", "full_ranking_map"]

#: Bytes of per-positive state: its reference (int32), its lower float32 bound, an int32 count
#: (8 more with int64 references and counts, from 2^31 references), and its float64 closeness
#: (8) unless leaving it out lets the state fit the budget in one group (symmetric tiles):
#: the rare exact comparison then recomputes it.
_STATE_BYTES = 12
_VALUE_BYTES = 8
#: Bytes of per-row state besides the bucket table (pointer, lowest bound, scale, band width,
#: result, spare count).
_ROW_BYTES = 36
#: Buckets per row: about this many per positive, a power of two within the limits below.
_BUCKETS_PER_POSITIVE = 8
_MIN_BUCKETS, _MAX_BUCKETS = 64, 1024
#: The cap for row groups, which scan wide tiles: a row's table is then read for thousands of
#: columns and stays in cache (50k queries, R = 499, references in class order, interleaved
#: runs: 23.0 CPU s median against 23.8 with 1024).
_MAX_GROUP_BUCKETS = 4096
#: Largest tile side (rows = columns) of the scan.
_MAX_TILE = 1024


def closeness_tolerance(kind: str, d: int, q_max_norm: float, r_max_norm: float) -> float:
    """Worst-case difference between a float32 tile closeness and its float64 value:
    :func:`dmlkit.distances.rounding_bound` (``kind`` ``"ip"`` or ``"l2"``) in float32."""
    return rounding_bound(kind, d, q_max_norm, r_max_norm)


def _table_dtype(r_max: int) -> type:
    """The smallest integer type of a bucket table for rows of up to ``r_max`` positives (entries
    ``e`` and ``-1 - e`` for ``e <= R``): each tile visit reads the row's table (int8 tables with
    int32 counts measured about 5 % off the counting at R = 49, against int16 and int64)."""
    return np.int8 if r_max < 2**7 - 2 else np.int16 if r_max < 2**15 - 2 else np.int32


def _buckets(counts: np.ndarray, cap: int) -> int:
    """Buckets per row for rows with ``counts`` positives (a power of two, at most ``cap``)."""
    mean = float(counts.mean()) if counts.size else 1.0
    want = max(_MIN_BUCKETS, min(cap, _BUCKETS_PER_POSITIVE * mean))
    return 1 << math.ceil(math.log2(want))


def full_ranking_map(
    scorer, q: torch.Tensor, r: torch.Tensor | None, query_labels: torch.Tensor,
    reference_labels: torch.Tensor, budget: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-query full-ranking AP (float64; 0 where a query has no positive), and per query
    whether a negative ties one of its positives exactly in float64 (the tie rule then orders
    them: :func:`dmlkit.metrics.near_ties.warn_tie_ruled`).

    ``scorer`` is a symmetric :class:`dmlkit.metrics.knn._Scorer` (cosine, dot or Euclidean);
    ``q`` / ``r`` are its *prepared* float32 CPU rows; ``r=None`` is a self-search that leaves
    each query out of its own ranking. Memory: a copy of the references in class order; the
    positives' state (20 bytes each, 12 where that lets it fit one group) and a bucket table per
    row (1 byte a bucket below 126 positives, 2 below 2^15, else 4); a float32 tile per worker.
    A self-search whose state fits ``budget`` less its square tiles scans them once each for
    both of their row blocks (half the products); otherwise the state takes half of ``budget``,
    in groups of rows if need be (each group then scans every reference, in tiles as wide as
    the other half allows, with up to 4096 buckets a row instead of 1024).
    """
    same = r is None
    ref = q if same else r
    nq, m = q.shape[0], ref.shape[0]
    ql = query_labels.cpu().numpy().astype(np.int64, copy=False)
    rl = reference_labels.cpu().numpy().astype(np.int64, copy=False)
    classes, ref_codes = np.unique(rl, return_inverse=True)
    pos = np.searchsorted(classes, ql).clip(0, max(classes.size - 1, 0))
    query_codes = np.where(classes[pos] == ql, pos, -1).astype(np.int64)
    class_count = np.bincount(ref_codes.reshape(-1), minlength=classes.size).astype(np.int64)
    class_start = (np.cumsum(class_count) - class_count).astype(np.int64)
    # the references in class order (stable: by index within a class), so each query's
    # positives are one interval of columns; a self-search reorders its queries the same way
    ref_index = np.argsort(ref_codes.reshape(-1), kind="stable").astype(np.int64)
    ref = ref[torch.from_numpy(ref_index)]
    if same:
        q, query_codes = ref, query_codes[ref_index]
    has = query_codes >= 0
    pos_first = np.where(has, class_start[query_codes.clip(0)], 0).astype(np.int64)
    pos_last = np.where(has, pos_first + class_count[query_codes.clip(0)], 0).astype(np.int64)
    r_count = ((pos_last - pos_first) - int(same)).clip(0).astype(np.int64)
    codes = _Codes(query_codes, pos_first, pos_last, ref_index)

    q_norm = float(q.norm(dim=1).max())
    r_norm = q_norm if same else float(ref.norm(dim=1).max())
    tol = closeness_tolerance(scorer.kind, q.shape[1], q_norm, r_norm)
    out = np.zeros(nq, dtype=np.float64)
    tied = np.zeros(nq, dtype=bool)
    tiles = _Tiles(scorer, q, ref, bf16=False)
    table_dtype = _table_dtype(int(r_count.max(initial=0)))
    index_dtype = np.int32 if m < 2**31 else np.int64
    with single_threaded_torch() as workers:
        # per worker: a float32 tile in the other half of the budget, square on a symmetric
        # self-search; row groups scan tiles as wide as it holds (a row's counts and table are
        # then fetched once per wide block: 6 KB a row at 499 positives, and the row pass measured
        # 1.55-1.9 s against 2.3-2.7 s with 1024-column tiles, 20k queries, one thread)
        tile_area = budget // (8 * workers)
        tile = int(max(64, min(_MAX_TILE, math.isqrt(tile_area))))
        # a whole number of square blocks (:func:`_square_blocks`) unless it spans every reference
        wide = max(tile, min(m, tile_area // tile // tile * tile))
        # one group of symmetric tiles may use what its square tiles leave of the budget
        one_group_room = max(0, budget - workers * _square_tile_bytes(tile)) if same else budget // 2
        groups, n_buckets, keep_values = _plan(r_count, np.dtype(index_dtype).itemsize, table_dtype,
                                               budget, one_group_room)
        memory = _GroupMemory(max(b - a for a, b in groups),
                              max(int(r_count[a:b].sum()) for a, b in groups), n_buckets, table_dtype,
                              index_dtype, keep_values)
        for g0, g1 in groups:
            if r_count[g0:g1].sum() == 0:
                continue
            group = _Group(g0, g1, r_count[g0:g1], codes, same, tiles, scorer.kind == "l2", tol,
                           memory, workers)
            group.scan(tiles, tile, wide, workers, nq, m)
            group.average_precision(out[g0:g1], tied[g0:g1])
    if same:  # back to the caller's order
        out[ref_index], tied[ref_index] = out.copy(), tied.copy()
    return torch.from_numpy(out), torch.from_numpy(tied)


def _square_tile_bytes(tile: int) -> int:
    """One worker's memory on symmetric tiles of side ``tile``: the float32 tile and the
    counting scratch (:func:`dmlkit.metrics._ap_kernels.counting_scratch`)."""
    # lazy: the numba kernels load only when a compiled path runs
    from dmlkit.metrics._ap_kernels import counting_scratch_bytes

    return 4 * tile * tile + counting_scratch_bytes(tile)


def _plan(r_count: np.ndarray, index_bytes: int, table_dtype: type, budget: int,
          one_group_room: int) -> tuple:
    """``(groups, buckets a row, keep the float64 closeness)`` for rows with ``r_count``
    positives: one group (symmetric tiles on a self-search) if the state fits
    ``one_group_room``, without the stored closeness if only that makes it fit; else row groups
    in half of ``budget``, with the closeness and finer tables (row groups scan wide tiles,
    where a row's table stays in cache)."""
    state_bytes = _STATE_BYTES + 2 * (index_bytes - 4)
    n_buckets = _buckets(r_count, _MAX_BUCKETS)
    groups = _row_groups(r_count, state_bytes + _VALUE_BYTES, n_buckets, table_dtype, one_group_room)
    if len(groups) == 1:
        return groups, n_buckets, True
    lean = _row_groups(r_count, state_bytes, n_buckets, table_dtype, one_group_room)
    if len(lean) == 1:
        return lean, n_buckets, False
    n_buckets = _buckets(r_count, _MAX_GROUP_BUCKETS)
    return _row_groups(r_count, state_bytes + _VALUE_BYTES, n_buckets, table_dtype, budget // 2), n_buckets, True


def _row_groups(r_count: np.ndarray, state_bytes: int, n_buckets: int, table_dtype: type,
                room: int) -> list:
    """Consecutive query rows ``(g0, g1)`` whose state fits in ``room`` bytes."""
    per_row = np.cumsum(r_count * state_bytes + _ROW_BYTES + table_dtype().itemsize * n_buckets)
    groups, g0, nq = [], 0, r_count.shape[0]
    while g0 < nq:
        base = per_row[g0 - 1] if g0 else 0
        g1 = int(np.searchsorted(per_row, base + room, side="right"))
        g1 = min(nq, max(g1, g0 + 1))
        groups.append((g0, g1))
        g0 = g1
    return groups


def _square_blocks(tiles: _Tiles, a0: int, a1: int, b0: int, b1: int, width: int,
                   buf: torch.Tensor) -> np.ndarray:
    """The tile of query rows ``a0:a1`` and references ``b0:b1`` as blocks ``width`` columns
    wide, side by side (``[block, row, column]``; the last one padded with ``-inf``, which no
    count reads). One product a block: side by side, the products measured 63 GFLOP/s a thread
    against 55 for one product into the whole ``1024 x 16384`` tile (two threads, medians of 7
    interleaved rounds)."""
    rows, n_blocks = a1 - a0, -(-(b1 - b0) // width)
    view = buf[: n_blocks * rows * width].view(n_blocks, rows, width)
    for k in range(n_blocks):
        c0 = b0 + k * width
        c1 = min(b1, c0 + width)
        tiles.product_into(a0, a1, c0, c1, view[k, :, : c1 - c0])
        if c1 - c0 < width:
            view[k, :, c1 - c0 :] = -math.inf
    return view.numpy()


class _Codes:
    """Per query (in scan order): its class code and its positives' interval of references
    (in class order); per reference, its index in the caller's order."""

    def __init__(self, query_codes, pos_first, pos_last, ref_index) -> None:
        self.query_codes, self.pos_first, self.pos_last = query_codes, pos_first, pos_last
        self.ref_index = ref_index


class _GroupMemory:
    """The arrays of :class:`_Group`, sized for the largest group and reused by every group: a
    fresh page costs a fault on first write (measured 2.7 ms a MB on a 2-core EPYC VM: about
    1.6 s for the 600 MB of state of 50k queries with 499 positives each)."""

    def __init__(self, rows: int, positives: int, n_buckets: int, table_dtype: type,
                 index_dtype: type, keep_values: bool) -> None:
        self.pos_ptr = np.empty(rows + 1, np.int64)
        self.pos_ref = np.empty(positives, index_dtype)
        self.pos_val = np.empty(positives if keep_values else 0, np.float64)
        self.up = np.empty(positives, np.float32)
        self.band = np.empty(rows, np.float32)
        self.lo = np.empty(rows, np.float32)
        self.scale = np.empty(rows, np.float32)
        self.table = np.empty((rows, n_buckets), table_dtype)
        self.cnt = np.empty(positives + rows, index_dtype)
        self.tied = np.empty(rows, np.uint8)


class _Group:
    """The sorted positives, float32 bounds, bucket tables and counts of query rows ``g0:g1``."""

    def __init__(self, g0: int, g1: int, counts: np.ndarray, codes: _Codes, same: bool,
                 tiles: _Tiles, euclidean: bool, tol: float, memory: _GroupMemory, workers: int) -> None:
        # lazy: the numba kernels load only when a compiled path runs
        from dmlkit.metrics import _ap_positives

        self.g0, self.g1, self.same, self.euclidean = g0, g1, same, euclidean
        self.codes = codes
        self.qn, self.rn = tiles.query_np, tiles.ref_np
        rows = g1 - g0
        pos_ptr = memory.pos_ptr[: rows + 1]
        pos_ptr[0] = 0
        np.cumsum(counts, out=pos_ptr[1:])
        total = int(pos_ptr[-1])
        pos_ref = memory.pos_ref[:total]
        _ap_positives.gather_positives(g0, codes.pos_first, codes.pos_last, same, pos_ptr, pos_ref)
        query_codes = codes.query_codes[g0:g1]
        self.pos_ptr, self.pos_ref = pos_ptr, pos_ref
        self.pos_val = memory.pos_val[:total]  # empty when not kept
        self.up, self.band = memory.up[:total], memory.band[:rows]
        self.lo, self.scale, self.table = memory.lo[:rows], memory.scale[:rows], memory.table[:rows]

        def prepare(chunk: tuple[int, int]) -> None:
            """Rows ``a:b`` of the group: float64 closeness of the positives (kept, or a
            temporary), sorted per row (closest first, ties by index), their float32 bounds (the
            upper ones a temporary, kept as a width a row) and the bucket tables."""
            a, b = chunk
            p, q = pos_ptr[a], pos_ptr[b]
            ptr, refs, up, dn = pos_ptr[a : b + 1] - p, pos_ref[p:q], self.up[p:q], np.empty(q - p, np.float32)
            vals = self.pos_val[p:q] if self.pos_val.size else np.empty(q - p, np.float64)
            by_class = np.argsort(query_codes[a:b], kind="stable")
            _ap_positives.positive_scores(self.qn, self.rn, by_class, g0 + a, ptr, refs, euclidean,
                                          vals)
            _ap_positives.sort_positives(ptr, vals, refs)
            _ap_positives.bounds(vals, tol, up, dn)
            _ap_positives.band_widths(ptr, up, dn, self.band[a:b])
            _ap_positives.build_tables(ptr, up, dn, self.lo[a:b], self.scale[a:b], self.table[a:b])

        # chunks of at most 2^20 positives (8 MB of float64 closeness each), 4 per worker or more
        step = max(1, min(-(-rows // (4 * workers)), 2**20 // max(1, int(counts.max(initial=1)))))
        run_threads(prepare, [(a, min(rows, a + step)) for a in range(0, rows, step)], workers)
        self.cnt = memory.cnt[: total + rows]  # a spare slot after each row's
        self.cnt.fill(0)
        self.tied = memory.tied[:rows]
        self.tied.fill(0)

    def scan(self, tiles: _Tiles, tile: int, wide: int, workers: int, nq: int, m: int) -> None:
        """Every tile of these rows against every reference, on ``workers`` threads: square tiles
        of side ``tile`` on a symmetric self-search, else ``tile`` rows by ``wide`` columns."""
        # lazy: the numba kernels load only when a compiled path runs
        from dmlkit.metrics._ap_kernels import Counting, count_columns, count_rows, counting_scratch

        g0, g1 = self.g0, self.g1
        blocks = [(a0, min(g1, a0 + tile)) for a0 in range(g0, g1, tile)]
        symmetric = self.same and g0 == 0 and g1 == nq
        if symmetric:  # tiles b >= a only, by bands from the diagonal
            nb = len(blocks)
            tasks = [(bi, bi + band) for band in range(nb) for bi in range(nb - band)]
            col_blocks = blocks
        else:
            col_blocks = [(b0, min(m, b0 + wide)) for b0 in range(0, m, wide)]
            tasks = [(bi, bj) for bj in range(len(col_blocks)) for bi in range(len(blocks))]
        locks = [threading.Lock() for _ in blocks]
        scratch: SimpleQueue = SimpleQueue()
        side = max(b - a for a, b in col_blocks)
        padded = -(-side // tile) * tile  # a wide tile is held as square blocks side by side
        for _ in range(workers):
            scratch.put((tiles.scratch(tile, padded), counting_scratch(side)))
        codes = self.codes
        state = Counting(self.pos_ptr, self.pos_ref, self.pos_val, self.up, self.band, self.lo,
                         self.scale, self.table, self.cnt, self.qn, self.rn, self.euclidean,
                         codes.pos_first, codes.pos_last, codes.ref_index, self.tied)

        def run(task: tuple[int, int]) -> None:
            bi, bj = task
            (a0, a1), (b0, b1) = blocks[bi], col_blocks[bj]
            buf, work = scratch.get()
            try:
                if symmetric:
                    s = tiles.product(a0, a1, b0, b1, buf)
                    with locks[bi]:
                        count_rows(s.reshape(1, *s.shape), a0, b0, self.g0, state, work)
                    if bi != bj:  # the same tile, its columns as queries b0:b1
                        with locks[bj]:
                            count_columns(s, a0, b0, self.g0, state, work)
                else:
                    s = _square_blocks(tiles, a0, a1, b0, b1, tile, buf)
                    with locks[bi]:
                        count_rows(s, a0, b0, self.g0, state, work)
            finally:
                scratch.put((buf, work))

        run_threads(run, tasks, workers)

    def average_precision(self, out: np.ndarray, tied: np.ndarray) -> None:
        """Each row's AP into ``out``; into ``tied``, whether a negative tied a positive."""
        # lazy: the numba kernels load only when a compiled path runs
        from dmlkit.metrics import _ap_kernels

        _ap_kernels.ap_from_counts(self.pos_ptr, self.cnt, out)
        tied[:] = self.tied != 0
