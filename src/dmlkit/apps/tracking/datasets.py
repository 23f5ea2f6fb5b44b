"""Tracking sequences on disk: GOT-10k and OTB layouts, folders of frames and video files.

* GOT-10k (Huang et al., TPAMI 2019): ``ROOT/[train|val|test]/GOT-10k_Train_000001/00000001.jpg``
  with ``groundtruth.txt`` (one ``x,y,w,h`` per frame) and optionally ``absence.label``
  (1 = target absent in that frame; such frames get a NaN box and are skipped by training
  and evaluation).
* OTB (Wu et al., CVPR 2013): ``ROOT/Seq/img/0001.jpg`` with ``groundtruth_rect.txt``
  (``x,y,w,h`` separated by commas, tabs or spaces). Sequences with several targets have
  ``groundtruth_rect.1.txt``, ``groundtruth_rect.2.txt``...: each becomes ``Seq.1``, ``Seq.2``.

**Index base.** Both benchmarks write **1-based** boxes (MATLAB's convention: the image's
top-left pixel is ``(1, 1)``, so a target whose top-left pixel has 0-based column 40 and row 30
is written ``41,31,w,h``; GOT-10k's authors state it in got-10k/toolkit issue #6, and the OTB
toolkit computes centres as ``x + (w - 1) / 2`` in those coordinates). dmlkit works in 0-based
coordinates (:mod:`dmlkit.apps.tracking.geometry`), so the loaders subtract ``index_base`` from
``x`` and ``y`` (width and height are unchanged): ``index_base=None`` (the default) reads a
``dmlkit track build-data`` folder in the base its ``meta.json`` records (``box_index_base``;
builds of dmlkit before it was recorded wrote 0-based boxes and are read so) and any other
folder as 1-based; pass 0 for files written 0-based (:func:`box_index_base`).

Frames are read lazily (``seq.frame(i)`` is an ``(H, W, 3)`` uint8 RGB array).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dmlkit.embedding_files import check_numpy_file
from dmlkit.exceptions import ConfigError, DataError, DataNotFoundError, require
from dmlkit.utils import read_json

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".pgm", ".ppm", ".tif", ".tiff")
VIDEO_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm", ".gif", ".mpg", ".mpeg", ".m4v")


def read_image(path: str | Path) -> np.ndarray:
    """An image file as an ``(H, W, 3)`` uint8 RGB array, decoded as every other command decodes
    images (:func:`dmlkit.data.base.load_image`: turned upright by its EXIF orientation, 16-bit
    and float frames scaled to 8 bits, never clipped; Pillow's ``convert("RGB")`` alone left a
    16-bit frame 98 % white and a camera frame sideways, and the tracker drifted off the target
    without a word). An unreadable frame is a :class:`DataError` naming it, a decompression bomb
    included."""
    from dmlkit.data.base import load_image  # lazy: PIL and the data layer load on first frame

    try:
        return np.asarray(load_image(path, "RGB"))
    except DataError as exc:
        cause = exc.__cause__
        if isinstance(cause, FileNotFoundError):
            raise DataNotFoundError(f"frame {path} does not exist") from None
        raise DataError(f"cannot read frame {path}: {cause if cause is not None else exc}") from None


def _natural_key(path: Path) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name))


def list_frames(folder: str | Path) -> list[Path]:
    """Image files of a folder in natural order (``2.jpg`` before ``10.jpg``)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataNotFoundError(f"frame folder {folder} does not exist")
    frames = sorted((p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES),
                    key=_natural_key)
    if not frames:
        raise DataNotFoundError(
            f"no image files ({', '.join(IMAGE_SUFFIXES)}) in {folder}"
        )
    return frames


