"""Patch-comparison networks of Zagoruyko & Komodakis (CVPR 2015) and a metric-learning descriptor.

"Learning to compare image patches via convolutional neural networks" compares ways to learn
a similarity ``s(p1, p2)`` of two grayscale patches:

* **decision networks** output one value ``o = tanh(z)`` in ``[-1, 1]`` per pair, trained with
  the hinge loss ``sum_i max(0, 1 - y_i o_i)`` (``y = +1`` match, ``-1`` non-match):
  ``2ch`` (the two patches stacked as the channels of one image), ``2ch-deep`` (more, smaller
  convolutions), ``2ch-2stream`` (central-surround: a fovea stream on the central half of the
  patch and a retina stream on the whole patch downsampled by 2), ``siam`` (two branches with
  shared weights -> concatenated descriptors -> fully connected decision layers),
  ``pseudo-siam`` (the same, unshared) and ``siam-2stream`` (siamese central-surround);
* **descriptor networks** compared by the L2 distance, trained with the hinge embedding
  loss (``d`` for matches, ``max(0, m - d)`` for non-matches): ``siam-l2``, ``pseudo-siam-l2``,
  ``siam-2stream-l2``;
* ``hardnet``: a plain metric-learning descriptor (the L2-Net layout of Tian et al., CVPR 2017,
  as used by HardNet, Mishchuk et al., NeurIPS 2017), trained with dmlkit's triplet loss and
  the batch-hard miner: how the rest of dmlkit learns an embedding.

Layer notation of the paper: ``C(n, k, s)`` convolution with ``n`` filters of ``k x k`` and
stride ``s``, ``P(k, s)`` max pooling, ``F(n)`` fully connected. The paper's networks take
64 x 64 patches; to keep CPU training cheap the default here is 32 x 32 (the paper itself
downsamples to 32 x 32 for the retina stream) with a ``width`` multiplier on every layer's
filters (``width = 1`` gives the paper's 96-192-256). Layer kinds and order follow the paper;
kernel sizes, strides and "same" padding are adapted so that both 32 and 64 pixel inputs
keep a spatial map until the last layer (for 64 pixels the first convolution has stride 2).

Scores for ranking (``score``) are higher-is-match: the decision value before the ``tanh``
(``tanh`` saturates to ties in float32) or the negative L2 distance.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dmlkit.exceptions import ConfigError, ShapeError

__all__ = [
    "ARCHITECTURES",
    "DECISION_ARCHITECTURES",
    "DESCRIPTOR_ARCHITECTURES",
    "PatchNet",
    "build_patch_model",
    "prepare_patches",
]

SUPPORTED_SIZES = (32, 64)


def prepare_patches(patches, size: int = 32) -> torch.Tensor:
    """uint8 ``(N, 64, 64)`` patches -> float32 ``(N, 1, size, size)``, zero mean, unit std per patch.

    Downsampling averages ``64/size`` x ``64/size`` blocks (area interpolation). Per-patch
    normalisation removes the affine brightness/contrast changes between views.
    """
    x = torch.as_tensor(patches)
    if x.dim() == 3:
        x = x.unsqueeze(1)
    if x.dim() != 4 or x.shape[1] != 1:
        raise ShapeError(f"patches must be (N, H, W) or (N, 1, H, W), got {tuple(x.shape)}")
    x = x.to(torch.float32)
    if x.shape[-1] != size:
        if x.shape[-1] % size:
            raise ShapeError(f"patch side {x.shape[-1]} is not a multiple of the network input {size}")
        x = F.avg_pool2d(x, x.shape[-1] // size)
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    std = x.std(dim=(1, 2, 3), keepdim=True)
    return (x - mean) / std.clamp_min(1e-3)


def _c(n: int, width: float) -> int:
    return max(4, int(round(n * width)))


def _conv(cin: int, cout: int, k: int, s: int = 1, p: int | None = None) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, k, stride=s, padding=k // 2 if p is None else p), nn.ReLU(inplace=True)]


def _trunk(in_ch: int, width: float, size: int) -> nn.Sequential:
    """Siamese branch / 2ch trunk: C(96,k,s)-ReLU-P(2,2)-C(192,5,1)-ReLU-P(2,2)-C(256,3,1)-ReLU-P(2,2)."""
    c1, c2, c3 = _c(96, width), _c(192, width), _c(256, width)
    first = _conv(in_ch, c1, 7, 2, 3) if size == 64 else _conv(in_ch, c1, 5, 1, 2)
    return nn.Sequential(
        *first, nn.MaxPool2d(2), *_conv(c1, c2, 5), nn.MaxPool2d(2), *_conv(c2, c3, 3), nn.MaxPool2d(2), nn.Flatten()
    )


def _deep_trunk(in_ch: int, width: float, size: int) -> nn.Sequential:
    """2ch-deep: C(96,4,s)-Stack(96)-P(2,2)-Stack(192)-P(2,2), Stack(n) = 3 x [C(n,3,1)-ReLU]."""
    c1, c2 = _c(96, width), _c(192, width)
    stride = 4 if size == 64 else 2

    def stack(cin: int, n: int) -> list[nn.Module]:
        return [*_conv(cin, n, 3), *_conv(n, n, 3), *_conv(n, n, 3)]

    return nn.Sequential(
        *_conv(in_ch, c1, 4, stride, 1), *stack(c1, c1), nn.MaxPool2d(2), *stack(c1, c2), nn.MaxPool2d(2), nn.Flatten()
    )


class _TwoStream(nn.Module):
    """Central-surround streams: fovea = central half crop, retina = whole patch downsampled x2.

    Each stream: C(96,3,1)-ReLU-P(2,2)-C(192,3,1)-ReLU-C(256,3,1)-ReLU-C(256,3,1)-ReLU-P(2,2)
    on a ``size/2`` input (the paper's C(96,4,2)-... on 32 x 32, adapted to stride 1).
    """

    def __init__(self, in_ch: int, width: float, size: int) -> None:
        super().__init__()
        c1, c2, c3 = _c(96, width), _c(192, width), _c(256, width)

        def stream() -> nn.Sequential:
            return nn.Sequential(
                *_conv(in_ch, c1, 3), nn.MaxPool2d(2), *_conv(c1, c2, 3), *_conv(c2, c3, 3), *_conv(c3, c3, 3),
                nn.MaxPool2d(2), nn.Flatten(),
            )

        self.fovea, self.retina = stream(), stream()
        self.size = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.size // 4
        fovea = x[..., q : q + self.size // 2, q : q + self.size // 2]
        retina = F.avg_pool2d(x, 2)
        return torch.cat([self.fovea(fovea), self.retina(retina)], dim=1)


def _feature_dim(module: nn.Module, in_ch: int, size: int) -> int:
    with torch.no_grad():
        return int(module(torch.zeros(1, in_ch, size, size)).shape[1])


class PatchNet(nn.Module):
    """Base of every patch network.

    ``forward(a, b)``: decision networks return ``o = tanh(z)`` in ``[-1, 1]``, descriptor
    networks the L2 distance. ``score(a, b)``: higher is a match. ``describe(x, side)``:
    the descriptor of one side (networks with descriptors only). Inputs are ``(N, 1, S, S)``
    from :func:`prepare_patches`.
    """

    kind: str = "decision"  # "decision" | "descriptor"
    has_descriptor: bool = False

    def __init__(self, name: str, size: int, width: float) -> None:
        super().__init__()
        self.name, self.size, self.width = name, size, width

    def _check(self, a: torch.Tensor, b: torch.Tensor | None = None) -> None:
        for t in (a,) if b is None else (a, b):
            if t.dim() != 4 or t.shape[1] != 1 or t.shape[-1] != self.size or t.shape[-2] != self.size:
                raise ShapeError(
                    f"{self.name} takes (N, 1, {self.size}, {self.size}) patches from prepare_patches, "
                    f"got {tuple(t.shape)}"
                )
        if b is not None and a.shape[0] != b.shape[0]:
            raise ShapeError(f"the two sides hold {a.shape[0]} and {b.shape[0]} patches")

    def logits(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.logits(a, b))

    def score(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.logits(a, b)


class TwoChannelNet(PatchNet):
    """2ch, 2ch-deep, 2ch-2stream: both patches as the two channels of one input."""

    def __init__(self, name: str, size: int, width: float, variant: str) -> None:
        super().__init__(name, size, width)
        if variant == "2ch":
            self.features: nn.Module = _trunk(2, width, size)
            dim = _feature_dim(self.features, 2, size)
            self.head = nn.Sequential(nn.Linear(dim, _c(256, width)), nn.ReLU(inplace=True), nn.Linear(_c(256, width), 1))
        elif variant == "deep":
            self.features = _deep_trunk(2, width, size)
            self.head = nn.Sequential(nn.Linear(_feature_dim(self.features, 2, size), 1))
        elif variant == "2stream":
            self.features = _TwoStream(2, width, size)
            dim = _feature_dim(self.features, 2, size)
            self.head = nn.Sequential(nn.Linear(dim, _c(768, width)), nn.ReLU(inplace=True), nn.Linear(_c(768, width), 1))
        else:  # pragma: no cover - guarded by the registry
            raise ConfigError(f"unknown 2-channel variant {variant}")

    def logits(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        self._check(a, b)
        return self.head(self.features(torch.cat([a, b], dim=1))).squeeze(1)


class SiameseNet(PatchNet):
    """siam / pseudo-siam / siam-2stream (decision head) and their ``-l2`` descriptor variants.

    Decision: ``z = F(1)(ReLU(F(512)([f1(a), f2(b)])))`` (Zagoruyko & Komodakis, Fig. 2).
    ``-l2``: ``d = ||f1(a) - f2(b)||_2`` on L2-normalised descriptors (unit sphere, so the
    hinge-embedding margin has a fixed scale); ``score = -d``.
    """

    has_descriptor = True

    def __init__(self, name: str, size: int, width: float, *, shared: bool, two_stream: bool, l2: bool) -> None:
        super().__init__(name, size, width)
        make: Callable[[], nn.Module] = (
            (lambda: _TwoStream(1, width, size)) if two_stream else (lambda: _trunk(1, width, size))
        )
        self.branch1 = make()
        self.branch2 = self.branch1 if shared else make()
        self.shared, self.l2 = shared, l2
        self.dim = _feature_dim(self.branch1, 1, size)
        if l2:
            self.kind = "descriptor"
            self.head = None
        else:
            hidden = _c(512, width)
            self.head = nn.Sequential(nn.Linear(2 * self.dim, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, 1))

    def describe(self, x: torch.Tensor, side: int = 0) -> torch.Tensor:
        """Descriptors of one side (``side=1`` uses the second branch of pseudo-siamese nets)."""
        self._check(x)
        d = (self.branch2 if side else self.branch1)(x)
        return F.normalize(d, dim=1) if self.l2 else d

    def decide(self, da: torch.Tensor, db: torch.Tensor) -> torch.Tensor:
        """Pair scores from descriptors: the decision logits, or ``-||da - db||``."""
        if self.head is None:
            return -(da - db).norm(dim=1)
        return self.head(torch.cat([da, db], dim=1)).squeeze(1)

    def logits(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.decide(self.describe(a, 0), self.describe(b, 1))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        z = self.logits(a, b)
        return -z if self.l2 else torch.tanh(z)


class HardNetDescriptor(PatchNet):
    """L2-Net / HardNet layout: 7 conv layers with BatchNorm, 128-d L2-normalised descriptor.

    C(32,3,1)-C(32,3,1)-C(64,3,2)-C(64,3,1)-C(128,3,2)-C(128,3,1)-Dropout(0.3)-C(128,8) with
    BN + ReLU after each but the last (Tian et al., CVPR 2017; Mishchuk et al., NeurIPS 2017),
    channels scaled by ``2 * width`` (``width = 0.5`` is the original), for 32 x 32 input (64 x 64 is area-downsampled first). Trained with a metric-learning loss
    on batches of matching patches (``dmlkit.losses`` + ``dmlkit.miners``); ``score = -L2``.
    """

    kind = "descriptor"
    has_descriptor = True

    def __init__(self, name: str, size: int, width: float) -> None:
        super().__init__(name, size, width)
        w = 2.0 * width  # width 0.5 -> the original 32-64-128 channels; 0.25 -> 16-32-64
        c1, c2, c3 = _c(32, w), _c(64, w), _c(128, w)

        def block(cin: int, cout: int, s: int = 1) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, stride=s, padding=1, bias=False), nn.BatchNorm2d(cout, affine=False), nn.ReLU(inplace=True)]

        self.net = nn.Sequential(
            *block(1, c1), *block(c1, c1), *block(c1, c2, 2), *block(c2, c2), *block(c2, c3, 2), *block(c3, c3),
            nn.Dropout(0.3), nn.Conv2d(c3, 128, 8, bias=False), nn.BatchNorm2d(128, affine=False), nn.Flatten(),
        )
        self.dim = 128

    def describe(self, x: torch.Tensor, side: int = 0) -> torch.Tensor:
        self._check(x)
        if self.size == 64:
            x = F.avg_pool2d(x, 2)
        return F.normalize(self.net(x), dim=1)

    def decide(self, da: torch.Tensor, db: torch.Tensor) -> torch.Tensor:
        return -(da - db).norm(dim=1)

    def logits(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.decide(self.describe(a), self.describe(b))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return -self.logits(a, b)


_BUILDERS: dict[str, Callable[[int, float], PatchNet]] = {
    "2ch-2stream": lambda s, w: TwoChannelNet("2ch-2stream", s, w, "2stream"),
    "2ch-deep": lambda s, w: TwoChannelNet("2ch-deep", s, w, "deep"),
    "2ch": lambda s, w: TwoChannelNet("2ch", s, w, "2ch"),
    "siam": lambda s, w: SiameseNet("siam", s, w, shared=True, two_stream=False, l2=False),
    "siam-l2": lambda s, w: SiameseNet("siam-l2", s, w, shared=True, two_stream=False, l2=True),
    "pseudo-siam": lambda s, w: SiameseNet("pseudo-siam", s, w, shared=False, two_stream=False, l2=False),
    "pseudo-siam-l2": lambda s, w: SiameseNet("pseudo-siam-l2", s, w, shared=False, two_stream=False, l2=True),
    "siam-2stream": lambda s, w: SiameseNet("siam-2stream", s, w, shared=True, two_stream=True, l2=False),
    "siam-2stream-l2": lambda s, w: SiameseNet("siam-2stream-l2", s, w, shared=True, two_stream=True, l2=True),
    "hardnet": lambda s, w: HardNetDescriptor("hardnet", s, w),
}
#: Every architecture, in the column order of the paper's Table 1 (plus ``hardnet``).
ARCHITECTURES = tuple(_BUILDERS)
DECISION_ARCHITECTURES = ("2ch-2stream", "2ch-deep", "2ch", "siam", "pseudo-siam", "siam-2stream")
DESCRIPTOR_ARCHITECTURES = ("siam-l2", "pseudo-siam-l2", "siam-2stream-l2", "hardnet")


def build_patch_model(name: str, patch_size: int = 32, width: float = 0.25) -> PatchNet:
    """One of :data:`ARCHITECTURES` for ``patch_size`` x ``patch_size`` input (32 or 64)."""
    if name not in _BUILDERS:
        raise ConfigError(f"unknown patch architecture '{name}': choose one of {', '.join(ARCHITECTURES)}")
    if patch_size not in SUPPORTED_SIZES:
        raise ConfigError(f"patch_size must be 32 or 64, got {patch_size}")
    if not 0.0 < width <= 4.0:
        raise ConfigError(f"width must be in (0, 4], got {width}")
    return _BUILDERS[name](patch_size, float(width))
