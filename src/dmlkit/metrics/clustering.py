"""Clustering metrics: NMI, AMI and pair-counting F1 of k-means clusters against the labels.

The embeddings are clustered by k-means with ``k`` = the number of classes (faiss k-means when
faiss is installed, else scikit-learn), as in the metric-learning literature (NMI: Schuetze et
al., "Introduction to Information Retrieval", 2008, used by Song et al., CVPR 2016). Because
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

from typing import Any

import numpy as np

from dmlkit.exceptions import DataError

__all__ = ["CLUSTERING_METRICS", "cluster_metrics", "kmeans_labels", "pair_f1"]

CLUSTERING_METRICS = ("nmi", "ami", "pair_f1")


def kmeans_labels(
    embeddings: np.ndarray, n_clusters: int, seed: int = 0, *, niter: int = 20, backend: str = "auto"
) -> np.ndarray:
    """Cluster assignments of k-means with ``n_clusters`` clusters for one seed.

    faiss (when installed and ``backend`` is ``"auto"`` or ``"faiss"``): best of 5 random
    initialisations by the k-means objective; scikit-learn: one k-means++ initialisation.
    """
    x = np.ascontiguousarray(embeddings, dtype=np.float32)
    if n_clusters < 1 or n_clusters > x.shape[0]:
        raise DataError(f"k-means needs 1 <= clusters <= samples, got {n_clusters} for {x.shape[0]} samples")
    use_faiss = backend == "faiss"
    if backend == "auto":
        try:
            import faiss

            use_faiss = True
        except ImportError:
            use_faiss = False
    if use_faiss:
        import faiss

        # faiss initialises at random points (no k-means++): keep the best of a few inits
        km = faiss.Kmeans(x.shape[1], n_clusters, niter=niter, seed=int(seed) + 1, verbose=False, nredo=5,
                          max_points_per_centroid=max(256, x.shape[0]), min_points_per_centroid=1)
        km.train(x)
        _, assign = km.index.search(x, 1)
        return assign[:, 0].astype(np.int64)
    from sklearn.cluster import KMeans

    km = KMeans(n_clusters=n_clusters, n_init=1, max_iter=max(niter, 1), random_state=int(seed))
    return km.fit_predict(x).astype(np.int64)


def _comb2(x: np.ndarray) -> float:
    x = x.astype(np.float64)
    return float((x * (x - 1) / 2).sum())


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


def cluster_metrics(
    embeddings: Any,
    labels: Any,
    metrics: tuple[str, ...] | list[str] = CLUSTERING_METRICS,
    *,
    restarts: int = 3,
    seed: int = 0,
    backend: str = "auto",
) -> dict[str, float]:
    """Mean of ``metrics`` (subset of nmi, ami, pair_f1) over ``restarts`` seeded k-means runs.

    ``embeddings`` should already be in the space the distance uses (e.g. L2-normalised for
    cosine). k = the number of distinct labels.
    """
    from sklearn.metrics import adjusted_mutual_info_score, normalized_mutual_info_score

    x = np.asarray(embeddings, dtype=np.float32)
    y = np.asarray(labels)
    if restarts < 1:
        raise DataError(f"restarts must be at least 1, got {restarts}")
    n_clusters = int(np.unique(y).size)
    scores: dict[str, list[float]] = {m: [] for m in metrics}
    for run in range(restarts):
        assign = kmeans_labels(x, n_clusters, seed + run, backend=backend)
        for m in metrics:
            if m == "nmi":
                scores[m].append(float(normalized_mutual_info_score(y, assign)))
            elif m == "ami":
                scores[m].append(float(adjusted_mutual_info_score(y, assign)))
            elif m == "pair_f1":
                scores[m].append(pair_f1(y, assign))
            else:
                raise DataError(f"unknown clustering metric {m!r}; choose from {CLUSTERING_METRICS}")
    return {m: float(np.mean(v)) for m, v in scores.items()}
