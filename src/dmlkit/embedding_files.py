"""Read embedding files as stored: ``(embeddings, labels, extra)`` from ``.npz``, ``.npy`` or
``.pt``, and labels files. The one reader behind :func:`dmlkit.embeddings.load_embeddings` and
``dmlkit evaluate``; it imports only numpy for ``.npz``/``.npy`` (torch for ``.pt`` only), so a
small evaluation stays small. Labels are returned as stored, never cast: whether they are
usable is :mod:`dmlkit.validation`'s decision. One exception: an ``.npz`` that holds
``class_names`` beside integer ``labels`` (codes into those names: what ``save_embeddings``
writes for string labels, and what ``load_embeddings`` returns for them) gives the names, so
that two such files with different name tables are compared by name, not by code."""

from __future__ import annotations

import csv
import io
import os
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from dmlkit.exceptions import DataError, DataNotFoundError
from dmlkit.label_text import clean_labels, integer_ids
from dmlkit.utils import read_utf8_text

__all__ = ["ROW_ARRAYS", "check_numpy_file", "read_embedding_file", "read_labels_file", "repeated_name"]


def read_embedding_file(path: str | os.PathLike, labels_path: str | os.PathLike | None = None,
                        *, labels_required: bool = True
                        ) -> tuple[np.ndarray, np.ndarray | None, dict[str, np.ndarray]]:
    """``(embeddings, labels, extra arrays)`` as stored; ``labels_path`` (``.npy``/``.txt``/
    ``.csv``) replaces the file's labels. Every unreadable file is one :class:`DataError`.
    With ``labels_required=False`` a file without labels gives ``labels = None``."""
    path = Path(path)
    if not path.exists():
        raise DataNotFoundError(f"embeddings file not found: {path}")
    if path.is_dir():
        if (path / "manifest.json").is_file():  # what dmlkit embed --format shards writes
            raise DataError(f"{path} is a shard directory (dmlkit embed --format shards); this reads one "
                            "embeddings file: write one with `dmlkit embed ... --format npz` (dmlkit "
                            "evaluate and dmlkit index read shard directories)")
        if (path / "config.yaml").is_file() and (path / "checkpoints").is_dir():
            raise DataError(f"{path} is a run directory of dmlkit train, not embeddings: pass its "
                            f"embeddings file ({path / 'embeddings' / 'test.npz'}, or write one with "
                            f"`dmlkit embed {path} --split val`)")
        raise DataError(f"{path} is a directory without a shard manifest.json: not embeddings, or a "
                        "shard write that was interrupted (write it again)")
    suffix = path.suffix.lower()
    labels: Any = None
    extra: dict[str, np.ndarray] = {}
    try:
        if suffix in (".npz", ".npy"):
            check_numpy_file(path, suffix, "embeddings")
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as data:
                if "embeddings" not in data.files:
                    raise DataError(f"{path} has no 'embeddings' array (keys: {sorted(data.files)})")
                emb = data["embeddings"]
                labels = data["labels"] if "labels" in data.files else None
                extra = {k: data[k] for k in data.files if k not in ("embeddings", "labels")}
        elif suffix == ".npy":
            emb = np.load(path, allow_pickle=False)
        elif suffix in (".pt", ".pth"):
            emb, labels = _read_torch_file(path)
        else:
            raise DataError(f"unsupported embeddings file {path}: use .npz, .npy or .pt")
    except zipfile.BadZipFile:  # a zip cut short (an interrupted copy) or damaged
        raise DataError(f"cannot read embeddings from {path}: it is not a readable .npz file (a "
                        "damaged or truncated zip archive)") from None
    except (OSError, ValueError, EOFError) as exc:
        raise DataError(f"cannot read embeddings from {path}: {' '.join(str(exc).split())[:200]}") from None
    _check_row_arrays(path, emb, extra)
    if labels_path is not None:
        if labels is not None:  # said, not silent: the file's own labels are not the ones used
            warnings.warn(f"{labels_path} replaces the {np.size(labels)} labels stored in {path}",
                          stacklevel=2)
        labels = read_labels_file(Path(labels_path))
    elif labels is not None and "class_names" in extra:
        labels = _named_labels(path, np.asarray(labels), np.asarray(extra["class_names"]))
    if labels is None and labels_required:
        raise DataError(f"{path} has no labels: save an .npz with 'embeddings' and 'labels', or pass a labels file")
    return np.asarray(emb), None if labels is None else np.asarray(labels), extra


