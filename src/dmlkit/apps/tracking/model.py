"""SiamFC: the fully-convolutional siamese network of Bertinetto et al. (2016).

L. Bertinetto, J. Valmadre, J. F. Henriques, A. Vedaldi, P. H. S. Torr, "Fully-Convolutional
Siamese Networks for Object Tracking", ECCV 2016 workshops, arXiv:1606.09549.

The same embedding function phi (a 5-layer AlexNet-like network without padding and without
fully-connected layers, Table 1 of the paper) maps the exemplar z (127 x 127) to a 6 x 6 feature
map and the search image x (255 x 255) to a 22 x 22 map. The score map is their
cross-correlation plus a learned bias, Eq. (1):

    f(z, x) = a * (phi(z) ⋆ phi(x)) + b                       (17 x 17, total stride 8)

with a learned scale ``a`` and bias ``b`` (the original implementation's "adjust" layer). The
scale starts at 1e-3 so that initial scores are O(1) and is learned in log space,
``a = 1e-3 * exp(g)``: a plain scale receives gradients of the size of the raw correlation
(10^3-10^4) and makes SGD diverge at the paper's learning rate. The batched cross-correlation is a grouped convolution: the batch
is folded into the channel dimension and each exemplar correlates only with its own search image.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dmlkit.exceptions import ConfigError, ShapeError

EXEMPLAR_SIZE = 127
INSTANCE_SIZE = 255
TOTAL_STRIDE = 8


def xcorr(z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Batched cross-correlation of exemplar features ``z`` with search features ``x``.

    ``z`` is ``(B, C, h, w)`` and ``x`` is ``(B, C, H, W)`` (pair i correlates z[i] with x[i]),
    or ``z`` is ``(1, C, h, w)`` and ``x`` is ``(K, C, H, W)`` (one exemplar over K search
    images, e.g. the tracker's scales). Returns ``(B or K, 1, H - h + 1, W - w + 1)``:
    ``out[i, 0, u, v] = sum_{c, p, q} z[i, c, p, q] * x[i, c, u + p, v + q]``.
    """
    if z.dim() != 4 or x.dim() != 4 or z.shape[1] != x.shape[1]:
        raise ShapeError(
            f"xcorr needs (B, C, h, w) and (B, C, H, W) feature maps, got {tuple(z.shape)} and "
            f"{tuple(x.shape)}"
        )
    if z.shape[0] == 1:
        return F.conv2d(x, z)
    if z.shape[0] != x.shape[0]:
        raise ShapeError(
            f"xcorr: {z.shape[0]} exemplars but {x.shape[0]} search images; pass one exemplar "
            "or as many as search images"
        )
    b, c, h, w = x.shape
    out = F.conv2d(x.reshape(1, b * c, h, w), z, groups=b)
    return out.reshape(b, 1, out.shape[-2], out.shape[-1])


class SiamFCBackbone(nn.Sequential):
    """The paper's embedding function phi (Table 1): 5 convolutions, 2 max-poolings, no padding.

    Layer       kernel   channels      stride  (exemplar 127 -> search 255)
    conv1       11x11    96            2       59 -> 123
    pool1       3x3                    2       29 -> 61
    conv2       5x5      256 (2 groups) 1      25 -> 57
    pool2       3x3                    2       12 -> 28
    conv3       3x3      384           1       10 -> 26
    conv4       3x3      384 (2 groups) 1       8 -> 24
    conv5       3x3      256 (2 groups) 1       6 -> 22

    Batch normalisation follows every convolution but the last, ReLU every one but the last,
    as in the paper. ``width`` multiplies every channel count (1.0 = the paper; a smaller
    width trades accuracy for CPU speed); channel counts stay even for the 2-group layers.
    """

    def __init__(self, width: float = 1.0) -> None:
        if not 0.0 < width <= 4.0:
            raise ConfigError(f"SiamFC backbone width must be in (0, 4], got {width}")

        def ch(n: int) -> int:
            return max(2, 2 * round(n * width / 2))

        c1, c2, c3, c4, c5 = ch(96), ch(256), ch(384), ch(384), ch(256)
        super().__init__(
            nn.Conv2d(3, c1, 11, stride=2),
            nn.BatchNorm2d(c1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2),
            nn.Conv2d(c1, c2, 5, groups=2),
            nn.BatchNorm2d(c2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2),
            nn.Conv2d(c2, c3, 3),
            nn.BatchNorm2d(c3),
            nn.ReLU(inplace=True),
            nn.Conv2d(c3, c4, 3, groups=2),
            nn.BatchNorm2d(c4),
            nn.ReLU(inplace=True),
            nn.Conv2d(c4, c5, 3, groups=2),
        )
        self.width = float(width)
        self.out_channels = c5
        self.total_stride = TOTAL_STRIDE
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)


