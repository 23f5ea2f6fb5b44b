"""The Brown / PhotoTour layout: reading order, info and match files, round trip, torchvision parity."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dmlkit.apps.patches import (
    PatchPairs,
    load_subset,
    read_matches,
    read_patch_sheets,
    write_brown_subset,
)
from dmlkit.exceptions import DataError, DataNotFoundError


def _hand_made(folder: Path, n: int = 300) -> None:
    """Two sheets written with PIL alone: patch k is filled with k % 251 and its row k // 251."""
    folder.mkdir(parents=True)
    for s in range(2):
        sheet = np.zeros((1024, 1024), np.uint8)
        for j in range(256):
            k = s * 256 + j
            if k >= n:
                break
            r, c = divmod(j, 16)
            sheet[r * 64 : (r + 1) * 64, c * 64 : (c + 1) * 64] = k % 251
            sheet[r * 64, c * 64] = k // 251
        Image.fromarray(sheet).save(folder / f"patches{s:04d}.bmp")
    (folder / "info.txt").write_text("".join(f"{k // 3} 0\n" for k in range(n)))
    # patch1 point1 unused patch2 point2 unused unused
    (folder / "m50_4_4_0.txt").write_text("0 0 0 1 0 0 0\n0 0 0 3 1 0 0\n299 99 0 298 99 0 0\n5 1 0 6 2 0 0\n")


def test_reading_order_and_files(tmp_path: Path) -> None:
    _hand_made(tmp_path / "liberty")
    sub = load_subset(tmp_path, "liberty")
    assert sub.patches.shape == (300, 64, 64) and sub.patches.dtype == np.uint8
    k = np.arange(300)
    assert np.array_equal(sub.patches[:, 5, 5], (k % 251).astype(np.uint8))
    assert np.array_equal(sub.patches[:, 0, 0], (k // 251).astype(np.uint8))
    assert np.array_equal(sub.point_ids, k // 3)
    pairs = sub.pairs()
    assert np.array_equal(pairs.left, [0, 0, 299, 5]) and np.array_equal(pairs.right, [1, 3, 298, 6])
    assert np.array_equal(pairs.label, [1, 0, 1, 0])
    assert sub.pairs(4).source == "m50_4_4_0.txt"
    assert read_patch_sheets(tmp_path / "liberty", 10).shape == (10, 64, 64)


def _real_patches(n: int, seed: int = 0) -> np.ndarray:
    """Real 64 x 64 crops of a photograph (the cameraman of scikit-image, a PIL-free fallback)."""
    import skimage.data as skdata

    img = skdata.camera()
    rng = np.random.default_rng(seed)
    ys = rng.integers(0, img.shape[0] - 64, n)
    xs = rng.integers(0, img.shape[1] - 64, n)
    return np.stack([img[y : y + 64, x : x + 64] for y, x in zip(ys, xs)]).astype(np.uint8)


@pytest.mark.filterwarnings("ignore:Image.Image.getdata:DeprecationWarning")
def test_round_trip_and_torchvision_phototour_reads_it(tmp_path: Path) -> None:
    import torch
    from torchvision.datasets import PhotoTour

    n = 200  # one sheet, partly filled (PhotoTour keeps the black padding patches too)
    patches = _real_patches(n)
    point_ids = np.arange(n, dtype=np.int64) // 2
    image_ids = np.arange(n, dtype=np.int64) % 2
    left = np.array([0, 2, 4, 1, 198], dtype=np.int64)
    right = np.array([1, 3, 7, 10, 199], dtype=np.int64)
    pairs = PatchPairs(left, right, (point_ids[left] == point_ids[right]).astype(np.int64))
    write_brown_subset(tmp_path / "liberty", patches, point_ids, image_ids, {5: pairs})
    assert sorted(p.name for p in (tmp_path / "liberty").glob("*.bmp")) == ["patches0000.bmp"]
    sub = load_subset(tmp_path, "liberty")
    assert np.array_equal(sub.patches, patches)
    assert np.array_equal(sub.point_ids, point_ids)
    got = sub.pairs()
    assert np.array_equal(got.left, left) and np.array_equal(got.right, right)
    assert np.array_equal(got.label, [1, 1, 0, 0, 1])

    class Fixture(PhotoTour):
        matches_files = "m50_5_5_0.txt"

    ds = Fixture(str(tmp_path), "liberty", train=False)
    assert torch.equal(ds.data[:n], torch.from_numpy(patches))
    assert int(ds.data[n:].max()) == 0
    assert torch.equal(ds.labels, torch.from_numpy(point_ids))
    assert np.array_equal(ds.matches.numpy(), np.c_[left, right, got.label])


def test_errors_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(DataNotFoundError, match="PhotoTour"):
        load_subset(tmp_path, "yosemite")
    with pytest.raises(DataNotFoundError, match="build-data"):
        load_subset(tmp_path, "photos")
    _hand_made(tmp_path / "notredame")
    (tmp_path / "notredame" / "m50_2_2_0.txt").write_text("0 0 0 1 0 0 0\n0 0 0 999 1 0 0\n")
    with pytest.raises(DataError, match="beyond"):
        load_subset(tmp_path, "notredame").pairs(2)
    (tmp_path / "notredame" / "m50_2_2_0.txt").write_text("0 0 0 1 0 0 0\n-1 0 0 1 1 0 0\n")
    with pytest.raises(DataError, match="line 2 holds a negative patch id"):  # was the last patch
        load_subset(tmp_path, "notredame").pairs(2)
    with pytest.raises(DataNotFoundError, match="found"):
        load_subset(tmp_path, "notredame").pairs(7)
    (tmp_path / "notredame" / "m50_3_3_0.txt").write_text("0 0 x\n")
    with pytest.raises(DataError):
        read_matches(tmp_path / "notredame" / "m50_3_3_0.txt")
    with pytest.raises(DataError):
        write_brown_subset(tmp_path / "bad", np.zeros((3, 32, 32), np.uint8), np.zeros(3, np.int64), np.zeros(3, np.int64), {})
    (tmp_path / "notredame" / "info.txt").write_text("\n".join(["1 0"] * 600) + "\n")
    with pytest.raises(DataError, match="only"):
        load_subset(tmp_path, "notredame")
