"""Positive/negative similarity histograms and their Jensen-Shannon divergence.

Oi, Kawakami, Naemura, "Analysis of Evaluation Metrics with the Distance between Positive Pairs
and Negative Pairs in Deep Metric Learning": take the similarities (inner products of
L2-normalised embeddings) of *all* positive pairs (same class) and of *all* negative pairs,
histogram each and normalise each to area 1, so the score does not depend on the number of
classes; compare the two with the Jensen-Shannon divergence

    JS(P || Q) = (KL(P || M) + KL(Q || M)) / 2,   M = (P + Q) / 2,

in base 2, so ``0`` (identical) <= JS <= ``1`` (no overlap). Larger = better separated.

Pairs are counted exactly (no sampling) block by block: when the query set is the reference
set only the upper triangle ``i < j`` is visited (each unordered pair once); otherwise every
query x reference pair. Per block, all values and the positive values are binned with integer
counts; the negative histogram is the difference.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dmlkit.distances import BaseDistance, CosineSimilarity, get_distance
from dmlkit.exceptions import ConfigError, DataError, ShapeError
from dmlkit.metrics._threads import full_float32_matmuls, run_threads, single_threaded_torch
from dmlkit.metrics._validation import (
    DEFAULT_MEMORY_BUDGET,
    as_embeddings,
    check_budget,
)
from dmlkit.metrics.knn import SMALL_SEARCH_PAIRS
from dmlkit.validation import check_integer, check_label_pair

__all__ = ["PosNegHistograms", "js_divergence", "pos_neg_histograms"]


@dataclass(frozen=True)
class PosNegHistograms:
    """Histograms of positive- and negative-pair values.

    ``edges`` has ``bins + 1`` entries; ``*_density`` integrate to 1 over the edges (area 1,
    as in the paper); ``*_counts`` are exact pair counts; ``js`` is the base-2 JS divergence.
    """

    edges: np.ndarray
    pos_counts: np.ndarray
    neg_counts: np.ndarray
    pos_density: np.ndarray = field(repr=False)
    neg_density: np.ndarray = field(repr=False)
    js: float
    num_positive_pairs: int
    num_negative_pairs: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "edges": self.edges.tolist(),
            "pos_density": self.pos_density.tolist(),
            "neg_density": self.neg_density.tolist(),
            "js": self.js,
            "num_positive_pairs": self.num_positive_pairs,
            "num_negative_pairs": self.num_negative_pairs,
        }


def js_divergence(p: Any, q: Any) -> float:
    """Base-2 Jensen-Shannon divergence of two histograms (normalised here to sum 1)."""
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    if not (np.isfinite(p).all() and np.isfinite(q).all()) or (p < 0).any() or (q < 0).any():
        # NaN, infinite or negative counts read 0.0 (the clamp below swallowed the NaN)
        raise DataError("JS divergence needs histograms of finite, non-negative counts or densities")
    if p.shape != q.shape or not p.any() or not q.any():
        raise DataError("JS divergence needs two non-empty histograms over the same bins")
    p, q = p / p.max(), q / q.max()  # then summed: counts near 1e308 overflowed the sum to inf
    p, q = p / p.sum(), q / q.sum()
    m = (p + q) / 2

    def kl(a: np.ndarray) -> float:
        nz = a > 0
        return float(np.sum(a[nz] * np.log2(a[nz] / m[nz])))

    return float(min(1.0, max(0.0, (kl(p) + kl(q)) / 2)))


def _bin_index(values: torch.Tensor, lo: float, hi: float, bins: int) -> torch.Tensor:
    """``floor((v - lo) / width)`` clamped to ``[0, bins - 1]`` (``hi`` falls in the last bin)."""
    idx = ((values - lo) * (bins / (hi - lo))).floor_()
    return idx.clamp_(0, bins - 1).to(torch.int64)


def _blocks(n: int, m: int, same: bool, budget: int):
    """Tiles ``(a0, a1, b0, b1)`` covering the pairs; with ``same`` only tiles with b0 >= a0."""
    # a tile holds floats + int64 bin indices + a bool mask: ~13 bytes per pair, twice over
    side = int(max(16, math.isqrt(max(1, budget // 32))))
    for a0 in range(0, n, side):
        for b0 in range(a0 if same else 0, m, side):
            yield a0, min(n, a0 + side), b0, min(m, b0 + side)


def _count_torch(
    dist: BaseDistance, q: torch.Tensor, ql: torch.Tensor, r: torch.Tensor, rl: torch.Tensor,
    same: bool, lo: float, hi: float, bins: int, budget: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Positive-pair and all-pair counts with torch ops on the tensors' device (GPUs)."""
    pos = torch.zeros(bins, dtype=torch.int64, device=q.device)
    total = torch.zeros(bins, dtype=torch.int64, device=q.device)
    for a0, a1, b0, b1 in _blocks(q.shape[0], r.shape[0], same, budget):
        idx = _bin_index(dist(q[a0:a1], r[b0:b1]).to(torch.float32), lo, hi, bins)
        same_class = ql[a0:a1, None] == rl[None, b0:b1]
        if same and a0 == b0:  # diagonal tile: strict upper triangle only
            upper = torch.ones_like(same_class).triu_(1)
            idx, same_class = idx[upper], same_class[upper]
        else:
            idx, same_class = idx.reshape(-1), same_class.reshape(-1)
        total += torch.bincount(idx, minlength=bins)
        pos += torch.bincount(idx[same_class], minlength=bins)
    return pos.cpu().numpy(), total.cpu().numpy()