#: Extra arrays of an ``.npz`` that hold one value per embedding row (what ``dmlkit train`` /
#: ``embed`` write: :func:`dmlkit.embeddings.dataset_items`; ``dmlkit reid``'s camera ids and
#: query/gallery groups; an index's item ids).
ROW_ARRAYS = ("indices", "paths", "file_sizes", "ids", "cams", "camids", "groups")


def _check_row_arrays(path: Path, emb: Any, extra: dict[str, np.ndarray]) -> None:
    """Refuse, in one line, a per-row extra array (:data:`ROW_ARRAYS`) without one value per
    embedding row: which value belongs to which row is then unknown (a hand-edited file whose
    ``paths`` lost rows had the report name only the classes of the rows it still covered)."""
    n = np.shape(emb)[0] if np.ndim(emb) else None
    for key in ROW_ARRAYS:
        if n is None or key not in extra:
            continue
        values = extra[key]
        if values.ndim == 0 or values.shape[0] != n:
            has = "is one value" if values.ndim == 0 else f"has {values.shape[0]} values"
            raise DataError(f"{path}: '{key}' {has} for {n} embeddings: give one per row (in the "
                            f"order of the embedding rows), or drop '{key}'")


_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a zip's first entry, or an empty zip
_NPY_MAGIC = b"\x93NUMPY"


def check_numpy_file(path: Path, suffix: str, what: str) -> None:
    """Refuse, in one line, an ``.npz``/``.npy`` whose first bytes are not what its suffix says.
    ``np.load`` takes any such file for a pickle ("contains pickled (object) data ...
    allow_pickle"), which sends the user after a setting instead of a damaged file; an ``.npy``
    named ``.npz`` would load as an array without ``.files``."""
    with open(path, "rb") as fh:
        head = fh.read(6)
    if not head:
        raise DataError(f"cannot read {what} from {path}: the file is empty (0 bytes)")
    if suffix == ".npz" and head[:4] in _ZIP_MAGIC:
        return
    if suffix == ".npy" and head == _NPY_MAGIC:
        return
    kind = ("an .npy array, not an .npz archive: rename it to .npy" if head == _NPY_MAGIC else
            "an .npz archive, not an .npy array: rename it to .npz" if head[:4] in _ZIP_MAGIC else
            f"not a readable {suffix} file (damaged, truncated, or another kind of file)")
    raise DataError(f"cannot read {what} from {path}: it is {kind}")


def _named_labels(path: Path, labels: np.ndarray, names: np.ndarray) -> np.ndarray:
    """The class names of an ``.npz``'s integer ``labels``, codes into its ``class_names``
    (codes of two files with different name tables name different classes: compared as codes,
    'd' of one file matched 'e' of the other); labels that are not such codes are refused."""
    if labels.dtype.kind not in "iu" or names.ndim != 1:
        return labels  # names already, or not a code table: validation decides
    twice = repeated_name(names.tolist())
    if twice is not None:  # two codes would read as one class
        raise DataError(f"{path}: its class_names holds {twice!r} twice, so two classes would merge; "
                        "save each class name once")
    if labels.size and (int(labels.min()) < 0 or int(labels.max()) >= names.shape[0]):
        raise DataError(f"{path}: its labels (from {int(labels.min())} to {int(labels.max())}) are not "
                        f"codes into its {names.shape[0]} class_names; save the labels as names, or "
                        "drop class_names")
    return names[labels]


def repeated_name(names: list[Any]) -> Any | None:
    """The first entry of ``names`` that an earlier one repeats (as strings), or ``None``: a
    class-name table naming two codes alike would merge their classes."""
    seen: set[str] = set()
    for name in names:
        if str(name) in seen:
            return name
        seen.add(str(name))
    return None


