"""The deep-metric-learning retrieval benchmarks in their official layouts: CUB-200-2011,
Cars196, Stanford Online Products and In-Shop Clothes (the Reality Check's datasets and the
usual fourth). Registered in :data:`dmlkit.data.datasets.DATASETS` on import; layouts and
class splits are listed in :mod:`dmlkit.data.datasets`."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from dmlkit.data.base import ImageFileDataset
from dmlkit.data.datasets import (
    TRAIN_TEST,
    _check_files,
    _count_check,
    _download,
    _download_file,
    _find_dir,
    _groups_by_range,
    _missing,
    _root,
    register_dataset,
)
from dmlkit.exceptions import DataError

__all__ = ["load_cars196", "load_cub200", "load_inshop", "load_sop"]


# -- CUB-200-2011 ------------------------------------------------------------------------------
CUB_URL = "https://data.caltech.edu/records/65de6-vp158/files/CUB_200_2011.tgz"
CUB_MD5 = "97eceeb196236b17998738112f37df78"


def _read_numbered(path: Path, ncols: int, *, skip_header: str | None = None
                   ) -> list[tuple[int, list[str]]]:
    """``(line number, fields)`` of a whitespace-separated list file, ``ncols`` fields a line
    (the last one keeps its spaces: a path). Blank lines are skipped; ``skip_header``: line 1 is
    skipped when it is exactly this header (SOP's ``image_id class_id super_class_id path``),
    and only then. Any other line with another number of fields (a line cut short, two lines
    run together) is a :class:`DataError` naming ``file:line``: such lines were dropped
    silently before, shifting counts and splits with only a generic count warning."""
    rows = []
    with open(path) as fh:
        for lineno, line in enumerate(fh, start=1):
            if lineno == 1 and skip_header is not None and line.split() == skip_header.split():
                continue
            if not line.strip():
                continue
            parts = line.strip().split(maxsplit=ncols - 1)
            if len(parts) != ncols:
                raise DataError(f"{path}:{lineno}: expected {ncols} fields, got {len(parts)} "
                                f"({line.strip()[:80]!r}); the file is damaged: extract the "
                                "archive again")
            rows.append((lineno, parts))
    return rows


def _read_table(path: Path, ncols: int, *, skip_header: str | None = None) -> list[list[str]]:
    """The fields of :func:`_read_numbered`'s rows, without their line numbers."""
    return [parts for _, parts in _read_numbered(path, ncols, skip_header=skip_header)]


def _class_halves_dataset(
    name: str, folder: Path, paths: list[Path], labels: list[int], names: dict[int, str], *,
    expected: int, last_train: int, strict: bool, transform, skip_corrupt: bool,
) -> ImageFileDataset:
    """The common end of the CUB-200 / Cars196 loaders: check the files and their count
    (``expected`` images), then classes ``<= last_train`` train and the rest test."""
    _check_files(name, folder, paths)
    _count_check(name, "images", len(paths), expected, strict)
    return ImageFileDataset(
        paths, labels, class_names=names, class_groups=_groups_by_range(set(labels), last_train),
        split_groups=TRAIN_TEST, transform=transform, name=name, skip_corrupt=skip_corrupt,
        meta={"root": str(folder)},
    )


@register_dataset("cub200")
def load_cub200(root: str | os.PathLike | None = None, download: bool = False, *,
                strict: bool = False, transform=None, skip_corrupt: bool = False) -> ImageFileDataset:
    """CUB-200-2011 (Wah et al. 2011): 200 bird species, 11,788 images.

    Class id = the official 1..200; classes 1-100 train, 101-200 test (the DML convention).
    ``images.txt`` (``<id> <path>``), ``image_class_labels.txt`` (``<id> <class id>``, one of
    the ids of ``classes.txt``) and ``classes.txt`` (``<class id> <name>``): a line with a
    field missing, or a label that ``classes.txt`` does not list, is a :class:`DataError`
    naming ``file:line``.
    """
    base = _root(root)
    folder = _find_dir(base, ["CUB_200_2011", "cub200/CUB_200_2011", "cub200"], "images.txt")
    if folder is None and download:
        _download(CUB_URL, base, md5=CUB_MD5)
        folder = _find_dir(base, ["CUB_200_2011"], "images.txt")
    if folder is None:
        raise _missing(
            "cub200", base, "CUB_200_2011/{images.txt, image_class_labels.txt, classes.txt, images/}",
            f"Download {CUB_URL} and extract it into {base} (or pass download=True).",
        )
    for f in ("image_class_labels.txt", "classes.txt"):
        if not (folder / f).exists():
            raise _missing("cub200", folder, f, "Extract the full CUB_200_2011.tgz archive.")
    try:
        images = dict(_read_table(folder / "images.txt", 2))
        label_rows = [(n, k, int(v)) for n, (k, v) in
                      _read_numbered(folder / "image_class_labels.txt", 2)]
        cls_of = {k: c for _, k, c in label_rows}
        names = {int(k): v for k, v in _read_table(folder / "classes.txt", 2)}
        ids = sorted(images, key=int)
    except ValueError as exc:
        raise DataError(f"cub200: a list file in {folder} holds a non-integer id ({exc}): "
                        "extract the full CUB_200_2011.tgz archive again") from None
    unlabelled = [i for i in ids if i not in cls_of]
    if unlabelled:  # a truncated image_class_labels.txt: a KeyError traceback before
        raise DataError(f"cub200: {len(unlabelled):,} image(s) of images.txt have no class in "
                        f"{folder / 'image_class_labels.txt'}, e.g. image id {unlabelled[0]}; "
                        "extract the full CUB_200_2011.tgz archive again")
    for lineno, i, c in label_rows:
        if c not in names:  # else a class of its own, outside the 1-100 / 101-200 halves
            raise DataError(f"{folder / 'image_class_labels.txt'}:{lineno}: class {c} of image id "
                            f"{i} is not an id of classes.txt; extract the full "
                            "CUB_200_2011.tgz archive again")
    paths = [folder / "images" / images[i] for i in ids]
    labels = [cls_of[i] for i in ids]
    return _class_halves_dataset(
        "cub200", folder, paths, labels, names, expected=11788, last_train=100, strict=strict,
        transform=transform, skip_corrupt=skip_corrupt,
    )


# -- Cars196 -----------------------------------------------------------------------------------
# https (the site serves it; torchvision's StanfordCars reads car196/ over https). No checksum of
# these two files is published: a download is unverified; its extraction refuses members that
# would land outside the data root (:func:`~dmlkit.data.datasets.extract_archive`).
CARS_URL = "https://ai.stanford.edu/~jkrause/car196/car_ims.tgz"
CARS_ANNOS_URL = "https://ai.stanford.edu/~jkrause/car196/cars_annos.mat"


@register_dataset("cars196")
def load_cars196(root: str | os.PathLike | None = None, download: bool = False, *,
                 strict: bool = False, transform=None, skip_corrupt: bool = False) -> ImageFileDataset:
    """Cars196 / Stanford Cars (Krause et al. 2013): 196 car models, 16,185 images.

    Layout of the DML literature: ``cars_annos.mat`` (fields ``relative_im_path``, ``class``,
    ``test``, plus ``class_names``) and ``car_ims/``. Class id = the official 1..196; classes
    1-98 train, 99-196 test.
    """
    import scipy.io

    base = _root(root)
    folder = _find_dir(base, ["cars196", "stanford_cars", "CARS196"], "cars_annos.mat")
    if folder is None and download:
        target = base / "cars196"
        _download(CARS_URL, target)
        _download_file(CARS_ANNOS_URL, target)
        folder = target
    if folder is None:
        raise _missing(
            "cars196", base, "cars196/cars_annos.mat and cars196/car_ims/*.jpg",
            f"Download {CARS_URL} (extract it) and {CARS_ANNOS_URL} into {base / 'cars196'} "
            "(the original site is often offline; mirrors of car_ims.tgz + cars_annos.mat "
            "have the same layout).",
        )
    mat = folder / "cars_annos.mat"
    again = f"download {CARS_ANNOS_URL} again"
    try:  # MatReadError: an empty or cut file (a partial download), not an OSError/ValueError
        m = scipy.io.loadmat(mat, squeeze_me=True, struct_as_record=False)
    except (OSError, ValueError, NotImplementedError, scipy.io.matlab.MatReadError) as exc:
        raise DataError(f"cannot read {mat}: {exc}; {again}") from None
    if "annotations" not in m:  # another .mat (e.g. the Stanford Cars devkit's cars_meta.mat)
        raise DataError(f"{mat} has no 'annotations' (found {sorted(k for k in m if not k.startswith('__'))}): "
                        f"it is not the DML cars_annos.mat; {again}")
    annos = np.atleast_1d(m["annotations"])
    paths, labels = [], []
    for k, a in enumerate(annos):
        fields = getattr(a, "_fieldnames", None) or []
        if "relative_im_path" not in fields or "class" not in fields:
            raise DataError(f"{mat}: annotation {k + 1} has no fields relative_im_path and class "
                            f"(found {fields}); {again}")
        cls = getattr(a, "class")
        try:
            label = int(cls)
        except (TypeError, ValueError):
            raise DataError(f"{mat}: annotation {k + 1} ({a.relative_im_path}) has class {cls!r}, "
                            f"not an integer; {again}") from None
        paths.append(folder / str(a.relative_im_path))
        labels.append(label)
    names: dict[int, str] = {}
    if "class_names" in m:
        for i, n in enumerate(np.atleast_1d(m["class_names"]).tolist(), start=1):
            names[i] = str(n)
    return _class_halves_dataset(
        "cars196", folder, paths, labels, names, expected=16185, last_train=98, strict=strict,
        transform=transform, skip_corrupt=skip_corrupt,
    )


# -- Stanford Online Products ------------------------------------------------------------------
# The project page's link (ftp, no https copy, no published checksum): a download is unverified;
# its extraction refuses members that would land outside the data root.
SOP_URL = "ftp://cs.stanford.edu/cs/cvgl/Stanford_Online_Products.zip"
SOP_HEADER = "image_id class_id super_class_id path"


@register_dataset("sop")
def load_sop(root: str | os.PathLike | None = None, download: bool = False, *,
             strict: bool = False, transform=None, skip_corrupt: bool = False) -> ImageFileDataset:
    """Stanford Online Products (Oh Song et al. 2016): 22,634 products, 120,053 images.

    ``Ebay_train.txt`` (11,318 classes, 59,551 images) and ``Ebay_test.txt`` (11,316 classes,
    60,502 images), lines ``image_id class_id super_class_id path``. Class id = the official
    ``class_id``; groups train / test from the file each class is listed in. Line 1 is
    skipped only when it is the official header; any other line must have four fields and
    integer ids (else a :class:`DataError` naming ``file:line``).
    """
    base = _root(root)
    folder = _find_dir(base, ["Stanford_Online_Products", "sop", "SOP"], "Ebay_train.txt")
    if folder is None and download:
        _download(SOP_URL, base)
        folder = _find_dir(base, ["Stanford_Online_Products"], "Ebay_train.txt")
    if folder is None:
        raise _missing(
            "sop", base, "Stanford_Online_Products/{Ebay_train.txt, Ebay_test.txt, *_final/}",
            f"Download {SOP_URL} (also mirrored by many DML repositories) and extract it into "
            f"{base}.",
        )
    paths, labels, groups, names = [], [], {}, {}
    for part, fname, n_cls, n_img in (("train", "Ebay_train.txt", 11318, 59551),
                                      ("test", "Ebay_test.txt", 11316, 60502)):
        f = folder / fname
        if not f.exists():
            raise _missing("sop", folder, fname, "Extract the full archive.")
        # line 1 is the official header, skipped only when it is exactly that (a damaged
        # image id such as '3x' made a line look like a header: it was dropped silently)
        rows = _read_numbered(f, 4, skip_header=SOP_HEADER)
        part_classes = set()
        for lineno, (img_id, cls, _super, rel) in rows:
            if not (img_id.isascii() and img_id.isdecimal()):
                raise DataError(f"{f}:{lineno}: image_id {img_id!r} of {rel} is not an integer; "
                                "extract the full archive again")
            if not (cls.isascii() and cls.isdecimal()):
                raise DataError(f"{f}:{lineno}: class_id {cls!r} of {rel} is not an integer; "
                                "extract the full archive again")
            c = int(cls)
            paths.append(folder / rel)
            labels.append(c)
            part_classes.add(c)
            if groups.setdefault(c, part) != part:  # else the class went to test, train images too
                raise DataError(f"{f}: class {c} is listed in both Ebay_train.txt and Ebay_test.txt; "
                                "the official lists are class-disjoint: extract the archive again")
            names.setdefault(c, f"{rel.split('/')[0].removesuffix('_final')}/{c}")
        _count_check("sop", f"{part} classes", len(part_classes), n_cls, strict)
        _count_check("sop", f"{part} images", len(rows), n_img, strict)
    _check_files("sop", folder, paths)
    return ImageFileDataset(
        paths, labels, class_names=names, class_groups=groups, split_groups=TRAIN_TEST,
        transform=transform, name="sop", skip_corrupt=skip_corrupt, meta={"root": str(folder)},
    )


# -- In-Shop Clothes Retrieval ------------------------------------------------------------------
INSHOP_URL = "https://mmlab.ie.cuhk.edu.hk/projects/DeepFashion/InShopRetrieval.html"
INSHOP_HEADER = "image_name item_id evaluation_status"


@register_dataset("inshop")
def load_inshop(root: str | os.PathLike | None = None, download: bool = False, *,
                strict: bool = False, transform=None, skip_corrupt: bool = False) -> ImageFileDataset:
    """DeepFashion In-Shop Clothes Retrieval (Liu et al. 2016): 7,982 items, 52,712 images.

    ``list_eval_partition.txt`` (line 1: the number of images, line 2: the header
    ``image_name item_id evaluation_status``, then one such line per image; both are checked)
    assigns each image to ``train`` (3,997 items, 25,882 images),
    ``query`` (14,218) or ``gallery`` (12,612); query and gallery share the 3,985 test items.
    Class id = the item number (``id_00000002`` -> 2); ``ds.sample_groups`` holds the
    partition and ``ds.subset_group("query")`` / ``("gallery")`` give the retrieval sets.
    """
    base = _root(root)
    folder = None
    for marker in ("list_eval_partition.txt", "Eval/list_eval_partition.txt"):
        folder = _find_dir(base, ["InShop", "inshop", "In-shop Clothes Retrieval Benchmark",
                                  "In-shop_Clothes_Retrieval_Benchmark"], marker)
        if folder is not None:
            part_file = folder / marker
            break
    if folder is None:
        raise _missing(
            "inshop", base, "InShop/list_eval_partition.txt (or InShop/Eval/...) and InShop/img/",
            f"Download img.zip and list_eval_partition.txt from {INSHOP_URL} (Google Drive; no "
            f"direct download) and extract them into {base / 'InShop'}.",
        )
    lines = part_file.read_text().splitlines()
    # line 1: the number of images, line 2: the header (read, not skipped blindly: a file
    # without its count line lost its first image, one cut short loaded as a partial copy)
    count = lines[0].strip().lstrip("\ufeff") if lines else ""
    if not (count.isascii() and count.isdecimal()):
        raise DataError(f"{part_file}:1: expected the number of images, got {count[:80]!r}; the "
                        "file is damaged: download list_eval_partition.txt again")
    if len(lines) < 2 or lines[1].split() != INSHOP_HEADER.split():
        got = lines[1].strip()[:80] if len(lines) > 1 else ""
        raise DataError(f"{part_file}:2: expected the header '{INSHOP_HEADER}', got {got!r}; the "
                        "file is damaged: download list_eval_partition.txt again")
    rows = [(k, ln.split()) for k, ln in enumerate(lines[2:], start=3) if ln.strip()]
    if len(rows) != int(count):
        raise DataError(f"{part_file}: line 1 says {int(count):,} images but {len(rows):,} are "
                        "listed; the file is damaged: download list_eval_partition.txt again")
    paths, labels, status = [], [], []
    for lineno, r in rows:
        if len(r) != 3:
            raise DataError(f"{part_file}:{lineno}: malformed line {' '.join(r)!r}")
        rel, item, st = r
        num = item.removeprefix("id_")
        if not (num.isascii() and num.isdecimal()):  # else a ValueError traceback
            raise DataError(f"{part_file}: item id {item!r} of {rel} is not id_<number>")
        if st not in ("train", "query", "gallery"):  # else silently a test image
            raise DataError(f"{part_file}: evaluation_status {st!r} of {rel} is not train, query "
                            "or gallery")
        paths.append(folder / rel)
        labels.append(int(num))
        status.append(st)
    _check_files("inshop", folder, paths)
    _count_check("inshop", "images", len(paths), 52712, strict)
    groups: dict[int, str] = {}
    for c, st in zip(labels, status):
        g = "train" if st == "train" else "test"
        if groups.setdefault(c, g) != g:
            raise DataError(f"{part_file}: item id_{c:08d} is in both train and query/gallery")
    return ImageFileDataset(
        paths, labels, class_names={c: f"id_{c:08d}" for c in set(labels)}, class_groups=groups,
        split_groups=TRAIN_TEST, sample_groups=status, transform=transform, name="inshop",
        skip_corrupt=skip_corrupt, meta={"root": str(folder)},
    )
