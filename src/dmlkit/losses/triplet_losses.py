"""Triplet-based losses: triplet margin (hard/soft, batch-all/non-zero/hard), angular, N-pairs,
tuplet margin.

None of them builds a ``B x B x B`` tensor. "All triplets" are handled per anchor on the
``(B, R)`` positive/negative structure:

* hinge triplet, batch-all: each anchor's negatives are sorted once; for a positive ``p`` the
  violating negatives are a prefix found by binary search, and their summed hinge is
  ``c * (d_ap + m) - (sum of the c smallest d_an)`` from a cumulative sum (float64) -
  ``O(B R log R)`` time, ``O(B R)`` memory, exact value and gradient;
* soft-margin triplet and angular: blocks of anchors (or positive pairs), each checkpointed, so
  memory stays ``O(block x R)`` while the time is the number of triplets.

Half-precision inputs are computed in float32 (the returned loss is float32). A batch without
a usable triplet or pair returns :meth:`BaseLoss.zero_loss`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dmlkit.distances import BaseDistance, CosineSimilarity, DotProductSimilarity, LpDistance
from dmlkit.exceptions import ConfigError
from dmlkit.losses._pairs import (
    as_distance,
    block_elements,
    check_indices,
    compact_mask,
    indices_kind,
    label_masks,
    masked_logsumexp,
    pair_masks,
    pair_matrix,
    safe_normalize,
    to_pair_indices,
    upcast,
)
from dmlkit.losses.base import BaseLoss, register_loss
from dmlkit.losses.classification_losses import _check_positive
from dmlkit.losses.pair_losses import _check_choice

__all__ = ["AngularLoss", "NPairsLoss", "TripletMarginLoss", "TupletMarginLoss"]

#: Hinge triplets over all triplets use the sorting path when an anchor has more positives.
SORT_ABOVE_POSITIVES = 8


def _matrix(distance: BaseDistance, embeddings: torch.Tensor, ref_emb: torch.Tensor | None):
    return pair_matrix(distance, embeddings, ref_emb)


def _blocks(n: int, per_item: int, device: torch.device) -> list[tuple[int, int]]:
    """Ranges of ``n`` items of ``per_item`` elements each, :func:`block_elements` a block."""
    size = max(1, block_elements(device) // max(1, per_item))
    return [(s, min(n, s + size)) for s in range(0, n, size)]


def _maybe_checkpoint(fn, *args, single_block: bool = False):
    """``fn(*args)``, checkpointed (recomputed in backward) unless it is the only block."""
    if (
        not single_block
        and torch.is_grad_enabled()
        and any(a is not None and a.requires_grad for a in args)
    ):
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def hinge_triplet_sums(
    dist: torch.Tensor,
    pos_mask: torch.Tensor,
    neg_mask: torch.Tensor,
    margin: float,
    ratio: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-anchor ``sum_{p, n} [d_ap - d_an + m]_+`` and the count of non-zero terms; with
    ``ratio`` the sum of ``[1 - d_an / (m + d_ap)]_+`` (``m > 0``, ``d >= 0``).

    ``dist`` is ``(B, R)`` with larger = farther. Sorting-based (see module docstring); no
    ``B x B x B`` tensor. Both forms are non-zero for the same negatives, ``d_an < d_ap + m``
    (the ``c`` smallest), so a positive's ratio sum is ``c - (sum of those d_an) / (m + d_ap)``.
    Returns ``(sums (B,), counts (B,))``.
    """
    inf = torch.tensor(float("inf"), dtype=dist.dtype, device=dist.device)
    neg_sorted, _ = torch.sort(torch.where(neg_mask, dist, inf), dim=1)
    thresholds = dist + margin
    counts = torch.searchsorted(neg_sorted.detach().contiguous(), thresholds.detach().contiguous())
    counts = counts.masked_fill(~pos_mask, 0)
    csum = torch.cumsum(neg_sorted.to(torch.float64), dim=1)
    csum = torch.cat([torch.zeros_like(csum[:, :1]), csum], dim=1)
    prefix = csum.gather(1, counts)
    if ratio:
        per_pair = counts.to(torch.float64) - prefix / thresholds.to(torch.float64)
    else:
        per_pair = counts.to(torch.float64) * thresholds.to(torch.float64) - prefix
    per_pair = torch.where(pos_mask, per_pair, 0.0)
    return per_pair.sum(1).to(dist.dtype), counts.sum(1)


