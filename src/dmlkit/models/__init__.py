"""Trunks, embedder heads and frozen BatchNorm (cached trunk features: :mod:`dmlkit.embeddings`).

>>> from dmlkit.models import build_trunk, EmbeddingModel, freeze_batchnorm
>>> trunk, dim = build_trunk("resnet18", pretrained=False)  # random weights: BatchNorm trains
>>> model = EmbeddingModel(trunk, dim, 128)
>>> pretrained = freeze_batchnorm(EmbeddingModel(*build_trunk("resnet18"), 128))  # loaded statistics
"""

from dmlkit.models import features as _features
from dmlkit.models.bn_inception import BN_INCEPTION_URL, BNInception
from dmlkit.models.embedder import (
    EmbeddingModel,
    FrozenBatchNorm1d,
    FrozenBatchNorm2d,
    FrozenBatchNorm3d,
    build_embedder,
    freeze_batchnorm,
    is_batchnorm_frozen,
    mark_fresh_batchnorm,
    unfreeze_batchnorm,
)
from dmlkit.models.placement import to_device
from dmlkit.models.trunks import (
    TRUNKS,
    EfficientNetLiteTrunk,
    SmallCNN,
    adapt_input_channels,
    build_trunk,
    load_weights_file,
    register_trunk,
    trunk_loads_weights,
    trunk_names,
)

__all__ = [
    "BN_INCEPTION_URL",
    "TRUNKS",
    "BNInception",
    "EfficientNetLiteTrunk",
    "EmbeddingModel",
    "FrozenBatchNorm1d",
    "FrozenBatchNorm2d",
    "FrozenBatchNorm3d",
    "SmallCNN",
    "adapt_input_channels",
    "build_embedder",
    "build_trunk",
    "freeze_batchnorm",
    "is_batchnorm_frozen",
    "mark_fresh_batchnorm",
    "load_weights_file",
    "register_trunk",
    "to_device",
    "trunk_loads_weights",
    "trunk_names",
    "unfreeze_batchnorm",
]


def __getattr__(name: str) -> object:
    """Deprecation shim: the frozen-trunk feature cache moved to :mod:`dmlkit.embeddings`."""
    if name in _features.MOVED:
        return _features.__getattr__(name)  # warns (DeprecationWarning)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
