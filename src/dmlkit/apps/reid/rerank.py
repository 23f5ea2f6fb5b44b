"""k-reciprocal re-ranking (Zhong, Zheng, Cao & Li, "Re-ranking Person Re-identification with
k-reciprocal Encoding", CVPR 2017), memory-bounded.

On the ``N = Q + G`` query and gallery items, with ``d`` the Euclidean distance (on
L2-normalised features for ``metric="cosine"``):

1. ``d'(i, j) = d(i, j)^2 / max_l d(i, l)^2`` (the squared, row-normalised distance of the
   authors' code); ``N(i, k)``: the ``k`` nearest items of ``i`` (itself included, ties by index);
2. k-reciprocal set ``R(i, k1) = {j in N(i, k1 + 1) : i in N(j, k1 + 1)}``, expanded by
   ``R(j, round(k1 / 2))`` of every ``j in R(i, k1)`` that shares more than 2/3 of its items
   with ``R(i, k1)`` (Eq. 6 of the paper) to ``R*(i)``;
3. ``V[i, j] = exp(-d'(i, j)) / sum_{l in R*(i)} exp(-d'(i, l))`` for ``j in R*(i)``, else 0
   (Eq. 7-8); local query expansion ``V[i] <- mean_{j in N(i, k2)} V[j]`` (Eq. 10);
4. Jaccard distance ``d_J(p, g) = 1 - sum_j min(V[p,j], V[g,j]) / sum_j max(V[p,j], V[g,j])``
   ``= 1 - m / (2 - m)`` with ``m = sum_j min(...)`` (rows of ``V`` sum to one; Eq. 9-11);
5. final distance ``d*(p, g) = (1 - lambda) d_J(p, g) + lambda d'(p, g)`` (Eq. 12); defaults
   ``k1 = 20, k2 = 6, lambda = 0.3`` (the paper's Market-1501 setting).

The authors' code holds several ``N x N`` matrices (float16 for Market-1501: 19,281^2 x 2 B =
0.7 GB each; MSMT17's N = 93,820 needs 17.6 GB each). Here only the ``N x (k1 + 1)`` neighbour
table, the sparse ``V`` (``O(N k1^2)`` non-zeros at most) and one block of rows at a time exist:
the neighbour pass streams ``N x N`` distances in row blocks, the Jaccard sums use ``V``'s
inverted index (a compiled kernel), and the final distances are produced one query block at a
time for :func:`dmlkit.apps.reid.evaluate_reid_scores`. Cost: one ``N x N`` and one ``Q x G``
distance pass, plus ``O(Q * nnz per row * items per column)`` for the Jaccard sums.

torchreid passes its *squared* Euclidean distance to the authors' function, which squares it
again; this module squares the Euclidean distance once, as the paper's code does on features.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from dmlkit.apps.reid._common import (
    DEFAULT_MEMORY_BUDGET,
    _as_float,
    _block_rows,
    _centred,
    _prepared,
    _sq_norms,
    check_memory_budget,
    check_rerank_metric,
    check_rerank_value,
)
from dmlkit.exceptions import ShapeError

__all__ = ["k_reciprocal_blocks", "k_reciprocal_distances", "neighbour_table"]


def _prepare(query: Any, gallery: Any, metric: str):
    import torch

    check_rerank_metric(metric)
    q = _as_float(query, "query embeddings")
    g = _as_float(gallery, "gallery embeddings")
    if q.shape[1] != g.shape[1]:
        raise ShapeError(f"query dim {q.shape[1]} != gallery dim {g.shape[1]}")
    x = torch.from_numpy(np.concatenate([q, g]))
    x = _prepared(x, metric, False, "query and gallery embeddings")
    x, _ = _centred(x, x)  # the same distances, less rounding where an offset dominates
    return x, _sq_norms(x)


def _sq_dist(a, a_sq, b_t, b_sq):
    """Squared Euclidean distances of row block ``a`` to all of ``b`` (clamped at 0)."""
    out = a @ b_t
    out.mul_(-2.0).add_(a_sq[:, None]).add_(b_sq[None, :]).clamp_(min=0.0)
    return out


def neighbour_table(x, x_sq, k: int, memory_budget: int) -> tuple[np.ndarray, np.ndarray]:
    """``(N, k)`` nearest items of every item (itself included; ties by index) and the
    per-row maximum squared distance, streamed in row blocks."""
    import torch

    n = x.shape[0]
    k = min(k, n)
    x_t = x.t()  # a view: no copy
    nn = np.empty((n, k), dtype=np.int64)
    row_max = np.empty(n, dtype=np.float64)
    rows = _block_rows(n, memory_budget)
    for a in range(0, n, rows):
        d2 = _sq_dist(x[a: a + rows], x_sq[a: a + rows], x_t, x_sq)
        row_max[a: a + d2.shape[0]] = d2.max(1).values.double().numpy()
        # the k smallest, then a deterministic (distance, index) order
        vals, idx = torch.topk(d2, k, dim=1, largest=False, sorted=False)
        v, i = vals.numpy(), idx.numpy()
        # topk picks any of the items tied at the k-th distance: take the lowest indices
        thr = v.max(1)
        for r in np.flatnonzero((d2 <= torch.from_numpy(thr)[:, None]).sum(1).numpy() > k):
            row = d2[r].numpy()
            below = np.flatnonzero(row < thr[r])
            sel = np.concatenate([below, np.flatnonzero(row == thr[r])[: k - below.size]])
            i[r], v[r] = sel, row[sel]
        order = np.lexsort((i, v), axis=-1)
        nn[a: a + d2.shape[0]] = np.take_along_axis(i, order, axis=1)
    return nn, row_max


def _reciprocal_sets(nn: np.ndarray, k1: int) -> tuple[np.ndarray, np.ndarray]:
    from dmlkit.apps.reid._kernels import expanded_reciprocal_sets  # lazy: numba, first use

    k_full = min(k1 + 1, nn.shape[1])  # capped: k1 >= N - 1 takes every item, as N - 1 does
    k_half = min(int(np.around(k1 / 2.0)) + 1, nn.shape[1])
    width = k_full * (k_half + 1)  # R(i) and, per member, its half set (from the capped sizes)
    buf = np.empty((nn.shape[0], width), dtype=np.int64)
    lengths = np.zeros(nn.shape[0], dtype=np.int64)
    expanded_reciprocal_sets(nn, k_full, k_half, buf, lengths)
    ptr = np.zeros(nn.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=ptr[1:])
    cols = np.concatenate([buf[r, : lengths[r]] for r in range(nn.shape[0])])
    return ptr, cols


def _encode(x, x_sq, row_max: np.ndarray, ptr: np.ndarray, cols: np.ndarray, k2: int,
            nn: np.ndarray, memory_budget: int):
    """The sparse ``V`` (CSR) after local query expansion."""
    import scipy.sparse as sp
    import torch

    n = x.shape[0]
    rows = np.repeat(np.arange(n), np.diff(ptr))
    d2 = np.empty(cols.size, dtype=np.float64)
    chunk = max(1, memory_budget // max(1, 8 * x.shape[1]))
    for a in range(0, cols.size, chunk):
        r = torch.from_numpy(rows[a: a + chunk])
        c = torch.from_numpy(cols[a: a + chunk])
        dots = (x[r] * x[c]).sum(1)
        d2[a: a + chunk] = (x_sq[r] + x_sq[c] - 2.0 * dots).clamp_(min=0.0).double().numpy()
    scale = np.where(row_max > 0, row_max, 1.0)
    w = np.exp(-d2 / scale[rows])
    sums = np.bincount(rows, weights=w, minlength=n)  # an empty R*(i) (ties) adds nothing
    w /= sums[rows]
    v = sp.csr_matrix((w, cols, ptr), shape=(n, n))
    if k2 > 1:
        k2 = min(k2, nn.shape[1])
        qe = sp.csr_matrix((np.full(n * k2, 1.0 / k2), nn[:, :k2].reshape(-1),
                            np.arange(0, n * k2 + 1, k2)), shape=(n, n))
        v = (qe @ v).tocsr()
    v.sort_indices()
    return v


def k_reciprocal_blocks(
    query: Any,
    gallery: Any,
    *,
    k1: int = 20,
    k2: int = 6,
    lambda_value: float = 0.3,
    metric: str = "euclidean",
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> Iterator[tuple[int, np.ndarray]]:
    """Yield ``(row0, block)``: re-ranked query x gallery distances ``d*``, one query block at a time."""

    from dmlkit.apps.reid._kernels import jaccard_rows  # lazy: numba, first use

    for key, value in (("k1", k1), ("k2", k2), ("lambda_value", lambda_value)):
        check_rerank_value(key, key, value)
    memory_budget = check_memory_budget(memory_budget)  # 0 or 0.5 were clamped without a word
    x, x_sq = _prepare(query, gallery, metric)
    n_q = len(query)
    n = x.shape[0]
    nn, row_max = neighbour_table(x, x_sq, max(k1 + 1, k2), memory_budget)
    ptr, cols = _reciprocal_sets(nn, k1)
    v = _encode(x, x_sq, row_max, ptr, cols, k2, nn, memory_budget)
    inv = v.tocsc()
    inv.sort_indices()
    q_ptr, q_col, q_val = v.indptr.astype(np.int64), v.indices.astype(np.int64), v.data
    i_ptr, i_row, i_val = inv.indptr.astype(np.int64), inv.indices.astype(np.int64), inv.data
    g = x[n_q:]
    g_t, g_sq = g.t(), x_sq[n_q:]
    n_g = n - n_q
    rows = _block_rows(n_g, memory_budget // 2)
    for a in range(0, n_q, rows):
        b = min(n_q, a + rows)
        scale = lambda_value / np.where(row_max[a:b] > 0, row_max[a:b], 1.0)
        m = np.zeros((b - a, n_g), dtype=np.float64)
        jaccard_rows(a, b, q_ptr, q_col, q_val, i_ptr, i_row, i_val, n_q, n_g, m)
        np.divide(m, 2.0 - m, out=m)  # in place: few block-sized temporaries
        m *= -(1.0 - lambda_value)
        m += 1.0 - lambda_value  # (1 - lambda) d_J
        m += _sq_dist(x[a:b], x_sq[a:b], g_t, g_sq).numpy() * scale[:, None]  # + lambda d'
        yield a, m.astype(np.float32)


def k_reciprocal_distances(query: Any, gallery: Any, **kwargs: Any) -> np.ndarray:
    """The full ``(Q, G)`` re-ranked distance matrix (small sets; else use the blocks)."""
    blocks = list(k_reciprocal_blocks(query, gallery, **kwargs))
    return np.concatenate([blk for _, blk in blocks]) if blocks else np.empty((0, len(gallery)))
