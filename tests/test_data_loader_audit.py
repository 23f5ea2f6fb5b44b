"""Audit of the benchmark loaders (Cars196, Omniglot zips, Brown / PhotoTour, CUB-200-2011, SOP,
In-Shop): a damaged file was a traceback or was read silently wrong. Each test builds a tiny
real-format fixture and pins one of these; a partial copy with intact list files still loads
with the count warning ("using what is there")."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dmlkit.apps.patches import PatchPairs, load_subset, read_patch_sheets, write_brown_subset
from dmlkit.data import load_dataset
from dmlkit.exceptions import DataError


def _img(path: Path, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = np.random.default_rng(seed).integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
    Image.fromarray(arr).save(path, format="JPEG")
    return path


# -- Cars196: cars_annos.mat ------------------------------------------------------------------------
def _cars_mat(folder: Path, annos: dict) -> Path:
    import scipy.io

    folder.mkdir(parents=True, exist_ok=True)
    scipy.io.savemat(folder / "cars_annos.mat", annos)
    return folder / "cars_annos.mat"


def test_cars_empty_annotation_file_is_one_error(tmp_path):
    (tmp_path / "cars196" / "car_ims").mkdir(parents=True)
    (tmp_path / "cars196" / "cars_annos.mat").write_bytes(b"")  # a partial download
    with pytest.raises(DataError, match="cars_annos.mat.*download"):  # was scipy's MatReadError
        load_dataset("cars196", root=tmp_path)


def test_cars_mat_without_annotations_or_their_fields_is_one_error(tmp_path):
    folder = tmp_path / "cars196"
    _cars_mat(folder, {"class_names": np.array(["Car 1"], dtype=object)})
    with pytest.raises(DataError, match=r"cars_annos.mat has no 'annotations'"):  # was KeyError
        load_dataset("cars196", root=tmp_path)
    _img(folder / "car_ims" / "000001.jpg")
    no_class = np.array([("car_ims/000001.jpg", 0)], dtype=[("relative_im_path", "O"), ("test", "O")])
    _cars_mat(folder, {"annotations": no_class})
    with pytest.raises(DataError, match="annotation 1 has no fields relative_im_path and class"):
        load_dataset("cars196", root=tmp_path)  # was AttributeError
    ok = np.array([("car_ims/000001.jpg", 3, 0)],
                  dtype=[("relative_im_path", "O"), ("class", "O"), ("test", "O")])
    _cars_mat(folder, {"annotations": ok})
    with pytest.warns(UserWarning, match="using what is there"):
        assert load_dataset("cars196", root=tmp_path).labels.tolist() == [3]


# -- Omniglot: the official zip ---------------------------------------------------------------------
def test_omniglot_truncated_zip_is_one_error(tmp_path):
    folder = tmp_path / "omniglot"
    folder.mkdir()
    zpath = folder / "images_background.zip"
    with zipfile.ZipFile(zpath, "w") as zf:
        for drawer in range(1, 21):
            img = Image.fromarray(np.full((105, 105), 255 * (drawer % 2), np.uint8))
            path = tmp_path / "png.png"
            img.save(path)
            zf.write(path, f"images_background/Alphabet/character01/0001_{drawer:02d}.png")
    data = zpath.read_bytes()
    zpath.write_bytes(data[: len(data) // 2])  # a partial download
    with pytest.raises(DataError, match="images_background.zip is not a complete zip file.*download"):
        load_dataset("omniglot", root=tmp_path, source="zip", sets=["background"])  # was BadZipFile


# -- Brown / PhotoTour ------------------------------------------------------------------------------
N_PATCHES = 300  # two sheets: 256 + 44


@pytest.fixture
def brown(tmp_path) -> tuple[Path, np.ndarray]:
    rng = np.random.default_rng(0)
    patches = rng.integers(0, 256, (N_PATCHES, 64, 64), dtype=np.uint8)
    points = np.arange(N_PATCHES, dtype=np.int64) // 3
    left, right = np.arange(12, dtype=np.int64), np.arange(12, dtype=np.int64)[::-1].copy()
    pairs = PatchPairs(left, right, (points[left] == points[right]).astype(np.int64))
    write_brown_subset(tmp_path / "liberty", patches, points, np.zeros(N_PATCHES, np.int64), {12: pairs})
    return tmp_path, patches


def test_brown_only_numbered_sheets_are_read(brown):
    root, patches = brown
    folder = root / "liberty"
    shutil.copy(folder / "patches0001.bmp", folder / "patches0000 (copy).bmp")  # sorts first
    sub = load_subset(root, "liberty")  # was: the copy read as sheet 0, every patch shifted
    assert np.array_equal(sub.patches, patches)
    (folder / "notes.BMP").write_bytes(b"")  # not a sheet either
    assert np.array_equal(read_patch_sheets(folder), np.concatenate([patches, np.zeros((212, 64, 64), np.uint8)]))


def test_brown_sheets_must_be_numbered_without_gap(brown):
    root, patches = brown
    folder = root / "liberty"
    (folder / "patches0001.bmp").rename(folder / "patches0002.bmp")
    with pytest.raises(DataError, match="300 patches .*2 sheets.*missing patches0001.bmp hold only 256"):
        load_subset(root, "liberty")  # was: patches0002.bmp read as the second sheet
    with pytest.raises(DataError, match="patches0001.bmp is missing"):
        read_patch_sheets(folder)
    assert np.array_equal(read_patch_sheets(folder, 200), patches[:200])  # one sheet is enough


def test_brown_cut_match_file_is_refused(brown):
    root, _ = brown
    path = root / "liberty" / "m50_12_12_0.txt"
    path.write_text("".join(path.read_text().splitlines(True)[:9]))
    sub = load_subset(root, "liberty")
    with pytest.raises(DataError, match="m50_12_12_0.txt: expected 12 pairs .*found 9"):
        sub.pairs(12)  # was: 9 pairs, silently


def test_brown_truncated_sheet_names_the_file(brown):
    root, _ = brown
    sheet = root / "liberty" / "patches0001.bmp"
    data = sheet.read_bytes()
    sheet.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"patches0001\.bmp: cannot read this patch sheet"):
        load_subset(root, "liberty")  # was PIL's OSError without the file name


# -- CUB-200-2011 -----------------------------------------------------------------------------------
def _cub(root: Path, n: int = 4) -> Path:
    folder = root / "CUB_200_2011"
    images, labels = [], []
    for k in range(1, n + 1):
        cls = 1 if k <= n // 2 else 101
        rel = f"{cls:03d}.Bird/Bird_{k:04d}.jpg"
        _img(folder / "images" / rel, k)
        images.append(f"{k} {rel}")
        labels.append(f"{k} {cls}")
    (folder / "images.txt").write_text("\n".join(images) + "\n")
    (folder / "image_class_labels.txt").write_text("\n".join(labels) + "\n")
    (folder / "classes.txt").write_text("1 001.Bird\n101 101.Bird\n")
    return folder


def test_cub_line_with_a_missing_field_is_one_error(tmp_path):
    folder = _cub(tmp_path)
    lines = (folder / "images.txt").read_text().splitlines()
    lines[3] = "4"  # the path cut off
    (folder / "images.txt").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"images.txt:4: expected 2 fields, got 1"):
        load_dataset("cub200", root=tmp_path)  # was: image 4 dropped, one count warning


def test_cub_label_not_in_classes_txt_is_one_error(tmp_path):
    folder = _cub(tmp_path)
    (folder / "image_class_labels.txt").write_text("1 1\n2 1\n3 101\n4 201\n")
    with pytest.raises(DataError, match=r"image_class_labels.txt:4: class 201 of image id 4 is not"):
        load_dataset("cub200", root=tmp_path)  # was: a test class 201 of its own


def test_cub_partial_copy_with_intact_lists_still_loads(tmp_path):
    folder = _cub(tmp_path, 6)
    for name in ("images.txt", "image_class_labels.txt"):  # whole lines lost at the end
        lines = (folder / name).read_text().splitlines()
        (folder / name).write_text("\n".join(lines[:5]) + "\n\n")
    with pytest.warns(UserWarning, match="found 5 images.*using what is there"):
        assert len(load_dataset("cub200", root=tmp_path)) == 5


# -- Stanford Online Products -----------------------------------------------------------------------
SOP_HEADER = "image_id class_id super_class_id path\n"


def _sop(root: Path, test_lines: list[str], header: str = SOP_HEADER) -> Path:
    folder = root / "Stanford_Online_Products"
    for c, j in ((1, 0), (1, 1), (3, 0), (3, 1), (4, 0), (4, 1)):
        _img(folder / "bicycle_final" / f"{c}_{j}.JPG", 10 * c + j)
    (folder / "Ebay_train.txt").write_text(
        header + "1 1 1 bicycle_final/1_0.JPG\n2 1 1 bicycle_final/1_1.JPG\n")
    (folder / "Ebay_test.txt").write_text(header + "".join(f"{ln}\n" for ln in test_lines))
    return folder


SOP_TEST = ["3 3 1 bicycle_final/3_0.JPG", "4 3 1 bicycle_final/3_1.JPG",
            "5 4 1 bicycle_final/4_0.JPG", "6 4 1 bicycle_final/4_1.JPG"]


@pytest.mark.filterwarnings("ignore:sop. found:UserWarning")
def test_sop_cut_line_is_one_error(tmp_path):
    _sop(tmp_path, [*SOP_TEST[:3], "6 4 1"])
    with pytest.raises(DataError, match=r"Ebay_test.txt:5: expected 4 fields, got 3"):
        load_dataset("sop", root=tmp_path)  # was: the line dropped, one count warning


@pytest.mark.filterwarnings("ignore:sop. found:UserWarning")
def test_sop_damaged_image_id_is_not_a_header(tmp_path):
    _sop(tmp_path, [SOP_TEST[0], "4x 3 1 bicycle_final/3_1.JPG", *SOP_TEST[2:]])
    with pytest.raises(DataError, match=r"Ebay_test.txt:3: image_id '4x'"):
        load_dataset("sop", root=tmp_path)  # was: skipped as a header line


def test_sop_header_is_only_line_one(tmp_path):
    _sop(tmp_path, SOP_TEST)
    with pytest.warns(UserWarning, match="using what is there"):
        assert len(load_dataset("sop", root=tmp_path)) == 6
    _sop(tmp_path, SOP_TEST, header="")  # no header: line 1 is an image
    with pytest.warns(UserWarning, match="using what is there"):
        assert len(load_dataset("sop", root=tmp_path)) == 6


# -- In-Shop ----------------------------------------------------------------------------------------
INSHOP_ROWS = [("img/WOMEN/Dresses/id_00000002/02_1_front.jpg", "id_00000002", "train"),
               ("img/WOMEN/Dresses/id_00000002/02_2_side.jpg", "id_00000002", "train"),
               ("img/MEN/Denim/id_00000080/01_1_front.jpg", "id_00000080", "query"),
               ("img/MEN/Denim/id_00000080/01_2_side.jpg", "id_00000080", "gallery")]


def _inshop(root: Path, text: str) -> None:
    folder = root / "InShop"
    for k, (rel, _, _) in enumerate(INSHOP_ROWS):
        _img(folder / rel, k)
    (folder / "list_eval_partition.txt").write_text(text)


def test_inshop_count_and_header_lines_are_checked(tmp_path):
    head = "image_name item_id evaluation_status\n"
    body = "".join(f"{r} {i} {s}\n" for r, i, s in INSHOP_ROWS)
    _inshop(tmp_path, f"4\n{head}{body}")
    with pytest.warns(UserWarning, match="using what is there"):
        assert len(load_dataset("inshop", root=tmp_path)) == 4
    cases = ((f"{head}{body}", r"list_eval_partition.txt:1: expected the number of images"),
             (f"4\n{body}", r"list_eval_partition.txt:2: expected the header"),
             (f"4\n{head}{''.join(body.splitlines(True)[:3])}", r"line 1 says 4 images but 3 are listed"))
    for text, match in cases:  # was: the first image taken as the header; a cut list loaded
        _inshop(tmp_path, text)
        with pytest.raises(DataError, match=match):
            load_dataset("inshop", root=tmp_path)
