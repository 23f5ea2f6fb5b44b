"""Classification losses: softmax, normalised softmax and the large-margin (angular) family.

Each loss owns a weight matrix ``W`` of shape ``(num_classes, embedding_size)`` (one row per
class), available through ``loss.parameters()`` so the trainer can give it its own optimiser
and learning rate (the Reality Check tunes that learning rate separately). All of them reduce
by the mean over the batch of the per-sample cross entropy, computed with
:func:`torch.nn.functional.cross_entropy` (log-sum-exp, no overflow at scale 64).

The large-margin family follows seed 002 (and InsightFace's "combined margin")::

    L = -1/N sum_i log( e^{s phi(theta_{y_i})} / (e^{s phi(theta_{y_i})} + sum_{j != y_i} e^{s cos theta_j}) )
    phi(theta) = cos(m1 * theta + m2) - m3

with ``cos theta_j = <x / |x|, W_j / |W_j|>``. The named presets are SphereFace (``m1``),
CosFace (``m3``) and ArcFace (``m2``).

Numerics: when embeddings or weights are float16/bfloat16 the cosines, margins and cross
entropy are computed in float32 (autocast disabled inside the loss), and the loss is returned
in float32; gradients flow back to the low-precision tensors in their own dtype. float64
inputs are kept in float64 (for gradient checks).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dmlkit.exceptions import ConfigError
from dmlkit.losses._pairs import safe_norm, safe_normalize
from dmlkit.losses.base import ProxyLoss, full_precision, register_loss

__all__ = [
    "ArcFaceLoss",
    "CosFaceLoss",
    "LargeMarginSoftmaxLoss",
    "NormalizedSoftmaxLoss",
    "SoftmaxLoss",
    "SphereFaceLoss",
]

#: Cosines are clamped to [-1 + eps, 1 - eps] before ``acos`` so its gradient stays finite.
_ACOS_EPS = {torch.float64: 1e-12, torch.float32: 1e-6}

#: The largest ArcFace margin (radians) whose target logit is monotone in the angle: the root
#: of ``cos m + m sin m = 1`` in ``(0, pi)``. At ``theta = pi - m`` the logit falls to
#: ``cos(pi) = -1`` and the fallback continues from ``-cos m - m sin m``, which is <= -1 (no
#: upward jump) exactly while ``m`` is at most this root.
ARCFACE_MAX_MARGIN = 2.3311223704144224


# --------------------------------------------------------------------------- shared helpers
def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (half/bfloat16 inputs are upcast)."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def reject_pairs_and_refs(loss: nn.Module, indices, ref_emb) -> None:
    """Classification/proxy losses use neither a miner's indices nor a reference set."""
    name = type(loss).__name__
    if indices is not None:
        raise ConfigError(
            f"{name} compares embeddings with class weights/proxies, not pairs or triplets: "
            "remove the miner from the config (miner: null)"
        )
    if ref_emb is not None:
        raise ConfigError(
            f"{name} does not take ref_emb/ref_labels (cross-batch memory is for pair-based "
            "losses): call it as loss(embeddings, labels)"
        )


