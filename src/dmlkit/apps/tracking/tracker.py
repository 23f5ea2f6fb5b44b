"""The SiamFC tracker (inference of Bertinetto et al. 2016, Sec. 2.4 and 4.1) and an NCC baseline.

Per frame, around the previous centre:

1. crop the search region at ``num_scales`` scales ``s_x * step^k``,
   ``k = -(n-1)/2 .. (n-1)/2`` and resize each to 255 x 255;
2. score them against the first frame's exemplar: ``num_scales`` 17 x 17 maps;
3. upsample each map x16 with bicubic interpolation (272 x 272) and multiply the maps of the
   changed scales by ``scale_penalty``; take the scale with the highest peak;
4. normalise that map to sum 1 and blend a cosine (Hann) window, the displacement penalty:
   ``r <- (1 - window_influence) r + window_influence * hann``;
5. move the centre by the peak's displacement from the map centre mapped back to image pixels
   (``/ 16 * 8`` to search-image pixels, ``* s_x / 255`` to the frame);
6. damp the scale update: ``s <- (1 - scale_lr) s + scale_lr * s * step^k*`` for both the
   target size and the search region.

Defaults are those of the paper's 3-scale tracker (SiamFC-3s, the public release's
hyper-parameters): step 1.0375, penalty 0.9745, scale_lr 0.59, window influence 0.176.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from dmlkit.apps.tracking.datasets import read_image
from dmlkit.apps.tracking.geometry import (
    box_to_center,
    center_to_box,
    crop_and_resize,
    exemplar_side,
    image_to_tensor,
)
from dmlkit.apps.tracking.model import (
    EXEMPLAR_SIZE,
    INSTANCE_SIZE,
    MIN_IMAGE_SIZE,
    TOTAL_STRIDE,
    SiamFC,
)
from dmlkit.embeddings import resolve_device
from dmlkit.exceptions import ConfigError, NonFiniteError, ShapeError, require
from dmlkit.models import to_device


@dataclass
class TrackerConfig:
    """Hyper-parameters of the SiamFC tracker (paper defaults, 3 scales)."""

    num_scales: int = 3
    scale_step: float = 1.0375
    scale_penalty: float = 0.9745
    scale_lr: float = 0.59
    window_influence: float = 0.176
    response_up: int = 16
    context: float = 0.5
    exemplar_size: int = EXEMPLAR_SIZE
    instance_size: int = INSTANCE_SIZE
    min_size: float = 4.0

    def __post_init__(self) -> None:
        if self.num_scales < 1 or self.num_scales % 2 == 0:
            raise ConfigError(f"num_scales must be odd and >= 1 (3 or 5), got {self.num_scales}")
        if not 0.0 <= self.window_influence <= 1.0 or not 0.0 <= self.scale_lr <= 1.0:
            raise ConfigError("window_influence and scale_lr must be in [0, 1]")
        if self.scale_step < 1.0 or not 0.0 < self.scale_penalty <= 1.0:
            raise ConfigError("scale_step must be >= 1 and scale_penalty in (0, 1]")
        if self.response_up < 1:
            raise ConfigError(f"response_up must be >= 1, got {self.response_up}")
        numbers = {f.name: getattr(self, f.name) for f in fields(self)}
        bad = sorted(k for k, v in numbers.items() if not np.isfinite(v))
        if bad:  # NaN passed every comparison above and tracked to NaN boxes
            raise ConfigError(f"tracker settings must be finite numbers: {bad}")
        if self.context < 0 or self.min_size < 0:
            raise ConfigError(f"context and min_size must be >= 0, got {self.context} and {self.min_size}")
        if self.exemplar_size < MIN_IMAGE_SIZE:  # embed() refused it only at the first frame
            raise ConfigError(f"exemplar_size must be at least {MIN_IMAGE_SIZE}, the SiamFC network's receptive "
                              f"field (a smaller exemplar has no feature cell to correlate), got "
                              f"{self.exemplar_size}; the paper uses {EXEMPLAR_SIZE}")
        if self.exemplar_size > self.instance_size:
            raise ConfigError(f"need exemplar_size <= instance_size, got {self.exemplar_size} "
                              f"and {self.instance_size}")
        for name in ("exemplar_size", "instance_size"):
            size = getattr(self, name)
            if (size - MIN_IMAGE_SIZE) % TOTAL_STRIDE:  # the response map's centre and size were off
                raise ConfigError(
                    f"{name} must be {MIN_IMAGE_SIZE} plus a multiple of the network's stride {TOTAL_STRIDE} "
                    f"(e.g. {EXEMPLAR_SIZE} and {INSTANCE_SIZE}), got {size}: the network drops the last "
                    f"{(size - MIN_IMAGE_SIZE) % TOTAL_STRIDE} pixel rows and columns of such a crop, which moves "
                    "the response map's centre off the crop's and changes the map's size")

    @classmethod
    def five_scales(cls) -> TrackerConfig:
        """SiamFC-5s: 5 scales, step 1.025 and penalty 0.962 (the paper's slower variant)."""
        return cls(num_scales=5, scale_step=1.025, scale_penalty=0.962)

    def with_scales(self, num_scales: int) -> TrackerConfig:
        """These settings with the paper's ``num_scales``-scale search: 3 (SiamFC-3s: step 1.0375,
        penalty 0.9745) or 5 (:meth:`five_scales`). The variant's scale step and penalty replace
        these settings' own, even when ``num_scales`` is already theirs (a checkpoint's custom
        3-scale step is not the paper's 3-scale search); every other setting stays."""
        variants = {3: TrackerConfig(), 5: TrackerConfig.five_scales()}
        if num_scales not in variants:
            raise ConfigError(f"the number of scales must be 3 (SiamFC-3s) or 5 (SiamFC-5s), got {num_scales}")
        v = variants[num_scales]
        return replace(self, num_scales=v.num_scales, scale_step=v.scale_step, scale_penalty=v.scale_penalty)

    def to_dict(self) -> dict:
        return asdict(self)


def tracker_config(settings: Mapping[str, Any]) -> TrackerConfig:
    """A :class:`TrackerConfig` from a config's ``tracker`` mapping: unknown keys and values that
    are not numbers (whole numbers for the integer settings) are one :class:`ConfigError`."""
    defaults = {f.name: f.default for f in fields(TrackerConfig)}
    unknown = sorted(set(settings) - set(defaults))
    if unknown:
        raise ConfigError(f"unknown tracker setting(s) {unknown}; choose from {sorted(defaults)}")
    for key, value in settings.items():
        whole = isinstance(defaults[key], int)
        if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
            raise ConfigError(f"tracker.{key} must be a {'whole ' if whole else ''}number, got {value!r}")
    return TrackerConfig(**settings)


@dataclass
class TrackResult:
    """Boxes ``(N, 4)`` (the first is the initial box), per-frame seconds and peak scores."""

    boxes: np.ndarray
    seconds: np.ndarray
    scores: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @property
    def fps(self) -> float:
        """Frames per second of the updates (initialisation excluded, as in the paper)."""
        t = float(self.seconds[1:].sum()) if len(self.seconds) > 1 else 0.0
        return (len(self.seconds) - 1) / t if t > 0 else float("nan")


def frame_size(frame: np.ndarray | torch.Tensor) -> tuple[int, int]:
    """``(width, height)`` of an ``(H, W[, C])`` array or a ``(3, H, W)`` tensor (see ``image_to_tensor``)."""
    if isinstance(frame, torch.Tensor) and frame.dim() == 3 and frame.shape[0] == 3:
        return int(frame.shape[2]), int(frame.shape[1])
    return int(frame.shape[1]), int(frame.shape[0])


def check_box_in_frame(box: np.ndarray, width: int, height: int, name: str) -> None:
    """Refuse a box ``(x, y, w, h)`` wholly outside a ``width x height`` first frame.

    Outside means ``x >= W or y >= H or x + w <= 0 or y + h <= 0`` (no pixel of the box in the
    frame): SiamFC then tracked padding without a word. ``name`` starts the message (the CLI
    passes ``--init-box x,y,w,h``). Raises :class:`ShapeError`.
    """
    if box[0] >= width or box[1] >= height or box[0] + box[2] <= 0 or box[1] + box[3] <= 0:
        raise ShapeError(f"{name} lies outside the first frame ({width} x {height})")


class BaseTracker:
    """``init(frame, box)`` then ``update(frame) -> box``; ``track(frames, box)`` runs a video."""

    def init(self, frame: np.ndarray, box: np.ndarray) -> None:
        raise NotImplementedError

    def update(self, frame: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    last_score: float = float("nan")

    def track(self, frames: Iterable[np.ndarray], init_box, progress=None) -> TrackResult:
        """One pass over ``frames`` starting from ``init_box`` (x, y, w, h) in the first frame.

        ``frames`` yields ``(H, W, 3)`` arrays or image paths (read with Pillow); ``progress``
        is called after each frame.
        """
        box0 = np.asarray(init_box, dtype=np.float64)
        if box0.shape != (4,) or not np.isfinite(box0).all() or box0[2] <= 0 or box0[3] <= 0:
            raise ShapeError(f"the initial box must be finite x, y, w, h with w, h > 0, got {init_box}")
        boxes, secs, scores = [], [], []
        for i, frame in enumerate(frames):
            if not isinstance(frame, np.ndarray | torch.Tensor):
                frame = read_image(frame)
            t0 = time.perf_counter()
            if i == 0:  # every tracker refuses a start box with no pixel in the frame, as the CLI does
                check_box_in_frame(box0, *frame_size(frame),
                                   f"the initial box {','.join(f'{v:g}' for v in box0)}")
                self.init(frame, box0)
                box = box0.copy()
            else:
                box = self.update(frame)
            secs.append(time.perf_counter() - t0)
            boxes.append(box)
            scores.append(self.last_score if i else 1.0)
            if progress is not None:
                progress()
        if not boxes:
            raise ShapeError("no frames to track")
        return TrackResult(np.asarray(boxes), np.asarray(secs), np.asarray(scores))


def _hann(n: int) -> np.ndarray:
    w = np.hanning(n)
    out = np.outer(w, w)
    return out / out.sum()


class SiamFCTracker(BaseTracker):
    """Track one object with a :class:`SiamFC` network (see the module docstring)."""

    def __init__(self, model: SiamFC, config: TrackerConfig | None = None,
                 device: str | torch.device = "cpu") -> None:
        device = resolve_device(device)  # an unknown or absent device is one ConfigError
        self.model = to_device(model, device).eval()  # in place; convolutions channels-last
        self.config = config or TrackerConfig()
        self.device = device
        c = self.config
        self.response_size = (c.instance_size - c.exemplar_size) // model.total_stride + 1
        self.upscale_size = self.response_size * c.response_up
        self.window = _hann(self.upscale_size)
        k = np.arange(c.num_scales) - (c.num_scales - 1) / 2.0
        self.scale_factors = c.scale_step ** k
        self.penalties = np.where(k == 0, 1.0, c.scale_penalty)

    @torch.no_grad()
    def init(self, frame: np.ndarray, box: np.ndarray) -> None:
        c = self.config
        image = image_to_tensor(frame).to(self.device)
        self.center, self.size = box_to_center(box)
        self.frame_shape = image.shape[-2:]
        self.avg_color = image.mean(dim=(1, 2))
        self.z_side = exemplar_side(self.size, c.context)
        self.x_side = self.z_side * c.instance_size / c.exemplar_size
        self.x_side_range = (0.2 * self.x_side, 5.0 * self.x_side)
        z = crop_and_resize(image, self.center, self.z_side, c.exemplar_size, self.avg_color)
        self.kernel = self.model.embed(z)
        if not torch.isfinite(self.kernel).all():  # else NaN maps: the box drifts to a corner
            raise NonFiniteError("the model's embedding of the first frame holds NaN or infinity: its weights "
                                 "are not finite (train it again with a lower lr)")

    @torch.no_grad()
    def response(self, frame: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
        """The upsampled, scale-penalised response maps ``(S, 272, 272)`` and the crops."""
        c = self.config
        image = image_to_tensor(frame).to(self.device)
        x = crop_and_resize(image, self.center, self.x_side * self.scale_factors,
                            c.instance_size, self.avg_color)
        scores = self.model.score(self.kernel, self.model.embed(x))
        up = F.interpolate(scores, size=(self.upscale_size, self.upscale_size), mode="bicubic",
                           align_corners=False)
        maps = up[:, 0].cpu().double().numpy() * self.penalties[:, None, None]
        if not np.isfinite(maps).all():
            raise NonFiniteError("the response map holds NaN or infinity: the model's weights or this frame's "
                                 "pixels are not finite")
        return maps, x

    @torch.no_grad()
    def update(self, frame: np.ndarray) -> np.ndarray:
        c = self.config
        maps, _ = self.response(frame)
        best = int(np.argmax(maps.reshape(len(maps), -1).max(axis=1)))
        r = maps[best]
        self.last_score = float(r.max())
        r = r - r.min()
        r = r / (r.sum() + 1e-16)
        r = (1.0 - c.window_influence) * r + c.window_influence * self.window
        loc = np.array(np.unravel_index(int(np.argmax(r)), r.shape), dtype=np.float64)
        disp_response = loc - (self.upscale_size - 1) / 2.0
        disp_instance = disp_response * self.model.total_stride / c.response_up
        scale = self.scale_factors[best]
        disp_image = disp_instance * self.x_side * scale / c.instance_size
        self.center = self.center + disp_image
        h, w = int(self.frame_shape[0]), int(self.frame_shape[1])
        self.center = np.clip(self.center, [0.0, 0.0], [h, w])
        damped = (1.0 - c.scale_lr) + c.scale_lr * scale
        self.size = np.maximum(self.size * damped, c.min_size)
        self.x_side = float(np.clip(self.x_side * damped, *self.x_side_range))
        return center_to_box(self.center, self.size)


class NCCTracker(BaseTracker):
    """Baseline that needs no learning: normalised cross-correlation template matching.

    The first frame's target patch (gray levels) is matched by zero-mean normalised
    cross-correlation (``skimage.feature.match_template``, Lewis 1995 "Fast normalized
    cross-correlation") over a search window of ``search_factor`` times the target size around
    the previous position; the box moves to the best match, its size stays the first one.
    """

    def __init__(self, search_factor: float = 2.0) -> None:
        if search_factor < 1.0:
            raise ConfigError(f"search_factor must be >= 1, got {search_factor}")
        self.search_factor = search_factor
        # imported here, not in the first timed update (its import time was that frame's)
        self._feature = require("skimage.feature", "tracking")

    @staticmethod
    def _gray(frame: np.ndarray) -> np.ndarray:
        f = np.asarray(frame, dtype=np.float32)
        return f if f.ndim == 2 else f[:, :, :3] @ np.array([0.299, 0.587, 0.114], np.float32)

    def init(self, frame: np.ndarray, box: np.ndarray) -> None:
        gray = self._gray(frame)
        x, y, w, h = (int(round(v)) for v in box)
        H, W = gray.shape
        x0, y0 = max(0, x), max(0, y)
        x1, y1 = min(W, x + max(w, 1)), min(H, y + max(h, 1))
        if x1 - x0 < 2 or y1 - y0 < 2:
            raise ShapeError(f"the initial box {box.tolist()} is (almost) outside the frame {W}x{H}")
        self.template = gray[y0:y1, x0:x1]
        self.box = np.array([x0, y0, x1 - x0, y1 - y0], dtype=np.float64)

    def update(self, frame: np.ndarray) -> np.ndarray:
        gray = self._gray(frame)
        H, W = gray.shape
        th, tw = self.template.shape
        x, y, w, h = self.box
        cx, cy = x + w / 2, y + h / 2
        sw, sh = max(tw + 2, int(w * self.search_factor)), max(th + 2, int(h * self.search_factor))
        x0 = int(np.clip(round(cx - sw / 2), 0, max(0, W - tw)))
        y0 = int(np.clip(round(cy - sh / 2), 0, max(0, H - th)))
        x1, y1 = min(W, x0 + sw), min(H, y0 + sh)
        window = gray[y0:y1, x0:x1]
        if window.shape[0] < th or window.shape[1] < tw:
            self.last_score = float("nan")
            return self.box.copy()
        ncc = self._feature.match_template(window, self.template)
        dy, dx = np.unravel_index(int(np.argmax(ncc)), ncc.shape)
        self.last_score = float(ncc[dy, dx])
        self.box = np.array([x0 + dx, y0 + dy, tw, th], dtype=np.float64)
        return self.box.copy()
