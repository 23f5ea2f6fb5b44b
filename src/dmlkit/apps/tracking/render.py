"""Drawing tracked boxes on frames and writing them as a GIF, a video or a folder of images."""

from __future__ import annotations

import io
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from dmlkit.apps.tracking.datasets import read_image
from dmlkit.exceptions import ConfigError, DataError, require
from dmlkit.utils import atomic_write_bytes


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


#: The files :func:`write_frames` writes into a folder (and removes there before writing).
_FRAME_NAME = re.compile(r"\d{5,}\.jpg")
#: The hidden sub-folder of an output folder where :func:`write_frames` encodes the new frames
#: before they replace the earlier ones (one a killed render left is removed by the next).
_PENDING_FRAMES = ".frames.tmp"

#: Video containers :func:`write_frames` writes (with imageio + PyAV).
VIDEO_OUT_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm")
#: The codec of each container (WebM holds only VP8 / VP9 / AV1: mpeg4 was refused there).
_VIDEO_CODECS = {".mp4": "libx264", ".mkv": "libx264", ".mov": "libx264", ".avi": "mpeg4",
                 ".webm": "libvpx-vp9"}

#: Slowest frame rate :func:`write_frames` writes: one frame per 100 s (a GIF frame's delay is
#: at most 655.35 s, 16 bits of hundredths of a second; 0.001 overflowed Pillow's field).
MIN_FPS = 0.01
#: Fastest frame rate of a GIF: its delays are whole hundredths of a second (Pillow writes
#: ``duration // 10``), so above 100 fps the delay became 0, which viewers play at their own
#: default speed.
MAX_GIF_FPS = 100.0
#: Fastest frame rate of a video: PyAV (through imageio) stores the rate and its time base as
#: fractions with denominators up to 65535, and ``.avi`` (mpeg4) silently wrote 600 fps for
#: 10000; 1000 fps covers high-speed cameras and is stored exactly by every container here.
MAX_VIDEO_FPS = 1000.0


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


def fps_limits(out: str | Path | None) -> tuple[float, float]:
    """The frame rates ``out`` (:func:`check_output`) can store: ``[MIN_FPS, MAX_GIF_FPS]`` for a
    ``.gif``, ``[MIN_FPS, MAX_VIDEO_FPS]`` for a video, a folder of frames or no output."""
    is_gif = out is not None and Path(out).suffix.lower() == ".gif"
    return MIN_FPS, MAX_GIF_FPS if is_gif else MAX_VIDEO_FPS


def check_fps(fps: float, out: str | Path | None, name: str = "fps") -> float:
    """``fps`` as a float if ``out`` can store it (:func:`fps_limits`), else one
    :class:`ConfigError` line naming ``name`` and the range. Called before any frame is tracked:
    ``inf`` or ``0.001`` ended in an OverflowError after the whole video, and ``inf`` wrote a GIF
    whose frames have no delay."""
    lo, hi = fps_limits(out)
    try:
        value = float(fps)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number of frames per second, got {fps!r}") from None
    if not lo <= value <= hi:  # also refuses NaN; 0 must not quietly mean "the default"
        suffix = Path(out).suffix.lower() if out is not None else ""
        kind = (f" for a GIF ({out})" if suffix == ".gif" else f" for a video ({out})"
                if suffix in VIDEO_OUT_SUFFIXES else "")
        raise ConfigError(f"{name} must be between {lo:g} and {hi:g} frames per second{kind}, got {fps}")
    return value


def gif_delays_ms(n: int, fps: float) -> list[int]:
    """Each of ``n`` GIF frames' delay in milliseconds, whole hundredths of a second (what a GIF
    stores) whose running sum stays within half a hundredth of ``k / fps``: frame ``k`` waits
    ``round(100 (k + 1) / fps) - round(100 k / fps)`` hundredths. One rounded delay for every
    frame played 15 fps at 16.7 (6 hundredths for 6.67) and 30 fps at 33.3; these alternate
    (7, 7, 6, ...) and keep the clip's length. ``fps`` is at most :data:`MAX_GIF_FPS`, so no
    delay is 0."""
    ticks = [round(100 * k / fps) for k in range(n + 1)]
    return [10 * (b - a) for a, b in zip(ticks, ticks[1:])]


def _write_frame_folder(frames: Iterable[np.ndarray], out: Path) -> Path:
    """Write ``out/00001.jpg`` ... in place of the frames an earlier call wrote there (an earlier,
    longer render's frames stayed after this one's); other files stay. The frames are encoded
    into :data:`_PENDING_FRAMES` first and moved in once all are written, so an interrupted render
    leaves the earlier frames, not a shorter sequence of new ones that reads as complete."""
    from PIL import Image

    pending = out / _PENDING_FRAMES
    if pending.is_dir():  # left by a render killed while encoding
        shutil.rmtree(pending)
    pending.mkdir(parents=True)
    try:
        for i, f in enumerate(frames):
            Image.fromarray(f).save(pending / f"{i + 1:05d}.jpg", quality=92)
        new = sorted(p.name for p in pending.iterdir())
        for name in new:
            os.replace(pending / name, out / name)
        for old in out.iterdir():
            if _FRAME_NAME.fullmatch(old.name) and old.is_file() and old.name not in new:
                old.unlink()
    finally:
        shutil.rmtree(pending, ignore_errors=True)
    return out


def write_frames(frames: Iterable[np.ndarray], out: str | Path, fps: float = 15.0) -> Path:
    """Write frames to ``out``: ``.gif`` (Pillow), ``.mp4`` / ``.avi`` / ... (imageio + PyAV),
    or a folder (``00001.jpg`` ...) when ``out`` has no suffix (:func:`check_output`): the frames
    an earlier call wrote there (``NNNNN.jpg``) are replaced, other files stay
    (:func:`_write_frame_folder`). A GIF or video is encoded in memory and written atomically
    (:func:`~dmlkit.utils.atomic_write_bytes`): one interrupted while saved left a shorter file that
    still played. ``fps`` must lie in :func:`fps_limits` (:func:`check_fps`), checked before any
    frame is read."""
    from PIL import Image

    out = check_output(out)
    suffix = out.suffix.lower()
    fps = check_fps(fps, out)
    if suffix == "":
        return _write_frame_folder(frames, out)
    if suffix == ".gif":
        images = [Image.fromarray(f) for f in frames]
        if not images:
            raise ConfigError("no frames to write")
        buffer = io.BytesIO()
        images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:], loop=0,
                       duration=gif_delays_ms(len(images), fps), optimize=False)
        atomic_write_bytes(out, buffer.getvalue())
        return out
    if suffix in VIDEO_OUT_SUFFIXES:
        iio = require("imageio.v3", "tracking")
        require("av", "tracking")  # imageio's "pyav" plugin: without it a 40-line traceback
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
        data = iio.imwrite("<bytes>", np.stack(arrays), extension=suffix, fps=fps, plugin="pyav",
                           codec=_VIDEO_CODECS[suffix])
        atomic_write_bytes(out, data)
    return out
