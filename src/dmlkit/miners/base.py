"""The miner interface (:class:`BaseMiner`), the registry and the pair/triplet index helpers
shared by every miner (see :mod:`dmlkit.miners`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, TypeVar

import torch
from torch import nn

from dmlkit.distances import BaseDistance, CosineSimilarity, get_distance, inputs_checked
from dmlkit.exceptions import ConfigError, ShapeError
from dmlkit.losses._pairs import label_masks, upcast_pair  # the helpers losses and miners share
from dmlkit.losses.base import (  # one input check for losses and miners
    check_inputs,
    check_references,
    full_precision,
)
from dmlkit.utils import registering

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

    After each call, :attr:`stats` holds what was mined for logging (``num_pos_pairs`` and
    ``num_neg_pairs``, or ``num_triplets``; counts of the output, read without waiting for the
    device) and :attr:`num_mined` their total.
    Subclasses implement :meth:`mine` on a precomputed ``(B, M)`` matrix.
    """

    output_type: ClassVar[str] = "triplet"

    def __init__(self, distance: BaseDistance | str | None = None) -> None:
        super().__init__()
        self.distance = self.default_distance() if distance is None else get_distance(distance)
        self.stats: dict[str, int] = {}
        self._exclude_self: bool | None = None  # set for the duration of a call (forward)

    @staticmethod
    def default_distance() -> BaseDistance:
        return CosineSimilarity()

    @property
    def num_mined(self) -> int:
        """Pairs (positive + negative) or triplets returned by the last call."""
        return sum(self.stats.values())

    @torch.no_grad()
    def forward(
        self,
        embeddings: torch.Tensor,
        labels: torch.Tensor,
        ref_emb: torch.Tensor | None = None,
        ref_labels: torch.Tensor | None = None,
        *,
        ref_starts_with_batch: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        """Mine ``embeddings`` against ``ref_emb`` (default: the batch itself, each row's pair
        with itself left out). ``ref_starts_with_batch``: the first ``B`` reference rows are the
        batch's own rows (a cross-batch memory's references), whose pairs with themselves are
        left out too, before mining: a self pair counted as a positive changed what is mined
        (the number of hard negatives of :class:`HardNegativePairMiner`, the negatives kept by
        the multi-similarity rule for an anchor with no other positive)."""
        check_inputs(embeddings, labels, "embeddings")
        check_references(embeddings, ref_emb, ref_labels)
        same = ref_emb is None or (ref_emb is embeddings and ref_labels is labels)
        if ref_emb is None:
            ref_emb, ref_labels = embeddings, labels
        labels = labels.to(embeddings.device)
        ref_labels = ref_labels.to(embeddings.device)
        if embeddings.shape[0] == 0 or ref_emb.shape[0] == 0:  # nothing to mine (as a loss gives 0)
            out = _empty_like(embeddings.device, 4 if self.output_type == "pair" else 3)
            self._record(out)
            return out
        if ref_starts_with_batch and not same and ref_emb.shape[0] < embeddings.shape[0]:
            raise ShapeError(f"ref_starts_with_batch needs at least the batch's {embeddings.shape[0]} "
                             f"reference rows, got {ref_emb.shape[0]}")
        self._exclude_self = same or ref_starts_with_batch
        try:
            # under autocast, distances stay in float32; the inputs' finiteness is checked above
            with full_precision(embeddings), inputs_checked():
                out = self.mine(embeddings.detach(), labels, ref_emb.detach(), ref_labels, same)
        finally:
            self._exclude_self = None
        self._record(out)
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
    def label_masks(self, labels: torch.Tensor, ref_labels: torch.Tensor, same: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pos_mask, neg_mask)`` of this call (:func:`dmlkit.losses._pairs.label_masks`):
        each row's pair with itself is no positive pair on the batch itself (``same``) and when
        the call says the references start with the batch (``ref_starts_with_batch``)."""
        exclude = same if self._exclude_self is None else self._exclude_self
        return label_masks(labels, ref_labels, exclude_self=exclude)

    def farness(self, embeddings: torch.Tensor, ref_emb: torch.Tensor, same: bool) -> torch.Tensor:
        """``(B, M)`` matrix where *smaller is closer* (the distance, or minus the similarity),
        in at least float32 (mining compares values, so bfloat16 is upcast, and
        :meth:`forward` disables autocast around :meth:`mine`), the batch and the references
        in one dtype (:func:`~dmlkit.losses._pairs.upcast_pair`, as every loss)."""
        embeddings, ref_emb = upcast_pair(embeddings, None if same else ref_emb)  # as a loss does
        mat = self.distance(embeddings, ref_emb)
        return -mat if self.distance.higher_is_closer else mat

    def _record(self, out: tuple[torch.Tensor, ...]) -> None:
        """Set :attr:`stats` from a call's output (``numel``: no read from the device)."""
        if self.output_type == "pair":
            self.stats = {
                "num_pos_pairs": int(out[0].numel()),
                "num_neg_pairs": int(out[2].numel()),
            }
        else:
            self.stats = {"num_triplets": int(out[0].numel())}

    def extra_repr(self) -> str:
        return f"distance={self.distance!r}"


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
        pos, neg = self.label_masks(labels, ref_labels, same)
        a1, p = torch.where(pos)
        a2, n = torch.where(neg)
        return a1, p, a2, n
