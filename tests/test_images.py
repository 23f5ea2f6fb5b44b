"""High-bit-depth images are scaled, never clipped to a blank image (issue 11, point 5).

PIL's ``convert("L")`` / ``convert("RGB")`` clips a 16-bit PNG (mode ``I;16``) at 255, so a
real photo became almost solid white; float images in [0, 1] became black.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from dmlkit.data import ArrayDataset, ImageFileDataset, get_transforms, load_image
from dmlkit.data.base import to_8bit
from dmlkit.exceptions import DataError


@pytest.fixture
def png16(tmp_path, data_root):
    """A real face (AT&T s1/1.pgm) written as a 16-bit grayscale PNG (values x 257)."""
    with Image.open(data_root / "att_faces" / "s1" / "1.pgm") as img:
        face8 = np.asarray(img.convert("L"))
    face16 = face8.astype(np.uint16) * 257  # the full 16-bit range, exactly 257 x the 8-bit value
    path = tmp_path / "face16.png"
    Image.fromarray(face16).save(path)
    with Image.open(path) as check:
        assert check.mode.startswith("I")  # really a 16-bit file
    return path, face8, face16


def test_plain_pil_conversion_is_the_bug(png16):
    path, face8, _ = png16
    with Image.open(path) as img:
        clipped = np.asarray(img.convert("L"))
    assert (clipped == 255).mean() > 0.9 and face8.std() > 20  # what dmlkit must not do


@pytest.mark.parametrize("mode", ["L", "RGB", None])
def test_16bit_png_loads_as_the_same_picture(png16, mode):
    path, face8, _ = png16
    img = load_image(path, mode)
    arr = np.asarray(img)
    if mode == "RGB":
        assert arr.shape == (*face8.shape, 3)
        assert all(np.array_equal(arr[..., c], face8) for c in range(3))
    else:
        assert img.mode == "L"
        np.testing.assert_array_equal(arr, face8)  # x 257 / 257: exact


def test_dataset_and_transforms_see_the_scaled_image(png16, tmp_path):
    path, face8, face16 = png16
    ds = ImageFileDataset([path], [0], mode="L")
    x, _ = ds[0]
    np.testing.assert_allclose(x.numpy()[0], face8 / 255.0, atol=1e-6)
    # a user's own PIL image, straight from Image.open: the presets scale it too
    with Image.open(path) as raw:
        t = get_transforms("grayscale", train=False, normalize=False)(raw)
        rgb = get_transforms("imagenet_resize", train=False, image_size=32, normalize=False)(raw)
    np.testing.assert_allclose(t.numpy()[0], face8 / 255.0, atol=1e-6)
    assert 0.2 < float(rgb.mean()) < 0.8  # not white (1.0) as clipping gives
    arrays = ArrayDataset(face16[None], [0])  # uint16 arrays: scaled by 1/65535
    np.testing.assert_allclose(arrays[0][0].numpy()[0], face16 / 65535.0, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(arrays.thumbnail(0, size=None)), face8)


def test_float_images_in_unit_range_are_scaled_else_refused(tmp_path):
    ramp = np.linspace(0, 1, 64, dtype=np.float32).reshape(8, 8)
    Image.fromarray(ramp).save(tmp_path / "f.tiff")
    out = np.asarray(load_image(tmp_path / "f.tiff", "L"))
    np.testing.assert_array_equal(out, np.rint(ramp * 255).astype(np.uint8))
    Image.fromarray(ramp * 300).save(tmp_path / "big.tiff")
    with pytest.raises(DataError, match=r"outside \[0, 1\]"):
        load_image(tmp_path / "big.tiff")


def test_nearly_blank_16bit_images_are_refused(tmp_path):
    dark = (np.arange(64, dtype=np.uint16) % 300).reshape(8, 8)  # values 0..299 of 0..65535
    Image.fromarray(dark).save(tmp_path / "dark.png")
    with pytest.raises(DataError, match="would be blank") as info:
        load_image(tmp_path / "dark.png")
    assert "dark.png" in str(info.value) and "\n" not in str(info.value)
    flat = np.full((8, 8), 40000, dtype=np.uint16)  # truly uniform: kept, as in 8 bits
    assert np.unique(np.asarray(to_8bit(Image.fromarray(flat)))).tolist() == [156]
    eight = Image.fromarray(np.zeros((4, 4), np.uint8))
    assert to_8bit(eight) is eight


@pytest.mark.parametrize("train", [False, True])
def test_imagenet_resize_caps_a_strip_s_long_side(train):
    """A 2 x 6000 px strip: the shorter side to 256 would make the longer 768,000 px (1.5 GB);
    the cap keeps it at MAX_ASPECT x 256, and ordinary aspect ratios are untouched."""
    from PIL import Image

    from dmlkit.data.transforms import MAX_ASPECT

    t = get_transforms("imagenet", train=train)
    resize = next(step for step in t.transforms if type(step).__name__ == "Resize")
    strip = resize(Image.new("RGB", (2, 6000)))
    assert max(strip.size) == MAX_ASPECT * 256
    assert resize(Image.new("RGB", (3000, 200))).size == (3840, 256)  # 15:1: as before
    assert t(Image.new("RGB", (2, 6000))).shape[1:] == (227, 227)