def receptive_field(layers: nn.Module) -> int:
    """Side in input pixels of the region one output cell of ``layers`` sees: over its
    convolutions and max-poolings in order (no dilation), ``1 + sum_l (k_l - 1) * prod_{m<l} s_m``.
    An input smaller than this has no output cell."""
    field, jump = 1, 1
    for m in layers.modules():
        if isinstance(m, nn.Conv2d | nn.MaxPool2d):
            k = m.kernel_size if isinstance(m.kernel_size, int) else m.kernel_size[0]
            s = m.stride if isinstance(m.stride, int) else m.stride[0]
            field += (k - 1) * jump
            jump *= s
    return field


#: The backbone's receptive field, 87 pixels: the smallest exemplar or search image it maps to a
#: feature map (of one cell). Channel counts do not change it: measured on the narrowest network.
MIN_IMAGE_SIZE = receptive_field(SiamFCBackbone(width=1e-3))


class SiamFC(nn.Module):
    """The siamese tracker network: ``forward(z, x) -> score map`` (Eq. 1 of the paper).

    Images are float tensors ``(B, 3, H, W)`` with values in [0, 255] (the original
    implementation feeds raw pixel values; batch normalisation absorbs the scale).
    ``embed`` computes phi alone so the tracker can embed the exemplar once.
    """

    def __init__(self, width: float = 1.0, out_scale: float = 1e-3) -> None:
        super().__init__()
        self.backbone = SiamFCBackbone(width)
        if out_scale <= 0:
            raise ConfigError(f"out_scale must be positive, got {out_scale}")
        self.out_scale = float(out_scale)
        self.log_gain = nn.Parameter(torch.zeros(()))
        self.bias = nn.Parameter(torch.zeros(()))

    @property
    def width(self) -> float:
        return self.backbone.width

    @property
    def total_stride(self) -> int:
        return self.backbone.total_stride

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """phi(images): ``(B, 3, H, W) -> (B, C, (H - 87) / 8 + 1, (W - 87) / 8 + 1)``."""
        if images.dim() != 4 or images.shape[1] != 3:
            raise ShapeError(f"SiamFC expects (B, 3, H, W) images, got {tuple(images.shape)}")
        if images.shape[-1] < MIN_IMAGE_SIZE or images.shape[-2] < MIN_IMAGE_SIZE:
            raise ShapeError(
                f"SiamFC needs images of at least {MIN_IMAGE_SIZE} x {MIN_IMAGE_SIZE} pixels (its receptive field), got "
                f"{tuple(images.shape[-2:])}"
            )
        return self.backbone(images)

    def score(self, z_feat: torch.Tensor, x_feat: torch.Tensor) -> torch.Tensor:
        """``a * (z_feat ⋆ x_feat) + b`` for precomputed features."""
        return self.scale * xcorr(z_feat, x_feat) + self.bias

    @property
    def scale(self) -> torch.Tensor:
        """The learned scale ``a = out_scale * exp(log_gain)``."""
        return self.out_scale * self.log_gain.exp()

    def forward(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.score(self.embed(z), self.embed(x))


def score_map_size(exemplar_size: int = EXEMPLAR_SIZE, instance_size: int = INSTANCE_SIZE) -> int:
    """Side of the score map: ``(instance - exemplar) / 8 + 1`` (17 for 127 / 255)."""
    return (instance_size - exemplar_size) // TOTAL_STRIDE + 1
