"""Dataset loaders with the standard layouts, file checks and helpful "where to put it" errors.

``load_dataset(name, root=None, download=False, **kw)`` returns a
:class:`~dmlkit.data.base.MetricDataset` with *every* class of the dataset; the class groups it
carries give the literature's split (:func:`dmlkit.data.default_split`).

| name | layout under ``root`` | classes (train / test) |
| --- | --- | --- |
| ``omniglot`` | ``omniglot/images_{background,evaluation}.npz`` or the official ``.zip`` files or ``omniglot-py/`` | 964 background / 659 evaluation |
| ``att_faces`` | ``att_faces/s1..s40/1..10.pgm`` | 1-20 / 21-40 |
| ``binary_alphadigits`` | ``binary_alphadigits/binaryalphadigs.mat`` | '0'..'H' / 'I'..'Z' (18 / 18) |
| ``cub200`` | ``CUB_200_2011/{images.txt,image_class_labels.txt,classes.txt,images/}`` | 1-100 / 101-200 |
| ``cars196`` | ``cars196/{cars_annos.mat,car_ims/}`` | 1-98 / 99-196 |
| ``sop`` | ``Stanford_Online_Products/{Ebay_train.txt,Ebay_test.txt,*_final/}`` | 11,318 / 11,316 |
| ``inshop`` | ``InShop/{list_eval_partition.txt or Eval/list_eval_partition.txt, img/}`` | 3,997 / 3,985 (query / gallery) |
| ``image_folder`` | ``root/<class>/<image>`` | first half / second half |
| ``lfw`` | ``lfw/<Name>/<Name>_0001.jpg`` (or a flat folder); pair lists: :mod:`dmlkit.data.pairs` | first half / second half |
| ``csv`` | a CSV file ``path,label[,split]`` | the split column, else halves |

``image_folder`` and ``csv`` live in :mod:`dmlkit.data.folders`.

``root`` defaults to :func:`dmlkit.utils.data_root` (``--data-root`` > ``$DMLKIT_DATA`` >
``~/.cache/dmlkit/data``).
"""

from __future__ import annotations

import csv as _csv
import io
import os
import platform
import re
import tarfile
import urllib.parse
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import numpy as np

from dmlkit.data.base import ArrayDataset, ImageFileDataset, MetricDataset
from dmlkit.exceptions import ConfigError, DataError, DataNotFoundError
from dmlkit.utils import data_root, one_line, sha256_file

__all__ = ["DATASETS", "IMAGE_EXTENSIONS", "canonical_dataset_name", "load_dataset", "register_dataset", "verify_sha256"]

#: The suffixes (any case) the image loaders read: what Pillow opens of common image files,
#: ``.jfif``/``.jpe`` (JPEGs as browsers and Windows save them) and ``.avif`` too (where Pillow reads it:
#: ``PIL.features.check("avif")``).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".bmp", ".pgm", ".ppm", ".pbm", ".pnm", ".tif",
                    ".tiff", ".webp", ".gif", ".avif")

DatasetFactory = Callable[..., MetricDataset]
DATASETS: dict[str, DatasetFactory] = {}


def register_dataset(name: str) -> Callable[[DatasetFactory], DatasetFactory]:
    """Decorator: make ``fn(root: Path | None, download: bool, **kw)`` loadable by ``name``."""

    def deco(fn: DatasetFactory) -> DatasetFactory:
        DATASETS[name] = fn
        return fn

    return deco


_ALIASES = {"cub": "cub200", "cub_200_2011": "cub200", "cars": "cars196",
            "stanford_online_products": "sop", "in_shop": "inshop", "att": "att_faces",
            "orl": "att_faces", "alphadigits": "binary_alphadigits", "folder": "image_folder"}


def canonical_dataset_name(name: str) -> str:
    """The registry key of dataset ``name``: lower case, ``-`` read as ``_``, an alias resolved
    (``"CUB-200-2011"`` and ``"cub"`` are ``"cub200"``); unknown names are returned so."""
    key = name.lower().replace("-", "_")
    return _ALIASES.get(key, key)


