"""Official verification pair lists: LFW ``pairs.txt`` and plain CSV pair files.

Face-verification benchmarks score a model on a *fixed* list of image pairs rather than on
random ones. Two formats are read:

* **LFW** (Huang, Ramesh, Berg & Learned-Miller, "Labeled Faces in the Wild", UMass TR 07-49,
  2007; the file format of ``pairs.txt`` / ``pairsDevTrain.txt`` / ``pairsDevTest.txt``). The
  first line is ``F N`` (``F`` folds of ``N`` matched then ``N`` mismatched pairs; the
  standard ``pairs.txt`` is ``10 300``) or just ``N`` (one fold: the development view).
  Matched lines are ``name n1 n2``, mismatched lines ``name1 n1 name2 n2``; image ``n`` of
  ``name`` is the file ``<name>/<name>_<nnnn>.jpg`` (four digits) under the image folder, or
  ``<name>_<nnnn>.jpg`` directly in it (any image extension of
  :data:`dmlkit.data.IMAGE_EXTENSIONS`, in any case). CALFW/CPLFW-style lists in the same format work too.
* **CSV**: ``path1,path2,same[,fold]`` with or without that header; ``same`` is
  ``1``/``0``, ``true``/``false`` or ``yes``/``no``; relative paths are resolved against the
  image folder (default: the CSV's folder). Without a ``fold`` column the list has no folds
  (:func:`dmlkit.apps.verification.verify_pair_list` then deals pairs into stratified folds).

Pairs that name a missing image are refused with a :class:`~dmlkit.exceptions.DataNotFoundError`
listing them: dropping them silently would change the benchmark. A pair of an image with itself
and a pair listed twice (in either order) are a :class:`~dmlkit.exceptions.DataError` naming
their lines: both inflate the accuracy (LFW's own lists hold neither).
"""

from __future__ import annotations

import csv as _csv
import glob
import io
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dmlkit.data.base import ImageFileDataset
from dmlkit.data.datasets import IMAGE_EXTENSIONS, register_dataset
from dmlkit.exceptions import DataError, DataNotFoundError
from dmlkit.utils import data_root, read_utf8_text

__all__ = [
    "LfwPair",
    "PairList",
    "find_lfw_image",
    "lfw_folder",
    "lfw_identity",
    "load_lfw",
    "load_pair_list",
    "parse_lfw_pairs",
    "read_pair_csv",
    "resolve_lfw_pairs",
]

_TRUE = {"1", "true", "yes", "same", "match", "matched"}
_FALSE = {"0", "false", "no", "different", "mismatch", "mismatched"}
_LFW_FILE = re.compile(r"^(?P<name>.+)_(?P<num>\d{4})$")


@dataclass(frozen=True)
class LfwPair:
    """One line of an LFW pair list: image ``num1`` of ``name1`` and ``num2`` of ``name2``."""

    name1: str
    num1: int
    name2: str
    num2: int
    fold: int
    line: int

    @property
    def same(self) -> bool:
        return self.name1 == self.name2


