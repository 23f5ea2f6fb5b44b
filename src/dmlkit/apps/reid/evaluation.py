"""The person/vehicle re-identification evaluation protocol (Market-1501 style), streamed.

For every query ``q`` with identity ``id(q)`` and camera ``cam(q)`` the gallery is ranked by
closeness to ``q`` (ties by gallery index, so results are deterministic), after removing the
*junk* items of that query (Zheng et al., "Scalable Person Re-identification: A Benchmark",
ICCV 2015, the official Market-1501 evaluation code):

- gallery items with ``id == id(q)`` **and** ``cam == cam(q)`` (the same person seen by the
  same camera: matching them is not re-identification);
- gallery items whose id is a junk id (``-1`` in Market-1501/DukeMTMC: bad detections).

Distractors (Market-1501's id ``0``) stay as negatives. The *positives* of ``q`` are the kept
items with ``id == id(q)``. A query without any positive is skipped (it is not *valid*) and
counted in ``num_skipped_queries``. A negative that scores exactly as a positive is ranked by
the index rule, not by the features: the valid queries where that happens are counted in one
warning.

With ``r_1 < r_2 < ... < r_P`` the 1-based ranks of the ``P`` positives in the filtered ranking:

- **CMC** (cumulative matching characteristic): ``CMC(k) = (1/|V|) sum_{q in V} [r_1(q) <= k]``
  over the valid queries ``V``, at every rank ``k = 1 .. |gallery|`` (Rank-1/5/10/20 shown);
- **AP** (non-interpolated average precision over the full ranking, as torchreid and fast-reid):
  ``AP = (1/P) sum_i i / r_i``; ``ap_mode="trapezoid"`` gives the official Market-1501 MATLAB
  code's variant ``AP = (1/P) sum_i ((i-1)/(r_i-1) + i/r_i) / 2`` (with ``(i-1)/(r_i-1) := 1``
  at ``r_i = 1``); **mAP** is the mean AP over the valid queries;
- **INP** (inverse negative penalty; Ye et al., "Deep Learning for Person Re-identification: A
  Survey and Outlook", TPAMI 2021): ``INP = P / r_P``, the precision at the hardest positive;
  **mINP** is its mean over the valid queries.

Memory: the query x gallery closeness is produced one query block at a time (``memory_budget``
bytes) and reduced at once to the ranks of the positives (a compiled kernel binary-searches
each kept item into the sorted positives: ``O(G log P)`` per query, no sort of the row); only
``O(Q)`` numbers are kept. Scores: ``metric="euclidean"`` ranks by squared Euclidean distance
on the raw features (torchreid's default), ``"cosine"`` by cosine similarity, ``"dot"`` by
the inner product; ``normalize=True`` L2-normalises the features first.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dmlkit.apps.reid._common import (
    DEFAULT_MEMORY_BUDGET,
    METRICS,
    _as_float,
    _as_ids,
    _as_junk_ids,
    _block_rows,
    _centred,
    _check_ap_mode,
    _check_metric,
    _prepared,
    _rerank_params,
    _sq_norms,
    check_memory_budget,
    check_threads,
)
from dmlkit.exceptions import DataError, NonFiniteError, ShapeError
from dmlkit.validation import _describe, check_integer

__all__ = [
    "METRICS",
    "ReidResult",
    "closeness_blocks",
    "evaluate_reid",
    "evaluate_reid_scores",
    "ranked_examples",
]

SHOWN_RANKS = (1, 5, 10, 20)


@dataclass(frozen=True)
class ReidResult:
    """Per-query outcome of the protocol and the aggregate metrics.

    Attributes:
        first_hit: ``(Q,)`` 0-based rank of the first positive in the filtered ranking, ``-1``
            for a skipped query.
        ap: ``(Q,)`` average precision (NaN for a skipped query).
        inp: ``(Q,)`` inverse negative penalty (NaN for a skipped query).
        num_positives: ``(Q,)`` positives left after removing junk.
        num_gallery: gallery size (the CMC has this many ranks).
        ap_mode: ``"standard"`` or ``"trapezoid"``.
    """

    first_hit: np.ndarray
    ap: np.ndarray
    inp: np.ndarray
    num_positives: np.ndarray
    num_gallery: int
    ap_mode: str = "standard"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def valid(self) -> np.ndarray:
        return self.first_hit >= 0

    @property
    def num_queries(self) -> int:
        return int(self.first_hit.size)

    @property
    def num_valid_queries(self) -> int:
        return int(self.valid.sum())

    @property
    def num_skipped_queries(self) -> int:
        return self.num_queries - self.num_valid_queries

    def _need_valid(self) -> None:
        if self.num_valid_queries == 0:
            raise DataError(
                "no query has a positive in the gallery (after removing same-camera and junk "
                "items): check that query and gallery share identities and the camera ids"
            )

    @property
    def cmc(self) -> np.ndarray:
        """``(num_gallery,)``: ``cmc[k - 1]`` = fraction of valid queries matched within rank k."""
        self._need_valid()
        hits = np.bincount(self.first_hit[self.valid], minlength=self.num_gallery)
        return np.cumsum(hits[: self.num_gallery]) / self.num_valid_queries

    def rank(self, k: int) -> float:
        """``CMC(k)`` (Rank-k accuracy); ranks past the gallery size give ``CMC(G)``.

        ``k`` is an integer of at least 1 (a float such as 1.5, a bool or 0 is one
        :class:`ConfigError`; 1.5 was a raw numpy ``IndexError``)."""
        k = check_integer(k, "the rank k", hint=" (ranks start at 1)")
        cmc = self.cmc
        return float(cmc[min(k, cmc.size) - 1])

    @property
    def mAP(self) -> float:
        self._need_valid()
        return float(np.mean(self.ap[self.valid]))

    @property
    def mINP(self) -> float:
        self._need_valid()
        return float(np.mean(self.inp[self.valid]))

    def to_dict(self, ranks: Sequence[int] = SHOWN_RANKS) -> dict[str, float]:
        """``{"rank_1": ..., "map": ..., "minp": ..., "num_valid_queries": ...}`` (fractions)."""
        out: dict[str, float] = {f"rank_{k}": self.rank(k) for k in ranks}
        out["map"] = self.mAP
        out["minp"] = self.mINP
        out["num_queries"] = self.num_queries
        out["num_valid_queries"] = self.num_valid_queries
        out["num_skipped_queries"] = self.num_skipped_queries
        out["num_gallery"] = self.num_gallery
        return out


def closeness_blocks(query: Any, gallery: Any, *, metric: str = "euclidean",
                     normalize: bool = False, memory_budget: int = DEFAULT_MEMORY_BUDGET,
                     ) -> Iterable[tuple[int, np.ndarray]]:
    """Yield ``(row0, block)``: float32 closeness (larger = closer) of query rows to the gallery.

    ``euclidean``: ``2 <q, g> - ||g||^2`` (= ``||q||^2 - d^2(q, g)``: the squared distance up to
    a per-row constant, so the same ranking), on rows centred about the gallery's mean where it
    dominates their spread (:func:`dmlkit.apps.reid._common._centred`); ``cosine``/``dot``: the
    similarity.
    """
    import torch

    _check_metric(metric)
    memory_budget = check_memory_budget(memory_budget)
    q = torch.from_numpy(_as_float(query, "query embeddings"))
    g = torch.from_numpy(_as_float(gallery, "gallery embeddings"))
    if q.shape[1] != g.shape[1]:
        raise ShapeError(f"query dim {q.shape[1]} != gallery dim {g.shape[1]}")
    q, g = _prepared(q, metric, normalize, "query embeddings"), _prepared(g, metric, normalize, "gallery embeddings")
    if metric == "euclidean":  # about the gallery's mean if it dominates: the same distances
        q, g = _centred(q, g)
    g_t = g.t()  # a transposed view: BLAS reads it as is, no copy of the gallery
    g_sq = _sq_norms(g) if metric == "euclidean" else None
    rows = _block_rows(g.shape[0], memory_budget)
    for a in range(0, q.shape[0], rows):
        block = q[a: a + rows] @ g_t
        if g_sq is not None:
            block.mul_(2.0).sub_(g_sq)
        yield a, block.numpy()


def _rank_block(scores: np.ndarray, sign: float, q_ids: np.ndarray, q_cams: np.ndarray,
                gal: tuple[np.ndarray, ...], same_cam: bool, trapezoid: bool,
                out: tuple[np.ndarray, ...], threads: int) -> None:
    from dmlkit.apps.reid._kernels import rank_rows  # lazy: numba loads/compiles on first use
    from dmlkit.metrics._threads import run_threads  # lazy: imports torch

    by_id, sorted_ids, g_ids, g_cams, g_junk = gal
    q_lo = np.searchsorted(sorted_ids, q_ids, side="left")
    q_hi = np.searchsorted(sorted_ids, q_ids, side="right")
    first, ap, inp, npos, tied = out
    b = scores.shape[0]
    step = max(1, -(-b // max(1, threads * 4)))

    def run(r0: int) -> None:
        rank_rows(scores, r0, min(b, r0 + step), scores.dtype.type(sign), q_ids, q_cams, q_lo, q_hi,
                  by_id, g_ids, g_cams, g_junk, same_cam, trapezoid, first, ap, inp, npos, tied)

    run_threads(run, range(0, b, step), threads if b > step else 1)


def _score_blocks(scores: Any, n_q: int, n_g: int) -> Iterable[tuple[int, Any]]:
    """``scores`` as ``(row0, block)`` pairs: one ``(0, scores)`` for an array, a tensor or a
    list/tuple that numpy reads as a numeric 2-D array (a ``(Q, G)`` matrix as nested lists);
    else the items of the iterable, each checked to be an ``(int row0, 2-D block)`` pair."""
    forms = (f"scores must be a (Q, G) = ({n_q}, {n_g}) array or an iterable of (row0, block) "
             "pairs (int row0, 2-D block) such as [(0, block)]")
    if isinstance(scores, np.ndarray) or hasattr(scores, "detach"):
        yield 0, scores
        return
    if isinstance(scores, list | tuple):
        try:
            arr = np.asarray(scores)
        except (TypeError, ValueError):  # ragged: (row0, block) pairs, or a bad matrix
            arr = None
        if arr is not None and arr.ndim == 2 and arr.dtype.kind in "biuf":
            yield 0, arr
            return
    try:
        items = iter(scores)
    except TypeError:
        raise ShapeError(f"{forms}, got {_describe(scores)}") from None
    for item in items:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise ShapeError(f"{forms}, got an item of type {_describe(item)}")
        row0, block = item
        try:
            dims = block.dim() if hasattr(block, "detach") else np.ndim(block)
        except (TypeError, ValueError):  # a ragged block
            dims = -1
        if isinstance(row0, bool | np.bool_) or not isinstance(row0, int | np.integer) or dims != 2:
            raise ShapeError(f"{forms}, got a pair of {_describe(row0)} and {_describe(block)} "
                             f"with {dims} dimension(s)")
        yield int(row0), block


def evaluate_reid_scores(
    scores: np.ndarray | Iterable[tuple[int, np.ndarray]],
    query_ids: Any,
    gallery_ids: Any,
    query_cams: Any = None,
    gallery_cams: Any = None,
    *,
    higher_is_closer: bool = False,
    exclude_same_camera: bool = True,
    junk_ids: Sequence[int] = (-1,),
    ap_mode: str = "standard",
    threads: int | None = None,
) -> ReidResult:
    """The protocol on precomputed scores (e.g. a re-ranked distance matrix).

    Args:
        scores: a ``(Q, G)`` array (or nested lists), or an iterable of ``(row0, block)``
            row blocks (as :func:`closeness_blocks` yields; one block: ``[(0, block)]``) so
            that the full matrix never exists; anything else is a :class:`ShapeError`. Float32
            (and float16) scores are ranked in float32, all others in float64.
        higher_is_closer: ``False`` for distances (default), ``True`` for similarities.
        query_cams / gallery_cams: camera ids; ``None`` for both disables the same-camera rule.
        exclude_same_camera: apply the same-id-same-camera junk rule (Market-1501).
        junk_ids: gallery ids that are always junk (Market-1501/Duke: ``-1``).
        ap_mode: ``"standard"`` or ``"trapezoid"`` (see the module docstring).
    """
    import torch

    trapezoid = _check_ap_mode(ap_mode)
    threads = check_threads(threads)
    q_ids = _as_ids(query_ids, len(query_ids), "query ids")
    n_q = q_ids.shape[0]
    g_ids = _as_ids(gallery_ids, len(gallery_ids), "gallery ids")
    n_g = g_ids.shape[0]
    if (query_cams is None) != (gallery_cams is None):
        raise ShapeError("give camera ids for both query and gallery, or for neither")
    same_cam = bool(exclude_same_camera and query_cams is not None)
    q_cams = _as_ids(query_cams, n_q, "query camera ids", default=0)
    g_cams = _as_ids(gallery_cams, n_g, "gallery camera ids", default=0)
    g_junk = np.isin(g_ids, _as_junk_ids(junk_ids))
    by_id = np.argsort(g_ids, kind="stable")
    gal = (by_id, g_ids[by_id], g_ids, g_cams, g_junk)
    first = np.full(n_q, -1, dtype=np.int64)
    ap = np.full(n_q, np.nan)
    inp = np.full(n_q, np.nan)
    npos = np.zeros(n_q, dtype=np.int64)
    tied = np.zeros(n_q, dtype=np.bool_)
    threads = threads or max(1, torch.get_num_threads())
    covered = np.zeros(n_q, dtype=bool)  # which rows: duplicated blocks must not pass for coverage
    for row0, block in _score_blocks(scores, n_q, n_g):
        if hasattr(block, "detach"):
            block = block.detach().cpu()
            low = block.dtype in (torch.float32, torch.float16, torch.bfloat16)
            block = (block.float() if low else block.double()).numpy()
        block = np.asarray(block)  # float64 stays float64: float32 would tie close distances
        block = block.astype(np.float32 if block.dtype in (np.float32, np.float16) else np.float64,
                             copy=False)
        if block.ndim != 2 or block.shape[1] != n_g or row0 < 0 or row0 + block.shape[0] > n_q:
            raise ShapeError(
                f"scores must be (Q, G) = ({n_q}, {n_g}); got a block of shape {block.shape} "
                f"at row {row0}"
            )
        with np.errstate(over="ignore"):  # NaN/inf propagate; no (Q, G) mask unless it overflows
            total = block.sum(dtype=np.float64)
        if not np.isfinite(total) and not np.isfinite(block).all():  # large finite scores may sum to inf
            raise NonFiniteError("scores contain NaN or infinity")
        sl = slice(row0, row0 + block.shape[0])
        if covered[sl].any():
            raise ShapeError(f"score blocks overlap: query row {row0 + int(np.argmax(covered[sl]))} is scored twice")
        covered[sl] = True
        out = (first[sl], ap[sl], inp[sl], npos[sl], tied[sl])
        _rank_block(np.ascontiguousarray(block), 1.0 if higher_is_closer else -1.0, q_ids[sl],
                    q_cams[sl], gal, same_cam, trapezoid, out, threads)
    if not covered.all():
        raise ShapeError(f"scores covered {int(covered.sum())} query rows, expected {n_q}")
    _warn_tie_ruled(tied & (first >= 0), int((first >= 0).sum()))
    return ReidResult(first, ap, inp, npos, n_g, ap_mode)


def _warn_tie_ruled(tied: np.ndarray, valid: int) -> None:
    """One warning where, for some valid queries, a gallery item of another identity scores
    exactly as one of the query's positives: the two are ranked by gallery index (the rule that
    keeps results deterministic), so those queries' CMC and AP depend on the gallery's order,
    not on the features."""
    ruled = int(tied.sum())
    if ruled:
        warnings.warn(f"re-id: for {ruled} of {valid} valid queries, a gallery item of another identity "
                      "scores exactly as one of their positives; such ties are ranked by gallery "
                      "index, so those queries' CMC and mAP depend on the gallery's order, not on "
                      "the features (collapsed, quantised or duplicated features?)", stacklevel=3)


def evaluate_reid(
    query: Any,
    gallery: Any,
    query_ids: Any,
    gallery_ids: Any,
    query_cams: Any = None,
    gallery_cams: Any = None,
    *,
    metric: str = "euclidean",
    normalize: bool = False,
    exclude_same_camera: bool = True,
    junk_ids: Sequence[int] = (-1,),
    ap_mode: str = "standard",
    rerank: dict[str, Any] | bool | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    threads: int | None = None,
) -> ReidResult:
    """The Market-1501 re-id protocol from query and gallery embeddings (see the module doc).

    ``rerank=True`` (or a dict of ``k1``, ``k2``, ``lambda_value``) ranks by the k-reciprocal
    re-ranked distance (:func:`dmlkit.apps.reid.k_reciprocal_blocks`, same ``metric``).

    Example:
        >>> r = evaluate_reid(qf, gf, q_pids, g_pids, q_camids, g_camids)   # doctest: +SKIP
        >>> r.rank(1), r.mAP, r.mINP, r.num_valid_queries                    # doctest: +SKIP
    """
    memory_budget = check_memory_budget(memory_budget)  # before any work, as the CLI's --memory-mb
    threads = check_threads(threads)
    q = _as_float(query, "query embeddings")
    g = _as_float(gallery, "gallery embeddings")
    if q.shape[0] == 0 or g.shape[0] == 0:
        raise ShapeError(f"need at least one query and one gallery item, got {q.shape[0]} and "
                         f"{g.shape[0]}")
    _as_ids(query_ids, q.shape[0], "query ids")
    _as_ids(gallery_ids, g.shape[0], "gallery ids")
    params = _rerank_params(rerank)
    if params is not None:
        from dmlkit.apps.reid.rerank import k_reciprocal_blocks  # lazy: only with rerank

        if normalize and metric == "euclidean":
            metric = "cosine"  # Euclidean on normalised features
        blocks = k_reciprocal_blocks(q, g, metric=metric, memory_budget=memory_budget, **params)
        higher = False
    else:
        blocks = closeness_blocks(q, g, metric=metric, normalize=normalize,
                                  memory_budget=memory_budget)
        higher = True
    return evaluate_reid_scores(
        blocks, query_ids, gallery_ids, query_cams, gallery_cams, higher_is_closer=higher,
        exclude_same_camera=exclude_same_camera, junk_ids=junk_ids,
        ap_mode=ap_mode, threads=threads,
    )


def ranked_examples(
    query: Any,
    gallery: Any,
    query_ids: Any,
    gallery_ids: Any,
    query_cams: Any = None,
    gallery_cams: Any = None,
    *,
    queries: Sequence[int],
    top: int = 10,
    metric: str = "euclidean",
    normalize: bool = False,
    exclude_same_camera: bool = True,
    junk_ids: Sequence[int] = (-1,),
) -> list[dict[str, Any]]:
    """The ``top`` nearest gallery items of some queries, junk *included and marked* (junk as
    in :func:`evaluate_reid` with the same ``exclude_same_camera`` and ``junk_ids``).

    ``queries``: query rows (integers in ``[0, Q)``); ``top``: an integer >= 1 (at most ``G``
    items are returned). Returns one dict per query: ``{"query": i, "gallery": [j, ...],
    "status": ["positive" | "negative" | "junk", ...], "score": [...]}`` (closeness, larger =
    closer), for figures.
    """
    top = check_integer(top, "top", hint=" (gallery items per query)")
    q = _as_float(query, "query embeddings")
    g = _as_float(gallery, "gallery embeddings")
    q_ids = _as_ids(query_ids, q.shape[0], "query ids")
    g_ids = _as_ids(gallery_ids, g.shape[0], "gallery ids")
    if (query_cams is None) != (gallery_cams is None):
        raise ShapeError("give camera ids for both query and gallery, or for neither")
    sel = np.asarray(list(queries))
    if sel.ndim != 1 or sel.size and not np.issubdtype(sel.dtype, np.integer):
        raise ShapeError(f"queries must be a sequence of integer query rows, got values of dtype "
                         f"{sel.dtype} and shape {sel.shape}")
    if sel.size and (sel.min() < 0 or sel.max() >= q.shape[0]):
        bad = sel[(sel < 0) | (sel >= q.shape[0])][0]
        raise ShapeError(f"queries must be query rows in [0, {q.shape[0]}), got {int(bad)}")
    sel = sel.astype(np.int64)
    cams = exclude_same_camera and query_cams is not None
    q_cams = _as_ids(query_cams, q.shape[0], "query camera ids", default=0)
    g_cams = _as_ids(gallery_cams, g.shape[0], "gallery camera ids", default=0)
    junk = _as_junk_ids(junk_ids)
    out: list[dict[str, Any]] = []
    for a, block in closeness_blocks(q[sel], g, metric=metric, normalize=normalize):
        for row, i in zip(block, sel[a: a + block.shape[0]]):
            order = np.argsort(-row, kind="stable")[:top]
            status = []
            for j in order:
                if g_ids[j] in junk or (cams and g_ids[j] == q_ids[i] and g_cams[j] == q_cams[i]):
                    status.append("junk")
                else:
                    status.append("positive" if g_ids[j] == q_ids[i] else "negative")
            out.append({"query": int(i), "gallery": order.tolist(), "status": status,
                        "score": row[order].astype(float).tolist()})
    return out
