"""Class names and thumbnails for the rows of a saved embeddings file.

A run's and a benchmark fold's ``embeddings/test.npz`` store integer class ids (``labels``), the
rows' positions in the dataset (``indices``) and their files (``paths``), neither the class names
nor the images. The figures of such a file (a benchmark's report, a run's report whose data or
checkpoint cannot be loaded, ``dmlkit plot map|per-class|gallery``) showed "class 14" in empty
gallery boxes, bars labelled 10..19 and maps without thumbnails, although the run report of the
same data named its classes and showed its images. :func:`saved_figure_data` finds them:

* **names**: the file's own ``class_names`` (a file saved with class-name labels), else the run's
  ``split.json`` (``meta.class_names``: the names ``dmlkit train`` and ``dmlkit bench`` record
  for every class id of the split), else the run's dataset as read now (its rows checked as
  below), else the rows' folders when the file's ``paths`` put each class in one folder of its
  own (an image folder's class folders);
* **thumbnails**: the run's dataset as read now (``config.yaml``'s ``data``, ``data_root`` or the
  recorded root), at the rows the file records (``indices``), only where those rows hold the
  file's classes and, where it records them, its files (``paths``): another dataset's images are
  never drawn as these rows'.

What cannot be had is said in :attr:`FigureData.notes`, a sentence each, for the page.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from dmlkit.config import load_config
from dmlkit.embeddings import items_base, relative_paths
from dmlkit.exceptions import DmlkitError
from dmlkit.training.data_root import load_dataset_at, run_data_root
from dmlkit.training.run_identity import read_run_split

__all__ = ["FigureData", "dataset_class_names", "file_class_names", "image_getter", "run_dir_of_file",
           "saved_figure_data"]


@dataclass
class FigureData:
    """What the figures of a saved file can show beyond its ids."""

    #: ``{class id: name}``; ``None``: the figures show ids
    class_names: dict[int, str] | None = None
    #: ``row -> image array in [0, 1]``; ``None``: no thumbnails
    image_of: Callable[[int], np.ndarray] | None = None
    #: why names or thumbnails are missing, or where the names come from
    notes: list[str] = field(default_factory=list)


def dataset_class_names(dataset: Any) -> dict[int, str] | None:
    """``{class id: name}`` of a dataset whose names say more than its ids, else None."""
    names = getattr(dataset, "class_names", None)
    if not names:
        return None
    return _telling({int(c): str(n) for c, n in dict(names).items()})


def _telling(names: dict[int, str]) -> dict[int, str] | None:
    """``names``, or None where every name is its id (the ids are the names)."""
    return None if all(n == str(c) for c, n in names.items()) else names


def file_class_names(extra: Mapping[str, Any]) -> dict[int, str] | None:
    """``{code: name}`` of an embeddings file saved with class-name labels (its
    ``class_names``), None without them or where every name is its code."""
    names = extra.get("class_names")
    return None if names is None else _telling({i: str(n) for i, n in enumerate(np.asarray(names).tolist())})


def image_getter(dataset: Any) -> Callable[[int], np.ndarray] | None:
    """``row -> thumbnail`` (at most 64 pixels, values in [0, 1]) of a dataset of images, else
    None (no ``thumbnail``, features, or a first image that cannot be read)."""
    if dataset is None or not hasattr(dataset, "thumbnail") or len(dataset) == 0:
        return None

    def image_of(i: int) -> np.ndarray:
        img = np.asarray(dataset.thumbnail(int(i), size=64), dtype=np.float32)
        return img / 255.0 if img.max() > 1 else img

    try:
        image_of(0)
    except Exception:  # features or unreadable images: no thumbnails
        return None
    return image_of


def run_dir_of_file(path: str | os.PathLike) -> Path | None:
    """The run (or benchmark fold run) directory an embeddings file belongs to:
    ``RUN_DIR/embeddings/FILE`` or ``RUN_DIR/FILE`` beside a ``config.yaml``; else None."""
    parent = Path(path).parent
    for candidate in ((parent.parent, parent) if parent.name == "embeddings" else (parent,)):
        if (candidate / "config.yaml").is_file():
            return candidate
    return None


def _split_names(run_dir: Path) -> dict[int, str] | None:
    """``meta.class_names`` of the run's ``split.json`` (None: no file or no names in it)."""
    split = read_run_split(run_dir)
    names = None if split is None else split.meta.get("class_names")
    if not isinstance(names, dict):
        return None
    try:
        return {int(c): str(n) for c, n in names.items()}
    except (TypeError, ValueError):  # a hand-edited file: no names rather than wrong ones
        return None