def cosine_to_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``(B, C)`` cosine similarities between the rows of ``x`` and the rows of ``weight``."""
    return safe_normalize(x, dim=1) @ safe_normalize(weight, dim=1).T


def _logits_cross_entropy(loss, embeddings, labels, indices, ref_emb) -> torch.Tensor:
    """``mean_i -log softmax(loss.get_logits(x))_{i, y_i}`` (in full precision): the softmax losses.

    Rejects miner indices / reference embeddings, and returns the loss's zero (counted as an
    empty batch) for an empty batch.
    """
    reject_pairs_and_refs(loss, indices, ref_emb)
    labels = labels.long()
    if embeddings.shape[0] == 0:
        return loss.zero_loss(embeddings)
    logits = loss.get_logits(embeddings)
    with full_precision(embeddings):
        return F.cross_entropy(logits, labels)


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"{name} must be a positive finite number, got {value}")


# --------------------------------------------------------------------------- softmax
@register_loss("softmax")
class SoftmaxLoss(ProxyLoss):
    """Softmax cross entropy on a learned linear layer (the classic classification baseline).

    ``L = -1/N sum_i log( exp(W_{y_i} x_i + b_{y_i}) / sum_j exp(W_j x_i + b_j) )``

    Embeddings are used as they come (no normalisation). ``W`` and ``b`` are initialised as in
    :class:`torch.nn.Linear`. Seed 002 (lecture 8) and e.g. Wen et al., "A Discriminative
    Feature Learning Approach for Deep Face Recognition", ECCV 2016 (the softmax baseline).

    Args:
        num_classes: number of training classes ``C`` (labels in ``[0, C)``).
        embedding_size: embedding dimension ``D``.
        bias: learn a bias ``b`` (default True).
    """

    def __init__(self, num_classes: int, embedding_size: int, bias: bool = True) -> None:
        super().__init__(num_classes, embedding_size)
        layer = nn.Linear(embedding_size, num_classes, bias=bias)
        self.weight = nn.Parameter(layer.weight.detach().clone())
        self.bias = nn.Parameter(layer.bias.detach().clone()) if bias else None

    def get_logits(self, embeddings: torch.Tensor) -> torch.Tensor:
        """``(B, C)`` class scores (in float32 or float64)."""
        dtype = compute_dtype(embeddings, self.weight)
        with full_precision(embeddings):
            bias = None if self.bias is None else self.bias.to(dtype)
            return F.linear(embeddings.to(dtype), self.weight.to(dtype), bias)

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        return _logits_cross_entropy(self, embeddings, labels, indices, ref_emb)


# --------------------------------------------------------------------------- normalised softmax
@register_loss("normalized_softmax")
class NormalizedSoftmaxLoss(ProxyLoss):
    """Normalised softmax (NormFace / "classification is a strong baseline").

    ``L = -1/N sum_i log( exp(cos(x_i, W_{y_i}) / T) / sum_j exp(cos(x_i, W_j) / T) )``

    Both embeddings and class weights are L2-normalised; ``T`` is the temperature
    (``scale = 1 / T``). Zhai & Wu, "Classification is a Strong Baseline for Deep Metric
    Learning", BMVC 2019 (arXiv 1811.12649, 2018); default ``T = 0.05`` as in that paper.
    Weights are initialised from ``N(0, 0.01^2)`` (isotropic directions).

    Equivalent to pytorch-metric-learning ``NormalizedSoftmaxLoss(num_classes, embedding_size,
    temperature=T)`` with ``W_pml = W.T``.

    Args:
        temperature: ``T`` (default 0.05). Give either ``temperature`` or ``scale``.
        scale: ``1 / T``; overrides the temperature when given.
    """

    def __init__(
        self,
        num_classes: int,
        embedding_size: int,
        temperature: float = 0.05,
        scale: float | None = None,
    ) -> None:
        super().__init__(num_classes, embedding_size)
        if scale is not None:
            _check_positive(scale=scale)
            temperature = 1.0 / scale
        _check_positive(temperature=temperature)
        self.temperature = float(temperature)
        self.weight = nn.Parameter(torch.empty(num_classes, embedding_size))
        nn.init.normal_(self.weight, std=0.01)

    @property
    def scale(self) -> float:
        return 1.0 / self.temperature

    def get_logits(self, embeddings: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(embeddings, self.weight)
        with full_precision(embeddings):
            return cosine_to_rows(embeddings.to(dtype), self.weight.to(dtype)) / self.temperature

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        return _logits_cross_entropy(self, embeddings, labels, indices, ref_emb)


# --------------------------------------------------------------------------- margin family
def psi_margin(cos: torch.Tensor, m1: float, m2: float, m3: float) -> torch.Tensor:
    """Monotone extension of ``cos(m1 theta + m2) - m3`` over ``theta in [0, pi]``.

    ``psi(theta) = (-1)^k cos(m1 theta + m2) - 2k - m3`` with ``k = floor((m1 theta + m2) / pi)``
    (SphereFace, Liu et al. 2017, extended to an additive angle). It equals the plain
    margin while ``m1 theta + m2 <= pi`` and keeps decreasing (continuously) beyond it, so a
    large margin never *rewards* a larger angle. ``k`` carries no gradient.
    """
    if m1 == 1.0 and m2 == 0.0:
        return cos - m3  # CosFace: no angle needed (exact, and cheap)
    eps = _ACOS_EPS.get(cos.dtype, 1e-6)
    theta = torch.acos(cos.clamp(-1 + eps, 1 - eps))
    u = m1 * theta + m2
    k = torch.floor(u.detach() / math.pi)
    sign = 1.0 - 2.0 * torch.remainder(k, 2)  # (-1)^k
    return sign * torch.cos(u) - 2.0 * k - m3


def sphereface_lambda(step: int, base: float, gamma: float, power: float, minimum: float) -> float:
    """SphereFace's annealing weight ``lambda = max(lambda_min, base (1 + gamma step)^-power)``."""
    return max(minimum, base * (1.0 + gamma * step) ** (-power))


