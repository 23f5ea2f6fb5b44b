"""Drawing tracked boxes on frames and writing them as a GIF, a video or a folder of images."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from dmlkit.apps.tracking.datasets import read_image
from dmlkit.exceptions import ConfigError, DataError, require


def draw_box(frame: np.ndarray, box, color=(255, 40, 40), width: int = 2,
             label: str | None = None) -> np.ndarray:
    """A copy of ``frame`` with the ``(x, y, w, h)`` rectangle (and a label) drawn on it.

    A box under one pixel wide or high is drawn one pixel wide or high; a box that is not
    finite or has no area (an absent target) is not drawn."""
    from PIL import Image, ImageDraw

    im = Image.fromarray(np.asarray(frame, dtype=np.uint8))
    draw = ImageDraw.Draw(im)
    x, y, w, h = (float(v) for v in box)
    if np.isfinite([x, y, w, h]).all() and w > 0 and h > 0:
        # Pillow refuses a rectangle whose far corner precedes its near one (w or h < 1)
        draw.rectangle([x, y, x + max(w, 1.0) - 1, y + max(h, 1.0) - 1], outline=tuple(color), width=width)
    if label:
        draw.text((4, 4), label, fill=tuple(color))
    return np.asarray(im)


def annotate(frames: Iterable[np.ndarray], boxes: np.ndarray,
             ground_truth: np.ndarray | None = None) -> Iterator[np.ndarray]:
    """Frames (arrays or image paths) with the predicted boxes (red) and, if given, the ground
    truth (green)."""
    for i, frame in enumerate(frames):
        out = frame if isinstance(frame, np.ndarray) else read_image(frame)
        if ground_truth is not None:
            out = draw_box(out, ground_truth[i], color=(40, 220, 40))
        yield draw_box(out, boxes[i], label=f"#{i + 1}")


#: Video containers :func:`write_frames` writes (with imageio + PyAV).
VIDEO_OUT_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm")


def check_output(out: str | Path) -> Path:
    """``out`` as :func:`write_frames` takes it: a ``.gif``, a video (:data:`VIDEO_OUT_SUFFIXES`)
    or a folder (no suffix, not an existing file); :class:`ConfigError` otherwise. Called before
    any frame is tracked, so that a wrong ``--out`` (e.g. ``boxes.txt``) is refused at once, not
    after the whole video."""
    out = Path(out)
    suffix = out.suffix.lower()
    if suffix not in ("", ".gif", *VIDEO_OUT_SUFFIXES):
        raise ConfigError(f"cannot write {out}: use .gif, {', '.join(VIDEO_OUT_SUFFIXES)} or a folder")
    if suffix == "" and out.exists() and not out.is_dir():
        raise ConfigError(f"cannot write frames into {out}: it is a file, not a folder")
    return out


def write_frames(frames: Iterable[np.ndarray], out: str | Path, fps: float = 15.0) -> Path:
    """Write frames to ``out``: ``.gif`` (Pillow), ``.mp4`` / ``.avi`` / ... (imageio + PyAV),
    or a folder (``00001.jpg`` ...) when ``out`` has no suffix (:func:`check_output`)."""
    from PIL import Image

    out = check_output(out)
    suffix = out.suffix.lower()
    if fps <= 0:
        raise ConfigError(f"fps must be positive, got {fps}")
    if suffix == "":
        out.mkdir(parents=True, exist_ok=True)
        for i, f in enumerate(frames):
            Image.fromarray(f).save(out / f"{i + 1:05d}.jpg", quality=92)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".gif":
        images = [Image.fromarray(f) for f in frames]
        if not images:
            raise ConfigError("no frames to write")
        images[0].save(out, save_all=True, append_images=images[1:], loop=0,
                       duration=int(round(1000 / fps)), optimize=False)
        return out
    if suffix in VIDEO_OUT_SUFFIXES:
        iio = require("imageio.v3", "tracking")
        arrays = []
        for f in frames:  # even sizes for yuv420p codecs
            h, w = f.shape[0] // 2 * 2, f.shape[1] // 2 * 2
            arrays.append(np.ascontiguousarray(f[:h, :w]))
        if not arrays:
            raise ConfigError("no frames to write")
        sizes = sorted({a.shape for a in arrays})
        if len(sizes) > 1:  # a video has one frame size (np.stack raised a traceback)
            raise DataError(f"cannot write {out}: the frames differ in size ({sizes[0]} and {sizes[-1]}); "
                            "write a .gif or a folder, or track frames of one size")
        iio.imwrite(out, np.stack(arrays), fps=fps, plugin="pyav", codec="libx264"
                    if suffix in (".mp4", ".mkv", ".mov") else "mpeg4")
    return out
