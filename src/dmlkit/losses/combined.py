"""A weighted sum of registered losses, with an optional BatchNorm "neck" per term.

The re-identification training recipe - batch-hard triplet loss plus an identity softmax on a
BN-neck feature (Hermans, Beyer & Leibe, "In Defense of the Triplet Loss for Person
Re-Identification", arXiv:1703.07737; Luo et al., "Bag of Tricks and a Strong Baseline for Deep
Person Re-identification", CVPRW 2019) - in one config entry::

    loss:
      name: combined
      params:
        losses:
          - {name: triplet, weight: 1.0, params: {margin: 0.3, reduction: batch_hard}}
          - {name: softmax, weight: 1.0, bn_neck: true, params: {bias: false}}
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dmlkit.exceptions import ConfigError, ShapeError
from dmlkit.losses.base import LOSSES, BaseLoss, get_loss, register_loss
from dmlkit.validation import check_parameter_numbers

__all__ = ["CombinedLoss", "needs_pair_batches"]

_KEYS = {"name", "params", "weight", "bn_neck", "use_indices"}



def needs_pair_batches(name: str, params: Mapping[str, Any] | None = None) -> bool:
    """Whether loss ``name`` (with ``params``) learns from pairs inside a batch, so that a batch
    needs several classes and several samples of a class (C x M batches, M >= 2): a pair or
    triplet loss, or a ``combined`` loss with such a term. A classification loss alone learns
    from single samples (seed 000's protocol: "C = 8 and M = 4 for embedding losses, and C = 32
    and M = 1 for classification losses"); ``combined`` needs ``num_classes`` whenever one of
    its terms does, which made a bench train triplet + softmax on 32 x 1 batches (no positive
    pair: the triplet term was empty on every batch)."""
    if name == "combined":
        terms = (params or {}).get("losses") or ()
        return any(isinstance(t, Mapping) and needs_pair_batches(str(t.get("name")), t.get("params"))
                   for t in terms if not (isinstance(t, Mapping) and t.get("name") == "combined"))
    return not bool(getattr(LOSSES.get(name), "requires_num_classes", False))

@register_loss("combined")
class CombinedLoss(BaseLoss):
    r"""``L = sum_k w_k L_k(h_k(x), y)`` over sub-losses ``L_k`` with weights ``w_k``.

    ``h_k`` is the identity, or with ``bn_neck: true`` a ``BatchNorm1d`` over the embedding
    whose shift is fixed at 0 (the BNNeck of Luo et al. 2019: the metric loss sees the raw
    feature ``f_t``, the classifier the normalised ``f_i = BN(f_t)``; a bias-free classifier
    is their choice too). Retrieval uses the model's output ``f_t`` (the neck belongs to the
    loss, so checkpoints and inference are unchanged).

    Sub-losses that need ``num_classes`` / ``embedding_size`` (classification and proxy
    losses) receive them from the trainer through this loss. A miner's ``indices`` go to the
    sub-losses that accept them (``use_indices: false`` to withhold them).

    Args:
        num_classes: training classes (set by the trainer).
        embedding_size: embedding dimension (set by the trainer).
        losses: a list of ``{name, params, weight=1.0, bn_neck=False, use_indices=True}``.
    """

    accepts_indices = True
    requires_num_classes = True

    def __init__(self, num_classes: int, embedding_size: int,
                 losses: Sequence[Mapping[str, Any]] = ()) -> None:
        super().__init__()
        if not losses:
            raise ConfigError("combined loss needs a non-empty 'losses' list of {name, params, weight}")
        self.num_classes = int(num_classes)
        self.embedding_size = int(embedding_size)
        self.terms = nn.ModuleList()
        self.necks = nn.ModuleList()
        self.weights: list[float] = []
        self.use_indices: list[bool] = []
        self.names: list[str] = []
        for spec in losses:
            spec = dict(spec)
            unknown = set(spec) - _KEYS
            if unknown or "name" not in spec:
                raise ConfigError(f"each combined term needs 'name' and may have {sorted(_KEYS)}; "
                                 f"got {sorted(spec)}")
            name = str(spec["name"])
            if name == "combined" or name not in LOSSES:
                raise ConfigError(f"combined term {name!r} is not a registered loss: "
                                 f"{sorted(set(LOSSES) - {'combined'})}")
            params = dict(spec.get("params") or {})
            # NaN, infinite or boolean numbers: refused as for a loss of its own (build_loss)
            check_parameter_numbers(f"loss.params.losses[{len(self.terms)}].params", LOSSES[name], params)
            if getattr(LOSSES[name], "requires_num_classes", False):
                params.update(num_classes=self.num_classes, embedding_size=self.embedding_size)
            self.terms.append(get_loss(name, **params))
            weight = spec.get("weight", 1.0)
            if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 <= weight < math.inf:
                raise ConfigError(f"combined term {name!r}: weight must be a finite number >= 0, got {weight!r}")
            weight = float(weight)
            self.weights.append(weight)
            self.use_indices.append(bool(spec.get("use_indices", True))
                                    and getattr(LOSSES[name], "accepts_indices", False))
            self.necks.append(_bn_neck(self.embedding_size) if spec.get("bn_neck") else nn.Identity())
            self.names.append(name)
        self.last_terms: dict[str, float] = {}

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        if ref_emb is not None:
            raise ConfigError(_NO_REFERENCES)
        total = embeddings.new_zeros(())
        parts: dict[str, float] = {}
        for k, (term, neck, weight) in enumerate(zip(self.terms, self.necks, self.weights)):
            x = _apply_neck(neck, embeddings)
            value = term(x, labels, indices if self.use_indices[k] else None)
            parts[f"{k}:{self.names[k]}"] = float(value.detach())
            total = total + weight * value
        self.last_terms = parts
        return total


#: Why the combined loss takes no reference set (so no cross-batch memory either).
_NO_REFERENCES = (
    "the combined loss takes no ref_emb/ref_labels, so it cannot be wrapped in cross-batch "
    "memory (loss.cross_batch_memory): use the memory with a single pair-based loss, or remove it"
)


def _apply_neck(neck: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``neck(x)`` in the neck's parameter dtype, cast back to ``x``'s dtype.

    A float64 batch through a float32 ``BatchNorm1d`` would fail (mixed dtypes); the neck
    computes in float32 then, as the loss terms do for their own float32 weights (a float64
    loss module, ``.double()``, keeps float64 throughout). In training mode BatchNorm needs
    at least 2 rows (a batch variance); a batch of one is refused with a clear error.
    """
    if isinstance(neck, nn.Identity) or x.shape[0] == 0:  # an empty batch: nothing to normalise
        return x
    if neck.training and x.shape[0] < 2:
        raise ShapeError(
            f"the combined loss's bn_neck normalises with the batch's statistics, which need at "
            f"least 2 embeddings, got {x.shape[0]}: use a larger batch (or call .eval() on the "
            "loss to use the running statistics)"
        )
    dtype = neck.weight.dtype
    return neck(x.to(dtype)).to(x.dtype)


def _bn_neck(dim: int) -> nn.BatchNorm1d:
    bn = nn.BatchNorm1d(dim)
    bn.bias.requires_grad_(False)  # no shift (Luo et al. 2019)
    with torch.no_grad():
        bn.bias.zero_()
    return bn