def _count_cpu(
    dist: BaseDistance, q: torch.Tensor, ql: torch.Tensor, r: torch.Tensor, rl: torch.Tensor,
    same: bool, lo: float, hi: float, bins: int, budget: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Positive-pair and all-pair counts on the CPU: each tile's values from a single-threaded
    torch call, binned by a compiled kernel, on ``torch.get_num_threads()`` Python threads with
    their own counts (4x faster than ``bincount`` on torch's thread pool at N = 100k)."""
    from queue import SimpleQueue

    # lazy: the numba kernels load only when a compiled path runs
    from dmlkit.metrics import _kernels

    counts: SimpleQueue = SimpleQueue()
    ql_np, rl_np = ql.numpy(), rl.numpy()
    low, scale = np.float32(lo), np.float32(bins / (hi - lo))

    def tile(block: tuple[int, int, int, int]) -> None:
        a0, a1, b0, b1 = block
        vals = np.ascontiguousarray(dist(q[a0:a1], r[b0:b1]).to(torch.float32).numpy())
        pos, total = counts.get()
        try:
            _kernels.histogram_tile(vals, ql_np[a0:a1], rl_np[b0:b1], same and a0 == b0, low, scale,
                                    pos, total)
        finally:
            counts.put((pos, total))

    with single_threaded_torch() as workers:
        for _ in range(workers):
            counts.put((np.zeros(bins, np.int64), np.zeros(bins, np.int64)))
        run_threads(tile, _blocks(q.shape[0], r.shape[0], same, budget // workers), workers)
    pos_c, total_c = np.zeros(bins, np.int64), np.zeros(bins, np.int64)
    while not counts.empty():
        pos, total = counts.get()
        pos_c += pos
        total_c += total
    return pos_c, total_c


@full_float32_matmuls
def pos_neg_histograms(
    query: Any,
    query_labels: Any,
    reference: Any | None = None,
    reference_labels: Any | None = None,
    *,
    distance: str | BaseDistance = "cosine",
    bins: int = 100,
    range: tuple[float, float] | str | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> PosNegHistograms:
    """Histograms of all positive-pair and all negative-pair values and their JS divergence.

    Args:
        query, query_labels: ``(N, D)`` embeddings and ``(N,)`` labels.
        reference, reference_labels: another set; ``None`` uses the pairs within ``query``.
        distance: pairs are valued by this distance (default cosine similarity, as in the paper).
        bins: number of equal-width bins.
        range: ``(low, high)`` of the bins (a pair outside it is counted in the first or last
            bin, so every pair is counted, unlike ``numpy.histogram``, which drops it);
            ``"observed"``: the pairs' minimum and maximum
            (one extra pass; a picture of embeddings whose similarities all lie in, say,
            [0.99, 1] stays readable); default ``(-1, 1)`` for cosine, so that ``pos_neg_js``
            of different models shares its bins, else observed.
        memory_budget: working memory in bytes.

    With the default cosine bins, a warning says when every pair falls within four adjacent
    bins: the divergence then reads near 0 whatever the ranking (width ``2 / bins``).
    """
    budget = check_budget(memory_budget)
    # numpy integers count (as k_values and seeds do); True is no number of bins
    bins = check_integer(bins, "bins")
    same = reference is None
    q = as_embeddings(query, "query embeddings")
    if same:
        if reference_labels is not None:  # as evaluate() refuses it: it was ignored
            raise ShapeError("reference_labels given without reference embeddings")
        ql = check_label_pair(query_labels, q.shape[0], None, 0)[0].to(q.device)
        r, rl = q, ql
    else:
        if reference_labels is None:
            raise ShapeError("pass reference_labels together with reference")
        r = as_embeddings(reference, "reference embeddings").to(q.device)
        ql, rl, _ = check_label_pair(query_labels, q.shape[0], reference_labels, r.shape[0])
        ql, rl = ql.to(q.device), rl.to(q.device)
        if r.shape[1] != q.shape[1]:
            raise ShapeError(f"query has {q.shape[1]} dimensions but reference has {r.shape[1]}")
    try:
        dist = get_distance(distance)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    n, m = q.shape[0], r.shape[0]

    def tile_values(a0: int, a1: int, b0: int, b1: int) -> tuple[torch.Tensor, torch.Tensor]:
        vals = dist(q[a0:a1], r[b0:b1]).to(torch.float32)
        valid = torch.ones_like(vals, dtype=torch.bool)
        if same and a0 == b0:  # diagonal tile: strict upper triangle only
            valid = torch.ones_like(valid).triu_(1)
        return vals, valid

    fixed_cosine = range is None and isinstance(dist, CosineSimilarity)
    if fixed_cosine:
        lo, hi = -1.0, 1.0
    elif range is None or range == "observed":
        lo, hi = math.inf, -math.inf
        for a0, a1, b0, b1 in _blocks(n, m, same, budget):
            vals, valid = tile_values(a0, a1, b0, b1)
            if valid.any():
                lo = min(lo, float(vals[valid].min()))
                hi = max(hi, float(vals[valid].max()))
        if not math.isfinite(lo):
            raise DataError("need at least two samples to form a pair")
        if hi <= lo:  # every pair alike: one bin holds them (a width that survives lo's size:
            # lo + 1 == lo from 2^53 on, and the bins divided by zero)
            hi = lo + max(1.0, abs(lo))
    elif isinstance(range, str):
        raise ConfigError(f"range must be (low, high) or 'observed', got {range!r}")
    else:
        if len(range) != 2:  # a third entry was ignored
            raise ConfigError(f"range must be (low, high), got {range}")
        lo, hi = float(range[0]), float(range[1])
        # finite, and bins of a width float32 can scale by ((0, inf) gave NaN edges and js 0.0)
        if not (hi > lo and math.isfinite(hi - lo) and bins / (hi - lo) <= float(np.finfo(np.float32).max)):
            raise ConfigError(f"range must be finite (low, high) with low < high, got {range}")

    # small CPU inputs take the torch path too: the compiled kernel's load (numba, ~0.1 GB) would
    # cost more than the count; both bin identically (tests/test_metrics_clustering_hist.py)
    small = n * m <= SMALL_SEARCH_PAIRS
    count = _count_cpu if q.device.type == "cpu" and not small else _count_torch
    pos_c, total_c = count(dist, q, ql, r, rl, same, lo, hi, bins, budget)
    neg_c = total_c - pos_c
    n_pos, n_neg = int(pos_c.sum()), int(neg_c.sum())
    if n_pos == 0:
        raise DataError("no positive pair: no two samples (query and reference) share a class; "
                        "the histogram metric needs at least one class with two or more samples")
    if n_neg == 0:
        raise DataError("no negative pair: all samples share one class; add other classes")
    occupied = np.flatnonzero(total_c)
    if fixed_cosine and bins >= 20 and occupied[-1] - occupied[0] < 4:
        edges = np.linspace(lo, hi, bins + 1)
        warnings.warn(
            f"pos_neg_js: every pair's cosine similarity lies in [{edges[occupied[0]]:.2f}, "
            f"{edges[occupied[-1] + 1]:.2f}], {occupied[-1] - occupied[0] + 1} of the {bins} bins over [-1, 1], so the "
            "divergence cannot separate these positives from negatives (it reads near 0 whatever "
            "the ranking); judge this embedding by P@1 / MAP@R, or bin over the observed range "
            "(pos_neg_histograms(..., range='observed'), as `dmlkit plot histograms` and the report draw)",
            stacklevel=3)
    edges = np.linspace(lo, hi, bins + 1)
    width = (hi - lo) / bins
    return PosNegHistograms(
        edges=edges,
        pos_counts=pos_c,
        neg_counts=neg_c,
        pos_density=pos_c / (n_pos * width),
        neg_density=neg_c / (n_neg * width),
        js=js_divergence(pos_c, neg_c),
        num_positive_pairs=n_pos,
        num_negative_pairs=n_neg,
    )
