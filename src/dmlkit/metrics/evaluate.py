"""One entry point for every metric: :func:`evaluate`, plus :func:`per_class` breakdowns."""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from dmlkit.distances import BaseDistance, get_distance, rounding_bound
from dmlkit.exceptions import ConfigError, ShapeError
from dmlkit.metrics._threads import float32_matmuls_in_full
from dmlkit.metrics._validation import (
    DEFAULT_MEMORY_BUDGET,
    as_embeddings,
    check_budget,
    row_hashes,
    shared_rows_warning,
)
from dmlkit.metrics.average_precision import full_ranking_map
from dmlkit.metrics.clustering import CLUSTERING_METRICS, cluster_metrics
from dmlkit.metrics.histograms import pos_neg_histograms
from dmlkit.metrics.knn import SMALL_SEARCH_PAIRS, _mask_self, _Scorer, knn
from dmlkit.metrics.near_ties import (
    EXTRA_NEIGHBOURS,
    PairScorer,
    Settled,
    identical_rows,
    rescore_near_positives,
    settle_near_ties,
    warn_tie_ruled,
)
from dmlkit.metrics.retrieval import (
    cutoff,
    embedding_independent,
    full_ranking_ap_block,
    num_positives,
    per_query_arrays,
    per_query_from_neighbours,
    warn_embedding_independent,
)
from dmlkit.validation import check_label_pair

__all__ = ["DEFAULT_METRICS", "METRIC_NAMES", "REFERENCE_IS_QUERY", "evaluate", "expand_metric_names", "per_class", "per_query"]

#: What :func:`evaluate` computes when ``metrics`` is None.
DEFAULT_METRICS = ("precision_at_1", "recall_at_k", "r_precision", "map_at_r")

#: Accepted names; ``recall_at_k`` / ``precision_at_k`` expand over ``k_values`` and
#: ``recall_at_<K>`` / ``precision_at_<K>`` ask for one K.
METRIC_NAMES = (
    "precision_at_1", "recall_at_k", "precision_at_k", "r_precision", "map_at_r", "map",
    "nmi", "ami", "pair_f1", "pos_neg_js",
)
_KNN_METRICS = ("precision_at_1", "r_precision", "map_at_r")
#: Peak bytes a score of ``map``'s float64 blocks holds (the score, int64 placements and their
#: gathers, masks): sets the rows of a block from the memory budget.
_MAP_BYTES_PER_SCORE = 56
#: The warning when a separate reference set holds the query embeddings row for row
#: (``dmlkit evaluate test.npz -r test.npz``): no query is excluded from its own neighbours.
REFERENCE_IS_QUERY = (
    "the reference embeddings are the query embeddings row for row, so every query finds itself "
    "at rank 1 (P@1 = 100 %): leave the reference out (reference=None; no --reference) to exclude "
    "each query from its own neighbours"
)
#: ``recall_at_K`` / ``precision_at_K`` with K a positive integer written without leading zeros
_AT_K = re.compile(r"^(recall|precision)_at_([1-9]\d*)$")