def load_dataset(name: str, root: str | os.PathLike | None = None, download: bool = False,
                 **kwargs: Any) -> MetricDataset:
    """Load dataset ``name`` (see the module table) with all its classes.

    ``root``: the data root holding the dataset folder (or the dataset folder itself); for
    ``image_folder`` the class-folder root, for ``csv`` the CSV file. ``download=True`` fetches
    missing files from the original source where one is public. Other keyword arguments go to
    the loader (``transform``, ``skip_corrupt``, ``verify``, ...).
    """
    key = canonical_dataset_name(name)
    if key not in DATASETS:
        raise ConfigError(f"unknown dataset {name!r}; choose one of {sorted(DATASETS)}")
    return DATASETS[key](root=root, download=download, **kwargs)


# -- helpers ---------------------------------------------------------------------------------
def _root(root: str | os.PathLike | None) -> Path:
    return data_root(root)


def _find_dir(root: Path, folder_names: Sequence[str], marker: str) -> Path | None:
    """The first of ``root/<name>`` or ``root`` that contains ``marker``."""
    for cand in [root / n for n in folder_names] + [root]:
        if (cand / marker).exists():
            return cand
    return None


def verify_sha256(path: Path, expected: str) -> None:
    """Raise :class:`DataError` if the SHA-256 of ``path`` is not ``expected``."""
    got = sha256_file(path)
    if got != expected.lower():
        raise DataError(
            f"checksum mismatch for {path}: SHA-256 {got}, expected {expected}. The file is "
            "corrupt or a different version: delete it and download it again"
        )


def _read_sha256sums(folder: Path) -> dict[str, str]:
    """``{relative path: sha256}`` from ``folder/SHA256SUMS`` (``sha256  ./path`` lines)."""
    sums = folder / "SHA256SUMS"
    if not sums.exists():
        return {}
    out: dict[str, str] = {}
    for line in sums.read_text().splitlines():
        parts = line.strip().split(maxsplit=1)
        if len(parts) == 2:
            out[os.path.normpath(parts[1].lstrip("*"))] = parts[0].lower()
    return out


def _verify_listed(folder: Path, relpaths: Iterable[str], published: dict[str, str]) -> None:
    """Check ``relpaths`` against checksums from ``folder/SHA256SUMS`` or ``published``."""
    sums = {**published, **_read_sha256sums(folder)}
    for rel in relpaths:
        key = os.path.normpath(rel)
        if key in sums:
            verify_sha256(folder / rel, sums[key])


def _count_check(name: str, what: str, found: int, expected: int, strict: bool) -> None:
    if found == expected:
        return
    msg = f"{name}: found {found:,} {what}, the official release has {expected:,}"
    if strict:
        raise DataError(msg + "; re-extract the archive (or pass strict=False to use a subset)")
    warnings.warn(msg + " (using what is there)", stacklevel=3)


#: The last sentence of a dataset's not-found message: where the data root comes from when no
#: config names one (:func:`dmlkit.training.data_root.load_dataset_at` replaces it where a
#: config's recorded ``data.root`` was used, so ``$DMLKIT_DATA`` did not apply).
DATA_ROOT_HINT = "Use --data-root / $DMLKIT_DATA to point at another data root."


def _missing(name: str, root: Path, expected: str, how: str) -> DataNotFoundError:
    # one line also for a data root holding a newline (printed as \n: one_line)
    return DataNotFoundError(one_line(f"{name} not found: expected {expected} under {root}. {how} {DATA_ROOT_HINT}"))


def _download(url: str, root: Path, md5: str | None = None, filename: str | None = None) -> None:
    """Download an archive into ``root`` with torchvision's ``download_url`` (needs internet;
    checked against ``md5`` when one is published) and extract it there with
    :func:`extract_archive`. torchvision's own extraction was used before: ``tarfile.extractall``
    with no filter, which wrote ``../`` and absolute members, and files through link members,
    outside ``root`` (a tampered archive on an ``http://`` URL)."""
    from torchvision.datasets.utils import download_url

    filename = filename or Path(urllib.parse.urlparse(url).path).name
    try:
        download_url(url, str(root), filename=filename, md5=md5)
    except Exception as exc:  # network errors come in many types
        raise DataNotFoundError(
            f"download of {url} failed ({type(exc).__name__}: {exc}); download it by hand and "
            f"extract it into {root}"
        ) from exc
    extract_archive(root / filename, root)


