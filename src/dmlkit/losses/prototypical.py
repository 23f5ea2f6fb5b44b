"""Prototypical-network loss for few-shot episodes, and class-centre helpers.

Snell, Swersky, Zemel, "Prototypical Networks for Few-shot Learning", NeurIPS 2017
(arXiv:1703.05175). For an episode with support sets ``S_k`` and queries ``Q``::

    c_k = 1/|S_k| sum_{x in S_k} f(x)                          (class prototype)
    p(y = k | x) = exp(-d(f(x), c_k)) / sum_k' exp(-d(f(x), c_k'))
    J = mean_{(x, y) in Q} [ d(f(x), c_y) + log sum_k' exp(-d(f(x), c_k')) ]

with ``d`` the squared Euclidean distance (the paper's choice; any dmlkit distance works:
similarities are used as logits directly). Two entry points:

* :func:`prototypical_loss` / :class:`PrototypicalLoss` called with ``ref_emb``: explicit
  ``(support, support_labels, query, query_labels)``.
* :class:`PrototypicalLoss` on a plain batch: each class's first ``k_shot`` rows (in batch
  order) are its support, the rest its queries (as an episode sampler lays them out).

The class-centre helpers (:func:`class_means`, :func:`distance_to_centres`) are shared with the
coupled-clusters loss.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from dmlkit.distances import BaseDistance, CosineSimilarity, LpDistance, get_distance
from dmlkit.exceptions import ConfigError, DataError, ShapeError
from dmlkit.losses._pairs import safe_normalize, upcast_pair
from dmlkit.losses.base import BaseLoss, check_inputs, register_loss
from dmlkit.validation import check_integer

__all__ = [
    "PrototypicalLoss",
    "class_means",
    "distance_to_centres",
    "prototypical_loss",
    "rank_within_class",
]


def class_means(
    embeddings: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-class mean embeddings.

    Returns ``(classes (K,), centres (K, D), inverse (N,))`` where ``classes`` are the sorted
    distinct labels and ``inverse[i]`` is the row of ``centres`` for ``labels[i]``. Cost
    ``O(N D)`` (``index_add``), no ``N x K`` one-hot matrix.
    """
    classes, inverse, counts = torch.unique(labels, return_inverse=True, return_counts=True)
    sums = embeddings.new_zeros(len(classes), embeddings.shape[1]).index_add(0, inverse, embeddings)
    return classes, sums / counts.to(embeddings.dtype).unsqueeze(1), inverse


def distance_to_centres(
    distance: BaseDistance, x: torch.Tensor, centres: torch.Tensor, *, x_is_query: bool = True
) -> torch.Tensor:
    """``distance`` between rows of ``x`` and class ``centres`` without re-normalising centres.

    Centres are means of the (already normalised, when the distance normalises) embeddings;
    projecting them back onto the sphere would change the method, so the distance's formula is
    applied to ``x`` as it is and ``centres`` as they are. The exception is
    :class:`~dmlkit.distances.CosineSimilarity`, which by definition compares directions only.
    ``x_is_query=False`` puts the centres first (``d(c, x)``; matters for SNR only).
    """
    if isinstance(distance, CosineSimilarity) or not distance.normalize_embeddings:
        raw = distance
    else:
        raw = copy.copy(distance)
        raw.normalize_embeddings = False
    return raw(x, centres) if x_is_query else raw(centres, x)


