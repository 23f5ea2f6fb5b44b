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
  only if it is linked to the last one, so it can reach a position the metrics read only
  through a run from the last neighbour back to that position. Callers ask for
  :data:`EXTRA_NEIGHBOURS` more neighbours than their metrics read; the rows where such a run
  exists anyway are searched again, exactly: every reference within ``gap`` of the last
  returned value (a float32 product with the same bound finds all of them) is re-scored in
  float64 and the top ``k`` taken.

Every position the metrics read is then exact, on every backend and device (the kNN's own
ties, bfloat16 tiles and BLAS or faiss summation order included).

Exact ties keep the rule (the smaller reference index first); where one holds a relevant and
an irrelevant reference at a read position, the query's metrics come from the order of the
rows, not from the embeddings. Such pairs are always in one run (their float32 values differ
by at most ``2 tol``), so the re-scoring above finds them for free; the rows are flagged
(:class:`Settled`) and counted in one warning (:func:`warn_tie_ruled`).

The earlier rule (a fixed 8 ulps and four odd-even passes) was neither: 40 references whose
closeness to the query differs by 1e-12 (all 1.0 in float32) came out in index order, and
P@1 / MAP@R differed from the float64 ranking by up to 0.04 / 0.012
(``tests/test_near_ties.py``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from dmlkit.distances import LpDistance
from dmlkit.metrics._validation import row_hashes
from dmlkit.metrics.average_precision import closeness_tolerance
from dmlkit.metrics.knn import SMALL_SEARCH_PAIRS, _Scorer, exact_topk

__all__ = ["EXTRA_NEIGHBOURS", "PairScorer", "Settled", "closeness_of", "compiled_scores", "identical_rows",
           "rescore_near_positives", "settle_near_ties", "tie_gap",
           "warn_tie_ruled"]

#: Neighbours a caller asks for beyond the positions its metrics read: a reference the search
#: did not return can then move a read position only through a run of this many linked
#: near-ties (50k x 128, 100 classes, one neighbour more: 14 % of the rows had to be searched
#: again, 3.0 s; with 8 more, none).
EXTRA_NEIGHBOURS = 8
#: Rows of the ``(N, k)`` result handled at once (bounds the temporaries to a few ``(rows, k)``
#: arrays).
_ROW_BLOCK = 4096
#: Ulps of the largest |closeness| added to ``2 tol``: the roundings after the product (the
#: Euclidean bias, a square root and its square, float32 storage of a float64 re-score).
_MARGIN_ULPS = 8


#: ``score(rows, refs)``: float64 closeness of query rows (indices into ``q``) and references.
Relevance = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: ``ref_blocks()``: ``(first index, prepared rows)`` of every reference, in blocks.
RefBlocks = Callable[[], Iterable[tuple[int, torch.Tensor]]]


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
             euclidean: bool, compiled: bool) -> torch.Tensor:
    """Float64 closeness of the pairs ``(q[rows], r[refs])``, each from one function of its two
    rows whatever the batch: the numba kernel with ``compiled`` (a CPU search large enough to
    run the compiled kernels anyway; no float64 copies of the rows), else torch's row form in
    chunks of 2^16 pairs (a small job loads no numba). A caller picks one for a whole search:
    the two round differently, and a float64 matrix product is no such function at all (MKL
    gave bit-identical rows values an ulp apart by column, so exact ties of duplicated rows were
    broken by that noise and moved with the memory budget)."""
    if compiled:
        # lazy: the numba kernels load only when a compiled path runs
        from dmlkit.metrics._kernels import pair_scores64

        return torch.from_numpy(pair_scores64(q.numpy(), r.numpy(), rows.numpy(), refs.numpy(), euclidean))
    out = torch.empty(rows.shape[0], dtype=torch.float64, device=q.device)
    for c0 in range(0, rows.shape[0], 2**16):
        a, b = q[rows[c0 : c0 + 2**16]].double(), r[refs[c0 : c0 + 2**16]].double()
        out[c0 : c0 + 2**16] = -(a - b).pow(2).sum(1) if euclidean else (a * b).sum(1)
    return out


