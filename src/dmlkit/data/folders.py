"""The generic loaders of one's own images: ``image_folder`` (one sub-folder per class) and
``csv`` (a file listing ``path,label[,split]``), registered with :func:`~dmlkit.data.load_dataset`.

Both follow one rule for the files they list: **a file is one image**, however it is reached
(``a.png``, ``./a.png``, ``x/../a.png``, a symbolic link to it, a folder linked into two classes).
A file reached twice is a :class:`~dmlkit.exceptions.DataError` naming both spellings: it
became two items, and each query found its own copy as a positive (one link in a 9-image
folder read P@1 0.800 instead of 0.778); under two classes it was also two labels of one image.

``image_folder`` also says what it leaves out, in one warning line each: files in class
folders whose suffix is not an image extension (``.heic``, notes), and images lying directly
in the root, in no class folder.
"""

from __future__ import annotations

import csv as _csv
import io
import os
import re
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dmlkit.data.base import ImageFileDataset
from dmlkit.data.datasets import IMAGE_EXTENSIONS, TRAIN_TEST, _check_files, register_dataset
from dmlkit.exceptions import ConfigError, DataError, DataNotFoundError
from dmlkit.label_text import clean_labels, integer_ids
from dmlkit.utils import read_utf8_text

__all__ = ["load_csv", "load_image_folder"]

#: Windows' own files (hidden there, not dot-named): no images, and no reason to warn.
_SYSTEM_FILES = frozenset({"thumbs.db", "desktop.ini"})


def _hidden(name: str) -> bool:
    """A dot entry (``.DS_Store``, ``.ipynb_checkpoints``, macOS ``._x.jpg``) or a Windows
    system file: never an image, at any level."""
    return name.startswith(".") or name.lower() in _SYSTEM_FILES


@dataclass
class _ClassFiles:
    """What one walk of a class folder found: its images, and the files left out for their suffix."""

    images: list[Path] = field(default_factory=list)
    other: list[Path] = field(default_factory=list)


@register_dataset("image_folder")
def load_image_folder(root: str | os.PathLike | None = None, download: bool = False, *,
                      path: str | os.PathLike | None = None, mode: str | None = "RGB",
                      extensions: Sequence[str] = IMAGE_EXTENSIONS, transform=None,
                      skip_corrupt: bool = False) -> ImageFileDataset:
    """One sub-folder per class (``root/<class>/**/<image>``), as torchvision's ImageFolder.

    Class ids 0..C-1 follow the sorted folder names (``ds.class_names`` maps them back); a
    folder without images is no class (skipped with a warning naming it). Files with another
    suffix than ``extensions`` and images directly in ``root`` are skipped with a warning
    (count and an example); an image file reached twice is a :class:`DataError` (module
    docstring). No class groups: :func:`default_split` uses the first / second half of the
    class order.
    """
    folder = Path(path or root or "")
    if not str(path or root or "") or not folder.is_dir():
        raise DataNotFoundError(
            f"image_folder: folder {folder} not found; pass root=<folder> with one sub-folder "
            "per class holding its images"
        )
    if isinstance(extensions, str) or not all(isinstance(e, str) for e in extensions):
        raise ConfigError(f"image_folder: extensions must be a list of suffixes like ['.png', '.jpg'], "
                          f"got {extensions!r}")
    exts = tuple(e.lower() if e.startswith(".") else f".{e.lower()}" for e in extensions)
    entries = sorted(e for e in folder.iterdir() if not _hidden(e.name))
    paths, labels, names, empty, other = [], [], {}, [], []
    for d in (e for e in entries if e.is_dir()):
        found = _class_images(d, exts)
        other += found.other
        if not found.images:  # a class id of its own left a gap: ids not 0..C-1, C one too many
            empty.append(d.name)
            continue
        cid = len(names)
        names[cid] = d.name
        paths.extend(sorted(found.images))
        labels.extend([cid] * len(found.images))
    if not paths:
        raise DataNotFoundError(
            f"image_folder: no images ({', '.join(exts)}) in class sub-folders of {folder}"
        )
    _refuse_repeated_images(folder, paths, labels)
    tag = f"image_folder:{folder.name}"
    if empty:
        shown = ", ".join(repr(n) for n in empty[:5]) + (" ..." if len(empty) > 5 else "")
        warnings.warn(f"{tag}: skipped {len(empty)} class folder(s) without images "
                      f"({', '.join(exts)}): {shown}", stacklevel=2)
    loose = [e for e in entries if e.suffix.lower() in exts and e.is_file()]
    _warn_left_out(tag, folder, other, loose)
    return ImageFileDataset(paths, labels, mode=mode, class_names=names, transform=transform,
                            name=tag, skip_corrupt=skip_corrupt, meta={"root": str(folder)})


