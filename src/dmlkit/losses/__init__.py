"""Metric learning losses, one module per family; see :mod:`dmlkit.losses.base`.

Every loss is registered by its config name (:func:`get_loss`, ``LOSSES``) and importable from
here by class name. The modules:

* :mod:`~dmlkit.losses.base` - ``BaseLoss``, ``ProxyLoss``, the registry;
* :mod:`~dmlkit.losses._pairs` - the helpers the losses and miners share (label masks,
  miner-index conversion, the masked log-sum-exp, scale-safe normalisation);
* :mod:`~dmlkit.losses.pair_losses` - contrastive, cosine similarity, lifted structure,
  margin, circle;
* :mod:`~dmlkit.losses.triplet_losses` - triplet margin, angular, N-pairs, tuplet margin;
* :mod:`~dmlkit.losses.pair_weighting_losses` - multi-similarity, NT-Xent, SupCon, SNR
  contrastive, distance-based logistic, coupled clusters (formerly ``ranking_losses``, still
  importable under that name with a deprecation warning);
* :mod:`~dmlkit.losses.nca` - NCA (also importable from ``pair_weighting_losses``);
* :mod:`~dmlkit.losses.ranked_list` - the Ranked List loss;
* :mod:`~dmlkit.losses.fastap`, :mod:`~dmlkit.losses.prototypical`;
* :mod:`~dmlkit.losses.classification_losses` - softmax, normalised softmax, SphereFace,
  CosFace, ArcFace; :mod:`~dmlkit.losses.proxy_losses` - ProxyNCA, ProxyAnchor, SoftTriple;
* :mod:`~dmlkit.losses.combined` - a weighted sum of losses;
* :mod:`~dmlkit.losses.cross_batch_memory` - the cross-batch memory wrapper.
"""

from __future__ import annotations

from dmlkit.losses.base import LOSSES, BaseLoss, ProxyLoss, get_loss, register_loss
from dmlkit.losses.classification_losses import (
    ArcFaceLoss,
    CosFaceLoss,
    LargeMarginSoftmaxLoss,
    NormalizedSoftmaxLoss,
    SoftmaxLoss,
    SphereFaceLoss,
)
from dmlkit.losses.combined import CombinedLoss, needs_pair_batches
from dmlkit.losses.cross_batch_memory import CrossBatchMemory
from dmlkit.losses.fastap import FastAPLoss
from dmlkit.losses.pair_losses import (
    CircleLoss,
    ContrastiveLoss,
    CosineSimilarityLoss,
    GeneralizedLiftedStructureLoss,
    LiftedStructureLoss,
    MarginLoss,
)
from dmlkit.losses.pair_weighting_losses import (
    CoupledClustersLoss,
    DistanceLogisticLoss,
    MultiSimilarityLoss,
    NCALoss,
    NTXentLoss,
    SNRContrastiveLoss,
    SupConLoss,
)
from dmlkit.losses.prototypical import PrototypicalLoss
from dmlkit.losses.proxy_losses import ProxyAnchorLoss, ProxyNCALoss, SoftTripleLoss
from dmlkit.losses.ranked_list import RankedListLoss
from dmlkit.losses.triplet_losses import (
    AngularLoss,
    NPairsLoss,
    TripletMarginLoss,
    TupletMarginLoss,
)

__all__ = [
    "LOSSES",
    "AngularLoss",
    "ArcFaceLoss",
    "BaseLoss",
    "CircleLoss",
    "CombinedLoss",
    "needs_pair_batches",
    "ContrastiveLoss",
    "CosFaceLoss",
    "CosineSimilarityLoss",
    "CoupledClustersLoss",
    "CrossBatchMemory",
    "DistanceLogisticLoss",
    "FastAPLoss",
    "GeneralizedLiftedStructureLoss",
    "LargeMarginSoftmaxLoss",
    "LiftedStructureLoss",
    "MarginLoss",
    "MultiSimilarityLoss",
    "NCALoss",
    "NPairsLoss",
    "NTXentLoss",
    "NormalizedSoftmaxLoss",
    "PrototypicalLoss",
    "ProxyAnchorLoss",
    "ProxyLoss",
    "ProxyNCALoss",
    "RankedListLoss",
    "SNRContrastiveLoss",
    "SoftTripleLoss",
    "SoftmaxLoss",
    "SphereFaceLoss",
    "SupConLoss",
    "TripletMarginLoss",
    "TupletMarginLoss",
    "get_loss",
    "register_loss",
]