def rescore_near_positives(s: torch.Tensor, positive: torch.Tensor, row0: int, score: PairScorer,
                           margin: float) -> None:
    """Make a block of float64 matrix-product closeness rank as the pair function ``score`` does
    wherever a full ranking reads it, in place: every finite positive (``positive[i, j]``) and
    every other finite entry within ``margin`` of one of its row's positives becomes
    ``score(row0 + i, j)``.

    ``margin`` bounds the difference between a product's value and the pair function's (twice
    :func:`dmlkit.distances.rounding_bound` in float64: both are within one bound of the exact
    value). An entry farther than ``margin`` from every positive's re-scored value then lies on
    the same side of each as its pair-function value, so the ranking's counts are those of the
    pair function, whatever the block's shape (the product's rounding moved with the memory
    budget) and however small the distances: the expanded Euclidean form cancels to an error of
    about ``|x|^2 d 2^-53``, larger than the squared distance of rows an ulp apart, and ranked
    such rows by that noise. Bit-identical rows get equal values wherever it matters (a copy of
    a positive lies within ``margin`` of it). Costs one host synchronisation a block.
    """
    positive = positive & torch.isfinite(s)
    i, j = positive.nonzero(as_tuple=True)
    s[i, j] = score(i + row0, j)
    width = int(positive.sum(1).max()) if positive.numel() else 0
    if width == 0:
        return
    # each row's positives, ascending (padded at the front with -inf)
    val = torch.where(positive, s, -math.inf).topk(width, dim=1, sorted=True).values.flip(1)
    at = torch.searchsorted(val, s)  # val[at - 1] < s <= val[at]
    below = val.gather(1, (at - 1).clamp_min(0))
    above = val.gather(1, at.clamp_max(width - 1))
    near = ((at > 0) & (s - below <= margin)) | ((at < width) & (above - s <= margin))
    near &= ~positive & torch.isfinite(s)
    i, j = near.nonzero(as_tuple=True)
    if i.numel():
        s[i, j] = score(i + row0, j)


def compiled_scores(on_cpu: bool, pairs: int) -> bool:
    """Whether a search of ``pairs`` query-reference pairs scores its float64 pairs with the
    compiled kernel (:func:`_score64`): on the CPU, from the size at which the kNN runs its own
    compiled kernels (:data:`dmlkit.metrics.knn.SMALL_SEARCH_PAIRS`)."""
    return on_cpu and pairs >= SMALL_SEARCH_PAIRS


