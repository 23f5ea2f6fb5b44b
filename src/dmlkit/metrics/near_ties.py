"""Exact order of a float32 kNN result: near-ties settled by float64 scores, with a proven bound.

A float32 kNN (torch, numba or faiss; CPU or GPU) ranks float32 closeness values, each within
``tol`` of its float64 value whatever the summation order (:func:`closeness_tolerance`: ``(d +
4) 2^-24 |x| |y|`` for an inner product, Higham, *Accuracy and Stability of Numerical
Algorithms*, 2nd ed., sec. 3.1). Two neighbours can therefore come out in the wrong order only
if their float32 values differ by at most ``2 tol``. :func:`settle_near_ties` makes a result
equal to the ranking by float64 closeness (exact ties by the smaller reference index), the one
every other metric path uses:

* **runs**: neighbours linked by gaps of at most ``gap`` (``2 tol`` plus a few ulps for the
  final roundings) form runs; two neighbours in different runs differ by more than ``2 tol``,
  so their order is already right. A run that mixes relevant and irrelevant references is
  re-scored in float64 and sorted (a run of one relevance reads the same to every metric).
* **the boundary**: a reference the search did not return can belong before a returned one
  only if it ties with the last one; rows whose last two neighbours are linked are searched
  again, exactly: every reference within ``gap`` of the last returned value (a float32 product
  with the same bound finds all of them) is re-scored in float64 and the top ``k`` taken.
  Callers ask for one neighbour more than the metrics read, so every position they read is
  exact.

The earlier rule (a fixed 8 ulps and four odd-even passes) was neither: 40 references whose
closeness to the query differs by 1e-12 (all 1.0 in float32) came out in index order, and
P@1 / MAP@R differed from the float64 ranking by up to 0.04 / 0.012
(``tests/test_near_ties.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

from dmlkit.distances import LpDistance
from dmlkit.metrics.average_precision import closeness_tolerance
from dmlkit.metrics.knn import _Scorer

__all__ = ["EXTRA_NEIGHBOURS", "closeness_of", "pair_scorer", "settle_near_ties", "tie_gap"]

#: Neighbours a caller asks for beyond the positions its metrics read: a reference the search
#: did not return can then move a read position only through a run of this many linked
#: near-ties (50k x 128, 100 classes: 14 % of rows had their last two neighbours linked, 0.1 %
#: a run of 9).
EXTRA_NEIGHBOURS = 8
#: Rows of the ``(N, k)`` result handled at once (bounds the temporaries to a few ``(rows, k)``
#: arrays).
_ROW_BLOCK = 4096
#: Ulps of the largest |closeness| added to ``2 tol``: the roundings after the product (the
#: Euclidean bias, a square root and its square, float32 storage of a float64 re-score).
_MARGIN_ULPS = 8


def closeness_of(values: torch.Tensor, scorer: _Scorer) -> torch.Tensor:
    """The kNN's values as float64 closeness in the kernels' units: the inner product, or minus
    the squared Euclidean distance (a distance with ``power=1`` is squared back)."""
    v = values.double()
    if scorer.kind == "ip":
        return v
    dist = scorer.distance
    assert isinstance(dist, LpDistance)
    return -(v if dist.power == 2 else v * v)


def tie_gap(scorer: _Scorer, d: int, q_norm: float, r_norm: float, closeness: torch.Tensor) -> float:
    """The largest float32 gap between two neighbours that float32 rounding can invert: twice
    the product's error bound for rows of at most these norms (prepared rows, dimension ``d``),
    plus :data:`_MARGIN_ULPS` of the largest |closeness|."""
    tol = closeness_tolerance(scorer.kind, d, q_norm, r_norm)
    top = float(closeness.abs().max()) if closeness.numel() else 0.0
    return 2.0 * tol + _MARGIN_ULPS * float(np.finfo(np.float32).eps) * max(1.0, top)


def _score64(q: torch.Tensor, r: torch.Tensor, rows: torch.Tensor, refs: torch.Tensor,
             euclidean: bool) -> torch.Tensor:
    """Float64 closeness of the pairs ``(q[rows], r[refs])``: the numba kernel (no float64 copies
    of the rows) for many pairs on the CPU, torch in chunks of 2^16 pairs otherwise."""
    if rows.numel() > 4096 and q.device.type == "cpu":
        # lazy: the numba kernels load only when a compiled path runs
        from dmlkit.metrics._kernels import pair_scores64

        return torch.from_numpy(pair_scores64(q.numpy(), r.numpy(), rows.numpy(), refs.numpy(), euclidean))
    out = torch.empty(rows.shape[0], dtype=torch.float64, device=q.device)
    for c0 in range(0, rows.shape[0], 2**16):
        a, b = q[rows[c0 : c0 + 2**16]].double(), r[refs[c0 : c0 + 2**16]].double()
        out[c0 : c0 + 2**16] = -(a - b).pow(2).sum(1) if euclidean else (a * b).sum(1)
    return out


def pair_scorer(q: torch.Tensor, r: torch.Tensor, euclidean: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``score(rows, refs)``: float64 closeness of ``q[rows]`` and ``r[refs]`` (prepared rows)."""
    return lambda rows, refs: _score64(q, r, rows, refs, euclidean)