@dataclass(frozen=True)
class PairList:
    """Resolved pairs: ``paths[left[p]]`` and ``paths[right[p]]`` form pair ``p``.

    ``paths`` holds each image once (first-appearance order), ``same`` (bool) says whether a
    pair shows one identity, ``folds`` (int64, ``0..num_folds-1``) is the list's own fold of
    each pair or ``None`` when the file defines none (a CSV without a ``fold`` column, a
    one-fold LFW list). A CSV ``fold`` column holding one value gives one fold, which
    :func:`dmlkit.apps.verification.verify_pair_list` refuses: it cannot be cross-validated.
    """

    paths: list[str]
    left: np.ndarray
    right: np.ndarray
    same: np.ndarray
    folds: np.ndarray | None
    source: str

    def __len__(self) -> int:
        return int(self.same.shape[0])

    @property
    def num_folds(self) -> int:
        return 0 if self.folds is None else int(self.folds.max()) + 1

    @classmethod
    def from_path_pairs(cls, path1: Sequence[str], path2: Sequence[str], same: Sequence[bool],
                        folds: Sequence[int] | None, source: str, *,
                        lines: Sequence[int] | None = None) -> PairList:
        """Build from two path columns (paths are deduplicated into :attr:`paths`).

        A pair of an image with itself, or a pair listed again (in either order), is a
        :class:`DataError` naming them by ``lines`` (the file's line of each pair) or, without
        ``lines``, by their 0-based positions: such pairs inflate the accuracy (a self pair is a
        trivial match, a repeat is scored twice and may sit in two folds). Two spellings of one
        file (``a.png``, ``x/../a.png``, a symbolic link) are one image."""
        index: dict[str, int] = {}
        left = np.fromiter((index.setdefault(p, len(index)) for p in path1), np.int64, len(path1))
        right = np.fromiter((index.setdefault(p, len(index)) for p in path2), np.int64, len(path2))
        files: dict[str, int] = {}  # each path's file, as verify_pair_list matches them (_match_rows)
        file_of = np.fromiter((files.setdefault(os.path.normcase(os.path.realpath(p)), len(files)) for p in index),
                              np.int64, len(index))
        _refuse_repeated_pairs(file_of[left], file_of[right], source, lines)
        fold_arr = None if folds is None else np.asarray(folds, dtype=np.int64)
        if fold_arr is not None:
            uniq = np.unique(fold_arr)
            fold_arr = np.searchsorted(uniq, fold_arr).astype(np.int64)  # renumber 0..F-1
        return cls(list(index), left, right, np.asarray(same, dtype=bool), fold_arr, source)


def parse_lfw_pairs(path: str | os.PathLike) -> list[LfwPair]:
    """The pairs of an LFW-format list, in file order, with their fold (0-based).

    Header ``F N``: pair ``k`` (0-based, counting pair lines only) is in fold ``k // (2N)``;
    header ``N``: one fold of ``2N`` pairs. Each fold lists its ``N`` matched pairs (three
    fields, ``name n1 n2``) then its ``N`` mismatched pairs (four fields, two different names).
    Raises :class:`DataError` naming the line for anything else, when the number of pairs
    disagrees with the header, and where a fold breaks that layout (a matched line among the
    mismatched ones, say): fold ids come from line positions, so such a list would score its
    pairs in other folds than its author meant, silently.
    """
    p = Path(path)
    if not p.is_file():
        raise DataNotFoundError(f"pair list not found: {p}; pass LFW's pairs.txt or a CSV path1,path2,same")
    # utf-8-sig: a byte-order mark is not part of the header (it made '10 300' unreadable)
    lines = [(k + 1, ln.split()) for k, ln in enumerate(p.read_text(encoding="utf-8-sig").splitlines())]
    lines = [(k, f) for k, f in lines if f]
    if not lines:
        raise DataError(f"{p}: empty pair list")
    head_line, head = lines[0]
    if not all(h.isdigit() for h in head) or len(head) not in (1, 2):
        raise DataError(
            f"{p}:{head_line}: the first line of an LFW pair list is 'FOLDS PAIRS_PER_FOLD' "
            f"(e.g. '10 300') or 'PAIRS' (one fold), got {' '.join(head)!r}; for other lists "
            "use a CSV with columns path1,path2,same"
        )
    folds, per = (1, int(head[0])) if len(head) == 1 else (int(head[0]), int(head[1]))
    if folds < 1 or per < 1:
        raise DataError(f"{p}:{head_line}: folds and pairs per fold must be positive, got {head}")
    body = lines[1:]
    if len(body) != 2 * folds * per:
        raise DataError(
            f"{p}: the header announces {folds} fold(s) of {per} matched + {per} mismatched "
            f"pairs = {2 * folds * per} lines, but the file has {len(body)} pair lines"
        )
    pairs: list[LfwPair] = []
    for k, (line_no, f) in enumerate(body):
        fold = k // (2 * per)
        try:
            if len(f) == 3:
                pair = LfwPair(f[0], int(f[1]), f[0], int(f[2]), fold, line_no)
            elif len(f) == 4:
                if f[0] == f[2]:
                    raise DataError(f"{p}:{line_no}: a mismatched pair names one person twice ({f[0]})")
                pair = LfwPair(f[0], int(f[1]), f[2], int(f[3]), fold, line_no)
            else:
                raise ValueError
        except ValueError as exc:
            raise DataError(
                f"{p}:{line_no}: expected 'name n1 n2' (matched) or 'name1 n1 name2 n2' "
                f"(mismatched), got {' '.join(f)!r}"
            ) from exc
        matched = k % (2 * per) < per
        if pair.same != matched:
            raise DataError(
                f"{p}:{line_no}: a {'mismatched' if matched else 'matched'} pair where the header's "
                f"layout puts a {'matched' if matched else 'mismatched'} one (each of the {folds} "
                f"fold(s) lists {per} matched pairs 'name n1 n2', then {per} mismatched pairs "
                f"'name1 n1 name2 n2'; this is pair {k % (2 * per) + 1} of fold {fold + 1})"
            )
        pairs.append(pair)
    return pairs