def extract_archive(archive: str | os.PathLike, root: str | os.PathLike) -> None:
    """Extract the tar (``.tar``, ``.tgz``, ...) or zip ``archive`` into ``root``. A member that
    would land outside ``root`` (an absolute or ``../`` name, a link pointing out of ``root``, a
    device) is one :class:`DataError` before anything is extracted. Tar files are extracted with
    Python's ``filter="data"`` (PEP 706: Python 3.11.4 or later; an older Python refuses to
    extract rather than extract unsafely); zip members are checked by name (``zipfile`` writes
    no links)."""
    archive, root = Path(archive), Path(root)
    is_zip = zipfile.is_zipfile(archive)
    if not is_zip and not hasattr(tarfile, "data_filter"):
        raise DataError(one_line(
            f"cannot extract {archive} safely: Python {platform.python_version()} has no tarfile "
            f"'data' filter (Python 3.11.4 or later has it): upgrade Python, or extract it into {root} by hand"))
    root.mkdir(parents=True, exist_ok=True)
    dest = root.resolve()
    escaped = f"{archive} holds a member that would be written outside {root}"
    refused = "; nothing was extracted: it is not the official archive, delete it"
    try:
        if is_zip:
            with zipfile.ZipFile(archive) as zf:
                bad = next((n for n in zf.namelist() if not _stays_inside(dest, n)), None)
                if bad is not None:
                    raise DataError(one_line(f"{escaped} ({bad!r}){refused}"))
                zf.extractall(root)
            return
        with tarfile.open(archive) as tar:
            members = tar.getmembers()
            for member in members:  # all checked before any is written
                try:
                    if not _stays_inside(dest, member.name):
                        raise DataError(one_line(f"{escaped} ({member.name!r}){refused}"))
                    tarfile.data_filter(member, str(dest))
                except tarfile.TarError as exc:  # FilterError: a link out of root, a device
                    raise DataError(one_line(f"{escaped} ({exc}){refused}")) from None
            tar.extractall(root, members=members, filter="data")  # checks each member again
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error) as exc:
        raise DataError(one_line(f"cannot extract {archive} ({exc}): delete it and download it again")) from None


def _stays_inside(dest: Path, name: str) -> bool:
    """Whether archive member ``name`` lands inside the resolved folder ``dest``: not absolute,
    no ``..`` part (``\\`` read as ``/``), and not through a link already in ``dest``."""
    parts = PurePosixPath(name.replace("\\", "/"))
    if parts.is_absolute() or ".." in parts.parts or PureWindowsPath(name).drive:
        return False
    return (dest / parts).resolve().is_relative_to(dest)


def _download_file(url: str, root: Path) -> None:
    """Download one file (no extraction) into ``root`` with torchvision's helper."""
    from torchvision.datasets.utils import download_url

    root.mkdir(parents=True, exist_ok=True)
    try:
        download_url(url, str(root))
    except Exception as exc:  # network errors come in many types
        raise DataNotFoundError(f"download of {url} failed: {exc}") from exc


def _groups_by_range(classes: Iterable[int], last_train: int) -> dict[int, str]:
    return {int(c): ("train" if int(c) <= last_train else "test") for c in classes}


TRAIN_TEST = {"train": "train", "val": "val", "test": "test"}


def _check_files(name: str, folder: Path, paths: Sequence[Path]) -> None:
    missing = [p for p in paths if not p.exists()]
    if missing:
        raise DataNotFoundError(
            f"{name}: {len(missing):,} of {len(paths):,} listed images are missing under "
            f"{folder}, e.g. {missing[0]}; extract the full archive again"
        )


# -- Omniglot --------------------------------------------------------------------------------
OMNIGLOT_SETS = ("background", "evaluation")
OMNIGLOT_NUM_CLASSES = {"background": 964, "evaluation": 659}
# Published checksums (GitHub bitsandscraps/omniglot *.sha256) and of the official zips.
OMNIGLOT_SHA256 = {
    "images_background.npz": "8bf84167413cd00beacdce3fe582f780ab538d8dbef043a6d688f2527bbce199",
    "images_evaluation.npz": "0b84c7ffd94c4841c0040e529c86a82eaaccb986d8eadad5673f7991b7475276",
}
OMNIGLOT_URL = "https://raw.githubusercontent.com/brendenlake/omniglot/master/python"
_OMNI_NAME = re.compile(r"images_(background|evaluation)/([^/]+)/(character\d+)/(\d+)_(\d+)\.png$")