def identical_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(rows, firsts)``: each row of ``x`` that repeats an earlier one bit for bit, and that
    earlier row's index (its first copy); ``None`` when no row repeats. Found by
    :func:`dmlkit.metrics._validation.row_hashes`, then checked bit for bit (a colliding hash
    is no copy)."""
    h = row_hashes(x).cpu().numpy()
    _, first, inverse = np.unique(h, return_index=True, return_inverse=True)
    if first.size == h.size:
        return None
    firsts = torch.from_numpy(first[inverse.reshape(-1)]).to(x.device)
    rows = torch.arange(x.shape[0], device=x.device)
    bits = x.contiguous().view(torch.int32)
    copy = (firsts != rows) & (bits == bits[firsts]).all(1)
    return rows[copy], firsts[copy]


class PairScorer:
    """``score(rows, refs)``: float64 closeness of ``q[rows]`` and ``r[refs]`` (prepared rows),
    all by one function (:func:`_score64`; ``compiled`` by default from the sizes of ``q`` and
    ``r``)."""

    def __init__(self, q: torch.Tensor, r: torch.Tensor, euclidean: bool,
                 compiled: bool | None = None) -> None:
        self.q, self.r, self.euclidean = q, r, euclidean
        if compiled is None:
            compiled = compiled_scores(q.device.type == "cpu", q.shape[0] * r.shape[0])
        self.compiled = compiled

    def __call__(self, rows: torch.Tensor, refs: torch.Tensor) -> torch.Tensor:
        return _score64(self.q, self.r, rows, refs, self.euclidean, self.compiled)


def _sort_runs(idx: torch.Tensor, linked: torch.Tensor, differ: torch.Tensor,
               score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], relevant: Relevance,
               read: torch.Tensor) -> torch.Tensor:
    """Sort, in place in the contiguous ``idx``, every run of neighbours (``linked[:, j]``: positions ``j`` and ``j + 1`` are in one)
    that mixes relevances (``differ[:, j]``: a link between a relevant and an irrelevant one;
    a run mixes them iff one of its links does) by (float64 closeness descending, index
    ascending); ``score(rows, refs)`` re-scores pairs (rows local). Returns, per row, whether
    the tie rule decides what it reads (:func:`_tie_ruled`; ``relevant(rows, refs)``, ``read``
    as in :func:`settle_near_ties`)."""
    n, k = idx.shape
    starts = torch.ones(n, k, dtype=torch.bool, device=idx.device)
    starts[:, 1:] = ~linked
    run = torch.cumsum(starts.reshape(-1), 0) - 1  # a global run id, in row-major order
    mixed = torch.zeros(int(run[-1]) + 1, dtype=torch.bool, device=idx.device)
    r_, j_ = differ.nonzero(as_tuple=True)
    mixed[run[r_ * k + j_]] = True
    pos = mixed[run].nonzero().squeeze(1)
    rows, refs, runs = pos // k, idx.reshape(-1)[pos], run[pos]
    out = idx.reshape(-1)  # a run's positions are contiguous and in the order of run ids
    out[pos], s64 = _sorted_within_runs(runs, score(rows, refs), refs)
    group = torch.ones_like(runs, dtype=torch.bool)  # a group of equal closeness starts here
    group[1:] = (runs[1:] != runs[:-1]) | (s64[1:] != s64[:-1])
    return _tie_ruled(rows, pos % k, group, relevant(rows, out[pos]), read, n)


def _tie_ruled(rows: torch.Tensor, position: torch.Tensor, group: torch.Tensor,
               relevant: torch.Tensor, read: torch.Tensor, n: int) -> torch.Tensor:
    """Per row (of ``n``), whether a group of neighbours with exactly equal float64 closeness
    holds relevant and irrelevant ones and starts at a position the metrics read (``position
    < read[row]``): their order then comes from the tie rule (the smaller reference index
    first), and another order of the same embeddings would read differently. Entries are in
    row-major order, ``group`` marks each group's first one (a group never spans two rows)."""
    gid = torch.cumsum(group.to(torch.int64), 0) - 1
    n_groups = int(gid[-1]) + 1 if gid.numel() else 0
    rel = relevant.to(torch.int64)
    high = torch.zeros(n_groups, dtype=torch.int64, device=rows.device).scatter_reduce_(0, gid, rel, "amax")
    low = torch.ones(n_groups, dtype=torch.int64, device=rows.device).scatter_reduce_(0, gid, rel, "amin")
    first_row = rows[group]
    ruled = (high != low) & (position[group] < read[first_row])
    out = torch.zeros(n, dtype=torch.bool, device=rows.device)
    out[first_row[ruled]] = True
    return out


#: Runs up to this long are sorted by odd-even transposition (one vectorised pass per position);
#: longer ones by three stable sorts of all positions.
_TRANSPOSITION_MAX = 32


