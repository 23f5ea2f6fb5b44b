"""Exact, memory-bounded evaluation of embeddings.

* Retrieval (:mod:`~dmlkit.metrics.retrieval`): ``precision_at_1``, ``recall_at_{K}``,
  ``precision_at_{K}``, ``r_precision``, ``map_at_r`` (Musgrave et al., ECCV 2020) and
  full-ranking ``map``, from an exact blockwise kNN (:func:`knn`).
* Clustering (:mod:`~dmlkit.metrics.clustering`): ``nmi``, ``ami``, ``pair_f1`` of k-means
  with k = number of classes, averaged over seeded restarts.
* Histograms (:mod:`~dmlkit.metrics.histograms`): positive/negative pair similarity
  histograms and their Jensen-Shannon divergence ``pos_neg_js`` (Oi et al.).

:func:`evaluate` computes any of them in one call; :func:`per_class` and :func:`per_query`
break retrieval metrics down; :func:`evaluate_streaming` (:mod:`~dmlkit.metrics.streaming`)
computes the same retrieval metrics from sources larger than memory (memory-mapped shards), and
``across_ranks=True`` splits them by query over the ranks of a ``torchrun`` job.
"""

from dmlkit.metrics.clustering import CLUSTERING_METRICS, cluster_metrics, kmeans_labels, pair_f1
from dmlkit.metrics.evaluate import (
    DEFAULT_METRICS,
    METRIC_NAMES,
    evaluate,
    per_class,
    per_query,
)
from dmlkit.metrics.histograms import PosNegHistograms, js_divergence, pos_neg_histograms
from dmlkit.metrics.knn import KNNResult, exact_topk, faiss_available, knn
from dmlkit.metrics.roc import RocCurve, fpr95, fpr_at_tpr, roc_auc, roc_curve
from dmlkit.metrics.streaming import evaluate_streaming, per_query_streaming

__all__ = [
    "CLUSTERING_METRICS",
    "DEFAULT_METRICS",
    "KNNResult",
    "METRIC_NAMES",
    "PosNegHistograms",
    "cluster_metrics",
    "evaluate",
    "evaluate_streaming",
    "exact_topk",
    "faiss_available",
    "js_divergence",
    "kmeans_labels",
    "knn",
    "pair_f1",
    "per_class",
    "per_query",
    "per_query_streaming",
    "pos_neg_histograms",
    # ROC of pair scores (metrics/roc.py)
    "RocCurve",
    "fpr95",
    "fpr_at_tpr",
    "roc_auc",
    "roc_curve",
]
