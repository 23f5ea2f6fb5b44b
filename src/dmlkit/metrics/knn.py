"""Exact, memory-bounded k-nearest-neighbour search.

:func:`knn` returns, for every query row, the ``k`` closest reference rows under a
:mod:`dmlkit.distances` distance, **exactly** (no approximation) and without ever forming the
``N x M`` distance matrix: the work is cut into tiles whose size follows from an explicit memory
budget. Ranking is by closeness (larger similarity / smaller distance first); ties are broken by
the smaller reference index, so results are deterministic.

Three backends give the same neighbours (up to the order of references whose float32
similarities differ by less than an ulp):

* ``"torch"`` - per query block, ``matmul`` against reference chunks and an exact
  ``topk`` merge (any device; used on GPUs and for distances other than cosine, dot and
  Euclidean). Ties are resolved exactly by reference index.
* ``"numba"`` - the CPU default for cosine, dot and Euclidean. When the query set is the
  reference set the similarity matrix is symmetric, so every off-diagonal tile product
  ``X_i X_j^T`` serves both row block ``i`` and (transposed) row block ``j``: half the
  arithmetic of an ordinary search. Each tile goes to the compiled kernels of
  :mod:`dmlkit.metrics._kernels`: a vectorised comparison against every row's threshold, and
  the rare survivors, packed as int64 keys ordered by (closeness, smaller index), into per-row
  reservoirs cut back by quickselect (exact ties by index, in any arrival order). Two
  accelerations keep it exact: a threshold *guess* per row from a 1/32 sample of the
  references when ``k`` is large (rows it overshot are recomputed), and, where this CPU does
  bfloat16 dot products much faster than float32 ones, bfloat16 inner-product tiles read
  through their rounding-error bound, with every survivor recomputed in float64 (see
  :class:`dmlkit.metrics._tiles._Tiles`). Work is spread over ``torch.get_num_threads()`` Python
  threads (:mod:`._threads`).
* ``"faiss"`` - the same symmetric tiles fed to faiss's per-row heaps
  (``faiss.float_minheap_array_t.addn``, the selection kernel of ``faiss.knn``). Rows may be
  processed in a caller-given ``order`` (:func:`dmlkit.metrics.evaluate` sorts by label) so
  the heaps fill with good candidates early. Rows whose kept neighbours contain exactly equal
  values are re-sorted by index; which of several references at *exactly* the k-th value is
  kept is faiss's choice.

``backend="auto"`` picks numba on CPU tensors for cosine, dot and Euclidean from
:data:`SMALL_SEARCH_PAIRS` query-reference pairs on, else torch.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dmlkit.distances import BaseDistance, DotProductSimilarity, LpDistance, get_distance
from dmlkit.exceptions import ConfigError, DataError, ShapeError, require
from dmlkit.metrics._threads import (
    full_float32_matmuls,
    run_threads,
    single_threaded_pool,
    single_threaded_torch,
)
from dmlkit.metrics._tiles import _BF16_MIN_PAIRS, _bf16_is_faster, _Tiles
from dmlkit.metrics._validation import DEFAULT_MEMORY_BUDGET, as_embeddings, check_budget
from dmlkit.validation import check_integer

__all__ = ["KNNResult", "faiss_available", "knn"]

_BACKENDS = ("auto", "torch", "numba", "faiss")
#: ``backend="auto"`` uses the numba backend from this many query-reference pairs on.
SMALL_SEARCH_PAIRS = 2**22


@dataclass(frozen=True)
class KNNResult:
    """Neighbours of each query, closest first.

    Attributes:
        indices: ``(N, k)`` int64 reference row indices.
        values: ``(N, k)`` float32 similarities or distances (the distance's own units).
        higher_is_closer: ``True`` for similarities (cosine, dot), ``False`` for distances.
    """

    indices: torch.Tensor
    values: torch.Tensor
    higher_is_closer: bool

    @property
    def k(self) -> int:
        return int(self.indices.shape[1])


def faiss_available() -> bool:
    """Whether the optional ``faiss`` backend can be imported."""
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


# -- scoring: closeness of two blocks of rows --------------------------------------------------
class _Scorer:
    """Maps a distance to a block function ``closeness(A, B)`` (larger = closer).

    ``kind`` is ``"ip"`` (cosine / dot: closeness = inner product), ``"l2"`` (Euclidean:
    closeness = minus the squared distance, from one matmul) or ``"generic"`` (anything else,
    through the distance object). ``ip`` and ``l2`` are symmetric.
    """

    def __init__(self, distance: BaseDistance) -> None:
        self.distance = distance
        if isinstance(distance, DotProductSimilarity):  # includes CosineSimilarity
            self.kind = "ip"
        elif isinstance(distance, LpDistance) and distance.p == 2:
            self.kind = "l2"
        else:
            self.kind = "generic"
        self.symmetric = self.kind in ("ip", "l2")

    def prepare(self, x: torch.Tensor, name: str = "embeddings") -> torch.Tensor:
        """Normalised (scale-safe) or range-checked rows (:meth:`BaseDistance.prepare`)."""
        if self.kind == "generic":
            return x
        return self.distance.prepare(x, name).contiguous()

    def sq_norms(self, x: torch.Tensor) -> torch.Tensor | None:
        return x.pow(2).sum(1) if self.kind == "l2" else None

    def block(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        na: torch.Tensor | None = None,
        nb: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.kind == "ip":
            return torch.mm(a, b.T, out=out) if out is not None else a @ b.T
        if self.kind == "l2":
            bias = -(na[:, None] + nb[None, :])
            if out is not None:
                return torch.addmm(bias, a, b.T, alpha=2.0, out=out)
            return torch.addmm(bias, a, b.T, alpha=2.0)
        return self.distance.closeness(self.distance.pairwise(a, b))

    def to_values(self, closeness: torch.Tensor) -> torch.Tensor:
        """Closeness back to the distance's own units."""
        if self.kind == "ip":
            return closeness
        if self.kind == "l2":
            sq = (-closeness).clamp_min(0)
            return sq if self.distance.power == 2 else sq.sqrt()
        return closeness if self.distance.higher_is_closer else -closeness


# -- exact top-k with index tie-breaking --------------------------------------------------------
def _sort_rows_by_value_then_index(v: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row by (value descending, index ascending) with two stable sorts."""
    o = torch.argsort(i, dim=1, stable=True)
    v, i = v.gather(1, o), i.gather(1, o)
    o = torch.argsort(v, dim=1, descending=True, stable=True)
    return v.gather(1, o), i.gather(1, o)


def exact_topk(
    values: torch.Tensor, k: int, indices: torch.Tensor | None = None, offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries of each row, ties broken by the smaller index.

    ``indices`` (same shape as ``values``) gives each entry's index; by default the column
    number plus ``offset``. ``torch.topk`` does the work; rows where it could have chosen or
    ordered equal values arbitrarily (a tie inside the result or at its boundary) are re-done
    with two stable sorts, so the result is exact and deterministic.
    """
    top_v, pos = values.topk(k, dim=1, largest=True, sorted=True)
    top_i = pos + offset if indices is None else indices.gather(1, pos)
    if k == 0:
        return top_v, top_i
    boundary = top_v[:, -1:]
    ambiguous = (values == boundary).sum(1, dtype=torch.int32) != (top_v == boundary).sum(
        1, dtype=torch.int32
    )
    if k > 1:
        ambiguous |= (top_v[:, 1:] == top_v[:, :-1]).any(1)
    rows = ambiguous.nonzero().squeeze(1)
    if rows.numel():
        sub_v = values[rows]
        if indices is None:
            sub_i = torch.arange(values.shape[1], device=values.device).expand_as(sub_v) + offset
        else:
            sub_i = indices[rows]
        sv, si = _sort_rows_by_value_then_index(sub_v, sub_i)
        top_v[rows] = sv[:, :k]
        top_i[rows] = si[:, :k]
    return top_v, top_i


def _mask_self(block: torch.Tensor, a0: int, b0: int) -> None:
    """Set ``block[r - a0, r - b0] = -inf`` for every global row ``r`` in both ranges."""
    lo = max(a0, b0)
    hi = min(a0 + block.shape[0], b0 + block.shape[1])
    if lo < hi:
        r = torch.arange(lo, hi, device=block.device)
        block[r - a0, r - b0] = -math.inf


# -- torch backend ------------------------------------------------------------------------------
def _knn_torch(
    scorer: _Scorer, q: torch.Tensor, r: torch.Tensor, k: int, exclude_self: bool, budget: int
) -> tuple[torch.Tensor, torch.Tensor]:
    nq, m = q.shape[0], r.shape[0]
    # reference chunk: 16384 columns at the default budget, fewer for small budgets
    chunk = min(m, max(2 * k, min(16384, budget // 4096)))
    # per query row: the chunk (float32) + its compare masks + topk output and the merge buffers
    per_row = chunk * 4 * 3 + (2 * k) * (4 + 8) * 3
    rows = max(1, min(nq, budget // per_row))
    nq_, nr_ = scorer.sq_norms(q), scorer.sq_norms(r)
    out_c = torch.empty(nq, k, dtype=torch.float32, device=q.device)
    out_i = torch.empty(nq, k, dtype=torch.int64, device=q.device)
    for a0 in range(0, nq, rows):
        a1 = min(nq, a0 + rows)
        qa = q[a0:a1]
        na = None if nq_ is None else nq_[a0:a1]
        run_c = run_i = None
        for c0 in range(0, m, chunk):
            c1 = min(m, c0 + chunk)
            s = scorer.block(qa, r[c0:c1], na, None if nr_ is None else nr_[c0:c1])
            if exclude_self:
                _mask_self(s, a0, c0)
            v, i = exact_topk(s, min(k, c1 - c0), offset=c0)
            if run_c is None:
                run_c, run_i = v, i
            else:
                cat_v, cat_i = torch.cat([run_c, v], 1), torch.cat([run_i, i], 1)
                run_c, run_i = exact_topk(cat_v, min(k, cat_v.shape[1]), indices=cat_i)
        out_c[a0:a1], out_i[a0:a1] = run_c, run_i
    return out_c, out_i


# -- faiss backend ------------------------------------------------------------------------------
def _knn_faiss(
    scorer: _Scorer,
    q: torch.Tensor,
    r: torch.Tensor | None,
    k: int,
    exclude_self: bool,
    budget: int,
    order: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    import faiss

    same = r is None
    if order is not None:
        q = q[order].contiguous()
    ref = q if same else r
    nq, m = q.shape[0], ref.shape[0]
    nq_, nr_ = scorer.sq_norms(q), scorer.sq_norms(ref)
    # Threads: torch and faiss each bundle an OpenMP runtime, and when both run parallel
    # regions in turn their idle threads spin against each other (a 2-core machine slows down
    # ~4x). So every kernel here runs single-threaded and the parallelism is a pipeline:
    # `workers` Python threads compute tile products (torch releases the GIL) while this
    # thread feeds finished tiles to the heaps, in order.
    workers = max(1, torch.get_num_threads())
    inflight = workers + 1
    # `inflight` pairs of float32 tiles (product and transpose) fill the budget, at most
    # 1024 x 1024 (a tile in the L2/L3 cache keeps the matmul near peak and the heap scan fast)
    tile = int(max(64, min(1024, math.isqrt(budget // (8 * inflight)))))
    dist = np.full((nq, k), -np.inf, dtype=np.float32)
    ids = np.full((nq, k), -1, dtype=np.int64)
    heaps = faiss.float_minheap_array_t()
    heaps.nh, heaps.k = nq, k
    heaps.val, heaps.ids = faiss.swig_ptr(dist), faiss.swig_ptr(ids)
    bufs = [torch.empty(tile * tile, dtype=torch.float32) for _ in range(inflight)]
    bufs_t = [torch.empty(tile * tile, dtype=torch.float32) for _ in range(inflight)]

    def tasks():
        """Tiles ``(a0, a1, b0, b1, transpose_too)``; for a self-search only ``b0 >= a0``, in
        bands by distance from the diagonal (neighbours in ``order`` come first)."""
        if same:
            nb = (nq + tile - 1) // tile
            for band in range(nb):
                for bi in range(nb - band):
                    bj = bi + band
                    yield (bi * tile, min(nq, (bi + 1) * tile),
                           bj * tile, min(nq, (bj + 1) * tile), band > 0)
        else:
            for a0 in range(0, nq, tile):
                for b0 in range(0, m, tile):
                    yield a0, min(nq, a0 + tile), b0, min(m, b0 + tile), False

    def compute(slot: int, a0: int, a1: int, b0: int, b1: int, both: bool):
        size = (a1 - a0) * (b1 - b0)
        s = scorer.block(
            q[a0:a1], ref[b0:b1],
            None if nq_ is None else nq_[a0:a1], None if nr_ is None else nr_[b0:b1],
            out=bufs[slot][:size].view(a1 - a0, b1 - b0),
        )
        if exclude_self:
            _mask_self(s, a0, b0)
        st = None
        if both:
            st = bufs_t[slot][:size].view(b1 - b0, a1 - a0)
            st.copy_(s.T)
        return s, st

    def add(block: torch.Tensor, row0: int, col0: int) -> None:
        heaps.addn(block.shape[1], faiss.swig_ptr(block.numpy()), col0, row0, block.shape[0])

    from collections import deque

    with single_threaded_pool(workers, faiss) as submit:  # the caller and each worker on 1 thread
        pending: deque = deque()

        def consume() -> None:
            (a0, _, b0, _, _), fut = pending.popleft()
            s, st = fut.result()
            add(s, a0, b0)
            if st is not None:
                add(st, b0, a0)

        for n_task, (a0, a1, b0, b1, both) in enumerate(tasks()):
            if len(pending) == inflight:
                consume()  # frees the slot that this task reuses
            fut = submit(compute, n_task % inflight, a0, a1, b0, b1, both)
            pending.append(((a0, a1, b0, b1, both), fut))
        while pending:
            consume()
    heaps.reorder()
    top_c = torch.from_numpy(dist)
    top_i = torch.from_numpy(ids)
    if k > 1:  # equal values inside a row: order them by reference index, like the torch backend
        tied = (top_c[:, 1:] == top_c[:, :-1]).any(1).nonzero().squeeze(1)
        if tied.numel():
            sub_i = top_i[tied] if order is None or not same else order[top_i[tied]]
            sv, si = _sort_rows_by_value_then_index(top_c[tied], sub_i)
            top_c[tied] = sv
            top_i[tied] = si if order is None or not same else torch.argsort(order)[si]
    if order is None:
        return top_c, top_i
    # back to the caller's row order and reference indices, a block of rows at a time
    out_c, out_i = torch.empty_like(top_c), torch.empty_like(top_i)
    step = max(1, (1 << 22) // k)
    for a0 in range(0, nq, step):
        rows = order[a0 : a0 + step]
        out_c[rows] = top_c[a0 : a0 + step]
        out_i[rows] = order[top_i[a0 : a0 + step]] if same else top_i[a0 : a0 + step]
    return out_c, out_i


# -- numba backend ------------------------------------------------------------------------------
#: Fraction of the references sampled to guess each row's k-th closeness (numba backend).
_GUESS_SAMPLE = 1 / 32
#: Below this many expected top-k members in the sample, a guess costs more than it saves
#: (measured: k = 49 of 100k references is faster without one, k = 999 much faster with one).
_GUESS_MIN_EXPECTED = 4.0


def _guess_thresholds(
    tiles: _Tiles, k: int, exclude_self: bool, budget: int, workers: int
) -> np.ndarray | None:
    """A per-row guess of the k-th closeness, slightly below it, from a sample of references.

    With ``m`` references sampled uniformly (fixed seed), the number of a row's true top-``k``
    that fall in the sample is about Binomial(m, k/M), mean ``mu = k m / M``. The ``j``-th
    closest sampled value with ``j = mu + 3 sqrt(mu) + 2`` (plus one for the query itself in a
    self-search) lies below the true k-th closeness for all but ~0.1% of rows; the scan then
    starts from it and discards almost everything at once. A row whose guess was too high ends
    with fewer than ``k`` candidates and is recomputed (the result is exact either way).
    ``None`` when the sample would be too small to say anything (small ``k`` or ``M``).
    """
    nq, m_ref = tiles.q.shape[0], tiles.ref.shape[0]
    m = math.ceil(m_ref * _GUESS_SAMPLE)
    mu = k * m / m_ref
    if mu < _GUESS_MIN_EXPECTED or mu > m / 4:
        return None
    j = min(m, math.ceil(mu + 3 * math.sqrt(mu)) + 2 + int(exclude_self))
    gen = torch.Generator().manual_seed(0)
    cols = torch.randperm(m_ref, generator=gen)[:m].sort().values
    rows = max(1, min(nq, budget // (8 * m * workers), 4096))
    guess = np.empty(nq, dtype=np.float32)

    def block(a0: int) -> None:
        a1 = min(nq, a0 + rows)
        s = tiles.closeness(a0, a1, cols).numpy()
        guess[a0:a1] = np.partition(s, m - j, axis=1)[:, m - j]  # j-th largest
        if tiles.bf16:  # the sampled values are approximate: step below them by the error bound
            guess[a0:a1] -= np.float32(tiles.slack(a0, a1, 0, m_ref))

    run_threads(block, range(0, nq, rows), workers)
    return guess


def _knn_numba(
    scorer: _Scorer, q: torch.Tensor, r: torch.Tensor | None, k: int, exclude_self: bool, budget: int,
    floor: np.ndarray | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The numba backend. ``floor`` (float32 per query row, the tile's closeness units): only
    references at least that close are wanted (a running k-th closeness from other references,
    :mod:`dmlkit.metrics.streaming`); each row's scan starts from it, and a row with fewer than
    ``k`` of them is padded with closeness ``-inf`` and index ``-1``.

    Each query row holds ``max(2k, k + 32)`` int64 keys until its last tile: against separate
    references the queries go in groups whose keys fit half the budget (at least 1024 rows; 500k
    queries at k = 1 took 247 MiB at a 1 MiB budget before); a self-search's symmetric tiles fill
    two row blocks at once, so there every row keeps its keys to the end (docs/guide.md)."""
    from queue import SimpleQueue

    # lazy: the numba kernels load only when a compiled path runs
    from dmlkit.metrics import _kernels

    cap = max(2 * k, k + 32)
    group = max(1024, budget // (2 * 8 * cap))
    if r is not None and not exclude_self and q.shape[0] > group:
        parts = [_knn_numba(scorer, q[g:g + group], r, k, False, budget, None if floor is None else floor[g:g + group])
                 for g in range(0, q.shape[0], group)]
        return torch.cat([v for v, _ in parts]), torch.cat([i for _, i in parts])
    same = r is None
    ref = q if same else r
    nq, m = q.shape[0], ref.shape[0]
    bf16 = scorer.kind == "ip" and nq * m >= _BF16_MIN_PAIRS and _bf16_is_faster(q.shape[1])
    tiles = _Tiles(scorer, q, ref, bf16)
    with single_threaded_torch() as workers:  # kernels and matmuls on `workers` Python threads
        # one tile per worker in the budget, at most 1024 x 1024 (measured faster than 512 on a
        # 2-core EPYC: fewer calls, a slightly faster matmul; the scan reads it from L3)
        tile = int(max(64, min(1024, math.isqrt(budget // (4 * workers)))))
        blocks = [(a0, min(nq, a0 + tile)) for a0 in range(0, nq, tile)]
        ref_blocks = blocks if same else [(b0, min(m, b0 + tile)) for b0 in range(0, m, tile)]
        guess = floor if floor is not None else _guess_thresholds(tiles, k, exclude_self, budget, workers)
        state = []
        for a0, a1 in blocks:
            thr = np.full(a1 - a0, -np.inf, np.float32) if guess is None else guess[a0:a1].astype(np.float32)
            state.append((
                np.empty((a1 - a0, cap), np.int64),  # reservoir keys
                np.zeros(a1 - a0, np.int64),  # keys held
                _kernels.pack_keys(thr, 0xFFFFFFFF),  # threshold key: lowest key at the threshold
                thr,
            ))
        locks = [threading.Lock() for _ in blocks]
        scratch: SimpleQueue = SimpleQueue()
        for _ in range(workers):
            scratch.put((tiles.scratch(tile), np.zeros(-(-tile // 8) * 8, np.uint8)))
        if same:  # tiles b >= a only, by bands: concurrent tiles rarely share a row block
            nb = len(blocks)
            tasks = [(bi, bi + band) for band in range(nb) for bi in range(nb - band)]
        else:  # row blocks vary fastest, for the same reason
            tasks = [(bi, bj) for bj in range(len(ref_blocks)) for bi in range(len(blocks))]

        def run(task: tuple[int, int]) -> None:
            bi, bj = task
            (a0, a1), (b0, b1) = blocks[bi], ref_blocks[bj]
            out, mask = scratch.get()
            try:
                s = tiles.product(a0, a1, b0, b1, out)
                slack = np.float32(tiles.slack(a0, a1, b0, b1))
                both = same and bi != bj
                first, second = locks[bi], (locks[bj] if both else None)
                with first:
                    if second is not None:
                        second.acquire()
                    try:
                        other = state[bj] if both else state[bi]
                        _kernels.scan_tile(
                            s, a0, b0, exclude_self, *state[bi], both, *other, k, mask, slack,
                            tiles.query_np, tiles.ref_np,
                        )
                    finally:
                        if second is not None:
                            second.release()
            finally:
                scratch.put((out, mask))

        out_v = np.empty((nq, k), dtype=np.float32)
        out_i = np.empty((nq, k), dtype=np.int64)

        def finish(bi: int) -> None:
            a0, a1 = blocks[bi]
            buf, counts, _, _ = state[bi]
            if floor is not None:  # rows short of k above their floor: pad with the lowest key
                head = buf[:, :k]
                head[np.arange(k) >= counts[:, None]] = _kernels.LOWEST_KEY
            _kernels.select_rows(buf, counts, k)
            # numpy's sort (SIMD, releases the GIL) is ~10x faster than a compiled quicksort here
            _kernels.unpack_rows(np.sort(buf[:, :k], axis=1), out_v[a0:a1], out_i[a0:a1])
            state[bi] = (None, counts, None, None)  # the reservoir's memory goes back now

        run_threads(run, tasks, workers)
        run_threads(finish, range(len(blocks)), workers)
    counts = np.concatenate([st[1] for st in state])
    short = np.flatnonzero(counts < k)
    values, indices = torch.from_numpy(out_v), torch.from_numpy(out_i)
    if floor is not None:
        indices[values == -np.inf] = -1
    elif short.size:  # guessed threshold above the k-th closeness: redo these rows directly
        rows = torch.from_numpy(short)
        values[rows], indices[rows] = _knn_rows_torch(scorer, q, ref, rows, k, exclude_self, budget)
    return values, indices


def _knn_rows_torch(
    scorer: _Scorer, q: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor, k: int,
    exclude_self: bool, budget: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-``k`` of some query rows against every reference (self excluded by index)."""
    extra = int(exclude_self)
    v, i = _knn_torch(scorer, q[rows], ref, min(k + extra, ref.shape[0]), False, budget)
    if not exclude_self:
        return v, i
    # drop each row's own index if it made the top k + 1, else the (k + 1)-th
    keep = i != rows[:, None]
    keep[keep.all(1), -1] = False
    return v[keep].view(-1, k), i[keep].view(-1, k)


# -- public entry point -------------------------------------------------------------------------
@full_float32_matmuls
def knn(
    query: Any,
    reference: Any | None = None,
    k: int = 1,
    *,
    distance: str | BaseDistance = "cosine",
    exclude_self: bool | None = None,
    backend: str = "auto",
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    order: Any | None = None,
) -> KNNResult:
    """Exact k nearest references of every query, closest first, ties by reference index.

    Args:
        query: ``(N, D)`` embeddings (numpy or torch).
        reference: ``(M, D)`` embeddings; ``None`` searches the query set itself.
        k: neighbours per query; capped at the number of available references.
        distance: a :mod:`dmlkit.distances` name or object (default cosine similarity).
        exclude_self: drop reference ``i`` from query ``i``'s neighbours (by index, not by
            value, so duplicates of a query still count). Default: ``True`` when
            ``reference`` is ``None`` (or is the query object itself), else ``False``.
        backend: ``"auto"``, ``"torch"``, ``"numba"`` or ``"faiss"`` (see the module docstring).
        memory_budget: working memory in bytes for the tiles (the ``N x k`` result, a
            prepared copy of the inputs and, on a numba self-search, 8 ``max(2k, k + 32)``
            bytes a query row are extra).
        order: optional permutation of the query rows used by the faiss backend on a
            self-search to process similar rows together (speed only, same result).

    Returns:
        :class:`KNNResult` with ``(N, k)`` indices and values.
    """
    if backend not in _BACKENDS:
        raise ConfigError(f"unknown kNN backend {backend!r}; choose one of {list(_BACKENDS)}")
    budget = check_budget(memory_budget)
    same = reference is None or reference is query
    q = as_embeddings(query, "query embeddings")
    r = q if same else as_embeddings(reference, "reference embeddings").to(q.device)
    if r.shape[1] != q.shape[1]:
        raise ShapeError(
            f"query has {q.shape[1]} dimensions but reference has {r.shape[1]}: embed both with "
            "the same model"
        )
    if exclude_self is None:
        exclude_self = same
    if exclude_self and r.shape[0] != q.shape[0]:
        raise ShapeError("exclude_self needs query and reference sets of the same size")
    try:
        dist = get_distance(distance)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    available = r.shape[0] - (1 if exclude_self else 0)
    k = check_integer(k, "k")  # True was k = 1
    if available < 1:
        raise DataError("the reference set has no row other than the query itself: add references")
    k = int(min(k, available))
    scorer = _Scorer(dist)
    cpu_symmetric = q.device.type == "cpu" and scorer.symmetric
    if backend == "auto":
        # small searches: torch (no numba import or compiled-kernel load, ~125 MB and a second
        # or two of start-up for a few milliseconds of work)
        backend = "numba" if cpu_symmetric and q.shape[0] * r.shape[0] >= SMALL_SEARCH_PAIRS else "torch"
    if backend in ("numba", "faiss") and not cpu_symmetric:
        raise ConfigError(
            f"the {backend} backend needs CPU tensors and a cosine, dot or Euclidean distance; "
            "use backend='torch'"
        )
    use_faiss = backend == "faiss"
    if use_faiss and not faiss_available():
        require("faiss", "faiss")
    qp = scorer.prepare(q, "query embeddings")
    rp = qp if same else scorer.prepare(r, "reference embeddings")
    if use_faiss:
        perm = None
        if order is not None and same:
            perm = torch.as_tensor(np.asarray(order) if not isinstance(order, torch.Tensor) else order)
            perm = perm.to(torch.int64).cpu()
            if perm.shape != (q.shape[0],) or not torch.equal(
                torch.sort(perm).values, torch.arange(q.shape[0])
            ):
                raise ShapeError("order must be a permutation of the query rows")
        closeness, idx = _knn_faiss(scorer, qp, None if same else rp, k, exclude_self, budget, perm)
    elif backend == "numba":
        closeness, idx = _knn_numba(scorer, qp, None if same else rp, k, exclude_self, budget)
    else:
        closeness, idx = _knn_torch(scorer, qp, rp, k, exclude_self, budget)
    return KNNResult(indices=idx, values=scorer.to_values(closeness), higher_is_closer=dist.higher_is_closer)
