"""Datasets for metric learning: every sample has an integer class id, splits are by class.

:class:`MetricDataset` is the common interface (a ``torch.utils.data.Dataset``):

- ``ds[i] -> (x, label)``: ``x`` is the transformed sample, ``label`` the original class id;
- ``ds.labels``: ``np.int64 (N,)`` original class ids (never re-indexed);
- ``ds.classes``: sorted unique class ids; ``ds.class_names``: ``{class_id: name}``;
- ``ds.class_groups``: ``{class_id: group}``, the dataset's own class partition (e.g. Omniglot's
  ``background`` / ``evaluation``, CUB's ``train`` / ``test``) used by
  :func:`dmlkit.data.default_split`; ``ds.split_groups`` names which group is train/test;
- ``ds.sample_groups``: optional per-sample partition (In-Shop's ``train/query/gallery``);
- ``ds.subset_classes(ids)``, ``ds.subset(indices)``, ``ds.with_transform(t)``,
  ``ds.fingerprint()`` (stable string for caches), ``ds.portable_fingerprint()`` (the same for
  a copy of the data elsewhere), ``ds.paths`` (or ``None``),
  ``ds.thumbnail(i)`` (a PIL image of the raw sample, for reports).

Two storage back-ends share the interface: :class:`ArrayDataset` (images or feature vectors
held in memory as a NumPy array) and :class:`ImageFileDataset` (image files loaded with PIL).
Subsets are views: they keep the storage and select rows.
"""

from __future__ import annotations

import copy
import hashlib
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from dmlkit.data.imaging import HIGH_DEPTH_MODES, full_depth, to_8bit, upright_8bit, upright_image
from dmlkit.data.skipped import SkippedImagesWarning
from dmlkit.exceptions import DataError, ShapeError
from dmlkit.utils import path_bytes, portable_path

__all__ = ["HIGH_DEPTH_MODES", "ArrayDataset", "ImageFileDataset", "MetricDataset", "load_image", "to_8bit",
           "upright_8bit", "upright_image"]

Transform = Callable[[Any], Any]


