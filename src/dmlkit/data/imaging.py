"""How every reader of dmlkit turns an image file into 8-bit pixels (datasets, ``dmlkit serve``,
exports, reports): EXIF orientation, high-bit-depth scaling and the "would be blank" check.

- :func:`to_8bit`: 16-bit and float single-channel images (:data:`HIGH_DEPTH_MODES`) scaled to
  8 bits, never clipped; refused when the result would be blank;
- :func:`full_depth`: multi-channel 16-bit files (16-bit RGB/RGBA PNG and TIFF, 16-bit gray +
  alpha PNG), which Pillow decodes straight to 8 bits by keeping each sample's high byte,
  decoded at full depth and scaled the same way, with the same check;
- :func:`upright_image`: turned as the EXIF orientation says;
- :func:`upright_8bit`: all three, what the readers use; :func:`decode_8bit`: the same, fully
  decoded and detached from the file.

Alpha is dropped, not composited, by every reader (``convert("RGB")``, as torchvision's
``decode_image(mode=RGB)``): a transparent pixel shows the colour stored under it.
"""

from __future__ import annotations

import io
import os
import re
import sys
from typing import Any

import numpy as np

from dmlkit.exceptions import DataError

__all__ = ["HIGH_DEPTH_MODES", "decode_8bit", "full_depth", "to_8bit", "upright_8bit", "upright_image"]

#: PIL modes with more than 8 bits per sample; ``Image.convert("L"/"RGB")`` *clips* them
#: (a 16-bit PNG becomes almost solid white, a float image in [0, 1] black).
HIGH_DEPTH_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")
#: The EXIF tag of the camera's orientation (1 = as stored).
_EXIF_ORIENTATION = 0x0112
#: Fewer 8-bit grey levels than this from a non-constant source counts as "blank".
_MIN_LEVELS = 4
#: Pillow's raw modes of multi-channel 16-bit files that it decodes to an 8-bit mode of the
#: same channels by keeping each sample's high byte (PNG colour types 2 and 6 at 16 bits, TIFF
#: RGB/RGBA/CMYK at 16 bits; ``RGBX`` drops the 4th sample). ``RGBa`` (premultiplied alpha)
#: is not among them: its unpacking divides by alpha, not a per-byte operation.
_MULTI_CHANNEL_16 = re.compile(r"^(RGB|RGBA|RGBX|CMYK);16([BLN])$")
#: The byte order that decodes the *low* byte of each sample in place of the high one.
_OTHER_ORDER = {"B": "L", "L": "B", "N": "B" if sys.byteorder == "little" else "L"}
#: 16-bit gray + alpha PNG: Pillow decodes it to RGBA (no 16-bit LA mode); read with the 8-bit
#: raw mode of the same 4 bytes per pixel, its samples come through whole (big-endian).
_GRAY_ALPHA_16 = "LA;16B"


def _scaled(arr: np.ndarray, top: float, name: str, what: str, alpha: bool = False) -> np.ndarray:
    """``rint(arr * 255 / top)`` as uint8; :class:`DataError` when the colour samples (all but
    the last channel when ``alpha``) vary but would span fewer than :data:`_MIN_LEVELS` levels
    (``max - min`` of the 8-bit values).
    ``what`` names the source's depth in the message (``I;16``, ``16-bit RGB``)."""
    out = np.rint(arr.astype(np.float64) * (255.0 / top)).astype(np.uint8)
    src, got = (arr[..., :-1], out[..., :-1]) if alpha else (arr, out)
    lo, hi = float(src.min()), float(src.max())
    if hi > lo and int(got.max()) - int(got.min()) < _MIN_LEVELS:
        raise DataError(
            f"{name} ({what}) uses only values {lo:g}..{hi:g} of 0..{top:g}: scaled to 8 bits it "
            "would be blank; stretch it to the full range (or convert it to 8-bit) first"
        )
    return out