def _omniglot_names(folder: Path) -> dict[int, str]:
    """``{class id: "Alphabet/characterNN"}`` from ``alphabets.csv`` (class id = global id - 1)."""
    path = folder / "alphabets.csv"
    names: dict[int, str] = {}
    if not path.exists():
        return names
    with open(path, newline="") as fh:
        for row in _csv.DictReader(fh):
            first, last = int(row["first_char_id"]), int(row["last_char_id"])
            for gid in range(first, last + 1):
                names[gid - 1] = f"{row['alphabet']}/character{gid - first + 1:02d}"
    return names


def _omniglot_from_png_entries(entries: Iterable[tuple[str, Callable[[], bytes]]]):
    from PIL import Image

    imgs, labels, names, sets = [], [], {}, {}
    for name, read in entries:
        m = _OMNI_NAME.search(name.replace("\\", "/"))
        if not m:
            continue
        which, alphabet, char, gid, _drawer = m.groups()
        cid = int(gid) - 1
        try:
            with Image.open(io.BytesIO(read())) as img:
                arr = np.asarray(img.convert("L")) >= 128  # True = background, as the npz
        except OSError as exc:
            raise DataError(f"cannot read Omniglot image {name}: {exc}") from exc
        imgs.append(arr)
        labels.append(cid)
        names[cid] = f"{alphabet}/{char}"
        sets[cid] = which
    return imgs, labels, names, sets


def _omniglot_read_zip(zpath: Path):
    """The PNGs of an official ``images_{set}.zip``, as :func:`_omniglot_from_png_entries`.

    A truncated or damaged zip (a partial download) is one :class:`DataError` naming it: it was
    ``zipfile.BadZipFile`` (no central directory) or ``zlib.error`` / a bad CRC (a cut member)."""

    try:
        with zipfile.ZipFile(zpath) as zf:
            members = sorted((n for n in zf.namelist() if n.endswith(".png")),
                             key=lambda n: n.rsplit("/", 1)[-1])  # by global id, drawer
            found = _omniglot_from_png_entries((n, (lambda n=n: zf.read(n))) for n in members)
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise DataError(f"{zpath} is not a complete zip file ({exc}): download "
                        f"{OMNIGLOT_URL}/{zpath.name} again") from None
    if not found[0]:  # else numpy's "need at least one array to stack"
        raise DataError(f"{zpath} holds no Omniglot PNGs: download {OMNIGLOT_URL}/{zpath.name} again")
    return found


