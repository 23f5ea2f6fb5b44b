"""Tracking frames are decoded as every other command decodes images (audit s40_images, findings
1 and 3): EXIF orientation applied, 16-bit frames scaled (not clipped to white), a decompression
bomb or a missing frame one clear error."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from dmlkit.apps.tracking.datasets import read_image
from dmlkit.apps.tracking.tracker import NCCTracker
from dmlkit.data.base import load_image
from dmlkit.exceptions import DataError, DataNotFoundError


def test_sixteen_bit_frames_are_scaled_and_the_target_is_tracked(tmp_path):
    """A bright target moving right on a 16-bit background: clipped by convert("RGB") every
    frame was white and the tracker drifted to the corner."""
    frames = []
    for k in range(5):
        a = np.full((60, 80), 20000, np.uint16)
        a[20:30, 10 + 5 * k:20 + 5 * k] = 60000
        path = tmp_path / f"{k:04d}.png"
        Image.fromarray(a).save(path)
        frames.append(path)
    first = read_image(frames[0])
    assert first.dtype == np.uint8 and first.shape == (60, 80, 3)
    np.testing.assert_array_equal(first, np.asarray(load_image(frames[0], "RGB")))
    assert set(np.unique(first)) == {round(20000 * 255 / 65535), round(60000 * 255 / 65535)}
    result = NCCTracker().track(frames, (8, 18, 14, 14))  # the target and a border around it
    np.testing.assert_allclose(result.boxes[:, 0], [8, 13, 18, 23, 28])
    np.testing.assert_allclose(result.boxes[:, 1], 18)


def test_exif_orientation_is_applied(tmp_path):
    pixels = np.zeros((20, 40, 3), np.uint8)
    pixels[:, :10] = 255  # a white band on the left of the stored image
    path = tmp_path / "rotated.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    Image.fromarray(pixels).save(path, exif=exif, quality=95)
    frame = read_image(path)
    assert frame.shape == (40, 20, 3)  # upright: the stored width is the shown height
    assert frame[:10].mean() > 200 and frame[-10:].mean() < 50  # the band is now on top


def test_unreadable_frames_are_one_clear_error(tmp_path, monkeypatch):
    with pytest.raises(DataNotFoundError, match="does not exist"):
        read_image(tmp_path / "missing.png")
    big = tmp_path / "bomb.png"
    Image.new("L", (400, 400)).save(big)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 400 x 400 is over twice the limit
    with pytest.raises(DataError, match="cannot read frame .*bomb.png") as info:
        read_image(big)
    assert "skip_corrupt" not in str(info.value)
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 20)
    with pytest.raises(DataError, match="cannot read frame .*broken.png"):
        read_image(broken)
