"""The Brown / PhotoTour reader refuses what would shift or relabel pairs without a word: sheets
of another size than 1024 x 1024, m50 point ids that disagree with info.txt, m50 lines of other
than 7 columns and an empty m50 file (each test pins a bug of audit s41)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from _reference import brown_subset, one_error_line
from dmlkit.apps.patches import load_subset, read_matches, read_patch_sheets
from dmlkit.exceptions import DataError


def _sheets(folder: Path, sizes: list[tuple[int, int]], n: int, seed: int = 0) -> list[np.ndarray]:
    """Sheets ``patches%04d.bmp`` of the given ``(height, width)``, random pixels; ``info.txt``
    of ``n`` patches, 4 per 3D point; one consistent m50 line. Returns the sheets' pixels."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    out = []
    for k, (h, w) in enumerate(sizes):
        sheet = rng.integers(0, 256, (h, w), dtype=np.uint8)
        Image.fromarray(sheet).save(folder / f"patches{k:04d}.bmp")
        out.append(sheet)
    (folder / "info.txt").write_text("".join(f"{k // 4} 0\n" for k in range(n)))
    (folder / "m50_1_1_0.txt").write_text(f"0 0 0 {n - 1} {(n - 1) // 4} 0 0\n")
    return out


# -- F1: every sheet is 1024 x 1024 ----------------------------------------------------------------
def test_small_first_sheet_is_refused(tmp_path: Path) -> None:
    """Was: a 512 x 512 first sheet gave 64 patches, so patch 256 (and every pair past patch 63)
    was another patch than the Brown layout's, silently."""
    _sheets(tmp_path / "s", [(512, 512), (1024, 1024)], 300)
    with pytest.raises(DataError, match=r"patches0000\.bmp: sheet of 512 x 512 pixels, expected 1024 x 1024"):
        load_subset(tmp_path, "s")
    with pytest.raises(DataError, match=r"patches0000\.bmp: sheet of 512 x 512"):
        read_patch_sheets(tmp_path / "s")


def test_small_or_oblong_last_sheet_is_refused(tmp_path: Path) -> None:
    """The last sheet is padded to 1024 x 1024 in the Brown data (and by write_brown_subset): a
    shorter last sheet, even one holding all the patches info.txt lists, is not the layout."""
    _sheets(tmp_path / "s", [(1024, 1024), (512, 1024)], 300)  # 256 + 128 patches >= 300
    with pytest.raises(DataError, match=r"patches0001\.bmp: sheet of 1024 x 512 pixels, expected 1024 x 1024"):
        load_subset(tmp_path, "s")


def test_full_sheets_still_load_in_phototour_order(tmp_path: Path) -> None:
    sheets = _sheets(tmp_path / "s", [(1024, 1024), (1024, 1024)], 300)
    sub = load_subset(tmp_path, "s")
    assert sub.patches.shape == (300, 64, 64)
    # patch k = sheet k // 256, row k % 256 // 16, column k % 16
    for k in (0, 17, 255, 256, 299):
        s, r, c = k // 256, k % 256 // 16, k % 16
        assert np.array_equal(sub.patches[k], sheets[s][r * 64 : (r + 1) * 64, c * 64 : (c + 1) * 64])


