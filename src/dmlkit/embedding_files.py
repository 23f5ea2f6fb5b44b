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

from dmlkit.exceptions import ConfigError, DataError, DataNotFoundError
from dmlkit.label_text import clean_labels, integer_ids
from dmlkit.utils import read_utf8_text

__all__ = ["DATASET_ID", "ROW_ARRAYS", "check_numpy_file", "read_embedding_file", "read_labels_file",
           "repeated_name", "shared_items", "without_shared_items"]


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




#: The key of the data set a run's ``indices`` number (:func:`dmlkit.embeddings.dataset_items`):
#: the same index means the same item only in the same data set.
DATASET_ID = "dataset_id"
#: Between an item's id and its label in :func:`_item_keys` (no path or label holds it).
_KEY_SEP = "\x1f"


def shared_items(query_labels: Any, query_extra: dict[str, Any], reference_labels: Any,
                 reference_extra: dict[str, Any]) -> tuple[np.ndarray, np.ndarray] | None:
    """``(query rows also in the reference, reference rows also in the query)`` as boolean masks,
    or ``None`` where the two files' items cannot be matched. An item is its ``paths`` entry
    (an absolute path as the other file's relative path that it ends with, :func:`_as_relative`),
    else, where both files record :data:`DATASET_ID` alike, its ``indices`` entry (a row of that
    data set), **and** its label (a path or row of another data set with the same layout names
    another item). ``labels`` as :func:`read_embedding_file` / ``load_embeddings`` return them."""
    key = "paths" if all(e.get("paths") is not None for e in (query_extra, reference_extra)) else None
    if key is None and all(e.get("indices") is not None and e.get(DATASET_ID) is not None
                           for e in (query_extra, reference_extra)):
        same = str(np.asarray(query_extra[DATASET_ID])) == str(np.asarray(reference_extra[DATASET_ID]))
        key = "indices" if same else None
        if not same:  # two data sets: no row of one is a row of the other
            return np.zeros(len(query_labels), bool), np.zeros(len(reference_labels), bool)
    if key is None:
        return None
    q_keys, r_keys = (_item_keys(e[key], lab) for e, lab in ((query_extra, query_labels),
                                                             (reference_extra, reference_labels)))
    if key == "paths":
        q_keys, r_keys = _as_relative(q_keys, r_keys), _as_relative(r_keys, q_keys)
    return np.isin(q_keys, r_keys), np.isin(r_keys, q_keys)


def without_shared_items(query_labels: Any, query_extra: dict[str, Any], reference: Any, reference_labels: Any,
                         reference_extra: dict[str, Any], shared: str | None = None, *,
                         reference_name: str = "the reference set", spell: str = 'shared_items="{}"',
                         ) -> tuple[Any, Any]:
    """``(reference, reference_labels)`` checked for query items they hold too
    (:func:`shared_items`): each such query can retrieve another embedding of its own item
    (another model's, device's, a copy's; 1e-5 apart: P@1 100 % against 50 % left out), which
    inflates every retrieval metric. ``shared=None`` refuses them (:class:`DataError`, naming
    the count, an example and the ways out); ``"keep"`` counts them, with a warning; ``"drop"``
    leaves them out of the reference (refused where nothing is left). Files whose items cannot
    be matched pass unchanged (``shared`` given then: :class:`ConfigError`, it would be
    unused). ``spell``: how messages write an option value (``dmlkit evaluate``: its flag)."""
    if shared not in (None, "drop", "keep"):
        raise ConfigError(f"{spell.format(shared)}: choose drop or keep")
    found = shared_items(query_labels, query_extra, reference_labels, reference_extra)
    if found is None:
        if shared is not None:
            name = spell.split("{")[0].strip(' ="')
            raise ConfigError(f"{name} matches query and reference items by the 'paths' (or the 'indices' and "
                              f"'{DATASET_ID}') both files record, and they do not both record them: drop {name}")
        return reference, reference_labels
    in_query, in_reference = found
    if not in_query.any():
        return reference, reference_labels
    by = "paths" if query_extra.get("paths") is not None and reference_extra.get("paths") is not None else "indices"
    example = str(np.asarray(reference_extra[by])[in_reference][0])
    said = (f"{int(in_query.sum())} of the {len(in_query)} query items are also in {reference_name} (the same items by "
            f"the {by} and labels both files record, e.g. {example!r}): each can retrieve another embedding of its own "
            "image, which inflates every retrieval metric (P@1 up to 100 %)")
    if shared is None:
        raise DataError(f"{said}; evaluate the query file alone (each query left out of its own neighbours), or pass "
                        f"{spell.format('drop')} (leave them out of the reference set) or {spell.format('keep')} "
                        "(count them as they are)")
    if shared == "keep":
        warnings.warn(f"{said}; counted as they are ({spell.format('keep')})", stacklevel=2)
        return reference, reference_labels
    if in_reference.all():
        raise DataError(f"{said}, and every reference item is one of them: {spell.format('drop')} leaves no "
                        "reference; evaluate the query file alone (each query left out of its own neighbours)")
    warnings.warn(f"left the {int(in_reference.sum())} reference items that are query items out of {reference_name} "
                  f"({spell.format('drop')})", stacklevel=2)
    return np.asarray(reference)[~in_reference], np.asarray(reference_labels)[~in_reference]


def _item_keys(items: Any, labels: Any) -> np.ndarray:
    """One string per item, its id (path or row) and its label (as read: the class names of a
    file that records them, else the ids, integers compared as such)."""
    labels = np.asarray(labels)
    text = (labels.astype(np.int64) if labels.dtype.kind in "iub" else labels).astype(str)
    return np.char.add(np.char.add(np.asarray(items).astype(str), _KEY_SEP), text)


def _as_relative(keys: Any, other: Any) -> np.ndarray:
    """``keys`` (:func:`_item_keys`) with each absolute path spelled as the longest relative
    path of the ``other`` file's keys that it ends with (after a separator), labels equal: an
    older ``csv`` run's file stores absolute paths, a newer one's the same items relative to the
    list's image folder, and they were compared as text (no item shared: P@1 read 100 %)."""
    keys = np.asarray(keys).astype(str).astype(object)
    relative = {k for k in np.asarray(other).astype(str).tolist() if not os.path.isabs(k)}
    absolute = [i for i, k in enumerate(keys.tolist()) if os.path.isabs(k)] if relative else []
    for i in absolute:
        path, _, label = keys[i].rpartition(_KEY_SEP)
        for cut in (j for j, c in enumerate(path) if c == os.sep):  # longest suffix first
            if f"{path[cut + 1:]}{_KEY_SEP}{label}" in relative:
                keys[i] = f"{path[cut + 1:]}{_KEY_SEP}{label}"
                break
    return keys.astype(str)
