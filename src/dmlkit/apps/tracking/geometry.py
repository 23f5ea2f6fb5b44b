"""Boxes, crops and the SiamFC context rule.

Boxes are ``(x, y, w, h)``: top-left corner, width and height in pixels, **0-based**: ``x`` is
the column of the box's leftmost pixel counted from 0 (as numpy indexes an image, and as
Pillow, OpenCV and image viewers report positions). Centres are
``(cx, cy) = (x + w / 2, y + h / 2)`` in continuous pixel coordinates where pixel ``i`` covers
``[i, i + 1)``, so the box covers ``[x, x + w)`` and pixel ``i``'s centre is ``i + 1/2``.

The benchmarks' files are **1-based** (MATLAB): OTB's ``groundtruth_rect.txt`` and GOT-10k's
``groundtruth.txt`` write the target whose top-left pixel is 0-based ``(40, 30)`` as
``41,31,w,h`` (got-10k/toolkit issue #6: "All coordinate values are 1-based"; the OTB toolkit's
centre ``x + (w - 1) / 2`` is that pixel grid's; siamfc-pytorch converts with
``x - 1 + (w - 1) / 2`` to 0-based pixel-centre coordinates, which is ``x - 1 + w / 2`` here).
:mod:`dmlkit.apps.tracking.datasets` subtracts 1 from ``x`` and ``y`` when it reads them and
``dmlkit track build-data`` / ``track evaluate`` add it back when they write such files.
Overlap and centre error do not change when both boxes shift alike, but the exemplar a
tracker cuts from the first box does: read unconverted, it was centred one pixel right and
down of the target.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from dmlkit.exceptions import ShapeError


def parse_box(text: str) -> np.ndarray:
    """``"x,y,w,h"`` (commas, tabs or spaces) -> float array of 4; raises ShapeError otherwise."""
    parts = [p for p in text.replace("\t", ",").replace(" ", ",").split(",") if p.strip()]
    try:
        box = np.array([float(p) for p in parts], dtype=np.float64)
    except ValueError:
        raise ShapeError(f"a box is 'x,y,w,h' (four numbers), got {text!r}") from None
    if box.shape != (4,):
        raise ShapeError(f"a box is 'x,y,w,h' (four numbers), got {text!r}")
    if not np.isfinite(box).all() or box[2] <= 0 or box[3] <= 0:
        raise ShapeError(f"a box needs finite values and positive width and height, got {text!r}")
    return box


def box_to_center(box: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y, w, h) -> (centre (cy, cx), size (h, w))`` as float arrays."""
    x, y, w, h = (float(v) for v in box)
    return np.array([y + h / 2.0, x + w / 2.0]), np.array([h, w])


def center_to_box(center: np.ndarray, size: np.ndarray) -> np.ndarray:
    """``(centre (cy, cx), size (h, w)) -> (x, y, w, h)``."""
    cy, cx = float(center[0]), float(center[1])
    h, w = float(size[0]), float(size[1])
    return np.array([cx - w / 2.0, cy - h / 2.0, w, h])


def exemplar_side(size: np.ndarray, context: float = 0.5) -> float:
    """Side ``s_z`` of the square exemplar region in image pixels (SiamFC, Sec. 2.4).

    With a margin ``p = context * (w + h) / 2`` on each side (``context = 0.5`` gives the
    paper's ``p = (w + h) / 4``): ``s_z = sqrt((w + 2p) (h + 2p))``. The region is then resized to
    127 x 127; the search region is ``s_x = s_z * 255 / 127`` around the previous position.
    """
    h, w = float(size[0]), float(size[1])
    pad = context * (w + h)
    return math.sqrt((w + pad) * (h + pad))


def image_to_tensor(image: np.ndarray | torch.Tensor) -> torch.Tensor:
    """``(H, W, 3)`` uint8/float array (or gray ``(H, W)``) -> ``(3, H, W)`` float32 in [0, 255]."""
    if isinstance(image, torch.Tensor):
        t = image
        if t.dim() == 3 and t.shape[0] == 3:
            return t.float()
        t = t.cpu().numpy()
        image = t
    arr = np.asarray(image)
    if arr.ndim == 2:
        arr = np.repeat(arr[:, :, None], 3, axis=2)
    if arr.ndim != 3 or arr.shape[2] not in (3, 4):
        raise ShapeError(f"a frame is an (H, W, 3) RGB or (H, W) gray image, got {arr.shape}")
    arr = arr[:, :, :3]
    if arr.dtype != np.float32:
        arr = arr.astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))


def crop_and_resize(
    image: torch.Tensor,
    center: np.ndarray,
    sides: Sequence[float] | float,
    out_size: int,
    pad_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Square crops of side ``sides[k]`` (image pixels) centred on ``center`` resized to ``out_size``.

    ``image`` is ``(3, H, W)`` float. A crop of side ``s`` covers ``[c - s / 2, c + s / 2]`` in
    the continuous coordinates of the module docstring, i.e. pixel centres (index coordinates)
    ``c - 1/2 -/+ (s - 1) / 2`` as SiamFC defines its crops. Regions that leave the image are
    filled with ``pad_value`` (default: the image's mean colour, as in SiamFC): an output pixel
    wholly outside the image is the pad, one across the border a bilinear blend of the border
    pixel and the pad. Resampling is bilinear with
    ``torchvision.ops.roi_align``, averaging ``ceil(side / out_size)``^2 samples per output
    pixel (one when enlarging, an area average when shrinking, which anti-aliases); several
    sides (the tracker's scales) are cropped in one call.
    Returns ``(K, 3, out_size, out_size)``.
    """
    from torchvision.ops import roi_align

    if image.dim() != 3 or image.shape[0] != 3:
        raise ShapeError(f"crop_and_resize expects a (3, H, W) image, got {tuple(image.shape)}")
    side_list = [float(sides)] if np.isscalar(sides) else [float(s) for s in sides]
    if pad_value is None:
        pad_value = image.mean(dim=(1, 2))
    pad = pad_value.to(image.dtype).view(3, 1, 1)
    cy, cx = float(center[0]), float(center[1])
    rois = torch.tensor(
        [[0.0, cx - s / 2.0, cy - s / 2.0, cx + s / 2.0, cy + s / 2.0] for s in side_list],
        dtype=image.dtype, device=image.device,
    )
    # roi_align samples outside the image as 0, centring on the pad value makes that padding;
    # but it reads a sample up to one pixel beyond the border as the border pixel, so an output
    # pixel wholly outside the image copied that pixel: a one-pixel frame of zeros (the pad)
    # around the image makes every sample beyond the border blend into, then read, the pad
    framed = F.pad(image - pad, (1, 1, 1, 1))
    out = roi_align(framed[None], rois + rois.new_tensor([0.0, 1.0, 1.0, 1.0, 1.0]),
                    output_size=out_size, spatial_scale=1.0, sampling_ratio=-1, aligned=True)
    return out + pad[None]