def lfw_folder(root: str | os.PathLike) -> Path:
    """The folder holding LFW's person folders: ``root/lfw`` if it exists, else ``root``."""
    base = Path(root)
    for name in ("lfw", "lfw-deepfunneled", "lfw_funneled", "lfw-funneled"):
        if (base / name).is_dir():
            return base / name
    if not base.is_dir():
        raise DataNotFoundError(
            f"LFW image folder {base} not found: pass the folder holding <Name>/<Name>_0001.jpg "
            "(from the LFW archive lfw.tgz) or a folder of <Name>_0001.jpg files"
        )
    return base


def find_lfw_image(folder: Path, name: str, number: int) -> Path | None:
    """``folder/<name>/<name>_<nnnn>.<ext>`` or ``folder/<name>_<nnnn>.<ext>``, else ``None``.

    ``<ext>`` is matched in any case (``.JPG``, ``.Png``), as :func:`load_lfw` reads the files:
    the pair list named images the dataset had loaded "missing". The lower-case names are tried
    first (one ``stat`` each); only then is the folder listed for the stem."""
    stem = f"{name}_{number:04d}"
    for d in (folder / name, folder):
        for ext in IMAGE_EXTENSIONS:
            candidate = d / f"{stem}{ext}"
            if candidate.is_file():
                return candidate
        for candidate in sorted(d.glob(f"{glob.escape(stem)}.*")):
            if candidate.suffix.lower() in IMAGE_EXTENSIONS and candidate.is_file():
                return candidate
    return None


def _first_20(items: list[str]) -> str:
    """``items`` joined by ``; ``, the first 20 then a count of the rest."""
    more = f"; ... and {len(items) - 20} more" if len(items) > 20 else ""
    return "; ".join(items[:20]) + more


def _refuse_missing(missing: list[str], total: int, source: str, where: Path) -> None:
    if missing:
        raise DataNotFoundError(
            f"{source}: {len(missing)} of {total} pairs name images missing under {where} "
            f"(pass the image folder the list was made for; no pair is dropped): {_first_20(missing)}"
        )


def _refuse_repeated_pairs(left: np.ndarray, right: np.ndarray, source: str,
                           lines: Sequence[int] | None = None) -> None:
    """A :class:`DataError` listing the pairs of an image with itself (``left == right``) and the
    pairs that repeat an earlier one in either order, by ``lines`` (one per pair) or, without
    them, by 0-based pair position. Random pairs are drawn distinct (``make_pairs``); a fixed
    list holding such pairs would be scored with a trivial match, or one pair twice (in two
    folds, perhaps: its threshold then chosen on itself), inflating the accuracy."""
    def name(k: int) -> str:
        return f"line {lines[k]}" if lines is not None else f"pair {k}"

    selfs: list[str] = []
    repeats: list[str] = []
    first: dict[tuple[int, int], int] = {}
    for k, (a, b) in enumerate(zip(left.tolist(), right.tolist())):
        if a == b:
            selfs.append(name(k))
            continue
        j = first.setdefault((min(a, b), max(a, b)), k)
        if j != k:
            repeats.append(f"{name(k)} repeats {name(j)}")
    problems = []
    if selfs:
        problems.append(f"{len(selfs)} pair(s) of an image with itself ({_first_20(selfs)})")
    if repeats:
        problems.append(f"{len(repeats)} pair(s) listed again, in either order ({_first_20(repeats)})")
    if problems:
        counted = "" if lines is not None else " (pairs counted from 0)"
        raise DataError(f"{source}: {' and '.join(problems)}{counted}: a self pair is a trivial match and a "
                        "repeated pair is scored twice, both inflate the accuracy; list each pair of two "
                        "different images once")


