"""BN-Inception (Ioffe & Szegedy, "Batch Normalization", ICML 2015), the Reality Check's trunk.

The layer names and shapes follow the widely used PyTorch port in Cadene's
``pretrainedmodels`` (``bninception``), so its ImageNet weights
(``bn_inception-52deb4733.pth``) load with ``load_state_dict``. That port expects BGR input in
``[0, 255]`` minus the per-channel mean ``(104, 117, 128)``; :class:`BNInception` takes the
usual ImageNet-normalised RGB tensors (``dmlkit.data.get_transforms("imagenet", ...)``) and
converts them internally (``input_space="imagenet"``), so every dmlkit trunk takes the same
input. The classifier is removed: the output is the 1024-d global-average-pooled feature.
"""

from __future__ import annotations

import torch
from torch import nn

from dmlkit.exceptions import ConfigError

__all__ = ["BN_INCEPTION_SHA256", "BN_INCEPTION_URL", "BNInception"]

#: The port's ImageNet weights (Cadene's ``pretrainedmodels``), over https (the host serves it).
BN_INCEPTION_URL = "https://data.lip6.fr/cadene/pretrainedmodels/bn_inception-52deb4733.pth"
#: SHA-256 of that file. The file name publishes its first 9 hex digits (``52deb4733``, the
#: torchvision naming convention); the full digest is the one recorded publicly for this file
#: and agrees with that prefix. It could not be recomputed here (no network); a download that
#: does not match it is refused (:func:`dmlkit.models.trunks.fetch_weights`).
BN_INCEPTION_SHA256 = "52deb473314542a5c2f87e9e6f26f4ca42fe863d15f986414dbae8c2dfdd2353"

_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)
_CAFFE_MEAN_BGR = (104.0, 117.0, 128.0)

# (name, in, 1x1, 3x3 reduce, 3x3, double reduce, double 3x3, pool kind, pool proj, stride)
# stride 2 blocks (3c, 4e) have no 1x1 branch and a max-pool pass-through branch.
_BLOCKS = (
    ("3a", 192, 64, 64, 64, 64, 96, "avg", 32, 1),
    ("3b", 256, 64, 64, 96, 64, 96, "avg", 64, 1),
    ("3c", 320, 0, 128, 160, 64, 96, "max", 0, 2),
    ("4a", 576, 224, 64, 96, 96, 128, "avg", 128, 1),
    ("4b", 576, 192, 96, 128, 96, 128, "avg", 128, 1),
    ("4c", 576, 160, 128, 160, 128, 160, "avg", 128, 1),
    ("4d", 608, 96, 128, 192, 160, 192, "avg", 128, 1),
    ("4e", 608, 0, 128, 192, 192, 256, "max", 0, 2),
    ("5a", 1056, 352, 192, 320, 160, 224, "avg", 128, 1),
    ("5b", 1024, 352, 192, 320, 192, 224, "max", 128, 1),
)


