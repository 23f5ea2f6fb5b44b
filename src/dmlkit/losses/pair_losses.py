"""Pair-based losses: contrastive, cosine similarity, lifted structure, generalised lifted
structure, margin, circle.

Every loss here works on the ``(B, R)`` matrix between the batch and the reference set (the
batch itself, or ``ref_emb`` from a cross-batch memory) and boolean masks of the positive and
negative pairs, so memory is ``O(B R)``. ``indices`` from a miner (pairs ``(a1, p, a2, n)`` or
triplets ``(a, p, n)``) restrict the pairs used. Half-precision inputs are computed in float32
(the returned loss is float32). A batch without a usable pair returns
:meth:`BaseLoss.zero_loss` (a zero with a gradient, counted in ``num_empty_batches``).

Distances: ``dmlkit.distances`` objects. For a distance (smaller = closer) the formulas read
as written; for a similarity (larger = closer) margins are mirrored exactly as in
pytorch-metric-learning (e.g. the contrastive positive term becomes ``[m_pos - s]_+``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dmlkit.distances import BaseDistance, CosineSimilarity, LpDistance
from dmlkit.exceptions import ConfigError
from dmlkit.losses._pairs import (
    check_indices,
    class_columns,
    label_masks,
    masked_logsumexp,
    pair_masks,
    pair_matrix,
    to_pair_indices,
)
from dmlkit.losses.base import BaseLoss, register_loss
from dmlkit.losses.classification_losses import _check_positive
from dmlkit.validation import check_number

__all__ = [
    "CircleLoss",
    "ContrastiveLoss",
    "CosineSimilarityLoss",
    "GeneralizedLiftedStructureLoss",
    "LiftedStructureLoss",
    "MarginLoss",
]


def _pair_matrix(
    distance: BaseDistance, embeddings: torch.Tensor, ref_emb: torch.Tensor | None
) -> torch.Tensor:
    """``(B, R)`` distance/similarity matrix (float32 for half-precision inputs, scale-safe)."""
    return pair_matrix(distance, embeddings, ref_emb)


def _ref_labels(labels: torch.Tensor, ref_labels: torch.Tensor | None) -> torch.Tensor:
    return labels if ref_labels is None else ref_labels


def _pos_violation(distance: BaseDistance, values: torch.Tensor, margin) -> torch.Tensor:
    """How far a positive pair is beyond ``margin``: ``d - m`` (distance) or ``m - s`` (similarity)."""
    return distance.margin(margin, values)


def _neg_violation(distance: BaseDistance, values: torch.Tensor, margin) -> torch.Tensor:
    """How far a negative pair is inside ``margin``: ``m - d`` (distance) or ``s - m`` (similarity)."""
    return distance.margin(values, margin)


def _require_similarity(loss: str, distance: BaseDistance) -> None:
    if not distance.higher_is_closer:
        raise ConfigError(
            f"{loss} is defined on a similarity in [-1, 1]; use distance='cosine' (the default)"
        )


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    """One :class:`ConfigError` line listing ``choices`` unless ``value`` is one of them (the
    check of the string options of the pair, triplet and NCA losses)."""
    if value not in choices:
        listed = ", ".join(map(repr, choices))
        raise ConfigError(f"{name} must be one of {listed}; got {value!r}")


def _mean_nonzero(values: torch.Tensor) -> torch.Tensor:
    """Mean of the strictly positive entries of ``values`` (0 with a gradient when none)."""
    count = torch.count_nonzero(values)  # values are >= 0 (hinges)
    return values.sum() / count.clamp_min(1)


# --------------------------------------------------------------------------------------------
@register_loss("contrastive")
class ContrastiveLoss(BaseLoss):
    r"""Contrastive loss, single or double margin, on the distance or the squared distance.

    For a pair at distance :math:`D` (``D = d`` or ``D = d^2`` with ``distance_power=2``)::

        L_pos = [D - m_pos]_+ ^ h        L_neg = [m_neg - D]_+ ^ h        (h = hinge_power)

    Hadsell, Chopra, LeCun, "Dimensionality Reduction by Learning an Invariant Mapping",
    CVPR 2006 (single margin ``m_pos = 0``, ``h = 2``); the double margin (``m_pos > 0``) as in
    Lin et al. 2015 and seed 003, which takes ``D`` as the squared distance (``distance_power=2,
    hinge_power=2``); the Reality Check (Musgrave et al. 2020) uses ``D = d``, ``h = 1``.

    Defaults follow the Reality Check / pytorch-metric-learning: Euclidean distance of
    L2-normalised embeddings, ``D = d`` (``distance_power=1``), ``h = 1``, ``m_pos = 0``,
    ``m_neg = 1``; equal to ``pml.losses.ContrastiveLoss(pos_margin=0, neg_margin=1)``.

    Args:
        pos_margin, neg_margin: the two margins (for a similarity, ``s >= pos_margin`` is the
            goal for positives and ``s <= neg_margin`` for negatives).
        distance: a :class:`~dmlkit.distances.BaseDistance` or name (default ``LpDistance()``).
        distance_power: 1 = on the distance, 2 = on the squared distance (distances only).
        hinge_power: 1 = hinge, 2 = squared hinge (Hadsell's form).
        reduction: how the positive terms ``P`` and negative terms ``N`` are averaged::

            "mean_nonzero" (default):  sum(P) / #{P > 0}  +  sum(N) / #{N > 0}
                                       (pml's ``AvgNonZeroReducer``)
            "mean":                    sum(P) / |P|  +  sum(N) / |N|
                                       (each kind weighs the same, whatever its count)
            "pooled":                  (sum(P) + sum(N)) / (|P| + |N|)
                                       (one mean over all pairs: seed 003's online
                                       contrastive loss, ``torch.cat([pos, neg]).mean()``)

            Note: contrastive's ``"mean"`` is not the ``"mean"`` of ``cosine_similarity`` and
            ``distance_logistic``, which is the pooled mean (their ``"balanced"`` is half of
            this ``"mean"``). A part with no pair (``|P| = 0`` or ``|N| = 0``) adds 0.

    Seed 003's online contrastive loss (all pairs of a batch, ``d^2`` for positives and
    ``[m - d]_+^2`` for negatives, one mean over the ``n (n - 1) / 2`` terms, on raw
    embeddings) is ``ContrastiveLoss(neg_margin=m, hinge_power=2, reduction="pooled",
    distance=LpDistance(normalize_embeddings=False))`` without ``indices`` (every ordered pair
    counts twice, which leaves the mean unchanged) or with ``miner:all_pairs``.

    Without ``indices`` every pair of the batch is used (``i != j``); with ``indices`` the
    mined pairs (triplets give ``(a, p)`` and ``(a, n)``, duplicates kept).
    """

    #: The values of ``reduction``.
    REDUCTIONS = ("mean_nonzero", "mean", "pooled")

    accepts_indices = True

    def __init__(
        self,
        pos_margin: float = 0.0,
        neg_margin: float = 1.0,
        distance: BaseDistance | str | None = None,
        distance_power: int = 1,
        hinge_power: int = 1,
        reduction: str = "mean_nonzero",
    ) -> None:
        super().__init__(distance)
        if any(isinstance(v, bool) or v not in (1, 2) for v in (distance_power, hinge_power)):
            raise ConfigError(f"distance_power and hinge_power must be 1 or 2, got {distance_power!r} "
                              f"and {hinge_power!r}")
        if distance_power == 2 and self.distance.higher_is_closer:
            raise ConfigError(
                "distance_power=2 squares a distance; with a similarity use distance_power=1"
            )
        _check_choice("reduction", reduction, self.REDUCTIONS)
        self.pos_margin = float(pos_margin)
        self.neg_margin = float(neg_margin)
        self.distance_power = distance_power
        self.hinge_power = hinge_power
        self.reduction = reduction

    @staticmethod
    def default_distance() -> BaseDistance:
        return LpDistance()

    def _terms(self, values: torch.Tensor, positive: bool) -> torch.Tensor:
        if self.distance_power == 2:
            values = values.pow(2)
        if positive:
            v = _pos_violation(self.distance, values, self.pos_margin)
        else:
            v = _neg_violation(self.distance, values, self.neg_margin)
        v = F.relu(v)
        return v * v if self.hinge_power == 2 else v

    def _dense_negative_terms(self, mat: torch.Tensor, same: torch.Tensor) -> torch.Tensor:
        """:meth:`_terms` of every entry of ``mat`` as a negative pair, 0 where ``same``.

        Same values as ``_terms(mat, False).masked_fill(same, 0)``, but the masking and the
        hinge work in place on the one fresh ``(B, R)`` violation tensor (neither the
        subtraction nor the mask needs it for the backward pass), so the forward pass allocates
        one ``(B, R)`` float tensor instead of three.
        """
        values = mat.pow(2) if self.distance_power == 2 else mat
        v = _neg_violation(self.distance, values, self.neg_margin)  # a new tensor
        v = v.masked_fill_(same, 0.0).relu_()
        return v * v if self.hinge_power == 2 else v

    def _reduce(
        self,
        pos_terms: torch.Tensor,
        n_pos: torch.Tensor,
        neg_terms: torch.Tensor,
        n_neg: torch.Tensor,
    ) -> torch.Tensor:
        """The loss from the positive and negative terms and their pair counts (``reduction``)."""
        if self.reduction == "pooled":
            return (pos_terms.sum() + neg_terms.sum()) / (n_pos + n_neg).clamp_min(1)
        if self.reduction == "mean_nonzero":
            return _mean_nonzero(pos_terms) + _mean_nonzero(neg_terms)
        return pos_terms.sum() / n_pos.clamp_min(1) + neg_terms.sum() / n_neg.clamp_min(1)

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        if indices is None:
            same_set = ref_labels is None
            ref_labels = labels if same_set else ref_labels
            # the few positives of each anchor are gathered (no B x R mask for them); the
            # negatives are the whole row with the anchor's class masked out
            cols, valid, cls_q, cls_r, counts = class_columns(labels, ref_labels, same_set)
            n_pos = valid.sum()
            n_neg = (ref_labels.shape[0] - counts[cls_q]).sum()
            if int(n_pos + n_neg) == 0:  # one read from the device
                return self.zero_loss(embeddings)
            mat = _pair_matrix(self.distance, embeddings, ref_emb)
            pos_terms = torch.where(valid, self._terms(mat.gather(1, cols), True), 0.0)
            same = cls_q.unsqueeze(1) == cls_r.unsqueeze(0)
            neg_terms = self._dense_negative_terms(mat, same)
            return self._reduce(pos_terms, n_pos, neg_terms, n_neg)
        mat = _pair_matrix(self.distance, embeddings, ref_emb)
        check_indices(indices, embeddings.shape[0], mat.shape[1])
        a1, p, a2, n = to_pair_indices(indices)
        if a1.numel() + a2.numel() == 0:
            return self.zero_loss(embeddings)
        pos_terms = self._terms(mat[a1, p], True)
        neg_terms = self._terms(mat[a2, n], False)
        n_pos = torch.tensor(a1.numel(), device=mat.device)
        n_neg = torch.tensor(a2.numel(), device=mat.device)
        return self._reduce(pos_terms, n_pos, neg_terms, n_neg)


# --------------------------------------------------------------------------------------------
@register_loss("cosine_similarity")
class CosineSimilarityLoss(BaseLoss):
    r"""Cosine similarity loss: squared error between the pair's cosine and a target.

    For a pair ``(x1, x2)`` with target ``y``::

        L(x1, x2, y) = 1/2 (y - cos(f(x1), f(x2)))^2,   cos(u, v) = <u, v> / (|u| |v|)
        y = 1 for a same-class pair, y = negative_target (default 0) otherwise
        L = mean over the pairs

    Seed 003 (J. Serrat, "Deep Metric Learning", the "Cosine distance" slide). The slide does
    not define ``y``; its neighbouring slides (contrastive, distance-based logistic) use
    ``y = 0`` for a *similar* pair and ``y = 1`` for a dissimilar one, and read that way this
    formula would pull similar pairs to cosine 0 and dissimilar ones to cosine 1. dmlkit
    deliberately inverts that convention here: ``y = 1`` for a similar (same-class) pair and
    ``y = 0`` for a dissimilar one, so similar pairs are pulled to cosine 1 and dissimilar ones
    to cosine 0 (orthogonal), not pushed to opposite directions. The loss is bounded
    (``cos in [-1, 1]``), so no pair produces an extreme gradient. ``negative_target=-1``
    gives ``+-1`` labels; only then is it half of the contrastive loss on cosine similarity
    with squared hinges and margins ``pos_margin=1, neg_margin=-1`` pair by pair (the hinges
    never clip: ``[1 - cos]_+^2 = (1 - cos)^2``, ``[cos + 1]_+^2 = (-1 - cos)^2``); a negative
    target of 0 has no contrastive counterpart (a hinge at 0 leaves negative cosines alone).

    Pairs: without ``indices`` every pair ``(i, j)``, ``i != j``, of the batch (or every
    ``(i, j)`` against ``ref_emb``); with ``indices`` the mined pairs (a triplet gives
    ``(a, p)`` and ``(a, n)``, duplicates kept).

    Args:
        negative_target: ``y`` of a different-class pair, in ``[-1, 1)`` (default 0: with
            ``y = 1`` for same-class pairs, the seed's two label values, 1 meaning similar).
        reduction: ``"mean"`` (default, over all pairs as in the seed) or ``"balanced"`` (the
            mean of the positive-pair mean and the negative-pair mean, for batches with far
            more negative than positive pairs).
    """

    accepts_indices = True

    def __init__(self, negative_target: float = 0.0, reduction: str = "mean") -> None:
        super().__init__(CosineSimilarity())
        if not -1.0 <= negative_target < 1.0:
            raise ConfigError(f"negative_target must be in [-1, 1), got {negative_target}")
        _check_choice("reduction", reduction, ("mean", "balanced"))
        self.negative_target = float(negative_target)
        self.reduction = reduction

    def _reduce(self, pos_terms, neg_terms, n_pos, n_neg) -> torch.Tensor:
        if self.reduction == "mean":
            return (pos_terms.sum() + neg_terms.sum()) / (n_pos + n_neg)
        parts = [t.sum() / n for t, n in ((pos_terms, n_pos), (neg_terms, n_neg)) if n]
        return sum(parts[1:], parts[0]) / len(parts)

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        if indices is None:
            pos_mask, neg_mask = label_masks(labels, ref_labels)
            n_pos, n_neg = int(pos_mask.sum()), int(neg_mask.sum())
            if n_pos + n_neg == 0:
                return self.zero_loss(embeddings)
            cos = _pair_matrix(self.distance, embeddings, ref_emb)
            pos_terms = torch.where(pos_mask, (1.0 - cos).pow(2) / 2, 0.0)
            neg_terms = torch.where(neg_mask, (self.negative_target - cos).pow(2) / 2, 0.0)
            return self._reduce(pos_terms, neg_terms, n_pos, n_neg)
        ref = embeddings if ref_emb is None else ref_emb
        check_indices(indices, embeddings.shape[0], ref.shape[0])
        a1, p, a2, n = to_pair_indices(indices)
        if a1.numel() + a2.numel() == 0:
            return self.zero_loss(embeddings)
        cos_p = self.distance.paired(embeddings[a1], ref[p])
        cos_n = self.distance.paired(embeddings[a2], ref[n])
        pos_terms = (1.0 - cos_p).pow(2) / 2
        neg_terms = (self.negative_target - cos_n).pow(2) / 2
        return self._reduce(pos_terms, neg_terms, a1.numel(), a2.numel())


# --------------------------------------------------------------------------------------------
class _LiftedStructureBase(BaseLoss):
    """Shared constructor of the two lifted structure losses: margins ``m_neg`` / ``m_pos``.

    Args:
        neg_margin, pos_margin: ``m_neg`` and ``m_pos``.
        distance: default ``LpDistance()`` (Euclidean on L2-normalised embeddings).
    """

    accepts_indices = True

    def __init__(
        self,
        neg_margin: float = 1.0,
        pos_margin: float = 0.0,
        distance: BaseDistance | str | None = None,
    ) -> None:
        super().__init__(distance)
        self.neg_margin = float(neg_margin)
        self.pos_margin = float(pos_margin)

    @staticmethod
    def default_distance() -> BaseDistance:
        return LpDistance()


# --------------------------------------------------------------------------------------------
@register_loss("lifted_structure")
class LiftedStructureLoss(_LiftedStructureBase):
    r"""Lifted structured loss, the smooth upper bound (Oh Song et al. 2016), per positive pair.

    For each positive pair :math:`(i, j)` with negatives :math:`N_i` of ``i`` and :math:`N_j`
    of ``j``::

        J_ij = log( sum_{k in N_i} exp(m_neg - d_ik) + sum_{l in N_j} exp(m_neg - d_jl) )
               + d_ij - m_pos
        hinge_power=2 (default):  L = 1 / (2 |P|) * sum_{(i, j) in P} [J_ij]_+ ^ 2
        hinge_power=1:            L = 1 / |P|     * sum_{(i, j) in P} [J_ij]_+

    Oh Song, Xiang, Jegelka, Savarese, "Deep Metric Learning via Lifted Structured Feature
    Embedding", CVPR 2016, eq. 4 (``m_neg = alpha = 1``, ``m_pos = 0``) is the squared hinge.
    ``hinge_power=1`` is the plain hinge that seed 003 writes, both for the smooth bound
    (``J = sum_P max(0, J_ij)``) and for Hermans, Beyer, Leibe's "lifted embedding loss for
    triplets" (arXiv:1703.07737, "Lifted 1-pos." in their table)::

        L_L = sum_{i=1..B} [ d(a_i, p_i) + log sum_{n != a_i, p_i} (e^{m - d(a_i, n)}
                                                                   + e^{m - d(p_i, n)}) ]_+

    whose inner sum runs, for each anchor-positive pair, over the negatives of both ends
    (seed 003: "negatives are all but the anchor and positive", in batches where every other
    sample has another identity): that is ``J_ij`` with ``m_neg = m``, ``m_pos = 0``. The
    seed's sum over its ``B`` pairs is averaged here over the positive pairs (Hermans et al.
    average every loss), which changes the scale only. The sum is over ordered
    pairs, which gives the same mean as over unordered ones. The log-sum-exp is computed once
    per row (``O(B R)``), never as a (positive pairs x negative pairs) mask. Equal to
    ``pml.losses.LiftedStructureLoss(neg_margin=1, pos_margin=0)`` without indices.

    With ``indices``, positives and the negatives of the *anchor* side come from the mined
    pairs (duplicates count once); without ``ref_emb`` the negatives of ``j`` are the mined
    negative pairs anchored at ``j``. With ``ref_emb`` the negatives of the reference ``j`` are
    all references of another label (from the ``R x R`` reference matrix). A positive pair
    neither of whose ends has a negative uses ``log(...) = 0`` (as pml).

    Args:
        neg_margin, pos_margin: ``m_neg`` (the paper's ``alpha``) and ``m_pos``.
        distance: default ``LpDistance()`` (Euclidean on L2-normalised embeddings).
        hinge_power: 2 (default, Oh Song's squared hinge, pml's) or 1 (seed 003's plain hinge).
    """

    def __init__(
        self,
        neg_margin: float = 1.0,
        pos_margin: float = 0.0,
        distance: BaseDistance | str | None = None,
        hinge_power: int = 2,
    ) -> None:
        super().__init__(neg_margin, pos_margin, distance)
        if isinstance(hinge_power, bool) or hinge_power not in (1, 2):
            raise ConfigError(f"hinge_power must be 1 or 2, got {hinge_power!r}")
        self.hinge_power = int(hinge_power)

    def _neg_lse(self, mat: torch.Tensor, neg_mask: torch.Tensor) -> torch.Tensor:
        floor = torch.finfo(mat.dtype).min
        return masked_logsumexp(
            _neg_violation(self.distance, mat, self.neg_margin), neg_mask, dim=1, empty=floor
        )

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        mat = _pair_matrix(self.distance, embeddings, ref_emb)
        pos_mask, neg_mask = pair_masks(labels, indices, ref_labels)
        if not bool(pos_mask.any() & neg_mask.any()):  # one read from the device
            return self.zero_loss(embeddings)
        lse_anchor = self._neg_lse(mat, neg_mask)  # (B,)
        if ref_emb is None:
            lse_ref, ref_has_neg = lse_anchor, neg_mask.any(1)
        else:
            ref_mat = _pair_matrix(self.distance, ref_emb, None)
            _, ref_neg = label_masks(ref_labels)
            lse_ref, ref_has_neg = self._neg_lse(ref_mat, ref_neg), ref_neg.any(1)
        lse = torch.logaddexp(lse_anchor.unsqueeze(1), lse_ref.unsqueeze(0))
        any_neg = neg_mask.any(1).unsqueeze(1) | ref_has_neg.unsqueeze(0)
        lse = torch.where(any_neg, lse, 0.0)
        j = lse + _pos_violation(self.distance, mat, self.pos_margin)
        hinge = F.relu(j).pow(2) / 2 if self.hinge_power == 2 else F.relu(j)
        terms = torch.where(pos_mask, hinge, 0.0)
        return terms.sum() / torch.count_nonzero(pos_mask)


# --------------------------------------------------------------------------------------------
@register_loss("generalized_lifted_structure")
class GeneralizedLiftedStructureLoss(_LiftedStructureBase):
    r"""Generalised lifted structure loss (Hermans, Beyer, Leibe 2017), one term per anchor.

    ::

        L_a = [ log sum_{p in P_a} exp(d_ap - m_pos) + log sum_{n in N_a} exp(m_neg - d_an) ]_+
        L   = mean over anchors with at least one positive and one negative

    Hermans, Beyer, Leibe, "In Defense of the Triplet Loss for Person Re-Identification",
    arXiv:1703.07737, eq. (4) (all positives and all negatives of each anchor; their margin is
    ``m_neg``, with ``m_pos = 0``). Equal to ``pml.losses.GeneralizedLiftedStructureLoss(
    neg_margin=1, pos_margin=0)`` when every anchor has a positive and a negative (pml also
    averages in anchors that lack one, with the missing sum taken as 0).

    Args:
        neg_margin, pos_margin: ``m_neg`` and ``m_pos``.
        distance: default ``LpDistance()``.
    """

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        mat = _pair_matrix(self.distance, embeddings, ref_emb)
        pos_mask, neg_mask = pair_masks(labels, indices, ref_labels)
        valid = pos_mask.any(1) & neg_mask.any(1)
        if not valid.any():
            return self.zero_loss(embeddings)
        pos = masked_logsumexp(_pos_violation(self.distance, mat, self.pos_margin), pos_mask)
        neg = masked_logsumexp(_neg_violation(self.distance, mat, self.neg_margin), neg_mask)
        terms = torch.where(valid, F.relu(pos + neg), 0.0)
        return terms.sum() / valid.sum()


# --------------------------------------------------------------------------------------------
@register_loss("margin")
class MarginLoss(BaseLoss):
    r"""Margin loss with a learnable boundary ``beta`` (Wu et al. 2017).

    For a pair with label :math:`y_{ij} = +1` (same class) or :math:`-1`::

        l(i, j) = [ alpha + y_ij (D_ij - beta_i) ]_+
        L       = sum_pairs l(i, j) / #{pairs with l > 0}  +  nu * beta_reg

    Wu, Manmatha, Smola, Krähenbühl, "Sampling Matters in Deep Embedding Learning", ICCV 2017:
    ``alpha = 0.2``, ``beta`` initialised at 1.2 and learned (``learn_beta=True``), optionally
    one ``beta`` per class (``num_classes``; ``beta_i = beta[label of the anchor]``), ``nu``
    the regulariser weight on ``beta`` (0 by default). ``D`` is the Euclidean distance of
    L2-normalised embeddings. ``beta_reg`` is ``beta`` (single) or the mean of ``beta[label of
    the anchor]`` over the pairs used (per class).

    Pairs: all pairs of the batch without ``indices``; mined pairs, or a triplet's ``(a, p)`` and
    ``(a, n)`` (duplicates kept) with ``indices``. With triplet indices the value equals
    ``pml.losses.MarginLoss(margin=0.2, nu=0, beta=1.2, learn_beta=...)`` given the same
    triplets (pml's default, "all triplets", counts each pair once per triplet).

    ``beta`` is a parameter of this module (``loss.parameters()``): give it to an optimiser
    (Wu et al. use a separate learning rate for it).
    """

    accepts_indices = True

    def __init__(
        self,
        margin: float = 0.2,
        beta: float = 1.2,
        learn_beta: bool = True,
        num_classes: int | None = None,
        nu: float = 0.0,
        distance: BaseDistance | str | None = None,
    ) -> None:
        super().__init__(distance)
        if num_classes is not None and num_classes < 1:
            raise ConfigError(f"num_classes must be positive, got {num_classes}")
        self.margin = float(margin)
        self.nu = check_number(nu, "nu", least=0.0)  # nu < 0 rewards beta without bound
        self.num_classes = num_classes
        init = torch.full((num_classes or 1,), float(beta))
        if learn_beta:
            self.beta = nn.Parameter(init)
        else:
            self.register_buffer("beta", init)

    @staticmethod
    def default_distance() -> BaseDistance:
        return LpDistance()

    def _beta_for(self, anchor_labels: torch.Tensor) -> torch.Tensor:
        if self.num_classes is None:
            return self.beta[0].expand_as(anchor_labels)  # the caller casts (no float32 rounding)
        if anchor_labels.numel() and (
            int(anchor_labels.min()) < 0 or int(anchor_labels.max()) >= self.num_classes
        ):
            raise ConfigError(
                f"MarginLoss with per-class beta needs labels in [0, {self.num_classes}); "
                "remap labels to contiguous ids or raise num_classes"
            )
        return self.beta[anchor_labels.long()]  # a uint8 index would be a mask

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        mat = _pair_matrix(self.distance, embeddings, ref_emb)
        if indices is None:
            pos_mask, neg_mask = label_masks(labels, ref_labels)
            if not bool(pos_mask.any() | neg_mask.any()):  # one read from the device
                return self.zero_loss(embeddings)
            beta = self._beta_for(labels).to(mat.dtype).unsqueeze(1)  # (B, 1)
            pos = F.relu(_pos_violation(self.distance, mat, beta) + self.margin)
            neg = F.relu(_neg_violation(self.distance, mat, beta) + self.margin)
            pos = torch.where(pos_mask, pos, 0.0)
            neg = torch.where(neg_mask, neg, 0.0)
            n_pairs_beta = (
                (beta.squeeze(1) * (pos_mask.sum(1) + neg_mask.sum(1))).sum()
                / (torch.count_nonzero(pos_mask) + torch.count_nonzero(neg_mask))
            )
        else:
            check_indices(indices, embeddings.shape[0], mat.shape[1])
            a1, p, a2, n = to_pair_indices(indices)
            if a1.numel() + a2.numel() == 0:
                return self.zero_loss(embeddings)
            beta_p = self._beta_for(labels[a1]).to(mat.dtype)
            beta_n = self._beta_for(labels[a2]).to(mat.dtype)
            pos = F.relu(_pos_violation(self.distance, mat[a1, p], beta_p) + self.margin)
            neg = F.relu(_neg_violation(self.distance, mat[a2, n], beta_n) + self.margin)
            n_pairs_beta = torch.cat([beta_p, beta_n]).mean()
        active = torch.count_nonzero(pos) + torch.count_nonzero(neg)  # hinges are >= 0
        loss = (pos.sum() + neg.sum()) / active.clamp_min(1)
        if self.nu:
            reg = self.beta[0] if self.num_classes is None else n_pairs_beta
            loss = loss + self.nu * reg
        return loss + 0 * self.beta.sum()


# --------------------------------------------------------------------------------------------
@register_loss("circle")
class CircleLoss(BaseLoss):
    r"""Circle loss (Sun et al. 2020), pair-wise labels, one term per anchor.

    With similarities :math:`s_p` (positives of the anchor) and :math:`s_n` (negatives)::

        alpha_p = [1 + m - s_p]_+ ,  alpha_n = [s_n + m]_+      (no gradient through alpha)
        L_a = softplus( log sum_p exp(-gamma alpha_p (s_p - (1 - m)))
                      + log sum_n exp( gamma alpha_n (s_n - m)) )
        L   = mean over anchors with at least one positive and one negative

    Sun, Cheng, Zhang, Zhang, Zheng, Wang, Wei, "Circle Loss: A Unified Perspective of Pair
    Similarity Optimization", CVPR 2020. Defaults ``m = 0.4, gamma = 80`` are the paper's
    fine-grained image retrieval setting (face recognition: ``m = 0.25, gamma = 256``). Needs a
    similarity (default cosine). Equal to ``pml.losses.CircleLoss(m=0.4, gamma=80)`` (pml
    averages the non-zero anchor terms; they coincide unless a term underflows to exactly 0).
    """

    accepts_indices = True

    def __init__(
        self, m: float = 0.4, gamma: float = 80.0, distance: BaseDistance | str | None = None
    ) -> None:
        super().__init__(distance)
        _require_similarity("CircleLoss", self.distance)
        _check_positive(gamma=gamma)  # <= 0 turns the objective upside down or off
        self.m = float(m)
        self.gamma = float(gamma)

    @staticmethod
    def default_distance() -> BaseDistance:
        return CosineSimilarity()

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        mat = _pair_matrix(self.distance, embeddings, ref_emb)
        pos_mask, neg_mask = pair_masks(labels, indices, ref_labels)
        valid = pos_mask.any(1) & neg_mask.any(1)
        if not valid.any():
            return self.zero_loss(embeddings)
        detached = mat.detach()
        alpha_p = F.relu(1 + self.m - detached)
        alpha_n = F.relu(detached + self.m)
        logit_p = -self.gamma * alpha_p * (mat - (1 - self.m))
        logit_n = self.gamma * alpha_n * (mat - self.m)
        lse = masked_logsumexp(logit_p, pos_mask) + masked_logsumexp(logit_n, neg_mask)
        terms = torch.where(valid, F.softplus(lse), 0.0)
        return terms.sum() / valid.sum()