def expand_metric_names(metrics: Sequence[str] | None, k_values: Sequence[int] = (1, 2, 4, 8)) -> list[str]:
    """The metric names ``metrics`` asks for (``recall_at_k`` / ``precision_at_k`` expanded over
    ``k_values``), or one :class:`ConfigError` naming an unknown one and the accepted names."""
    if metrics is None:
        metrics = DEFAULT_METRICS
    if isinstance(metrics, str):
        metrics = [m.strip() for m in metrics.split(",") if m.strip()]
    ks_given = [k_values] if isinstance(k_values, str | int | float) else list(k_values)
    # a K that is not a whole number is refused, never truncated (k_values=(2.5,) read recall_at_2)
    whole = [(isinstance(k, int | np.integer) and not isinstance(k, bool | np.bool_))
             or (isinstance(k, float | np.floating) and float(k).is_integer()) for k in ks_given]
    if not all(whole) or any(k < 1 for k in ks_given):
        raise ConfigError(f"k_values must be positive integers, got {ks_given}")
    ks = [int(k) for k in ks_given]
    names: list[str] = []
    for m in metrics:
        m = m.strip().lower()
        if m in ("recall_at_k", "precision_at_k"):
            if not ks:  # expanded over no K, it was dropped without a word
                raise ConfigError(f"{m} needs at least one K: k_values is empty")
            expanded = [f"{m[:-2]}_{k}" for k in ks]
        elif m in METRIC_NAMES or _AT_K.match(m):
            expanded = [m]
        else:
            raise ConfigError(
                f"unknown metric {m!r}; choose from {', '.join(METRIC_NAMES)} "
                "(or recall_at_<K> / precision_at_<K> with K >= 1)"
            )
        names += [e for e in expanded if e not in names]
    if not names:
        raise ConfigError("no metric requested")
    return names


class _Inputs:
    """Validated query/reference tensors and labels; ``stacklevel``: of its warnings, the frames
    up to the public function's caller (4 under a helper of the public function, 3 directly)."""

    def __init__(self, query, query_labels, reference, reference_labels, distance, stacklevel: int = 4) -> None:
        self.same = reference is None
        self.q = as_embeddings(query, "query embeddings")
        if self.same:
            if reference_labels is not None:
                raise ShapeError("reference_labels given without reference embeddings")
            self.ql, _, self.class_names = check_label_pair(query_labels, self.q.shape[0], None, 0)
            self.r, self.rl = self.q, self.ql
        else:
            if reference_labels is None:
                raise ShapeError("pass reference_labels together with reference embeddings")
            self.r = as_embeddings(reference, "reference embeddings").to(self.q.device)
            self.ql, self.rl, self.class_names = check_label_pair(
                query_labels, self.q.shape[0], reference_labels, self.r.shape[0]
            )
            if self.r.shape[1] != self.q.shape[1]:
                raise ShapeError(
                    f"query has {self.q.shape[1]} dimensions but reference has {self.r.shape[1]}"
                )
            if self.r.shape == self.q.shape and torch.equal(self.r, self.q):
                warnings.warn(REFERENCE_IS_QUERY, stacklevel=stacklevel)
            elif (shared := shared_rows_warning(row_hashes(self.q), row_hashes(self.r))) is not None:
                warnings.warn(shared, stacklevel=stacklevel)
        try:
            self.distance: BaseDistance = get_distance(distance)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.r_q = num_positives(self.ql, self.rl, exclude_self=self.same)
        #: how many references each query is ranked against (itself left out of its own set)
        self.candidates = self.r.shape[0] - int(self.same)


def _retrieval_per_query(
    inp: _Inputs, names: list[str], backend: str, budget: int
) -> dict[str, torch.Tensor]:
    knn_names = [n for n in names if n in _KNN_METRICS or _AT_K.match(n)]
    out: dict[str, torch.Tensor] = {}
    # per query: does the tie rule decide what its metrics read (near_ties.warn_tie_ruled), one
    # warning a group, as evaluate_streaming and torchrun give them: the kNN metrics read the
    # first max(K, R_q) positions, map every one, so their counts differ (one line that joined
    # them counted 1154 of 1154 queries for P@1 where 560 had such a tie)
    if knn_names:
        need = 1
        for n in knn_names:
            if _AT_K.match(n):
                need = max(need, cutoff(n))
        read = torch.full_like(inp.r_q, need)  # per query, the positions its metrics read
        if any(n in ("r_precision", "map_at_r") for n in knn_names):
            need = max(need, int(inp.r_q.max()))
            read = torch.maximum(read, inp.r_q)
        # a few neighbours more than the metrics read: near-ties are then settled exactly at every
        # position they read (:mod:`dmlkit.metrics.near_ties`; knn caps k at the references)
        need += EXTRA_NEIGHBOURS
        # rows sorted by label help only the faiss backend's heaps fill early
        order = torch.argsort(inp.ql, stable=True) if inp.same and backend == "faiss" else None
        res = knn(
            inp.q, None if inp.same else inp.r, need, distance=inp.distance,
            backend=backend, memory_budget=budget, order=order,
        )
        neighbours, knn_ruled = _settled(inp, res, budget, read)
        out.update(per_query_from_neighbours(neighbours, inp.rl, inp.ql, inp.r_q, knn_names))
        warn_tie_ruled(knn_ruled.cpu(), inp.r_q > 0, knn_names)
    if "map" in names:
        out["map"], map_ruled = _full_map(inp, budget)
        warn_tie_ruled(map_ruled.cpu(), inp.r_q > 0, ["map"])
    return out


