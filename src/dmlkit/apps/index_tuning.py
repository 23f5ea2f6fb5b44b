"""Recall of an approximate :class:`~dmlkit.apps.index.EmbeddingIndex`, and tuning it to a target.

The recall of an approximate search is measured against the exact search on held-out queries:

    recall@k = mean over queries q of |ANN_k(q) ∩ Exact_k(q)| / k

(the "k-recall@k" of ANN-Benchmarks, Aumüller et al., Information Systems 2020), where an
approximate neighbour exactly as close as the ``k``-th exact one counts as found
(:func:`as_close_as_kth`: duplicated vectors tie, and the exact list keeps only the first). Without
explicit queries, :func:`measure_recall` and :func:`tune` sample indexed rows that the structure
has not seen: rows the IVF quantiser was not trained on, or the rows a new HNSW graph holds out
of the graph until this measurement (:func:`dmlkit.apps.index_faiss.add_to_structure`; exact
neighbours are then taken among the rows in the graph). Each query's own row is dropped from
both result lists; the approximate search drops it from its candidates before keeping as many
as an outside query gets (IVF-PQ's ``rerank * k``), so the recall is the one a query achieves. ``recall["held_out"]`` says whether the queries were unseen; in-graph HNSW
queries overstate recall (a query that is a node of the graph finds its neighbours easily).
Queries the caller gives are held out unless one of them is bit-identical to an indexed vector
(:func:`_any_indexed`): its own row is kept in both result lists (the caller's queries carry no
row numbers), found at distance 0, and overstates recall, so ``held_out`` is ``False``.

:func:`tune` walks the search settings of :func:`search_settings` in order of cost (the bytes a
query scans: ``nprobe`` IVF cells of vectors or PQ codes plus the ``rerank * k`` re-scored
vectors of IVF-PQ (Jegou et al., "Product quantization for nearest neighbor search", TPAMI
2011); ``ef_search`` for HNSW (Malkov and Yashunin, TPAMI 2020)) and keeps the first that
reaches the target.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from dmlkit.apps.index_exact import closeness64, first_kept, to_numpy_embeddings
from dmlkit.apps.index_faiss import flush_graph_reserve
from dmlkit.exceptions import ConfigError, DataError, ShapeError
from dmlkit.validation import check_integer

if TYPE_CHECKING:
    from dmlkit.apps.index import EmbeddingIndex

__all__ = ["check_recall_settings", "check_target_recall", "measure_recall", "recall_at_k", "search_settings", "tune"]

RERANK_FACTORS = (1, 2, 4, 8, 16, 32, 64)
#: Float64 bytes of one block of gathered neighbours scored by :func:`as_close_as_kth` (32 MiB).
RECALL_SCORE_BYTES = 2**25
EF_VALUES = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


def recall_at_k(approx: np.ndarray, exact: np.ndarray, k: int, as_close: np.ndarray | None = None) -> float:
    """``mean_q |approx[q, :k] ∩ exact[q, :k]| / k``, k-recall@k.

    Entries ``< 0`` in ``approx`` (not found) never match. ``as_close`` (``(Q, k)`` bool) marks
    approximate neighbours that count even outside the exact list: those exactly as close as
    its ``k``-th (:func:`as_close_as_kth`), for which the exact search's tie rule (the smaller
    row) chose another row. ANN-Benchmarks likewise counts a neighbour by its distance, not its
    id (within the ``k``-th exact distance plus a margin).
    """
    if approx.shape[0] != exact.shape[0]:
        raise ShapeError(f"{approx.shape[0]} approximate rows but {exact.shape[0]} exact rows")
    if approx.shape[0] == 0:
        return float("nan")
    hits = 0
    for r, (a, e) in enumerate(zip(approx[:, :k], exact[:, :k])):
        hit = np.isin(a, e) if as_close is None else np.isin(a, e) | as_close[r, : a.size]
        hits += int((hit & (a >= 0)).sum())
    return hits / (approx.shape[0] * k)


def as_close_as_kth(index: EmbeddingIndex, q: np.ndarray, approx: np.ndarray, exact: np.ndarray,
                    k: int) -> np.ndarray:
    """``(Q, k)``: the approximate neighbours whose float64 closeness to their query (as exact
    search computes it: :func:`dmlkit.apps.index_exact.closeness64`) is at least that of the
    ``k``-th exact neighbour. With duplicated vectors, rows tied at the ``k``-th place are all
    right answers, but the exact list holds only the first of them: an index that returned
    another was counted as missing it."""
    a = approx[:, :k]
    kth = exact[:, k - 1:k]
    out = np.zeros(a.shape, dtype=bool)
    block = max(1, RECALL_SCORE_BYTES // (8 * (k + 1) * index.dim))
    for r0 in range(0, a.shape[0], block):
        sl = slice(r0, r0 + block)
        rows = np.maximum(np.concatenate([a[sl], kth[sl]], axis=1), 0)
        s = closeness64(index.embeddings, q[sl], rows, index.distance, index._unit)
        out[sl] = (s[:, :-1] >= s[:, -1:]) & (a[sl] >= 0) & (kth[sl] >= 0)
    return out


def _drop(found: np.ndarray, drop: np.ndarray, k: int) -> np.ndarray:
    """The first ``k`` entries of each row of ``found`` where ``drop`` is false (``-1`` pads)."""
    order, gone = first_kept(drop, k)
    return np.where(gone, -1, np.take_along_axis(found, order, axis=1))


def check_recall_settings(k: Any, num_queries: Any) -> tuple[int, int]:
    """The recall measurement's ``k`` and number of sampled queries as positive ints
    (:func:`dmlkit.validation.check_integer`): the one check of both, for the constructor's
    ``recall_k`` / ``recall_queries``, :func:`measure_recall` and :func:`tune` (so the CLI's
    ``--add``/``--remove`` re-tuning too). ``k=2.5`` was a TypeError, 0 queries a ValueError
    traceback, and ``k=0`` blamed the index size."""
    return (check_integer(k, "recall_k", hint=" (the k of recall@k: --recall-k, or k of measure_recall/tune)"),
            check_integer(num_queries, "recall_queries",
                          hint=" (queries sampled to measure recall: --recall-queries, or num_queries)"))


def check_target_recall(target_recall: Any) -> float:
    """``target_recall`` as a float in (0, 1], else one :class:`ConfigError` line (a string was
    a TypeError from the comparison, NaN compared false everywhere)."""
    if isinstance(target_recall, bool) or not isinstance(target_recall, int | float | np.integer | np.floating) \
            or not 0 < target_recall <= 1:
        raise ConfigError(f"target_recall must be a number in (0, 1], got {target_recall!r}")
    return float(target_recall)


def recall_sample(index: EmbeddingIndex, num_queries: int, seed: int) -> np.ndarray:
    """Rows for the recall measurement: rows an HNSW graph holds out, else rows the quantiser
    was not trained on where there are enough, else any indexed rows; never an all-zero row
    of an index that compares directions (:meth:`~dmlkit.apps.index.EmbeddingIndex.refuse_zero_queries`:
    every item is as close to it as any other, and each one was counted as found)."""
    rng = np.random.default_rng(seed + 1)
    n = len(index)
    nonzero = index._row_norms().sq > 0 if index._unit else np.ones(n, dtype=bool)
    if index._graph_reserve.size:
        pool = np.sort(index._rows_of_keys(index._graph_reserve))
        pool = pool[nonzero[pool]]
    else:
        trained = index._trained_keys
        held = np.flatnonzero(~np.isin(index._keys, trained) & nonzero) if trained.size else np.flatnonzero(nonzero)
        pool = held if held.size >= min(num_queries, n) else np.flatnonzero(nonzero)
    if not pool.size:
        raise DataError("every indexed row is all zeros: there is no query with a direction to measure recall with")
    take = min(num_queries, pool.size)
    return np.sort(rng.choice(pool, size=take, replace=False))


def _setup(index: EmbeddingIndex, k: int, queries: Any, num_queries: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int, bool]:
    """``(queries, exact neighbours, query rows or None, k, held_out)`` of a recall measurement."""
    k, num_queries = check_recall_settings(k, num_queries)
    if index.kind == "flat":
        raise ConfigError("a flat index is exact (recall 1.0): measure or tune an approximate kind")
    if len(index) < 2:
        raise DataError("need at least two indexed items to measure recall")
    # rows not in the HNSW graph yet are left out of the exact lists as well
    outside = np.sort(index._rows_of_keys(index._graph_reserve)) if index._graph_reserve.size else None
    n_out = 0 if outside is None else outside.size
    if queries is None:
        rows = recall_sample(index, num_queries, index.params["seed"])
        q = np.ascontiguousarray(index.embeddings[rows], dtype=np.float32)
        # the graph holds every row but the reserve (queries among it), else all but the query
        k = min(k, len(index) - n_out if n_out else len(index) - 1)
        if k < 1:
            raise DataError("too few indexed items besides the recall queries to measure recall")
        exact, _ = index._exact(q, min(len(index), k + 1 + n_out))
        if index.kind == "hnsw":
            held_out = outside is not None and bool(np.isin(rows, outside).all())
        else:
            held_out = not bool(np.isin(index._keys[rows], index._trained_keys).any())
        dropped = exact == rows[:, None] if outside is None else np.isin(exact, outside)
        return q, _drop(exact, dropped, k), rows, k, held_out
    q = to_numpy_embeddings(queries, "queries")
    if q.shape[1] != index.dim:
        raise ShapeError(f"queries must be (Q, {index.dim}), got shape {q.shape}")
    index.refuse_zero_queries(q)
    k = min(k, len(index) - n_out)
    exact, _ = index._exact(q, min(len(index), k + n_out))
    if outside is not None:
        exact = _drop(exact, np.isin(exact, outside), k)
    return q, exact, None, k, not _any_indexed(index, q, outside)


def _any_indexed(index: EmbeddingIndex, q: np.ndarray, outside: np.ndarray | None) -> bool:
    """Whether any query is bit-identical to an indexed vector the structure holds (``outside``:
    rows out of the HNSW graph, left out): such a query finds itself, at distance 0, among its
    exact and its approximate neighbours, and the recall is overstated (not held out). Rows are
    compared by their bytes in blocks (a hash lookup per indexed row, no distances)."""
    row = np.dtype((np.void, 4 * index.dim))
    wanted = set(np.ascontiguousarray(q, dtype=np.float32).view(row).ravel().tolist())
    skip = None
    if outside is not None:
        skip = np.zeros(len(index), dtype=bool)
        skip[outside] = True
    block = max(1, RECALL_SCORE_BYTES // (4 * index.dim))
    for r0 in range(0, len(index), block):
        x = np.ascontiguousarray(index.embeddings[r0:r0 + block], dtype=np.float32)
        if skip is not None:
            x = x[~skip[r0:r0 + block]]
        if not wanted.isdisjoint(x.view(row).ravel().tolist()):
            return True
    return False


def _recall_of(index: EmbeddingIndex, q: np.ndarray, exact: np.ndarray, rows: np.ndarray | None, k: int,
               setting: dict[str, Any]) -> tuple[float, float]:
    """``(recall@k, seconds per query)`` of one search setting.

    A held-in query (``rows``) is searched as if its own row were not indexed: the same
    candidates an outside query gets at this setting (IVF-PQ re-scores ``rerank * k`` of them,
    not ``rerank * (k + 1)``), so the recall is the one a user's query achieves.
    """
    t0 = time.perf_counter()
    approx, _ = index._ann(q, k, setting, exclude=rows)
    seconds = time.perf_counter() - t0
    return recall_at_k(approx, exact, k, as_close_as_kth(index, q, approx, exact, k)), seconds / max(1, q.shape[0])


def measure_recall(index: EmbeddingIndex, k: int = 10, queries: Any = None, num_queries: int = 1000
                   ) -> dict[str, Any]:
    """Measure recall@k of the index's current settings against exact search; stored as ``index.recall``."""
    q, exact, rows, k, held_out = _setup(index, k, queries, num_queries)
    setting = index._setting()
    recall, per_query = _recall_of(index, q, exact, rows, k, setting)
    index.recall = {"k": k, "recall": recall, "num_queries": int(q.shape[0]), "held_out": held_out,
                    "setting": setting, "seconds_per_query": per_query, "target": None, "met": None,
                    "stale": False}
    flush_graph_reserve(index)
    return index.recall


