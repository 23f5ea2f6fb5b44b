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
(``num_queries_without_positive``), never divided by zero. A mean that is the same for any
embeddings (one class among the references: every ranking puts the positives first; a
Recall@K whose ``K`` exceeds every query's negatives; a Precision@K whose ``K`` reaches every
reference) is NaN, with a warning (:func:`warn_embedding_independent`), as the clustering
metrics are on one class.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
import torch

__all__ = [
    "RETRIEVAL_PREFIXES", "num_positives", "per_query_from_neighbours", "full_ranking_ap", "full_ranking_ap_block",
    "cutoff", "embedding_independent", "per_query_arrays", "warn_embedding_independent",
]

RETRIEVAL_PREFIXES = ("precision_at_", "recall_at_")

def cutoff(name: str) -> int | None:
    """``K`` of ``recall_at_K`` / ``precision_at_K`` (``RETRIEVAL_PREFIXES``), else ``None``."""
    for prefix in RETRIEVAL_PREFIXES:
        if name.startswith(prefix):
            return int(name[len(prefix):])
    return None


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


def _independent_reasons(r_q: torch.Tensor, candidates: int, names: Sequence[str]) -> list[tuple[list[str], str]]:
    """The metrics of ``names`` whose mean over the queries with a positive is the same for any
    embeddings, grouped by reason, each group with its warning (see
    :func:`warn_embedding_independent`)."""
    valid = r_q > 0
    if not bool(valid.any()):
        return []
    most_negatives = candidates - int(r_q[valid].min())
    if most_negatives <= 0:
        return [(list(names), f"{', '.join(names)}: every reference shares its query's class (one "
                 "class), so every ranking puts the positives first whatever the embeddings; "
                 "reported as NaN (no number): evaluate at least two classes")]
    recall = [n for n in names if n.startswith("recall_at_") and cutoff(n) > most_negatives]
    precision = [n for n in names if n.startswith("precision_at_") and cutoff(n) >= candidates]
    reasons = []
    if recall:
        reasons.append((recall, f"{', '.join(recall)}: K is larger than every query's number of "
                        f"references of other classes (at most {most_negatives}), so its K nearest "
                        "always hold a positive whatever the embeddings; reported as NaN (no "
                        f"number): ask for a smaller K (at most {most_negatives})"))
    if precision:
        reasons.append((precision, f"{', '.join(precision)}: K reaches all {candidates} references "
                        "a query is ranked against, so its K nearest are the same whatever the "
                        f"embeddings; reported as NaN (no number): ask for K below {candidates}"))
    return reasons


def embedding_independent(r_q: torch.Tensor, candidates: int, names: Sequence[str]) -> set[str]:
    """:func:`warn_embedding_independent` without its warnings: what a caller need not search
    for (a search for them would read deeper, and flag ties that no reported number reads)."""
    return {n for group, _ in _independent_reasons(r_q, candidates, names) for n in group}


def warn_embedding_independent(r_q: torch.Tensor, candidates: int, names: Sequence[str]) -> set[str]:
    """The metrics of ``names`` whose mean over the queries with a positive is the same for any
    embeddings, with one warning per reason (callers report them as NaN, "no number"):

    * all of them where no such query has a reference of another class (one class): every
      ranking puts the positives first, and every metric reads 1;
    * ``recall_at_K`` with ``K`` above every such query's count of negatives: its ``K``
      nearest always hold a positive;
    * ``precision_at_K`` with ``K`` at least the ``candidates`` a query is ranked against
      (``M``, or ``M - 1`` leaving itself out): its ``K`` nearest are every reference.

    Empty without a query with a positive (those means are NaN already)."""
    fixed: set[str] = set()
    for group, message in _independent_reasons(r_q, candidates, names):
        warnings.warn(message, stacklevel=3)
        fixed.update(group)
    return fixed


