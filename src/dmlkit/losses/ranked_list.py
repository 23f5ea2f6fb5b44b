"""The Ranked List loss (Wang et al., "Ranked List Loss for Deep Metric Learning", CVPR 2019,
arXiv:1903.03238): per anchor, positives farther than ``alpha - m`` and negatives closer than
``alpha`` enter the loss, weighted as the paper states (formula and the differences from
pytorch-metric-learning's ``RankedListLoss`` in :class:`RankedListLoss`)."""

from __future__ import annotations

import math

import torch

from dmlkit.distances import BaseDistance, LpDistance
from dmlkit.exceptions import ConfigError
from dmlkit.losses._pairs import (
    class_columns,
    pair_matrix,
)
from dmlkit.losses.base import register_loss
from dmlkit.losses.pair_weighting_losses import _PairMatrixLoss

__all__ = ["RankedListLoss"]


# -- ranked list ----------------------------------------------------------------------------------
def _weighted_mean(values: torch.Tensor, logits: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    """Row-wise ``sum_{mask} w v / sum_{mask} w`` with ``w = exp(logits)`` (``w = 1`` for
    ``logits=None``); 0 for an empty row, with a zero gradient.

    Stable for any temperature: the weights are shifted by the row's largest selected logit
    (detached; the ratio is invariant to it), so they lie in ``(0, 1]``.
    """
    if logits is None:
        return torch.where(mask, values, 0.0).sum(1) / mask.sum(1).clamp_min(1)
    m = logits.detach().masked_fill(~mask, float("-inf")).amax(1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp((logits - m).masked_fill(~mask, 0)).masked_fill(~mask, 0)
    # a non-empty row has a weight of exactly 1 (its largest), so the floor only acts on empty rows
    return torch.linalg.vecdot(w, values.masked_fill(~mask, 0), dim=1) / w.sum(1).clamp_min(1e-30)


@register_loss("ranked_list")
class RankedListLoss(_PairMatrixLoss):
    r"""Ranked List Loss (Wang, Hua, Kodirov, Hu, Garnier, Robertson, "Ranked List Loss for Deep
    Metric Learning", CVPR 2019, arXiv:1903.03238).

    For each anchor ``i`` with distances ``d_ij`` (Euclidean on L2-normalised embeddings), the
    non-trivial positives lie outside the positive boundary ``alpha - m`` and the non-trivial
    negatives inside the negative boundary ``alpha``::

        P*_i = {j in P_i : d_ij > alpha - m},        N*_i = {j in N_i : d_ij < alpha}
        w+_ij = exp(T_p (d_ij - (alpha - m))),       w-_ij = exp(T_n (alpha - d_ij))
        L_P(i) = sum_{P*_i} w+_ij (d_ij - (alpha - m)) / sum_{P*_i} w+_ij
        L_N(i) = sum_{N*_i} w-_ij (alpha - d_ij)       / sum_{N*_i} w-_ij
        L      = 1/B sum_i [ (1 - lambda) L_P(i) + lambda L_N(i) ]

    (an empty set contributes 0). ``T_p = 0`` is the paper's simpler variant "RLL-Simpler"
    (positives weighted equally). The weights are normalised by a max-shifted exponential,
    so any temperature is safe; they are differentiated through, as in pytorch-metric-learning
    (``detach_weights=True`` treats them as constants).

    Defaults: ``margin = 0.4``, ``alpha = 1 + margin / 2 = 1.2`` (pml's rule when ``alpha`` is
    not given), ``Tn = 10``, ``Tp = 0``, ``imbalance = lambda = 0.5``.

    Relation to ``pml.losses.RankedListLoss(margin, Tn, imbalance, alpha, Tp)`` (same value and
    gradient otherwise): pml divides by ``sum_j (w_ij + 1e-5)`` over *all* ``B`` columns, i.e.
    ``sum w + 1e-5 B``, which shrinks each anchor's term by a factor ``sum w / (sum w + 1e-5 B)``
    (noticeable with ``T_p = 0`` and few positives: ``1e-5 B / |P*|``); and it selects a
    negative only when ``d > 0``, so a negative at distance exactly 0 (a duplicate embedding
    with another label, the worst violation) is ignored by pml and counted here.

    With miner ``indices`` the positives/negatives of each anchor are the mined pairs; with
    ``ref_emb`` they are taken from the reference set.

    Parameter names ``Tn``, ``Tp`` and ``imbalance`` are pml's, so a pml setting reads the same
    in a dmlkit config (``loss: {name: ranked_list, params: {margin: 0.4, Tn: 10}}``).

    Args:
        margin: ``m``, the gap between the positive and the negative boundary.
        alpha: ``alpha``, the negative boundary (default ``1 + margin / 2``).
        Tn, Tp: temperatures of the negative and positive weights (``>= 0``).
        imbalance: ``lambda`` in ``[0, 1]``, the weight of the negative term.
        detach_weights: do not back-propagate through the weights.
        distance: a distance (smaller is closer), default ``LpDistance()``.
    """

    def __init__(
        self,
        margin: float = 0.4,
        alpha: float | None = None,
        Tn: float = 10.0,
        Tp: float = 0.0,
        imbalance: float = 0.5,
        detach_weights: bool = False,
        distance: BaseDistance | str | None = None,
    ) -> None:
        super().__init__(distance)
        if self.distance.higher_is_closer:
            raise ConfigError(
                "ranked_list is defined on a distance (smaller is closer), e.g. 'euclidean'; "
                f"got the similarity {self.distance!r}"
            )
        if not 0.0 <= imbalance <= 1.0:
            raise ConfigError(f"imbalance must be in [0, 1], got {imbalance}")
        if Tn < 0 or Tp < 0 or not (math.isfinite(Tn) and math.isfinite(Tp)):
            raise ConfigError(f"Tn and Tp must be finite and >= 0, got {Tn}, {Tp}")
        if not margin >= 0:
            raise ConfigError(f"margin must be >= 0, got {margin}")
        self.margin = float(margin)
        self.alpha = 1.0 + self.margin / 2 if alpha is None else float(alpha)
        self.Tn, self.Tp = float(Tn), float(Tp)
        self.imbalance = float(imbalance)
        self.detach_weights = bool(detach_weights)

    @staticmethod
    def default_distance() -> BaseDistance:
        return LpDistance()

    def _weights(self, temperature: float, x: torch.Tensor) -> torch.Tensor | None:
        if temperature == 0:
            return None
        z = temperature * x
        return z.detach() if self.detach_weights else z

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        if indices is None:
            return self._compute_labels(embeddings, labels, ref_emb, ref_labels)
        mat, pos, neg = self._setup(embeddings, labels, indices, ref_emb, ref_labels)
        if mat is None:
            return self.zero_loss(embeddings)
        pos_excess = mat - (self.alpha - self.margin)  # > 0: outside the positive boundary
        neg_excess = self.alpha - mat  # > 0: inside the negative boundary
        p_sel = pos & (pos_excess > 0)
        n_sel = neg & (neg_excess > 0)
        loss_p = _weighted_mean(pos_excess, self._weights(self.Tp, pos_excess), p_sel)
        loss_n = self._negative_term(neg_excess, n_sel)
        return ((1 - self.imbalance) * loss_p + self.imbalance * loss_n).mean()

    def _compute_labels(self, embeddings, labels, ref_emb, ref_labels):
        """All pairs from labels: the few positives of each anchor are gathered into a
        ``(B, max class size)`` block; the negatives are one pass over the ``(B, R)`` row."""
        same_set = ref_labels is None
        ref_labels = labels if same_set else ref_labels
        if labels.shape[0] * (ref_labels.shape[0] - int(same_set)) <= 0:
            return self.zero_loss(embeddings)
        mat = pair_matrix(self.distance, embeddings, ref_emb)
        cols, valid, cls_q, cls_r, _ = class_columns(labels, ref_labels, same_set)
        pos_excess = mat.gather(1, cols) - (self.alpha - self.margin)
        loss_p = _weighted_mean(
            pos_excess, self._weights(self.Tp, pos_excess), valid & (pos_excess > 0)
        )
        neg_excess = self.alpha - mat
        n_sel = (neg_excess > 0).logical_and_(cls_q.unsqueeze(1) != cls_r.unsqueeze(0))
        loss_n = self._negative_term(neg_excess, n_sel)
        return ((1 - self.imbalance) * loss_p + self.imbalance * loss_n).mean()

    def _negative_term(self, excess: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        """``L_N`` per anchor: the ``exp(T_n excess)``-weighted mean of the selected ``excess``.

        Selected entries have ``0 < excess <= alpha`` (distances are >= 0), so when
        ``T_n alpha <= 60`` the weights ``exp(T_n excess)`` lie in ``[1, e^60]`` and need no
        max-shift (one pass fewer over the ``(B, R)`` matrix); larger temperatures use the
        shifted :func:`_weighted_mean`.
        """
        if self.Tn == 0 or self.Tn * self.alpha > 60:
            return _weighted_mean(excess, self._weights(self.Tn, excess), sel)
        z = excess.detach() if self.detach_weights else excess
        w = torch.where(sel, torch.exp(z * self.Tn), 0.0)
        return torch.linalg.vecdot(w, excess, dim=1) / w.sum(1).clamp_min(1.0)