def search_settings(index: EmbeddingIndex, k: int) -> list[tuple[float, dict[str, Any]]]:
    """Search settings with their cost (bytes scanned per query; ``ef_search`` for HNSW), cheapest first.

    IVF-Flat: ``nprobe * N / nlist * D * 4`` bytes; IVF-PQ: ``nprobe * N / nlist * m * nbits / 8``
    bytes of codes plus ``rerank * k * D * 4`` bytes of re-scored vectors.
    """
    n, d = max(1, len(index)), index.dim
    if index.kind == "hnsw":
        efs = [ef for ef in EF_VALUES if k + 1 <= ef < n]
        if n <= EF_VALUES[-1] or not efs:  # a small graph: ef = N visits all of it
            efs.append(max(n, k + 1) if n <= EF_VALUES[-1] else k + 1)
        # no ef = N on a large graph: it visits every node, slower than an exact scan (a 1M-row
        # graph took hours to measure at ef = 1M); the tuner keeps the best and says "not met"
        return [(float(ef), {"ef_search": ef}) for ef in efs]
    p = index.params
    nlist = int(p["nlist"])
    probes = sorted({min(nlist, 2**i) for i in range(int(math.log2(nlist)) + 2)})
    out = []
    for nprobe in probes:
        cell = nprobe * n / nlist
        if index.kind == "ivf_flat":
            out.append((cell * d * 4, {"nprobe": nprobe}))
        else:
            for r in RERANK_FACTORS:
                out.append((cell * p["pq_m"] * p["pq_nbits"] / 8 + r * k * d * 4, {"nprobe": nprobe, "rerank": r}))
    return sorted(out, key=lambda t: t[0])


