"""FastAP: average precision optimised through soft histogram binning.

Cakir, He, Xia, Kulis, Sclaroff, "Deep Metric Learning to Rank", CVPR 2019. For each anchor
``i`` the distances to the reference set are binned into ``L + 1`` bins centred at
``z_l = l * Delta`` (``Delta = d_max / L``) with the triangular kernel
``delta(d, z_l) = max(0, 1 - |d - z_l| / Delta)``::

    h+_l = sum_{j in P_i} delta(d_ij, z_l)         h_l = sum_{j in P_i or N_i} delta(d_ij, z_l)
    H+_l = sum_{l' <= l} h+_l'                     H_l = sum_{l' <= l} h_l'
    FastAP_i = 1/|P_i| sum_l h+_l H+_l / H_l       (terms with h+_l H+_l = 0 or H_l = 0 skipped)
    L = 1 - mean_{i: |P_i| > 0} FastAP_i

``d`` is the (squared by default) Euclidean distance between L2-normalised embeddings, so
``d_max = 2 ** power`` (4 for squared, 2 for plain). Each distance falls in at most two adjacent
bins, so the histograms are built with two ``scatter_add`` calls: ``O(B R + B L)`` memory,
never the ``(L + 1) x B x R`` kernel tensor. Equivalent to
``pytorch_metric_learning.losses.FastAPLoss(num_bins)`` (default ``LpDistance(power=2)``)
without a miner.
"""

from __future__ import annotations

import torch

from dmlkit.distances import BaseDistance, LpDistance
from dmlkit.exceptions import ConfigError
from dmlkit.losses._pairs import pair_masks, pair_matrix
from dmlkit.losses.base import BaseLoss, register_loss
from dmlkit.validation import check_integer

__all__ = ["FastAPLoss", "soft_histograms"]


def soft_histograms(
    dist: torch.Tensor, masks: tuple[torch.Tensor, ...], num_bins: int, d_max: float
) -> list[torch.Tensor]:
    """Triangular-kernel histograms of each row of ``dist`` (``(B, R)``), one per mask.

    Returns ``(B, num_bins + 1)`` tensors: ``h[i, l] = sum_{j: mask[i, j]} max(0, 1 - |d_ij -
    z_l| / Delta)`` with ``z_l = l * d_max / num_bins``. Distances beyond ``d_max + Delta`` (or
    below ``-Delta``) contribute nothing, exactly as the kernel says. Differentiable in ``dist``.
    The masks must be disjoint: all of them are filled by the same two ``scatter_add`` calls
    (lower and upper neighbouring bin), each mask owning its own block of columns.
    """
    width = num_bins + 2  # bins 0..num_bins, plus one spare column per block
    delta = d_max / num_bins
    scaled = dist / delta
    lower = torch.floor(scaled.detach())
    frac = scaled - lower  # in [0, 1): weight of the upper bin
    block = torch.full(dist.shape, len(masks), dtype=torch.long, device=dist.device)
    for k, mask in enumerate(masks):
        block.masked_fill_(mask, k)
    used = block < len(masks)
    base = lower.long().clamp(-1, num_bins + 1)
    hist = dist.new_zeros(dist.shape[0], width * len(masks) + 1)
    dump = width * len(masks)  # excluded pairs and out-of-range bins land here
    for offset, weight in ((0, 1 - frac), (1, frac)):
        idx = base + offset
        ok = used & (idx >= 0) & (idx <= num_bins)
        col = torch.where(ok, idx + block * width, dump)
        hist = hist.scatter_add(1, col, torch.where(ok, weight, 0.0))
    return [hist[:, k * width : k * width + num_bins + 1] for k in range(len(masks))]


@register_loss("fastap")
class FastAPLoss(BaseLoss):
    """FastAP (Cakir et al., "Deep Metric Learning to Rank", CVPR 2019); see the module docstring.

    ``L = 1 - mean_i 1/|P_i| sum_l h+_l H+_l / H_l`` over anchors with at least one positive.

    Args:
        num_bins: ``L``, the number of histogram intervals (paper and pml: 10; bins have
            ``L + 1`` centres ``0, Delta, ..., d_max``).
        distance: an :class:`~dmlkit.distances.LpDistance` with ``p = 2`` on normalised
            embeddings (``power=2`` squared, the default, or ``power=1``); the histogram needs
            the bounded range ``[0, 2 ** power]``.

    Miner indices restrict the histograms to the mined positive and negative pairs (pml uses a
    miner only to weight anchors). ``ref_emb`` adds a reference set (cross-batch memory).
    """

    accepts_indices = True

    def __init__(self, num_bins: int = 10, distance: BaseDistance | str | None = None) -> None:
        super().__init__(distance)
        d = self.distance
        if not (isinstance(d, LpDistance) and d.p == 2 and d.normalize_embeddings):
            raise ConfigError(
                "fastap needs the Euclidean distance on L2-normalised embeddings (bounded range): "
                f"use LpDistance(power=2) or LpDistance(power=1), got {d!r}"
            )
        self.num_bins = check_integer(num_bins, "num_bins")

    @staticmethod
    def default_distance() -> BaseDistance:
        return LpDistance(power=2)

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        pos, neg = pair_masks(labels, indices, ref_labels)
        num_pos = pos.sum(1)
        has_pos = num_pos > 0
        if not bool(has_pos.any()):
            return self.zero_loss(embeddings)
        dist = pair_matrix(self.distance, embeddings, ref_emb)
        d_max = float(2**self.distance.power)
        h_pos, h_neg = soft_histograms(dist, (pos, neg & ~pos), self.num_bins, d_max)
        h_all = h_pos + h_neg
        cum_pos = torch.cumsum(h_pos, 1)
        cum_all = torch.cumsum(h_all, 1)
        numer = h_pos * cum_pos
        safe = (numer > 0) & (cum_all > 0)
        ratio = torch.where(safe, numer / torch.where(safe, cum_all, torch.ones_like(cum_all)), 0.0)
        ap = ratio.sum(1)[has_pos] / num_pos[has_pos].to(ratio.dtype)
        return 1 - ap.mean()
