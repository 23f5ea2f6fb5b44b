"""The Brown "multi-view stereo correspondence" patch dataset, read from and written to its official layout.

Brown, Hua & Winder, "Discriminative learning of local image descriptors", TPAMI 2011
(subsets Liberty, Notre Dame, Yosemite). One folder per subset::

    <root>/<subset>/patches0000.bmp ...   1024 x 1024 grayscale sheets, 16 x 16 patches of
                                          64 x 64, read row by row, sheets in number order
                                          (patches%04d.bmp from 0000, no gap, ceil(N / 256))
    <root>/<subset>/info.txt              one line per patch: "<3D point id> <image id>"
    <root>/<subset>/m50_<n>_<n>_0.txt     exactly <n> pairs, one per line:
                                          "patch1 point1 unused patch2 point2 unused unused";
                                          a pair matches when point1 == point2

This is the layout ``torchvision.datasets.PhotoTour`` reads (``root/<name>/``, ``.bmp``,
``info.txt``, ``m50_100000_100000_0.txt``) and the order in which it cuts patches, so a folder
written by :func:`write_brown_subset` loads with both. The protocol of Brown et al. and
Zagoruyko & Komodakis (CVPR 2015): train on one subset, test on the 100k pairs of
``m50_100000_100000_0.txt`` of another.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dmlkit.exceptions import DataError, DataNotFoundError, ShapeError
from dmlkit.utils import atomic_write_bytes, atomic_write_text, fsync_path, read_json

__all__ = [
    "BROWN_SUBSETS",
    "BROWN_TEST_PAIRS",
    "PATCH_SIZE",
    "PatchPairs",
    "PatchSubset",
    "load_subset",
    "match_files",
    "numbered_sheets",
    "read_info",
    "read_matches",
    "read_patch_sheets",
    "subset_folder",
    "write_brown_subset",
]

#: The subsets of the original dataset, as torchvision names their folders.
BROWN_SUBSETS = ("liberty", "notredame", "yosemite")
#: The test list of the protocol (Brown et al.; Zagoruyko & Komodakis): ``m50_100000_100000_0.txt``.
BROWN_TEST_PAIRS = 100000
#: Side of one patch in the sheets (pixels).
PATCH_SIZE = 64
_SHEET = 1024
_PER_SIDE = _SHEET // PATCH_SIZE
_MATCH_RE = re.compile(r"^m50_(\d+)_(\d+)_(\d+)\.txt$")
_SHEET_RE = re.compile(r"^patches(\d{4})\.bmp$")


def numbered_sheets(folder: Path) -> dict[int, Path]:
    """``{number: path}`` of the files named exactly ``patches<4 digits>.bmp``: only these are
    sheets (another ``.bmp`` beside them, such as a file manager's ``patches0000 (copy).bmp``,
    was read as a sheet and shifted every later patch)."""
    return {int(m.group(1)): p for p in folder.iterdir() if (m := _SHEET_RE.match(p.name))}


def read_patch_sheets(folder: str | Path, n: int | None = None) -> np.ndarray:
    """All patches of ``folder``'s sheets ``patches%04d.bmp`` as ``uint8 (N, 64, 64)``, in PhotoTour's order.

    Sheets are read in number order from ``patches0000.bmp``, each row by row (left to right,
    top to bottom); ``n`` keeps the first ``n`` patches (the last sheet is usually only partly
    filled). Only files named exactly ``patches<4 digits>.bmp`` are sheets; they must be
    numbered from 0000 with no gap up to the last one ``n`` needs (``ceil(n / 256)`` sheets of
    1024 x 1024; sheets past it are not read), else a :class:`DataError` names the first
    missing one. A sheet PIL cannot decode (a truncated file) is a :class:`DataError` naming it.

    Every sheet read must be exactly 1024 x 1024, the last one too, else a :class:`DataError`
    names the file and its size: patch ``k`` is sheet ``k // 256``, row ``k % 256 // 16``,
    column ``k % 16`` (Brown's data page: "1024x1024 bitmap (.bmp) images, each containing a
    16x16 array of image patches"; the last sheet is padded, as :func:`write_brown_subset`
    writes it). A smaller sheet (any multiple of 64 was read) gave fewer patches and shifted
    every later patch index, and so every ``m50`` pair past it, without a word.
    """
    from PIL import Image

    folder = Path(folder)
    numbered = numbered_sheets(folder) if folder.is_dir() else {}
    if not numbered:
        raise DataNotFoundError(f"no patch sheets patches0000.bmp ... in {folder}: unpack the subset there (Brown layout)")
    last = max(numbered)
    out: list[np.ndarray] = []
    total = 0
    for k in range(last + 2 if n is not None else last + 1):
        if n is not None and total >= n and out:
            break
        f = folder / f"patches{k:04d}.bmp"
        if k not in numbered:
            if n is None:
                raise DataError(f"{folder}: patch sheet {f.name} is missing (sheets are numbered to "
                                f"patches{last:04d}.bmp with no gap); unpack the subset again")
            raise DataError(f"{folder}: info.txt lists {n} patches (256 per 1024 x 1024 sheet: "
                            f"{-(-n // (_PER_SIDE * _PER_SIDE))} sheets) but the sheets before the "
                            f"missing {f.name} hold only {total}; unpack the subset again")
        f = numbered[k]
        try:
            with Image.open(f) as im:
                a = np.asarray(im.convert("L"), dtype=np.uint8)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
            raise DataError(f"{f}: cannot read this patch sheet ({exc}); unpack the subset again") from None
        h, w = a.shape
        if (h, w) != (_SHEET, _SHEET):  # patch k is sheet k // 256 only if every sheet holds 256
            raise DataError(f"{f}: sheet of {w} x {h} pixels, expected {_SHEET} x {_SHEET} (16 x 16 patches of "
                            f"{PATCH_SIZE} x {PATCH_SIZE}; the last sheet is padded, not smaller); unpack the subset again")
        grid = a.reshape(_PER_SIDE, PATCH_SIZE, _PER_SIDE, PATCH_SIZE).transpose(0, 2, 1, 3)
        out.append(grid.reshape(-1, PATCH_SIZE, PATCH_SIZE))
        total += out[-1].shape[0]
    patches = np.concatenate(out)
    if n is not None:
        if patches.shape[0] < n:
            raise DataError(f"{folder}: info.txt lists {n} patches but the sheets hold only {patches.shape[0]}")
        patches = patches[:n]
    return np.ascontiguousarray(patches)


def read_info(folder: str | Path) -> np.ndarray:
    """The 3D point id of every patch (first column of ``info.txt``), ``int64 (N,)``."""
    path = Path(folder) / "info.txt"
    if not path.is_file():
        raise DataNotFoundError(f"{path} is missing: every Brown subset folder has an info.txt")
    try:
        with warnings.catch_warnings():  # an empty file: the error below, not numpy's warning
            warnings.simplefilter("ignore", UserWarning)
            table = np.loadtxt(path, dtype=np.int64, ndmin=2)
    except ValueError as exc:
        raise DataError(f"{path}: expected integer columns '<3D point id> <image id>': {exc}") from exc
    if table.size == 0:
        raise DataError(f"{path} is empty: expected one line '<3D point id> <image id>' per patch")
    return table[:, 0].copy()


def match_files(folder: str | Path) -> dict[int, Path]:
    """The ``m50_<n>_<n>_0.txt`` files of a subset folder, keyed by their number of pairs."""
    found: dict[int, Path] = {}
    for p in sorted(Path(folder).glob("m50_*.txt")):
        m = _MATCH_RE.match(p.name)
        if m:
            found[int(m.group(1))] = p
    return found


@dataclass(frozen=True)
class PatchPairs:
    """Pairs of patch indices and their ground truth: ``left``, ``right`` (integers), ``label`` (1/0).

    Checked on construction (the one place every pair list passes through): three 1-D arrays of
    one length (else a :class:`ShapeError`: a right side of one patch was broadcast against every
    left one), integer indices and labels 1 or 0 (else a :class:`DataError`). Which patches the
    indices may point at is known only where they are used: :meth:`check_indices`.
    """

    left: np.ndarray
    right: np.ndarray
    label: np.ndarray
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("left", "right", "label"):
            value = getattr(self, name)
            if not isinstance(value, np.ndarray) or value.ndim != 1:
                raise ShapeError(f"PatchPairs.{name} must be a 1-D numpy array (one entry per pair), "
                                 f"got {type(value).__name__} of shape {np.shape(value)}")
        lengths = (self.left.shape[0], self.right.shape[0], self.label.shape[0])
        if len(set(lengths)) > 1:
            raise ShapeError("PatchPairs: left, right and label need one entry per pair, got lengths "
                             f"{lengths[0]}, {lengths[1]} and {lengths[2]}")
        for name in ("left", "right"):
            if not np.issubdtype(getattr(self, name).dtype, np.integer):
                raise DataError(f"PatchPairs.{name} holds patch indices: integers, got {getattr(self, name).dtype}")
        if not np.isin(self.label, (0, 1)).all():
            raise DataError("PatchPairs.label must be 1 (a match) or 0 for every pair")

    def __len__(self) -> int:
        return int(self.left.shape[0])

    def check_indices(self, num_patches: int, what: str = "pairs") -> None:
        """Every index points at one of the ``num_patches`` patches, ``[0, num_patches)``, else a
        :class:`DataError` naming the first pair outside (numpy and torch take -1 as the last
        patch, a silent wrong pair; an index past the end was a raw IndexError)."""
        for name in ("left", "right"):
            idx = getattr(self, name)
            outside = np.flatnonzero((idx < 0) | (idx >= num_patches))
            if outside.size:
                k = int(outside[0])
                raise DataError(f"{what}: pair {k} has {name} patch index {int(idx[k])}, outside the "
                                f"{num_patches} patches [0, {num_patches}) ({outside.size} such pair(s) on that side)")

    def subset(self, idx: np.ndarray) -> PatchPairs:
        return PatchPairs(self.left[idx], self.right[idx], self.label[idx], self.source)


def read_matches(path: str | Path, num_patches: int | None = None, *,
                 point_ids: np.ndarray | None = None) -> PatchPairs:
    """Pairs from an ``m50_*`` file: columns 0 and 3 are patch ids, 1 and 4 their 3D points.

    Each line has exactly 7 integer columns, ``patch1 point1 unused patch2 point2 unused unused``
    (Brown's format; ``torchvision.datasets.PhotoTour`` reads columns 0, 1, 3 and 4); a pair
    matches when ``point1 == point2``. An empty file, another number of columns, a negative
    patch id or one past ``num_patches`` is a :class:`DataError`. A file named
    ``m50_<n>_<n>_0.txt`` must hold exactly ``n`` lines (a cut file is refused).

    ``point_ids`` (``info.txt``'s first column; :meth:`PatchSubset.pairs` passes it; its length
    bounds the patch ids as ``num_patches`` does): every line's ``point1`` and ``point2`` must
    equal ``point_ids[patch1]`` and ``point_ids[patch2]``, else a :class:`DataError` names the
    first line that disagrees. Refused rather than warned about: the label comes from the file's point
    ids (as in PhotoTour) while the patches come from the sheets that ``info.txt`` describes, so a
    disagreement means the file and ``info.txt`` are not of one subset (a mixed-up or damaged
    copy) and either label would be a guess; the official files agree, and
    :func:`write_brown_subset` refuses to write a file that does not.
    """
    path = Path(path)
    if not path.is_file():
        raise DataNotFoundError(f"{path} is missing: expected a Brown match file m50_<n>_<n>_0.txt")
    try:
        with warnings.catch_warnings():  # an empty file: the error below, not numpy's warning
            warnings.simplefilter("ignore", UserWarning)
            t = np.loadtxt(path, dtype=np.int64, ndmin=2)
    except ValueError as exc:
        raise DataError(f"{path}: expected 7 integer columns per line: {exc}") from exc
    if t.size == 0:
        raise DataError(f"{path} is empty: expected one line 'patch1 point1 unused patch2 point2 unused "
                        f"unused' per pair; unpack the subset again")
    if t.shape[1] != 7:  # 5 columns were read (the last two are unused, but the format has 7)
        raise DataError(f"{path}: expected 7 integer columns per line ('patch1 point1 unused patch2 point2 "
                        f"unused unused'), got {t.shape[1]}")
    m = _MATCH_RE.match(path.name)
    if m and t.shape[0] != int(m.group(1)):  # a cut file was read as a smaller pair list
        raise DataError(f"{path}: expected {int(m.group(1))} pairs (the number in its name), found "
                        f"{t.shape[0]} lines; unpack the subset again")
    left, right = t[:, 0].copy(), t[:, 3].copy()
    negative = np.flatnonzero((left < 0) | (right < 0))
    if negative.size:  # numpy would index from the end: a silent wrong pair
        raise DataError(f"{path}: line {int(negative[0]) + 1} holds a negative patch id")
    if point_ids is not None:  # ids past info.txt have no point to compare with
        num_patches = len(point_ids) if num_patches is None else min(num_patches, len(point_ids))
    if num_patches is not None and (left.max(initial=0) >= num_patches or right.max(initial=0) >= num_patches):
        raise DataError(f"{path}: patch ids go beyond the {num_patches} patches of info.txt")
    if point_ids is not None:
        _check_point_ids(path, t, np.asarray(point_ids))
    return PatchPairs(left, right, (t[:, 1] == t[:, 4]).astype(np.int64), source=path.name)


def _check_point_ids(path: Path, t: np.ndarray, point_ids: np.ndarray) -> None:
    """Columns 1 and 4 of the m50 table ``t`` equal ``point_ids`` of the patches in columns 0
    and 3, else a :class:`DataError` naming the first line that disagrees."""
    bad = np.flatnonzero((point_ids[t[:, 0]] != t[:, 1]) | (point_ids[t[:, 3]] != t[:, 4]))
    if bad.size:
        k = int(bad[0])
        a, b = int(t[k, 0]), int(t[k, 3])
        raise DataError(f"{path}: line {k + 1} gives patches {a} and {b} the 3D points {int(t[k, 1])} and "
                        f"{int(t[k, 4])}, info.txt gives {int(point_ids[a])} and {int(point_ids[b])} "
                        f"({bad.size} such line(s)): the match file and info.txt are not of one subset; "
                        f"unpack the subset again")


@dataclass
class PatchSubset:
    """One subset in memory: ``patches`` uint8 ``(N, 64, 64)``, ``point_ids`` int64 ``(N,)``,
    and its match files (``pairs(n)`` reads one)."""

    name: str
    folder: Path
    patches: np.ndarray
    point_ids: np.ndarray
    matches: dict[int, Path] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.patches.shape[0])

    def pairs(self, num_pairs: int | str | None = None, *, largest: bool = True) -> PatchPairs:
        """Pairs of the ``m50_<num_pairs>_*`` file (a number or a file name); ``None``: the largest
        file (``largest=True``, training) or the test list: ``m50_100000_100000_0.txt`` when present
        (the protocol's test pairs; the Brown subsets ship files of 1k to 500k pairs), else the
        smallest file. The file's 3D point ids must agree with ``info.txt`` (:func:`read_matches`)."""
        if not self.matches:
            raise DataNotFoundError(f"{self.folder}: no m50_<n>_<n>_0.txt match file")
        if num_pairs is None:
            if largest:
                key = max(self.matches)
            else:
                key = BROWN_TEST_PAIRS if BROWN_TEST_PAIRS in self.matches else min(self.matches)
            path = self.matches[key]
        elif isinstance(num_pairs, str) and not num_pairs.isdigit():
            path = self.folder / num_pairs
        else:
            if int(num_pairs) not in self.matches:
                raise DataNotFoundError(
                    f"{self.folder}: no match file with {num_pairs} pairs; found {sorted(self.matches)}"
                )
            path = self.matches[int(num_pairs)]
        return read_matches(path, len(self), point_ids=self.point_ids)


def subset_folder(root: str | Path, name: str) -> Path:
    """``<root>/<name>``, or a one-line :class:`DataNotFoundError` saying where to get it."""
    folder = Path(root).expanduser() / name
    if not folder.is_dir():
        hint = (
            "download it from the Brown/Winder multi-view stereo page (or torchvision.datasets.PhotoTour) "
            "and unpack it there"
            if name in BROWN_SUBSETS
            else "build it with `dmlkit patches build-data`"
        )
        raise DataNotFoundError(f"patch subset '{name}' not found at {folder}: {hint}")
    _check_build_finished(folder, name)
    return folder


#: The record of ``dmlkit patches build-data`` beside the subsets it built.
BUILD_MANIFEST = "manifest.json"


def _check_build_finished(folder: Path, name: str) -> None:
    """Refuse a subset folder beside a ``manifest.json`` of ``dmlkit patches build-data`` that
    the manifest does not list: the build records a subset only once all its files are written
    (and drops it before rebuilding it), so the folder is a build that was killed or failed
    part-way; read anyway, a subset without its test ``m50`` file was tested on its training
    pairs without a word. No manifest (the Brown data, a folder written otherwise): no check."""
    real = folder.resolve()
    manifest = real.parent / BUILD_MANIFEST
    try:
        built = read_json(manifest, BUILD_MANIFEST)["subsets"]
    except (OSError, DataError, KeyError, TypeError):  # none, or not build-data's (corrupt, nested too deeply)
        return
    if isinstance(built, dict) and real.name not in built:
        raise DataError(
            f"patch subset '{name}' at {folder} is not listed in {manifest}: its `dmlkit patches build-data` "
            f"did not finish (killed or failed part-way); build it again with `dmlkit patches build-data "
            f"-o {real.parent} --subset {real.name}` (and its settings), or move a subset that build-data "
            f"did not make out of {real.parent}")


def load_subset(root: str | Path, name: str) -> PatchSubset:
    """Read ``<root>/<name>/`` (Brown layout) into memory."""
    folder = subset_folder(root, name)
    ids = read_info(folder)
    patches = read_patch_sheets(folder, len(ids))
    return PatchSubset(name=name, folder=folder, patches=patches, point_ids=ids, matches=match_files(folder))


def write_brown_subset(
    folder: str | Path,
    patches: np.ndarray,
    point_ids: np.ndarray,
    image_ids: np.ndarray,
    pairs: dict[int, PatchPairs],
) -> Path:
    """Write patches, ``info.txt`` and ``m50_<n>_<n>_0.txt`` files in the Brown layout.

    ``patches``: uint8 ``(N, 64, 64)``; sheets ``patches%04d.bmp`` of 16 x 16 patches, the last
    one padded with black. ``pairs[n]`` is written to ``m50_<n>_<n>_0.txt`` (``n == len``).
    Everything is checked before the folder is touched. The files are written into a hidden
    sibling folder (``.<name>.building-*``) and moved into place when all are there: a write
    killed part-way left a half-built subset (the training ``m50`` file without the test one,
    which the protocol then silently replaced by the training file) and now leaves the earlier
    subset or none. The sheets and ``m50`` files of an earlier subset in ``folder`` are removed
    (stale pair files would be read as this subset's); any other file there is the user's and
    stays.
    """
    folder = Path(folder)
    patches = np.asarray(patches)
    point_ids, image_ids = np.asarray(point_ids), np.asarray(image_ids)
    if patches.dtype != np.uint8 or patches.ndim != 3 or patches.shape[1:] != (PATCH_SIZE, PATCH_SIZE):
        raise DataError(f"patches must be uint8 (N, {PATCH_SIZE}, {PATCH_SIZE}), got {patches.dtype} {patches.shape}")
    n = patches.shape[0]
    if point_ids.shape != (n,) or image_ids.shape != (n,):
        raise DataError("point_ids and image_ids need one entry per patch")
    files: dict[str, str] = {}
    for count, pp in pairs.items():
        if len(pp) != count:
            raise DataError(f"pairs[{count}] holds {len(pp)} pairs")
        pp.check_indices(n, f"pairs[{count}]")
        pl, pr = point_ids[pp.left], point_ids[pp.right]
        if not np.array_equal(pl == pr, pp.label.astype(bool)):
            raise DataError("pair labels disagree with the 3D point ids")
        files[f"m50_{count}_{count}_0.txt"] = "".join(
            f"{a} {b} 0 {c} {d} 0 0\n" for a, b, c, d in zip(pp.left.tolist(), pl.tolist(), pp.right.tolist(), pr.tolist())
        )
    if folder.exists() and not folder.is_dir():
        raise DataError(f"{folder} is a file, not a subset folder: choose another path")
    target = folder.resolve() if folder.is_symlink() else folder  # a linked folder stays where it is
    target.parent.mkdir(parents=True, exist_ok=True)
    building = f".{target.name}.building-"
    for stale in [p for p in target.parent.iterdir() if p.name.startswith(building)]:  # a killed write's
        shutil.rmtree(stale, ignore_errors=True)
    staging = target.parent / f"{building}{uuid.uuid4().hex[:12]}"
    staging.mkdir()  # the mode a new folder gets (mkdtemp's 0700 would become the subset's)
    try:
        _write_layout(staging, patches, point_ids, image_ids, files)
        _move_into_place(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone once moved; a failed write's files
    return folder


def _write_layout(folder: Path, patches: np.ndarray, point_ids: np.ndarray, image_ids: np.ndarray,
                  match_texts: dict[str, str]) -> None:
    """The sheets, ``info.txt`` and the ``m50`` files (``{name: text}``) into the empty ``folder``."""
    import io

    from PIL import Image

    per_sheet = _PER_SIDE * _PER_SIDE
    for s in range(0, len(patches), per_sheet):
        chunk = patches[s : s + per_sheet]
        full = np.zeros((per_sheet, PATCH_SIZE, PATCH_SIZE), np.uint8)
        full[: len(chunk)] = chunk
        sheet = full.reshape(_PER_SIDE, _PER_SIDE, PATCH_SIZE, PATCH_SIZE).transpose(0, 2, 1, 3)
        buf = io.BytesIO()
        Image.fromarray(sheet.reshape(_SHEET, _SHEET), mode="L").save(buf, format="BMP")
        atomic_write_bytes(folder / f"patches{s // per_sheet:04d}.bmp", buf.getvalue())
    atomic_write_text(folder / "info.txt", "".join(f"{p} {i}\n" for p, i in zip(point_ids.tolist(), image_ids.tolist())))
    for name, lines in match_texts.items():
        atomic_write_text(folder / name, lines)


def _layout_files(folder: Path) -> list[Path]:
    """The files of ``folder`` that the layout reads: sheets ``patches<4 digits>.bmp``,
    ``info.txt`` and ``m50`` files. Any other file (another ``.bmp`` included) is the user's."""
    m50 = [f for f in folder.glob("m50_*.txt") if _MATCH_RE.match(f.name)]
    info = [folder / "info.txt"] if (folder / "info.txt").is_file() else []
    return [*numbered_sheets(folder).values(), *info, *m50]


def _move_into_place(staging: Path, folder: Path) -> None:
    """Make the complete subset in ``staging`` the subset at ``folder``. A new folder, or one
    holding only an earlier subset's files, is swapped whole (two renames: a kill leaves the old
    subset, or no folder); a folder that also holds the user's files keeps them, and only the
    layout's files are replaced there, one rename each."""
    if folder.exists() and {p.name for p in folder.iterdir()} != {p.name for p in _layout_files(folder)}:
        for old in _layout_files(folder):
            old.unlink()
        for new in sorted(staging.iterdir(), key=lambda p: p.name.startswith("m50_")):  # pairs last
            os.replace(new, folder / new.name)
    else:
        old_subset = staging.with_name(staging.name + ".old")  # matched by the stale-folder sweep
        if folder.exists():
            folder.rename(old_subset)
        try:
            staging.rename(folder)
        except BaseException:
            if old_subset.exists():
                old_subset.rename(folder)  # the earlier subset back where it was
            raise
        shutil.rmtree(old_subset, ignore_errors=True)
    with contextlib.suppress(OSError):  # the renames are durable once the folders are flushed
        fsync_path(folder)
        fsync_path(folder.parent)