def resolve_lfw_pairs(pairs: Sequence[LfwPair], image_root: str | os.PathLike, source: str = "pairs") -> PairList:
    """Map LFW ``(name, number)`` references to files under ``image_root`` (see
    :func:`lfw_folder`); every pair naming a missing image is listed in the error."""
    folder = lfw_folder(image_root)
    cache: dict[tuple[str, int], Path | None] = {}

    def find(name: str, num: int) -> Path | None:
        key = (name, num)
        if key not in cache:
            cache[key] = find_lfw_image(folder, name, num)
        return cache[key]

    p1, p2, missing = [], [], []
    for pr in pairs:
        a, b = find(pr.name1, pr.num1), find(pr.name2, pr.num2)
        if a is None or b is None:
            gone = [f"{n}_{k:04d}" for (n, k), f in (((pr.name1, pr.num1), a), ((pr.name2, pr.num2), b)) if f is None]
            missing.append(f"line {pr.line}: {', '.join(gone)}")
            continue
        p1.append(str(a))
        p2.append(str(b))
    _refuse_missing(missing, len(pairs), source, folder)
    folds = [pr.fold for pr in pairs]
    if not any(folds):  # a one-fold list (header 'N': the development view) defines no folds
        folds = None
    return PairList.from_path_pairs(p1, p2, [pr.same for pr in pairs], folds, source,
                                    lines=[pr.line for pr in pairs])