@register_dataset("omniglot")
def load_omniglot(root: str | os.PathLike | None = None, download: bool = False, *,
                  sets: Sequence[str] = OMNIGLOT_SETS, source: str = "auto", verify: bool = True,
                  transform=None) -> ArrayDataset:
    """Omniglot (Lake, Salakhutdinov & Tenenbaum, Science 2015): 1,623 characters x 20 drawers.

    Class id = global character id - 1 (0..963 background, 964..1622 evaluation); class
    group ``background`` (train) / ``evaluation`` (test). Images are ``105 x 105`` uint8 with
    the ink white (255) on black (0). Sources, tried in this order with ``source="auto"``:
    ``images_{set}.npz`` (numpy copies, fastest), the official ``images_{set}.zip`` files,
    the extracted torchvision folder ``omniglot-py/images_{set}/``. ``download=True`` uses
    ``torchvision.datasets.Omniglot`` (original GitHub source).
    """
    base = _root(root)
    sets = tuple(sets)
    bad = set(sets) - set(OMNIGLOT_SETS)
    if bad or not sets:
        raise ConfigError(f"omniglot sets must be among {OMNIGLOT_SETS}, got {sets}")
    folder = _find_dir(base, ["omniglot"], f"images_{sets[0]}.npz") or \
        _find_dir(base, ["omniglot"], f"images_{sets[0]}.zip") or \
        _find_dir(base, ["omniglot"], f"omniglot-py/images_{sets[0]}") or \
        _find_dir(base, ["omniglot"], f"images_{sets[0]}")
    if folder is None and download:
        from torchvision.datasets import Omniglot

        target = base / "omniglot"
        for s in sets:
            try:
                Omniglot(str(target), background=(s == "background"), download=True)
            except Exception as exc:  # network errors come in many types
                raise DataNotFoundError(
                    f"Omniglot download failed ({type(exc).__name__}: {exc}); download "
                    f"{OMNIGLOT_URL}/images_{s}.zip by hand into {target}"
                ) from exc
        folder = target
    if folder is None:
        raise _missing(
            "omniglot", base, "omniglot/images_background.npz + images_evaluation.npz, or the "
            "official omniglot/images_background.zip + images_evaluation.zip",
            f"Download {OMNIGLOT_URL}/images_background.zip and images_evaluation.zip into "
            f"{base / 'omniglot'} (or pass download=True).",
        )
    names = _omniglot_names(folder)
    all_imgs: list[np.ndarray] = []
    all_labels: list[np.ndarray] = []
    groups: dict[int, str] = {}
    used: list[str] = []
    for s in sets:
        npz, zpath = folder / f"images_{s}.npz", folder / f"images_{s}.zip"
        dirs = [folder / "omniglot-py" / f"images_{s}", folder / f"images_{s}"]
        offset = 0 if s == "background" else OMNIGLOT_NUM_CLASSES["background"]
        if source in ("auto", "npz") and npz.exists():
            if verify:
                _verify_listed(folder, [npz.name], OMNIGLOT_SHA256)
            with np.load(npz) as d:
                images, labels = d["images"], d["labels"]
            if images.ndim != 4 or images.shape[1:] != (20, 105, 105):
                raise DataError(f"{npz}: expected images (C, 20, 105, 105), got {images.shape}")
            imgs = images.reshape(-1, 105, 105)
            lab = labels.reshape(-1).astype(np.int64) + offset
            for c in np.unique(lab).tolist():
                groups[c] = s
            used.append(npz.name)
        elif source in ("auto", "zip") and zpath.exists():
            if verify:
                _verify_listed(folder, [zpath.name], {})
            lst, labs, nm, st = _omniglot_read_zip(zpath)
            imgs, lab = np.stack(lst), np.asarray(labs, dtype=np.int64)
            names.update(nm)
            groups.update(st)
            used.append(zpath.name)
        elif source in ("auto", "folder") and any(d.is_dir() for d in dirs):
            d = next(d for d in dirs if d.is_dir())
            files = sorted(d.rglob("*.png"), key=lambda f: f.name)
            lst, labs, nm, st = _omniglot_from_png_entries(
                (f"images_{s}/" + f.relative_to(d).as_posix(), f.read_bytes) for f in files)
            if not lst:
                raise DataError(f"no Omniglot PNGs found in {d}")
            imgs, lab = np.stack(lst), np.asarray(labs, dtype=np.int64)
            names.update(nm)
            groups.update(st)
            used.append(str(d.relative_to(folder)))
        else:
            raise _missing(
                "omniglot", folder,
                f"images_{s}.npz, images_{s}.zip or omniglot-py/images_{s}/ (source={source!r})",
                f"Download {OMNIGLOT_URL}/images_{s}.zip into {folder} (or pass download=True).",
            )
        n_classes = np.unique(lab).size
        if n_classes != OMNIGLOT_NUM_CLASSES[s] or lab.size != 20 * n_classes:
            raise DataError(
                f"omniglot {s}: found {n_classes} classes / {lab.size} images, expected "
                f"{OMNIGLOT_NUM_CLASSES[s]} x 20; the files are incomplete: download them again"
            )
        all_imgs.append(imgs)
        all_labels.append(lab)
    data = all_imgs[0] if len(all_imgs) == 1 else np.concatenate(all_imgs)
    labels = np.concatenate(all_labels)
    return ArrayDataset(
        data, labels, kind="image", invert=True, class_names=names, class_groups=groups,
        split_groups={"train": "background", "test": "evaluation"}, transform=transform,
        name="omniglot", meta={"root": str(folder), "files": used, "ink": "white on black"},
    )


