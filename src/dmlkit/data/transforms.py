"""Image transform presets.

``imagenet`` is the augmentation of Musgrave, Belongie & Lim, "A Metric Learning Reality Check"
(ECCV 2020), as in their powerful-benchmarker code:

- train: resize the shorter side to 256, ``RandomResizedCrop(227, scale=(0.16, 1),
  ratio=(3/4, 4/3))`` (a crop of side 0.4..1 x 256, i.e. about 102..256 px, resized to
  227 x 227), horizontal flip with p = 0.5, ImageNet normalisation;
- eval: resize the shorter side to 256, centre crop 227, ImageNet normalisation.

Another ``image_size`` (the crop) scales the evaluation resize with it, to
``round(image_size * 256 / 227)``: the centre crop keeps 227/256 of the shorter side at the
scale the training crops see (the Reality Check's geometry). A fixed 256 showed a 64 px crop
the middle quarter of the shorter side, objects 1.6-4x larger than in any training view.
Training keeps its 256 (a larger source for the random crop; where the crop falls is a
fraction of the image, whatever its resolution).

The resize caps the longer side at :data:`MAX_ASPECT` times the shorter (4096 px for 256):
without it a 2 x 6000 px strip became a 256 x 768,000 image (1.5 GB, 17 s a load); no image
under 16:1 is affected (a longer strip is scaled to that cap, the crop padded with zeros).

``imagenet_resize`` keeps the whole image (no centre crop): eval resizes to
``image_size x image_size`` (default 224) and normalises; train uses a mild
``RandomResizedCrop(image_size, scale=(0.64, 1))`` and a flip. For images whose content fills
the frame (faces): frozen EfficientNet-Lite0 features of AT&T faces (subjects 21-40) reach
MAP@R 0.86 with it against 0.72 with the ``imagenet`` centre crop.

``grayscale`` is for small single-channel data (Omniglot 105 x 105, Binary Alphadigits,
faces): optional resize, a small random affine jitter for training, tensor in ``[0, 1]``
standardised with ``mean = std = 0.5`` (so values lie in ``[-1, 1]``).
``none`` returns ``None``: the dataset's default tensor conversion.

All presets accept PIL images of any mode (converted to RGB or L first; 16-bit and float
images are scaled to 8 bits by :func:`dmlkit.data.imaging.to_8bit`, not clipped) and have a stable
``repr`` used by the feature cache.
"""

from __future__ import annotations

from typing import Any

from dmlkit.data.imaging import to_8bit
from dmlkit.exceptions import ConfigError

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "MAX_ASPECT", "PRESETS", "ToMode", "get_transforms"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
PRESETS = ("imagenet", "imagenet_resize", "grayscale", "none")
#: The longest side ``imagenet``'s resize makes, as a multiple of its shorter side.
MAX_ASPECT = 16
#: The Reality Check's ``imagenet`` geometry: crop 227 of a shorter side resized to 256.
CROP, RESIZE = 227, 256


class ToMode:
    """Convert a PIL image to ``mode`` (``"RGB"``, ``"L"``); picklable for DataLoader workers."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def __call__(self, img: Any) -> Any:
        img = to_8bit(img)  # 16-bit / float images are scaled, never clipped to white
        return img if getattr(img, "mode", self.mode) == self.mode else img.convert(self.mode)

    def __repr__(self) -> str:
        return f"ToMode({self.mode!r})"


def get_transforms(preset: str, train: bool, image_size: int | None = None, *,
                   resize: int | None = None, scale: tuple[float, float] = (0.16, 1.0),
                   ratio: tuple[float, float] = (3 / 4, 4 / 3), flip: float = 0.5,
                   augment: bool = True, normalize: bool = True):
    """The transform of ``preset`` for training (``train=True``) or evaluation.

    ``imagenet``: ``image_size`` is the crop (default 227) and ``resize`` the shorter side
    before cropping (raised to ``image_size`` if smaller); by default 256 for training and
    ``round(image_size * 256 / 227)`` for evaluation (256 at 227). ``imagenet_resize``:
    ``image_size`` is the square output (default 224). ``grayscale``:
    ``image_size`` resizes to a square (default: keep the size); ``augment=False`` turns the
    training jitter off. ``none``: ``None``.
    """
    from torchvision import transforms as T

    name = preset.lower()
    if name == "none":
        return None
    if name == "imagenet":
        crop = int(image_size or CROP)
        if resize is None:  # evaluation: the crop's share of the shorter side stays 227/256
            resize = RESIZE if train else round(crop * RESIZE / CROP)
        short = max(int(resize), crop)
        norm = [T.Normalize(IMAGENET_MEAN, IMAGENET_STD)] if normalize else []
        if train:
            steps = [ToMode("RGB"), T.Resize(short, max_size=MAX_ASPECT * short),
                     T.RandomResizedCrop(crop, scale=scale, ratio=ratio)]
            if flip > 0:
                steps.append(T.RandomHorizontalFlip(flip))
        else:
            steps = [ToMode("RGB"), T.Resize(short, max_size=MAX_ASPECT * short), T.CenterCrop(crop)]
        return T.Compose([*steps, T.ToTensor(), *norm])
    if name == "imagenet_resize":
        size = int(image_size or 224)
        norm = [T.Normalize(IMAGENET_MEAN, IMAGENET_STD)] if normalize else []
        if train and augment:
            steps = [ToMode("RGB"), T.RandomResizedCrop(size, scale=(0.64, 1.0), ratio=ratio)]
            if flip > 0:
                steps.append(T.RandomHorizontalFlip(flip))
        else:
            steps = [ToMode("RGB"), T.Resize((size, size))]
        return T.Compose([*steps, T.ToTensor(), *norm])
    if name == "grayscale":
        steps = [ToMode("L")]
        if image_size is not None:
            steps.append(T.Resize((int(image_size), int(image_size))))
        if train and augment:
            steps.append(T.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1),
                                        shear=5, fill=0))
        steps.append(T.ToTensor())
        if normalize:
            steps.append(T.Normalize((0.5,), (0.5,)))
        return T.Compose(steps)
    raise ConfigError(f"unknown transform preset {preset!r}; choose one of {PRESETS}")
