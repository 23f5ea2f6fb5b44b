"""Exact retrieval metrics for embedding sets larger than memory, streamed block by block.

:func:`evaluate_streaming` gives the same P@1, Recall@K, Precision@K, R-Precision and MAP@R
(definitions in :mod:`dmlkit.metrics.retrieval`; Musgrave et al., "A Metric Learning Reality
Check", ECCV 2020) as :func:`dmlkit.metrics.evaluate`, but reads the query and reference
embeddings a block of rows at a time from any sliceable ``(N, D)`` source: a
:class:`dmlkit.embedding_shards.ShardedEmbeddings` directory, an ``np.memmap``, a numpy array
or a torch tensor. Nothing of size ``N x D`` or ``N x N`` is ever held.

Algorithm, for each query block ``Q_i`` (rows ``a0:a1``):

1. for each reference block ``G_j``: the exact top-``k`` of ``Q_i`` among ``G_j`` with the
   library's kNN (:func:`dmlkit.metrics.knn`, any backend; the diagonal block of a self-search
   is a self-search, so the query itself is excluded by index), merged into a running top-``k``
   once they hold ``k`` columns (:func:`_merge_top`: closeness descending, ties by the smaller
   global reference index, exactly as the in-memory search orders them). Once ``k`` are held, only
   references at least as close as a query's running ``k``-th can still enter, so for cosine and dot
   the compiled scan of the next blocks starts from that value (:func:`knn_above_floor`);
2. :func:`dmlkit.metrics.near_ties.settle_near_ties`, as in :func:`dmlkit.metrics.evaluate`:
   runs of near-tied neighbours that mix relevances are re-scored in float64 (just their rows
   read back), and a row whose last neighbours tie with those its metrics read is searched
   again over every reference block;
3. per-query scores from the ranked neighbours (:func:`per_query_from_neighbours`).

``k`` is what :func:`evaluate` uses: the largest K (or ``R_q`` when an R-based metric is
asked for) plus :data:`dmlkit.metrics.near_ties.EXTRA_NEIGHBOURS`. The per-query float64 scores of all queries (``O(N)``) are kept
and averaged exactly as :func:`evaluate` averages them, so the numbers are identical, exact ties
included. Working memory: ``memory_budget`` (blocks, kNN tiles, the block's ``B x k``
neighbours) plus ``O(N)`` for labels and per-query scores.

Cost: with the query set as the reference set the in-memory kNN computes each off-diagonal
tile once for both of its row blocks; streaming cannot keep every row's running top-``k``
within the budget, so it computes each tile product twice (2x the in-memory matrix products
when there are many blocks). Each pair of blocks also costs a kNN call, reads and a merge, so
small blocks cost more than their products (1600 quantised rows, ``block_rows=200``: 2.3x the
in-memory time, benchmarks/README.md), and the floor saves little where many references tie
with it. Time grows as ``N^2 d``, memory as the budget plus ``O(N)``. The loop runs on one
torch thread, but for a large search's kNN calls and near-tie re-search: on a busy machine its
many small operations each waited for a descheduled thread (13x the in-memory time above).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dmlkit.distances import BaseDistance, get_distance
from dmlkit.distributed import agree, all_gather_unequal, context, is_main_process, shard_bounds
from dmlkit.exceptions import ConfigError, DataError, ShapeError
from dmlkit.metrics._threads import full_float32_matmuls, single_threaded_torch, torch_threads
from dmlkit.metrics._validation import (
    DEFAULT_MEMORY_BUDGET,
    as_embeddings,
    check_budget,
    row_hashes,
    shared_rows_warning,
)
from dmlkit.metrics.evaluate import _AT_K, REFERENCE_IS_QUERY, expand_metric_names
from dmlkit.metrics.knn import (
    SMALL_SEARCH_PAIRS,
    KNNResult,
    _knn_numba,
    _Scorer,
    exact_topk,
    knn,
)
from dmlkit.metrics.near_ties import (
    EXTRA_NEIGHBOURS,
    PairScorer,
    Settled,
    compiled_scores,
    settle_near_ties,
    warn_tie_ruled,
)
from dmlkit.metrics.retrieval import (
    cutoff,
    embedding_independent,
    num_positives,
    per_query_arrays,
    per_query_from_neighbours,
    warn_embedding_independent,
)
from dmlkit.validation import check_integer, check_label_pair

__all__ = ["StreamingPlan", "evaluate_streaming", "per_query_streaming", "plan_blocks"]

_STREAMABLE = ("precision_at_1", "r_precision", "map_at_r")


@dataclass(frozen=True)
class StreamingPlan:
    """How a streaming evaluation cuts its work: ``query_rows`` / ``reference_rows`` per block,
    the ``k`` searched and the kNN's share of the budget (bytes)."""

    query_rows: int
    reference_rows: int
    k: int
    knn_budget: int