def read_boxes(path: str | Path) -> np.ndarray:
    """A ground-truth file: one box ``x,y,w,h`` per line (commas, tabs or spaces) -> ``(N, 4)``,
    the numbers as the file holds them (OTB's and GOT-10k's are 1-based: :func:`load_otb` and
    :func:`load_got10k` return them 0-based, :func:`box_index_base`)."""
    path = Path(path)
    if not path.is_file():
        raise DataNotFoundError(f"ground-truth file {path} does not exist")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        parts = [p for p in re.split(r"[,\s]+", line.strip()) if p]
        if not parts:
            continue
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise DataError(f"{path}:{lineno}: not a box 'x,y,w,h': {line!r}") from None
        if len(values) != 4:
            raise DataError(
                f"{path}:{lineno}: expected 4 numbers x,y,w,h, got {len(values)} "
                "(polygon annotations are not supported; convert them to axis-aligned boxes)"
            )
        rows.append(values)
    if not rows:
        raise DataError(f"{path} has no boxes")
    return np.asarray(rows, dtype=np.float64)


@dataclass
class Sequence:
    """One annotated (or unannotated) video: frame files and a box per frame.

    ``boxes`` is ``(N, 4)`` ``x, y, w, h`` in 0-based pixel coordinates (NaN rows where the
    target is absent) or ``None`` for an unannotated video; ``frames`` are paths, or in-memory
    ``(H, W, 3)`` uint8 arrays.
    """

    name: str
    frames: list
    boxes: np.ndarray | None = None
    #: the index base of the ground-truth file the boxes were read from (they are 0-based
    #: in memory; ``None``: not read from a file): what result files beside it are written in
    index_base: int | None = None

    def __post_init__(self) -> None:
        if not self.frames:
            raise DataError(f"sequence {self.name!r} has no frames")
        if self.boxes is not None:
            self.boxes = np.asarray(self.boxes, dtype=np.float64)
            if len(self.boxes) != len(self.frames):
                raise DataError(
                    f"sequence {self.name!r}: {len(self.frames)} frames but "
                    f"{len(self.boxes)} ground-truth boxes; they must match one to one"
                )

    def __len__(self) -> int:
        return len(self.frames)

    def frame(self, i: int) -> np.ndarray:
        f = self.frames[i]
        return f if isinstance(f, np.ndarray) else read_image(f)

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(len(self)):
            yield self.frame(i)

    @property
    def valid(self) -> np.ndarray:
        """Frames with a usable box (finite, positive width and height)."""
        if self.boxes is None:
            return np.zeros(len(self), dtype=bool)
        b = self.boxes
        return np.isfinite(b).all(axis=1) & (b[:, 2] > 0) & (b[:, 3] > 0)


def _build_meta(folder: Path) -> dict | None:
    """The ``meta.json`` of the ``dmlkit track build-data`` whose ``train`` or ``test`` folder
    ``folder`` is, else ``None`` (another folder, or a ``meta.json`` that is not a build's)."""
    meta_path = folder.parent / "meta.json"
    if folder.name not in ("train", "test") or not meta_path.is_file():
        return None
    try:
        meta = read_json(meta_path, "build-data meta.json")
    except (OSError, DataError):  # unreadable, corrupt or nested ~100,000 deep
        return None  # not the meta.json of a build
    if not isinstance(meta, dict) or not all(isinstance(meta.get(k), dict) for k in ("train", "test")):
        return None
    return meta