class BNInception(nn.Module):
    """BN-Inception trunk: ``(N, 3, H, W) -> (N, 1024)`` (H, W >= 32; 224 or 227 in practice).

    ``in_channels != 3`` replaces the first convolution (pretrained weights, if loaded
    afterwards with :func:`dmlkit.models.trunks.adapt_input_channels`, are summed over the
    colour channels). ``input_space``: ``"imagenet"`` (ImageNet-normalised RGB, converted to the
    port's BGR 0-255 mean-subtracted space) or ``"caffe"`` (already in that space).
    """

    feature_dim = 1024

    def __init__(self, in_channels: int = 3, input_space: str = "imagenet") -> None:
        super().__init__()
        if input_space not in ("imagenet", "caffe"):
            raise ValueError(f"input_space must be 'imagenet' or 'caffe', got {input_space!r}")
        if in_channels != 3 and input_space == "imagenet":
            raise ConfigError(
                f"BNInception(input_space='imagenet') converts RGB input internally, which has no "
                f"exact {in_channels}-channel form: use in_channels=3 or input_space='caffe'"
            )
        self.input_space = input_space
        self.in_channels = in_channels
        self._add("conv1_7x7_s2", in_channels, 64, 7, stride=2, padding=3)
        self.pool1_3x3_s2 = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        self._add("conv2_3x3_reduce", 64, 64, 1)
        self._add("conv2_3x3", 64, 192, 3, padding=1)
        self.pool2_3x3_s2 = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        for name, cin, c1, r3, c3, rd, cd, pool, proj, stride in _BLOCKS:
            p = f"inception_{name}"
            if c1:
                self._add(f"{p}_1x1", cin, c1, 1)
            self._add(f"{p}_3x3_reduce", cin, r3, 1)
            self._add(f"{p}_3x3", r3, c3, 3, stride=stride, padding=1)
            self._add(f"{p}_double_3x3_reduce", cin, rd, 1)
            self._add(f"{p}_double_3x3_1", rd, cd, 3, padding=1)
            self._add(f"{p}_double_3x3_2", cd, cd, 3, stride=stride, padding=1)
            if stride == 2:
                setattr(self, f"{p}_pool", nn.MaxPool2d(3, stride=2, ceil_mode=True))
            elif pool == "avg":
                setattr(self, f"{p}_pool", nn.AvgPool2d(3, stride=1, padding=1, ceil_mode=True,
                                                        count_include_pad=True))
            else:
                setattr(self, f"{p}_pool", nn.MaxPool2d(3, stride=1, padding=1, ceil_mode=True))
            if proj:
                self._add(f"{p}_pool_proj", cin, proj, 1)
        self.global_pool = nn.AdaptiveAvgPool2d(1)
        std = torch.tensor(_IMAGENET_STD).view(1, 3, 1, 1)
        mean = torch.tensor(_IMAGENET_MEAN).view(1, 3, 1, 1)
        self.register_buffer("_in_scale", std * 255.0, persistent=False)
        self.register_buffer("_in_shift", mean * 255.0, persistent=False)
        self.register_buffer("_caffe_mean", torch.tensor(_CAFFE_MEAN_BGR).view(1, 3, 1, 1),
                             persistent=False)

    def _add(self, name: str, cin: int, cout: int, k: int, stride: int = 1,
             padding: int = 0) -> None:
        setattr(self, name, nn.Conv2d(cin, cout, k, stride=stride, padding=padding))
        setattr(self, f"{name}_bn", nn.BatchNorm2d(cout, eps=1e-5, momentum=0.1))

    def _cbr(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(getattr(self, f"{name}_bn")(getattr(self, name)(x)))

    def _to_caffe(self, x: torch.Tensor) -> torch.Tensor:
        """ImageNet-normalised RGB -> BGR in [0, 255] minus (104, 117, 128)."""
        if self.input_space == "caffe" or x.shape[1] != 3:
            return x
        rgb255 = x * self._in_scale + self._in_shift
        return rgb255.flip(1) - self._caffe_mean

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The last inception block's feature map ``(N, 1024, h, w)``."""
        x = self._to_caffe(x)
        x = self.pool1_3x3_s2(self._cbr("conv1_7x7_s2", x))
        x = self._cbr("conv2_3x3", self._cbr("conv2_3x3_reduce", x))
        x = self.pool2_3x3_s2(x)
        for name, _cin, c1, _r3, _c3, _rd, _cd, _pool, proj, _stride in _BLOCKS:
            p = f"inception_{name}"
            branches = []
            if c1:
                branches.append(self._cbr(f"{p}_1x1", x))
            branches.append(self._cbr(f"{p}_3x3", self._cbr(f"{p}_3x3_reduce", x)))
            d = self._cbr(f"{p}_double_3x3_reduce", x)
            branches.append(self._cbr(f"{p}_double_3x3_2", self._cbr(f"{p}_double_3x3_1", d)))
            pooled = getattr(self, f"{p}_pool")(x)
            branches.append(self._cbr(f"{p}_pool_proj", pooled) if proj else pooled)
            x = torch.cat(branches, 1)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.global_pool(self.features(x)).flatten(1)
