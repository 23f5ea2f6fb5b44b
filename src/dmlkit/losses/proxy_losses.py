"""Proxy-based losses: ProxyNCA, ProxyAnchor and SoftTriple.

Each loss owns learnable proxies (``nn.Parameter`` of shape ``(num_classes, embedding_size)``,
or ``(num_classes * K, embedding_size)`` for SoftTriple's ``K`` centres per class), so
``loss.parameters()`` hands them to their own optimiser / learning rate. Memory is
``O(B x classes)``: no pairwise ``B x B`` matrix is formed. Every exponential goes through
log-sum-exp (``cross_entropy`` / ``logsumexp``), so large scales (``alpha = 32``,
``lambda = 20``) never overflow. bfloat16/float16 inputs are computed in float32 with
autocast disabled (see :mod:`dmlkit.losses.classification_losses`); the loss is float32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dmlkit.distances import BaseDistance, LpDistance
from dmlkit.exceptions import ConfigError
from dmlkit.losses._pairs import masked_logsumexp, pair_matrix, safe_normalize
from dmlkit.losses.base import ProxyLoss, register_loss
from dmlkit.losses.classification_losses import (
    _check_positive,
    compute_dtype,
    cosine_to_rows,
    full_precision,
    reject_pairs_and_refs,
)
from dmlkit.validation import check_integer

__all__ = ["ProxyAnchorLoss", "ProxyNCALoss", "SoftTripleLoss"]


@register_loss("proxy_nca")
class ProxyNCALoss(ProxyLoss):
    """ProxyNCA: NCA with one learned proxy per class.

    ``L = -1/N sum_i log( exp(-s d(x_i, p_{y_i})) / sum_{j in Z} exp(-s d(x_i, p_j)) )``

    with ``d`` the squared Euclidean distance between L2-normalised embeddings and proxies
    (for a similarity the logit is ``+s sim``). ``Z`` is every class (a softmax over the
    proxies, as in the common implementations and Proxy-NCA++), or every class but ``y_i``
    with ``exclude_positive=True`` (the NCA ratio of the paper, which is unbounded below).
    Movshovitz-Attias, Toshev, Leung, Ioffe, Singh, "No Fuss Distance Metric Learning using
    Proxies", ICCV 2017. Proxies are initialised from ``N(0, 1) / 8`` as in the reference
    implementation of Kim et al. (Proxy-Anchor repository).

    With the defaults this equals pytorch-metric-learning ``ProxyNCALoss(num_classes,
    embedding_size, softmax_scale=s)`` (its default distance is ``LpDistance(power=2)``) with
    ``proxies_pml = proxies``.

    Args:
        scale: ``s`` (default 1).
        distance: any :class:`dmlkit.distances.BaseDistance` or name (default squared
            Euclidean on normalised vectors).
        exclude_positive: leave the true proxy out of the denominator (paper's ratio).
    """

    def __init__(
        self,
        num_classes: int,
        embedding_size: int,
        scale: float = 1.0,
        distance: BaseDistance | str | None = None,
        exclude_positive: bool = False,
    ) -> None:
        super().__init__(num_classes, embedding_size, distance)
        _check_positive(scale=scale)
        if exclude_positive and num_classes < 2:
            raise ConfigError("exclude_positive=True needs at least 2 classes")
        self.scale = float(scale)
        self.exclude_positive = bool(exclude_positive)
        self.proxies = nn.Parameter(torch.randn(num_classes, embedding_size) / 8)

    @staticmethod
    def default_distance() -> BaseDistance:
        return LpDistance(power=2)

    def get_logits(self, embeddings: torch.Tensor) -> torch.Tensor:
        """``(B, C)`` logits ``s * closeness(x_i, p_j)``."""
        dtype = compute_dtype(embeddings, self.proxies)
        with full_precision(embeddings):
            values = pair_matrix(self.distance, embeddings.to(dtype), self.proxies.to(dtype))
            return self.scale * self.distance.closeness(values)

    def _uses_unit_squared_euclidean(self) -> bool:
        d = self.distance
        return isinstance(d, LpDistance) and d.p == 2 and d.power == 2 and d.normalize_embeddings

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        reject_pairs_and_refs(self, indices, ref_emb)
        labels = labels.long()
        if embeddings.shape[0] == 0:
            return self.zero_loss(embeddings)
        if self._uses_unit_squared_euclidean():
            # |x - p|^2 = 2 - 2 cos(x, p) for unit vectors, and a softmax (or the NCA ratio)
            # is unchanged by the constant -2s: same loss and gradient, fewer (B, C) passes.
            dtype = compute_dtype(embeddings, self.proxies)
            with full_precision(embeddings):
                logits = cosine_to_rows(embeddings.to(dtype), self.proxies.to(dtype))
                logits = logits * (2.0 * self.scale)
        else:
            logits = self.get_logits(embeddings)
        with full_precision(embeddings):
            if not self.exclude_positive:
                return F.cross_entropy(logits, labels)
            positive = logits.gather(1, labels[:, None]).squeeze(1)
            others = logits.scatter(1, labels[:, None], float("-inf"))
            return (torch.logsumexp(others, dim=1) - positive).mean()


@register_loss("proxy_anchor")
class ProxyAnchorLoss(ProxyLoss):
    """Proxy Anchor: each proxy is an anchor weighing all batch samples against it.

    ``L = 1/|P+| sum_{p in P+} log(1 + sum_{x in X_p+} e^{-alpha (s(x, p) - delta)})
       + 1/|P|  sum_{p in P}  log(1 + sum_{x in X_p-} e^{ alpha (s(x, p) + delta)})``

    ``P`` are all proxies, ``P+`` those with a positive sample in the batch, ``X_p+`` / ``X_p-``
    the batch samples of / not of the proxy's class, ``s`` the cosine similarity.
    Kim, Kim, Cho, Kwak, "Proxy Anchor Loss for Deep Metric Learning", CVPR 2020. Paper
    defaults ``alpha = 32``, ``delta = 0.1``; proxies initialised with
    ``kaiming_normal_(mode="fan_out")`` as in the paper's code.

    Equals pytorch-metric-learning ``ProxyAnchorLoss(num_classes, embedding_size, margin=delta,
    alpha=alpha)`` with ``proxies_pml = proxies``.

    Args:
        margin: ``delta``.
        alpha: the scale.
        distance: a similarity (``cosine`` default, or ``dot``); the method is defined on
            similarities.
    """

    def __init__(
        self,
        num_classes: int,
        embedding_size: int,
        margin: float = 0.1,
        alpha: float = 32.0,
        distance: BaseDistance | str | None = None,
    ) -> None:
        super().__init__(num_classes, embedding_size, distance)
        _check_positive(alpha=alpha)
        if not self.distance.higher_is_closer:
            raise ConfigError(
                "ProxyAnchorLoss is defined on a similarity: use distance 'cosine' or 'dot'"
            )
        self.margin = float(margin)
        self.alpha = float(alpha)
        self.proxies = nn.Parameter(torch.empty(num_classes, embedding_size))
        nn.init.kaiming_normal_(self.proxies, mode="fan_out")

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        reject_pairs_and_refs(self, indices, ref_emb)
        labels = labels.long()
        if embeddings.shape[0] == 0:
            return self.zero_loss(embeddings)
        dtype = compute_dtype(embeddings, self.proxies)
        with full_precision(embeddings):
            sim = pair_matrix(self.distance, embeddings.to(dtype), self.proxies.to(dtype))
            pos_mask = labels.unsqueeze(1) == torch.arange(self.num_classes, device=labels.device)
            pos_term = masked_logsumexp(-self.alpha * (sim - self.margin), pos_mask, dim=0, add_one=True)
            neg_term = masked_logsumexp(self.alpha * (sim + self.margin), ~pos_mask, dim=0, add_one=True)
            num_with_pos = pos_mask.any(0).sum()
            # pos_term is exactly 0 for proxies without positives, so the plain sum is right.
            return pos_term.sum() / num_with_pos + neg_term.sum() / self.num_classes


@register_loss("soft_triple")
class SoftTripleLoss(ProxyLoss):
    """SoftTriple: a softmax over classes, each represented by ``K`` centres.

    ``S_{i,c} = sum_k softmax_k(<x_i, w_c^k> / gamma) <x_i, w_c^k>`` (normalised vectors),
    ``L = -1/N sum_i log( e^{lambda (S_{i,y_i} - delta)} / (e^{lambda (S_{i,y_i} - delta)} + sum_{j != y_i} e^{lambda S_{i,j}}) )
       + tau R``, with the centre-merging regulariser
    ``R = sum_c sum_{k < l} sqrt(2 + 1e-5 - 2 <w_c^k, w_c^l>) / (C K (K - 1))``.

    Qian, Shang, Sun, Hu, Li, Jin, "SoftTriple Loss: Deep Metric Learning Without Triplet
    Sampling", ICCV 2019. Paper defaults ``K = 10``, ``lambda = 20``, ``gamma = 0.1``,
    ``tau = 0.2``, ``delta = 0.01``; centres initialised as in the paper's code
    (``kaiming_uniform_(a=sqrt(5))`` on the ``(D, C K)`` matrix). The regulariser is computed
    per class (``C x K x K``), not on the full ``CK x CK`` Gram matrix.

    With ``tau = 0`` this equals pytorch-metric-learning ``SoftTripleLoss(num_classes,
    embedding_size, centers_per_class=K, la=lambda, gamma=gamma, margin=delta)`` with
    ``fc_pml = centers.T`` (pml has no centre regulariser).
    """

    def __init__(
        self,
        num_classes: int,
        embedding_size: int,
        centers_per_class: int = 10,
        la: float = 20.0,
        gamma: float = 0.1,
        tau: float = 0.2,
        margin: float = 0.01,
    ) -> None:
        super().__init__(num_classes, embedding_size)
        centers_per_class = check_integer(centers_per_class, "centers_per_class")
        _check_positive(la=la, gamma=gamma)
        if tau < 0:
            raise ConfigError(f"tau must be >= 0, got {tau}")
        self.centers_per_class = int(centers_per_class)
        self.la, self.gamma, self.tau, self.margin = (
            float(la),
            float(gamma),
            float(tau),
            float(margin),
        )
        fc = torch.empty(embedding_size, num_classes * self.centers_per_class)
        nn.init.kaiming_uniform_(fc, a=math.sqrt(5))
        self.centers = nn.Parameter(fc.T.contiguous())  # row c * K + k is centre k of class c

    def class_similarity(self, embeddings: torch.Tensor) -> torch.Tensor:
        """``(B, C)`` soft class similarities ``S_{i,c}``."""
        dtype = compute_dtype(embeddings, self.centers)
        with full_precision(embeddings):
            sim = cosine_to_rows(embeddings.to(dtype), self.centers.to(dtype))
            sim = sim.view(-1, self.num_classes, self.centers_per_class)
            # softmax over the K centres of each class; taken over dim 1 of the transposed view
            # because torch's CPU softmax over a short innermost dimension is 4-8x slower
            weights = F.softmax(sim.transpose(1, 2) / self.gamma, dim=1).transpose(1, 2)
            return (weights * sim).sum(2)

    get_logits = class_similarity

    def regularizer(self) -> torch.Tensor:
        """``R``: mean distance between the centres of the same class (0 when ``K = 1``)."""
        k = self.centers_per_class
        centers = safe_normalize(self.centers.to(compute_dtype(self.centers)), dim=1)
        if k == 1:
            return centers.sum() * 0
        centers = centers.view(self.num_classes, k, -1)
        gram = centers @ centers.transpose(1, 2)  # (C, K, K)
        upper = torch.triu_indices(k, k, offset=1, device=gram.device)
        pair_sims = gram[:, upper[0], upper[1]]
        return torch.sqrt(2.0 + 1e-5 - 2.0 * pair_sims).sum() / (self.num_classes * k * (k - 1))

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        reject_pairs_and_refs(self, indices, ref_emb)
        labels = labels.long()
        if embeddings.shape[0] == 0:
            return self.zero_loss(embeddings)
        sim = self.class_similarity(embeddings)
        with full_precision(embeddings):
            margin = torch.zeros_like(sim).scatter(1, labels[:, None], self.margin)
            loss = F.cross_entropy(self.la * (sim - margin), labels)
            if self.tau > 0 and self.centers_per_class > 1:
                loss = loss + self.tau * self.regularizer().to(loss.dtype)
        return loss