def _parse_same(value: str, where: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise DataError(f"{where}: 'same' must be 1/0, true/false or yes/no, got {value!r}")


def _trimmed(fields: list[str]) -> list[str]:
    """A CSV row without its trailing empty fields (a spreadsheet's ``a,b,1,``)."""
    end = len(fields)
    while end and not fields[end - 1]:
        end -= 1
    return fields[:end]


def read_pair_csv(path: str | os.PathLike, image_root: str | os.PathLike | None = None) -> PairList:
    """A CSV pair list ``path1,path2,same[,fold]`` (header optional), files checked to exist."""
    p = Path(path)
    if not p.is_file():
        raise DataNotFoundError(f"pair list not found: {p}")
    base = Path(image_root) if image_root is not None else p.parent
    text = read_utf8_text(p, 'save it as "CSV UTF-8"')  # a byte offset into the file, not into a chunk of it
    rows = [(k + 1, [c.strip() for c in r]) for k, r in enumerate(_csv.reader(io.StringIO(text, newline="")))
            if any(c.strip() for c in r)]
    if not rows:
        raise DataError(f"{p}: empty pair list")
    columns = ["path1", "path2", "same", "fold"]
    first = [c.lower() for c in rows[0][1]]
    if "path1" in first:
        missing_cols = [c for c in columns[:3] if c not in first]
        if missing_cols:
            raise DataError(f"{p}: the header must name path1,path2,same[,fold]; missing {missing_cols}")
        col = {c: first.index(c) for c in columns if c in first}
        rows = rows[1:]
        # a header may put the columns anywhere (e.g. an id first) and name more than those
        fewest, most, like = max(col.values()) + 1, len(first), "the header"
    else:
        width = len(_trimmed(rows[0][1]))
        if width not in (3, 4):
            raise DataError(f"{p}:1: expected columns path1,path2,same[,fold], got {width} fields")
        col = dict(zip(columns, range(width)))
        fewest, most, like = width, width, "the first line"
    if not rows:
        raise DataError(f"{p}: no pairs below the header")
    p1, p2, same, folds, missing = [], [], [], [], []
    for line_no, r in rows:
        # a longer row than the header or the first line: its extra fields (a fold) were dropped
        n = len(_trimmed(r))
        if n < fewest:
            raise DataError(f"{p}:{line_no}: expected {fewest} fields, got {n}")
        if n > most:
            raise DataError(f"{p}:{line_no}: expected at most {most} fields (as {like}), got {n}")
        a, b = (Path(r[col[c]]) for c in ("path1", "path2"))
        a, b = (x if x.is_absolute() else base / x for x in (a, b))
        gone = [str(x) for x in (a, b) if not x.is_file()]
        if gone:
            missing.append(f"line {line_no}: {', '.join(gone)}")
        p1.append(str(a))
        p2.append(str(b))
        same.append(_parse_same(r[col["same"]], f"{p}:{line_no}"))
        if "fold" in col:
            try:
                folds.append(int(r[col["fold"]]))
            except ValueError as exc:
                raise DataError(f"{p}:{line_no}: fold must be an integer, got {r[col['fold']]!r}") from exc
    _refuse_missing(missing, len(rows), str(p), base)
    return PairList.from_path_pairs(p1, p2, same, folds if "fold" in col else None, str(p),
                                    lines=[line_no for line_no, _ in rows])


def load_pair_list(path: str | os.PathLike, image_root: str | os.PathLike | None = None) -> PairList:
    """Read a pair list: ``.csv`` as :func:`read_pair_csv`, anything else as LFW format.

    ``image_root`` for LFW lists: the folder with the person folders (or its parent holding
    ``lfw/``); default: the pair list's folder.
    """
    p = Path(path)
    try:
        if p.suffix.lower() == ".csv":
            return read_pair_csv(p, image_root)
        pairs = parse_lfw_pairs(p)
    except UnicodeDecodeError as exc:
        raise DataError(f"{p} is not a pair list: not UTF-8 text (byte {exc.start})") from None
    return resolve_lfw_pairs(pairs, image_root if image_root is not None else p.parent, source=str(p))


def lfw_identity(path: str | os.PathLike) -> tuple[str, int] | None:
    """``(name, number)`` of an LFW file name ``<name>_<nnnn>.<ext>``, else ``None``."""
    m = _LFW_FILE.match(Path(path).stem)
    return (m["name"], int(m["num"])) if m else None


@register_dataset("lfw")  # registered here: datasets.py must not import this module
def load_lfw(root: str | os.PathLike | None = None, download: bool = False, *, min_images: int = 1,
             mode: str | None = "RGB", transform=None, skip_corrupt: bool = False) -> ImageFileDataset:
    """LFW (Huang et al. 2007) as a :class:`~dmlkit.data.MetricDataset`: one class per person.
    ``download`` is accepted for the dataset registry; LFW is read from local files only.

    Reads ``<root>/lfw/<Name>/<Name>_<nnnn>.jpg`` (also ``lfw-deepfunneled``/``lfw_funneled``,
    or ``root`` itself holding the person folders) or a flat folder of ``<Name>_<nnnn>.jpg``.
    Class ids ``0..C-1`` follow the sorted names (``ds.class_names`` maps them back);
    ``min_images`` keeps only people with at least that many images (2 for retrieval, where a
    query needs a positive). No class groups: :func:`dmlkit.data.default_split` takes halves.
    """
    folder = lfw_folder(data_root(root) if root is None else root)
    exts = tuple(IMAGE_EXTENSIONS)
    files: dict[str, list[Path]] = {}
    for f in sorted(folder.rglob("*")):
        # hidden entries at any level (macOS "._Name_0001.jpg" stubs, ".ipynb_checkpoints"
        # copies) are no people and no photos, as in image folders
        if f.suffix.lower() not in exts or not f.is_file() or any(
                part.startswith(".") for part in f.relative_to(folder).parts):
            continue
        ident = lfw_identity(f)
        if ident is not None:
            files.setdefault(ident[0], []).append(f)
    names = sorted(n for n, fs in files.items() if len(fs) >= max(1, int(min_images)))
    if not names:
        raise DataNotFoundError(
            f"lfw: no images named <Name>_<nnnn>.jpg under {folder}"
            + (f" with at least {min_images} per person" if min_images > 1 else "")
            + "; extract lfw.tgz (vis-www.cs.umass.edu/lfw) there"
        )
    paths = [f for n in names for f in files[n]]
    labels = [c for c, n in enumerate(names) for _ in files[n]]
    return ImageFileDataset(paths, labels, mode=mode, class_names=dict(enumerate(names)),
                            transform=transform, name="lfw", skip_corrupt=skip_corrupt,
                            meta={"root": str(folder)})
