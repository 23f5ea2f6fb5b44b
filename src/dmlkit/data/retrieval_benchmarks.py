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


def _read_table(path: Path, ncols: int) -> list[list[str]]:
    rows = []
    with open(path) as fh:
        for line in fh:
            parts = line.strip().split(maxsplit=ncols - 1)
            if len(parts) == ncols:
                rows.append(parts)
    return rows


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
        cls_of = {k: int(v) for k, v in _read_table(folder / "image_class_labels.txt", 2)}
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
    paths = [folder / "images" / images[i] for i in ids]
    labels = [cls_of[i] for i in ids]
    return _class_halves_dataset(
        "cub200", folder, paths, labels, names, expected=11788, last_train=100, strict=strict,
        transform=transform, skip_corrupt=skip_corrupt,
    )


# -- Cars196 -----------------------------------------------------------------------------------
CARS_URL = "http://ai.stanford.edu/~jkrause/car196/car_ims.tgz"
CARS_ANNOS_URL = "http://ai.stanford.edu/~jkrause/car196/cars_annos.mat"


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
    try:
        m = scipy.io.loadmat(folder / "cars_annos.mat", squeeze_me=True, struct_as_record=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read {folder / 'cars_annos.mat'}: {exc}") from exc
    annos = np.atleast_1d(m["annotations"])
    paths = [folder / str(a.relative_im_path) for a in annos]
    labels = [int(a.__getattribute__("class")) for a in annos]
    names: dict[int, str] = {}
    if "class_names" in m:
        for i, n in enumerate(np.atleast_1d(m["class_names"]).tolist(), start=1):
            names[i] = str(n)
    return _class_halves_dataset(
        "cars196", folder, paths, labels, names, expected=16185, last_train=98, strict=strict,
        transform=transform, skip_corrupt=skip_corrupt,
    )


# -- Stanford Online Products ------------------------------------------------------------------
SOP_URL = "ftp://cs.stanford.edu/cs/cvgl/Stanford_Online_Products.zip"


@register_dataset("sop")
def load_sop(root: str | os.PathLike | None = None, download: bool = False, *,
             strict: bool = False, transform=None, skip_corrupt: bool = False) -> ImageFileDataset:
    """Stanford Online Products (Oh Song et al. 2016): 22,634 products, 120,053 images.

    ``Ebay_train.txt`` (11,318 classes, 59,551 images) and ``Ebay_test.txt`` (11,316 classes,
    60,502 images), lines ``image_id class_id super_class_id path``. Class id = the official
    ``class_id``; groups train / test from the file each class is listed in.
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
        rows = _read_table(f, 4)
        rows = [r for r in rows if r[0].isdigit()]  # skip the header
        part_classes = set()
        for _img_id, cls, _super, rel in rows:
            if not (cls.isascii() and cls.isdecimal()):
                raise DataError(f"{f}: class_id {cls!r} of {rel} is not an integer; extract the "
                                "full archive again")
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


@register_dataset("inshop")
def load_inshop(root: str | os.PathLike | None = None, download: bool = False, *,
                strict: bool = False, transform=None, skip_corrupt: bool = False) -> ImageFileDataset:
    """DeepFashion In-Shop Clothes Retrieval (Liu et al. 2016): 7,982 items, 52,712 images.

    ``list_eval_partition.txt`` (line 1: count, line 2: header, then ``image_name item_id
    evaluation_status``) assigns each image to ``train`` (3,997 items, 25,882 images),
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
    rows = [ln.split() for ln in lines[2:] if ln.strip()]
    paths, labels, status = [], [], []
    for r in rows:
        if len(r) != 3:
            raise DataError(f"{part_file}: malformed line {' '.join(r)!r}")
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
