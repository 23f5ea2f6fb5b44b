"""Pair-weighting and softmax-over-pairs losses: multi-similarity, NT-Xent, supervised
contrastive, SNR contrastive, NCA, distance-based logistic, ranked list and coupled clusters.

NCA lives in :mod:`dmlkit.losses.nca` and is re-exported here (``NCALoss`` imports from this
module as before).

(This module was ``dmlkit.losses.ranking_losses``; that path still works, with a
``DeprecationWarning``.)

All of them work on the ``(B, R)`` matrix between the batch (rows, the anchors) and the
reference set (columns: ``ref_emb`` when given, otherwise the batch itself with the diagonal
excluded) and on two boolean ``(B, R)`` masks of positive and negative pairs:

* without ``indices``: positives = same label (not the pair ``(i, i)``), negatives = other label;
* with a miner's pairs ``(a1, p, a2, n)``: positives ``[a1, p]``, negatives ``[a2, n]``;
* with triplets ``(a, p, n)``: positives ``[a, p]``, negatives ``[a, n]`` (duplicates collapse).

Everything is ``O(B R)`` memory (no ``B x B x B`` tensor, no ``positive pairs x negative pairs``
mask), vectorised, and uses the shared masked log-sum-exp
(:func:`dmlkit.losses._pairs.masked_logsumexp`), so large scales give no NaN/inf. Half-precision
inputs are upcast to float32 before the distance matrix; the loss is returned in float32.

Without ``indices``, multi-similarity, SupCon and NCA take a faster path that needs no
``B x R`` boolean mask for the sparse positive set: per-class sums are formed with
``index_add`` into ``(B, classes)`` or the positives are gathered into a ``(B, max class size)``
block (same values, tested against the mask form and the loop references).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dmlkit.distances import BaseDistance, LpDistance, SNRDistance
from dmlkit.exceptions import ConfigError
from dmlkit.losses._pairs import (
    anchor_positives,
    class_columns,
    masked_logsumexp,
    pair_masks,
    pair_matrix,
    safe_normalize,
    upcast,
)
from dmlkit.losses.base import BaseLoss, register_loss
from dmlkit.losses.nca import NCALoss
from dmlkit.losses.prototypical import class_means, distance_to_centres

__all__ = [
    "CoupledClustersLoss",
    "DistanceLogisticLoss",
    "MultiSimilarityLoss",
    "NCALoss",
    "NTXentLoss",
    "SNRContrastiveLoss",
    "SupConLoss",
]


# -- shared helpers ---------------------------------------------------------------------------
class _PairMatrixLoss(BaseLoss):
    """Shared setup: distance matrix in the working dtype and the pos/neg masks."""

    accepts_indices = True

    def _setup(self, embeddings, labels, indices, ref_emb, ref_labels):
        """``(mat, pos, neg)``; ``mat`` is None when there is no pair at all (skip the distance)."""
        pos, neg = pair_masks(labels, indices, ref_labels)
        if indices is None:  # every (i, j) is a pair, except (i, i) within the batch
            num_ref = labels.shape[0] if ref_labels is None else ref_labels.shape[0]
            empty = labels.shape[0] * (num_ref - int(ref_labels is None)) <= 0
        else:
            empty = all(t.numel() == 0 for t in indices)
        if empty:
            return None, pos, neg
        return self._matrix(embeddings, ref_emb), pos, neg

    def _matrix(self, embeddings, ref_emb):
        return pair_matrix(self.distance, embeddings, ref_emb)


# -- multi-similarity ---------------------------------------------------------------------------
@register_loss("multi_similarity")
class MultiSimilarityLoss(_PairMatrixLoss):
    """Multi-similarity loss (Wang, Han, Huang, Dong, Scott, "Multi-Similarity Loss with General
    Pair Weighting for Deep Metric Learning", CVPR 2019), eq. 6::

        L = 1/B sum_i [ 1/alpha log(1 + sum_{p in P_i} exp(-alpha (S_ip - lambda)))
                      + 1/beta  log(1 + sum_{n in N_i} exp( beta  (S_in - lambda))) ]

    ``S`` is cosine similarity by default; with a distance ``d`` the signs flip
    (``exp(alpha (d_ip - lambda))``, ``exp(-beta (d_in - lambda))``). Averaged over all ``B``
    anchors (the paper's code divides by the batch size). The paper's pair mining is a separate
    miner (``multi_similarity`` in :mod:`dmlkit.miners`); pass its indices.
    Equivalent to ``pytorch_metric_learning.losses.MultiSimilarityLoss(alpha, beta, base)``.

    Args:
        alpha: positive-pair scale (paper 2).
        beta: negative-pair scale (paper 50).
        base: the similarity threshold lambda (paper 0.5).
    """

    def __init__(
        self,
        alpha: float = 2.0,
        beta: float = 50.0,
        base: float = 0.5,
        distance: BaseDistance | str | None = None,
    ) -> None:
        super().__init__(distance)
        if alpha <= 0 or beta <= 0:
            raise ConfigError(f"alpha and beta must be positive, got {alpha}, {beta}")
        self.alpha, self.beta, self.base = float(alpha), float(beta), float(base)

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        if indices is None:
            return self._compute_labels(embeddings, labels, ref_emb, ref_labels)
        mat, pos, neg = self._setup(embeddings, labels, indices, ref_emb, ref_labels)
        if mat is None:
            return self.zero_loss(embeddings)
        pos_exp = -self.alpha * self.distance.margin(mat, self.base)
        neg_exp = -self.beta * self.distance.margin(self.base, mat)
        pos_lse = masked_logsumexp(pos_exp, pos, add_one=True)
        neg_lse = masked_logsumexp(neg_exp, neg, add_one=True)
        return (pos_lse / self.alpha + neg_lse / self.beta).mean()

    def _compute_labels(self, embeddings, labels, ref_emb, ref_labels):
        """All pairs from labels: the (few) positives of each row are gathered into a
        ``(B, max class size)`` block, the negatives are the row with its class masked out."""
        same_set = ref_labels is None
        ref_labels = labels if same_set else ref_labels
        b, r = labels.shape[0], ref_labels.shape[0]
        if b * (r - int(same_set)) <= 0:
            return self.zero_loss(embeddings)
        mat = pair_matrix(self.distance, embeddings, ref_emb)
        cols, valid, cls_q, cls_r, counts = class_columns(labels, ref_labels, same_set)
        pos_vals = mat.gather(1, cols)
        pos_lse = masked_logsumexp(-self.alpha * self.distance.margin(pos_vals, self.base), valid, add_one=True)
        same = cls_q.unsqueeze(1) == cls_r.unsqueeze(0)  # includes (i, i)
        has_neg = counts[cls_q] < r
        if not bool(has_neg.all()):  # keep rows without negatives finite (they are zeroed below)
            same &= has_neg.unsqueeze(1)
        neg_exp = (-self.beta * self.distance.margin(self.base, mat)).masked_fill(same, float("-inf"))
        # log(1 + sum exp) = softplus(logsumexp)
        neg_lse = torch.where(has_neg, F.softplus(torch.logsumexp(neg_exp, 1)), 0.0)
        return (pos_lse / self.alpha + neg_lse / self.beta).mean()


# -- NT-Xent and supervised contrastive ----------------------------------------------------------
class _TemperatureLoss(_PairMatrixLoss):
    def __init__(self, temperature: float = 0.1, distance: BaseDistance | str | None = None) -> None:
        super().__init__(distance)
        if temperature <= 0:
            raise ConfigError(f"temperature must be positive, got {temperature}")
        self.temperature = float(temperature)

    def _logits(self, mat: torch.Tensor) -> torch.Tensor:
        return self.distance.closeness(mat) / self.temperature


@register_loss("ntxent")
class NTXentLoss(_TemperatureLoss):
    """NT-Xent / InfoNCE over labelled pairs (Chen, Kornblith, Norouzi, Hinton, "A Simple
    Framework for Contrastive Learning of Visual Representations", ICML 2020; supervised form
    as in pytorch-metric-learning). For every positive pair ``(a, p)``::

        l_ap = -log( exp(s_ap / tau) / (exp(s_ap / tau) + sum_{n in N_a} exp(s_an / tau)) )
             = softplus( logsumexp_{n in N_a}(s_an / tau) - s_ap / tau )
        L = mean over positive pairs of l_ap

    ``s`` is cosine similarity by default (a distance is negated). The denominator holds the
    positive itself and the anchor's negatives only (not its other positives). Computed as one
    masked log-sum-exp per anchor row, ``O(B R)`` memory: no ``positives x negatives`` mask.
    Equivalent to ``pytorch_metric_learning.losses.NTXentLoss(temperature)``.

    Args:
        temperature: tau (SimCLR's best setting 0.1; pml's default is 0.07).
    """

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        mat, pos, neg = self._setup(embeddings, labels, indices, ref_emb, ref_labels)
        num_pos = pos.sum()
        if int(num_pos) == 0:
            return self.zero_loss(embeddings)
        logits = self._logits(mat)
        neg_lse = masked_logsumexp(logits, neg)
        rows, cols = pos.nonzero(as_tuple=True)  # only the P positive pairs, not B x R
        has_neg = neg.any(1)[rows]
        per_pair = F.softplus(neg_lse[rows] - logits[rows, cols])
        return torch.where(has_neg, per_pair, torch.zeros_like(per_pair)).sum() / num_pos


@register_loss("supcon")
class SupConLoss(_TemperatureLoss):
    """Supervised contrastive loss, the "L_out" form (Khosla et al., "Supervised Contrastive
    Learning", NeurIPS 2020, eq. 2)::

        L_i = -1/|P(i)| sum_{p in P(i)} log( exp(s_ip / tau) / sum_{a in A(i)} exp(s_ia / tau) )
        L   = mean over anchors i with |P(i)| > 0

    ``A(i)`` = every reference except ``i`` itself (positives and negatives, or the mined ones),
    ``P(i)`` = its positives; ``s`` is cosine similarity by default. Matches
    ``pytorch_metric_learning.losses.SupConLoss(temperature)`` (whose reducer additionally drops
    anchors whose loss is exactly 0).

    Args:
        temperature: tau (paper 0.1).
    """

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        if indices is None:
            return self._compute_labels(embeddings, labels, ref_emb, ref_labels)
        mat, pos, neg = self._setup(embeddings, labels, indices, ref_emb, ref_labels)
        num_pos = pos.sum(1)
        has_pos = num_pos > 0
        if not bool(has_pos.any()):
            return self.zero_loss(embeddings)
        logits = self._logits(mat)
        lse_all = masked_logsumexp(logits, pos | neg)
        npos = num_pos.to(logits.dtype)
        # sum_p log_prob_ip = sum_p s_ip / tau - |P(i)| lse_all(i)
        sum_pos = torch.where(pos, logits, 0.0).sum(1) - npos * lse_all
        return (-sum_pos[has_pos] / npos[has_pos]).mean()

    def _compute_labels(self, embeddings, labels, ref_emb, ref_labels):
        """All pairs from labels without a ``B x R`` mask: ``A(i)`` is the whole row (minus the
        diagonal), and the positives' logits are summed per class with ``index_add``."""
        same_set, num_classes, cls_q, cls_r, num_pos = anchor_positives(labels, ref_labels)
        has_pos = num_pos > 0
        if not bool(has_pos.any()):
            return self.zero_loss(embeddings)
        logits = self._logits(pair_matrix(self.distance, embeddings, ref_emb))
        if same_set:
            off_diag = logits.clone()
            off_diag.fill_diagonal_(float("-inf"))
            lse_all = torch.logsumexp(off_diag, 1)
            no_self = logits.clone()
            no_self.fill_diagonal_(0.0)
        else:
            lse_all, no_self = torch.logsumexp(logits, 1), logits
        per_class = logits.new_zeros(logits.shape[0], num_classes).index_add(1, cls_r, no_self)
        npos = num_pos.to(logits.dtype)
        sum_pos = per_class.gather(1, cls_q.unsqueeze(1)).squeeze(1) - npos * lse_all
        return (-sum_pos[has_pos] / npos[has_pos]).mean()


# -- SNR contrastive ------------------------------------------------------------------------------
def _nonzero_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over the strictly positive entries of ``x`` (0, with gradient, if there are none)."""
    count = (x > 0).sum()
    return x.sum() / count.clamp_min(1).to(x.dtype)


def snr_matrix(
    distance: SNRDistance, embeddings: torch.Tensor, ref_emb: torch.Tensor | None = None
) -> torch.Tensor:
    """``(B, R)`` SNR distances ``Var(r_j - x_i) / Var(x_i)`` at any float32 scale.

    The SNR distance is invariant to one common scale of the batch and the reference set, so
    both are divided by a detached power of two at or above their largest absolute entry
    (exact; value and gradient unchanged) before ``distance`` is applied: ``1e-20`` or ``1e19``
    embeddings give the same loss as unit-sized ones instead of an underflow/overflow error.
    An anchor with zero variance (e.g. a collapsed, all-zero batch) has no defined SNR and
    raises :class:`~dmlkit.exceptions.NonFiniteError` (from the distance), never NaN.
    """
    x = upcast(embeddings)
    ref = None if ref_emb is None else upcast(ref_emb)
    peak = x.detach().abs().max() if x.numel() else x.new_zeros(())
    if ref is not None and ref.numel():
        peak = torch.maximum(peak, ref.detach().abs().max())
    _, exponent = torch.frexp(torch.where(peak > 0, peak, torch.ones_like(peak)))
    scale = torch.ldexp(torch.ones_like(peak), exponent.to(peak.dtype))
    return distance(x / scale, None if ref is None else ref / scale)


@register_loss("snr_contrastive")
class SNRContrastiveLoss(_PairMatrixLoss):
    """Contrastive loss on the signal-to-noise-ratio distance, with its zero-mean regulariser
    (Yuan, Deng, Tang, Tang, Chen, "Signal-To-Noise Ratio: A Robust Distance Metric for Deep
    Metric Learning", CVPR 2019)::

        d_ij = Var(h_j - h_i) / Var(h_i)                           (SNR distance)
        L = mean_{pos}^{>0} [d_ij - m_pos]_+ + mean_{neg}^{>0} [m_neg - d_ij]_+
            + lambda * 1/B sum_i |sum_k h_ik|                      (zero-mean regulariser)

    ``mean^{>0}`` averages over the pairs with a non-zero loss (``reduction="nonzero"``, the
    Reality Check / pytorch-metric-learning convention) or over all pairs (``"mean"``).
    The regulariser keeps the features zero-mean, as the SNR derivation assumes.
    Equivalent to ``pml.losses.SignalToNoiseRatioContrastiveLoss(pos_margin, neg_margin,
    distance=SNRDistance(normalize_embeddings=...), embedding_regularizer=ZeroMeanRegularizer(),
    embedding_reg_weight=lambda)``. Note pml's ``SNRDistance`` normalises by default, dmlkit's not.
    The matrix comes from :func:`snr_matrix`: scale-invariant over the float32 range; a
    collapsed (zero-variance) anchor raises NonFiniteError where pml returns NaN.

    Args:
        pos_margin: ``m_pos`` (0).
        neg_margin: ``m_neg`` (1).
        regularizer_weight: ``lambda`` of the zero-mean regulariser (default 0.001; 0 disables).
        reduction: ``"nonzero"`` or ``"mean"``.
        distance: must be an :class:`~dmlkit.distances.SNRDistance` (default un-normalised).
    """

    def __init__(
        self,
        pos_margin: float = 0.0,
        neg_margin: float = 1.0,
        regularizer_weight: float = 0.001,
        reduction: str = "nonzero",
        distance: BaseDistance | str | None = None,
    ) -> None:
        super().__init__(distance)
        if not isinstance(self.distance, SNRDistance):
            raise ConfigError(
                f"snr_contrastive needs the SNR distance, got {self.distance!r}; use "
                "distance='snr' (or the 'contrastive' loss for other distances)"
            )
        if reduction not in ("nonzero", "mean"):
            raise ConfigError(f"reduction must be 'nonzero' or 'mean', got {reduction!r}")
        if regularizer_weight < 0:
            raise ConfigError(f"regularizer_weight must be >= 0, got {regularizer_weight}")
        self.pos_margin, self.neg_margin = float(pos_margin), float(neg_margin)
        self.regularizer_weight = float(regularizer_weight)
        self.reduction = reduction

    @staticmethod
    def default_distance() -> BaseDistance:
        return SNRDistance()

    def _matrix(self, embeddings, ref_emb):
        return snr_matrix(self.distance, embeddings, ref_emb)

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        # the regulariser needs no pair: a batch (or a miner's output) without any keeps it
        reg = (self.regularizer_weight * upcast(embeddings).sum(1).abs().mean()
               if self.regularizer_weight > 0 and embeddings.shape[0] else None)
        mat, pos, neg = self._setup(embeddings, labels, indices, ref_emb, ref_labels)
        if mat is None:
            zero = self.zero_loss(embeddings)
            return zero if reg is None else zero + reg
        pos_loss = F.relu(-self.distance.margin(mat[pos], self.pos_margin))
        neg_loss = F.relu(-self.distance.margin(self.neg_margin, mat[neg]))
        if self.reduction == "nonzero":
            loss = _nonzero_mean(pos_loss) + _nonzero_mean(neg_loss)
        else:
            zero = mat.sum() * 0
            loss = (pos_loss.mean() if pos_loss.numel() else zero) + (
                neg_loss.mean() if neg_loss.numel() else zero
            )
        return loss if reg is None else loss + reg


# -- distance-based logistic ----------------------------------------------------------------------
@register_loss("distance_logistic")
class DistanceLogisticLoss(_PairMatrixLoss):
    """Distance-based logistic loss (Vo, Hays, "Localizing and Orienting Street Views Using
    Overhead Imagery", ECCV 2016; seed 003)::

        p(x1, x2) = (1 + exp(-m)) / (1 + exp(D - m))          (probability of "same")
        L = -[ y_same log p + (1 - y_same) log(1 - p) ]        (binary cross-entropy)

    in log space: ``log p = softplus(-m) - softplus(D - m)`` and
    ``log(1 - p) = -m + log(expm1(D)) - softplus(D - m)``. ``D`` is the Euclidean distance by
    default; in ``log(1 - p)`` ``D`` is clamped below at ``min_distance`` (in every term, so
    a negative pair closer than that gets the loss of one at ``min_distance``, with zero
    gradient) so a negative pair at distance 0 gives a large finite loss rather than ``inf``. Averaged over all pairs (``"mean"``) or as the mean
    of the positive-pair and negative-pair means (``"balanced"``).

    Args:
        margin: ``m``, the distance at which the logistic is centred (1.0 here: the midpoint of
            the ``[0, 2]`` range of distances between unit vectors).
        reduction: ``"mean"`` or ``"balanced"``.
        min_distance: lower clamp of ``D`` in ``log(1 - p)`` (1e-6).
        distance: a distance (smaller is closer) such as Euclidean or SNR; not a similarity.
    """

    def __init__(
        self,
        margin: float = 1.0,
        reduction: str = "mean",
        min_distance: float = 1e-6,
        distance: BaseDistance | str | None = None,
    ) -> None:
        super().__init__(distance)
        if self.distance.higher_is_closer:
            raise ConfigError(
                "distance_logistic needs a distance (smaller is closer), e.g. 'euclidean'; "
                f"got the similarity {self.distance!r}"
            )
        if reduction not in ("mean", "balanced"):
            raise ConfigError(f"reduction must be 'mean' or 'balanced', got {reduction!r}")
        if min_distance <= 0:
            raise ConfigError(f"min_distance must be positive, got {min_distance}")
        self.margin, self.reduction, self.min_distance = float(margin), reduction, float(min_distance)

    @staticmethod
    def default_distance() -> BaseDistance:
        return LpDistance()

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        mat, pos, neg = self._setup(embeddings, labels, indices, ref_emb, ref_labels)
        if mat is None:
            return self.zero_loss(embeddings)
        m = self.margin
        sp_m = math.log1p(math.exp(-m)) if m > -30 else -m  # softplus(-m)
        # -log p on the whole matrix, -log(1 - p) = m - log(expm1(D)) + softplus(D - m) with
        # log(expm1(D)) = D + log(-expm1(-D)); selected per entry, masked entries get 0.
        # -log(1 - p) uses the clamped D in all three terms: it is -log(1 - p(max(D, min_d))),
        # flat (zero gradient) below the clamp and never negative
        d_c = mat.clamp_min(self.min_distance)
        neg_loss = F.softplus(d_c - m) + (m - d_c) - torch.log(-torch.expm1(-d_c))
        per_pair = torch.where(pos, F.softplus(mat - m) - sp_m, neg_loss)
        num_pos, num_neg = pos.sum(), neg.sum()
        if self.reduction == "mean":
            return torch.where(pos | neg, per_pair, 0.0).sum() / (num_pos + num_neg)
        parts = []
        if int(num_pos):
            parts.append(torch.where(pos, per_pair, 0.0).sum() / num_pos)
        if int(num_neg):
            parts.append(torch.where(neg, per_pair, 0.0).sum() / num_neg)
        return torch.stack(parts).mean()


def _normalized(distance: BaseDistance, x: torch.Tensor) -> torch.Tensor:
    """``x`` as the distance sees it: scale-safely L2-normalised if the distance normalises."""
    x = upcast(x)
    return safe_normalize(x) if distance.normalize_embeddings else x


# -- coupled clusters -----------------------------------------------------------------------------
@register_loss("coupled_clusters")
class CoupledClustersLoss(BaseLoss):
    """Coupled clusters loss (Liu, Tian, Yang, Pang, Huang, "Deep Relative Distance Learning:
    Tell the Difference Between Similar Vehicles", CVPR 2016; seed 003). For each class ``k``
    in the batch, with centre ``c_k`` = mean of its embeddings and ``x*_k`` = the negative
    nearest to ``c_k``::

        L_k = sum_{i in class k} [ m + d(c_k, x_i) - d(c_k, x*_k) ]_+
        L   = (sum_k L_k) / (number of samples in classes that have a negative)

    ``d`` is the squared Euclidean distance by default (as in the paper; the paper's factor
    1/2 is dropped: it only rescales the margin and learning rate); with a similarity the hinge
    is ``[m - s(c_k, x_i) + s(c_k, x*_k)]_+``. Centres are means of the embeddings after the
    distance's normalisation and are not re-normalised (except by cosine similarity).
    With ``ref_emb`` the nearest negative is searched in the reference set (e.g. a cross-batch
    memory) instead of the batch; centres always come from the batch. The loss mines its own
    negatives, so miner indices are refused. A class with one sample still counts (its
    centre is the sample).

    Args:
        margin: ``m`` (1.0 for squared distances of unit vectors, range ``[0, 4]``).
    """

    accepts_indices = False

    def __init__(self, margin: float = 1.0, distance: BaseDistance | str | None = None) -> None:
        super().__init__(distance)
        self.margin = float(margin)

    @staticmethod
    def default_distance() -> BaseDistance:
        return LpDistance(power=2)

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        if indices is not None:
            raise ConfigError(
                "coupled_clusters mines its own hardest negative per class: remove the miner"
            )
        x = _normalized(self.distance, embeddings)
        if ref_emb is None:
            ref, ref_lab = x, labels
        else:
            ref, ref_lab = _normalized(self.distance, ref_emb), ref_labels
        classes, centres, inverse = class_means(x, labels)
        to_ref = distance_to_centres(self.distance, ref, centres, x_is_query=False)  # (K, R)
        is_neg = classes.unsqueeze(1) != ref_lab.unsqueeze(0)
        has_neg = is_neg.any(1)
        if not bool(has_neg.any()):
            return self.zero_loss(embeddings)
        closeness = self.distance.closeness(to_ref).masked_fill(~is_neg, float("-inf"))
        hardest = closeness.argmax(1)
        hard_neg = to_ref.gather(1, hardest.unsqueeze(1)).squeeze(1)  # (K,)
        to_own = distance_to_centres(self.distance, x, centres, x_is_query=False)  # (K, B)
        own = to_own.gather(0, inverse.unsqueeze(0)).squeeze(0)  # d(c_{y_i}, x_i), (B,)
        per_sample = F.relu(self.margin - self.distance.margin(own, hard_neg[inverse]))
        valid = has_neg[inverse]
        return per_sample[valid].sum() / valid.sum().to(per_sample.dtype)
