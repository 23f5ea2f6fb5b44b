"""Retrieval metrics from ranked neighbours: P@1, Recall@K, Precision@K, R-Precision, MAP@R, MAP.

For a query ``q`` let ``R_q`` be the number of references of its class (not counting the query
itself when the query set is the reference set) and ``rel_i`` = 1 if the ``i``-th nearest
reference has the query's class (ranking by closeness, ties by reference index).

* ``precision_at_1`` = ``rel_1``.
* ``recall_at_{K}`` = 1 if any of the ``K`` nearest is relevant, else 0 (the definition used
  in metric learning since Song et al., "Deep Metric Learning via Lifted Structured Feature
  Embedding", CVPR 2016 - *not* the information-retrieval recall).
* ``precision_at_{K}`` = ``(1/K) sum_{i<=K} rel_i``.
* ``r_precision`` = ``r / R_q`` with ``r = sum_{i<=R_q} rel_i`` (Musgrave et al., "A Metric
  Learning Reality Check", ECCV 2020).
* ``map_at_r`` = ``(1/R_q) sum_{i<=R_q} P(i)``, ``P(i)`` = precision at ``i`` if ``rel_i`` else 0
  (same paper).
* ``map`` = average precision over the *full* ranking, ``(1/R_q) sum_{positives j} P(rank_j)``.

Each value is averaged over the queries with ``R_q > 0``; queries without any same-class
reference carry no information about retrieval and are counted separately
(``num_queries_without_positive``), never divided by zero.
"""

from __future__ import annotations

import math

import torch

__all__ = ["RETRIEVAL_PREFIXES", "num_positives", "per_query_from_neighbours", "full_ranking_ap"]

RETRIEVAL_PREFIXES = ("precision_at_", "recall_at_")

#: Rows of the (queries x k) relevance matrix processed at a time by the metric arithmetic.
_ROW_BLOCK = 8192


def num_positives(
    query_labels: torch.Tensor, reference_labels: torch.Tensor, exclude_self: bool
) -> torch.Tensor:
    """``R_q``: references sharing each query's label (minus the query itself if excluded)."""
    classes, counts = torch.unique(reference_labels, return_counts=True)
    pos = torch.searchsorted(classes, query_labels).clamp_max(classes.numel() - 1)
    found = classes[pos] == query_labels
    r = torch.where(found, counts[pos], torch.zeros_like(pos))
    if exclude_self:
        r = r - (reference_labels == query_labels).to(r.dtype)
    return r


def per_query_from_neighbours(
    neighbours: torch.Tensor,
    reference_labels: torch.Tensor,
    query_labels: torch.Tensor,
    r: torch.Tensor,
    names: list[str],
) -> dict[str, torch.Tensor]:
    """Per-query float64 scores for ``names`` from the ranked neighbours.

    ``neighbours`` is ``(N, k)`` reference indices (closest first), ``r`` is ``R_q``. R-based metrics use
    the first ``min(R_q, k)`` columns, so ``k`` must be at least ``max R_q`` for them to be
    exact (:func:`dmlkit.metrics.evaluate` ensures it).
    """
    n, k = neighbours.shape
    dev = neighbours.device  # computed where the neighbours are; the scores come back to the CPU
    reference_labels, query_labels, r = reference_labels.to(dev), query_labels.to(dev), r.to(dev)
    out = {name: torch.empty(n, dtype=torch.float64) for name in names}
    ranks = torch.arange(1, k + 1, dtype=torch.float64, device=dev)
    for a0 in range(0, n, _ROW_BLOCK):
        a1 = min(n, a0 + _ROW_BLOCK)
        rel = reference_labels[neighbours[a0:a1]] == query_labels[a0:a1, None]
        rq = r[a0:a1]
        need_r = any(name in ("r_precision", "map_at_r") for name in names)
        if need_r:
            in_r = torch.arange(k, device=dev)[None, :] < rq[:, None]
            rel_r = rel & in_r
            denom = rq.clamp_min(1).to(torch.float64)
        for name in names:
            if name == "precision_at_1":
                val = rel[:, 0].to(torch.float64)
            elif name.startswith("recall_at_"):
                kk = int(name.rsplit("_", 1)[1])
                val = rel[:, :kk].any(1).to(torch.float64)
            elif name.startswith("precision_at_"):
                kk = int(name.rsplit("_", 1)[1])
                val = rel[:, :kk].sum(1, dtype=torch.int64).to(torch.float64) / kk
            elif name == "r_precision":
                val = rel_r.sum(1, dtype=torch.int64).to(torch.float64) / denom
            elif name == "map_at_r":
                hits = rel_r.cumsum(1, dtype=torch.int32)
                prec = torch.where(rel_r, hits.to(torch.float64) / ranks, 0.0)
                val = prec.sum(1) / denom
            else:  # pragma: no cover - guarded by evaluate()
                raise KeyError(name)
            out[name][a0:a1] = val
    return out


