"""Online miners: choose informative pairs or triplets inside a batch.

A miner looks at a batch of embeddings and labels and returns *indices* that a loss then uses
(``loss(embeddings, labels, indices=miner(embeddings, labels))``). Two output types:

* ``"pair"``: ``(a1, p, a2, n)`` - positive pairs ``(a1[i], p[i])`` and negative pairs
  ``(a2[j], n[j])``;
* ``"triplet"``: ``(a, p, n)`` - ``label[a] == ref_label[p] != ref_label[n]``.

Anchors (``a``, ``a1``, ``a2``) index ``embeddings``; positives and negatives index the
*reference set*, which is ``ref_emb`` when given (e.g. a cross-batch memory) and ``embeddings``
itself otherwise. When the reference set is the batch itself, an anchor is never its own
positive. Pairs are *ordered*: with the batch as its own reference both ``(i, j)`` and
``(j, i)`` appear, as in pytorch-metric-learning.

Everything runs on the embeddings' device with tensor operations only (no Python loop over
pairs or triplets, no transfer to numpy, the cost pointed out in seed 003), in ``O(B^2)``
memory for a ``B x B`` batch - except where the *output itself* is larger: the triplet miners
that return many negatives per positive pair (``batch_all``, ``all_triplets``,
``semi_hard(negatives="all")``) work through blocks of positive pairs, or read each pair's
negatives off its anchor's sorted row (see :class:`_BandTripletMiner`), so their extra memory is
``O(B^2 + number of triplets returned)``; no ``B x B x B`` tensor is ever built.

Available (config name -> class):

=====================  ======================================  ==================================
name                   class                                   source
=====================  ======================================  ==================================
``all_pairs``          :class:`AllPairsMiner`                  every positive and negative pair
``all_triplets``       :class:`AllTripletsMiner`               every valid triplet (small batches)
``batch_hard``         :class:`BatchHardMiner`                 Hermans et al. 2017
``semi_hard``          :class:`SemiHardMiner`                  Schroff et al. 2015 (FaceNet)
``batch_all``          :class:`BatchAllMiner`                  Hermans et al. 2017
``hard_negative_pairs`` :class:`HardNegativePairMiner`         seed 003 (HardNegativePairSelector)
``multi_similarity``   :class:`MultiSimilarityMiner`           Wang et al. 2019
``distance_weighted``  :class:`DistanceWeightedMiner`          Wu et al. 2017
=====================  ======================================  ==================================
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar, TypeVar

import torch
from torch import nn

from dmlkit.distances import BaseDistance, CosineSimilarity, LpDistance, get_distance
from dmlkit.exceptions import ConfigError, NonFiniteError, ShapeError
from dmlkit.losses._pairs import label_masks  # the one label-mask helper of losses and miners
from dmlkit.losses.base import full_precision
from dmlkit.utils import registering

__all__ = [
    "MINERS",
    "AllPairsMiner",
    "AllTripletsMiner",
    "BaseMiner",
    "BatchAllMiner",
    "BatchHardMiner",
    "DistanceWeightedMiner",
    "HardNegativePairMiner",
    "MultiSimilarityMiner",
    "SemiHardMiner",
    "get_miner",
    "label_masks",
    "pairs_from_triplets",
    "register_miner",
    "triplets_from_pairs",
]

MINERS: dict[str, type[BaseMiner]] = {}
_T = TypeVar("_T", bound=type)

Pairs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
Triplets = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def register_miner(*names: str) -> Callable[[_T], _T]:
    """Class decorator: make a miner available to :func:`get_miner` and configs by name(s)."""
    return registering(MINERS, "miner", names)


def get_miner(name: str, **kwargs) -> BaseMiner:
    """Instantiate a registered miner by config name, e.g. ``get_miner("batch_hard")``."""
    try:
        cls = MINERS[name]
    except KeyError:
        raise ConfigError(f"unknown miner {name!r}; choose one of {sorted(MINERS)}") from None
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"bad parameters for miner {name!r}: {exc}") from exc


# --------------------------------------------------------------------------------------------
# Label masks and index conversion
# --------------------------------------------------------------------------------------------
def pairs_from_triplets(
    anchors: torch.Tensor,
    positives: torch.Tensor,
    negatives: torch.Tensor,
    *,
    unique: bool = True,
) -> Pairs:
    """Triplets ``(a, p, n)`` -> pairs ``(a, p, a, n)``.

    With ``unique=True`` (default) each positive pair ``(a, p)`` and negative pair ``(a, n)``
    appears once (sorted by anchor then reference index); with ``unique=False`` there is one
    positive and one negative pair per triplet (pytorch-metric-learning's ``convert_to_pairs``),
    so pairs shared by several triplets count several times.
    """
    if not unique:
        return anchors, positives, anchors, negatives
    a1, p = _unique_pairs(anchors, positives)
    a2, n = _unique_pairs(anchors, negatives)
    return a1, p, a2, n


def _unique_pairs(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if a.numel() == 0:
        return a.clone(), b.clone()
    width = int(b.max()) + 1
    keys = torch.unique(a * width + b)
    return keys // width, keys % width


def triplets_from_pairs(a1: torch.Tensor, p: torch.Tensor, a2: torch.Tensor, n: torch.Tensor) -> Triplets:
    """Pairs -> every triplet ``(a, p, n)`` whose positive pair ``(a, p)`` and negative pair
    ``(a, n)`` share the anchor ``a``.

    The output is ordered like the positive pairs, and for each positive pair like the negative
    pairs of its anchor. Its size is ``sum_a (#pos pairs of a) * (#neg pairs of a)``; it is built
    with ``repeat_interleave`` (memory proportional to the output, no cross product).
    """
    device = a1.device
    if a1.numel() == 0 or a2.numel() == 0:
        empty = torch.empty(0, dtype=torch.long, device=device)
        return empty, empty.clone(), empty.clone()
    size = int(torch.maximum(a1.max(), a2.max())) + 1
    order = torch.argsort(a2, stable=True)
    n_sorted = n[order]
    neg_count = torch.bincount(a2, minlength=size)
    neg_start = torch.cumsum(neg_count, 0) - neg_count
    counts = neg_count[a1]
    a_t, p_t, k = _expand(a1, p, counts)
    n_t = n_sorted[neg_start[a_t] + k]
    return a_t, p_t, n_t


def _expand(
    anchors: torch.Tensor, positives: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Repeat each ``(anchors[j], positives[j])`` ``counts[j]`` times; also return the rank
    ``k = 0 .. counts[j] - 1`` of each copy."""
    counts = counts.clamp_min(0)
    total = int(counts.sum())
    a_t = torch.repeat_interleave(anchors, counts, output_size=total)
    p_t = torch.repeat_interleave(positives, counts, output_size=total)
    seg_start = torch.cumsum(counts, 0) - counts
    k = torch.arange(total, device=anchors.device) - torch.repeat_interleave(
        seg_start, counts, output_size=total
    )
    return a_t, p_t, k


# --------------------------------------------------------------------------------------------
# Base class
# --------------------------------------------------------------------------------------------
class BaseMiner(nn.Module):
    """Base of every miner.

    Call as ``miner(embeddings (B, D), labels (B,), ref_emb=None, ref_labels=None)``; returns a
    tuple of ``int64`` index tensors on the embeddings' device: ``(a1, p, a2, n)`` when
    :attr:`output_type` is ``"pair"``, ``(a, p, n)`` when it is ``"triplet"``. Mining runs
    without gradient (the indices are constants for the loss).

    Args:
        distance: a :class:`~dmlkit.distances.BaseDistance` or its name; default cosine
            similarity (the Reality Check's L2-normalised embeddings).

    After each call, :attr:`stats` holds what was mined for logging (``num_pos_pairs`` /
    ``num_neg_pairs`` or ``num_triplets``, and ``num_anchors``) and :attr:`num_mined` the total.
    Subclasses implement :meth:`mine` on a precomputed ``(B, M)`` matrix.
    """

    output_type: ClassVar[str] = "triplet"

    def __init__(self, distance: BaseDistance | str | None = None) -> None:
        super().__init__()
        self.distance = self.default_distance() if distance is None else get_distance(distance)
        self.stats: dict[str, int] = {}

    @staticmethod
    def default_distance() -> BaseDistance:
        return CosineSimilarity()

    @property
    def num_mined(self) -> int:
        """Pairs (positive + negative) or triplets returned by the last call."""
        return sum(v for k, v in self.stats.items() if k.startswith("num_") and k != "num_anchors")

    @torch.no_grad()
    def forward(
        self,
        embeddings: torch.Tensor,
        labels: torch.Tensor,
        ref_emb: torch.Tensor | None = None,
        ref_labels: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        _check(embeddings, labels, "embeddings")
        if (ref_emb is None) != (ref_labels is None):
            raise ShapeError("pass both ref_emb and ref_labels, or neither")
        same = ref_emb is None or (ref_emb is embeddings and ref_labels is labels)
        if ref_emb is None:
            ref_emb, ref_labels = embeddings, labels
        else:
            _check(ref_emb, ref_labels, "ref_emb")
            if ref_emb.shape[1] != embeddings.shape[1]:
                raise ShapeError(
                    f"ref_emb has {ref_emb.shape[1]} features but embeddings have "
                    f"{embeddings.shape[1]}"
                )
        labels = labels.to(embeddings.device)
        ref_labels = ref_labels.to(embeddings.device)
        with full_precision(embeddings):  # under autocast, distances stay in float32
            out = self.mine(embeddings.detach(), labels, ref_emb.detach(), ref_labels, same)
        self._record(out, labels.shape[0])
        return out

    def mine(
        self,
        embeddings: torch.Tensor,
        labels: torch.Tensor,
        ref_emb: torch.Tensor,
        ref_labels: torch.Tensor,
        same: bool,
    ) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    # -- helpers for subclasses ----------------------------------------------------------------
    def farness(self, embeddings: torch.Tensor, ref_emb: torch.Tensor, same: bool) -> torch.Tensor:
        """``(B, M)`` matrix where *smaller is closer* (the distance, or minus the similarity),
        in at least float32 (mining compares values, so bfloat16 is upcast, and
        :meth:`forward` disables autocast around :meth:`mine`)."""
        if embeddings.dtype in (torch.float16, torch.bfloat16):
            embeddings, ref_emb = embeddings.float(), ref_emb.float()
        mat = self.distance(embeddings, None if same else ref_emb)
        return -mat if self.distance.higher_is_closer else mat

    def _record(self, out: tuple[torch.Tensor, ...], batch: int) -> None:
        if self.output_type == "pair":
            self.stats = {
                "num_pos_pairs": int(out[0].numel()),
                "num_neg_pairs": int(out[2].numel()),
            }
        else:
            self.stats = {"num_triplets": int(out[0].numel())}

    def extra_repr(self) -> str:
        return f"distance={self.distance!r}"


def _check(embeddings: torch.Tensor, labels: torch.Tensor, name: str) -> None:
    if embeddings.dim() != 2:
        raise ShapeError(f"{name} must be (B, D), got shape {tuple(embeddings.shape)}")
    if not embeddings.is_floating_point():
        raise ShapeError(f"{name} must be a floating-point tensor, got {embeddings.dtype}")
    if not isinstance(labels, torch.Tensor) or labels.dim() != 1 or labels.shape[0] != embeddings.shape[0]:
        shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ShapeError(f"labels for {name} must be a (B,) tensor with B = {embeddings.shape[0]}, got {shape}")
    if labels.is_floating_point():
        raise ShapeError(f"labels must be integers, got {labels.dtype}")
    if not torch.isfinite(embeddings).all():
        raise NonFiniteError(f"{name} contain NaN or infinity: check the model and learning rate")


def _empty_like(device: torch.device, k: int) -> tuple[torch.Tensor, ...]:
    return tuple(torch.empty(0, dtype=torch.long, device=device) for _ in range(k))


# --------------------------------------------------------------------------------------------
# Simple miners
# --------------------------------------------------------------------------------------------
@register_miner("all_pairs")
class AllPairsMiner(BaseMiner):
    """Every positive pair and every negative pair of the batch (``O(B^2)`` pairs).

    Same output, in the same row-major order, as pytorch-metric-learning's
    ``lmu.get_all_pairs_indices``. The distance is not used.
    """

    output_type = "pair"

    def mine(self, embeddings, labels, ref_emb, ref_labels, same):
        pos, neg = label_masks(labels, ref_labels, exclude_self=same)
        a1, p = torch.where(pos)
        a2, n = torch.where(neg)
        return a1, p, a2, n


_BLOCK_ELEMENTS = 2**22  # (positive pairs x references) per block of the block strategy


class _BandTripletMiner(BaseMiner):
    """Triplet miners that select, for each positive pair ``(a, p)``, negatives of ``a`` by
    comparing ``d(a, n)`` with ``d(a, p)``. Two exact strategies, same triplets:

    * ``"blocks"``: positive pairs are processed in blocks of ``~4M / R`` pairs; for each
      block the ``(pairs x R)`` comparison is one vectorised mask. Work ``O(P R)`` for ``P``
      positive pairs, memory ``O(B^2 + output)``; best when anchors have few positives (the
      usual ``M = 4`` batches: ``P = 3B``).
    * ``"sort"``: each anchor's negatives are sorted once (``O(B R log R)``) and every
      positive pair reads a contiguous band of its sorted row (``torch.searchsorted``); best
      when anchors have many positives (few classes per batch).

    ``strategy="auto"`` (default) takes ``"blocks"`` when ``P <= 8 B``. Triplets are grouped by
    positive pair; the order of the negatives within a pair is not specified.
    """

    def __init__(
        self, distance=None, max_triplets: int | None = None, strategy: str = "auto"
    ) -> None:
        super().__init__(distance)
        if max_triplets is not None and max_triplets < 0:
            raise ConfigError(f"max_triplets must be >= 0 or None, got {max_triplets}")
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
        step = max(1, _BLOCK_ELEMENTS // max(1, f.shape[1]))
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
        return torch.sort(f.masked_fill(~neg, math.inf), dim=1)

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
        pos, neg = label_masks(labels, ref_labels, exclude_self=same)
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
        pos, neg = label_masks(labels, ref_labels, exclude_self=same)
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
        self.margin = float(margin)
        self.nonzero = bool(nonzero)

    def mine(self, embeddings, labels, ref_emb, ref_labels, same):
        pos, neg = label_masks(labels, ref_labels, exclude_self=same)
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

    ``strategy`` as for :class:`BatchAllMiner` (same triplets either way).
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
        self.margin = float(margin)
        self.negatives = negatives
        self.fallback = fallback

    def mine(self, embeddings, labels, ref_emb, ref_labels, same):
        f = self.farness(embeddings, ref_emb, same)
        pos, neg = label_masks(labels, ref_labels, exclude_self=same)
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
        num_neg = neg.sum(1)[a]
        n = order[a, lo.clamp_max(order.shape[1] - 1)]
        keep = lo < hi
        if self.fallback != "none":
            all_hard = (lo >= num_neg) & (num_neg > 0)
            col = num_neg - 1 if self.fallback == "easiest" else torch.zeros_like(num_neg)
            n = torch.where(all_hard, order[a, col.clamp_min(0)], n)
            keep = keep | all_hard
        return a[keep], p[keep], n[keep]

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


@register_miner("distance_weighted")
class DistanceWeightedMiner(BaseMiner):
    """Distance-weighted sampling (Wu, Manmatha, Smola, Krähenbühl, "Sampling Matters in Deep
    Embedding Learning", ICCV 2017).

    On the unit sphere in ``n = D`` dimensions, pairwise distances of random points have density
    ``q(d) ∝ d^(n-2) (1 - d^2/4)^((n-3)/2)``. For every positive pair ``(a, p)`` one negative is
    drawn with probability proportional to the clipped inverse density

    ``w(a, n) ∝ q(max(d(a, n), cutoff))^-1``  if ``d(a, n) < nonzero_loss_cutoff``, else 0,

    computed in log space and normalised per anchor (clipping the distance at ``cutoff = 0.5``
    is the paper's ``min(lambda, q(d)^-1)``; negatives beyond ``nonzero_loss_cutoff = 1.4`` give
    no loss for the margin loss and are never drawn). An anchor whose negatives all have zero
    weight draws uniformly among its negatives (the authors' reference code).

    The distance must be the Euclidean distance of L2-normalised embeddings (the default).
    Sampling uses a ``torch.Generator`` seeded with ``seed`` on the embeddings' device, so a
    run is reproducible; :meth:`sampling_weights` exposes the weight matrix.
    """

    def __init__(
        self,
        cutoff: float = 0.5,
        nonzero_loss_cutoff: float = 1.4,
        seed: int = 0,
        distance=None,
    ) -> None:
        super().__init__(distance)
        d = self.distance
        if not (
            isinstance(d, LpDistance) and d.p == 2 and d.power == 1 and d.normalize_embeddings
        ):
            raise ConfigError(
                "distance_weighted needs the Euclidean distance of L2-normalised embeddings: "
                "leave distance unset or pass LpDistance(p=2, power=1, normalize_embeddings=True)"
            )
        if not 0 < cutoff < nonzero_loss_cutoff <= 2:
            raise ConfigError(
                "need 0 < cutoff < nonzero_loss_cutoff <= 2, got "
                f"cutoff={cutoff}, nonzero_loss_cutoff={nonzero_loss_cutoff}"
            )
        self.cutoff = float(cutoff)
        self.nonzero_loss_cutoff = float(nonzero_loss_cutoff)
        self.seed = int(seed)
        self._generators: dict[str, torch.Generator] = {}

    @staticmethod
    def default_distance() -> BaseDistance:
        return LpDistance(p=2, power=1, normalize_embeddings=True)

    def generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            self._generators[key] = g
        return self._generators[key]

    def log_weights(self, dist: torch.Tensor, dim: int) -> torch.Tensor:
        """``log q(max(d, cutoff))^-1`` up to a constant; ``-inf`` where ``d >= nonzero_loss_cutoff``."""
        d = dist.clamp_min(self.cutoff)
        logw = (2.0 - dim) * torch.log(d) - ((dim - 3) / 2) * torch.log1p(-0.25 * d * d)
        return logw.masked_fill(dist >= self.nonzero_loss_cutoff, -math.inf)

    @torch.no_grad()
    def sampling_weights(
        self,
        embeddings: torch.Tensor,
        labels: torch.Tensor,
        ref_emb: torch.Tensor | None = None,
        ref_labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``(B, M)`` per-anchor sampling probabilities over the reference set (rows sum to 1;
        rows without any negative are all zero)."""
        same = ref_emb is None
        if same:
            ref_emb, ref_labels = embeddings, labels
        w, _ = self._weights(embeddings, labels, ref_emb, ref_labels, same)
        return w

    def _weights(self, embeddings, labels, ref_emb, ref_labels, same):
        dist = self.farness(embeddings, ref_emb, same)
        pos, neg = label_masks(labels, ref_labels, exclude_self=same)
        logw = self.log_weights(dist, embeddings.shape[1]).masked_fill(~neg, -math.inf)
        row_max = logw.amax(1, keepdim=True)
        w = torch.exp(logw - row_max.masked_fill(~torch.isfinite(row_max), 0))
        empty = w.sum(1, keepdim=True) == 0
        w = torch.where(empty, neg.to(w.dtype), w)  # uniform fallback over the negatives
        total = w.sum(1, keepdim=True)
        return w / total.clamp_min(torch.finfo(w.dtype).tiny), pos

    def mine(self, embeddings, labels, ref_emb, ref_labels, same):
        w, pos = self._weights(embeddings, labels, ref_emb, ref_labels, same)
        has_neg = w.sum(1) > 0
        a, p = torch.where(pos & has_neg.unsqueeze(1))
        if a.numel() == 0:
            return _empty_like(embeddings.device, 3)
        num_pos = torch.bincount(a, minlength=w.shape[0])
        rows = torch.nonzero(num_pos > 0).squeeze(1)
        draws = torch.multinomial(
            w[rows], int(num_pos.max()), replacement=True, generator=self.generator(w.device)
        )
        row_of = torch.full((w.shape[0],), -1, dtype=torch.long, device=w.device)
        row_of[rows] = torch.arange(rows.numel(), device=w.device)
        start = torch.cumsum(num_pos, 0) - num_pos
        rank = torch.arange(a.numel(), device=a.device) - start[a]
        n = draws[row_of[a], rank]
        return a, p, n

    def extra_repr(self) -> str:
        return (
            f"cutoff={self.cutoff}, nonzero_loss_cutoff={self.nonzero_loss_cutoff}, "
            f"seed={self.seed}, {super().extra_repr()}"
        )


# --------------------------------------------------------------------------------------------
# Pair miners
# --------------------------------------------------------------------------------------------
@register_miner("hard_negative_pairs")
class HardNegativePairMiner(BaseMiner):
    """All positive pairs plus as many of the hardest negative pairs (seed 003's
    ``HardNegativePairSelector``, after Bielski's siamese-triplet).

    Returns every positive pair and the ``k = min(round(neg_pos_ratio * P), #negatives)``
    negative pairs with the smallest distance (largest similarity) in the whole batch, where
    ``P`` is the number of positive pairs - on the device with ``torch.topk`` rather than the
    seed's numpy ``argpartition``. Pairs are ordered (``(i, j)`` and ``(j, i)``), as in
    :class:`AllPairsMiner`. A batch without positive pairs gets no negative pair either
    (``neg_pos_ratio * 0``); set ``min_negatives`` to still return some.
    """

    output_type = "pair"

    def __init__(self, neg_pos_ratio: float = 1.0, min_negatives: int = 0, distance=None) -> None:
        super().__init__(distance)
        if neg_pos_ratio < 0 or min_negatives < 0:
            raise ConfigError("neg_pos_ratio and min_negatives must be >= 0")
        self.neg_pos_ratio = float(neg_pos_ratio)
        self.min_negatives = int(min_negatives)

    def mine(self, embeddings, labels, ref_emb, ref_labels, same):
        f = self.farness(embeddings, ref_emb, same)
        pos, neg = label_masks(labels, ref_labels, exclude_self=same)
        a1, p = torch.where(pos)
        num_neg = int(neg.sum())
        k = min(max(round(self.neg_pos_ratio * a1.numel()), self.min_negatives), num_neg)
        flat = f.masked_fill(~neg, math.inf).flatten()
        idx = torch.topk(flat, k, largest=False, sorted=True).indices
        cols = f.shape[1]
        return a1, p, idx // cols, idx % cols

    def extra_repr(self) -> str:
        return (
            f"neg_pos_ratio={self.neg_pos_ratio}, min_negatives={self.min_negatives}, "
            f"{super().extra_repr()}"
        )


@register_miner("multi_similarity")
class MultiSimilarityMiner(BaseMiner):
    """Pair mining of the multi-similarity loss (Wang, Han, Huang, Dong, Scott, "Multi-Similarity
    Loss with General Pair Weighting for Deep Metric Learning", CVPR 2019, eqs. 7-8).

    With similarities ``S``, a negative pair is kept if ``S_an > min_{p} S_ap - epsilon`` and a
    positive pair if ``S_ap < max_{n} S_an + epsilon`` (``epsilon = 0.1``); for a distance the
    inequalities flip (``d_an < max_p d_ap + epsilon``, ``d_ap > min_n d_an - epsilon``). An
    anchor without positives keeps no negative and one without negatives keeps no positive.
    Same pairs as pytorch-metric-learning's ``MultiSimilarityMiner`` (there, sorted per row).
    """

    output_type = "pair"

    def __init__(self, epsilon: float = 0.1, distance=None) -> None:
        super().__init__(distance)
        self.epsilon = float(epsilon)

    def mine(self, embeddings, labels, ref_emb, ref_labels, same):
        f = self.farness(embeddings, ref_emb, same)
        pos, neg = label_masks(labels, ref_labels, exclude_self=same)
        hardest_pos = f.masked_fill(~pos, -math.inf).amax(1, keepdim=True)
        hardest_neg = f.masked_fill(~neg, math.inf).amin(1, keepdim=True)
        a1, p = torch.where(pos & (f + self.epsilon > hardest_neg))
        a2, n = torch.where(neg & (f - self.epsilon < hardest_pos))
        return a1, p, a2, n

    def extra_repr(self) -> str:
        return f"epsilon={self.epsilon}, {super().extra_repr()}"