def tune(index: EmbeddingIndex, target_recall: float = 0.95, k: int = 10, queries: Any = None,
         num_queries: int = 1000) -> dict[str, Any]:
    """Set the cheapest search setting whose measured recall@k reaches ``target_recall``.

    When none reaches the target, the most accurate one is kept and ``recall["met"]`` is ``False``.
    """
    target_recall = check_target_recall(target_recall)
    q, exact, rows, k, held_out = _setup(index, k, queries, num_queries)
    tried = []
    chosen = None
    for cost, setting in search_settings(index, k):
        recall, per_query = _recall_of(index, q, exact, rows, k, setting)
        tried.append({"setting": setting, "recall": recall, "cost": cost, "seconds_per_query": per_query})
        if recall >= target_recall:
            chosen = tried[-1]
            break
    met = chosen is not None
    if chosen is None:
        chosen = max(tried, key=lambda t: (t["recall"], -t["cost"]))
    index.params.update(chosen["setting"])
    index.recall = {"k": k, "recall": chosen["recall"], "num_queries": int(q.shape[0]), "held_out": held_out,
                    "setting": chosen["setting"], "seconds_per_query": chosen["seconds_per_query"],
                    "target": target_recall, "met": met, "tried": tried, "stale": False}
    flush_graph_reserve(index)
    return index.recall