def _settled(inp: _Inputs, res, budget: int, read: torch.Tensor) -> Settled:
    """The kNN's neighbours in the exact float64 order, and the queries whose read positions
    the tie rule decides (:mod:`dmlkit.metrics.near_ties`)."""
    scorer = _Scorer(inp.distance)  # a generic distance is returned as it is, unflagged
    dev = res.indices.device
    q = scorer.prepare(inp.q, "query embeddings").to(dev)
    r = q if inp.same else scorer.prepare(inp.r, "reference embeddings").to(dev)
    available = r.shape[0] - int(inp.same)
    score = PairScorer(q, r, scorer.kind == "l2")
    return settle_near_ties(
        res.indices, res.values, scorer, q, inp.ql, inp.rl, r_norm=float(r.norm(dim=1).max()),
        score=score, compiled=score.compiled, ref_blocks=lambda: [(0, r)],
        complete=res.indices.shape[1] >= available, budget=budget,
        query_index=torch.arange(q.shape[0], device=dev) if inp.same else None, read=read,
    )


def _full_map(inp: _Inputs, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-ranking average precision per query, and whether a negative ties one of its
    positives exactly (:func:`dmlkit.metrics.near_ties.warn_tie_ruled`).

    CPU cosine / dot / Euclidean: :func:`dmlkit.metrics.average_precision.full_ranking_map`
    (no sort; exact in float64 near ties). Small CPU searches, other distances and devices:
    float64 scores in blocks of rows, each reference placed among its row's sorted positives
    (:func:`dmlkit.metrics.retrieval.full_ranking_ap_block`, O(N M log R)), so that a GPU ranks
    exactly as the CPU kernels do (float64 matrix products cost little there). Where a product
    value lies too near a positive's for its rounding to decide (the expanded Euclidean form
    cancels for rows an ulp apart), the block is redone with those entries scored by the pair
    function (:func:`dmlkit.metrics.near_ties.rescore_near_positives`).
    """
    scorer = _Scorer(inp.distance)
    q = scorer.prepare(inp.q, "query embeddings")
    r = q if inp.same else scorer.prepare(inp.r, "reference embeddings")
    m = r.shape[0]
    if scorer.symmetric and q.device.type == "cpu" and q.shape[0] * m >= SMALL_SEARCH_PAIRS:
        return full_ranking_map(scorer, q, None if inp.same else r, inp.ql, inp.rl, budget)
    margin = None
    if scorer.symmetric:  # where the product could rank otherwise, the pair function decides
        pair = PairScorer(q, r, scorer.kind == "l2", compiled=False)
        margin = 2.0 * rounding_bound(scorer.kind, q.shape[1], float(q.norm(dim=1).max()),
                                      float(r.norm(dim=1).max()), unit_roundoff=2.0**-53)
        copies = None
    else:
        # a float64 matrix product gives bit-identical rows values an ulp apart by column (MKL):
        # each reference's column is overwritten by that of its first identical row, so copies tie
        copies = identical_rows(r)
    q, r = q.double(), r.double()
    nq_, nr_ = scorer.sq_norms(q), scorer.sq_norms(r)
    ql, rl, r_q = inp.ql.to(q.device), inp.rl.to(q.device), inp.r_q.to(q.device)
    r_max = int(r_q.max()) if r_q.numel() else 0  # every row's finite positives: at most R_q
    rows = max(1, budget // (m * _MAP_BYTES_PER_SCORE))

    def scores(a0: int, a1: int, exact: bool = False) -> torch.Tensor:
        s = scorer.block(q[a0:a1], r, None if nq_ is None else nq_[a0:a1], nr_)
        if copies is not None:
            s[:, copies[0]] = s[:, copies[1]]
        if inp.same:
            _mask_self(s, a0, 0)
        if exact and margin is not None:
            rescore_near_positives(s, rl[None, :] == ql[a0:a1, None], a0, pair, margin)
        return s

    # no host synchronisation inside the loop (a GPU queues every block); blocks whose rows hold
    # equal positives, or a negative whose product value lies within twice ``margin`` of a
    # positive's (only there can the product and the pair function rank them apart), are redone
    # at the end: re-scored near the positives, with exact tie runs
    starts = range(0, q.shape[0], rows)
    ap = torch.empty(q.shape[0], dtype=torch.float64, device=q.device)
    tied = torch.zeros(q.shape[0], dtype=torch.bool, device=q.device)
    redo = torch.zeros(len(starts), dtype=torch.bool, device=q.device)
    near = None if margin is None else 2.0 * margin
    for i, a0 in enumerate(starts):
        a1 = min(q.shape[0], a0 + rows)
        ap[a0:a1], redo[i], tied[a0:a1] = full_ranking_ap_block(scores(a0, a1), ql[a0:a1], rl,
                                                                r_q[a0:a1], r_max, near=near)
    for i in redo.nonzero().flatten().tolist():
        a0, a1 = starts[i], min(q.shape[0], starts[i] + rows)
        ap[a0:a1], _, tied[a0:a1] = full_ranking_ap_block(scores(a0, a1, exact=True), ql[a0:a1], rl,
                                                          r_q[a0:a1], r_max, tie_runs=True)
    return ap.cpu(), tied.cpu()


def per_query(
    query: Any,
    query_labels: Any,
    reference: Any | None = None,
    reference_labels: Any | None = None,
    metrics: Sequence[str] | None = None,
    *,
    distance: str | BaseDistance = "cosine",
    k_values: Sequence[int] = (1, 2, 4, 8),
    backend: str = "auto",
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Per-query retrieval scores (float64 arrays, NaN where ``R_q = 0``) and ``R_q``.

    Only retrieval metrics (not clustering or histogram ones) have per-query values.
    """
    with float32_matmuls_in_full():  # inline, not a decorator: warnings keep their stacklevel
        out, r_q, _ = _per_query(
            query, query_labels, reference, reference_labels, metrics, distance=distance,
            k_values=k_values, backend=backend, memory_budget=memory_budget,
        )
        return out, r_q