def to_8bit(img: Any, source: str | os.PathLike | None = None):
    """A high-bit-depth PIL image (:data:`HIGH_DEPTH_MODES`) as 8-bit ``"L"``, by *scaling*.

    Integer modes (16-bit PNG/TIFF: ``I;16``; ``I``) must hold values in ``[0, 65535]`` and are
    scaled by ``255 / 65535`` (the full 16-bit range maps to the full 8-bit range, as OpenCV
    and torchvision's ``decode_png`` do; 12-bit data stored in 16 bits therefore comes out dark,
    0..16); float images (``F``) must lie in ``[0, 1]`` and are scaled by 255. Other modes are
    returned unchanged (multi-channel 16-bit files: :func:`full_depth`). Raises
    :class:`DataError` (never returns a blank image) when values fall outside that range, or
    when a non-constant image's 8-bit values would span fewer than 4 levels (``max - min < 4``,
    e.g. a 16-bit file using only values 0..700, which scale to 0..3).
    """
    from PIL import Image

    mode = getattr(img, "mode", None)
    if not isinstance(mode, str) or not (mode in HIGH_DEPTH_MODES or mode.startswith("I;")):
        return img
    name = f"image {source}" if source is not None else "the image"
    arr = np.asarray(img)
    if arr.dtype.kind == "f":
        top = 1.0
        if not np.isfinite(arr).all() or float(np.nanmin(arr)) < 0.0 or float(np.nanmax(arr)) > 1.0:
            raise DataError(f"{name} is a float image (mode F) with values outside [0, 1] (or NaN): "
                            "rescale it to [0, 1] or save it as 8- or 16-bit")
    else:
        lo, hi, top = int(arr.min()), int(arr.max()), 65535.0
        if lo < 0 or hi > 65535:
            raise DataError(f"{name} ({img.mode}) holds values {lo}..{hi} outside the 16-bit range "
                            "0..65535: rescale it or save it as an 8- or 16-bit image")
    return Image.fromarray(_scaled(arr, top, name, img.mode), mode="L")


def _is_multi_channel_16(img: Any) -> bool:
    """``img`` is a multi-channel 16-bit file not yet decoded (raw mode ``RGB;16B``, ...)."""
    raw = _raw_mode(img)
    return raw is not None and (raw == _GRAY_ALPHA_16 or _MULTI_CHANNEL_16.match(raw) is not None)


def _raw_mode(img: Any) -> str | None:
    """The raw mode Pillow will decode ``img`` from (``RGB;16B``, ...): the first argument of
    its tiles, when all agree; ``None`` for a decoded image (no tiles) or another decoder."""
    modes = set()
    for tile in getattr(img, "tile", None) or ():
        args = tile[3]
        modes.add(args[0] if isinstance(args, tuple) and args else args)
    raw = modes.pop() if len(modes) == 1 else None
    return raw if isinstance(raw, str) else None


def _with_raw_mode(img: Any, raw: str) -> None:
    """Make ``img`` (not yet loaded) decode from raw mode ``raw`` instead of its own."""
    tiles = []
    for tile in img.tile:
        args = tile[3]
        args = (raw, *args[1:]) if isinstance(args, tuple) else raw
        tiles.append(tile._replace(args=args) if hasattr(tile, "_replace") else (*tile[:3], args))
    img.tile = tiles


def _reopen(img: Any) -> Any:
    """A fresh, not yet decoded copy of ``img`` (same file or bytes, same frame)."""
    from PIL import Image

    filename = getattr(img, "filename", None)
    if filename:
        again = Image.open(filename)
    else:
        fp = img.fp
        pos = fp.tell()
        fp.seek(0)
        data = fp.read()
        fp.seek(pos)
        again = Image.open(io.BytesIO(data))
    frame = img.tell()
    if frame:
        try:
            again.seek(frame)
        except BaseException:
            again.close()
            raise
    return again