def blocked_triplet_sums(
    dist: torch.Tensor,
    pos_mask: torch.Tensor,
    neg_mask: torch.Tensor,
    margin: float,
    soft: bool = True,
    swap_dist: torch.Tensor | None = None,
    ratio: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-anchor ``sum_{p, n} l(d_ap - d_an + m)`` and the count of non-zero terms, with
    ``l = softplus`` (``soft``) or ``relu``; with ``ratio`` (not ``soft``) the terms are
    ``[1 - d_an / (m + d_ap)]_+``.

    Blocks of anchors over ``(block, K, R)`` with ``K`` the largest number of positives of an
    anchor; when there is more than one block each is checkpointed so that the backward pass
    recomputes it and memory stays ``O(B R + block)``. With ``swap_dist`` (the ``(R, R)``
    reference-to-reference matrix, larger = farther) ``d_an`` is replaced by
    ``min(d_an, d_pn)`` (the anchor swap of Balntas et al. 2016).
    """
    term = F.softplus if soft else F.relu
    cols, valid = compact_mask(pos_mask)
    d_pos = dist.gather(1, cols)  # (B, K)
    k, r = cols.shape[1], dist.shape[1]

    def block(dp, dn, sd, c, v, nm):
        dn = dn.unsqueeze(1)
        if sd is not None:
            dn = torch.minimum(dn, sd[c])  # (block, K, R): d_pn of each positive
        dp = dp.unsqueeze(2)
        x = 1 - dn / (dp + margin) if ratio else dp - dn + margin
        keep = v.unsqueeze(2) & nm.unsqueeze(1)
        terms = torch.where(keep, term(x), 0.0)
        return terms.sum((1, 2)), torch.count_nonzero(terms, dim=(1, 2))  # terms >= 0

    sums, counts = [], []
    blocks = _blocks(dist.shape[0], k * r, dist.device)
    for s, e in blocks:
        out_sum, out_count = _maybe_checkpoint(
            lambda dp, dn, sd, s=s, e=e: block(dp, dn, sd, cols[s:e], valid[s:e], neg_mask[s:e]),
            d_pos[s:e],
            dist[s:e],
            swap_dist,
            single_block=len(blocks) == 1,
        )
        sums.append(out_sum)
        counts.append(out_count)
    return torch.cat(sums), torch.cat(counts)


# --------------------------------------------------------------------------------------------
@register_loss("triplet")
class TripletMarginLoss(BaseLoss):
    r"""Triplet margin loss, hard or soft margin, difference or ratio form, over all or mined
    triplets.

    For a triplet ``(a, p, n)``::

        hard margin:  l = [d_ap - d_an + m]_+            (Schroff et al., FaceNet, CVPR 2015)
        soft margin:  l = softplus(d_ap - d_an + m)      (Hermans et al. 2017 use m = 0)
        ratio form:   l = [1 - d_an / (m + d_ap)]_+      (form="ratio"; seed 003)

    The ratio form is the second triplet loss of seed 003's "Triplet loss" slide,
    ``L = max{0, 1 - d(a, n) / (m + d(a, p))}``, with ``d`` the Euclidean distance or the
    cosine distance ``1 - cos``: with ``distance="cosine"`` it uses ``d = 1 - s`` (floored at
    0), with a distance ``d`` as is (it must be >= 0; a similarity other than cosine is
    refused). It is non-zero for exactly the triplets the hinge is non-zero for
    (``d_an < d_ap + m``), so every reduction, the miners and ``swap`` work unchanged (the
    hardest triplet of an anchor is still its farthest positive and nearest negative). It
    needs ``m > 0``: identical anchor and positive (``d_ap = 0``) would divide by ``m``;
    soft margin is refused (it is defined for the difference form only).

    Reductions (Hermans, Beyer, Leibe, "In Defense of the Triplet Loss for Person
    Re-Identification", arXiv:1703.07737; seed 003):

    * ``"batch_all"``: mean of ``l`` over all valid triplets (``L_BA``);
    * ``"batch_all_nonzero"`` (default): mean over the triplets with ``l > 0`` (``L_BA!=0``;
      pytorch-metric-learning's ``AvgNonZeroReducer``);
    * ``"batch_hard"``: per anchor the hardest positive and hardest negative,
      ``[m + max_p d_ap - min_n d_an]_+``, averaged over anchors (``L_BH``); with mined
      triplets, each anchor's largest ``l`` (the same thing over its triplets).

    Triplets: without ``indices`` every valid ``(a, p, n)`` of the batch (``a != p``, computed
    per anchor in ``O(B R)`` memory); with pair ``indices`` every ``(a, p, n)`` such that
    ``(a, p)`` is a mined positive and ``(a, n)`` a mined negative pair; with triplet
    ``indices`` exactly those triplets.

    Anchor swap (``swap=True``; Balntas, Riba, Ponsa, Mikolajczyk, "Learning local feature
    descriptors with triplets and shallow convolutional neural networks", BMVC 2016): the
    negative's distance is the smaller of ``d_an`` and ``d_pn`` (the positive acts as the
    anchor when it is closer to the negative)::

        l = [d_ap - min(d_an, d_pn) + m]_+        (for a similarity: max(s_an, s_pn))

    ``d_pn`` is measured between the positive and the negative in the reference set (with
    ``ref_emb`` both come from it). With ``reduction="batch_hard"`` and no triplet indices the
    swap is applied to each anchor's hardest positive and hardest negative (as
    pytorch-metric-learning's batch-hard miner followed by its swapped loss). The swapped all-triplets hinge uses the blocked path
    (``O(block x K x R)`` memory) instead of the sorting path.

    Defaults: ``margin = 0.2`` (FaceNet), Euclidean distance on L2-normalised embeddings
    (``distance=LpDistance()``; ``LpDistance(power=2)`` for FaceNet's squared distance),
    ``form="difference"``.
    pml equivalent: ``pml.losses.TripletMarginLoss(margin=m, swap=swap, smooth_loss=soft_margin)``
    with its default ``AvgNonZeroReducer`` = ``reduction="batch_all_nonzero"`` (none for the
    ratio form).
    """

    accepts_indices = True
    #: The values of ``reduction`` and of ``form``.
    REDUCTIONS = ("batch_all", "batch_all_nonzero", "batch_hard")
    FORMS = ("difference", "ratio")

    def __init__(
        self,
        margin: float = 0.2,
        distance: BaseDistance | str | None = None,
        soft_margin: bool = False,
        reduction: str = "batch_all_nonzero",
        swap: bool = False,
        form: str = "difference",
    ) -> None:
        super().__init__(distance)
        _check_choice("reduction", reduction, self.REDUCTIONS)
        _check_choice("form", form, self.FORMS)
        if form == "ratio":
            if soft_margin:
                raise ConfigError("soft_margin is for form='difference'; form='ratio' is a hinge")
            if not margin > 0:
                raise ConfigError(
                    f"form='ratio' needs margin > 0 (it divides by margin + d_ap), got {margin}"
                )
            if self.distance.higher_is_closer and not isinstance(self.distance, CosineSimilarity):
                raise ConfigError(
                    "form='ratio' needs a distance >= 0 or distance='cosine' (d = 1 - cos), "
                    f"got {self.distance!r}"
                )
        self.margin = float(margin)
        self.soft_margin = soft_margin
        self.reduction = reduction
        self.swap = bool(swap)
        self.form = form

    @staticmethod
    def default_distance() -> BaseDistance:
        return LpDistance()

    def _term(self, x: torch.Tensor) -> torch.Tensor:
        return F.softplus(x) if self.soft_margin else F.relu(x)

    def _triplet_term(self, d_ap: torch.Tensor, d_an: torch.Tensor) -> torch.Tensor:
        """``l`` of triplets with these distances (larger = farther, :meth:`_dist`)."""
        if self.form == "ratio":
            return F.relu(1 - d_an / (self.margin + d_ap))
        return self._term(d_ap - d_an + self.margin)

    def _dist(self, values: torch.Tensor) -> torch.Tensor:
        """Distances or similarities as the form's distance: larger = farther (``-s`` for a
        similarity in the difference form, ``1 - cos`` floored at 0 in the ratio form)."""
        if self.form == "ratio" and self.distance.higher_is_closer:
            return (1 - values).clamp_min(0)
        return as_distance(values, self.distance)

    def _ref_dist(self, dist: torch.Tensor, ref_emb: torch.Tensor | None) -> torch.Tensor:
        """The ``(R, R)`` reference-to-reference distances (larger = farther) for the swap."""
        if ref_emb is None:
            return dist
        return self._dist(_matrix(self.distance, ref_emb, None))

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        dist = self._dist(_matrix(self.distance, embeddings, ref_emb))
        if indices is not None and indices_kind(indices) == "triplet":
            return self._from_triplets(embeddings, dist, indices, ref_emb)
        pos_mask, neg_mask = pair_masks(labels, indices, ref_labels)
        has_pos, has_neg = pos_mask.any(1), neg_mask.any(1)
        valid = has_pos & has_neg
        if not valid.any():
            return self.zero_loss(embeddings)
        if self.reduction == "batch_hard":
            hardest_pos, p_idx = dist.masked_fill(~pos_mask, float("-inf")).max(1)
            hardest_neg, n_idx = dist.masked_fill(~neg_mask, float("inf")).min(1)
            if self.swap:
                d_pn = self._ref_dist(dist, ref_emb)[p_idx, n_idx]
                hardest_neg = torch.minimum(hardest_neg, d_pn)
            # masked rows hold -inf / inf (their d_ap + m is never a divisor: zeroed below)
            hardest_pos = torch.where(valid, hardest_pos, 0.0)
            hardest_neg = torch.where(valid, hardest_neg, 0.0)
            terms = self._triplet_term(hardest_pos, hardest_neg)
            return torch.where(valid, terms, 0.0).sum() / valid.sum()
        max_pos = int(torch.count_nonzero(pos_mask, dim=1).max())
        ratio = self.form == "ratio"
        if self.swap or self.soft_margin or max_pos <= SORT_ABOVE_POSITIVES:
            sums, counts = blocked_triplet_sums(
                dist,
                pos_mask,
                neg_mask,
                self.margin,
                soft=self.soft_margin,
                swap_dist=self._ref_dist(dist, ref_emb) if self.swap else None,
                ratio=ratio,
            )
        else:
            sums, counts = hinge_triplet_sums(dist, pos_mask, neg_mask, self.margin, ratio=ratio)
        if self.reduction == "batch_all":
            n_triplets = (
                torch.count_nonzero(pos_mask, dim=1) * torch.count_nonzero(neg_mask, dim=1)
            ).sum()
            return sums.sum() / n_triplets
        return sums.sum() / counts.sum().clamp_min(1)

    def _from_triplets(self, embeddings, dist, indices, ref_emb):
        check_indices(indices, embeddings.shape[0], dist.shape[1])
        a, p, n = indices
        if a.numel() == 0:
            return self.zero_loss(embeddings)
        d_an = dist[a, n]
        if self.swap:
            ref = embeddings if ref_emb is None else ref_emb
            d_pn = self.distance.paired(upcast(ref[p]), upcast(ref[n]))
            d_an = torch.minimum(d_an, self._dist(d_pn))
        terms = self._triplet_term(dist[a, p], d_an)
        if self.reduction == "batch_all":
            return terms.mean()
        if self.reduction == "batch_all_nonzero":
            return terms.sum() / (terms > 0).sum().clamp_min(1)
        hardest = torch.zeros(dist.shape[0], dtype=terms.dtype, device=terms.device)
        hardest = hardest.scatter_reduce(0, a, terms, reduce="amax", include_self=False)
        present = torch.bincount(a, minlength=dist.shape[0]) > 0
        return hardest[present].mean()


# --------------------------------------------------------------------------------------------
@register_loss("angular")
class AngularLoss(BaseLoss):
    r"""Angular loss, N-pair form (Wang et al. 2017, eq. 8).

    With L2-normalised embeddings and, for every positive pair ``(a, p)``, all negatives ``n``
    of ``a``::

        f_apn = 4 tan^2(alpha) (x_a + x_p)^T x_n - 2 (1 + tan^2(alpha)) x_a^T x_p
        L     = mean over positive pairs of  log(1 + sum_n exp(f_apn))

    Wang, Zhou, Wen, Liu, Lin, "Deep Metric Learning with Angular Loss", ICCV 2017; ``alpha``
    in degrees (the paper uses 36-55; default 40, pytorch-metric-learning's). The distance is
    fixed (Euclidean geometry of normalised embeddings), so there is no ``distance`` argument.
    Memory ``O(block x R)``: positive pairs are processed in checkpointed blocks.

    Positive pairs: all of the batch, or the mined ones (pairs, or a triplet's ``(a, p)``,
    duplicates kept); negatives: every reference whose label differs from the anchor's (as
    ``pml.losses.AngularLoss(alpha=40)``, which this equals on L2-normalised inputs - pml forms
    its products with the raw reference rows, so on other inputs the two differ - except on mined
    pairs without a negative pair: pml then returns 0, although it too ignores which negatives
    were mined).
    """

    accepts_indices = True

    def __init__(self, alpha: float = 40.0) -> None:
        super().__init__(LpDistance(p=2, power=1, normalize_embeddings=True))
        if not 0 < alpha < 90:
            raise ConfigError(f"alpha is an angle in degrees in (0, 90), got {alpha}")
        self.alpha = float(alpha)

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        x = safe_normalize(upcast(embeddings), dim=1)
        ref = x if ref_emb is None else safe_normalize(upcast(ref_emb), dim=1)
        ref_lab = labels if ref_labels is None else ref_labels
        if indices is None:
            pos_mask, _ = label_masks(labels, ref_labels)
            a1, p = pos_mask.nonzero(as_tuple=True)
        else:
            check_indices(indices, x.shape[0], ref.shape[0])
            a1, p, _, _ = to_pair_indices(indices)
        neg_mask = labels.unsqueeze(1) != ref_lab.unsqueeze(0)
        if a1.numel() == 0 or not neg_mask.any(1)[a1].any():
            return self.zero_loss(embeddings)
        tan2 = math.tan(math.radians(self.alpha)) ** 2

        def block(xq, xr, ia, ip):
            # (x_a + x_p)^T x_n in one product from the block's rows: no (B, R) similarity
            # matrix is gathered, so the backward adds (block, D) rows, not a zero-filled (B, R)
            # gradient a block
            a, b = xq[ia], xr[ip]
            f = 4 * tan2 * ((a + b) @ xr.T) - 2 * (1 + tan2) * (a * b).sum(1, keepdim=True)
            return masked_logsumexp(f, neg_mask[ia], dim=1, add_one=True)

        losses = []
        blocks = _blocks(a1.numel(), ref.shape[0], ref.device)
        for s, e in blocks:
            ia, ip = a1[s:e], p[s:e]
            losses.append(
                _maybe_checkpoint(
                    lambda xq, xr, ia=ia, ip=ip: block(xq, xr, ia, ip),
                    x,
                    ref,
                    single_block=len(blocks) == 1,
                )
            )
        return torch.cat(losses).mean()


# --------------------------------------------------------------------------------------------
@register_loss("n_pairs")
class NPairsLoss(BaseLoss):
    r"""Multi-class N-pair loss (Sohn 2016).

    One positive pair ``(x_i, x_i^+)`` per class present (the first anchor of each class and
    its first positive), and for each::

        L_i = log(1 + sum_{j != i} exp(s(x_i, x_j^+) - s(x_i, x_i^+)))
            = cross-entropy of the row s(x_i, x_.^+) with target i

    Sohn, "Improved Deep Metric Learning with Multi-class N-pair Loss Objective", NIPS 2016.
    ``s`` is the dot product (default ``DotProductSimilarity()``, on L2-normalised embeddings
    as in pytorch-metric-learning; Sohn uses raw embeddings with an L2 penalty: pass
    ``DotProductSimilarity(normalize_embeddings=False)``); for a distance ``s = -d``.
    With mined ``indices``: the first mined positive pair of each anchor class. Equal to
    ``pml.losses.NPairsLoss()``. With ``ref_emb`` the positives come from the reference set.
    """

    accepts_indices = True

    @staticmethod
    def default_distance() -> BaseDistance:
        return DotProductSimilarity()

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        ref = embeddings if ref_emb is None else ref_emb
        if indices is None:
            pos_mask, _ = label_masks(labels, ref_labels)
            cand = pos_mask.any(1).nonzero(as_tuple=True)[0]
            a_all, p_all = cand, None
        else:
            check_indices(indices, embeddings.shape[0], ref.shape[0])
            a_all, p_all, _, _ = to_pair_indices(indices)
        if a_all.numel() == 0:
            return self.zero_loss(embeddings)
        uniq, inverse = torch.unique(labels[a_all], return_inverse=True)
        order = torch.arange(a_all.numel(), device=a_all.device)
        first = torch.full((uniq.numel(),), a_all.numel(), device=a_all.device, dtype=order.dtype)
        first = first.scatter_reduce(0, inverse, order, reduce="amin")
        anchors = a_all[first]
        if p_all is None:
            positives = pos_mask[anchors].to(torch.uint8).argmax(1)
        else:
            positives = p_all[first]
        sim = pair_matrix(self.distance, embeddings[anchors], ref[positives])
        logits = sim if self.distance.higher_is_closer else -sim
        targets = torch.arange(anchors.numel(), device=logits.device)
        return F.cross_entropy(logits, targets)


# --------------------------------------------------------------------------------------------
@register_loss("tuplet_margin")
class TupletMarginLoss(BaseLoss):
    r"""Tuplet margin loss (Yu & Tao 2019).

    With cosine similarities, ``theta_ap = arccos(s_ap)``, for every positive pair ``(a, p)``
    and the negatives ``n`` of ``a``::

        L_ap = log(1 + sum_n exp(s * (cos(theta_an) - cos(theta_ap - beta))))
        L    = mean over positive pairs

    Yu, Tao, "Deep Metric Learning with Tuplet Margin Loss", ICCV 2019: slack margin
    ``beta = 5.73`` degrees (0.1 rad), scale ``s = 64``. Per anchor the negatives' log-sum-exp
    is computed once, so ``L_ap = softplus(LSE_n(s cos theta_an) - s cos(theta_ap - beta))``
    in ``O(B R)``. Needs a similarity of normalised embeddings (default cosine). With
    ``indices`` the positive and negative pairs are the mined ones (duplicates count once).
    Equal to ``pml.losses.TupletMarginLoss(margin=5.73, scale=64)``. ``arccos`` is taken on
    similarities clamped to ``[-1 + 1e-7, 1 - 1e-7]`` so identical embeddings give a finite
    gradient.
    """

    accepts_indices = True

    def __init__(
        self, margin: float = 5.73, scale: float = 64.0, distance: BaseDistance | str | None = None
    ) -> None:
        super().__init__(distance)
        if not (self.distance.higher_is_closer and self.distance.normalize_embeddings):
            raise ConfigError("TupletMarginLoss needs distance='cosine' (the default)")
        _check_positive(scale=scale)  # <= 0 turns the objective upside down or off
        self.margin = float(margin)
        self.scale = float(scale)

    @staticmethod
    def default_distance() -> BaseDistance:
        return CosineSimilarity()

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        sim = _matrix(self.distance, embeddings, ref_emb)
        pos_mask, neg_mask = pair_masks(labels, indices, ref_labels)
        if not bool(pos_mask.any() & neg_mask.any()):  # one read from the device
            return self.zero_loss(embeddings)
        eps = 1e-7
        theta = torch.acos(sim.clamp(-1 + eps, 1 - eps))
        pos_term = self.scale * torch.cos(theta - math.radians(self.margin))
        floor = torch.finfo(sim.dtype).min
        neg_lse = masked_logsumexp(self.scale * sim, neg_mask, dim=1, empty=floor)
        terms = F.softplus(neg_lse.unsqueeze(1) - pos_term)
        return torch.where(pos_mask, terms, 0.0).sum() / torch.count_nonzero(pos_mask)