def _sort_runs(idx: torch.Tensor, linked: torch.Tensor, relevant: torch.Tensor,
               score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Sort every run of neighbours (``linked[:, j]``: positions ``j`` and ``j + 1`` are in one)
    that mixes relevances by (float64 closeness descending, index ascending); ``score(rows,
    refs)`` re-scores pairs (rows local)."""
    n, k = idx.shape
    starts = torch.ones(n, k, dtype=torch.bool, device=idx.device)
    starts[:, 1:] = ~linked
    run = torch.cumsum(starts.reshape(-1), 0) - 1  # a global run id, in row-major order
    n_runs = int(run[-1]) + 1
    rel = relevant.reshape(-1).to(torch.int8)
    length = torch.bincount(run, minlength=n_runs)
    some = torch.zeros(n_runs, dtype=torch.int8, device=idx.device).scatter_reduce(0, run, rel, "amax")
    every = torch.ones(n_runs, dtype=torch.int8, device=idx.device).scatter_reduce(0, run, rel, "amin")
    mixed = (length > 1) & (some != every)
    pos = mixed[run].nonzero().squeeze(1)
    if pos.numel() == 0:
        return idx
    rows, refs, runs = pos // k, idx.reshape(-1)[pos], run[pos]
    s64 = score(rows, refs)
    order = torch.argsort(refs, stable=True)
    order = order[torch.argsort(-s64[order], stable=True)]
    order = order[torch.argsort(runs[order], stable=True)]
    out = idx.clone().reshape(-1)
    out[pos] = refs[order]  # a run's positions are contiguous and in the order of run ids
    return out.reshape(n, k)


def _exact_rows(
    q_rows: torch.Tensor, floor: torch.Tensor, k: int, gap: float, scorer: _Scorer,
    ref_blocks: Callable[[], Iterable[tuple[int, torch.Tensor]]], self_index: torch.Tensor | None,
    budget: int,
) -> torch.Tensor:
    """The exact top ``k`` (float64 closeness, ties by index) of prepared query rows ``q_rows``
    whose ``k``-th float32 closeness was ``floor``: every reference within ``gap`` below it is a
    candidate (the true top ``k`` all are: each has a float32 closeness of at least the true
    ``k``-th value minus ``tol``, itself at least ``floor - tol``), re-scored in float64.
    ``ref_blocks()`` yields ``(first index, prepared rows)``; ``self_index`` (a self-search) is
    each query's own reference index, never a candidate."""
    dev = q_rows.device
    euclidean = scorer.kind == "l2"
    low = (floor - gap).float()
    low = torch.where(low.double() > floor - gap, torch.nextafter(low, torch.full_like(low, -np.inf)), low)
    rows_c, refs_c, s_c = [], [], []
    q_sq = scorer.sq_norms(q_rows)
    for b0, r_blk in ref_blocks():
        r_sq = scorer.sq_norms(r_blk)
        step = max(1, budget // max(1, r_blk.shape[0] * 8))
        for a0 in range(0, q_rows.shape[0], step):
            a1 = min(q_rows.shape[0], a0 + step)
            c32 = scorer.block(q_rows[a0:a1], r_blk, None if q_sq is None else q_sq[a0:a1], r_sq)
            keep = c32 >= low[a0:a1, None]
            if self_index is not None:
                own = self_index[a0:a1] - b0
                inside = (own >= 0) & (own < r_blk.shape[0])
                keep[inside.nonzero().squeeze(1), own[inside]] = False
            rr, cc = keep.nonzero(as_tuple=True)
            s_c.append(_score64(q_rows, r_blk, rr + a0, cc, euclidean))
            rows_c.append(rr + a0)
            refs_c.append(cc + b0)
    rows, refs, s64 = torch.cat(rows_c), torch.cat(refs_c), torch.cat(s_c)
    order = torch.argsort(refs, stable=True)
    order = order[torch.argsort(-s64[order], stable=True)]
    order = order[torch.argsort(rows[order], stable=True)]
    rows, refs = rows[order], refs[order]
    count = torch.bincount(rows, minlength=q_rows.shape[0])
    if bool((count < k).any()):  # cannot happen with the bound above; never return a short row
        raise RuntimeError("near-tie search found fewer candidates than neighbours: please report")
    first = torch.cumsum(count, 0) - count
    rank = torch.arange(rows.shape[0], device=dev) - first[rows]
    take = rank < k
    out = torch.empty(q_rows.shape[0], k, dtype=torch.int64, device=dev)
    out[rows[take], rank[take]] = refs[take]
    return out


#: ``score(rows, refs)``: float64 closeness of query rows (indices into ``q``) and references.
PairScorer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: ``ref_blocks()``: ``(first index, prepared rows)`` of every reference, in blocks.
RefBlocks = Callable[[], Iterable[tuple[int, torch.Tensor]]]


def settle_near_ties(
    idx: torch.Tensor, values: torch.Tensor, scorer: _Scorer, q: torch.Tensor,
    query_labels: torch.Tensor, reference_labels: torch.Tensor, *, r_norm: float,
    score: PairScorer, ref_blocks: RefBlocks, complete: bool, budget: int,
    query_index: torch.Tensor | None = None, read: torch.Tensor | None = None,
) -> torch.Tensor:
    """``idx`` (the kNN's ``(N, k)`` neighbours, ``values`` in the distance's units) in the exact
    float64 order at every position but the last (see the module). ``q``: the *prepared* float32
    query rows the kNN searched; ``r_norm``: the largest norm of the prepared references;
    ``complete``: the result holds every reference (nothing can be missing at the boundary);
    ``query_index``: on a self-search, each query's own reference index (never a candidate);
    ``read``: per row, how many leading positions the metrics read (default ``k - 1``): a row
    is searched again only if the run reaching its last neighbour starts before that, so asking
    for a few neighbours more than the metrics read (:data:`EXTRA_NEIGHBOURS`) makes that rare.
    Cosine, dot and Euclidean only; others are returned as they are."""
    if scorer.kind == "generic" or idx.numel() == 0:
        return idx
    n, k = idx.shape
    dev = idx.device
    c = closeness_of(values, scorer)
    q_norm = float(q.norm(dim=1).max()) if q.numel() else 0.0
    gap = tie_gap(scorer, q.shape[1], q_norm, r_norm, c)
    ql, rl = query_labels.to(dev), reference_labels.to(dev)
    out = idx
    redo: list[torch.Tensor] = []
    for a0 in range(0, n, _ROW_BLOCK):
        a1 = min(n, a0 + _ROW_BLOCK)
        blk_idx, blk_c = idx[a0:a1], c[a0:a1]
        if k < 2:
            continue
        relevant = rl[blk_idx] == ql[a0:a1, None]
        linked = (blk_c[:, :-1] - blk_c[:, 1:]) <= gap
        # a run mixes relevances iff one of its links does: sort only the rows that have one
        mixed = (linked & (relevant[:, :-1] != relevant[:, 1:])).any(1).nonzero().squeeze(1)
        if mixed.numel():
            settled = _sort_runs(blk_idx[mixed], linked[mixed], relevant[mixed],
                                 lambda rows, refs, m=mixed + a0: score(m[rows], refs))
            if out is idx:
                out = idx.clone()
            out[a0 + mixed] = settled
        if not complete:
            # where the run that reaches the last neighbour starts: past the last unlinked gap
            cols = torch.arange(1, k, device=dev).expand_as(linked)
            start = torch.where(linked, torch.zeros_like(cols), cols).amax(1)
            limit = torch.full_like(start, k - 1) if read is None else read[a0:a1].to(dev)
            redo.append((start < limit).nonzero().squeeze(1) + a0)
    rows = torch.cat(redo) if redo else torch.empty(0, dtype=torch.int64, device=dev)
    if rows.numel():
        exact = _exact_rows(q[rows], c[rows, -1], k, gap, scorer, ref_blocks,
                            None if query_index is None else query_index[rows], budget)
        if out is idx:
            out = idx.clone()
        out[rows] = exact
    return out
