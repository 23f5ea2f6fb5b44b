"""Clustering metrics: NMI, AMI and pair-counting F1 of k-means clusters against the labels.

The embeddings are clustered by k-means with ``k`` = the number of classes (dmlkit's Lloyd
k-means from k-means++ seeds, :func:`kmeans_labels`; faiss or scikit-learn on request), as in
the metric-learning literature (NMI: Schuetze et al., "Introduction to Information Retrieval",
2008, used by Song et al., CVPR 2016). Because
the scores depend on the clustering's random seed (a weakness the seeds point out), k-means is
run ``restarts`` times with seeds ``seed, seed + 1, ...`` and the scores are averaged.

* ``nmi`` - normalized mutual information ``I(Y; C) / mean(H(Y), H(C))`` (arithmetic mean,
  scikit-learn's default).
* ``ami`` - adjusted mutual information (Vinh, Epps, Bailey, JMLR 2010).
* ``pair_f1`` - over all unordered pairs of samples: a pair is *predicted positive* when both are
  in the same cluster and *truly positive* when both have the same class;
  ``P = TP / (TP + FP)``, ``R = TP / (TP + FN)``, ``F1 = 2PR / (P + R)``.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from dmlkit.distances import rounding_bound
from dmlkit.exceptions import ConfigError, DataError, require
from dmlkit.metrics._threads import full_float32_matmuls, run_threads, single_threaded_torch
from dmlkit.validation import (
    SEED_LIMIT,
    check_embeddings,
    check_integer,
    check_labels,
    check_product_range,
    check_seed,
)

__all__ = ["CLUSTERING_METRICS", "cluster_metrics", "kmeans_labels", "pair_f1"]

CLUSTERING_METRICS = ("nmi", "ami", "pair_f1")


_KMEANS_BACKENDS = ("auto", "dmlkit", "faiss", "sklearn")


@full_float32_matmuls
def kmeans_labels(
    embeddings: np.ndarray, n_clusters: int, seed: int = 0, *, niter: int = 20, backend: str = "auto"
) -> np.ndarray:
    """Cluster assignments of k-means with ``n_clusters`` clusters for one seed.

    * ``"dmlkit"`` (``"auto"``): Lloyd's algorithm from k-means++ seeds (``niter``
      assign/update rounds, empty clusters refilled by splitting the largest, a final
      assignment), each assignment exact, with bfloat16 products where they pay
      (:func:`_kmeans_lloyd`).
    * ``"faiss"``: ``faiss.Kmeans``, best of 5 random initialisations by the k-means objective.
    * ``"sklearn"``: scikit-learn, one k-means++ initialisation.
    """
    x = check_embeddings(embeddings, "embeddings").cpu().numpy()  # 1-D was numpy's ValueError
    # 4.0 clusters was torch's TypeError; niter = -1 returned the all-zero start
    n_clusters = check_integer(n_clusters, "k-means n_clusters")
    niter = check_integer(niter, "k-means niter", least=0)
    if n_clusters > x.shape[0]:
        raise DataError(f"k-means needs 1 <= clusters <= samples, got {n_clusters} for {x.shape[0]} samples")
    if backend not in _KMEANS_BACKENDS:
        raise ConfigError(f"unknown k-means backend {backend!r}; choose one of {list(_KMEANS_BACKENDS)}")
    check_seed(seed, "the k-means seed")  # `dmlkit evaluate --seed -1` was numpy's traceback
    if backend in ("auto", "dmlkit"):
        return _kmeans_lloyd(x, n_clusters, seed, niter)
    if backend == "faiss":
        faiss = require("faiss", "faiss")  # a bare ModuleNotFoundError named no extra

        # faiss initialises at random points (no k-means++): keep the best of a few inits
        # faiss takes a C int: seeds from 2**31 - 1 overflowed it (any seed is accepted above)
        faiss_seed = int(seed) % (2**31 - 1) + 1
        km = faiss.Kmeans(x.shape[1], n_clusters, niter=niter, seed=faiss_seed, verbose=False, nredo=5,
                          max_points_per_centroid=max(256, x.shape[0]), min_points_per_centroid=1)
        km.train(x)
        _, assign = km.index.search(x, 1)
        return assign[:, 0].astype(np.int64)
    from sklearn.cluster import KMeans

    km = KMeans(n_clusters=n_clusters, n_init=1, max_iter=max(niter, 1), random_state=int(seed))
    return km.fit_predict(x).astype(np.int64)


def _kmeans_lloyd(x: np.ndarray, k: int, seed: int, niter: int) -> np.ndarray:
    """Lloyd's k-means (Lloyd 1982) from k-means++ seeds, with exact nearest-centroid steps.

    Seeds: k-means++ (Arthur and Vassilvitskii, SODA 2007) on a uniform sample of
    ``min(N, 8k + 1024)`` rows (:func:`dmlkit.metrics._kernels.kmeans_plusplus`); unlike
    faiss's random rows it rarely puts two seeds in one well-separated cluster.

    Assignment: ``argmin_c |x - c|^2 = argmax_c <x, c> - |c|^2 / 2``, the inner product of
    ``[x, 1]`` and ``[c, -|c|^2 / 2]``, found by :func:`_nearest`: bfloat16 products where this
    CPU does them fast and within their error bound, every near-maximal entry re-scored in
    float64 - the assignment float64 arithmetic makes, at bfloat16 speed (measured against
    ``faiss.Kmeans`` in ``benchmarks/bench_metrics.py --clustering``). Centroids are float64
    means; an empty cluster takes half of the largest one, both centroids moved apart by
    ``1/1024`` of it (as faiss does). ``niter`` assign/update rounds, then a final assignment.
    """
    import torch

    # lazy: the numba kernels load only when a compiled path runs
    from dmlkit.metrics._kernels import (
        cluster_sums,
        kmeans_plusplus,
    )

    # lazy: looked up per call (tests replace the probe)
    from dmlkit.metrics._tiles import _bf16_is_faster

    n, d = x.shape
    rng = np.random.default_rng(seed)
    xt = torch.from_numpy(x)
    x_aug = torch.cat([xt, torch.ones(n, 1)], dim=1).contiguous()
    m = min(n, 8 * k + 1024)  # k-means++ seeding on a uniform sample of ~8 rows per cluster
    sample = np.sort(rng.choice(n, size=m, replace=False)) if m < n else np.arange(n)
    seeds = kmeans_plusplus(x[sample], int(rng.integers(m)), rng.random(k - 1))
    centroids = xt[torch.from_numpy(sample[seeds])].double()
    check_product_range(x_aug, "embeddings", "k-means")
    bf16 = n * k >= _BF16_MIN_PAIRS and _bf16_is_faster(d + 1)
    x_norm = float(x_aug.norm(dim=1).max())  # for the products' error bound (every round)
    assign = torch.zeros(n, dtype=torch.int64)
    for it in range(niter + 1):
        bias = -0.5 * centroids.pow(2).sum(1, keepdim=True)
        c_aug = torch.cat([centroids, bias], dim=1).float().contiguous()
        assign = _nearest(x_aug, c_aug, bf16, x_norm)
        if it == niter:
            break
        sums, counts_np = np.zeros((k, d)), np.zeros(k, dtype=np.int64)
        cluster_sums(x, assign.numpy(), sums, counts_np)
        counts = torch.from_numpy(counts_np)
        new = torch.from_numpy(sums / np.maximum(counts_np, 1)[:, None])
        empty = (counts == 0).nonzero().flatten().tolist()
        sizes = counts.clone()
        for j in empty:  # split the (current) largest cluster in two
            big = int(torch.argmax(sizes))
            new[j] = new[big] * (1 + 1 / 1024)
            new[big] = new[big] * (1 - 1 / 1024)
            sizes[j] = sizes[big] // 2
            sizes[big] -= sizes[j]
        centroids = new
    return assign.numpy().astype(np.int64)


#: Below this many point-centroid pairs, k-means assignments use float32 products only.
_BF16_MIN_PAIRS = 2**24
#: Rows per assignment block (a block's product against every centroid is one tile).
_ASSIGN_ROWS = 512


def _nearest(x_aug, c_aug, bf16: bool, x_norm: float | None = None):
    """The exact closest centroid of every row (largest ``<x_aug, c_aug>``, ties by index).

    Blocks of rows against all centroids on the metric threads: float32 products, or bfloat16
    products (:func:`dmlkit.metrics._tiles._bf16_is_faster` found them fast and within their error
    bound here); either way the entries within twice the products' error bound of a row's maximum
    are re-scored in float64 (:func:`dmlkit.metrics._kernels.argmax_rows`).
    """
    import torch

    # lazy: the numba kernels load only when a compiled path runs
    from dmlkit.metrics._kernels import argmax_rows

    # lazy: looked up per call (tests)
    from dmlkit.metrics._tiles import _bf16_mm, _bf16_relative_bound

    n = x_aug.shape[0]
    out = np.empty(n, dtype=np.int64)
    xn, cn = x_aug.numpy(), c_aug.numpy()
    if x_norm is None:
        x_norm = float(x_aug.norm(dim=1).max())
    if bf16:
        xb, cb = x_aug.to(torch.bfloat16), c_aug.to(torch.bfloat16)
        bound = x_norm * float(c_aug.norm(dim=1).max()) * _bf16_relative_bound(
            x_aug.shape[1]) + x_aug.shape[1] * 1e-30
        slack = np.nextafter(np.float32(bound), np.float32(np.inf))
    else:
        # a float32 product is within this bound of its float64 value in any summation order: its
        # near-maximal entries are re-scored in float64 as well, so every CPU and BLAS assigns as
        # the bfloat16 path does (a float32 argmax put a row tied in float32 in the lower column)
        bound = rounding_bound("ip", x_aug.shape[1], x_norm, float(c_aug.norm(dim=1).max()))
        slack = np.nextafter(np.float32(bound), np.float32(np.inf))

    def block(a0: int) -> None:
        a1 = min(n, a0 + _ASSIGN_ROWS)
        if bf16:
            tile = _bf16_mm(xb[a0:a1], cb).view(torch.int16).numpy().view(np.uint16)
        else:
            tile = (x_aug[a0:a1] @ c_aug.T).numpy()
        argmax_rows(tile, a0, slack, xn, cn, out)

    with single_threaded_torch() as workers:
        run_threads(block, range(0, n, _ASSIGN_ROWS), workers)
    return torch.from_numpy(out)


def _comb2(x: np.ndarray) -> float:
    x = x.astype(np.float64)
    return float((x * (x - 1) / 2).sum())


def adjusted_mutual_info(labels: Any, clusters: Any) -> float:
    """Adjusted mutual information (Vinh, Epps, Bailey, JMLR 2010), arithmetic normalisation:

        AMI = (MI - E[MI]) / (mean(H(Y), H(C)) - E[MI]),

    the value of ``sklearn.metrics.adjusted_mutual_info_score`` (same limit cases and
    clamping), with E[MI] summed over distinct cluster sizes
    (:func:`dmlkit.metrics._kernels.expected_mutual_information`): 2,000 classes take well
    under a second instead of scikit-learn's tens of seconds. A clustering equal to the labels
    up to renaming is 1 exactly (then ``MI = H(Y) = H(C)``): with every class a singleton the
    formula is 0/0 in exact arithmetic, and its rounding noise read 0 to 1.25.
    """
    from sklearn.metrics import mutual_info_score
    from sklearn.metrics.cluster import contingency_matrix

    # lazy: the numba kernels load only when a compiled path runs
    from dmlkit.metrics._kernels import expected_mutual_information

    y, c = np.asarray(labels), np.asarray(clusters)
    n = y.shape[0]
    table = contingency_matrix(y, c, sparse=True)
    n_classes, n_clusters = table.shape
    if n_classes == n_clusters == 1 or n_classes == n_clusters == 0:
        return 1.0
    if n_classes == 1 or n_clusters == 1:
        return 0.0
    if table.nnz == n_classes == n_clusters:  # a renaming of the labels: perfect agreement
        return 1.0
    mi = mutual_info_score(y, c, contingency=table)
    size_y = np.asarray(table.sum(axis=1)).ravel().astype(np.int64)
    size_c = np.asarray(table.sum(axis=0)).ravel().astype(np.int64)
    ua, ca = np.unique(size_y, return_counts=True)
    ub, cb = np.unique(size_c, return_counts=True)
    emi = expected_mutual_information(ua.astype(np.int64), ca.astype(np.int64), ub.astype(np.int64),
                                      cb.astype(np.int64), int(n))

    def entropy(sizes: np.ndarray) -> float:
        p = sizes / n
        return float(-(p * np.log(p)).sum())

    normalizer = (entropy(size_y) + entropy(size_c)) / 2
    eps = np.finfo(np.float64).eps
    denominator = normalizer - emi
    denominator = min(denominator, -eps) if denominator < 0 else max(denominator, eps)
    # only the denominator is clamped, as in scikit-learn: where both are rounding noise (every
    # class a singleton, clustered perfectly) they are the same noise and the ratio is 1
    return float((mi - emi) / denominator)


def pair_f1(labels: Any, clusters: Any) -> float:
    """Pair-counting F1 of a clustering against the true labels (0 when no pair is positive)."""
    from sklearn.metrics.cluster import contingency_matrix

    table = contingency_matrix(np.asarray(labels), np.asarray(clusters), sparse=True)
    tp = _comb2(table.data)
    predicted = _comb2(np.asarray(table.sum(axis=0)).ravel())
    actual = _comb2(np.asarray(table.sum(axis=1)).ravel())
    if tp == 0 or predicted == 0 or actual == 0:
        return 0.0
    precision, recall = tp / predicted, tp / actual
    return 2 * precision * recall / (precision + recall)


@full_float32_matmuls
def cluster_metrics(
    embeddings: Any,
    labels: Any,
    metrics: tuple[str, ...] | list[str] = CLUSTERING_METRICS,
    *,
    restarts: int = 3,
    seed: int = 0,
    backend: str = "auto",
    spread: bool = False,
) -> dict[str, float]:
    """Mean of ``metrics`` (subset of nmi, ami, pair_f1) over ``restarts`` seeded k-means runs.

    ``embeddings`` should already be in the space the distance uses (e.g. L2-normalised for
    cosine). k = the number of distinct labels; run ``r`` uses seed ``seed + r``. With
    ``spread``, the result also holds ``<metric>_std``: the standard deviation over the
    restarts (``ddof = 1``; 0 for a single restart), how much the score depends on the seed.
    One class (k = 1) or every class a single sample (k = N) makes the clustering the labels'
    partition whatever the embeddings: every value is then NaN, with a warning.
    """
    from sklearn.metrics import normalized_mutual_info_score


    x = check_embeddings(embeddings, "embeddings").cpu().numpy()
    y, _ = check_labels(labels, x.shape[0], "labels")
    if isinstance(restarts, bool) or not isinstance(restarts, int | np.integer) or restarts < 1:
        # a bool is no count: True ran 1 restart (evaluate's k_values=[True] is refused)
        raise DataError(f"restarts must be an integer of at least 1, got {restarts!r}")
    check_seed(seed, "the k-means seed")
    if seed + restarts - 1 >= SEED_LIMIT:  # the error named seed + 1, which nobody passed
        raise ConfigError(f"the {restarts} k-means restarts use seeds {seed} ... {seed + restarts - 1}, "
                          f"beyond 2**32 - 1: pass a seed of at most {SEED_LIMIT - restarts}")
    if isinstance(metrics, str):  # "nmi" iterated as "n", "m", "i"
        metrics = (metrics,)
    metrics = tuple(dict.fromkeys(metrics))  # a repeated name scored each restart twice (its std)
    unknown = [m for m in metrics if m not in CLUSTERING_METRICS]
    if unknown:
        raise DataError(f"unknown clustering metric {unknown[0]!r}; choose from {CLUSTERING_METRICS}")
    n_clusters = int(np.unique(y).size)
    if n_clusters in (1, x.shape[0]):
        # k = 1 puts every sample in one cluster, k = N each in its own: the clustering is the
        # labels' partition whatever the embeddings, and NMI / AMI / F1 read 1 (0/0 by
        # convention for one class) - a number that says nothing about these embeddings
        what = "one class" if n_clusters == 1 else "every class a single sample"
        warnings.warn(
            f"{', '.join(metrics)}: {what} ({x.shape[0]} sample{'s' * (x.shape[0] != 1)}), so k-means with k = {n_clusters} "
            "reproduces the labels whatever the embeddings; reported as NaN (no number): cluster "
            "at least two classes with two or more samples in one of them", stacklevel=3)
        nan = {m: float("nan") for m in metrics}
        return {**nan, **({f"{m}_std": float("nan") for m in metrics} if spread else {})}
    scores: dict[str, list[float]] = {m: [] for m in metrics}
    for run in range(restarts):
        assign = kmeans_labels(x, n_clusters, seed + run, backend=backend)
        for m in metrics:
            if m == "nmi":
                scores[m].append(float(normalized_mutual_info_score(y, assign)))
            elif m == "ami":
                scores[m].append(adjusted_mutual_info(y, assign))
            else:
                scores[m].append(pair_f1(y, assign))
    out = {m: float(np.mean(v)) for m, v in scores.items()}
    if spread:
        for m, v in scores.items():
            out[f"{m}_std"] = float(np.std(v, ddof=1)) if len(v) > 1 else 0.0
    return out