def full_depth(img: Any, source: str | os.PathLike | None = None):
    """``img`` (opened, not yet decoded) decoded, at full depth when it is a multi-channel 16-bit
    file: the image itself (now loaded) for any other.

    Pillow decodes 16-bit RGB/RGBA PNG and TIFF files to 8-bit ``RGB``/``RGBA`` by keeping each
    sample's high byte (``v >> 8``), and 16-bit gray + alpha PNG files to ``RGBA`` likewise, so
    8-bit data stored in 16 bits came out solid black without a word. Such a file (its raw mode
    ``RGB;16B``, ``RGBA;16L``, ``LA;16B``, ...) is decoded a second time with the other byte
    order, which gives each sample's low byte (gray + alpha: once, with the 8-bit raw mode of
    the same 4 bytes a pixel); the 16-bit samples ``v`` are scaled as :func:`to_8bit` scales
    gray ones, ``rint(v * 255 / 65535)`` (OpenCV's and torchvision's ``decode_png`` scale), and
    refused (:class:`DataError`) when the colour samples of a non-constant image would span
    fewer than 4 levels at 8 bits (``max - min < 4``). The result is a new 8-bit image of the file's channels (``LA`` for
    gray + alpha: 2 channels, as an 8-bit gray + alpha file) with its EXIF orientation. A raw
    mode whose other byte order Pillow cannot decode keeps Pillow's 8-bit decoding.
    """
    from PIL import Image

    if not _is_multi_channel_16(img):
        img.load()
        return img
    multi = _MULTI_CHANNEL_16.match(_raw_mode(img) or "")
    name = f"image {source}" if source is not None else "the image"
    if multi is None:  # 16-bit gray + alpha: bytes Lh Ll Ah Al
        _with_raw_mode(img, "RGBA")
        img.load()
        b = np.asarray(img).astype(np.uint16)
        arr, mode = np.stack([b[..., 0] << 8 | b[..., 1], b[..., 2] << 8 | b[..., 3]], axis=-1), "LA"
    else:
        other = _reopen(img)  # before img.load() closes the file
        with other:  # closed when img.load() fails too (a truncated file: one fd leaked a read)
            img.load()
            try:
                _with_raw_mode(other, f"{multi.group(1)};16{_OTHER_ORDER[multi.group(2)]}")
                other.load()
                low = np.asarray(other)
            except ValueError:  # no decoder for the other byte order: Pillow's 8-bit pixels
                return img
        arr, mode = np.asarray(img).astype(np.uint16) << 8 | low.astype(np.uint16), img.mode
    out = Image.fromarray(_scaled(arr, 65535.0, name, f"16-bit {mode}", alpha=mode in ("RGBA", "LA")), mode=mode)
    try:  # a TIFF's orientation is applied by load() (and dropped from its EXIF)
        orientation = img.getexif().get(_EXIF_ORIENTATION, 1)
    except (OSError, ValueError, SyntaxError):  # a damaged EXIF block: as stored (upright_image)
        orientation = 1
    if orientation not in (0, 1):
        exif = Image.Exif()
        exif[_EXIF_ORIENTATION] = orientation
        out.info["exif"] = exif.tobytes()
    return out


def upright_image(img: Any):
    """``img`` turned as its EXIF orientation says (a phone photo is stored sideways with a tag
    that every viewer applies); the image itself when it has no such tag (no copy)."""
    from PIL import ImageOps

    try:
        orientation = img.getexif().get(_EXIF_ORIENTATION, 1)
    except (OSError, ValueError, SyntaxError):  # a damaged EXIF block: the pixels as stored
        return img
    return img if orientation in (0, 1) else ImageOps.exif_transpose(img)


def upright_8bit(img: Any, source: str | os.PathLike | None = None):
    """``img`` as every reader here takes it: decoded at full depth when it is a multi-channel
    16-bit file not yet decoded (:func:`full_depth`), turned upright (:func:`upright_image`)
    and scaled to 8 bits (:func:`to_8bit`); the image itself when none applies (then it may
    still be undecoded)."""
    if _is_multi_channel_16(img):
        img = full_depth(img, source)
    return to_8bit(upright_image(img), source)


def decode_8bit(img: Any, source: str | os.PathLike | None = None):
    """``img`` (opened with ``Image.open``) as :func:`upright_8bit` takes it, fully decoded and
    detached from its file (a copy when nothing changed): what ``dmlkit serve`` embeds of an
    upload or an indexed file. PIL's errors (``OSError`` for a truncated file, ...) and
    :class:`DataError` pass through."""
    out = upright_8bit(full_depth(img, source), source)
    return img.copy() if out is img else out
