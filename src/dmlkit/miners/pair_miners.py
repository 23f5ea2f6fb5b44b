"""Pair miners: distance-weighted sampling, hard negative pairs and multi-similarity mining
(see :mod:`dmlkit.miners`)."""

from __future__ import annotations

import math

import torch

from dmlkit.distances import BaseDistance, LpDistance
from dmlkit.exceptions import ConfigError
from dmlkit.miners.base import (
    BaseMiner,
    _empty_like,
    register_miner,
)
from dmlkit.validation import check_integer, check_number, check_seed


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
    run is reproducible; :meth:`sampling_weights` exposes the weight matrix. The generators'
    states (one per device) are the module's extra state: they travel in ``state_dict()``, so
    a checkpoint resumes the draws where they stopped instead of restarting them from ``seed``.
    A state dict written before they were saved still loads: its generators restart from
    ``seed`` (the old behaviour).
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
        self.seed = check_seed(seed)  # torch's generators refuse negative and 64-bit seeds
        self._generators: dict[str, torch.Generator] = {}
        #: saved states of devices whose generator is not created yet (set on first use)
        self._pending_states: dict[str, torch.Tensor] = {}

    @staticmethod
    def default_distance() -> BaseDistance:
        return LpDistance(p=2, power=1, normalize_embeddings=True)

    def generator(self, device: torch.device) -> torch.Generator:
        """The sampling generator of ``device``: seeded with ``seed`` on first use, or set to
        the state a loaded state dict saved for that device."""
        key = str(device)
        if key not in self._generators:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            pending = self._pending_states.pop(key, None)
            if pending is not None:
                g.set_state(pending)
            self._generators[key] = g
        return self._generators[key]

    def get_extra_state(self) -> dict[str, torch.Tensor]:
        """The generators' states by device name (``"cpu"``, ``"cuda:0"``), as CPU byte tensors
        (loadable with ``weights_only=True``); states loaded but not used yet are kept."""
        states = {k: s.clone() for k, s in self._pending_states.items()}
        states.update({k: g.get_state() for k, g in self._generators.items()})
        return states

    def set_extra_state(self, state: dict[str, torch.Tensor] | None) -> None:
        """Continue the draws from saved generator states (see :meth:`get_extra_state`).

        Each device's generator is (re)created on its first use after this, so a state saved
        on a device this process does not use (e.g. CUDA in a CPU-only resume) is kept, not
        applied. ``None`` (a state dict from before the states were saved) restarts every
        generator from ``seed``."""
        self._generators = {}
        self._pending_states = {str(k): v.detach().to("cpu", torch.uint8).clone()
                                for k, v in (state or {}).items()}

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        key = prefix + "_extra_state"
        if key not in state_dict:  # written before the generator states were saved
            state_dict[key] = None
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

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
        pos, neg = self.label_masks(labels, ref_labels, same)
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
    seed's numpy ``argpartition``, hardest first; of negative pairs at an equal distance the
    smaller row-major index ``i * M + j`` comes first (and is kept at the cut: every pair
    ``(i, j)`` has a twin ``(j, i)`` at the same distance, so with an odd ``k`` the cut is a tie
    in almost every batch). Pairs are ordered (``(i, j)`` and ``(j, i)``), as in
    :class:`AllPairsMiner`. A batch without positive pairs gets no negative pair either
    (``neg_pos_ratio * 0``); set ``min_negatives`` to still return some.
    """

    output_type = "pair"

    def __init__(self, neg_pos_ratio: float = 1.0, min_negatives: int = 0, distance=None) -> None:
        super().__init__(distance)
        self.neg_pos_ratio = check_number(neg_pos_ratio, "neg_pos_ratio", least=0)
        self.min_negatives = check_integer(min_negatives, "min_negatives", least=0)

    def mine(self, embeddings, labels, ref_emb, ref_labels, same):
        f = self.farness(embeddings, ref_emb, same)
        pos, neg = self.label_masks(labels, ref_labels, same)
        a1, p = torch.where(pos)
        num_neg = int(neg.sum())
        wanted = self.neg_pos_ratio * a1.numel()  # a huge ratio overflows to inf: every negative
        k = min(max(round(wanted) if wanted < num_neg else num_neg, self.min_negatives), num_neg)
        idx = _smallest(f.masked_fill(~neg, math.inf).flatten(), k)
        cols = f.shape[1]
        return a1, p, idx // cols, idx % cols

    def extra_repr(self) -> str:
        return (
            f"neg_pos_ratio={self.neg_pos_ratio}, min_negatives={self.min_negatives}, "
            f"{super().extra_repr()}"
        )


def _smallest(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` smallest entries of the 1-D ``values`` (``k`` at most the number
    of finite ones), by value then by index: ``torch.topk`` breaks ties arbitrarily. It finds
    the ``k``-th value; every smaller entry is kept, then the tied ones in index order until
    there are ``k``, sorted stably by value. ``O(N + k log k)``: a stable sort of all ``N``
    (B = 256: 65536 pairs) was 7x slower on a CPU; :func:`dmlkit.metrics.knn.exact_topk`, the
    row-wise counterpart a layer above, sorts whole rows where the cut is a tie, which it is
    here in almost every batch."""
    if k == 0:
        return torch.empty(0, dtype=torch.long, device=values.device)
    kth = torch.topk(values, k, largest=False, sorted=False).values.max()
    below = values < kth
    tied = values == kth
    chosen = below | (tied & (tied.cumsum(0) <= k - below.sum()))
    idx = chosen.nonzero().squeeze(1)
    return idx[torch.sort(values[idx], stable=True).indices]


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
        self.epsilon = check_number(epsilon, "epsilon")

    def mine(self, embeddings, labels, ref_emb, ref_labels, same):
        f = self.farness(embeddings, ref_emb, same)
        pos, neg = self.label_masks(labels, ref_labels, same)
        hardest_pos = f.masked_fill(~pos, -math.inf).amax(1, keepdim=True)
        hardest_neg = f.masked_fill(~neg, math.inf).amin(1, keepdim=True)
        a1, p = torch.where(pos & (f + self.epsilon > hardest_neg))
        a2, n = torch.where(neg & (f - self.epsilon < hardest_pos))
        return a1, p, a2, n

    def extra_repr(self) -> str:
        return f"epsilon={self.epsilon}, {super().extra_repr()}"
