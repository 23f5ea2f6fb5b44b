"""Neighbourhood components analysis (NCA) loss, in its log-likelihood and its sum form.

(Split from :mod:`dmlkit.losses.pair_weighting_losses`, which re-exports :class:`NCALoss`;
the config name stays ``nca``.) Works on the ``(B, R)`` matrix between the batch and the
reference set (the batch itself minus the diagonal, or ``ref_emb``); without ``indices`` the
softmax is summed per class with ``index_add``, with no ``B x R`` mask. Half-precision inputs
are upcast to float32; the loss is returned in float32.
"""

from __future__ import annotations

import torch

from dmlkit.distances import BaseDistance, LpDistance
from dmlkit.exceptions import ConfigError
from dmlkit.losses._pairs import (
    anchor_positives,
    masked_logsumexp,
    pair_masks,
    safe_normalize,
    upcast,
)
from dmlkit.losses.base import BaseLoss, register_loss
from dmlkit.losses.pair_losses import _check_choice

__all__ = ["NCALoss"]


@register_loss("nca")
class NCALoss(BaseLoss):
    """Neighbourhood components analysis (Goldberger, Roweis, Hinton, Salakhutdinov, NIPS 2004 /
    NeurIPS 2005)::

        p_ij = exp(-s d_ij) / sum_{k != i} exp(-s d_ik)      (softmax over the others, p_ii = 0)
        p_i  = sum_{j in C_i} p_ij                            (prob. of picking a same-class one)
        A    = the anchors whose C_i is not empty

        objective="log" (default):  L = -1/|A| sum_{i in A} log p_i
             = 1/|A| sum_{i in A} [ logsumexp_{k != i}(-s d_ik) - logsumexp_{j in C_i}(-s d_ij) ]
        objective="sum":            L = -1/|A| sum_{i in A} p_i

    ``"log"`` is the log-likelihood form used for deep embeddings (Goldberger et al.'s
    alternative objective ``sum_i log p_i``; pytorch-metric-learning's ``NCALoss``). ``"sum"``
    is the objective of the paper and of seed 003 (Serrat, "NCA loss" slide:
    ``w = argmax_w sum_i p_i``, the expected number of points 1-NN classifies correctly),
    divided by ``|A|`` so that its scale does not grow with the batch (anchors outside ``A``
    have ``p_i = 0``: the seed's sum over all ``i`` has the same gradient, ``|A|`` times
    larger). The two differ in value and in weighting: ``-log p_i`` pushes much harder on
    anchors whose ``p_i`` is small (badly classified), ``-p_i`` weighs every anchor by its
    own ``p_i``. The seed's ``p_ij`` uses ``exp(-|phi(x_i) - phi(x_j)|^2)`` on raw outputs:
    ``NCALoss(objective="sum", distance=LpDistance(power=2, normalize_embeddings=False))``.

    ``d`` is the squared Euclidean distance by default (on L2-normalised embeddings, as
    ``LpDistance(power=2)``); a similarity is used as ``+s * sim``. With miner indices the
    softmax runs over each anchor's mined positives and negatives and ``C_i`` = its mined
    positives. With ``objective="log"`` equivalent to ``pml.losses.NCALoss(softmax_scale=scale)``
    without a miner (pml drops anchors whose ``p_i`` underflows to 0; dmlkit keeps them,
    finite, via log-sum-exp).

    Args:
        scale: ``s``, the softmax scale (paper 1).
        objective: ``"log"`` (default) or ``"sum"``, as above.
    """

    accepts_indices = True
    #: The values of ``objective``.
    OBJECTIVES = ("log", "sum")

    def __init__(
        self,
        scale: float = 1.0,
        distance: BaseDistance | str | None = None,
        objective: str = "log",
    ) -> None:
        super().__init__(distance)
        if scale <= 0:
            raise ConfigError(f"scale must be positive, got {scale}")
        _check_choice("objective", objective, self.OBJECTIVES)
        self.scale = float(scale)
        self.objective = objective

    @staticmethod
    def default_distance() -> BaseDistance:
        return LpDistance(power=2)

    def _logits(self, embeddings, ref_emb):
        """``scale * closeness`` up to a per-row constant (which cancels in the row softmax).

        For the squared Euclidean distance ``-s |x_i - r_j|^2 = 2 s <x_i, r_j> - s |r_j|^2 -
        s |x_i|^2``: the last term is dropped and the rest is one ``addmm``.
        """
        x = upcast(embeddings)
        ref = None if ref_emb is None else upcast(ref_emb)
        d = self.distance
        if d.normalize_embeddings:
            x = safe_normalize(x)
            ref = None if ref is None else safe_normalize(ref)
        if isinstance(d, LpDistance) and d.p == 2 and d.power == 2:
            x, r = d._prepare(x, ref)
            sq_norms = r.pow(2).sum(1)
            return torch.addmm(sq_norms.unsqueeze(0), x, r.T, beta=-self.scale, alpha=2 * self.scale)
        mat = d(x, ref)
        return mat * (self.scale if d.higher_is_closer else -self.scale)

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        if indices is None:
            return self._compute_labels(embeddings, labels, ref_emb, ref_labels)
        pos, neg = pair_masks(labels, indices, ref_labels)
        has_pos = pos.any(1)
        if not bool(has_pos.any()):
            return self.zero_loss(embeddings)
        logits = self._logits(embeddings, ref_emb)
        log_p = masked_logsumexp(logits, pos) - masked_logsumexp(logits, pos | neg)  # log p_i
        if self.objective == "sum":
            return -torch.exp(log_p[has_pos]).mean()
        return -log_p[has_pos].mean()

    def _compute_labels(self, embeddings, labels, ref_emb, ref_labels):
        """All pairs from labels, without any ``B x R`` mask: the softmax over the row (minus
        the diagonal) is summed per reference class with ``index_add`` into ``(B, K)``."""
        same_set, num_classes, cls_q, cls_r, num_pos = anchor_positives(labels, ref_labels)
        has_pos = num_pos > 0
        if not bool(has_pos.any()):
            return self.zero_loss(embeddings)
        logits = self._logits(embeddings, ref_emb)
        if same_set:
            logits = logits.clone()
            logits.fill_diagonal_(float("-inf"))
        prob = torch.softmax(logits, 1)  # p_ii = 0
        per_class = prob.new_zeros(prob.shape[0], num_classes).index_add(1, cls_r, prob)
        p_i = per_class.gather(1, cls_q.unsqueeze(1)).squeeze(1)
        rows = has_pos.nonzero(as_tuple=True)[0]
        p_i = p_i[rows]
        if self.objective == "sum":  # p_i itself: no log, nothing to rescue from underflow
            return -p_i.mean()
        # rows whose same-class probability underflows: exact masked log-sum-exp on those rows
        under = p_i < torch.finfo(p_i.dtype).tiny ** 0.5
        per_row = -torch.log(torch.where(under, torch.ones_like(p_i), p_i))
        if bool(under.any()):
            r = rows[under]
            pos = cls_q[r].unsqueeze(1) == cls_r.unsqueeze(0)
            allowed = torch.ones_like(pos)
            if same_set:
                pos[torch.arange(len(r)), r] = False
                allowed[torch.arange(len(r)), r] = False
            exact = masked_logsumexp(logits[r].masked_fill(~allowed, 0), allowed) - masked_logsumexp(
                logits[r].masked_fill(~allowed, 0), pos
            )
            per_row = per_row.masked_scatter(under, exact)
        return per_row.mean()