def _class_images(folder: Path, exts: tuple[str, ...]) -> _ClassFiles:
    """The files under one class folder, at any depth, by suffix: hidden entries skipped at
    every level, symlinked sub-folders followed (a real folder once per class: a link back up
    the tree would never end)."""
    found, seen = _ClassFiles(), set()
    for top, dirs, files in os.walk(folder, followlinks=True):
        real = os.path.realpath(top)
        if real in seen:  # a link back up the tree
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = [d for d in dirs if not _hidden(d)]
        for f in files:
            if not _hidden(f):
                (found.images if Path(f).suffix.lower() in exts else found.other).append(Path(top) / f)
    return found


def _warn_left_out(tag: str, folder: Path, other: Sequence[Path], loose: Sequence[Path]) -> None:
    """One warning line for the files of class folders skipped for their suffix, and one for the
    images directly in the root: both were dropped without a word (a ``.jfif`` download, a photo
    not yet sorted into its class)."""
    if other:
        suffixes = Counter(p.suffix.lower() or "(none)" for p in other)
        common = ", ".join(f"{s} x{n}" for s, n in suffixes.most_common(5))
        warnings.warn(f"{tag}: skipped {len(other)} file(s) in class folders whose suffix is not an image extension "
                      f"({common}), e.g. {other[0].relative_to(folder)}; if they are images Pillow reads, add "
                      "their suffix to data.options.extensions (extensions=[...] in Python)", stacklevel=3)
    if loose:
        warnings.warn(f"{tag}: skipped {len(loose)} image(s) lying directly in {folder}, in no class folder, "
                      f"e.g. {loose[0].name}: move each into its class's sub-folder", stacklevel=3)


def _real_files(paths: Sequence[Path]) -> list[str]:
    """Each path's file, as :func:`os.path.realpath` names it (links and ``..`` resolved, case
    folded where the file system is), with one ``lstat`` per file: each folder resolved once."""
    folders: dict[str, str] = {}
    out = []
    for p in paths:
        parent, name = os.path.split(os.fspath(p))
        if parent not in folders:
            folders[parent] = os.path.realpath(parent or ".")
        full = os.path.join(folders[parent], name)
        out.append(os.path.normcase(os.path.realpath(full) if os.path.islink(full) else full))
    return out


def _repeats(paths: Sequence[Path]) -> Iterator[tuple[int, int]]:
    """``(i, j)`` for each path ``i`` naming the file of an earlier path ``j``."""
    first: dict[str, int] = {}
    for i, real in enumerate(_real_files(paths)):
        j = first.setdefault(real, i)
        if j != i:
            yield i, j


def _refuse_repeated_images(folder: Path, paths: Sequence[Path], labels: Sequence[int]) -> None:
    """An image folder reaching one file twice (a link beside it, two class folders linking
    one folder): a :class:`DataError` naming both spellings (of two classes, where one is)
    and how many there are."""
    found = sorted(_repeats(paths), key=lambda ij: labels[ij[0]] == labels[ij[1]])  # two classes first
    if found:
        i, j = found[0]
        where = "twice" if labels[i] == labels[j] else "in two classes"
        raise DataError(f"image_folder:{folder.name}: {len(found)} image file(s) are reached {where}, e.g. "
                        f"{paths[i].relative_to(folder)} is {paths[j].relative_to(folder)} (a symbolic link or a "
                        "folder linked twice): a copy is found as its own positive; remove the link (each image once)")


