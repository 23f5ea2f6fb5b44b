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

from dmlkit.distances import (
    BaseDistance,
    CosineSimilarity,
    DotProductSimilarity,
    LpDistance,
    get_distance,
    rounding_bound,
)
from dmlkit.exceptions import ConfigError, DataError, ShapeError
from dmlkit.limits import MAX_BINS
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


def _bin_index(values: torch.Tensor, lo: float, hi: float, bins: int,
               rule: EdgeRule | None = None, row0: int = 0, col0: int = 0) -> torch.Tensor:
    """``floor((v - lo) / width)`` clamped to ``[0, bins - 1]`` (``hi`` falls in the last bin);
    with ``rule``, a value near an inner edge takes the bin of its float64 value
    (:meth:`EdgeRule.rebin`; ``values`` is the tile of query rows from ``row0`` and reference
    rows from ``col0``)."""
    position = (values - lo) * (bins / (hi - lo))
    idx = position.floor().clamp_(0, bins - 1).to(torch.int64)
    if rule is not None:
        rule.rebin(position, idx, row0, col0)
    return idx


@dataclass(frozen=True)
class EdgeRule:
    """Which bin a pair near a bin edge falls in: that of its float64 value.

    A pair's value is computed in float32 (one matrix product a tile), within the rounding
    bound ``tol`` of the float64 value of the same prepared rows
    (:func:`dmlkit.distances.rounding_bound`), and the float32 product's summation order
    (BLAS, CPU, GPU) moves it within that bound. Where ``t = (v - lo) * bins / (hi - lo)`` lies
    within ``margin[k]`` of an inner edge ``k`` (``tol`` in bins plus the float32 binning's own
    rounding), the pair is re-scored in float64 from the prepared rows and binned from that
    value: the histogram is that of the float64 values, the same on every device (binary
    codes put every pair on an edge: their split over two bins moved ``pos_neg_js`` by half).
    ``kind``: ``"cosine"`` (the float64 cosine of the rows as given: pairs whose cosines are
    equal share a bin, whatever their norms), ``"ip"`` (dot product), ``"squared"`` or
    ``"euclidean"`` (L2 of the prepared rows, squared or not).
    """

    kind: str
    query: torch.Tensor  #: the query rows it re-scores (as given for cosine, else prepared)
    reference: torch.Tensor  #: the reference rows it re-scores
    margin: torch.Tensor  #: float64, per edge ``0..bins``: how near ``t`` may come to it
    low: float
    scale: float  #: bins per unit of value, float64
    bins: int
    #: the widest margin, rounded up: one comparison a pair picks the candidates
    widest: float
    #: pairs re-scored at once (bounds the float64 copies of their rows)
    chunk: int = 1 << 16

    @property
    def everything(self) -> bool:
        """Whether a margin reaches a whole bin (bins narrower than the rounding): every pair is
        then re-scored."""
        return self.widest >= 1

    def rebin(self, position: torch.Tensor, idx: torch.Tensor, row0: int, col0: int) -> None:
        """Overwrite, in ``idx``, the bins of the entries of ``position`` near an inner edge
        (``floor(t)`` or the next; every entry where a margin reaches a whole bin). One float32
        and two boolean tiles of scratch: the widest margin picks the few candidates first."""
        if self.everything:
            rows, cols = torch.ones_like(position, dtype=torch.bool).nonzero(as_tuple=True)
        else:
            part = position - position.floor()  # exact in float32
            rows, cols = ((part <= self.widest) | (part >= 1 - self.widest)).nonzero(as_tuple=True)
            del part
            t = position[rows, cols].to(torch.float64)
            f = t.floor()
            k = f.to(torch.int64)
            last = self.bins - 1
            near = (k >= 1) & (k <= last) & (t - f <= self.margin[k.clamp(0, self.bins)])
            near |= (k >= 0) & (k < last) & (f + 1 - t <= self.margin[(k + 1).clamp(0, self.bins)])
            rows, cols = rows[near], cols[near]
        for k in range(0, rows.shape[0], self.chunk):
            r, c = rows[k : k + self.chunk], cols[k : k + self.chunk]
            idx[r, c] = self.exact_bins(self.query[r + row0], self.reference[c + col0])

    def exact_bins(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The bins of the float64 values of row pairs ``(a[p], b[p])``."""
        a, b = a.to(torch.float64), b.to(torch.float64)
        if self.kind == "ip":
            v = (a * b).sum(1)
        elif self.kind == "cosine":  # a zero row's cosine is 0, as its normalised row is zero
            den = (a * a).sum(1) * (b * b).sum(1)
            v = (a * b).sum(1) / den.masked_fill(den == 0, 1).sqrt()
        else:
            v = (a - b).pow(2).sum(1)
            if self.kind == "euclidean":
                v = v.sqrt()
        return ((v - self.low) * self.scale).floor().clamp(0, self.bins - 1).to(torch.int64)


def edge_rule(dist: BaseDistance, q: torch.Tensor, r: torch.Tensor, lo: float, hi: float,
              bins: int) -> EdgeRule | None:
    """The :class:`EdgeRule` of ``dist``'s values binned over ``[lo, hi]``: for an inner product
    (cosine, dot) or the L2 distance; ``None`` for other distances (their float32 values bin as
    they are)."""
    if isinstance(dist, DotProductSimilarity):
        kind = "cosine" if dist.normalize_embeddings else "ip"
    elif isinstance(dist, LpDistance) and dist.p == 2:
        kind = "squared" if dist.power == 2 else "euclidean"
    else:
        return None
    d = q.shape[1]
    scale = bins / (hi - lo)
    edges = lo + torch.arange(bins + 1, dtype=torch.float64) / scale
    if kind == "cosine":  # the given rows' cosine, re-scored from them: the tiles multiply rows
        # normalised to within an ulp (relative 2^-24) of unit, which moves a product by up to
        # 2.01 2^-24 beyond the float32 product's own bound (rows of norm 1 + 2^-23 at most)
        tol = torch.full_like(edges, rounding_bound("ip", d, 1 + 2.0**-23, 1 + 2.0**-23) + 2.01 * 2.0**-24)
        margin = (tol * scale + _binning_error(lo, hi, bins)).to(q.device)
        return EdgeRule(kind, q, r, margin, lo, scale, bins, _widest(margin))
    qp = dist.prepare(q)
    rp = qp if r is q else dist.prepare(r)
    q_norm, r_norm = float(qp.norm(dim=1).max()), float(rp.norm(dim=1).max())
    if kind == "ip":
        tol = torch.full_like(edges, rounding_bound("ip", d, q_norm, r_norm))
    else:
        # the expanded form |x|^2 + |y|^2 - 2<x, y>, of rows moved by the references' mean
        # unless normalised (at most |x| + |y| from it either way): the squared distance's bound
        sq_tol = rounding_bound("centred_l2", d, q_norm + r_norm, 2 * r_norm)
        tol = torch.full_like(edges, sq_tol)
        if kind == "euclidean":  # sqrt(s +- tol) - sqrt(s) at the edge e = sqrt(s), and its rounding
            e = edges.clamp_min(0)
            below = (e.pow(2) - sq_tol).clamp_min(0).sqrt()
            tol = sq_tol / (e + below).clamp_min(math.sqrt(sq_tol)) + e * 2.0**-23
    margin = (tol * scale + _binning_error(lo, hi, bins)).to(q.device)
    return EdgeRule(kind, qp, rp, margin, lo, scale, bins, _widest(margin))


def _binning_error(lo: float, hi: float, bins: int) -> float:
    """Bound, in bins, on the float32 binning's own rounding (``lo``, the scale, the difference
    and the product)."""
    return 2.0**-21 * (bins / (hi - lo) * max(abs(lo), abs(hi)) + bins + 1)


def _widest(margin: torch.Tensor) -> float:
    """The widest margin, rounded up past float32's comparison (one host read, not one a tile)."""
    return float(margin.max()) * (1 + 2.0**-20)


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
    rule = edge_rule(dist, q, r, lo, hi, bins)
    for a0, a1, b0, b1 in _blocks(q.shape[0], r.shape[0], same, budget):
        idx = _bin_index(dist(q[a0:a1], r[b0:b1]).to(torch.float32), lo, hi, bins, rule, a0, b0)
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
    rule = edge_rule(dist, q, r, lo, hi, bins)
    if rule is None:
        no_rows = np.zeros((0, q.shape[1]), np.float32)
        edge = (_kernels.EDGE_NONE, no_rows, no_rows, np.zeros(bins + 1), np.float32(-1), float(lo), 1.0)
    else:
        mode = {"ip": _kernels.EDGE_IP, "cosine": _kernels.EDGE_COSINE,
                "squared": _kernels.EDGE_SQUARED, "euclidean": _kernels.EDGE_EUCLIDEAN}[rule.kind]
        q_rows = np.ascontiguousarray(rule.query.numpy())
        r_rows = q_rows if rule.reference is rule.query else np.ascontiguousarray(rule.reference.numpy())
        margin = np.full(bins + 1, np.inf) if rule.everything else rule.margin.numpy()
        edge = (mode, q_rows, r_rows, margin, np.float32(min(rule.widest, 1.0)), float(rule.low),
                float(rule.scale))

    def tile(block: tuple[int, int, int, int]) -> None:
        a0, a1, b0, b1 = block
        vals = np.ascontiguousarray(dist(q[a0:a1], r[b0:b1]).to(torch.float32).numpy())
        pos, total = counts.get()
        try:
            _kernels.histogram_tile(vals, ql_np[a0:a1], rl_np[b0:b1], same and a0 == b0, low, scale,
                                    pos, total, edge, a0, b0)
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
        bins: number of equal-width bins, 2 to :data:`~dmlkit.limits.MAX_BINS`.
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
    # one bin holds every pair of either kind: the divergence would read 0 whatever the embeddings
    bins = check_integer(bins, "bins", least=2, most=MAX_BINS)
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
    elif occupied.size == 1:  # with few bins, or a range wider than the values
        warnings.warn(
            f"pos_neg_js: every pair falls in one bin ({occupied[0]} of {bins} over [{lo:g}, {hi:g}]), so "
            "the divergence is 0 whatever the ranking; use more bins or a range the values fill "
            "(range='observed')", stacklevel=3)
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