def _per_query(
    query, query_labels, reference, reference_labels, metrics, *, distance, k_values, backend, memory_budget,
    means: bool = False,
) -> tuple[dict[str, np.ndarray], np.ndarray, _Inputs]:
    """Per-query scores (NaN where ``R_q = 0``), ``R_q`` and the validated inputs. With
    ``means`` (the caller reports means), a metric whose mean is the same for any embeddings
    (:func:`dmlkit.metrics.retrieval.embedding_independent`) is NaN without a search for it: it
    sets neither the search's depth nor the tie warning, as in :func:`evaluate`."""
    names = expand_metric_names(metrics, k_values)
    whole_set = [n for n in names if n in (*CLUSTERING_METRICS, "pos_neg_js")]
    if whole_set:  # they were dropped: per_class(metrics=["nmi"]) gave rows of counts alone
        raise ConfigError(f"{', '.join(whole_set)} score the whole set (a clustering, or the "
                          "positive/negative distance histograms), not each query or class: ask "
                          "per-query/per-class values of retrieval metrics (precision_at_1, "
                          "recall_at_k, r_precision, map_at_r, ...)")
    budget = check_budget(memory_budget)
    inp = _Inputs(query, query_labels, reference, reference_labels, distance)
    fixed = embedding_independent(inp.r_q, inp.candidates, names) if means else set()
    scores = _searched_scores(inp, names, fixed, backend, budget)
    return per_query_arrays(scores, inp.r_q), inp.r_q.numpy(), inp