def _folder_names(paths: np.ndarray, labels: np.ndarray) -> dict[int, str] | None:
    """``{class id: folder}`` when every row of a class lies in one folder (the last one of its
    path) and no two classes share one (class folders); else None, also where ``paths`` is
    not one per row (:func:`dmlkit.embedding_files.read_embedding_file` refuses such a file)."""
    if len(paths) != len(labels):  # zip() named only the classes of the rows paths covered
        return None
    folders: dict[int, set[str]] = {}
    for label, path in zip(labels.tolist(), paths.tolist()):
        folders.setdefault(int(label), set()).add(PurePosixPath(str(path).replace(os.sep, "/")).parent.name)
    if any(len(f) != 1 or "" in f for f in folders.values()):
        return None
    names = {c: next(iter(f)) for c, f in folders.items()}
    return names if len(set(names.values())) == len(names) else None


def _dataset_rows(run_dir: Path, labels: np.ndarray, extra: Mapping[str, np.ndarray],
                  data_root: str | os.PathLike | None) -> tuple[Any, str | None]:
    """``(the run's dataset at the file's rows, None)`` or ``(None, why not)``."""
    rows = extra.get("indices")
    if rows is None:
        return None, "the file does not record its rows' places in the dataset"
    rows = np.asarray(rows, dtype=np.int64)
    try:
        config = load_config(run_dir / "config.yaml")
        dataset = load_dataset_at(config.data, data_root, fix="pass --data-root")
    except (DmlkitError, OSError) as exc:
        return None, f"the run's dataset could not be read ({exc})"
    # the file's indices are rows of the dataset's storage (dmlkit.embeddings.dataset_rows)
    storage = np.asarray(getattr(dataset, "_rows", np.arange(len(dataset))), dtype=np.int64)
    where = np.minimum(np.searchsorted(storage, rows), max(len(storage) - 1, 0))
    if rows.shape != labels.shape or not storage.size or not np.array_equal(storage[where], rows):
        return None, "the run's dataset read now does not hold the file's rows (the data changed)"
    sub = dataset.subset(where)
    if not np.array_equal(np.asarray(sub.labels), labels):
        return None, "the run's dataset read now holds other classes at the file's rows (the data changed)"
    stored = extra.get("paths")
    if stored is not None and getattr(sub, "paths", None) is not None:
        root = run_data_root(config.data.root, data_root)
        today = relative_paths(sub.paths, items_base(sub, root))
        if not np.array_equal(today, np.asarray(stored).astype(str)):
            return None, "the run's dataset read now holds other files at the file's rows (the data changed)"
    return sub, None


def saved_figure_data(path: str | os.PathLike, labels: Any, extra: Mapping[str, np.ndarray],
                      run_dir: str | os.PathLike | None = None, *,
                      data_root: str | os.PathLike | None = None, thumbnails: bool = True) -> FigureData:
    """The class names and thumbnails of the rows of the embeddings file ``path`` (its
    ``labels`` and ``extra`` as :func:`~dmlkit.embeddings.load_embeddings` returns them), from
    the sources the module docstring lists, in that order; ``run_dir`` defaults to
    :func:`run_dir_of_file`. The dataset is read only for thumbnails (``thumbnails``) or for
    names that no file holds."""
    labels = np.asarray(labels)
    out = FigureData()
    run = Path(run_dir) if run_dir is not None else run_dir_of_file(path)
    if extra.get("class_names") is not None:  # a file saved with class-name labels: codes
        out.class_names = file_class_names(extra)
        return _with_images(out, run, labels, extra, data_root, thumbnails, names_known=True)
    names_known = False
    if run is not None:
        try:
            recorded = _split_names(run)
        except DmlkitError:  # a damaged split.json: the next source
            recorded = None
        if recorded is not None and set(labels.tolist()) <= set(recorded):
            out.class_names, names_known = _telling(recorded), True
    return _with_images(out, run, labels, extra, data_root, thumbnails, names_known)


def _with_images(out: FigureData, run: Path | None, labels: np.ndarray, extra: Mapping[str, np.ndarray],
                 data_root: str | os.PathLike | None, thumbnails: bool, names_known: bool) -> FigureData:
    """``out`` with the thumbnails (and, where no file named the classes, the names) that the
    run's dataset gives, and the notes of what is missing."""
    dataset, why = (None, "the file is not in a run directory (RUN_DIR/embeddings/)") if run is None else (None, None)
    if run is not None and (thumbnails or not names_known):
        dataset, why = _dataset_rows(run, labels, extra, data_root)
    if dataset is not None and not names_known:
        found = getattr(dataset, "class_names", None)
        if found:
            out.class_names, names_known = dataset_class_names(dataset), True
    if not names_known and extra.get("paths") is not None:
        folders = _folder_names(np.asarray(extra["paths"]).astype(str), labels)
        if folders is not None:
            out.class_names, names_known = _telling(folders), True
            out.notes.append("Classes are named by the folders of their images (the embeddings file's "
                             "paths): no split.json with class names was found and the dataset was not read.")
    if not names_known:
        out.notes.append(f"Classes are shown by their ids: no class names were found ({why or 'none recorded'}).")
    if thumbnails:
        out.image_of = image_getter(dataset)
        if out.image_of is None:
            out.notes.append("No thumbnails: " + (why or "the run's data are not images that can be read") + ".")
    return out