def rank_within_class(labels: torch.Tensor) -> torch.Tensor:
    """``rank[i]`` = how many earlier rows share ``labels[i]`` (0 for a class's first row).

    Vectorised: stable sort, then position minus the start of each run of equal labels.
    """
    n = labels.shape[0]
    if n == 0:
        return labels.new_zeros(0)
    sorted_labels, order = torch.sort(labels, stable=True)
    _, counts = torch.unique_consecutive(sorted_labels, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    rank_sorted = torch.arange(n, device=labels.device) - torch.repeat_interleave(starts, counts)
    rank = torch.empty_like(rank_sorted)
    rank[order] = rank_sorted
    return rank


def _episode_loss(
    distance: BaseDistance,
    support: torch.Tensor,
    support_labels: torch.Tensor,
    query: torch.Tensor,
    query_labels: torch.Tensor,
) -> tuple[torch.Tensor, int]:
    """Mean cross-entropy of the queries over prototypes; returns (loss, number of prototypes)."""
    support, query = upcast_pair(support, query)  # one dtype, as in every loss
    if distance.normalize_embeddings:
        support, query = safe_normalize(support), safe_normalize(query)
    classes, prototypes, _ = class_means(support, support_labels)
    target = torch.searchsorted(classes, query_labels.contiguous())  # (a strided view warns)
    found = target < len(classes)
    found[found.clone()] = classes[target[found]] == query_labels[found]
    if not bool(found.all()):
        missing = torch.unique(query_labels[~found]).tolist()[:10]
        raise DataError(
            f"query labels {missing} have no support examples: every query class needs at "
            "least one support embedding (check the episode sampler's k_shot)"
        )
    logits = distance.closeness(distance_to_centres(distance, query, prototypes))
    return F.cross_entropy(logits, target), len(classes)


def prototypical_loss(
    support: torch.Tensor,
    support_labels: torch.Tensor,
    query: torch.Tensor,
    query_labels: torch.Tensor,
    distance: BaseDistance | str | None = None,
) -> torch.Tensor:
    """The prototypical-network episode loss (Snell et al. 2017), as a plain function.

    ``J = mean_q [ d(q, c_{y_q}) + log sum_k exp(-d(q, c_k)) ]`` with ``c_k`` the mean of the
    support embeddings of class ``k``; ``d`` defaults to the squared Euclidean distance on raw
    (unnormalised) embeddings, as in the paper. Every query label must appear in the support
    set (:class:`~dmlkit.exceptions.DataError` otherwise). Returns a scalar; an empty query set
    gives a zero connected to the graph.
    """
    dist = _resolve_distance(distance)
    check_inputs(support, support_labels, name="support")
    check_inputs(query, query_labels, name="query")
    if support.shape[1] != query.shape[1]:
        raise ShapeError(
            f"support {tuple(support.shape)} and query {tuple(query.shape)} need the same D"
        )
    if query.shape[0] == 0 or support.shape[0] == 0:
        return (support.sum() + query.sum()) * 0
    loss, _ = _episode_loss(dist, support, support_labels, query, query_labels)
    return loss


def _resolve_distance(distance: BaseDistance | str | None) -> BaseDistance:
    if distance is None:
        return LpDistance(power=2, normalize_embeddings=False)
    return get_distance(distance)


@register_loss("prototypical")
class PrototypicalLoss(BaseLoss):
    """Prototypical-network loss (Snell, Swersky, Zemel, NeurIPS 2017).

    ``J = mean_{queries q} -log softmax_k(-d(q, c_k))[y_q]``, ``c_k`` = mean support embedding
    of class ``k``, ``d`` = squared Euclidean distance by default (paper), raw embeddings.

    Args:
        k_shot: support examples per class when splitting a plain batch: each class's first
            ``k_shot`` rows (batch order) are support, the rest queries. ``None`` (default)
            uses ``max(1, n_c // 2)`` for a class with ``n_c`` rows. A class with no query rows
            still contributes its prototype (a distractor for the other queries).
        distance: any dmlkit distance; default ``LpDistance(power=2, normalize_embeddings=False)``.

    Call forms:
        ``loss(embeddings, labels)`` splits the batch into support/query per class;
        ``loss(query, query_labels, ref_emb=support, ref_labels=support_labels)`` uses the given
        support set (e.g. a cross-batch memory) and every batch row as a query.

    No miner indices (the episode defines the comparisons). A batch with no query, or with
    fewer than two prototypes (the softmax is then identically 1), returns a zero loss.
    """

    accepts_indices = False

    def __init__(
        self, k_shot: int | None = None, distance: BaseDistance | str | None = None
    ) -> None:
        super().__init__(distance)
        self.k_shot = None if k_shot is None else check_integer(k_shot, "k_shot", hint=" or None")

    @staticmethod
    def default_distance() -> BaseDistance:
        return LpDistance(power=2, normalize_embeddings=False)

    def split(self, labels: torch.Tensor) -> torch.Tensor:
        """Boolean mask of the support rows of a plain batch (the rest are queries)."""
        rank = rank_within_class(labels)
        _, inverse, counts = torch.unique(labels, return_inverse=True, return_counts=True)
        if self.k_shot is None:
            shots = (counts // 2).clamp_min(1)
        else:
            shots = counts.clamp_max(self.k_shot)
        return rank < shots[inverse]

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        if indices is not None:
            raise ConfigError(
                "the prototypical loss does not take miner indices: remove the miner from the config"
            )
        if ref_emb is not None:
            support, support_labels = ref_emb, ref_labels
            query, query_labels = embeddings, labels
        else:
            is_support = self.split(labels)
            support, support_labels = embeddings[is_support], labels[is_support]
            query, query_labels = embeddings[~is_support], labels[~is_support]
        if query.shape[0] == 0 or support.shape[0] == 0:
            return self.zero_loss(embeddings)
        if torch.unique(support_labels).numel() < 2:
            return self.zero_loss(embeddings)
        loss, _ = _episode_loss(self.distance, support, support_labels, query, query_labels)
        return loss