def full_ranking_ap(
    closeness_rows: torch.Tensor, query_labels: torch.Tensor, reference_labels: torch.Tensor, r: torch.Tensor
) -> torch.Tensor:
    """Average precision over the full ranking for a block of queries, without sorting rows.

    ``closeness_rows`` is ``(B, M)`` (larger = closer; excluded references at ``-inf``), one row
    per query; ties rank by the smaller reference index. ``AP = (1/R) sum_p (p + 1) / rank_p``
    over the positives in ranking order (Manning, Raghavan and Schuetze 2008, sec. 8.4). Per row
    the ``R`` positives' closeness is sorted (descending, ties by index) and every reference is
    placed among them by binary search: ``e(j)`` = the positives ranked before ``j`` (a float64
    tie with a positive is settled by index), and ``rank_p = #{j : e(j) <= p}`` (positive ``p``
    itself included). ``O(M log R)`` a row instead of a sort's ``O(M log M)``; the same on any
    device (on a GPU the counts are one ``scatter_add``).
    """
    s = closeness_rows
    b, m = s.shape
    dev = s.device
    finite = torch.isfinite(s)
    pos = (reference_labels[None, :] == query_labels[:, None]) & finite
    counts = pos.sum(1)
    r_max = int(counts.max()) if b else 0
    if r_max == 0:
        return torch.zeros(b, dtype=torch.float64, device=dev)
    # each row's positives, left-aligned in column order (padded with closeness -inf)
    rows, cols = pos.nonzero(as_tuple=True)
    slot = torch.arange(rows.numel(), device=dev) - (counts.cumsum(0) - counts)[rows]
    pos_col = torch.zeros(b, r_max, dtype=torch.int64, device=dev)
    pos_col[rows, slot] = cols
    pos_val = torch.full((b, r_max), -math.inf, dtype=s.dtype, device=dev)
    pos_val[rows, slot] = s[rows, cols]
    del pos, rows, cols, slot
    pos_val, order = torch.sort(pos_val, dim=1, descending=True, stable=True)
    pos_col = pos_col.gather(1, order)
    keys = pos_val.neg_().contiguous()  # ascending; the padding is +inf
    neg = s.neg().contiguous()
    before = torch.searchsorted(keys, neg, side="left")  # positives strictly closer than j
    tied = finite & (keys.gather(1, before.clamp(max=r_max - 1)) == neg)
    if bool(tied.any()):  # equal float64 closeness: the positives of smaller index rank first
        tr, tc = tied.nonzero(as_tuple=True)
        value, at = neg[tr, tc], before[tr, tc]
        live = torch.ones_like(tc, dtype=torch.bool)
        while bool(live.any()):  # along each run of equal keys
            k = at.clamp(max=r_max - 1)
            live &= (at < r_max) & (keys[tr, k] == value)
            before[tr, tc] += live & (pos_col[tr, k] < tc)
            at += 1
    del neg, tied
    placed = torch.zeros(b, r_max + 1, dtype=torch.int64, device=dev)
    placed.scatter_add_(1, before, torch.ones((), dtype=torch.int64, device=dev).expand_as(before))
    ranks = placed[:, :r_max].cumsum(1).to(torch.float64)
    p = torch.arange(1, r_max + 1, dtype=torch.float64, device=dev)
    prec = torch.where(p[None, :] <= counts[:, None], p / ranks, 0.0)
    return prec.sum(1) / r.clamp_min(1).to(torch.float64)