def plan_blocks(n_query: int, n_reference: int, dim: int, k: int, memory_budget: int,
                same: bool) -> StreamingPlan:
    """Block sizes for a budget: half of it for the kNN's tiles, the other half for the blocks
    (float32 rows plus a storage-dtype copy while reading) and the running top-``k`` with its
    merge buffers (about six ``(rows, k)`` float32 + int64 arrays)."""
    budget = check_budget(memory_budget)
    per_query_row = dim * 4 * 2 + k * 12 * 6
    per_ref_row = dim * 4 * 2
    half = budget // 2
    if same:
        rows = max(1, half // (per_query_row + per_ref_row))
        rows = min(rows, n_query)
        return StreamingPlan(rows, rows, k, max(2**20, half))
    q_rows = max(1, min(n_query, half // 2 // per_query_row))
    r_rows = max(1, min(n_reference, half // 2 // per_ref_row))
    return StreamingPlan(q_rows, r_rows, k, max(2**20, half))


def _shape(source: Any, name: str) -> tuple[int, int]:
    shape = getattr(source, "shape", None)
    if shape is None or len(shape) != 2:
        raise ShapeError(f"{name} must be an (N, D) array, tensor, memmap or shard directory, "
                         f"got {type(source).__name__}")
    n, d = int(shape[0]), int(shape[1])
    if n == 0 or d == 0:
        raise ShapeError(f"{name} is empty (shape {(n, d)}): pass at least one row and column")
    return n, d


def _read(source: Any, a0: int, a1: int, name: str) -> torch.Tensor:
    """Rows ``a0:a1`` as a finite float32 tensor (float16 storage decodes to float32). A refusal
    names rows of the whole source (the block's own check counted from the block's start)."""
    block = source[a0:a1]
    whole = a0 == 0 and a1 == _shape(source, name)[0]
    return as_embeddings(block if isinstance(block, torch.Tensor) else np.asarray(block), name,
                         None if whole else a0)


def _take(source: Any, rows: np.ndarray, name: str) -> torch.Tensor:
    if isinstance(source, torch.Tensor):
        return as_embeddings(source[torch.from_numpy(rows)], name)
    return as_embeddings(np.asarray(source[rows]), name)


def _same_rows(query: Any, reference: Any, n: int, rows: int = 4096) -> bool:
    """Whether two ``(n, D)`` sources hold the same rows, read block by block (a different
    set differs in its first block: one block of each is read)."""
    if query is reference:
        return True
    for a0 in range(0, n, rows):
        a, b = query[a0:a0 + rows], reference[a0:a0 + rows]
        if not (torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                else np.array_equal(np.asarray(a), np.asarray(b))):
            return False
    return True


def _shared_rows(query: Any, nq: int, reference: Any, m: int, rows: int = 65536) -> str | None:
    """:func:`dmlkit.metrics._validation.shared_rows_warning` for two sources, hashed as float32
    block by block (8 bytes a row are kept). Unchecked: the search's own reads refuse non-finite
    or non-numeric rows, naming the rows of their block, so such a source gets no warning here."""
    hashes = []
    for source, n in ((query, nq), (reference, m)):
        out = []
        for a0 in range(0, n, rows):
            block = source[a0:min(n, a0 + rows)]
            try:
                block = (block.float() if isinstance(block, torch.Tensor)
                         else torch.from_numpy(np.asarray(block, dtype=np.float32)))
            except (TypeError, ValueError, RuntimeError):
                return None
            out.append(row_hashes(block).cpu())
        hashes.append(torch.cat(out))
    return shared_rows_warning(*hashes)


def _labels_of(source: Any, labels: Any, name: str) -> Any:
    if labels is not None:
        return labels
    found = getattr(source, "labels", None)
    if found is None:
        raise ShapeError(f"pass {name}: the {name.split()[0]} embeddings carry no labels")
    return found


def _resolve_block(
    q_blk: torch.Tensor, ql_blk: torch.Tensor, idx: torch.Tensor, values: torch.Tensor,
    reference: Any, rl: torch.Tensor, scorer: _Scorer, r_blocks: list[tuple[int, int]], r_norm: float,
    available: int, first: int | None, budget: int, read: torch.Tensor, compiled: bool,
) -> Settled:
    """:func:`dmlkit.metrics.near_ties.settle_near_ties` for a block of queries: the references
    its runs re-score are read by index, and the rows it searches again at the boundary read
    the reference blocks once more (``first``: the block's first query index on a self-search)."""
    q = scorer.prepare(q_blk, "query embeddings")  # a generic distance: returned unflagged
    euclidean = scorer.kind == "l2"

    def score(rows: torch.Tensor, refs: torch.Tensor) -> torch.Tensor:
        uniq, inv = torch.unique(refs, return_inverse=True)
        r = scorer.prepare(_take(reference, uniq.numpy(), "reference embeddings"), "reference embeddings")
        return PairScorer(q, r, euclidean, compiled)(rows, inv)

    def ref_blocks():
        for b0, b1 in r_blocks:
            with torch_threads(1):  # reading and checking: as in _stream
                blk = scorer.prepare(_read(reference, b0, b1, "reference embeddings"), "reference embeddings")
            yield b0, blk

    return settle_near_ties(
        idx, values, scorer, q, ql_blk, rl, r_norm=r_norm, score=score, compiled=compiled,
        ref_blocks=ref_blocks,
        complete=idx.shape[1] >= available, budget=budget,
        query_index=None if first is None else torch.arange(first, first + q.shape[0]), read=read,
    )


def knn_above_floor(
    query: torch.Tensor, reference: torch.Tensor, k: int, floor: np.ndarray | None, *,
    distance: BaseDistance, backend: str, memory_budget: int, threads: int | None = None,
) -> KNNResult:
    """:func:`dmlkit.metrics.knn.knn` (no self-exclusion) for queries that only need references
    at least as close as their ``floor`` (float32 per query, in the distance's closeness: cosine
    / dot similarity), the running k-th closeness of the block-by-block merge below.

    The numba scan then starts from the floor instead of from nothing, and a row with fewer than
    ``k`` such references is padded with ``-inf`` and index ``-1``. Without a floor, and for
    other distances and backends, it is :func:`knn` in full (the floor only saves time).
    ``threads``: torch threads for the search (default: the current count); the rows are
    checked and prepared on the current ones.
    """
    scorer = _Scorer(distance)
    threads = torch.get_num_threads() if threads is None else threads
    if floor is None or backend != "numba" or scorer.kind != "ip":
        with torch_threads(threads):
            return knn(query, reference, k, distance=distance, exclude_self=False, backend=backend,
                       memory_budget=memory_budget)
    qp = scorer.prepare(as_embeddings(query, "query embeddings"), "query embeddings")
    rp = scorer.prepare(as_embeddings(reference, "reference embeddings"), "reference embeddings")
    with torch_threads(threads):
        closeness, idx = _knn_numba(scorer, qp, rp, min(k, rp.shape[0]), False, check_budget(memory_budget),
                                    floor=np.asarray(floor, dtype=np.float32))
    return KNNResult(indices=idx, values=scorer.to_values(closeness), higher_is_closer=distance.higher_is_closer)


def _keys(c: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """Int64 keys in ranking order (float32 closeness ``c`` descending, index ``i >= -1``
    ascending): the numba kernels' ``key(v, j)`` (:mod:`dmlkit.metrics._kernels`), the float's
    bits made monotone (``-0.0`` as ``+0.0``, as ``==`` reads it) above ``2^32 - 2 - j``."""
    b = (c + 0.0).view(torch.int32).to(torch.int64)
    b = torch.where(b < 0, b ^ 0x7FFFFFFF, b)
    return (b << 32) | (0xFFFFFFFE - i)


def _merge_top(run_c: torch.Tensor | None, run_i: torch.Tensor | None,
               parts: list[tuple[torch.Tensor, torch.Tensor]], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The running top-``k`` (closeness, global index) merged with the block results ``parts``:
    the ``k`` first of their union by closeness descending, ties by the smaller index, which is
    :func:`dmlkit.metrics.knn.exact_topk` of the union (a top-``k`` of top-``k`` lists is the
    union's, so how many blocks wait changes no entry).

    The caller lets blocks wait until they hold ``k`` columns: merging at every block cost
    ``rows x (k + B)`` a reference block of ``B`` rows, ``N^3 / B`` in all where ``k`` grows
    with ``N`` (R-based metrics, a large class); waiting makes it about ``2 rows x N``. Float32
    closeness is merged by one ``topk`` of distinct packed keys (:func:`_keys`), not by
    ``exact_topk``'s two stable sorts of every tied row."""
    if run_c is None and len(parts) == 1:
        return parts[0]
    pieces = parts if run_c is None or run_i is None else [(run_c, run_i), *parts]
    cat_c, cat_i = torch.cat([c for c, _ in pieces], 1), torch.cat([i for _, i in pieces], 1)
    k = min(k, cat_c.shape[1])
    if cat_c.dtype != torch.float32 or bool(torch.isnan(cat_c).any()):  # a generic distance
        return exact_topk(cat_c, k, indices=cat_i)
    pos = _keys(cat_c, cat_i).topk(k, dim=1, sorted=True).indices
    return cat_c.gather(1, pos), cat_i.gather(1, pos)


def _drop_self(res: KNNResult, first: int) -> KNNResult:
    """Remove each query's own row (query ``r`` is reference ``first + r`` of the block) from a
    search that asked for one neighbour more; rows without it lose their last neighbour."""
    own = torch.arange(first, first + res.indices.shape[0])[:, None]
    keep = res.indices != own
    keep[keep.all(1), -1] = False
    k = res.indices.shape[1] - 1
    return KNNResult(res.indices[keep].view(-1, k), res.values[keep].view(-1, k), res.higher_is_closer)


def is_streamable(name: str) -> bool:
    """Whether metric ``name`` is a mean of per-query scores from a query's nearest neighbours
    (P@1, Recall@K, Precision@K, R-Precision, MAP@R), so it can be streamed and split by query."""
    return name in _STREAMABLE or bool(_AT_K.match(name))


def streamable_names(metrics: Sequence[str] | None, k_values: Sequence[int]) -> list[str]:
    """The expanded metric names (:func:`~dmlkit.metrics.evaluate.expand_metric_names`), or one
    :class:`ConfigError` naming those that need every embedding at once."""
    names = expand_metric_names(metrics, k_values)
    bad = [n for n in names if not is_streamable(n)]
    if bad:
        raise ConfigError(
            f"{', '.join(bad)} cannot be streamed (clustering, full-ranking and histogram metrics "
            "need every embedding at once): stream P@1 / Recall@K / Precision@K / "
            "R-Precision / MAP@R, or load the embeddings and use dmlkit.metrics.evaluate"
        )
    return names


@full_float32_matmuls
def _stream(
    query: Any, query_labels: Any, reference: Any, reference_labels: Any, metrics: Any, *,
    distance: str | BaseDistance, k_values: Sequence[int], backend: str, memory_budget: int,
    block_rows: int | None, progress: bool, query_range: tuple[int, int] | None = None,
    means: bool = False,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, list[str], torch.Tensor]:
    """Per-query float64 scores of the queries in ``query_range``, their ``R_q``, the metric
    names and whether the tie rule decides what a query's metrics read. With ``means`` (the
    caller reports means), a metric whose mean is the same for any embeddings
    (:func:`dmlkit.metrics.retrieval.embedding_independent`, decided on every query, so alike on
    every rank) is not searched for: NaN per query, and it sets neither the depth of the search
    nor the tie flags, as in :func:`dmlkit.metrics.evaluate`."""
    names = streamable_names(metrics, k_values)
    budget = check_budget(memory_budget)
    same = reference is None
    nq, d = _shape(query, "query embeddings")
    ref = query if same else reference
    m, d_r = (nq, d) if same else _shape(reference, "reference embeddings")
    if d_r != d:
        raise ShapeError(f"query has {d} dimensions but reference has {d_r}: embed both with the same model")
    # the two sets' checks read both of them whole: once for a torchrun job, on the rank that
    # shows its warnings
    if not same and is_main_process():
        if (m, d_r) == (nq, d) and _same_rows(query, reference, nq):
            warnings.warn(REFERENCE_IS_QUERY, stacklevel=4)
        elif shared := _shared_rows(query, nq, reference, m):
            warnings.warn(shared, stacklevel=4)
    try:
        dist = get_distance(distance)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    qlab = _labels_of(query, query_labels, "query labels")
    if same:
        if reference_labels is not None:
            raise ShapeError("reference_labels given without reference embeddings")
        ql, _, _ = check_label_pair(qlab, nq, None, 0)
        rl = ql
    else:
        ql, rl, _ = check_label_pair(qlab, nq, _labels_of(reference, reference_labels, "reference labels"), m)
    if query_range is None:
        qs, qe = 0, nq
    else:  # (0.7, 10.9) was truncated to rows 0-9 without a word
        if len(query_range) != 2:
            raise ConfigError(f"query_range must be (start, stop), got {query_range}")
        qs, qe = (check_integer(v, f"query_range {name}", least=0)
                  for v, name in zip(query_range, ("start", "stop"), strict=True))
    if not 0 <= qs < qe <= nq:
        raise ConfigError(f"query_range must satisfy 0 <= start < stop <= {nq}, got {query_range}")
    r_all = num_positives(ql, rl, exclude_self=same)
    r_q = r_all[qs:qe]
    available = m - int(same)
    fixed = embedding_independent(r_all, available, names) if means else set()
    searched = [n for n in names if n not in fixed]
    scores = {n: torch.full((qe - qs,), math.nan, dtype=torch.float64) for n in names}
    tie_ruled = torch.zeros(qe - qs, dtype=torch.bool)
    if not searched or not bool((r_q > 0).any()):  # nothing to search for; or no query with a
        # positive (one row; only singletons): every score is NaN, as evaluate() reports, without
        # a search (one row could not even run one)
        return scores, r_q, names, tie_ruled
    if available < 1:
        raise DataError("the reference set has no row other than the query itself: add references")
    need = 1
    for n in searched:
        if _AT_K.match(n):
            need = max(need, cutoff(n))
    read = torch.full_like(r_q, need)  # per query, the positions its metrics read
    if any(n in ("r_precision", "map_at_r") for n in searched):
        need = max(need, int(r_q.max()))
        read = torch.maximum(read, r_q)
    need = min(need + EXTRA_NEIGHBOURS, available)  # a few more (dmlkit.metrics.near_ties)
    plan = plan_blocks(nq, m, d, need, budget, same)
    on_cpu = not (isinstance(query, torch.Tensor) and query.device.type != "cpu")
    if backend == "auto" and on_cpu and _Scorer(dist).symmetric and (qe - qs) * m >= SMALL_SEARCH_PAIRS:
        backend = "numba"  # chosen for the whole search, as evaluate() would, not per block
    # float64 pair scores by one function for the whole search, on every rank (the total size)
    compiled = compiled_scores(on_cpu, nq * m)
    q_rows, r_rows = plan.query_rows, plan.reference_rows
    if block_rows is not None:
        q_rows = r_rows = check_integer(block_rows, "block_rows")
    if same:  # reference blocks cover the whole set; query blocks are their parts in the range
        r_blocks = [(b0, min(m, b0 + q_rows)) for b0 in range(0, m, q_rows)]
        q_blocks = [(max(b0, qs), min(b1, qe)) for b0, b1 in r_blocks if b0 < qe and b1 > qs]
    else:
        q_blocks = [(a0, min(qe, a0 + q_rows)) for a0 in range(qs, qe, q_rows)]
        r_blocks = [(b0, min(m, b0 + r_rows)) for b0 in range(0, m, r_rows)]
    iterator: Any = q_blocks
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(q_blocks, desc="evaluate (streaming)", unit="block", leave=False)
    higher = dist.higher_is_closer
    scorer = _Scorer(dist)
    r_norm = 0.0  # the largest prepared reference norm, for the near-tie bound
    seen: set[int] = set()

    def note(b0: int, blk: torch.Tensor) -> None:
        nonlocal r_norm
        if b0 not in seen and scorer.kind != "generic":
            seen.add(b0)
            r_norm = max(r_norm, float(scorer.prepare(blk, "reference embeddings").norm(dim=1).max()))

    # one torch thread but in a large search's searches and re-search (module docstring)
    with single_threaded_torch() as threads:
        workers = threads if (qe - qs) * m >= SMALL_SEARCH_PAIRS else 1
        for a0, a1 in iterator:
            q_blk = _read(query, a0, a1, "query embeddings")
            run_c = run_i = None
            parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # block results not merged yet
            for b0, b1 in r_blocks:
                if same and (b0, b1) == (a0, a1):  # the diagonal block: a self-search
                    note(b0, q_blk)
                    if a1 - a0 < 2:
                        continue
                    with torch_threads(workers):
                        res = knn(q_blk, None, min(need, a1 - a0 - 1), distance=dist, backend=backend,
                                  memory_budget=plan.knn_budget)
                elif same and b0 <= a0 < b1:  # part of a block: one more neighbour, then drop self
                    g_blk = _read(ref, b0, b1, "reference embeddings")
                    note(b0, g_blk)
                    if b1 - b0 < 2:
                        continue
                    res = knn_above_floor(q_blk, g_blk, min(need, b1 - b0 - 1) + 1, None, distance=dist,
                                          backend=backend, memory_budget=plan.knn_budget, threads=workers)
                    res = _drop_self(res, a0 - b0)
                    del g_blk
                else:  # once every query holds k neighbours, only what beats its k-th can enter
                    g_blk = _read(ref, b0, b1, "reference embeddings")
                    note(b0, g_blk)
                    floor = run_c[:, -1].numpy() if run_c is not None and run_c.shape[1] == need else None
                    res = knn_above_floor(q_blk, g_blk, min(need, b1 - b0), floor, distance=dist,
                                          backend=backend, memory_budget=plan.knn_budget, threads=workers)
                    del g_blk
                parts.append((res.values if higher else -res.values, res.indices + b0))
                if sum(c.shape[1] for c, _ in parts) >= need:
                    run_c, run_i, parts = *_merge_top(run_c, run_i, parts, need), []
            if parts:
                run_c, run_i = _merge_top(run_c, run_i, parts, need)
            assert run_c is not None and run_i is not None  # available >= 1 guarantees a block
            ql_blk = ql[a0:a1]
            with torch_threads(workers):  # the re-search's products
                neighbours, tie_ruled[a0 - qs:a1 - qs] = _resolve_block(
                    q_blk, ql_blk, run_i, run_c if higher else -run_c, ref, rl, scorer, r_blocks, r_norm,
                    available, a0 if same else None, plan.knn_budget, read[a0 - qs:a1 - qs], compiled)
            block_scores = per_query_from_neighbours(neighbours, rl, ql_blk, r_q[a0 - qs:a1 - qs], searched)
            for n in searched:
                scores[n][a0 - qs:a1 - qs] = block_scores[n]
    return scores, r_q, names, tie_ruled


def evaluate_streaming(
    query: Any,
    query_labels: Any | None = None,
    reference: Any | None = None,
    reference_labels: Any | None = None,
    metrics: Sequence[str] | None = None,
    *,
    distance: str | BaseDistance = "cosine",
    k_values: Sequence[int] = (1, 2, 4, 8),
    backend: str = "auto",
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    block_rows: int | None = None,
    progress: bool = False,
    query_range: tuple[int, int] | None = None,
    across_ranks: bool = False,
) -> dict[str, float | int]:
    """:func:`dmlkit.metrics.evaluate`'s retrieval metrics, reading embeddings block by block.

    Args:
        query: ``(N, D)`` sliceable source: a :class:`~dmlkit.embedding_shards.ShardedEmbeddings`,
            ``np.memmap``, numpy array or torch tensor.
        query_labels: ``(N,)`` labels; default the source's own ``labels`` (shard directories).
        reference, reference_labels: a separate reference set (same kinds); ``None`` searches the
            query set, each query excluded from its own neighbours by index.
        metrics: ``precision_at_1``, ``recall_at_k`` / ``recall_at_<K>``, ``precision_at_k`` /
            ``precision_at_<K>``, ``r_precision``, ``map_at_r`` (default: those of
            :data:`dmlkit.metrics.DEFAULT_METRICS`). Full-ranking ``map`` and the clustering and
            histogram metrics need every embedding at once and are refused.
        distance, k_values, backend: as in :func:`dmlkit.metrics.evaluate`.
        memory_budget: bytes for the blocks, the kNN tiles and the block's neighbours; the
            labels and per-query scores (``O(N)``) are extra.
        block_rows: force the rows per block (default: from the budget, :func:`plan_blocks`).
        progress: a progress bar over query blocks.
        query_range: ``(start, stop)``: evaluate only the queries in these rows (still against
            every reference, each query excluded from its own neighbours in a self-search). The
            per-query scores of disjoint ranges (:func:`per_query_streaming`) are those of the
            whole evaluation, so ranges can run on different machines; the means here are over
            the range.
        across_ranks: in a ``torch.distributed`` job (``torchrun``), split the queries over its
            ranks: rank ``r`` of ``W`` takes the contiguous ``query_range`` that
            :func:`dmlkit.distributed.shard_bounds` gives it, the per-query float64 scores and
            ``R_q`` are gathered in rank order (:func:`dmlkit.distributed.all_gather_unequal`),
            and every rank returns the whole evaluation's result (a query's scores depend on that
            query alone, so the split changes no number, exact ties included; ``W`` ranks do
            ``1/W`` of the products each). An error on any rank ends every rank with one error
            (:func:`dmlkit.distributed.agree`). Every rank must call it; without a process group
            it changes nothing.

    Returns the same keys and values as :func:`dmlkit.metrics.evaluate`.
    """
    kwargs: dict[str, Any] = dict(distance=distance, k_values=k_values, backend=backend,
                                  memory_budget=memory_budget, block_rows=block_rows)
    if across_ranks and context().enabled:
        if query_range is not None:
            raise ConfigError("across_ranks chooses each rank's query_range: pass one or the other")
        return _across_ranks(query, query_labels, reference, reference_labels, metrics, progress, kwargs)
    scores, r_q, names, tie_ruled = _stream(query, query_labels, reference, reference_labels, metrics,
                                            progress=progress, query_range=query_range, means=True,
                                            **kwargs)
    return _means(scores, r_q, names, _candidates(query, reference), tie_ruled)


def _across_ranks(query: Any, query_labels: Any, reference: Any, reference_labels: Any, metrics: Any,
                  progress: bool, kwargs: dict[str, Any]) -> dict[str, float | int]:
    """:func:`evaluate_streaming` with ``across_ranks=True`` in a process group."""
    names = agree(streamable_names, metrics, kwargs["k_values"])  # the same error everywhere: one line

    def share() -> tuple[torch.Tensor, torch.Tensor]:
        start, stop = shard_bounds(_shape(query, "query embeddings")[0])
        if start == stop:  # fewer queries than ranks: this rank has none
            return torch.empty(0, len(names) + 1, dtype=torch.float64), torch.empty(0, dtype=torch.int64)
        scores, r_q, _, tie_ruled = _stream(query, query_labels, reference, reference_labels, names,
                                            progress=progress and context().is_main,
                                            query_range=(start, stop), means=True, **kwargs)
        # the last column: whether the tie rule decides what the query's metrics read
        return torch.stack([*(scores[n] for n in names), tie_ruled.double()], 1), r_q.to(torch.int64)

    local, local_r = agree(share)
    gathered = all_gather_unequal(local)
    return _means({n: gathered[:, i] for i, n in enumerate(names)}, all_gather_unequal(local_r), names,
                  _candidates(query, reference), gathered[:, -1] > 0)


def _candidates(query: Any, reference: Any) -> int:
    """How many references each query is ranked against (itself left out of its own set)."""
    return _shape(query, "query embeddings")[0] - 1 if reference is None else _shape(reference, "reference embeddings")[0]


def _means(scores: dict[str, torch.Tensor], r_q: torch.Tensor, names: list[str],
           candidates: int, tie_ruled: torch.Tensor) -> dict[str, float | int]:
    """Each metric's mean over the queries with a positive (``R_q > 0``), and the counts; NaN
    where it is the same for any embeddings (:func:`warn_embedding_independent`); a warning
    where the tie rule decides what some queries' metrics read (:func:`warn_tie_ruled`)."""
    valid = r_q > 0
    n_valid = int(valid.sum())
    fixed = warn_embedding_independent(r_q, candidates, names)
    warn_tie_ruled(tie_ruled, valid, [n for n in names if n not in fixed])
    result: dict[str, float | int] = {
        n: float(scores[n][valid].mean()) if n_valid and n not in fixed else math.nan for n in names
    }
    result["num_queries"] = int(r_q.shape[0])
    result["num_queries_without_positive"] = int(r_q.shape[0] - n_valid)
    return result


def per_query_streaming(
    query: Any,
    query_labels: Any | None = None,
    reference: Any | None = None,
    reference_labels: Any | None = None,
    metrics: Sequence[str] | None = None,
    **kwargs: Any,
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Per-query float64 scores (NaN where ``R_q = 0``) and ``R_q``, as
    :func:`dmlkit.metrics.per_query` returns them; keyword arguments of :func:`evaluate_streaming`."""
    scores, r_q, names, tie_ruled = _stream(query, query_labels, reference, reference_labels, metrics,
                             distance=kwargs.pop("distance", "cosine"),
                             k_values=kwargs.pop("k_values", (1, 2, 4, 8)),
                             backend=kwargs.pop("backend", "auto"),
                             memory_budget=kwargs.pop("memory_budget", DEFAULT_MEMORY_BUDGET),
                             block_rows=kwargs.pop("block_rows", None),
                             progress=kwargs.pop("progress", False),
                             query_range=kwargs.pop("query_range", None))
    if kwargs:
        raise ConfigError(f"unknown arguments: {sorted(kwargs)}")
    warn_tie_ruled(tie_ruled, r_q > 0, names)
    return per_query_arrays(scores, r_q), r_q.numpy()