def check_offline_build(folder: str | Path) -> None:
    """Refuse (:class:`DataError`) a ``train`` or ``test`` folder of ``dmlkit track build-data``
    whose ``meta.json`` (beside it) says the build did not finish, or lists other sequences than
    the folder holds: an interrupted build left complete sequences, a half-written one and none of
    the rest, and training read the complete ones without a word. Any other folder passes."""
    folder = Path(folder)
    meta = _build_meta(folder)
    if meta is None:
        return
    meta_path = folder.parent / "meta.json"
    if meta.get("complete") is False:  # absent in builds of older versions, which wrote it last
        raise DataError(f"{folder.parent} is an unfinished `dmlkit track build-data` (it was interrupted): "
                        "run the same build-data command again to rebuild it")
    listed = set(meta[folder.name])
    found = ({p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")}
             if folder.is_dir() else set())
    if found != listed:
        missing, extra = sorted(listed - found), sorted(found - listed)
        what = (f"it lacks {len(missing)} of the sequences listed there ({missing[0]} ...)" if missing
                else f"it holds {len(extra)} sequences not listed there ({extra[0]} ...)")
        raise DataError(f"{folder} does not match {meta_path}: {what}; rebuild it with `dmlkit track "
                        "build-data`, or remove meta.json to read the folder as it is (its boxes are then "
                        "read as 1-based: pass index_base / --index-base if they are not)")


#: The index base of GOT-10k's and OTB's ground truth, and of what ``build-data`` writes now.
BENCHMARK_INDEX_BASE = 1


def check_index_base(index_base: int | None) -> int | None:
    """``index_base`` if it is ``None`` (read what the folder says), 0 or 1, else one
    :class:`ConfigError` line."""
    if index_base is None or (isinstance(index_base, int | np.integer) and not isinstance(index_base, bool)
                              and int(index_base) in (0, 1)):
        return None if index_base is None else int(index_base)
    raise ConfigError(f"the index base of ground-truth boxes (index_base, --index-base) is 0 or 1 (the "
                      f"first pixel's index: 1 for GOT-10k and OTB), got {index_base!r}")


def box_index_base(folder: str | Path, index_base: int | None = None) -> int:
    """The index base of the ground-truth files of the sequence folders in ``folder``: ``index_base``
    where given (0 or 1); for the ``train`` / ``test`` folder of a ``dmlkit track build-data``, the
    ``box_index_base`` its ``meta.json`` records, 0 where it records none (builds of older dmlkit
    wrote 0-based boxes); else 1, the GOT-10k and OTB convention (:data:`BENCHMARK_INDEX_BASE`)."""
    index_base = check_index_base(index_base)
    if index_base is not None:
        return index_base
    meta = _build_meta(Path(folder))
    if meta is None:
        return BENCHMARK_INDEX_BASE
    recorded = meta.get("box_index_base", 0)
    if recorded not in (0, 1) or isinstance(recorded, bool):
        raise DataError(f"{Path(folder).parent / 'meta.json'}: box_index_base must be 0 or 1, got {recorded!r}")
    return int(recorded)


def _zero_based(boxes: np.ndarray, index_base: int) -> np.ndarray:
    """``boxes`` ``(N, 4)`` read from a file of ``index_base`` in dmlkit's 0-based coordinates:
    ``x - index_base, y - index_base, w, h`` (NaN rows stay NaN)."""
    out = np.array(boxes, dtype=np.float64)
    out[:, :2] -= index_base
    return out


def _got10k_dirs(root: Path, split: str | None, named: bool = False) -> list[Path]:
    """The sequence folders of ``root/split`` (of ``root`` itself when that split folder is
    absent, unless the split was ``named`` by the user: a misspelt one is an error, not the root)."""
    if named and split and not (root / split).is_dir():
        folders = sorted(p.name for p in root.iterdir() if p.is_dir() and not (p / "groundtruth.txt").is_file())
        raise DataNotFoundError(f"GOT-10k split folder {root / split} does not exist"
                                + (f"; {root} holds {folders}" if folders else f"; {root} has no split folders: leave split unset"))
    base = root / split if split and (root / split).is_dir() else root
    dirs = sorted(p for p in base.iterdir() if p.is_dir() and (p / "groundtruth.txt").is_file())
    if not dirs:
        raise DataNotFoundError(
            f"no GOT-10k sequences under {base}: expected {base}/GOT-10k_Train_000001/"
            "00000001.jpg ... with groundtruth.txt"
        )
    return dirs


def got10k_splits(root: str | Path) -> list[str]:
    """The split folders of a GOT-10k root (``train``, ``val``, ``test`` ...): its sub-folders
    that hold sequence folders rather than being one; none when ``root`` is missing."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not (p / "groundtruth.txt").is_file()
                  and any((s / "groundtruth.txt").is_file() for s in p.iterdir() if s.is_dir()))


def load_got10k(root: str | Path, split: str | None = None, index_base: int | None = None) -> list[Sequence]:
    """Sequences in the GOT-10k layout: the ``split`` sub-folder, which must exist when named;
    unnamed, ``train`` if it exists, else ``root`` itself (the ``train`` folder of a finished
    ``build-data``: :func:`check_offline_build`). Boxes in 0-based coordinates: the file's
    ``x`` and ``y`` less :func:`box_index_base` (1 for GOT-10k's own files)."""
    root = Path(root)
    index_base = check_index_base(index_base)
    for folder in (root, root / (split or "train")):  # a build-data's train folder, or the build
        check_offline_build(folder)
    if not root.is_dir():
        raise DataNotFoundError(f"GOT-10k root {root} does not exist")
    sequences: list[Sequence] = []
    bases: dict[Path, int] = {}
    for d in _got10k_dirs(root, split or "train", named=split is not None):
        frames = list_frames(d)
        boxes = read_boxes(d / "groundtruth.txt")
        if len(boxes) == 1 and len(frames) > 1:  # GOT-10k test split: first box only
            boxes = np.vstack([boxes, np.full((len(frames) - 1, 4), np.nan)])
        absence = d / "absence.label"
        if absence.is_file():  # a flag a frame; one that does not fit is an error, not ignored
            try:
                flags = np.array([int(v) for v in absence.read_text().split()], dtype=np.int64) != 0
            except ValueError:
                raise DataError(f"{absence}: expected one 0/1 flag per frame") from None
            if len(flags) != len(boxes):
                raise DataError(f"{absence} has {len(flags)} flags but the sequence has {len(boxes)} "
                                "frames: one flag per frame (1 = target absent)")
            boxes[flags] = np.nan
        if d.parent not in bases:  # once a folder: meta.json was read and parsed per sequence
            bases[d.parent] = box_index_base(d.parent, index_base)
        base = bases[d.parent]
        sequences.append(Sequence(d.name, frames, _zero_based(boxes, base), base))
    return sequences


def load_otb(root: str | Path, index_base: int | None = None) -> list[Sequence]:
    """Sequences in the OTB layout: ``root/Seq/img/*.jpg`` + ``root/Seq/groundtruth_rect*.txt``
    (the ``test`` folder of a finished ``build-data``: :func:`check_offline_build`).
    Boxes in 0-based coordinates: the file's ``x`` and ``y`` less :func:`box_index_base` (1 for
    OTB's own, MATLAB-written files: ``41,31,w,h`` is the target whose top-left pixel is 0-based
    ``(40, 30)``). Two sequences of one name (``A/groundtruth_rect.1.txt`` and
    ``A.1/groundtruth_rect.txt``) are a :class:`DataError` naming both files."""
    root = Path(root)
    index_base = check_index_base(index_base)
    check_offline_build(root)
    if not root.is_dir():
        raise DataNotFoundError(f"OTB root {root} does not exist")
    base = box_index_base(root, index_base)
    sequences, sources = [], {}
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        gts = sorted(d.glob("groundtruth_rect*.txt"),
                     key=lambda p: (p.name != "groundtruth_rect.txt", _natural_key(p)))
        if not gts or not (d / "img").is_dir():
            continue
        frames = list_frames(d / "img")
        for gt in gts:
            suffix = gt.name[len("groundtruth_rect"):-len(".txt")]
            name = d.name + suffix
            if name in sources:  # one of the two was dropped from every result keyed by name
                raise DataError(f"two OTB sequences are named {name!r}: {sources[name]} and {gt}; rename one "
                                "of their folders so that sequence names are unique")
            sources[name] = gt
            boxes = read_boxes(gt)
            if len(boxes) != len(frames):
                raise DataError(
                    f"OTB sequence {name}: {len(frames)} frames in {d / 'img'} but {len(boxes)} "
                    f"boxes in {gt.name}; keep only the annotated frames in img/"
                )
            sequences.append(Sequence(name, frames, _zero_based(boxes, base), base))
    if not sequences:
        raise DataNotFoundError(
            f"no OTB sequences under {root}: expected {root}/<Seq>/img/0001.jpg ... and "
            f"{root}/<Seq>/groundtruth_rect.txt"
        )
    return sequences


def load_tracking_dataset(kind: str, root: str | Path, split: str | None = None,
                          index_base: int | None = None) -> list[Sequence]:
    """``kind`` is ``otb`` (no ``split``) or ``got10k`` (:func:`load_got10k`: a named ``split`` must
    exist); ``index_base`` as there (``None``: 1, or what a build's ``meta.json`` records)."""
    kind = kind.lower().replace("-", "")
    if kind == "otb":
        if split is not None:  # else silently the whole benchmark, not the sub-folder asked for
            raise ConfigError(f"OTB has no splits (got split {split!r}): leave --split out")
        return load_otb(root, index_base)
    if kind == "got10k":
        return load_got10k(root, split, index_base)
    raise DataError(f"unknown tracking dataset layout {kind!r}: use 'otb' or 'got10k'")


#: What imageio's plugins raise on a file that is no video they can read: it picks a plugin by the
#: file's content, and each has its own errors (an empty ``.npz``: numpy's EOFError, which the
#: CLI took for an abort; random bytes: a ValueError about pickles).
_DECODER_ERRORS = (OSError, EOFError, ValueError, KeyError, TypeError, RuntimeError)


def _video_frame(source: Path, index: int, arr: np.ndarray) -> np.ndarray:
    """Frame ``index`` of a decoded video as ``(H, W, 3)`` uint8 (gray repeated, alpha dropped);
    an array that is no 8-bit image (imageio's numpy plugin reads an ``.npz`` as arrays of any
    shape and dtype) is a :class:`DataError` naming ``source``, not an IndexError traceback nor
    numbers cast to pixels."""
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    if arr.ndim == 2:
        arr = np.repeat(arr[:, :, None], 3, axis=2)
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] not in (3, 4) or min(arr.shape[:2]) == 0:
        raise DataError(f"{source} is not a video: its frame {index} is an array of shape {arr.shape} and "
                        f"dtype {arr.dtype}, not an 8-bit image (pass a video file, e.g. .mp4, .avi or .gif, "
                        "or a folder of frames)")
    return np.ascontiguousarray(arr[:, :, :3])


def read_video(source: str | Path, max_frames: int | None = None) -> tuple[list, float | None]:
    """Frames of a folder of images (paths, read lazily) or a video file (decoded arrays).

    Returns ``(frames, fps)``; fps is the video's frame rate or ``None`` for a folder.
    Video files are decoded with imageio (the ``tracking`` extra: ``imageio`` + ``av``).
    """
    source = Path(source)
    if source.is_dir():
        frames = list_frames(source)
        return (frames[:max_frames] if max_frames else frames), None
    if not source.is_file():
        raise DataNotFoundError(f"{source} is neither a folder of frames nor a video file")
    if source.suffix.lower() in IMAGE_SUFFIXES:
        raise DataError(f"{source} is a single image: pass the folder that holds the frames")
    if source.suffix.lower() in (".npy", ".npz"):  # imageio's numpy plugin: a damaged one gave np.load's
        check_numpy_file(source, source.suffix.lower(), "video frames")  # "pickled data ... allow_pickle"
    iio = require("imageio.v3", "tracking")
    fps = None
    try:
        meta = iio.immeta(source)
        fps = meta.get("fps") or (1000.0 / meta["duration"] if meta.get("duration") else None)
    except Exception:  # metadata is optional
        fps = None
    frames = []
    try:
        for frame in iio.imiter(source):
            frames.append(_video_frame(source, len(frames), np.asarray(frame)))
            if max_frames and len(frames) >= max_frames:
                break
    except _DECODER_ERRORS as exc:  # imageio's message spans lines: the CLI prints one
        if source.suffix.lower() not in (".gif", ".npy", ".npz"):  # no PyAV: name the extra, not "damaged"
            require("av", "tracking")
        reason = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
        raise DataError(f"cannot decode video {source}: {reason} (a damaged file, or no video: pass a video "
                        "file, e.g. .mp4, .avi or .gif, or a folder of frames)") from None
    if not frames:
        raise DataError(f"video {source} has no frames")
    return frames, (float(fps) if fps else None)
