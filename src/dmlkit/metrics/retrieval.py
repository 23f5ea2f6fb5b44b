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
    out = {name: torch.empty(n, dtype=torch.float64) for name in names}
    ranks = torch.arange(1, k + 1, dtype=torch.float64)
    for a0 in range(0, n, _ROW_BLOCK):
        a1 = min(n, a0 + _ROW_BLOCK)
        rel = reference_labels[neighbours[a0:a1]] == query_labels[a0:a1, None]
        rq = r[a0:a1]
        need_r = any(name in ("r_precision", "map_at_r") for name in names)
        if need_r:
            in_r = torch.arange(k)[None, :] < rq[:, None]
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
    """Average precision over the full ranking for a block of queries.

    ``closeness_rows`` is ``(B, M)`` (larger = closer; excluded references at ``-inf``), one row
    per query. A stable descending sort ranks by closeness with ties by reference index.
    """
    order = torch.argsort(closeness_rows, dim=1, descending=True, stable=True)
    rel = reference_labels[order] == query_labels[:, None]
    finite = torch.isfinite(closeness_rows.gather(1, order))
    rel &= finite
    hits = rel.cumsum(1, dtype=torch.int64).to(torch.float64)
    ranks = torch.arange(1, rel.shape[1] + 1, dtype=torch.float64, device=rel.device)
    prec = torch.where(rel, hits / ranks, 0.0)
    return prec.sum(1) / r.clamp_min(1).to(torch.float64)
