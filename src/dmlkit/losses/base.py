"""What every loss shares: the calling convention, the registry, and empty-batch handling.

Calling convention (``../design.md``)::

    loss(embeddings (B, D), labels (B,), indices=None, ref_emb=None, ref_labels=None) -> scalar

* ``indices`` is a miner's output: pairs ``(anchor1, positive, anchor2, negative)`` or
  triplets ``(anchor, positive, negative)``. Anchors index ``embeddings``; positives and
  negatives index the reference set, which is ``embeddings`` itself unless ``ref_emb`` /
  ``ref_labels`` are given (cross-batch memory).
* A batch with no valid pair/triplet returns a zero that still has a gradient (``0 * sum``)
  and increments :attr:`BaseLoss.num_empty_batches`.
* Every loss computes in float32 (float64 inputs stay float64): half-precision inputs are
  upcast and autocast is disabled inside :meth:`BaseLoss.forward`, so under
  ``torch.autocast(dtype=torch.bfloat16)`` the matrices, log-sum-exps and the returned loss
  are float32; the gradient flows back to the half-precision embeddings in their own dtype.
* A loss that is not finite on finite inputs (only possible when the embeddings overflow a
  float32 computation, e.g. raw squared distances of ``1e19``-sized vectors) raises
  :class:`~dmlkit.exceptions.NonFiniteError` instead of returning NaN/inf to the optimiser.
* Classification/proxy losses subclass :class:`ProxyLoss`: they take ``num_classes`` and
  ``embedding_size``, own their parameters (``loss.parameters()``) so the trainer can give
  them their own optimiser/learning rate, and expect labels in ``[0, num_classes)``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TypeVar

import torch
from torch import nn

from dmlkit.distances import BaseDistance, CosineSimilarity, get_distance, inputs_checked
from dmlkit.exceptions import ConfigError, NonFiniteError, ShapeError
from dmlkit.losses._pairs import upcast_pair
from dmlkit.utils import registering
from dmlkit.validation import check_float_matrix

__all__ = ["LOSSES", "BaseLoss", "ProxyLoss", "get_loss", "register_loss"]

LOSSES: dict[str, type[BaseLoss]] = {}
_T = TypeVar("_T", bound=type)


def register_loss(*names: str) -> Callable[[_T], _T]:
    """Class decorator: make a loss available to :func:`get_loss` and configs by name(s)."""
    return registering(LOSSES, "loss", names)


def get_loss(name: str, **kwargs) -> BaseLoss:
    """Instantiate a registered loss by name, e.g. ``get_loss("triplet", margin=0.1)``.

    Every loss module is imported by :mod:`dmlkit.losses` (which runs before this module), so
    the registry is complete. An unknown name raises :class:`~dmlkit.exceptions.ConfigError`.
    """
    try:
        cls = LOSSES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown loss {name!r}; available: {sorted(LOSSES)}") from None
    return cls(**kwargs)


class BaseLoss(nn.Module):
    """Base of every dmlkit loss. Subclasses implement :meth:`compute`."""

    #: True for losses that consume a miner's pairs/triplets.
    accepts_indices: bool = False

    def __init__(self, distance: BaseDistance | str | None = None) -> None:
        super().__init__()
        self.distance = get_distance(distance) if distance is not None else self.default_distance()
        self.num_empty_batches = 0

    @staticmethod
    def default_distance() -> BaseDistance:
        return CosineSimilarity()

    def forward(
        self,
        embeddings: torch.Tensor,
        labels: torch.Tensor,
        indices: tuple[torch.Tensor, ...] | None = None,
        ref_emb: torch.Tensor | None = None,
        ref_labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        check_inputs(embeddings, labels, finite=False)
        check_references(embeddings, ref_emb, ref_labels, finite=False)
        embeddings, ref_emb = upcast_pair(embeddings, ref_emb)  # one dtype for both
        with full_precision(embeddings), inputs_checked():  # checked below, with the loss
            loss = self.compute(embeddings, labels, indices, ref_emb, ref_labels)
        check_finite_loss(self, loss, embeddings, ref_emb)
        return loss

    def compute(
        self,
        embeddings: torch.Tensor,
        labels: torch.Tensor,
        indices: tuple[torch.Tensor, ...] | None,
        ref_emb: torch.Tensor | None,
        ref_labels: torch.Tensor | None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def zero_loss(self, embeddings: torch.Tensor) -> torch.Tensor:
        """A zero connected to the graph (so ``backward()`` works), counted as an empty batch."""
        self.num_empty_batches += 1
        params = [p for p in self.parameters() if p.requires_grad]
        zero = embeddings.sum() * 0
        for p in params:
            zero = zero + p.sum() * 0
        return zero


class ProxyLoss(BaseLoss):
    """Base of classification- and proxy-based losses (own weights, labels in [0, C))."""

    requires_num_classes: bool = True

    def __init__(
        self, num_classes: int, embedding_size: int, distance: BaseDistance | str | None = None
    ) -> None:
        super().__init__(distance)
        if num_classes < 1 or embedding_size < 1:
            raise ValueError(
                f"num_classes and embedding_size must be positive, got {num_classes}, {embedding_size}"
            )
        self.num_classes = int(num_classes)
        self.embedding_size = int(embedding_size)

    def forward(self, embeddings, labels, indices=None, ref_emb=None, ref_labels=None):
        check_inputs(embeddings, labels, finite=False)  # types and shapes before the label range
        if embeddings.shape[1] != self.embedding_size:
            raise ShapeError(
                f"{type(self).__name__} was built for embedding_size={self.embedding_size}, "
                f"got embeddings of size {embeddings.shape[1]}"
            )
        if labels.numel():
            low, high = torch.stack(torch.aminmax(labels)).tolist()  # one read from the device
            if low < 0 or high >= self.num_classes:
                raise ShapeError(
                    f"{type(self).__name__} needs labels in [0, {self.num_classes}); got "
                    f"[{low}, {high}]: remap labels to contiguous ids"
                )
        return super().forward(embeddings, labels, indices, ref_emb, ref_labels)


def full_precision(x: torch.Tensor) -> AbstractContextManager:
    """A context that disables autocast for ``x``'s device while it is enabled (else a no-op),
    so that matrix products inside a loss are not silently computed in bfloat16/float16."""
    device = x.device.type
    try:
        enabled = torch.is_autocast_enabled(device)
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return nullcontext()
    return torch.autocast(device_type=device, enabled=False) if enabled else nullcontext()


def check_finite_loss(
    loss_fn: nn.Module, loss: torch.Tensor, embeddings: torch.Tensor, ref_emb: torch.Tensor | None
) -> None:
    """Raise :class:`~dmlkit.exceptions.NonFiniteError` if the inputs or ``loss`` are NaN or
    infinite, naming which.

    The inputs' and the loss's finiteness are read from the device together, once, after the
    computation (each read makes a GPU's host wait; a GPU training step measured the same with
    one read as with two, see benchmarks/README.md, so this is economy, not a speed-up). A finite
    input with a non-finite loss means that the embeddings (or the loss's own parameters)
    overflow its float32 computation: training on it would be garbage.
    """
    inputs = {"embeddings": embeddings, "ref_emb": ref_emb}
    inputs = {name: x for name, x in inputs.items() if x is not None}
    # a finite sum means finite entries (a NaN or an infinity makes the sum NaN or infinite): one
    # vectorised reduction, 12 us against 250 for isfinite().all() on 1024 x 128 (one thread),
    # a tenth of a 2 ms loss step; a sum that is not finite (a NaN, or finite entries whose sum
    # overflows) is settled by the exact test
    flags = torch.stack([torch.isfinite(x.detach().sum()) for x in inputs.values()]
                        + [torch.isfinite(loss.detach()).all()]).tolist()
    for (name, x), finite in zip(inputs.items(), flags):
        if not finite and not bool(torch.isfinite(x.detach()).all()):
            raise _nonfinite_input(name)
    if flags[-1]:
        return
    largest = max(float(x.detach().abs().max()) if x.numel() else 0.0 for x in inputs.values())
    raise NonFiniteError(
        f"{type(loss_fn).__name__} is {float(loss.detach().float().flatten()[0])} on finite "
        f"embeddings (largest |value| {largest:.3g}): its {loss.dtype} computation overflowed. "
        "L2-normalise the embeddings (a distance with normalize_embeddings=True), lower the "
        "learning rate or the loss's scale, or check the model's output"
    )


def check_inputs(embeddings: torch.Tensor, labels: torch.Tensor, name: str = "embeddings",
                 finite: bool = True) -> None:
    """Validate ``embeddings (B, D)`` float, ``D >= 1``, and ``labels (B,)`` integer tensors,
    and that the embeddings are finite unless ``finite=False`` (:func:`check_finite_loss`
    checks them then, with the loss). ``B = 0`` is an empty batch (a zero loss); ``D = 0`` is
    refused, as :func:`dmlkit.validation.check_embeddings` does (every loss returned a number
    and miners mined triplets from embeddings without a feature)."""
    check_float_matrix(embeddings, name)
    if embeddings.shape[1] == 0:
        raise ShapeError(f"{name} have no features (shape {tuple(embeddings.shape)}): pass at "
                         "least one column")
    if not isinstance(labels, torch.Tensor):
        raise ShapeError(f"labels must be a (B,) tensor with B = {embeddings.shape[0]}, got "
                         f"{type(labels).__name__}: pass torch.as_tensor(labels)")
    if labels.dim() != 1 or labels.shape[0] != embeddings.shape[0]:
        raise ShapeError(
            f"labels must be (B,) with B = {embeddings.shape[0]}, got shape {tuple(labels.shape)}"
        )
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise ShapeError(f"labels must be integers, got {labels.dtype}")
    if finite and not torch.isfinite(embeddings).all():
        raise _nonfinite_input(name)


def check_references(embeddings: torch.Tensor, ref_emb: torch.Tensor | None,
                     ref_labels: torch.Tensor | None, finite: bool = True) -> None:
    """Validate an optional reference set against checked ``embeddings``: both of ``ref_emb``
    and ``ref_labels`` or neither, :func:`check_inputs` on them, and as many features as the
    embeddings (a loss that normalises by itself, AngularLoss, raised torch's size mismatch)."""
    if (ref_emb is None) != (ref_labels is None):
        raise ShapeError("pass both ref_emb and ref_labels, or neither")
    if ref_emb is None:
        return
    check_inputs(ref_emb, ref_labels, name="ref_emb", finite=finite)
    if ref_emb.shape[1] != embeddings.shape[1]:
        raise ShapeError(f"ref_emb has {ref_emb.shape[1]} features but embeddings have "
                         f"{embeddings.shape[1]}: pass a reference set of the same width")


def _nonfinite_input(name: str) -> NonFiniteError:
    """The error for an input tensor ``name`` holding NaN or infinity."""
    return NonFiniteError(f"{name} contain NaN or infinity: check the model and learning rate")