def per_query_arrays(scores: dict[str, torch.Tensor], r_q: torch.Tensor) -> dict[str, np.ndarray]:
    """Per-query scores as float64 numpy arrays, NaN where ``R_q = 0`` (a query without a
    positive has no retrieval score), as :func:`dmlkit.metrics.per_query` returns them."""
    valid = r_q > 0
    return {name: v.masked_fill(~valid, math.nan).numpy() for name, v in scores.items()}


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
                kk = cutoff(name)
                val = rel[:, :kk].any(1).to(torch.float64)
            elif name.startswith("precision_at_"):
                kk = cutoff(name)
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
    per query; ties rank by the smaller reference index; ``r`` is each row's ``R_q``, its
    finite positives. ``AP = (1/R) sum_p (p + 1) / rank_p`` over the positives in ranking order
    (Manning, Raghavan and Schuetze 2008, sec. 8.4). Per row the ``R`` positives' closeness is
    sorted and every reference is placed among them by binary search: ``e(j)`` = the positives
    ranked before ``j`` (a float64 tie with a positive is settled by index), and
    ``rank_p = #{j : e(j) <= p}`` (positive ``p`` itself included). ``O(M log R)`` a row
    instead of a sort's ``O(M log M)``; the same on any device (on a GPU the counts are one
    ``scatter_add``). Returns float64 on the rows' device. See :func:`full_ranking_ap_block`.
    """
    r_max = int(r.max()) if r.numel() else 0
    ap, repeated, _ = full_ranking_ap_block(closeness_rows, query_labels, reference_labels, r, r_max)
    # equal positives in a row: settle references tied with several exactly (redoing the block
    # only then: with tie runs every block costs 35-48 % more on a CPU, 200 x 50k rows)
    if bool(repeated):
        ap = full_ranking_ap_block(closeness_rows, query_labels, reference_labels, r, r_max, tie_runs=True)[0]
    return ap


#: On a GPU the counts of references ranked below every positive (never read) are spread over
#: this many slots a row: atomic adds to one address serialise (109 -> 41 ms of scatter at 50k on
#: an H200). Not on a CPU, where the extra pass cost 5-18 % (200 x 50k float64 rows).
_SPREAD = 32


def full_ranking_ap_block(
    closeness_rows: torch.Tensor,
    query_labels: torch.Tensor,
    reference_labels: torch.Tensor,
    r: torch.Tensor,
    r_max: int,
    tie_runs: bool = False,
    near: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`full_ranking_ap` of one block without a host synchronisation: ``(ap, repeated,
    tied)``, ``tied`` per row: a finite negative ties a positive exactly (the tie rule, not the
    embeddings, orders them: :func:`dmlkit.metrics.near_ties.warn_tie_ruled`). With ``near``,
    ``repeated`` is also set when a finite negative lies within ``near`` of one of its row's
    positives (values a caller ranks again more exactly: :func:`dmlkit.metrics.near_ties.
    rescore_near_positives`).

    ``r`` is each row's count of finite positives (``R_q``; the query itself, if excluded, at
    ``-inf``) and ``r_max >= r.max()``. A reference tied in float64 with a positive is settled
    against that one positive. A row that holds equal positives (``repeated``, a 0-d bool
    tensor on the rows' device) can tie a reference with several, and only ``tie_runs=True``
    (which synchronises) settles those exactly: a GPU caller queues every block, then redoes
    the few flagged ones.

    In ranking terms: ``at(j) = #{p : v_p <= s_j}`` over the row's ``r_max`` sorted slots (the
    padding at ``-inf``), minus the tied positives of smaller index, so that
    ``e(j) = r_max - at(j)`` and ``rank_p = #{j : at(j) >= r_max - p}``, a suffix sum of the
    counts of ``at``.
    """
    s = closeness_rows
    b, m = s.shape
    dev = s.device
    width = min(r_max, m)
    if width == 0 or b == 0:
        return (torch.zeros(b, dtype=torch.float64, device=dev), torch.zeros((), dtype=torch.bool, device=dev),
                torch.zeros(b, dtype=torch.bool, device=dev))
    same_label = reference_labels[None, :] == query_labels[:, None]
    # each row's positives, ascending closeness, equal closeness by ascending column; padded
    # at the front with -inf (fewer than r_max finite positives)
    val, col = torch.where(same_label, s, -math.inf).topk(width, dim=1)
    col, order = col.sort(dim=1)
    val, order = val.gather(1, order).sort(dim=1, stable=True)
    col = col.gather(1, order)
    repeated = ((val[:, 1:] == val[:, :-1]) & torch.isfinite(val[:, 1:])).any()
    # shifted by one slot: val_before[:, at] = val[:, at - 1], NaN (equal to nothing) at 0; the
    # column m is no reference's
    val_before = torch.cat([val.new_full((b, 1), math.nan), val], 1)
    col_before = torch.cat([col.new_full((b, 1), m), col], 1)
    at = torch.searchsorted(val, s, side="right")
    ref = torch.arange(m, device=dev)
    # j ties the positive just at or below it (the -inf padding can tie an excluded reference,
    # -inf: that only lowers at(j) <= r_max - r)
    below = val_before.gather(1, at)
    tied = below == s
    first = tied & (col_before.gather(1, at) < ref)
    # a positive ties itself; -inf (the query itself, the padding) is no reference's closeness
    negative = ~same_label & torch.isfinite(s)
    del same_label
    tie_ruled = (tied & negative).any(1)
    if near is not None:  # the positive at or below j, or the one above it (+inf past the last)
        close = (s - below) <= near
        val_after = torch.cat([val, val.new_full((b, 1), math.inf)], 1)
        torch.gather(val_after, 1, at, out=below)  # ``below`` is not read again
        close |= below.sub_(s) <= near
        close &= negative
        repeated = repeated | close.any()
        del close
    del below, negative
    if tie_runs:  # further down each run of equal positives
        tied &= torch.isfinite(s)  # not along the padding
        step, further = at.clone(), torch.zeros_like(at)
        while True:
            step.sub_(tied.view(torch.uint8))
            tied &= val_before.gather(1, step) == s
            if not bool(tied.any()):
                break
            further += tied & (col_before.gather(1, step) < ref)
        at -= further
        del step, further
    at.sub_(first.view(torch.uint8))
    del tied, first
    # at(j) <= r_max - r: below every positive, never read
    if dev.type == "cuda":
        at = torch.where(at > (width - r)[:, None], at, width + 1 + ref % _SPREAD)
    placed = torch.zeros(b, width + 1 + _SPREAD, dtype=torch.int64, device=dev)
    placed.scatter_add_(1, at, torch.ones((), dtype=torch.int64, device=dev).expand_as(at))
    ranks = placed[:, : width + 1].flip(1).cumsum(1)[:, :width].to(torch.float64)
    p = torch.arange(1, width + 1, dtype=torch.float64, device=dev)
    prec = torch.where(p[None, :] <= r[:, None], p / ranks, 0.0)
    return prec.sum(1) / r.clamp_min(1).to(torch.float64), repeated, tie_ruled
