"""Which files the ``image_folder`` and ``csv`` loaders take: one file is one image however it
is reached (a symbolic link counted it twice), and nothing is dropped without a word (``.jfif``
downloads, photos lying in the root)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dmlkit.data import IMAGE_EXTENSIONS, load_dataset
from dmlkit.exceptions import DataError


def _folder(root: Path, classes: tuple[str, ...] = ("cat", "dog"), per_class: int = 2, suffix: str = ".png") -> Path:
    """``root/<class>/<k><suffix>``: small images of distinct colours."""
    rng = np.random.default_rng(0)
    for name in classes:
        (root / name).mkdir(parents=True, exist_ok=True)
        for k in range(per_class):
            pixels = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{k}{suffix}", format="JPEG" if "j" in suffix else "PNG")
    return root


def test_an_image_reached_through_a_link_is_refused_by_both_loaders(tmp_path):
    # the link was a second item of the same file: each query found its copy (P@1 0.800, not 0.778)
    root = _folder(tmp_path / "data")
    os.symlink(root / "cat" / "0.png", root / "cat" / "0_copy.png")
    with pytest.raises(DataError, match=r"1 image file\(s\) are reached twice, e.g. cat/0_copy.png is cat/0.png"):
        load_dataset("image_folder", root=root)
    (root / "list.csv").write_text("path,label\ncat/0.png,cat\ndog/0.png,dog\ncat/0_copy.png,cat\n")
    with pytest.raises(DataError, match=r"line 4 lists 'cat/0_copy.png', the image of line 2 \('cat/0.png'\) again"):
        load_dataset("csv", root=root / "list.csv")


def test_one_file_in_two_classes_is_refused(tmp_path):
    root = _folder(tmp_path / "data")
    os.symlink(root / "cat", root / "dog" / "cats_too", target_is_directory=True)
    with pytest.raises(DataError, match=r"2 image file\(s\) are reached in two classes, e.g. dog/cats_too/0.png is cat/0.png"):
        load_dataset("image_folder", root=root)
    (root / "dog" / "cats_too").unlink()
    os.symlink(tmp_path / "data" / "cat", tmp_path / "cat_link", target_is_directory=True)
    (root / "list.csv").write_text(f"path,label\ncat/1.png,cat\n{tmp_path / 'cat_link' / '1.png'},dog\n")
    with pytest.raises(DataError, match="line 3 .* the image of line 2"):
        load_dataset("csv", root=root / "list.csv")


def test_symlinked_class_folders_are_one_image_per_file(tmp_path):
    # the layout the docs show (ln -s $DMLKIT_DATA/att_faces/s1 faces10/s1) loads, no error
    real = _folder(tmp_path / "real")
    (tmp_path / "linked").mkdir()
    for name in ("cat", "dog"):
        os.symlink(real / name, tmp_path / "linked" / name, target_is_directory=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = load_dataset("image_folder", root=tmp_path / "linked")
    assert len(ds) == 4 and ds.class_counts() == {0: 2, 1: 2}


def test_jfif_and_jpe_images_are_read_and_skipped_files_are_named(tmp_path):
    assert {".jfif", ".jpe"} <= set(IMAGE_EXTENSIONS)
    root = _folder(tmp_path / "data", suffix=".jpg")
    for name in ("cat", "dog"):
        for suffix in (".jfif", ".JPE"):
            Image.new("RGB", (8, 8), (10, 20, 30)).save(root / name / f"web{suffix}", format="JPEG")
    (root / "cat" / "phone.heic").write_bytes(b"not read by Pillow")
    (root / "cat" / "Thumbs.db").write_bytes(b"")  # Windows' thumbnails and dot files: no warning
    (root / "dog" / ".DS_Store").write_bytes(b"")
    Image.new("RGB", (8, 8)).save(root / "unsorted.jpg")
    (root / "README.txt").write_text("my photos")  # not an image in the root: no warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = load_dataset("image_folder", root=root)
    assert ds.class_counts() == {0: 4, 1: 4}
    web = [i for i, p in enumerate(ds.paths) if Path(p).stem == "web"]
    assert len(web) == 4 and all(tuple(ds[i][0].shape[-2:]) == (8, 8) for i in web)  # read as images
    messages = [str(w.message) for w in caught]
    assert messages == [
        "image_folder:data: skipped 1 file(s) in class folders whose suffix is not an image extension (.heic x1), "
        "e.g. cat/phone.heic; if they are images Pillow reads, add their suffix to data.options.extensions "
        "(extensions=[...] in Python)",
        f"image_folder:data: skipped 1 image(s) lying directly in {root}, in no class folder, e.g. unsorted.jpg: "
        "move each into its class's sub-folder",
    ]