def _read_torch_file(path: Path) -> tuple[np.ndarray, Any]:
    import torch  # a .pt file needs torch; .npz/.npy files never load it

    from dmlkit.models.trunks import load_failure_reason  # lazy: torch-only error wording

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # unpickling refused, truncated zip, not a torch file
        raise DataError(f"cannot read embeddings from {path}: {load_failure_reason(exc)}") from None
    labels = None
    if isinstance(obj, dict):
        if "embeddings" not in obj:
            raise DataError(f"{path} holds a dict without 'embeddings' (keys: {sorted(obj)})")
        emb, labels = obj["embeddings"], obj.get("labels")
    elif isinstance(obj, tuple | list) and len(obj) == 2:
        emb, labels = obj
    else:
        emb = obj

    def to_numpy(x: Any) -> np.ndarray:
        if isinstance(x, torch.Tensor):
            x = x.detach().cpu()
            # float64 kept (as from an .npz), so validation names values beyond float32's range
            # (they were cast to inf here and refused as "NaN or infinity")
            wide = x.dtype.is_floating_point and x.dtype not in (torch.float32, torch.float64)
            return (x.float() if wide else x).numpy()
        return np.asarray(x)

    return to_numpy(emb), None if labels is None else to_numpy(labels)


def read_labels_file(path: Path) -> np.ndarray:
    """Labels from ``.npy`` or a text file with one label per line: the line in a ``.txt``
    (a class name may hold commas and inner spaces), the first field in a ``.csv`` (:mod:`csv`
    quoting), without the whitespace around it (:func:`dmlkit.label_text.clean_labels`: two
    labels that differ only in it are refused). The labels are integer ids (``3.0`` counts as
    3, as for float labels in an ``.npz``) when every one is an integer and no two different
    lines read as one (:func:`dmlkit.label_text.integer_ids`, the dataset CSV's rule: ``1`` and
    ``01`` are two class names); a number that is not an integer is refused; otherwise every
    line is a class name. Blank lines at the end are ignored; a blank line before the last
    label is refused."""
    if not path.exists():
        raise DataNotFoundError(f"labels file not found: {path}")
    try:
        if path.suffix.lower() == ".npy":
            check_numpy_file(path, ".npy", "labels")
            return np.load(path, allow_pickle=False)
        # a byte-order mark (Notepad, Excel) is not part of the first label
        text = read_utf8_text(path, "save the labels as UTF-8 text")
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read labels from {path}: {' '.join(str(exc).split())[:200]}") from None
    if path.suffix.lower() == ".csv":
        try:
            raw = [row[0] if row else "" for row in csv.reader(io.StringIO(text))]
        except csv.Error as exc:
            raise DataError(f"{path} is not a valid CSV file: {exc}") from None
    else:
        raw = text.splitlines()
    values = clean_labels(raw, str(path))
    while values and not values[-1]:
        values.pop()
    if "" in values:
        raise DataError(f"{path}: line {values.index('') + 1} is blank; give one label per line, "
                        "one line per embedding")
    numbers = [_as_number(v) for v in values]
    for line, (v, n) in enumerate(zip(values, numbers), start=1):
        if n is not None and not float(n).is_integer():  # 0.5, nan, inf: never truncated
            raise DataError(f"{path}: label {v!r} on line {line} is a number but not an integer; "
                            "labels are integer class ids or class names, one per line")
    ids = integer_ids(values, [None if n is None else int(n) for n in numbers])
    if ids is not None:
        big = next((line for line, n in enumerate(ids, start=1) if not -2**63 <= n < 2**63), None)
        if big is not None:  # numpy's OverflowError (a traceback) before
            raise DataError(f"{path}: label {values[big - 1]!r} on line {big} is beyond int64's range; "
                            "labels are integer class ids or class names, one per line")
        return np.asarray(ids, dtype=np.int64)
    return np.asarray(values)  # class names


#: A number as a labels file writes one: ASCII digits, a sign, a decimal point, an exponent,
#: ``nan``/``inf`` (Python's ``int``/``float`` also take ``1_2`` as 12 and non-ASCII digits,
#: which merged the class named "1_2" into class 12).
_NUMBER = re.compile(r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|nan|inf|infinity)",
                     re.IGNORECASE)


def _as_number(text: str) -> int | float | None:
    """``text`` as an int, else a float (``nan`` and ``inf`` too), else ``None``: a name."""
    text = text.strip()
    if not _NUMBER.fullmatch(text):
        return None
    try:
        return int(text)
    except ValueError:
        return float(text)


