"""Re-identification datasets read from local files in their official layouts.

Every loader returns a :class:`ReidDataset` (an :class:`~dmlkit.data.ImageFileDataset` with a
camera id per image in ``ds.cams``) holding all images; ``ds.sample_groups`` says which are
``train`` / ``query`` / ``gallery`` (VehicleID: ``train`` / ``test``) and
``ds.subset_group("query")`` selects them. Class ids are the datasets' own identity numbers
(junk ``-1`` and distractor ``0`` of Market-1501 kept as they are); class groups ``train`` /
``test`` give :func:`dmlkit.data.default_split` the training identities. Camera ids are
0-based (file ``c1`` -> camera 0). Nothing is downloaded: these datasets are distributed on
request or withdrawn, so the error says where to put a local copy.

| name | layout under the data root | train / query / gallery |
| --- | --- | --- |
| ``market1501`` | ``Market-1501-v15.09.15/{bounding_box_train,query,bounding_box_test}/0002_c1s1_000451_03.jpg`` | 751 ids 12,936 / 3,368 / 15,913 (19,732 with the 3,819 junk -1 images; distractors 0 are in both) |
| ``dukemtmc_reid`` | ``DukeMTMC-reID/{bounding_box_train,query,bounding_box_test}/0001_c2_f0046182.jpg`` | 702 ids 16,522 / 2,228 / 17,661 |
| ``msmt17`` | ``MSMT17_V1/{train,test}/`` (V2: ``mask_{train,test}_v2/``) + ``list_{train,val,query,gallery}.txt`` | 1,041 ids 32,621 / 11,659 / 82,161 |
| ``cuhk03`` | ``cuhk03-np/{detected,labeled}/{bounding_box_train,query,bounding_box_test}/`` (the new 767/700 protocol of Zhong et al. 2017) | 767 ids 7,365 / 1,400 / 5,332 (detected) |
| ``veri776`` | ``VeRi/{image_train,image_query,image_test}/0002_c002_00030600_0.jpg`` + ``name_{train,query,test}.txt`` | 576 ids 37,778 / 1,678 / 11,579 |
| ``vehicleid`` | ``VehicleID_V1.0/image/<name>.jpg`` + ``train_test_split/{train_list,test_list_800,test_list_1600,test_list_2400}.txt`` | 13,134 ids 110,178 / test: 800, 1,600 or 2,400 ids (6,532 / 11,395 / 17,638 images) |
| ``att_faces_reid`` | ``att_faces/s1..s40/1..10.pgm`` (shared data): camera = picture pair, test pictures 1 and 6 = queries | 20 ids 200 / 40 / 160 |

MSMT17 numbers the train and test identities from 0 independently; the test ids are offset
by :data:`MSMT17_TEST_OFFSET` so that class ids stay unique (``class_names`` keep the file's).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dmlkit.data.base import ImageFileDataset
from dmlkit.data.datasets import (
    DATA_ROOT_HINT,
    TRAIN_TEST,
    _count_check,
    _find_dir,
    _root,
    load_att_faces,
    register_dataset,
)
from dmlkit.exceptions import ConfigError, DataError, DataNotFoundError, ShapeError
from dmlkit.validation import check_integer

__all__ = [
    "MSMT17_TEST_OFFSET",
    "REID_DATASETS",
    "ReidDataset",
    "load_cuhk03",
    "load_att_faces_reid",
    "load_dukemtmc_reid",
    "load_market1501",
    "load_msmt17",
    "load_vehicleid",
    "load_veri776",
    "parse_reid_name",
]

MSMT17_TEST_OFFSET = 100_000
REID_DATASETS = ("market1501", "dukemtmc_reid", "msmt17", "cuhk03", "veri776", "vehicleid",
                 "att_faces_reid")
_NAME = re.compile(r"^(-?\d+)_c(\d+)")
_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp")


class ReidDataset(ImageFileDataset):
    """Image files with identity labels and a camera id per image (``ds.cams``, 0-based).

    ``ds.cams`` follows every view (:meth:`subset`, :meth:`subset_group`, ...) like ``labels``.
    """

    def __init__(self, paths: Sequence[str | os.PathLike], labels: Sequence[int] | np.ndarray,
                 cams: Sequence[int] | np.ndarray, **kwargs: Any) -> None:
        cams = np.asarray(cams, dtype=np.int64)
        if cams.shape != (len(paths),):
            raise ShapeError(f"cams must have one entry per image ({len(paths)}), got {cams.shape}")
        self._all_cams = cams
        super().__init__(paths, labels, **kwargs)

    def _refresh(self) -> None:
        super()._refresh()
        self.cams: np.ndarray = self._all_cams[self._rows]


def parse_reid_name(name: str) -> tuple[int, int]:
    """``(identity, 0-based camera)`` from ``0002_c1s1_000451_03.jpg``-style names."""
    m = _NAME.match(name)
    if m is None:
        raise DataError(
            f"file name {name!r} does not start with '<id>_c<camera>' (e.g. 0002_c1s1_000451_03.jpg)"
        )
    if int(m.group(2)) < 1:  # cameras are numbered from c1 (c0 became camera -1)
        raise DataError(f"file name {name!r} names camera c{m.group(2)}: cameras are numbered from c1")
    return int(m.group(1)), int(m.group(2)) - 1


def _missing(name: str, base: Path, expected: str) -> DataNotFoundError:
    return DataNotFoundError(
        f"{name} not found: expected {expected} under {base}. The dataset is distributed by its "
        f"authors on request (no public download); extract your copy there. {DATA_ROOT_HINT}"
    )


def _scan(folder: Path) -> list[tuple[Path, int, int]]:
    if not folder.is_dir():
        raise DataNotFoundError(f"folder {folder} not found: the dataset is incomplete")
    out = []
    for f in sorted(folder.iterdir()):
        if f.suffix.lower() in _IMAGE_SUFFIXES:
            try:
                pid, cam = parse_reid_name(f.name)
            except DataError as exc:
                raise DataError(f"{folder}: {exc}") from None
            out.append((f, pid, cam))
    if not out:
        raise DataError(f"no images in {folder}")
    return out


def _build(name: str, parts: dict[str, list[tuple[Path, int, int]]], folder: Path,
           transform: Any, skip_corrupt: bool, names: dict[int, str] | None = None,
           mode: str = "RGB", **meta: Any) -> ReidDataset:
    paths: list[Path] = []
    labels: list[int] = []
    cams: list[int] = []
    groups: list[str] = []
    for group, items in parts.items():
        for p, pid, cam in items:
            paths.append(p)
            labels.append(pid)
            cams.append(cam)
            groups.append(group)
    class_groups: dict[int, str] = {}
    for pid, group in zip(labels, groups):
        g = "train" if group == "train" else "test"
        if class_groups.setdefault(pid, g) != g:
            raise DataError(f"{name}: identity {pid} is both a training and a test identity")
    return ReidDataset(
        paths, labels, cams, mode=mode, class_names=names, class_groups=class_groups,
        split_groups=TRAIN_TEST, sample_groups=groups, transform=transform, name=name,
        skip_corrupt=skip_corrupt, meta={"root": str(folder), **meta},
    )


def _market_layout(name: str, folder: Path, counts: dict[str, int] | None, strict: bool,
                   transform: Any, skip_corrupt: bool) -> ReidDataset:
    parts = {
        "train": _scan(folder / "bounding_box_train"),
        "query": _scan(folder / "query"),
        "gallery": _scan(folder / "bounding_box_test"),
    }
    for group, n in (counts or {}).items():
        _count_check(name, f"{group} images", len(parts[group]), n, strict)
    return _build(name, parts, folder, transform, skip_corrupt)


@register_dataset("market1501")
def load_market1501(root: str | os.PathLike | None = None, download: bool = False, *,
                    strict: bool = False, transform=None, skip_corrupt: bool = False) -> ReidDataset:
    """Market-1501 (Zheng et al., ICCV 2015): 1,501 identities, 6 cameras.

    Names ``PPPP_cCsS_FFFFFF_BB.jpg``: identity, camera, sequence, frame, box. Gallery id
    ``-1`` = junk (evaluated as junk), ``0`` = distractor (a negative for every query).
    """
    base = _root(root)
    folder = _find_dir(base, ["Market-1501-v15.09.15", "Market-1501", "market1501"], "query")
    if folder is None:
        raise _missing("market1501", base, "Market-1501-v15.09.15/{bounding_box_train,query,"
                       "bounding_box_test}/")
    return _market_layout("market1501", folder,
                          {"train": 12936, "query": 3368, "gallery": 19732}, strict, transform,
                          skip_corrupt)


@register_dataset("dukemtmc_reid")
def load_dukemtmc_reid(root: str | os.PathLike | None = None, download: bool = False, *,
                       strict: bool = False, transform=None,
                       skip_corrupt: bool = False) -> ReidDataset:
    """DukeMTMC-reID (Zheng, Zheng & Yang, ICCV 2017): 1,404 identities + 408 distractors, 8 cameras.

    Names ``PPPP_cC_fFFFFFFF.jpg``. (The DukeMTMC data were withdrawn by their authors in
    2019; only existing local copies can be used.)
    """
    base = _root(root)
    folder = _find_dir(base, ["DukeMTMC-reID", "dukemtmc-reid", "dukemtmc_reid"], "query")
    if folder is None:
        raise _missing("dukemtmc_reid", base, "DukeMTMC-reID/{bounding_box_train,query,"
                       "bounding_box_test}/")
    return _market_layout("dukemtmc_reid", folder,
                          {"train": 16522, "query": 2228, "gallery": 17661}, strict, transform,
                          skip_corrupt)


@register_dataset("cuhk03")
def load_cuhk03(root: str | os.PathLike | None = None, download: bool = False, *,
                variant: str = "detected", strict: bool = False, transform=None,
                skip_corrupt: bool = False) -> ReidDataset:
    """CUHK03 under the new protocol (Zhong et al., "Re-ranking Person Re-identification with
    k-reciprocal Encoding", CVPR 2017): 767 training / 700 test identities, 2 cameras.

    Reads the protocol's Market-style release ``cuhk03-np/{detected,labeled}/`` (``variant``).
    """
    if variant not in ("detected", "labeled"):
        raise ConfigError(f"cuhk03 variant must be 'detected' or 'labeled', got {variant!r}")
    base = _root(root)
    folder = _find_dir(base, [f"cuhk03-np/{variant}", f"cuhk03_np/{variant}", variant], "query")
    if folder is None:
        raise _missing("cuhk03", base, f"cuhk03-np/{variant}/{{bounding_box_train,query,"
                       "bounding_box_test}/")
    counts = ({"train": 7365, "query": 1400, "gallery": 5332} if variant == "detected"
              else {"train": 7368, "query": 1400, "gallery": 5328})
    ds = _market_layout("cuhk03", folder, counts, strict, transform, skip_corrupt)
    ds.meta["variant"] = variant
    return ds


def _read_list(path: Path) -> list[list[str]]:
    if not path.exists():
        raise DataNotFoundError(f"list file {path} not found: the dataset is incomplete")
    rows = [ln.split() for ln in path.read_text().splitlines() if ln.strip()]
    return rows


@register_dataset("msmt17")
def load_msmt17(root: str | os.PathLike | None = None, download: bool = False, *,
                include_val: bool = True, strict: bool = False, transform=None,
                skip_corrupt: bool = False) -> ReidDataset:
    """MSMT17 (Wei et al., "Person Transfer GAN", CVPR 2018): 4,101 identities, 15 cameras.

    ``list_*.txt`` lines are ``<id folder>/<file> <id>``; the camera is the third ``_`` field
    of the file name (``0000_000_01_0303morning_0015_0.jpg`` -> camera 0). ``include_val``
    adds ``list_val.txt`` to the training images (the usual practice; 32,621 in all).
    Test identities get ``+ MSMT17_TEST_OFFSET`` (see the module docstring).
    """
    base = _root(root)
    folder = _find_dir(base, ["MSMT17_V1", "MSMT17_V2", "MSMT17", "msmt17"], "list_query.txt")
    if folder is None:
        raise _missing("msmt17", base, "MSMT17_V1/{train,test}/ and list_{train,val,query,"
                       "gallery}.txt")
    v2 = (folder / "mask_train_v2").is_dir()
    train_dir = folder / ("mask_train_v2" if v2 else "train")
    test_dir = folder / ("mask_test_v2" if v2 else "test")
    names: dict[int, str] = {}

    def read(list_name: str, image_dir: Path, offset: int) -> list[tuple[Path, int, int]]:
        out = []
        for row in _read_list(folder / list_name):
            if len(row) != 2 or not row[1].lstrip("-").isdigit():
                raise DataError(f"{folder / list_name}: malformed line {' '.join(row)!r}")
            fields = Path(row[0]).name.split("_")
            if len(fields) < 3 or not fields[2].isdigit():
                raise DataError(f"{folder / list_name}: no camera field in {row[0]!r}")
            pid = int(row[1]) + offset
            names[pid] = f"{'test' if offset else 'train'}/{int(row[1]):04d}"
            out.append((image_dir / row[0], pid, int(fields[2]) - 1))
        return out

    train = read("list_train.txt", train_dir, 0)
    if include_val and (folder / "list_val.txt").exists():
        train += read("list_val.txt", train_dir, 0)
    parts = {"train": train, "query": read("list_query.txt", test_dir, MSMT17_TEST_OFFSET),
             "gallery": read("list_gallery.txt", test_dir, MSMT17_TEST_OFFSET)}
    for group, n in {"train": 32621 if include_val else 30248, "query": 11659,
                     "gallery": 82161}.items():
        _count_check("msmt17", f"{group} images", len(parts[group]), n, strict)
    return _build("msmt17", parts, folder, transform, skip_corrupt, names=names,
                  version="V2" if v2 else "V1")


@register_dataset("veri776")
def load_veri776(root: str | os.PathLike | None = None, download: bool = False, *,
                 strict: bool = False, transform=None, skip_corrupt: bool = False) -> ReidDataset:
    """VeRi-776 (Liu et al., "A Deep Learning-Based Approach to Progressive Vehicle
    Re-identification", ECCV 2016): 776 vehicles, 20 cameras.

    ``name_{train,query,test}.txt`` list the files of ``image_{train,query,test}/``; names
    ``VVVV_cCCC_FFFFFFFF_0.jpg``. The official junk rule (``jk_index.txt``: same vehicle, same
    camera) is the camera rule of :func:`dmlkit.apps.reid.evaluate_reid`.
    """
    base = _root(root)
    folder = _find_dir(base, ["VeRi", "VeRi-776", "veri776", "VeRi_with_plate"], "name_query.txt")
    if folder is None:
        raise _missing("veri776", base, "VeRi/{image_train,image_query,image_test}/ and "
                       "name_{train,query,test}.txt")
    parts: dict[str, list[tuple[Path, int, int]]] = {}
    for group, split in (("train", "train"), ("query", "query"), ("gallery", "test")):
        items = []
        for line, row in enumerate(_read_list(folder / f"name_{split}.txt"), 1):
            try:
                pid, cam = parse_reid_name(row[0])
            except DataError as exc:
                raise DataError(f"{folder / f'name_{split}.txt'}, entry {line}: {exc}") from None
            items.append((folder / f"image_{split}" / row[0], pid, cam))
        parts[group] = items
    for group, n in {"train": 37778, "query": 1678, "gallery": 11579}.items():
        _count_check("veri776", f"{group} images", len(parts[group]), n, strict)
    return _build("veri776", parts, folder, transform, skip_corrupt)


VEHICLEID_TEST_SIZES = (800, 1600, 2400)


@register_dataset("vehicleid")
def load_vehicleid(root: str | os.PathLike | None = None, download: bool = False, *,
                   test_size: int = 800, strict: bool = False, transform=None,
                   skip_corrupt: bool = False) -> ReidDataset:
    """PKU VehicleID (Liu et al., "Deep Relative Distance Learning", CVPR 2016): 26,267 vehicles.

    ``train_test_split/train_list.txt`` and ``test_list_{800,1600,2400}.txt`` hold lines
    ``<image name> <vehicle id>``; images are ``image/<image name>.jpg``. Sample groups
    ``train`` / ``test`` (``test_size`` identities); the query/gallery draw of the protocol is
    :func:`dmlkit.apps.reid.vehicleid_protocol`. No camera ids (all 0).
    """
    if test_size not in VEHICLEID_TEST_SIZES:
        raise ConfigError(f"vehicleid test_size must be one of {VEHICLEID_TEST_SIZES}, got "
                          f"{test_size}")
    base = _root(root)
    folder = _find_dir(base, ["VehicleID_V1.0", "VehicleID", "vehicleid"],
                       "train_test_split/train_list.txt")
    if folder is None:
        raise _missing("vehicleid", base, "VehicleID_V1.0/image/ and train_test_split/"
                       "{train_list,test_list_800,test_list_1600,test_list_2400}.txt")
    parts: dict[str, list[tuple[Path, int, int]]] = {}
    for group, list_name in (("train", "train_list.txt"), ("test", f"test_list_{test_size}.txt")):
        items = []
        for row in _read_list(folder / "train_test_split" / list_name):
            if len(row) != 2 or not row[1].isdigit():
                raise DataError(f"{list_name}: malformed line {' '.join(row)!r}")
            items.append((folder / "image" / f"{row[0]}.jpg", int(row[1]), 0))
        parts[group] = items
    n_ids = len({pid for _, pid, _ in parts["test"]})
    _count_check("vehicleid", "test identities", n_ids, test_size, strict)
    ds = _build("vehicleid", parts, folder, transform, skip_corrupt)
    ds.meta["test_size"] = test_size
    return ds


ATT_QUERY_PICTURES = (1, 6)


@register_dataset("att_faces_reid")
def load_att_faces_reid(root: str | os.PathLike | None = None, download: bool = False, *,
                        pictures_per_camera: int = 2,
                        query_pictures: Sequence[int] = ATT_QUERY_PICTURES, verify: bool = True,
                        transform=None, skip_corrupt: bool = False) -> ReidDataset:
    """AT&T / ORL faces viewed as a re-id set (a small offline stand-in for Market-1501).

    Identity = subject (1-20 train, 21-40 test, as ``att_faces``); camera = picture group
    ``(n - 1) // pictures_per_camera`` of picture ``n.pgm`` (default: 5 "cameras" of 2
    pictures); test pictures ``query_pictures`` (default 1 and 6, cameras 0 and 2) are the
    queries and the other 8 the gallery, so each query has one same-camera (junk) picture and
    7 positives. Train subjects' pictures are in group ``train``.
    """
    # integers: 2.5 gave 4 "cameras", [1.5, 6.7] pictures 1 and 6, "2,7" a traceback
    pictures_per_camera = check_integer(pictures_per_camera, "pictures_per_camera")
    if isinstance(query_pictures, str | bytes) or not isinstance(query_pictures, Sequence | np.ndarray):
        raise ConfigError(f"query_pictures must be a list of picture numbers 1..10, got {query_pictures!r}")
    queries = {check_integer(p, "each of query_pictures") for p in query_pictures}
    base = load_att_faces(root, verify=verify)
    if not queries or not queries <= set(range(1, 11)):
        raise ConfigError(f"query_pictures must be among 1..10, got {sorted(queries)}")
    parts: dict[str, list[tuple[Path, int, int]]] = {"train": [], "query": [], "gallery": []}
    for p, label in zip(base.paths, base.labels.tolist()):
        n = int(Path(p).stem)
        cam = (n - 1) // pictures_per_camera
        group = ("train" if base.class_groups[label] == "train"
                 else "query" if n in queries else "gallery")
        parts[group].append((Path(p), label, cam))
    ds = _build("att_faces_reid", parts, Path(base.meta["root"]), transform, skip_corrupt,
                names=dict(base.class_names), mode="L")
    return ds