def _sorted_within_runs(runs: torch.Tensor, s64: torch.Tensor, refs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(refs, s64)`` reordered within each run (``runs``: non-decreasing ids) by float64
    closeness ``s64`` descending, then reference ascending. Runs are mostly two or three long: odd-even
    transposition, which sorts a run of length ``L`` in ``L`` passes, takes 5-10 % of the time
    of three stable sorts of all positions (1.6 million positions at 50k x 500 neighbours);
    beyond :data:`_TRANSPOSITION_MAX` the sorts."""
    if runs.numel() < 2:
        return refs, s64
    same = runs[1:] == runs[:-1]
    # the longest run: the longest stretch of consecutive "same" links, plus one
    breaks = torch.cat([torch.tensor([-1], device=runs.device), (~same).nonzero().squeeze(1),
                        torch.tensor([same.numel()], device=runs.device)])
    longest = int((breaks[1:] - breaks[:-1]).max())
    if longest > _TRANSPOSITION_MAX:
        order = torch.argsort(refs, stable=True)
        order = order[torch.argsort(-s64[order], stable=True)]
        order = order[torch.argsort(runs[order], stable=True)]
        return refs[order], s64[order]
    s, r = s64.clone(), refs.clone()
    starts = [same[0::2].nonzero().squeeze(1) * 2, same[1::2].nonzero().squeeze(1) * 2 + 1]
    for it in range(longest):
        i = starts[it % 2]  # pairs (i, i + 1) of one run, every other position
        a, b = s[i], s[i + 1]
        swap = (b > a) | ((b == a) & (r[i + 1] < r[i]))
        j = i[swap]
        if j.numel():
            s[j], s[j + 1] = s[j + 1], s[j].clone()
            r[j], r[j + 1] = r[j + 1], r[j].clone()
    return r, s


def _exact_rows(
    q_rows: torch.Tensor, floor: torch.Tensor, k: int, gap: float, scorer: _Scorer,
    ref_blocks: RefBlocks, self_index: torch.Tensor | None, budget: int, compiled: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact top ``k`` (float64 closeness, ties by index) of prepared query rows ``q_rows``
    whose ``k``-th float32 closeness was ``floor``, with that closeness: every reference within ``gap`` below it is a
    candidate (the true top ``k`` all are: each has a float32 closeness of at least the true
    ``k``-th value minus ``tol``, itself at least ``floor - tol``), re-scored in float64.
    ``ref_blocks()`` yields ``(first index, prepared rows)``; ``self_index`` (a self-search) is
    each query's own reference index, never a candidate.

    Memory stays within ``budget`` however many references tie (all of them, for collapsed
    embeddings): rows in chunks, references in column blocks, and after each block only each
    row's best ``k`` candidates are kept (:func:`dmlkit.metrics.knn.exact_topk`, the merge the
    streaming evaluation uses). For inner products on a device, a block where most references
    are candidates is scored by one float64 product instead of pair by pair."""
    dev = q_rows.device
    n = q_rows.shape[0]
    euclidean = scorer.kind == "l2"
    low = (floor - gap).float()
    low = torch.where(low.double() > floor - gap, torch.nextafter(low, torch.full_like(low, -np.inf)), low)
    q_sq = scorer.sq_norms(q_rows)
    chunk = max(1, min(n, 1024, budget // max(1, 64 * k)))
    out = torch.empty(n, k, dtype=torch.int64, device=dev)
    out_v = torch.empty(n, k, dtype=torch.float64, device=dev)
    for a0 in range(0, n, chunk):
        a1 = min(n, a0 + chunk)
        cols = max(1, budget // (32 * (a1 - a0)))
        qa, qa_sq, low_a = q_rows[a0:a1], None if q_sq is None else q_sq[a0:a1], low[a0:a1, None]
        best_v = torch.empty(a1 - a0, 0, dtype=torch.float64, device=dev)
        best_i = torch.empty(a1 - a0, 0, dtype=torch.int64, device=dev)
        for b0, blk in ref_blocks():
            for c0 in range(0, blk.shape[0], cols):
                r_blk = blk[c0 : c0 + cols]
                keep = scorer.block(qa, r_blk, qa_sq, scorer.sq_norms(r_blk)) >= low_a
                if self_index is not None:
                    own = self_index[a0:a1] - (b0 + c0)
                    inside = ((own >= 0) & (own < r_blk.shape[0])).nonzero().squeeze(1)
                    keep[inside, own[inside]] = False
                rr, cc = keep.nonzero(as_tuple=True)
                if not euclidean and rr.numel() * 4 > keep.numel() and dev.type != "cpu":
                    # mostly candidates on a device: one float64 product (not for Euclidean:
                    # |a|^2 + |b|^2 - 2ab cancels on near-equal rows; not on the CPU, where MKL's
                    # product gave identical rows values an ulp apart by column: _score64)
                    s64 = (qa.double() @ r_blk.double().T).masked_fill_(~keep, -np.inf)
                else:
                    s64 = torch.full(keep.shape, -np.inf, dtype=torch.float64, device=dev)
                    s64[rr, cc] = _score64(qa, r_blk, rr, cc, euclidean, compiled)
                ids = torch.arange(b0 + c0, b0 + c0 + r_blk.shape[0], device=dev).expand_as(s64)
                cat_v, cat_i = torch.cat([best_v, s64], 1), torch.cat([best_i, ids], 1)
                best_v, best_i = exact_topk(cat_v, min(k, cat_v.shape[1]), indices=cat_i)
        if best_v.shape[1] < k or bool((best_v[:, -1] == -np.inf).any()):
            # cannot happen with the bound above; never return a short row
            raise RuntimeError("near-tie search found fewer candidates than neighbours: please report")
        out[a0:a1], out_v[a0:a1] = best_i, best_v
    return out, out_v


class Settled(NamedTuple):
    """:func:`settle_near_ties`'s result."""

    #: the neighbours, in the exact float64 order at every position the metrics read
    indices: torch.Tensor
    #: per query, whether the tie rule decides what its metrics read: relevant and irrelevant
    #: references of exactly equal float64 closeness there (:func:`warn_tie_ruled`)
    tie_ruled: torch.Tensor


def settle_near_ties(
    idx: torch.Tensor, values: torch.Tensor, scorer: _Scorer, q: torch.Tensor,
    query_labels: torch.Tensor, reference_labels: torch.Tensor, *, r_norm: float,
    score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], compiled: bool,
    ref_blocks: RefBlocks, complete: bool, budget: int,
    query_index: torch.Tensor | None = None, read: torch.Tensor | None = None,
) -> Settled:
    """``idx`` (the kNN's ``(N, k)`` neighbours, ``values`` in the distance's units) put in the
    exact float64 order at every position the metrics read (see the module), in place. ``q``: the *prepared* float32
    query rows the kNN searched; ``r_norm``: the largest norm of the prepared references;
    ``complete``: the result holds every reference (nothing can be missing at the boundary);
    ``query_index``: on a self-search, each query's own reference index (never a candidate);
    ``score(rows, refs)``: the float64 closeness of query rows and references, by the one
    function ``compiled`` names (:func:`_score64`, :class:`PairScorer`; the rows searched again
    are scored by it too);
    ``read``: per row, how many leading positions the metrics read (default ``k - 1``): a row
    is searched again only if the run reaching its last neighbour starts before that, so asking
    for a few neighbours more than the metrics read (:data:`EXTRA_NEIGHBOURS`) makes that rare.

    Also flags the rows whose read positions the tie rule decides: a group of exactly equal
    float64 closeness with relevant and irrelevant references that starts before ``read``
    (two such references differ by at most ``2 tol`` in float32, so they are in one run, and
    a mixed run is re-scored anyway: no extra work). On a row searched again, a group of equal
    ones that starts before ``read`` and reaches the last neighbour may go on among the
    references not returned, and is flagged too. Cosine, dot and Euclidean only; others are
    returned as they are, unflagged."""
    n, k = idx.shape
    none = torch.zeros(n, dtype=torch.bool, device=idx.device)
    if scorer.kind == "generic" or idx.numel() == 0 or k < 2:
        return Settled(idx, none)
    dev = idx.device
    q_norm = float(q.norm(dim=1).max()) if q.numel() else 0.0
    gap = tie_gap(scorer, q.shape[1], q_norm, r_norm, closeness_of(values.abs().max(), scorer))
    ql, rl = query_labels.to(dev), reference_labels.to(dev)
    read = torch.full((n,), k - 1, dtype=torch.int64, device=dev) if read is None else read.to(dev)
    redo: list[torch.Tensor] = []
    last = torch.empty(n, dtype=torch.float64, device=dev)
    tie_ruled = none.clone()
    for a0 in range(0, n, _ROW_BLOCK):
        a1 = min(n, a0 + _ROW_BLOCK)
        blk_idx, blk_c = idx[a0:a1], closeness_of(values[a0:a1], scorer)
        last[a0:a1] = blk_c[:, -1]
        relevant = rl[blk_idx] == ql[a0:a1, None]
        linked = (blk_c[:, :-1] - blk_c[:, 1:]) <= gap
        differ = linked & (relevant[:, :-1] != relevant[:, 1:])
        mixed = differ.any(1).nonzero().squeeze(1)  # the rows with a run to sort
        if mixed.numel():
            rows = mixed + a0
            settled = blk_idx[mixed]
            ruled = _sort_runs(settled, linked[mixed], differ[mixed],
                               lambda r_, refs, m=rows: score(m[r_], refs),
                               lambda r_, refs, m=rows: rl[refs] == ql[m[r_]], read[rows])
            idx[rows] = settled
            tie_ruled[rows] = ruled
        if not complete:
            # the run reaching the last neighbour starts after the last unlinked gap
            unlinked = (~linked).flip(1)
            trailing = torch.where(unlinked.any(1), unlinked.to(torch.uint8).argmax(1),
                                   torch.full((a1 - a0,), k - 1, device=dev))
            start = (k - 1) - trailing
            redo.append((start < read[a0:a1]).nonzero().squeeze(1) + a0)
    rows = torch.cat(redo) if redo else torch.empty(0, dtype=torch.int64, device=dev)
    if rows.numel():
        exact, exact_v = _exact_rows(q[rows], last[rows], k, gap, scorer, ref_blocks,
                                     None if query_index is None else query_index[rows], budget,
                                     compiled)
        idx[rows] = exact
        tie_ruled[rows] = _redone_tie_ruled(exact, exact_v, rl[exact] == ql[rows, None], read[rows])
    return Settled(idx, tie_ruled)


def _redone_tie_ruled(idx: torch.Tensor, v64: torch.Tensor, relevant: torch.Tensor,
                      read: torch.Tensor) -> torch.Tensor:
    """:func:`_tie_ruled` of rows searched again (their exact neighbours ``idx``, float64
    closeness ``v64``): a group of equal closeness that reaches the last neighbour counts as
    mixed, since it may go on among the references not returned."""
    n, k = idx.shape
    group = torch.ones(n, k, dtype=torch.bool, device=idx.device)
    group[:, 1:] = v64[:, 1:] != v64[:, :-1]
    # the last group of each row: from its last start to the end; made mixed by marking it
    # both relevant and irrelevant (its first entry one way, the rest the other)
    last_start = (k - 1) - group.flip(1).to(torch.uint8).argmax(1)
    positions = torch.arange(k, device=idx.device).expand(n, k)
    in_last = positions >= last_start[:, None]
    rel = torch.where(in_last, positions != last_start[:, None], relevant)
    rows = torch.arange(n, device=idx.device)[:, None].expand(n, k)
    return _tie_ruled(rows.reshape(-1), positions.reshape(-1), group.reshape(-1), rel.reshape(-1), read, n)


def warn_tie_ruled(tie_ruled: torch.Tensor, valid: torch.Tensor, names: Sequence[str]) -> None:
    """One warning where the tie rule decides what the metrics ``names`` read for some of the
    ``valid`` queries (those with a positive; ``tie_ruled`` from :func:`settle_near_ties`): the
    numbers are the ones dmlkit's rule gives (the smaller reference index first), but the
    same embeddings in another order would score differently."""
    valid = valid.cpu()
    ruled, total = int((tie_ruled.cpu() & valid).sum()), int(valid.sum())
    if ruled:
        warnings.warn(
            f"{', '.join(names)}: for {ruled} of {total} queries, a reference of their class and "
            "one of another class are exactly as close where these metrics read them; dmlkit ranks "
            "such ties by reference index, so those queries' metrics depend on the order of the "
            "data, not on the embeddings (collapsed, quantised or duplicated embeddings?)",
            stacklevel=3)
