"""Triplet miners: every triplet, batch-hard, batch-all and semi-hard (see :mod:`dmlkit.miners`)."""

from __future__ import annotations

import math

import torch

from dmlkit.exceptions import ConfigError
from dmlkit.losses._pairs import block_elements  # one home for losses and miners
from dmlkit.miners.base import (
    BaseMiner,
    Triplets,
    _empty_like,
    _expand,
    register_miner,
)
from dmlkit.validation import check_integer, check_number


class _BandTripletMiner(BaseMiner):
    """Triplet miners that select, for each positive pair ``(a, p)``, negatives of ``a`` by
    comparing ``d(a, n)`` with ``d(a, p)``. Two exact strategies, same triplets:

    * ``"blocks"``: positive pairs are processed in blocks of ``~4M / R`` pairs on a CPU
      (larger on a GPU: :func:`dmlkit.losses._pairs.block_elements`); for each block the
      ``(pairs x R)`` comparison is one vectorised mask. Work ``O(P R)`` for ``P``
      positive pairs, memory ``O(B^2 + output)``; best when anchors have few positives (the
      usual ``M = 4`` batches: ``P = 3B``).
    * ``"sort"``: each anchor's negatives are sorted once (``O(B R log R)``) and every
      positive pair reads a contiguous band of its sorted row (``torch.searchsorted``); best
      when anchors have many positives (few classes per batch).

    ``strategy="auto"`` (default) takes ``"blocks"`` when ``P <= 8 B``. Triplets are grouped by
    positive pair; the order of the negatives within a pair is not specified. Where one
    negative is chosen among negatives at an equal distance, it is the smaller index, with
    either strategy.
    """

    def __init__(
        self, distance=None, max_triplets: int | None = None, strategy: str = "auto"
    ) -> None:
        super().__init__(distance)
        if max_triplets is not None:
            check_integer(max_triplets, "max_triplets", least=0, hint=" or None")
        if strategy not in ("auto", "blocks", "sort"):
            raise ConfigError(f"strategy must be 'auto', 'blocks' or 'sort', got {strategy!r}")
        self.max_triplets = max_triplets
        self.strategy = strategy

    def _use_blocks(self, num_pos_pairs: int, batch: int) -> bool:
        if self.strategy == "auto":
            return num_pos_pairs <= 8 * batch
        return self.strategy == "blocks"

    def _check_size(self, total: int) -> None:
        if self.max_triplets is not None and total > self.max_triplets:
            gib = total * 3 * 8 / 2**30
            raise ConfigError(
                f"{type(self).__name__} would return at least {total:,} triplets ({gib:.1f} GiB "
                f"of indices), above max_triplets={self.max_triplets:,}. Call the loss without "
                "indices (its built-in all-triplets mode, O(B^2) memory), use the batch_all "
                "miner with nonzero=True or batch_hard/semi_hard, use a smaller batch, or "
                "raise max_triplets."
            )

    # -- label-only expansion (every negative of the anchor) ------------------------------
    def _all_negatives(self, a: torch.Tensor, p: torch.Tensor, neg: torch.Tensor) -> Triplets:
        """Every ``(a, p, n)`` with ``n`` a negative of ``a``, in lexicographic order, without
        any sort: the row-major list of negatives plus per-anchor offsets."""
        _, n_flat = torch.where(neg)
        count = neg.sum(1)
        start = torch.cumsum(count, 0) - count
        counts = count[a]
        self._check_size(int(counts.sum()))
        a_t, p_t, k = _expand(a, p, counts)
        return a_t, p_t, n_flat[start[a_t] + k]

    # -- block strategy --------------------------------------------------------------------
    @staticmethod
    def _blocks(a: torch.Tensor, p: torch.Tensor, f: torch.Tensor, neg: torch.Tensor):
        """Yield ``(a_blk, p_blk, f[a_blk], d(a, p) as (blk, 1), neg[a_blk])``."""
        step = max(1, block_elements(f.device) // max(1, f.shape[1]))
        for s in range(0, a.numel(), step):
            ab, pb = a[s : s + step], p[s : s + step]
            fa = f[ab]
            yield ab, pb, fa, fa.gather(1, pb.unsqueeze(1)), neg[ab]

    def _block_select(self, a, p, f, neg, condition) -> Triplets:
        """Triplets where ``condition(f_an (blk, R), f_ap (blk, 1), is_neg (blk, R))`` holds."""
        parts: list[Triplets] = []
        total = 0
        for ab, pb, fa, fap, na in self._blocks(a, p, f, neg):
            rows, n = torch.nonzero(condition(fa, fap, na), as_tuple=True)
            total += rows.numel()
            self._check_size(total)
            parts.append((ab[rows], pb[rows], n))
        if not parts:
            return _empty_like(f.device, 3)
        return tuple(torch.cat(t) for t in zip(*parts))

    # -- sort strategy ---------------------------------------------------------------------
    @staticmethod
    def _sorted_negatives(f: torch.Tensor, neg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's values sorted, non-negatives (``inf``) last, and the column order; stable,
        so tied negatives stay in index order and a band's first one is the smaller index (the
        tie rule of the ``"blocks"`` strategy: an unstable sort picked any of them)."""
        return torch.sort(f.masked_fill(~neg, math.inf), dim=1, stable=True)

    def _band(self, a, p, lo, hi, order) -> Triplets:
        """Triplets ``(a, p, order[a, lo + k])`` for ``k < hi - lo``."""
        counts = (hi - lo).clamp_min(0)
        self._check_size(int(counts.sum()))
        a_t, p_t, k = _expand(a, p, counts)
        lo_t = torch.repeat_interleave(lo, counts, output_size=a_t.numel())
        return a_t, p_t, order[a_t, lo_t + k]


@register_miner("all_triplets")
class AllTripletsMiner(_BandTripletMiner):
    """Every valid triplet ``(a, p, n)``: ``y_a == y_p != y_n``, ``a != p``.

    There are ``sum_a P_a N_a`` of them (``O(B^3)``), returned in lexicographic ``(a, p, n)``
    order (as pytorch-metric-learning's ``get_all_triplets_indices``), built from the
    ``O(B^2)`` label masks with memory proportional to the output. Only for small batches:
    above ``max_triplets`` (default ``2**25``, i.e. ~0.8 GiB of int64 indices) a
    :class:`~dmlkit.exceptions.ConfigError` points to the losses' built-in all-triplets mode
    (call the loss without ``indices``), which never materialises the triplets.
    """

    def __init__(self, distance=None, max_triplets: int | None = 2**25) -> None:
        super().__init__(distance, max_triplets)

    def mine(self, embeddings, labels, ref_emb, ref_labels, same):
        pos, neg = self.label_masks(labels, ref_labels, same)
        a, p = torch.where(pos)
        return self._all_negatives(a, p, neg)


# --------------------------------------------------------------------------------------------
# Triplet miners
# --------------------------------------------------------------------------------------------
@register_miner("batch_hard")
class BatchHardMiner(BaseMiner):
    """Batch hard (Hermans, Beyer, Leibe, "In Defense of the Triplet Loss for Person
    Re-Identification", 2017): one triplet per anchor,

    ``p*(a) = argmax_{p: y_p = y_a, p != a} d(a, p)``, ``n*(a) = argmin_{n: y_n != y_a} d(a, n)``

    (for similarities: lowest-similarity positive, highest-similarity negative). Anchors with
    no positive or no negative are skipped. ``O(B^2)``; matches pytorch-metric-learning's
    ``BatchHardMiner``.
    """

    def mine(self, embeddings, labels, ref_emb, ref_labels, same):
        f = self.farness(embeddings, ref_emb, same)
        pos, neg = self.label_masks(labels, ref_labels, same)
        p = f.masked_fill(~pos, -math.inf).argmax(1)
        n = f.masked_fill(~neg, math.inf).argmin(1)
        keep = pos.any(1) & neg.any(1)
        a = torch.nonzero(keep).squeeze(1)
        return a, p[a], n[a]


@register_miner("batch_all")
class BatchAllMiner(_BandTripletMiner):
    """Batch all (Hermans et al. 2017): every valid triplet, or with ``nonzero=True``
    (default, the paper's "BA != 0") only those that violate the margin,

    ``m(a, p, n) < margin`` where ``m = d(a, n) - d(a, p)`` (or ``s(a, p) - s(a, n)``),

    i.e. the triplets whose hinge loss ``[margin - m]_+`` is non-zero. The loss then averages
    over what it is given, so ``batch_all(nonzero=False)`` + mean = "BA" and ``nonzero=True`` +
    mean = "BA != 0". Equivalent to pytorch-metric-learning's
    ``TripletMarginMiner(margin, type_of_triplets="all")`` (which keeps ``m <= margin``).

    The output has up to ``O(B^3)`` triplets; they are mined per block of positive pairs (or
    from sorted negatives, see ``strategy``) in ``O(B^2 + output)`` memory, never a ``B^3``
    tensor; ``max_triplets`` (default ``None`` = no limit) raises a clear error instead of
    allocating more.
    """

    def __init__(
        self,
        margin: float = 0.2,
        nonzero: bool = True,
        distance=None,
        max_triplets: int | None = None,
        strategy: str = "auto",
    ) -> None:
        super().__init__(distance, max_triplets, strategy)
        self.margin = check_number(margin, "margin")
        self.nonzero = bool(nonzero)

    def mine(self, embeddings, labels, ref_emb, ref_labels, same):
        pos, neg = self.label_masks(labels, ref_labels, same)
        a, p = torch.where(pos)
        if not self.nonzero:
            return self._all_negatives(a, p, neg)
        f = self.farness(embeddings, ref_emb, same)
        margin = self.margin
        if self._use_blocks(a.numel(), f.shape[0]):
            return self._block_select(a, p, f, neg, lambda fa, fap, na: na & (fa < fap + margin))
        sorted_f, order = self._sorted_negatives(f, neg)
        hi = torch.searchsorted(sorted_f, f + margin, side="left")[a, p]
        return self._band(a, p, torch.zeros_like(hi), hi, order)

    def extra_repr(self) -> str:
        return f"margin={self.margin}, nonzero={self.nonzero}, {super().extra_repr()}"


@register_miner("semi_hard")
class SemiHardMiner(_BandTripletMiner):
    """Semi-hard negatives (Schroff, Kalenichenko, Philbin, "FaceNet", CVPR 2015).

    For every positive pair ``(a, p)`` the semi-hard negatives are those farther from the
    anchor than the positive but inside the margin:

    ``d(a, p) < d(a, n) < d(a, p) + margin``  (similarities: ``s(a, p) - margin < s(a, n) < s(a, p)``).

    * ``negatives="hardest"`` (default, FaceNet): one triplet per positive pair, with the
      *closest* semi-hard negative. If the pair has no negative farther than its positive at
      all, ``fallback`` decides: ``"easiest"`` (default) takes the farthest negative - the
      rule of the FaceNet reference implementation (TensorFlow's ``triplet_semihard_loss``),
      which avoids the hardest negatives that FaceNet found to collapse training early -,
      ``"hardest"`` the closest negative, ``"none"`` drops the pair. A pair whose closest
      farther negative is already outside the margin has zero loss and is dropped.
    * ``negatives="all"``: every semi-hard negative of every positive pair (what
      pytorch-metric-learning's ``TripletMarginMiner(type_of_triplets="semihard")`` returns);
      ``fallback`` is not used.

    ``strategy`` as for :class:`BatchAllMiner` (same triplets either way: of negatives at an
    equal distance, the chosen one is the smaller index).
    """

    def __init__(
        self,
        margin: float = 0.2,
        negatives: str = "hardest",
        fallback: str = "easiest",
        distance=None,
        max_triplets: int | None = None,
        strategy: str = "auto",
    ) -> None:
        super().__init__(distance, max_triplets, strategy)
        if negatives not in ("hardest", "all"):
            raise ConfigError(f"negatives must be 'hardest' or 'all', got {negatives!r}")
        if fallback not in ("easiest", "hardest", "none"):
            raise ConfigError(f"fallback must be 'easiest', 'hardest' or 'none', got {fallback!r}")
        self.margin = check_number(margin, "margin")
        self.negatives = negatives
        self.fallback = fallback

    def mine(self, embeddings, labels, ref_emb, ref_labels, same):
        f = self.farness(embeddings, ref_emb, same)
        pos, neg = self.label_masks(labels, ref_labels, same)
        a, p = torch.where(pos)
        margin = self.margin
        if self._use_blocks(a.numel(), f.shape[0]):
            if self.negatives == "all":
                return self._block_select(
                    a, p, f, neg, lambda fa, fap, na: na & (fa > fap) & (fa < fap + margin)
                )
            return self._hardest_blocks(a, p, f, neg)
        sorted_f, order = self._sorted_negatives(f, neg)
        lo = torch.searchsorted(sorted_f, f, side="right")[a, p]
        hi = torch.searchsorted(sorted_f, f + margin, side="left")[a, p]
        if self.negatives == "all":
            return self._band(a, p, lo, hi, order)
        num_neg = neg.sum(1)
        n = order[a, lo.clamp_max(order.shape[1] - 1)]
        keep = lo < hi
        if self.fallback != "none":
            all_hard = (lo >= num_neg[a]) & (num_neg[a] > 0)
            col = self._fallback_columns(sorted_f, num_neg)[a]
            n = torch.where(all_hard, order[a, col], n)
            keep = keep | all_hard
        return a[keep], p[keep], n[keep]

    def _fallback_columns(self, sorted_f: torch.Tensor, num_neg: torch.Tensor) -> torch.Tensor:
        """Per anchor row, the column of the stably sorted negatives that ``fallback`` takes:
        the first (closest, smallest index among ties) for ``"hardest"``; for ``"easiest"`` the
        first of the values equal to the largest, so a tied farthest negative is the smaller
        index too, as ``argmax`` gives it in the ``"blocks"`` strategy (the last column was the
        largest index)."""
        if self.fallback == "hardest":
            return torch.zeros_like(num_neg)
        last = (num_neg - 1).clamp_min(0).unsqueeze(1)
        return torch.searchsorted(sorted_f, sorted_f.gather(1, last), side="left").squeeze(1)

    def _hardest_blocks(self, a, p, f, neg) -> Triplets:
        if self.fallback != "none":
            fallback_f = f.masked_fill(~neg, -math.inf if self.fallback == "easiest" else math.inf)
            fallback_n = fallback_f.argmax(1) if self.fallback == "easiest" else fallback_f.argmin(1)
            has_neg = neg.any(1)
        parts: list[Triplets] = []
        for ab, pb, fa, fap, na in self._blocks(a, p, f, neg):
            farther = na & (fa > fap)
            closest, n = fa.masked_fill(~farther, math.inf).min(1)
            keep = closest < fap.squeeze(1) + self.margin
            if self.fallback != "none":
                all_hard = ~farther.any(1) & has_neg[ab]
                n = torch.where(all_hard, fallback_n[ab], n)
                keep = keep | all_hard
            parts.append((ab[keep], pb[keep], n[keep]))
        if not parts:
            return _empty_like(f.device, 3)
        return tuple(torch.cat(t) for t in zip(*parts))

    def extra_repr(self) -> str:
        return (
            f"margin={self.margin}, negatives={self.negatives!r}, fallback={self.fallback!r}, "
            f"{super().extra_repr()}"
        )