def test_bad_sheet_is_one_error_line_in_the_cli(tmp_path: Path, run_cli) -> None:
    brown_subset(tmp_path / "a", 24, (64, 32), seed=1)
    brown_subset(tmp_path / "b", 24, (64, 32), seed=2)
    sheet = tmp_path / "a" / "patches0000.bmp"  # the training subset: refused before any training
    with Image.open(sheet) as im:
        small = np.asarray(im.convert("L"))[:512, :512]
    Image.fromarray(small).save(sheet)
    cfg = {"seed": 0, "data": {"root": str(tmp_path), "combinations": [["a", "b"]]},
           "model": {"architectures": ["siam-l2"], "patch_size": 32, "width": 0.125},
           "training": {"epochs": 1, "batch_size": 16, "threads": 1, "augment": False}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    code, out, err = run_cli(["patches", "train", str(tmp_path / "cfg.yaml"), "-o", str(tmp_path / "run"), "-q"])
    line = one_error_line(code, err)
    assert "patches0000.bmp" in line and "512 x 512" in line and "1024 x 1024" in line


# -- F2: m50 point ids agree with info.txt -----------------------------------------------------------
def test_m50_point_ids_that_disagree_with_info_are_refused(tmp_path: Path) -> None:
    """Was: ``0 999 0 5 999 0 0`` was read as a match although info.txt puts patches 0 and 5 on
    different 3D points (the label comes from the file's point ids alone)."""
    _sheets(tmp_path / "s", [(1024, 1024), (1024, 1024)], 300)
    folder = tmp_path / "s"
    (folder / "m50_3_3_0.txt").write_text("0 0 0 1 0 0 0\n0 999 0 5 999 0 0\n4 1 0 8 2 0 0\n")
    sub = load_subset(tmp_path, "s")
    with pytest.raises(DataError, match=r"m50_3_3_0\.txt: line 2 gives patches 0 and 5 the 3D points 999 and "
                                        r"999, info.txt gives 0 and 1 \(1 such line"):
        sub.pairs(3)
    with pytest.raises(DataError, match="line 2"):
        read_matches(folder / "m50_3_3_0.txt", point_ids=sub.point_ids)
    # one side only disagreeing is refused too
    (folder / "m50_3_3_0.txt").write_text("0 0 0 1 0 0 0\n0 0 0 5 0 0 0\n4 1 0 8 2 0 0\n")
    with pytest.raises(DataError, match="line 2 gives patches 0 and 5 the 3D points 0 and 0"):
        sub.pairs(3)
    # a consistent file reads, labels from the point ids
    (folder / "m50_3_3_0.txt").write_text("0 0 0 1 0 0 0\n0 0 0 5 1 0 0\n4 1 0 8 2 0 0\n")
    assert np.array_equal(sub.pairs(3).label, [1, 0, 0])
    # without info.txt's ids (a pair file read on its own) only the file is checked
    (folder / "m50_3_3_0.txt").write_text("0 0 0 1 0 0 0\n0 999 0 5 999 0 0\n4 1 0 8 2 0 0\n")
    assert np.array_equal(read_matches(folder / "m50_3_3_0.txt", 300).label, [1, 1, 0])


def test_point_ids_shorter_than_num_patches_bound_the_ids(tmp_path: Path) -> None:
    path = tmp_path / "m50_1_1_0.txt"
    path.write_text("0 0 0 9 3 0 0\n")
    with pytest.raises(DataError, match="beyond the 4 patches"):
        read_matches(path, 100, point_ids=np.array([0, 0, 1, 1]))


# -- F3: 7 columns, an empty file ------------------------------------------------------------------
def test_m50_lines_of_5_columns_are_refused(tmp_path: Path) -> None:
    """Was: 5-column lines were read although the error text and the docs say 7."""
    path = tmp_path / "m50_2_2_0.txt"
    path.write_text("0 3 0 1 3\n1 3 0 2 4\n")
    with pytest.raises(DataError, match=r"expected 7 integer columns per line .*got 5"):
        read_matches(path, 300)
    path.write_text("0 3 0 1 3 0 0 0\n1 3 0 2 4 0 0 0\n")
    with pytest.raises(DataError, match="got 8"):
        read_matches(path, 300)


def test_empty_m50_file_says_empty_without_numpy_warning(tmp_path: Path) -> None:
    """Was: "expected 7 integer columns per line, got 1" and numpy's raw UserWarning
    ("loadtxt: input contained no data") on stderr."""
    path = tmp_path / "m50_3_3_0.txt"
    for text in ("", "\n\n"):
        path.write_text(text)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # any warning that escapes fails the test
            with pytest.raises(DataError, match=r"m50_3_3_0\.txt is empty"):
                read_matches(path, 300)