@register_loss("large_margin_softmax")
class LargeMarginSoftmaxLoss(ProxyLoss):
    """The large-margin softmax family ``phi(theta) = cos(m1 theta + m2) - m3`` (seed 002).

    ``L = -1/N sum_i log( e^{s psi(theta_{y_i})} / (e^{s psi(theta_{y_i})} + sum_{j != y_i} e^{s cos theta_j}) )``

    where ``cos theta_j`` is the cosine between the embedding and class weight ``W_j`` and
    ``psi`` is the monotone extension of ``phi`` (:func:`psi_margin`). ``m1`` is SphereFace's
    multiplicative angular margin (Liu et al., "SphereFace", CVPR 2017), ``m2`` ArcFace's
    additive angular margin (Deng et al., CVPR 2019), ``m3`` CosFace's additive cosine margin
    (Wang et al., CVPR 2018); combining them is InsightFace's "combined margin". Defaults
    (``m1 = 1, m2 = m3 = 0, s = 64``) give the normalised softmax at scale 64.

    Args:
        m1, m2, m3: the margins (``m1 >= 1``, ``0 <= m2 < pi``, ``m3 >= 0``).
        scale: ``s``; multiplies every logit.
        feature_norm_scale: multiply the logits by ``|x_i|`` as well (SphereFace keeps the
            feature norm; the others use a fixed ``s`` on normalised embeddings).
        anneal: SphereFace's optimisation trick: the target logit is
            ``(lambda cos theta + psi(theta)) / (1 + lambda)`` with ``lambda`` annealed from
            ``lambda_base`` towards ``lambda_min`` by ``lambda_base (1 + lambda_gamma t)^-lambda_power``,
            ``t`` = number of forward passes in training mode (a saved buffer, so resume-safe).
    Weights are initialised from ``N(0, 0.01^2)`` (InsightFace).
    """

    def __init__(
        self,
        num_classes: int,
        embedding_size: int,
        m1: float = 1.0,
        m2: float = 0.0,
        m3: float = 0.0,
        scale: float = 64.0,
        *,
        feature_norm_scale: bool = False,
        anneal: bool = False,
        lambda_base: float = 1000.0,
        lambda_gamma: float = 0.12,
        lambda_power: float = 1.0,
        lambda_min: float = 5.0,
    ) -> None:
        super().__init__(num_classes, embedding_size)
        if not m1 >= 1.0:
            raise ConfigError(f"m1 (multiplicative angular margin) must be >= 1, got {m1}")
        if not 0.0 <= m2 < math.pi:
            raise ConfigError(f"m2 (additive angular margin, radians) must be in [0, pi), got {m2}")
        if not m3 >= 0.0:
            raise ConfigError(f"m3 (additive cosine margin) must be >= 0, got {m3}")
        _check_positive(scale=scale)
        if anneal:
            _check_positive(lambda_base=lambda_base, lambda_gamma=lambda_gamma)
            if lambda_min < 0 or lambda_power < 0:
                raise ConfigError("lambda_min and lambda_power must be >= 0")
        self.m1, self.m2, self.m3 = float(m1), float(m2), float(m3)
        self.scale = float(scale)
        self.feature_norm_scale = bool(feature_norm_scale)
        self.anneal = bool(anneal)
        self.lambda_params = (
            float(lambda_base),
            float(lambda_gamma),
            float(lambda_power),
            float(lambda_min),
        )
        self.register_buffer("anneal_step", torch.zeros((), dtype=torch.long))
        self.weight = nn.Parameter(torch.empty(num_classes, embedding_size))
        nn.init.normal_(self.weight, std=0.01)

    # -- pieces --------------------------------------------------------------------------
    def target_logit(self, cos_target: torch.Tensor) -> torch.Tensor:
        """The margin-modified cosine of the true class (before scaling)."""
        return psi_margin(cos_target, self.m1, self.m2, self.m3)

    def current_lambda(self) -> float:
        """The annealing weight at the current step (0 when annealing is off)."""
        if not self.anneal:
            return 0.0
        return sphereface_lambda(int(self.anneal_step), *self.lambda_params)

    def _scale(self, logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.feature_norm_scale:
            return logits * (self.scale * safe_norm(x, dim=1, keepdim=True))
        return logits * self.scale

    def get_logits(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Scaled cosine logits without margin (what to use for classification at test time)."""
        dtype = compute_dtype(embeddings, self.weight)
        with full_precision(embeddings):
            x = embeddings.to(dtype)
            return self._scale(cosine_to_rows(x, self.weight.to(dtype)), x)

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        reject_pairs_and_refs(self, indices, ref_emb)
        labels = labels.long()
        if embeddings.shape[0] == 0:
            return self.zero_loss(embeddings)
        dtype = compute_dtype(embeddings, self.weight)
        with full_precision(embeddings):
            x = embeddings.to(dtype)
            cos = cosine_to_rows(x, self.weight.to(dtype))
            cos_t = cos.gather(1, labels[:, None]).squeeze(1)
            target = self.target_logit(cos_t)
            lam = self.current_lambda()
            if lam > 0:
                target = (lam * cos_t + target) / (1.0 + lam)
            logits = cos.scatter(1, labels[:, None], target[:, None])
            loss = F.cross_entropy(self._scale(logits, x), labels)
        if self.anneal and self.training:
            self.anneal_step += 1
        return loss

    def extra_repr(self) -> str:
        return (
            f"num_classes={self.num_classes}, embedding_size={self.embedding_size}, "
            f"m1={self.m1}, m2={self.m2}, m3={self.m3}, scale={self.scale}"
        )


@register_loss("sphereface")
class SphereFaceLoss(LargeMarginSoftmaxLoss):
    """SphereFace / A-Softmax: multiplicative angular margin ``m1 = margin``.

    ``L = -1/N sum_i log( e^{|x_i| psi(theta_{y_i})} / (e^{|x_i| psi(theta_{y_i})} + sum_{j != y_i} e^{|x_i| cos theta_j}) )``,
    ``psi(theta) = (-1)^k cos(m theta) - 2k``, ``k = floor(m theta / pi)``.

    Liu, Wen, Yu, Li, Raj, Song, "SphereFace: Deep Hypersphere Embedding for Face
    Recognition", CVPR 2017. Paper defaults: ``m = 4``, normalised weights, no bias, the
    feature norm as the scale (``scale`` multiplies it, default 1). ``anneal=True`` enables
    the paper's softmax/A-Softmax mixing with ``lambda = max(5, 1000 (1 + 0.12 t)^-1)``.

    With ``anneal=False`` this equals pytorch-metric-learning
    ``SphereFaceLoss(num_classes, embedding_size, margin=m, scale=scale)`` with ``W_pml = W.T``.
    """

    def __init__(
        self,
        num_classes: int,
        embedding_size: int,
        margin: int = 4,
        scale: float = 1.0,
        *,
        anneal: bool = False,
        lambda_base: float = 1000.0,
        lambda_gamma: float = 0.12,
        lambda_power: float = 1.0,
        lambda_min: float = 5.0,
    ) -> None:
        super().__init__(
            num_classes,
            embedding_size,
            m1=margin,
            scale=scale,
            feature_norm_scale=True,
            anneal=anneal,
            lambda_base=lambda_base,
            lambda_gamma=lambda_gamma,
            lambda_power=lambda_power,
            lambda_min=lambda_min,
        )
        self.margin = self.m1


@register_loss("cosface")
class CosFaceLoss(LargeMarginSoftmaxLoss):
    """CosFace / large margin cosine loss: additive cosine margin ``m3 = margin``.

    ``L = -1/N sum_i log( e^{s (cos theta_{y_i} - m)} / (e^{s (cos theta_{y_i} - m)} + sum_{j != y_i} e^{s cos theta_j}) )``

    Wang, Wang, Zhou, Ji, Gong, Zhou, Li, Liu, "CosFace: Large Margin Cosine Loss for Deep Face
    Recognition", CVPR 2018. Paper defaults ``s = 64``, ``m = 0.35``.

    Equals pytorch-metric-learning ``CosFaceLoss(num_classes, embedding_size, margin=m,
    scale=s)`` with ``W_pml = W.T``.
    """

    def __init__(
        self, num_classes: int, embedding_size: int, margin: float = 0.35, scale: float = 64.0
    ) -> None:
        super().__init__(num_classes, embedding_size, m3=margin, scale=scale)
        self.margin = self.m3


@register_loss("arcface")
class ArcFaceLoss(LargeMarginSoftmaxLoss):
    """ArcFace / additive angular margin: ``m2 = margin``.

    ``L = -1/N sum_i log( e^{s cos(theta_{y_i} + m)} / (e^{s cos(theta_{y_i} + m)} + sum_{j != y_i} e^{s cos theta_j}) )``

    Deng, Guo, Xue, Zafeiriou, "ArcFace: Additive Angular Margin Loss for Deep Face
    Recognition", CVPR 2019. Paper defaults ``s = 64``, ``m = 0.5``. Where ``theta + m > pi``
    the target logit is ``cos theta - m sin m`` (when ``cos theta <= cos(pi - m)``), as in the
    paper's code (InsightFace). That keeps it decreasing in ``theta`` only for
    ``m <= ARCFACE_MAX_MARGIN`` (2.3311 rad, the root of ``cos m + m sin m = 1``): above it the
    fallback jumps up at ``theta = pi - m``, so larger margins are refused (use
    ``LargeMarginSoftmaxLoss(m2=m)``, whose extension is monotone for any ``m2 < pi``). With
    ``easy_margin=True`` the margin is applied only where ``cos theta > 0`` (plain
    ``cos theta`` elsewhere); that logit jumps up by ``sin m`` at ``theta = pi / 2`` by design
    (InsightFace's easy margin), so it is not monotone.

    With ``easy_margin=False`` this equals pytorch-metric-learning ``ArcFaceLoss(num_classes,
    embedding_size, margin=degrees(m), scale=s)`` (pml takes degrees) with ``W_pml = W.T``.
    """

    def __init__(
        self,
        num_classes: int,
        embedding_size: int,
        margin: float = 0.5,
        scale: float = 64.0,
        easy_margin: bool = False,
    ) -> None:
        super().__init__(num_classes, embedding_size, m2=margin, scale=scale)
        if self.m2 > ARCFACE_MAX_MARGIN:
            raise ConfigError(
                f"arcface margin must be at most {ARCFACE_MAX_MARGIN:.4f} rad, got {margin}: above "
                "it (the root of cos m + m sin m = 1) the paper code's fallback cos(theta) - m "
                "sin(m) jumps up at theta = pi - m, so the loss is not monotone in the angle; use "
                "a smaller margin, or large_margin_softmax with m2 for a monotone large margin"
            )
        self.margin = self.m2
        self.easy_margin = bool(easy_margin)
        self.threshold = math.cos(math.pi - self.m2)
        self.linear_drop = math.sin(math.pi - self.m2) * self.m2

    def target_logit(self, cos_target: torch.Tensor) -> torch.Tensor:
        eps = _ACOS_EPS.get(cos_target.dtype, 1e-6)
        theta = torch.acos(cos_target.clamp(-1 + eps, 1 - eps))
        with_margin = torch.cos(theta + self.m2)
        if self.easy_margin:
            return torch.where(cos_target > 0, with_margin, cos_target)
        return torch.where(cos_target > self.threshold, with_margin, cos_target - self.linear_drop)