@register_dataset("csv")
def load_csv(root: str | os.PathLike | None = None, download: bool = False, *,
             path: str | os.PathLike | None = None, image_root: str | os.PathLike | None = None,
             mode: str | None = "RGB", transform=None, skip_corrupt: bool = False) -> ImageFileDataset:
    """A CSV with a header and columns ``path,label[,split]``.

    Relative paths are resolved against ``image_root`` (default: the CSV's folder). Labels
    lose the whitespace around them (two that differ only in it are refused:
    :func:`dmlkit.label_text.clean_labels`); integer labels (``-?[0-9]+``) are kept as class ids
    unless two different labels read as one integer (``1`` and ``01``: then all are names,
    :func:`dmlkit.label_text.integer_ids`); other labels get ids 0..C-1 in sorted order. A ``split``
    column (``train`` / ``val`` / ``test`` per class, or ``query`` / ``gallery`` per sample)
    defines the default split; a class listed under two of train/val/test is an error, and so
    is an image listed twice, under any spelling or through a link (the error names both lines).
    """
    csv_path = Path(path or root or "")
    if not str(path or root or "") or not csv_path.is_file():
        raise DataNotFoundError(
            f"csv: file {csv_path} not found; pass root=<file.csv> with a header line "
            "'path,label[,split]'"
        )
    base = Path(image_root) if image_root is not None else csv_path.parent
    fields, rows, lines, raw = _read_csv_rows(csv_path)
    raw_labels = clean_labels(raw, str(csv_path), lines)
    unlabelled = [i for i, s in enumerate(raw_labels) if not s]
    if unlabelled:  # else one class named "" of unrelated images
        where = ", ".join(str(lines[i]) for i in unlabelled[:10])
        raise DataError(f"{csv_path}: {len(unlabelled)} row(s) have no label (line(s) {where}): "
                        "give every image its class")
    ids = integer_ids(raw_labels, [int(s) if re.fullmatch(r"-?\d+", s) else None for s in raw_labels])
    if ids is not None:
        labels = ids
        names = {c: str(c) for c in set(labels)}
    else:
        uniq = sorted(set(raw_labels))
        ids = {s: i for i, s in enumerate(uniq)}
        labels = [ids[s] for s in raw_labels]
        names = {i: s for s, i in ids.items()}
    paths = [Path(r["path"]) if Path(r["path"]).is_absolute() else base / r["path"] for r in rows]
    _refuse_repeated_paths(csv_path, rows, paths, lines)
    _check_files("csv", base, paths)
    class_groups: dict[int, str] = {}
    sample_groups = None
    meta: dict[str, Any] = {"root": str(base)}
    if "split" in fields and any(r.get("split") for r in rows):
        splits = [r.get("split", "").lower() for r in rows]
        for c, s in zip(labels, splits):
            g = "test" if s in ("query", "gallery") else s
            if g not in ("train", "val", "test"):
                raise DataError(f"{csv_path}: split must be train/val/test/query/gallery, got {s!r}")
            if class_groups.setdefault(c, g) != g:
                raise DataError(
                    f"{csv_path}: class {names[c]!r} appears in both {class_groups[c]} and {g}; "
                    "splits must be class-disjoint"
                )
        if any(s in ("query", "gallery") for s in splits):
            sample_groups = splits
        meta["split_column"] = sorted(set(splits))  # default_split refuses one without train or test
    return ImageFileDataset(
        paths, labels, mode=mode, class_names=names, class_groups=class_groups,
        split_groups=TRAIN_TEST, sample_groups=sample_groups, transform=transform,
        name=f"csv:{csv_path.stem}", skip_corrupt=skip_corrupt, meta=meta,
    )


def _read_csv_rows(csv_path: Path) -> tuple[list[str], list[dict[str, str]], list[int], list[str]]:
    """A dataset CSV's ``(columns, rows, lines, raw labels)``: the lower-cased header, each row
    ``{column: stripped value}``, each row's last line in the file (blank lines counted) and its
    label as written (:func:`dmlkit.label_text.clean_labels` strips it, refusing a merge). A file
    that is not UTF-8 (Excel's plain "CSV" on Windows) is one :class:`DataError` line."""
    text = read_utf8_text(csv_path, 'save it as "CSV UTF-8" (Excel: Save As, "CSV UTF-8 (Comma '
                                    'delimited)") and load it again')
    reader = _csv.DictReader(io.StringIO(text, newline=""))
    fields = [f.strip().lower() for f in (reader.fieldnames or [])]
    if "path" not in fields or "label" not in fields:
        raise DataError(f"{csv_path}: the header must name columns 'path' and 'label' "
                        f"(and optionally 'split'), got {reader.fieldnames}")
    rows, lines, raw = [], [], []
    for r in reader:
        row = {k.strip().lower(): v or "" for k, v in r.items() if k}
        raw.append(row["label"])
        rows.append({k: v.strip() for k, v in row.items()})
        lines.append(reader.line_num)
    if not rows:
        raise DataError(f"{csv_path}: no rows")
    return fields, rows, lines, raw


def _refuse_repeated_paths(csv_path: Path, rows: Sequence[dict[str, str]], paths: Sequence[Path],
                           lines: Sequence[int]) -> None:
    """Refuse a CSV that lists one image twice (``a.png`` and ``./a.png``, or a link to it): it
    became two items, and a query found its own copy as a positive."""
    repeat = next(_repeats(paths), None)
    if repeat is not None:
        i, j = repeat
        raise DataError(f"{csv_path}: line {lines[i]} lists {rows[i]['path']!r}, the image of line "
                        f"{lines[j]} ({rows[j]['path']!r}) again: list each image once")