class MetricDataset(Dataset):
    """Base class: labels, class bookkeeping, subsets and fingerprints (storage in subclasses).

    Subclasses implement :meth:`_raw` (the untransformed sample of a storage row),
    :meth:`_default_tensor` (what ``ds[i]`` returns without a transform) and
    :meth:`_storage_fingerprint`.
    """

    def __init__(
        self,
        labels: Sequence[int] | np.ndarray,
        *,
        class_names: Mapping[int, str] | None = None,
        class_groups: Mapping[int, str] | None = None,
        split_groups: Mapping[str, str] | None = None,
        sample_groups: Sequence[str] | np.ndarray | None = None,
        transform: Transform | None = None,
        name: str = "dataset",
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        labels = np.asarray(labels)
        if labels.ndim != 1:
            raise ShapeError(f"labels must be 1-D (N,), got shape {labels.shape}")
        if labels.size and not np.issubdtype(labels.dtype, np.integer):
            raise DataError(f"labels must be integer class ids, got dtype {labels.dtype}")
        self._all_labels = labels.astype(np.int64, copy=False)
        self._rows = np.arange(len(labels), dtype=np.int64)
        self.transform = transform
        self.name = name
        self.meta: dict[str, Any] = dict(meta or {})
        self.split_groups: dict[str, str] = dict(split_groups or {})
        self._all_sample_groups = None if sample_groups is None else np.asarray(sample_groups, dtype=str)
        if self._all_sample_groups is not None and self._all_sample_groups.shape != labels.shape:
            raise ShapeError(
                f"sample_groups must have one entry per sample ({len(labels)}), "
                f"got {self._all_sample_groups.shape}"
            )
        self._all_class_names = {int(k): str(v) for k, v in (class_names or {}).items()}
        self._all_class_groups = {int(k): str(v) for k, v in (class_groups or {}).items()}
        self._refresh()

    # -- bookkeeping -----------------------------------------------------------------------
    def _refresh(self) -> None:
        """The selected rows' labels, classes and groups, after any change of ``_rows``; the
        cached fingerprints (:meth:`fingerprint`, :meth:`portable_fingerprint`) are dropped."""
        self._fingerprint: str | None = None
        self._portable: str | None = None
        self.labels: np.ndarray = self._all_labels[self._rows]
        self.classes: np.ndarray = np.unique(self.labels)
        present = set(self.classes.tolist())
        self.class_names: dict[int, str] = {
            c: self._all_class_names.get(c, str(c)) for c in self.classes.tolist()
        }
        self.class_groups: dict[int, str] = {
            c: g for c, g in self._all_class_groups.items() if c in present
        }
        self.sample_groups: np.ndarray | None = (
            None if self._all_sample_groups is None else self._all_sample_groups[self._rows]
        )

    @property
    def num_classes(self) -> int:
        return int(self.classes.size)

    def __len__(self) -> int:
        return int(self._rows.size)

    def _row(self, index: int) -> int:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for a dataset of {n} samples")
        return int(self._rows[index])

    def __getitem__(self, index: int) -> tuple[Any, int]:
        row = self._row(index)
        x = self._raw(row)
        x = self.transform(x) if self.transform is not None else self._default_tensor(x)
        return x, int(self._all_labels[row])

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, samples={len(self)}, "
            f"classes={self.num_classes})"
        )

    # -- storage hooks ---------------------------------------------------------------------
    def _raw(self, row: int) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def _default_tensor(self, x: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def _storage_fingerprint(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def _portable_samples_fingerprint(self) -> str:
        """The selected samples' content without where the data lies (default: the storage's
        fingerprint and the selected rows)."""
        return self._storage_fingerprint() + self._rows.tobytes().hex()

    @property
    def paths(self) -> list[str] | None:
        """File paths of the samples (in order), or ``None`` for in-memory data."""
        return None

    # -- views -----------------------------------------------------------------------------
    def subset(self, indices: Iterable[int] | np.ndarray) -> MetricDataset:
        """A view of the samples at ``indices`` (positions in *this* dataset), same storage."""
        idx = np.asarray(list(indices) if not isinstance(indices, np.ndarray) else indices)
        if idx.dtype == bool:
            if idx.shape != (len(self),):
                raise ShapeError(f"boolean mask must have shape ({len(self)},), got {idx.shape}")
            idx = np.flatnonzero(idx)
        if idx.size and idx.dtype.kind not in "iu":  # as numpy: 1.7 was silently row 1
            raise IndexError(f"subset indices must be integers or a boolean mask, got {idx.dtype}")
        idx = idx.astype(np.int64, copy=False)
        if idx.size and (idx.min() < -len(self) or idx.max() >= len(self)):
            raise IndexError(f"subset indices out of range for a dataset of {len(self)} samples")
        new = copy.copy(self)
        new._rows = self._rows[idx]
        new._refresh()
        return new

    def subset_classes(self, class_ids: Iterable[int]) -> MetricDataset:
        """The samples whose class id is in ``class_ids`` (original ids, order kept).

        Raises :class:`DataError` when an id is not a class of this dataset.
        """
        ids = np.asarray(sorted({int(c) for c in class_ids}), dtype=np.int64)
        missing = np.setdiff1d(ids, self.classes)
        if missing.size:
            shown = ", ".join(map(str, missing[:10].tolist()))
            raise DataError(
                f"{missing.size} class id(s) not in dataset {self.name!r}: {shown}"
                f"{' ...' if missing.size > 10 else ''}; its classes are "
                f"{self.classes.min() if self.classes.size else '-'}.."
                f"{self.classes.max() if self.classes.size else '-'}"
            )
        return self.subset(np.flatnonzero(np.isin(self.labels, ids)))

    def subset_group(self, group: str) -> MetricDataset:
        """The samples of one class group (e.g. ``"background"``) or sample group (``"query"``)."""
        if self.sample_groups is not None and group in set(self.sample_groups.tolist()):
            return self.subset(np.flatnonzero(self.sample_groups == group))
        ids = [c for c, g in self.class_groups.items() if g == group]
        if not ids:
            known = sorted(set(self.class_groups.values()) | set(
                [] if self.sample_groups is None else self.sample_groups.tolist()))
            raise DataError(f"dataset {self.name!r} has no group {group!r}; groups: {known}")
        return self.subset_classes(ids)

    def with_transform(self, transform: Transform | None) -> MetricDataset:
        """The same samples with another transform (a shallow copy; storage is shared)."""
        new = copy.copy(self)
        new.transform = transform
        return new

    # -- identity --------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """A stable hex string identifying the samples and labels (not the transform).

        SHA-256 over the dataset name, the storage fingerprint (array bytes or file paths with
        sizes and modification times) and the selected rows' labels.
        """
        if self._fingerprint is None:
            h = hashlib.sha256()
            h.update(type(self).__name__.encode())
            h.update(path_bytes(self.name))  # a folder's name need not be UTF-8
            h.update(self._storage_fingerprint().encode())
            h.update(self._rows.tobytes())
            h.update(self.labels.tobytes())
            self._fingerprint = h.hexdigest()[:32]
        return self._fingerprint

    def portable_fingerprint(self) -> str:
        """A hex string identifying the samples and labels wherever the data lies: equal for two
        copies of a dataset in different folders or on different machines.

        Unlike :meth:`fingerprint` (a cache key for this copy: absolute paths, modification
        times, inodes), it hashes what a copy keeps of the selected samples: their content as
        the storage gives it without a location (:meth:`_portable_samples_fingerprint`: array
        bytes; image files' paths relative to their common folder and their sizes, no image is
        read), their labels and the classes' names. It depends on these samples alone, so a
        difference elsewhere in the storage leaves another split's fingerprint as it is. The
        ranks of a distributed job compare it, each having read its own copy of the data. Names
        read from the file system (class folders) are hashed as a UTF-8 system spells them
        (:func:`dmlkit.utils.portable_path`), so the fingerprint is the same in every locale.
        Computed once per selection of rows (a run's start compares it across ranks and records
        it in ``split.json``: each a pass over every file's size).
        """
        if self._portable is None:
            h = hashlib.sha256()
            h.update(type(self).__name__.encode())
            h.update(self._portable_samples_fingerprint().encode())
            h.update(self.labels.tobytes())
            names = sorted((c, portable_path(n) if isinstance(n, str) else n) for c, n in self.class_names.items())
            h.update(repr(names).encode())
            self._portable = h.hexdigest()[:32]
        return self._portable

    def thumbnail(self, index: int, size: int | None = 96):
        """The raw sample ``index`` as a PIL image (for reports), at most ``size`` pixels wide."""
        img = self._to_pil(self._raw(self._row(index)))
        if size is not None:
            img = img.copy()
            img.thumbnail((size, size))
        return img

    def _to_pil(self, x: Any):
        return x

    def class_counts(self) -> dict[int, int]:
        """``{class_id: number of samples}``."""
        ids, counts = np.unique(self.labels, return_counts=True)
        return dict(zip(ids.tolist(), counts.tolist()))


# -- in-memory data --------------------------------------------------------------------------
class ArrayDataset(MetricDataset):
    """Samples held in memory in one NumPy array.

    ``kind="image"``: ``data`` is ``(N, H, W)`` (grayscale) or ``(N, H, W, C)`` uint8 (or uint16,
    scaled by ``1 / 65535``, bool, or float in ``[0, 1]``); a transform receives a PIL image, and without a transform ``ds[i]`` is
    a float tensor ``(C, H, W)`` in ``[0, 1]``. Bool images stay bool in memory (True = 255)
    and are converted per sample; ``invert=True`` flips the pixel values (``255 - x``,
    ``65535 - x`` for uint16, ``1 - x`` for float), e.g. for Omniglot whose files store True for the background.
    ``kind="features"``: ``data`` is ``(N, D)``; ``ds[i]`` is a float32 tensor ``(D,)`` (the
    transform, if any, receives that tensor). Used for cached trunk features.
    """

    def __init__(self, data: np.ndarray | torch.Tensor, labels: Sequence[int] | np.ndarray, *,
                 kind: str = "image", invert: bool = False, **kwargs: Any) -> None:
        if isinstance(data, torch.Tensor):
            data = data.detach().cpu().numpy()
        data = np.asarray(data)
        labels = np.asarray(labels)
        if data.shape[0] != labels.shape[0]:
            raise ShapeError(f"data has {data.shape[0]} rows but labels has {labels.shape[0]}")
        if kind not in ("image", "features"):
            raise DataError(f"kind must be 'image' or 'features', got {kind!r}")
        if kind == "image" and data.ndim not in (3, 4):
            raise ShapeError(f"image arrays must be (N, H, W) or (N, H, W, C), got {data.shape}")
        if kind == "image" and data.dtype.kind in "iu" and data.dtype not in (np.uint8, np.uint16):
            # no scale is known: int64 values 0..255 stayed 0..255 in the tensor and were clipped
            # to white in the PIL image a transform receives
            raise DataError(f"image arrays must be uint8, uint16, bool or float in [0, 1], got "
                            f"{data.dtype}: convert them, e.g. data.astype(np.uint8) for values 0..255")
        if kind == "features" and data.ndim != 2:
            raise ShapeError(f"feature arrays must be (N, D), got {data.shape}")
        self.invert = bool(invert)
        self.data = data
        self.kind = kind
        self._storage_cache: dict[str, str] = {}  # shared by views (shallow copies)
        super().__init__(labels, **kwargs)

    def _default_tensor(self, x: Any) -> torch.Tensor:
        if self.kind == "features":
            return torch.from_numpy(np.asarray(x, dtype=np.float32))
        arr = np.asarray(x)
        scale = {np.dtype(np.uint8): 255.0, np.dtype(np.uint16): 65535.0}.get(arr.dtype, 1.0)
        t = torch.from_numpy(arr.astype(np.float32) / np.float32(scale))
        return t.unsqueeze(0) if t.ndim == 2 else t.permute(2, 0, 1).contiguous()

    def _raw(self, row: int) -> Any:
        x = self.data[row]
        if self.kind == "features":
            return x
        if x.dtype == bool:
            return ((x ^ self.invert).astype(np.uint8) * np.uint8(255))
        if self.invert:  # within the dtype's range: 1 - x of a uint16 image was -65534..1
            top = {np.dtype(np.uint8): 255, np.dtype(np.uint16): 65535}.get(x.dtype)
            return (top - x).astype(x.dtype) if top is not None else 1.0 - x
        return x

    def __getitem__(self, index: int) -> tuple[Any, int]:
        row = self._row(index)
        x = self._raw(row)
        if self.kind == "image":
            x = self.transform(self._to_pil(x)) if self.transform is not None else self._default_tensor(x)
        else:
            x = self._default_tensor(x)
            if self.transform is not None:
                x = self.transform(x)
        return x, int(self._all_labels[row])

    def _to_pil(self, x: Any):
        from PIL import Image

        arr = np.asarray(x)
        if self.kind == "features":
            raise DataError("a feature dataset has no images to show; use the image dataset")
        if arr.dtype == np.uint16:  # 16-bit images: scale the full range, never clip
            arr = np.rint(arr / 257.0).astype(np.uint8)
        elif arr.dtype != np.uint8:  # rounded, as to_8bit rounds a float image file (truncation
            # put 504 of 1024 random pixels one level low)
            arr = np.rint(np.clip(arr * 255.0, 0, 255)).astype(np.uint8)
        if arr.ndim == 3 and arr.shape[2] == 1:
            arr = arr[:, :, 0]
        return Image.fromarray(arr)

    def _storage_fingerprint(self) -> str:
        cached = self._storage_cache.get("fingerprint")
        if cached is not None:
            return cached
        h = hashlib.sha256()
        h.update(str((self.kind, self.data.shape, str(self.data.dtype), self.invert)).encode())
        h.update(np.ascontiguousarray(self.data).view(np.uint8).reshape(-1).data)
        self._storage_cache["fingerprint"] = h.hexdigest()
        return self._storage_cache["fingerprint"]

    def _portable_samples_fingerprint(self) -> str:
        """The selected rows' bytes (in blocks of rows: no copy of the whole split), with the
        kind, dtype, sample shape and ``invert``."""
        h = hashlib.sha256()
        h.update(str((self.kind, self.data.shape[1:], str(self.data.dtype), self.invert)).encode())
        for start in range(0, len(self._rows), 4096):
            block = np.ascontiguousarray(self.data[self._rows[start:start + 4096]])
            h.update(block.view(np.uint8).reshape(-1).data)
        return h.hexdigest()

    @property
    def arrays(self) -> np.ndarray:
        """The selected rows as stored (a copy, before ``invert``), e.g. features ``(N, D)``."""
        return self.data[self._rows]


# -- image files -----------------------------------------------------------------------------
def load_image(path: str | os.PathLike, mode: str | None = "RGB"):
    """Open an image with PIL, fully decoded, converted to ``mode`` (``None``: keep).

    Turned upright by its EXIF orientation (:func:`upright_image`); 16-bit and float images
    are scaled to 8 bits first, never clipped (:func:`to_8bit`; multi-channel 16-bit files are
    decoded at full depth, :func:`~dmlkit.data.imaging.full_depth`). Alpha is dropped, not
    composited. Raises :class:`DataError` naming the file when it is missing, truncated, not an
    image, beyond PIL's decompression-bomb limit (``Image.MAX_IMAGE_PIXELS`` x 2) or would be
    blank at 8 bits.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            out = upright_8bit(full_depth(img, path), path)
            if out is img:  # neither decoded anew, turned nor rescaled: detached from the file
                out = img.convert(mode) if mode is not None and img.mode != mode else img.copy()
            elif mode is not None and out.mode != mode:
                out = out.convert(mode)
    except FileNotFoundError as exc:
        raise DataError(f"image file not found: {path}") from exc
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError,
            SyntaxError) as exc:
        raise DataError(
            f"cannot read image {path}: {str(exc).rstrip('.')}. Replace or delete the file, or load the dataset "
            "with skip_corrupt=True to skip unreadable images"
        ) from exc
    return out


class ImageFileDataset(MetricDataset):
    """Samples are image files opened with PIL (converted to ``mode``, ``"RGB"`` by default).

    ``skip_corrupt=False`` (default): an unreadable image raises :class:`DataError` naming the
    file when it is loaded. ``skip_corrupt=True``: every image is decoded once at construction
    (threads), unreadable ones are dropped and listed in ``ds.skipped``, with the reason of each
    in ``ds.skip_reasons`` (a :class:`~dmlkit.data.skipped.SkippedImagesWarning` gives the count
    and one of them; ``dmlkit train``/``bench`` write them all to ``skipped.txt``); when none is
    readable that is a :class:`DataError`.
    """

    def __init__(self, paths: Sequence[str | os.PathLike], labels: Sequence[int] | np.ndarray, *,
                 mode: str | None = "RGB", skip_corrupt: bool = False, num_threads: int = 4,
                 **kwargs: Any) -> None:
        if len(paths) != len(labels):
            raise ShapeError(f"{len(paths)} paths but {len(labels)} labels")
        self._paths = np.asarray([os.fspath(p) for p in paths], dtype=object)
        self.mode = mode
        self.skip_corrupt = skip_corrupt
        self.skipped: list[str] = []
        self.skip_reasons: dict[str, str] = {}
        super().__init__(labels, **kwargs)
        if skip_corrupt and len(self):
            reasons = self._check_readable(num_threads)
            ok = np.asarray([r is None for r in reasons], dtype=bool)
            if not ok.any():  # else an empty dataset, refused later as "0 classes"
                try:
                    load_image(self._paths[0], None)
                    why = ""
                except DataError as exc:  # PIL's reason, without load_image's skip_corrupt hint
                    why = f": {exc.__cause__ or exc}"
                raise DataError(f"{self.name}: none of the {len(ok)} images could be read, e.g. "
                                f"{self._paths[0]}{why}; check the files (are they images, fully "
                                "copied?) or the data root")
            if not ok.all():
                self.skipped = [str(p) for p in self._paths[~ok]]
                self.skip_reasons = {str(p): r for p, r in zip(self._paths.tolist(), reasons, strict=True) if r}
                warnings.warn(
                    f"{self.name}: skipped {len(self.skipped)} unreadable image(s), e.g. "
                    f"{self.skipped[0]} (ds.skipped lists them all)",
                    SkippedImagesWarning,
                    stacklevel=2,
                )
                self._keep_storage(ok)

    def _keep_storage(self, keep: np.ndarray) -> None:
        """Drop the storage rows of skipped files from every per-sample array (``_paths`` and
        each ``_all_*``), so that a row stays a position in the dataset: the ``indices`` of a
        run's embeddings file (:func:`dmlkit.embeddings.dataset_rows`) pointed past skipped
        files at the wrong images."""
        n = len(self._paths)
        for name, value in list(vars(self).items()):
            if (name == "_paths" or name.startswith("_all_")) and isinstance(value, np.ndarray) \
                    and value.shape[:1] == (n,):
                setattr(self, name, value[keep])
        self._rows = np.arange(int(keep.sum()), dtype=np.int64)
        self._refresh()

    def _check_readable(self, num_threads: int) -> list[str | None]:
        """Why each file cannot be read (PIL's reason), ``None`` for a readable one."""
        def why_unreadable(p: str) -> str | None:
            try:
                load_image(p, None)
            except DataError as exc:  # PIL's reason, without load_image's skip_corrupt hint
                return " ".join(str(exc.__cause__ or exc).split())
            return None

        with ThreadPoolExecutor(max_workers=max(1, num_threads)) as pool:
            return list(pool.map(why_unreadable, self._paths.tolist()))

    def _raw(self, row: int) -> Any:
        return load_image(self._paths[row], self.mode)

    def _default_tensor(self, x: Any) -> torch.Tensor:
        # mode=None keeps a file's own mode; the tensor needs intensities in 0..255: a bilevel
        # image ("1") holds 0/1, a palette image ("P") indices, CMYK/YCbCr another colour space
        mode = getattr(x, "mode", None)
        if mode == "1":
            x = x.convert("L")
        elif mode in ("P", "PA"):
            x = x.convert("RGBA" if mode == "PA" or "transparency" in x.info else "RGB")
        elif mode in ("CMYK", "YCbCr", "LAB", "HSV", "RGBX", "RGBa"):
            x = x.convert("RGB")
        arr = np.asarray(x, dtype=np.float32) / 255.0
        t = torch.from_numpy(arr)
        return t.unsqueeze(0) if t.ndim == 2 else t.permute(2, 0, 1).contiguous()

    @property
    def paths(self) -> list[str]:
        return [str(p) for p in self._paths[self._rows]]

    def _storage_fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update(str(self.mode).encode())
        for p in self._paths[self._rows]:
            h.update(path_bytes(p))
            try:
                st = Path(p).stat()
                # nanosecond mtime, inode and ctime: an edit within the same second that keeps
                # the size, or a file replaced by another (rename), changes the fingerprint
                h.update(f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_ctime_ns}".encode())
            except OSError:
                h.update(b"missing")
        return h.hexdigest()

    def _portable_samples_fingerprint(self) -> str:
        """The selected files' paths relative to the folder that holds every file of the storage,
        and their sizes (the bytes are not read: a file replaced by another of the same size goes
        unnoticed); the same for a copy of the data under another root."""
        h = hashlib.sha256()
        h.update(str(self.mode).encode())
        try:
            base = os.path.commonpath([os.path.dirname(p) for p in self._paths]) if len(self._paths) else ""
        except ValueError:  # absolute and relative paths mixed: compare them as given
            base = ""
        for p in self._paths[self._rows]:
            h.update(path_bytes(os.path.relpath(p, base) if base else p))
            try:
                h.update(f":{os.stat(p).st_size}\n".encode())
            except OSError:
                h.update(b":missing\n")
        return h.hexdigest()