def _searched_scores(inp: _Inputs, names: list[str], skip: set[str], backend: str,
                     budget: int) -> dict[str, torch.Tensor]:
    """Per-query scores of ``names``; NaN for those in ``skip`` (not searched for: their mean is
    the same for any embeddings, and they would set the search's depth and its tie flags) and
    for all without a query with a positive (no search, which a single row could not even run)."""
    scores = {name: torch.full((inp.q.shape[0],), float("nan"), dtype=torch.float64) for name in names}
    searched = [n for n in names if n not in skip]
    if bool((inp.r_q > 0).any()) and searched:
        scores.update(_retrieval_per_query(inp, searched, backend, budget))
    return scores


def evaluate(
    query: Any,
    query_labels: Any,
    reference: Any | None = None,
    reference_labels: Any | None = None,
    metrics: Sequence[str] | None = None,
    *,
    distance: str | BaseDistance = "cosine",
    k_values: Sequence[int] = (1, 2, 4, 8),
    backend: str = "auto",
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    cluster_restarts: int = 3,
    seed: int = 0,
    bins: int = 100,
) -> dict[str, float | int]:
    """Evaluate embeddings; returns ``{metric: value}`` with fractions in ``[0, 1]``.

    Args:
        query, query_labels: ``(N, D)`` embeddings and ``(N,)`` integer labels.
        reference, reference_labels: a separate reference set; ``None`` uses the query set,
            excluding each query from its own neighbours (by index).
        metrics: names from :data:`METRIC_NAMES` (default :data:`DEFAULT_METRICS`);
            ``recall_at_k`` / ``precision_at_k`` expand to one key per ``k_values`` entry.
        distance: a :mod:`dmlkit.distances` name or object (default cosine).
        k_values: the K of Recall@K / Precision@K.
        backend: kNN backend, ``"auto"`` / ``"torch"`` / ``"numba"`` / ``"faiss"`` (:func:`knn`).
        memory_budget: working memory of the blockwise computations, in bytes.
        cluster_restarts, seed: k-means runs averaged by the clustering metrics, and their
            first seed.
        bins: histogram bins of ``pos_neg_js``.

    Retrieval metrics are means over the queries with at least one same-class reference
    (``R_q > 0``), NaN with a warning where that mean is the same for any embeddings (one
    class; a ``K`` past every query's negatives:
    :func:`~dmlkit.metrics.retrieval.warn_embedding_independent`); the result also holds
    ``num_queries`` and ``num_queries_without_positive``.
    Clustering metrics cluster the query set (embeddings normalised as the distance does) and
    are means over ``cluster_restarts`` k-means runs; each comes with ``<metric>_std``, their
    standard deviation over the restarts (after the counts).
    """
    with float32_matmuls_in_full():  # inline, not a decorator: warnings keep their stacklevel
        names = expand_metric_names(metrics, k_values)
        budget = check_budget(memory_budget)
        inp = _Inputs(query, query_labels, reference, reference_labels, distance, stacklevel=3)
        result: dict[str, float | int] = {}
        valid = inp.r_q > 0
        n_valid = int(valid.sum())
        retrieval = [n for n in names if n not in (*CLUSTERING_METRICS, "pos_neg_js")]
        if retrieval:
            fixed = warn_embedding_independent(inp.r_q, inp.candidates, retrieval)
            scores = _searched_scores(inp, retrieval, fixed, backend, budget)
            for name in retrieval:
                result[name] = float(scores[name][valid].mean()) if n_valid else float("nan")
        clustering = [n for n in names if n in CLUSTERING_METRICS]
        if clustering:
            emb = inp.distance.prepare(inp.q, "query embeddings").cpu().numpy()
            result.update(cluster_metrics(emb, inp.ql.numpy(), clustering, restarts=cluster_restarts,
                                          seed=seed, spread=True))
        if "pos_neg_js" in names:
            result["pos_neg_js"] = _pos_neg_js(inp, bins, budget)
        result["num_queries"] = int(inp.q.shape[0])
        result["num_queries_without_positive"] = int(inp.q.shape[0] - n_valid)
        spreads = [f"{n}_std" for n in clustering]
        return {n: result[n] for n in [*names, "num_queries", "num_queries_without_positive", *spreads]}