# -- AT&T faces ------------------------------------------------------------------------------
@register_dataset("att_faces")
def load_att_faces(root: str | os.PathLike | None = None, download: bool = False, *,
                   verify: bool = True, strict: bool = True, transform=None,
                   skip_corrupt: bool = False) -> ImageFileDataset:
    """AT&T / ORL faces (Samaria & Harter 1994): 40 subjects x 10 grayscale 92 x 112 PGMs.

    Class id = subject number (1..40); subjects 1-20 train, 21-40 test. Images load in PIL
    mode ``"L"`` (the ``imagenet`` transforms convert to RGB). Files listed in the folder's
    ``SHA256SUMS`` are checked when ``verify=True``.
    """
    base = _root(root)
    folder = _find_dir(base, ["att_faces", "orl_faces"], "s1")
    how = ("The database is no longer on AT&T's site; copies are redistributed for research "
           "(see its README); put the folders s1..s40 with 1.pgm..10.pgm in "
           f"{base / 'att_faces'}.")
    if folder is None:
        raise _missing("att_faces", base, "att_faces/s1/1.pgm ... att_faces/s40/10.pgm", how)
    paths, labels = [], []
    for subject in range(1, 41):
        for i in range(1, 11):
            p = folder / f"s{subject}" / f"{i}.pgm"
            if p.exists():
                paths.append(p)
                labels.append(subject)
    _count_check("att_faces", "images", len(paths), 400, strict)
    if not paths:
        raise _missing("att_faces", folder, "s1/1.pgm ... s40/10.pgm", how)
    if verify:
        _verify_listed(folder, [str(p.relative_to(folder)) for p in paths], {})
    return ImageFileDataset(
        paths, labels, mode="L", class_names={s: f"s{s}" for s in range(1, 41)},
        class_groups=_groups_by_range(range(1, 41), 20), split_groups=TRAIN_TEST,
        transform=transform, name="att_faces", skip_corrupt=skip_corrupt,
        meta={"root": str(folder)},
    )


# -- Binary Alphadigits ------------------------------------------------------------------------
ALPHADIGITS_SHA256 = "3ee9392e64e4e3bb7b35502b69bf2555a0b4197c1b31048c4189b84bc0bc6ea7"
ALPHADIGITS_URL = "https://cs.nyu.edu/~roweis/data/binaryalphadigs.mat"


@register_dataset("binary_alphadigits")
def load_binary_alphadigits(root: str | os.PathLike | None = None, download: bool = False, *,
                            verify: bool = True, transform=None) -> ArrayDataset:
    """Binary Alphadigits (Roweis): 36 classes ('0'-'9', 'A'-'Z') x 39 images of 20 x 16.

    Class id 0..35 in the file's order; classes 0-17 train, 18-35 test (18 / 18). Pixels are
    uint8 0 / 255 (ink white).
    """
    import scipy.io

    base = _root(root)
    folder = _find_dir(base, ["binary_alphadigits"], "binaryalphadigs.mat")
    if folder is None and download:
        target = base / "binary_alphadigits"
        _download_file(ALPHADIGITS_URL, target)
        folder = target
    if folder is None:
        raise _missing("binary_alphadigits", base, "binary_alphadigits/binaryalphadigs.mat",
                       f"Download {ALPHADIGITS_URL} into {base / 'binary_alphadigits'}.")
    path = folder / "binaryalphadigs.mat"
    if verify:
        verify_sha256(path, ALPHADIGITS_SHA256)
    m = scipy.io.loadmat(path)
    dat = m["dat"]
    n_cls, n_per = dat.shape
    images = np.stack([np.asarray(dat[c, k]) > 0 for c in range(n_cls) for k in range(n_per)])
    labels = np.repeat(np.arange(n_cls, dtype=np.int64), n_per)
    names = {c: str(np.asarray(m["classlabels"][0, c]).reshape(-1)[0]) for c in range(n_cls)}
    return ArrayDataset(
        images, labels, kind="image", class_names=names,
        class_groups=_groups_by_range(range(n_cls), n_cls // 2 - 1), split_groups=TRAIN_TEST,
        transform=transform, name="binary_alphadigits", meta={"root": str(folder)},
    )
