"""Pairwise distances and similarities between two sets of embeddings.

Every distance maps ``query (N, D)`` and ``reference (M, D)`` to an ``(N, M)`` matrix and says,
through :attr:`BaseDistance.higher_is_closer`, whether a larger value means *more similar*
(cosine, dot product) or *less similar* (Lp, SNR). Losses and miners only ever ask the
distance object, so they work unchanged with any of them.

Available:

* :class:`CosineSimilarity` - ``s(x, y) = <x, y> / (||x|| ||y||)``.
* :class:`DotProductSimilarity` - ``s(x, y) = <x, y>`` (optionally after L2 normalisation).
* :class:`LpDistance` - ``d(x, y) = ||x - y||_p``; ``p = 2`` is Euclidean, optionally squared.
* :class:`SNRDistance` - ``d(x, y) = Var(y - x) / Var(x)``, the signal-to-noise-ratio distance
  of Yuan et al., "Signal-To-Noise Ratio: A Robust Distance Metric for Deep Metric Learning",
  CVPR 2019.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dmlkit.exceptions import ShapeError

__all__ = [
    "BaseDistance",
    "CosineSimilarity",
    "DotProductSimilarity",
    "LpDistance",
    "SNRDistance",
    "get_distance",
]


class BaseDistance:
    """A pairwise distance or similarity.

    Args:
        normalize_embeddings: L2-normalise both inputs before comparing them.

    Call the object as ``distance(query, reference=None)``; ``reference=None`` compares the
    query set with itself.
    """

    higher_is_closer: bool = False
    name: str = "base"

    def __init__(self, normalize_embeddings: bool = True) -> None:
        self.normalize_embeddings = normalize_embeddings

    # -- public API -------------------------------------------------------------------------
    def __call__(self, query: torch.Tensor, reference: torch.Tensor | None = None) -> torch.Tensor:
        return self.pairwise(query, reference)

    def pairwise(self, query: torch.Tensor, reference: torch.Tensor | None = None) -> torch.Tensor:
        """The ``(N, M)`` matrix between every query row and every reference row."""
        query, reference = self._prepare(query, reference)
        return self._pairwise(query, reference)

    def paired(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The ``(N,)`` values between matched rows ``x[i]`` and ``y[i]``."""
        if x.shape != y.shape:
            raise ShapeError(f"paired() needs equal shapes, got {tuple(x.shape)} and {tuple(y.shape)}")
        x, y = self._prepare(x, y)
        return self._paired(x, y)

    def closeness(self, values: torch.Tensor) -> torch.Tensor:
        """Map values so that larger always means closer (identity for similarities)."""
        return values if self.higher_is_closer else -values

    def margin(self, closer: torch.Tensor, farther: torch.Tensor) -> torch.Tensor:
        """How much farther ``farther`` is than ``closer``: ``d(far) - d(close)`` or ``s(close) - s(far)``."""
        return closer - farther if self.higher_is_closer else farther - closer

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, p=2, dim=-1) if self.normalize_embeddings else x

    def __repr__(self) -> str:
        return f"{type(self).__name__}(normalize_embeddings={self.normalize_embeddings})"

    # -- to implement -------------------------------------------------------------------------
    def _pairwise(self, query: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _paired(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # -- helpers ------------------------------------------------------------------------------
    def _prepare(
        self, query: torch.Tensor, reference: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if query.dim() != 2:
            raise ShapeError(f"embeddings must be (N, D), got shape {tuple(query.shape)}")
        if reference is None:
            query = self.normalize(query)
            return query, query
        if reference.dim() != 2 or reference.shape[1] != query.shape[1]:
            raise ShapeError(
                f"query {tuple(query.shape)} and reference {tuple(reference.shape)} must both be "
                "(N, D) with the same D"
            )
        return self.normalize(query), self.normalize(reference)


class DotProductSimilarity(BaseDistance):
    """``s(x, y) = <x, y>``; larger is closer."""

    higher_is_closer = True
    name = "dot"

    def _pairwise(self, query, reference):
        return query @ reference.T

    def _paired(self, x, y):
        return (x * y).sum(-1)


class CosineSimilarity(DotProductSimilarity):
    """``s(x, y) = <x, y> / (||x|| ||y||)``; larger is closer. Always normalises."""

    name = "cosine"

    def __init__(self, normalize_embeddings: bool = True) -> None:
        if not normalize_embeddings:
            raise ValueError("CosineSimilarity always normalises; use DotProductSimilarity instead")
        super().__init__(normalize_embeddings=True)

    def __repr__(self) -> str:
        return "CosineSimilarity()"


_SQRT_EPS = 1e-12


def _safe_sqrt(squared: torch.Tensor) -> torch.Tensor:
    """``sqrt(max(x, 1e-12))``: finite gradient everywhere (zero below the floor), and at most
    ``1e-6`` where the distance is zero - far below float32 rounding of ``|x|^2 + |y|^2 - 2<x, y>``."""
    return squared.clamp_min(_SQRT_EPS).sqrt()


class LpDistance(BaseDistance):
    """``d(x, y) = ||x - y||_p``; smaller is closer.

    Args:
        p: the norm's order (2 = Euclidean).
        power: 1 for the distance, 2 for the squared Euclidean distance (``p = 2`` only).
        normalize_embeddings: L2-normalise inputs first (default True, as in the Reality Check).
    """

    higher_is_closer = False
    name = "lp"

    def __init__(self, p: float = 2.0, power: int = 1, normalize_embeddings: bool = True) -> None:
        super().__init__(normalize_embeddings)
        if p <= 0:
            raise ValueError(f"p must be positive, got {p}")
        if power not in (1, 2):
            raise ValueError(f"power must be 1 or 2, got {power}")
        if power == 2 and p != 2:
            raise ValueError("power=2 (squared distance) is only defined here for p=2")
        self.p = float(p)
        self.power = power

    def _pairwise(self, query, reference):
        if self.p == 2:
            # |x|^2 + |y|^2 - 2<x, y> in one fused matmul-add (measured 2-3x faster than
            # separate ops, and unlike torch.cdist it supports bfloat16)
            norms = query.pow(2).sum(1).unsqueeze(1) + reference.pow(2).sum(1).unsqueeze(0)
            sq = torch.addmm(norms, query, reference.T, alpha=-2)
            return sq.clamp_min(0) if self.power == 2 else _safe_sqrt(sq)
        return torch.cdist(query, reference, p=self.p)

    def _paired(self, x, y):
        diff = x - y
        if self.p == 2:
            sq = diff.pow(2).sum(-1)
            return sq if self.power == 2 else _safe_sqrt(sq)
        return diff.abs().pow(self.p).sum(-1).pow(1 / self.p)

    def __repr__(self) -> str:
        return (
            f"LpDistance(p={self.p}, power={self.power}, "
            f"normalize_embeddings={self.normalize_embeddings})"
        )


class SNRDistance(BaseDistance):
    """``d(a, b) = Var(b - a) / Var(a)`` (unbiased variances over the D features); smaller is closer.

    Yuan, Chen, Zhang, Xu, "Signal-To-Noise Ratio: A Robust Distance Metric for Deep Metric
    Learning", CVPR 2019. Not symmetric: the anchor's variance is the signal.
    Computed without forming ``N x M x D`` differences: with ``z = b - a``,
    ``sum z^2 = |a|^2 + |b|^2 - 2<a, b>`` and ``mean z = mean b - mean a``.
    """

    higher_is_closer = False
    name = "snr"

    def __init__(self, normalize_embeddings: bool = False) -> None:
        super().__init__(normalize_embeddings)

    def _pairwise(self, query, reference):
        d = query.shape[1]
        if d < 2:
            raise ShapeError("SNRDistance needs at least 2 embedding dimensions")
        sum_sq = (
            query.pow(2).sum(1, keepdim=True)
            + reference.pow(2).sum(1).unsqueeze(0)
            - 2 * (query @ reference.T)
        )
        mean_diff = reference.mean(1).unsqueeze(0) - query.mean(1, keepdim=True)
        noise = ((sum_sq - d * mean_diff.pow(2)) / (d - 1)).clamp_min(0)
        return noise / query.var(dim=1, keepdim=True)

    def _paired(self, x, y):
        return torch.var(y - x, dim=1) / torch.var(x, dim=1)


_REGISTRY: dict[str, type[BaseDistance]] = {
    "cosine": CosineSimilarity,
    "dot": DotProductSimilarity,
    "lp": LpDistance,
    "euclidean": LpDistance,
    "snr": SNRDistance,
}


def get_distance(name: str | BaseDistance, **kwargs) -> BaseDistance:
    """A distance by name (``cosine``, ``dot``, ``euclidean``/``lp``, ``snr``) or pass-through."""
    if isinstance(name, BaseDistance):
        return name
    try:
        cls = _REGISTRY[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown distance {name!r}; choose one of {sorted(_REGISTRY)}"
        ) from None
    return cls(**kwargs)