def _pos_neg_js(inp: _Inputs, bins: int, budget: int) -> float:
    """:func:`dmlkit.metrics.histograms.pos_neg_histograms`' JS divergence; NaN with a warning
    (as the other metrics that say nothing) where there is no positive or no negative pair, so
    one of the two histograms is empty (it was an error that lost every other metric asked
    for): a query's positives are its ``R_q`` references of its class, its negatives the rest
    of its ``candidates``."""
    missing = ("no positive pair (no query shares a class with a reference other than itself)"
               if not bool((inp.r_q > 0).any()) else
               "no negative pair (every reference shares its query's class: one class)"
               if not bool((inp.candidates - inp.r_q > 0).any()) else None)
    if missing:
        warnings.warn(f"pos_neg_js: {missing}, so one of its two histograms is empty; reported "
                      "as NaN (no number): evaluate at least two classes with two or more samples "
                      "in one of them", stacklevel=3)
        return math.nan
    hist = pos_neg_histograms(
        inp.q, inp.ql, None if inp.same else inp.r, None if inp.same else inp.rl,
        distance=inp.distance, bins=bins, memory_budget=budget,
    )
    return hist.js


def per_class(
    query: Any,
    query_labels: Any,
    reference: Any | None = None,
    reference_labels: Any | None = None,
    metrics: Sequence[str] | None = ("precision_at_1", "r_precision", "map_at_r"),
    *,
    distance: str | BaseDistance = "cosine",
    k_values: Sequence[int] = (1, 2, 4, 8),
    backend: str = "auto",
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> dict[int | str, dict[str, float | int]]:
    """Retrieval metrics averaged per query class: ``{label: {metric: value, "num_queries": n}}``.

    Queries with ``R_q = 0`` are left out of the class means (a class whose every query
    has none gets NaN; a metric whose mean is the same for any embeddings is NaN in every
    class, with a warning); keyword arguments are those of :func:`per_query`. Integer labels
    key the result by id, string labels (class names) by name.
    """
    with float32_matmuls_in_full():  # inline, not a decorator: warnings keep their stacklevel
        scores, r_q, inp = _per_query(
            query, query_labels, reference, reference_labels, metrics, distance=distance,
            k_values=k_values, backend=backend, memory_budget=memory_budget, means=True,
        )
        labels = inp.ql.numpy()
        names = inp.class_names
        fixed = warn_embedding_independent(inp.r_q, inp.candidates, list(scores))
        out: dict[int | str, dict[str, float | int]] = {}
        for c in np.unique(labels):
            sel = labels == c
            ok = sel & (r_q > 0)
            row: dict[str, float | int] = {
                name: float(v[ok].mean()) if ok.any() and name not in fixed else float("nan")
                for name, v in scores.items()
            }
            row["num_queries"] = int(sel.sum())
            row["num_queries_without_positive"] = int((sel & (r_q <= 0)).sum())
            out[int(c) if names is None else names[int(c)]] = row
        return out
