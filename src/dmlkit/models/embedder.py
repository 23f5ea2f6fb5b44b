"""Trunk + embedder head, optional L2 normalisation, and frozen BatchNorm.

The Reality Check setup (Musgrave, Belongie & Lim, ECCV 2020): a pretrained trunk, a linear
embedder to 128 dimensions, L2-normalised embeddings, and BatchNorm parameters frozen during
training (running statistics and affine parameters fixed) to reduce overfitting.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dmlkit.exceptions import ConfigError
from dmlkit.validation import check_integer

__all__ = [
    "EmbeddingModel",
    "FrozenBatchNorm1d",
    "FrozenBatchNorm2d",
    "FrozenBatchNorm3d",
    "build_embedder",
    "freeze_batchnorm",
    "is_batchnorm_frozen",
    "mark_fresh_batchnorm",
    "unfreeze_batchnorm",
]


def build_embedder(feature_dim: int, embedding_size: int, head: str = "linear",
                   hidden: int | None = None, dropout: float = 0.0) -> nn.Module:
    """The head mapping trunk features to embeddings.

    ``linear``: ``Linear(feature_dim, embedding_size)`` (the seed's embedder);
    ``mlp``: ``Linear -> BatchNorm1d -> ReLU -> (Dropout) -> Linear`` with ``hidden`` units
    (default ``feature_dim``; its BatchNorm is new, so :func:`freeze_batchnorm` leaves it
    trainable: :func:`mark_fresh_batchnorm`); ``identity``: no head (embedding = trunk feature).
    Sizes are positive integers and ``dropout`` a probability in ``[0, 1)``, else one
    :class:`ConfigError` line (a ``hidden`` of 0 silently became ``feature_dim``, an embedding size
    of 0 built an empty layer, -3 or 2.5 ended in torch's traceback).
    """
    feature_dim = check_integer(feature_dim, "feature_dim")
    embedding_size = check_integer(embedding_size, "embedding_size")
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise ConfigError(f"dropout must be a probability in [0, 1), got {dropout!r}")
    if head == "linear":
        return nn.Linear(feature_dim, embedding_size)
    if head == "mlp":
        h = feature_dim if hidden is None else check_integer(hidden, "hidden")
        layers: list[nn.Module] = [nn.Linear(feature_dim, h), nn.BatchNorm1d(h), nn.ReLU(inplace=True)]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        layers.append(nn.Linear(h, embedding_size))
        return mark_fresh_batchnorm(nn.Sequential(*layers))
    if head == "identity":
        return nn.Identity()
    raise ConfigError(f"head must be 'linear', 'mlp' or 'identity', got {head!r}")


class EmbeddingModel(nn.Module):
    """``x -> normalize(embedder(trunk(x)))``.

    ``model.trunk`` (features ``(N, feature_dim)``), ``model.embedder`` (the head),
    ``model.embedding_size``; ``model.embed_features(f)`` applies only the head (+ L2
    normalisation), for frozen-trunk training on cached features. ``normalize=True`` returns
    unit-length embeddings: ``e / max(||e||_2, 1e-12)``.
    """

    def __init__(self, trunk: nn.Module, feature_dim: int, embedding_size: int = 128,
                 head: str = "linear", normalize: bool = True, **head_kwargs: Any) -> None:
        super().__init__()
        self.trunk = trunk
        self.embedder = build_embedder(feature_dim, embedding_size, head, **head_kwargs)
        self.feature_dim = int(feature_dim)
        self.embedding_size = int(feature_dim if head == "identity" else embedding_size)
        self.head = head
        self.normalize = bool(normalize)

    def embed_features(self, features: torch.Tensor) -> torch.Tensor:
        """Head + optional L2 normalisation applied to trunk features ``(N, feature_dim)``."""
        emb = self.embedder(features)
        return F.normalize(emb, p=2, dim=1) if self.normalize else emb

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed_features(self.trunk(x))


# -- frozen BatchNorm ---------------------------------------------------------------------------
def mark_fresh_batchnorm(module: nn.Module) -> nn.Module:
    """Mark every BatchNorm layer of ``module`` as freshly created (a head's or a trunk's added
    neck): :func:`freeze_batchnorm` leaves it trainable, since frozen at its initial statistics
    (mean 0, variance 1, weight 1, bias 0) it would be the identity forever."""
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m._dmlkit_fresh_bn = True
    return module


class _FrozenBNMixin:
    """BatchNorm that stays in eval mode: ``.train()`` calls leave it in eval mode."""

    def train(self, mode: bool = True):  # type: ignore[override]
        return nn.Module.train(self, False)  # type: ignore[arg-type]


class FrozenBatchNorm1d(_FrozenBNMixin, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` frozen by :func:`freeze_batchnorm` (same state dict)."""


class FrozenBatchNorm2d(_FrozenBNMixin, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` frozen by :func:`freeze_batchnorm` (same state dict)."""


class FrozenBatchNorm3d(_FrozenBNMixin, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` frozen by :func:`freeze_batchnorm` (same state dict)."""


_FROZEN = {nn.BatchNorm1d: FrozenBatchNorm1d, nn.BatchNorm2d: FrozenBatchNorm2d,
           nn.BatchNorm3d: FrozenBatchNorm3d}
_FROZEN_DYNAMIC: dict[type, type] = {}


def _frozen_class(cls: type) -> type:
    if cls in _FROZEN:
        return _FROZEN[cls]
    if cls not in _FROZEN_DYNAMIC:
        _FROZEN_DYNAMIC[cls] = type(f"Frozen{cls.__name__}", (_FrozenBNMixin, cls),
                                    {"_dmlkit_unfrozen": cls})
    return _FROZEN_DYNAMIC[cls]


def freeze_batchnorm(module: nn.Module) -> nn.Module:
    """Freeze every BatchNorm layer of ``module`` in place (and return ``module``).

    As in the Reality Check: the layers use their running statistics (eval mode) even when the
    model is put in training mode, their running statistics are never updated, and their
    affine weight and bias get ``requires_grad = False`` (so optimisers skip them). The
    layers' classes become ``FrozenBatchNorm{1,2,3}d`` (same parameters and state dict);
    :func:`unfreeze_batchnorm` reverts. Layers marked by :func:`mark_fresh_batchnorm`
    (``small_cnn``'s ``bn_neck``; the ``mlp`` head's BatchNorm in a model that
    :func:`dmlkit.training.builders.build_model` builds) are left alone: only pretrained
    statistics are worth freezing.
    """
    for m in module.modules():
        if getattr(m, "_dmlkit_fresh_bn", False):
            continue
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, _FrozenBNMixin):
            m.__class__ = _frozen_class(type(m))
        if isinstance(m, _FrozenBNMixin):
            nn.Module.train(m, False)
            for p in m.parameters(recurse=False):
                p.requires_grad_(False)
    return module


def unfreeze_batchnorm(module: nn.Module) -> nn.Module:
    """Undo :func:`freeze_batchnorm`: ordinary BatchNorm with trainable affine parameters."""
    inverse = {v: k for k, v in _FROZEN.items()}
    for m in module.modules():
        if isinstance(m, _FrozenBNMixin):
            cls = type(m)
            m.__class__ = inverse.get(cls) or cls._dmlkit_unfrozen  # type: ignore[attr-defined]
            for p in m.parameters(recurse=False):
                p.requires_grad_(True)
            m.train(module.training)
    return module


def is_batchnorm_frozen(module: nn.Module) -> bool:
    """True if ``module`` has BatchNorm layers that :func:`freeze_batchnorm` freezes (not marked
    by :func:`mark_fresh_batchnorm`) and all of them are frozen."""
    bns = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
           and not getattr(m, "_dmlkit_fresh_bn", False)]
    return bool(bns) and all(isinstance(m, _FrozenBNMixin) for m in bns)
