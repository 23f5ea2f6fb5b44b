"""The on-disk form of an :class:`~dmlkit.apps.index.EmbeddingIndex`, and where item ids come from.

* :func:`save_index` / :func:`load_index`: a directory (``index.json``, ``vectors.npy``,
  ``keys.npy``, ``ids.npy``, ``labels.npy``, ``class_names.npy``, ``trained_keys.npy``,
  ``metadata.jsonl``, ``faiss.index``; written beside the target and renamed into place) or one ``.npz``; format v1
  files still load, as do v2 files written before ``trained_keys`` was saved (an IVF index
  then counts every row as a training row, so its re-measured recall is not held-out).
* :func:`item_ids`: the ids of an embeddings file's rows (their dataset paths when the file
  comes from a run), so query results map back to files, and the facts of their source (the
  run, :func:`run_facts`; the data root); :func:`run_item_files`: those files on this machine,
  :func:`check_embedded_files`: that they are the files it embedded (their sizes);
  :func:`file_under_root`: an id as a file under a data root.
"""

from __future__ import annotations

import io
import json
import mmap as mmap_module
import os
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dmlkit import __version__
from dmlkit.apps.index_faiss import _metric, to_gpu
from dmlkit.data import ClassSplit, load_dataset
from dmlkit.data.pairs import lfw_folder
from dmlkit.embedding_files import check_numpy_file
from dmlkit.embeddings import FILE_SIZES, file_sizes, items_base, relative_paths
from dmlkit.exceptions import DataError, DataNotFoundError, DmlkitError, require
from dmlkit.training import load_config
from dmlkit.utils import (
    atomic_write_bytes,
    fsync_path,
    local_path,
    os_error_message,
    process_alive,
    sha256_file,
)
from dmlkit.utils import data_root as resolve_root

if TYPE_CHECKING:
    from dmlkit.apps.index import EmbeddingIndex

__all__ = ["FORMAT", "check_embedded_files", "file_under_root", "index_meta", "item_ids", "load_index",
           "run_facts", "run_identity", "run_item_files", "save_index"]

FORMAT_V1 = "dmlkit-index-v1"
FORMAT = "dmlkit-index-v2"
_IVF_KINDS = ("ivf_flat", "ivf_pq")
#: The arrays of a saved index (``class_names``: of string labels; ``trained_keys``: IVF kinds;
#: both absent from older files).
_ARRAYS = ("vectors", "keys", "ids", "labels", "class_names", "trained_keys")


def index_meta(self: EmbeddingIndex) -> dict[str, Any]:
    """The ``index.json`` of an index: kind, distance, settings, measured recall, info."""
    return {"format": FORMAT, "kind": self.kind, "distance": self.distance, "normalize": self.normalize,
            "dim": self.dim,
            "count": len(self), "params": self.params, "recall": self.recall, "info": self.info,
            "next_key": self._next_key, "dmlkit_version": __version__}

def _is_index_file(path: Path) -> bool:
    """Whether ``path`` is an index written by :func:`save_index` (an ``.npz`` with its ``meta``)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return {"meta.npy", "vectors.npy"} <= set(archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def save_index(self: EmbeddingIndex, path: str | os.PathLike) -> Path:
    """Write the index: a directory, or one ``.npz`` file when ``path`` ends in ``.npz``.

    The directory holds ``index.json`` (kind, distance, settings, measured recall, info),
    ``vectors.npy``, ``keys.npy``, ``ids.npy``, ``labels.npy``, ``class_names.npy`` (string
    labels: the names of the label codes), ``trained_keys.npy`` (IVF
    kinds: the keys of the rows the quantiser was trained on), ``metadata.jsonl`` and
    ``faiss.index``; it is written beside the target, every file and the folder flushed to
    disk (fsync), renamed into place, and the parent folder flushed before the old index is
    deleted: after a crash or power loss the path holds the old index or the complete new one
    (before, nothing was flushed, and a renamed folder could hold ``index.json`` beside empty
    vectors while the old index was gone).
    """
    path = Path(path)
    arrays: dict[str, np.ndarray] = {"vectors": self.embeddings, "keys": self._keys, "ids": self.ids}
    if self.labels is not None:
        arrays["labels"] = self.labels
        if self.class_names is not None:  # string labels: the names of the stored codes
            arrays["class_names"] = np.asarray(self.class_names, dtype=str)
    if self.kind in _IVF_KINDS:  # the rows the quantiser saw: a reloaded index's recall stays honest
        arrays["trained_keys"] = self._trained_keys
    blob = self._faiss_bytes()
    meta_lines = None
    if self.metadata is not None:
        meta_lines = "\n".join(json.dumps(m) for m in self.metadata)
    if path.suffix == ".npz":
        if path.is_file() and not _is_index_file(path):
            raise DataError(f"{path} exists and is not a dmlkit index file: choose another path")
        extra: dict[str, Any] = {"meta": np.array(json.dumps(index_meta(self)))}
        if blob is not None:
            extra["faiss"] = blob
        if meta_lines is not None:
            extra["metadata"] = np.array(meta_lines)
        buffer = io.BytesIO()
        np.savez(buffer, **arrays, **extra)
        return atomic_write_bytes(path, buffer.getvalue())
    if path.exists() and not (path / "index.json").exists() and any(path.iterdir()):
        raise DataError(f"{path} exists and is not a dmlkit index directory: choose another path")
    _recover_interrupted_save(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        for name, arr in arrays.items():
            np.save(tmp / f"{name}.npy", arr, allow_pickle=False)
        if blob is not None:
            (tmp / "faiss.index").write_bytes(blob.tobytes())
        if meta_lines is not None:
            (tmp / "metadata.jsonl").write_text(meta_lines + "\n")
        # index.json last, renamed into place: a folder holding it is a complete index
        (tmp / ".index.json.part").write_text(json.dumps(index_meta(self), indent=2))
        for part in tmp.iterdir():  # on disk before any rename can make them the index
            fsync_path(part)
        (tmp / ".index.json.part").rename(tmp / "index.json")
        fsync_path(tmp)
    except OSError as exc:  # a full or read-only disk: nothing half-written is left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(os_error_message(exc, path, writing=True)) from None
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    fsync_path(path.parent)  # the renames, before the old index is deleted
    shutil.rmtree(old, ignore_errors=True)
    return path


def _recover_interrupted_save(path: Path) -> None:
    """Put back the index a :func:`save_index` killed between its two renames left beside
    ``path`` (no index at ``path``; the new one complete as ``.NAME.tmp-PID``, the one it
    replaces as ``.NAME.old-PID``): the newest complete one, so a kill loses no index; then
    remove what killed saves left (folders of processes no longer running)."""
    leftovers = [d for pattern in (f".{path.name}.tmp-*", f".{path.name}.old-*")
                 for d in path.parent.glob(pattern) if d.is_dir() and not _pid_alive(d.name.rsplit("-", 1)[-1])]
    complete = [d for d in leftovers if (d / "index.json").is_file()]
    if not path.exists() and complete:
        max(complete, key=lambda d: (d / "index.json").stat().st_mtime_ns).rename(path)
    for d in leftovers:
        shutil.rmtree(d, ignore_errors=True)


def _pid_alive(pid: str) -> bool:
    """Whether process ``pid`` (text) runs on this machine (a name that is no pid: not ours)."""
    return not pid.isdigit() or process_alive(int(pid))

def _random_access(vectors: np.ndarray) -> np.ndarray:
    """Tell the kernel that a memory-mapped matrix is read at random rows (``MADV_RANDOM``):
    searches read scattered rows (IVF-PQ's re-ranked candidates), and the default read-ahead
    around a fault on a page not yet cached would read far more of the file than those rows."""
    handle = getattr(vectors, "_mmap", None)
    if handle is not None and hasattr(mmap_module, "MADV_RANDOM"):
        handle.madvise(mmap_module.MADV_RANDOM)
    return vectors


def load_index(cls: type[EmbeddingIndex], path: str | os.PathLike, *, mmap: bool = False) -> EmbeddingIndex:
    """Read an index written by :meth:`save` (directory or ``.npz``; v1 files too).

    ``mmap=True`` memory-maps the vectors of a directory index instead of reading them.
    """
    path = Path(path)
    _recover_interrupted_save(path)
    if not path.exists():
        raise DataNotFoundError(f"index not found: {path} (build one with `dmlkit index`)")
    try:
        return _load_index(cls, path, mmap)
    except DmlkitError:
        raise
    except (OSError, ValueError, KeyError, TypeError, EOFError, RuntimeError, zipfile.BadZipFile) as exc:
        # truncated or hand-edited files: numpy, json and faiss raise their own errors
        reason = " ".join(str(exc).split())[:160] or type(exc).__name__
        raise DataError(f"{path} is a damaged index ({reason}): rebuild it with `dmlkit index`") from None


def _check_index_file(path: Path, suffix: str) -> None:
    """Refuse an index file that is no ``suffix`` file (:func:`check_numpy_file`) as damaged:
    ``np.load`` took it for a pickle and told the user to load it with ``allow_pickle``."""
    try:
        check_numpy_file(path, suffix, "a dmlkit index")
    except DataError as exc:
        raise DataError(f"{exc}; rebuild it with `dmlkit index`") from None


def _load_index(cls: type[EmbeddingIndex], path: Path, mmap: bool) -> EmbeddingIndex:
    """:func:`load_index` of an existing path."""
    if path.is_dir():
        meta_file = path / "index.json"
        if not meta_file.exists():
            raise DataError(f"{path} is not a dmlkit index directory (no index.json): build one with `dmlkit index`")
        meta = json.loads(meta_file.read_text())

        def arr(name: str) -> np.ndarray | None:
            f = path / f"{name}.npy"
            if not f.exists():
                return None
            _check_index_file(f, ".npy")
            if mmap and name == "vectors":
                return _random_access(np.load(f, allow_pickle=False, mmap_mode="r"))
            return np.load(f, allow_pickle=False)

        data = {n: arr(n) for n in _ARRAYS}
        mfile = path / "metadata.jsonl"
        metadata = [json.loads(line) for line in mfile.read_text().splitlines()] if mfile.exists() else None
        ffile = path / "faiss.index"
        blob = np.fromfile(ffile, dtype=np.uint8) if ffile.exists() else None
    else:
        _check_index_file(path, ".npz")
        try:
            npz = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise DataError(f"{path} is not a dmlkit index: {exc}") from exc
        with npz as z:
            if "meta" not in z:
                raise DataError(f"{path} is not a dmlkit index (build one with `dmlkit index`)")
            meta = json.loads(str(z["meta"]))
            if meta.get("format") == FORMAT_V1:
                return cls(z["embeddings"], z["labels"] if "labels" in z else None,
                           z["ids"] if "ids" in z else None, distance=meta["distance"])
            data = {n: z[n] if n in z else None for n in _ARRAYS}
            metadata = ([json.loads(line) for line in str(z["metadata"]).splitlines()]
                        if "metadata" in z else None)
            blob = z["faiss"] if "faiss" in z else None
    if meta.get("format") != FORMAT:
        raise DataError(f"{path}: unknown index format {meta.get('format')!r}; rebuild it with `dmlkit index`")
    return _from_parts(cls, meta, data, metadata, blob, path)

def _from_parts(cls: type[EmbeddingIndex], meta: dict[str, Any], data: dict[str, Any], metadata: Any, blob: Any,
                path: Path) -> EmbeddingIndex:
    p = dict(meta["params"])
    self = cls(None, distance=meta["distance"], kind=meta["kind"], dim=int(meta["dim"]),
               info=meta.get("info"), normalize=bool(meta.get("normalize", True)), **{k: p[k] for k in ("pq_nbits", "hnsw_m", "ef_construction",
                                                             "rerank", "ef_search", "gpu", "seed")})
    self.params.update(p)
    vectors, keys, ids = data["vectors"], data["keys"], data["ids"]
    if vectors is None or keys is None or ids is None:
        raise DataError(f"{path} is incomplete (vectors, keys and ids are needed): rebuild it")
    n = vectors.shape[0]
    if keys.shape != (n,) or ids.shape != (n,) or (data["labels"] is not None and data["labels"].shape != (n,)):
        raise DataError(f"{path} is corrupt: vectors, keys, ids and labels disagree in length")
    if metadata is not None and len(metadata) != n:
        raise DataError(f"{path} is corrupt: {len(metadata)} metadata lines for {n} items")
    self.embeddings, self._keys, self.ids = vectors, np.asarray(keys, dtype=np.int64), ids.astype(str)
    self.ids, self.info = _as_run_ids(self.ids, self.info)
    _check_rows(path, self, int(meta["next_key"]))
    self.labels = None if data["labels"] is None else np.asarray(data["labels"], dtype=np.int64)
    names = data["class_names"]
    if names is not None:
        self.class_names = np.asarray(names).astype(str)
        if self.labels is None or (n and (self.labels.min() < 0 or self.labels.max() >= len(names))):
            raise DataError(f"{path} is corrupt: its labels are not codes of its {len(names)} class names")
    self.metadata = metadata
    if self.kind in _IVF_KINDS:  # saved without them (older files): any row may be a training row
        trained = data["trained_keys"]
        self._trained_keys = self._keys.copy() if trained is None else np.asarray(trained, dtype=np.int64)
    self._next_key = int(meta["next_key"])
    self.recall = meta.get("recall")
    if blob is not None:
        faiss = require("faiss", "faiss")
        index = faiss.deserialize_index(np.ascontiguousarray(blob, dtype=np.uint8))
        if index.ntotal != n:
            raise DataError(f"{path} is corrupt: the faiss index holds {index.ntotal} vectors, not {n}")
        _check_metric(path, self, index)
        self._faiss_index = to_gpu(self, index)
    elif self.kind != "flat" and n:  # an empty one has no structure yet: its first add makes it
        raise DataError(f"{path} is a {self.kind} index without its faiss.index file: rebuild it")
    return self


def _check_metric(path: Path, index: EmbeddingIndex, structure: Any) -> None:
    """Refuse a faiss structure built for another distance than ``index.json`` names (a
    hand-edited ``distance``: a cosine graph loaded as ``euclidean`` answered with the inner
    product's neighbours, silently). Wrappers (``IndexIDMap2``, ...) and what they wrap are
    each checked."""
    faiss = require("faiss", "faiss")
    want = _metric(index.distance)
    while structure is not None:
        if int(structure.metric_type) != want:
            raise DataError(f"{path} is a damaged index (its faiss structure is not built for the {index.distance} "
                            "distance index.json names): rebuild it with `dmlkit index`")
        inner = getattr(structure, "index", None)
        structure = None if inner is None else faiss.downcast_index(inner)


def _check_rows(path: Path, index: EmbeddingIndex, next_key: int) -> None:
    """Refuse a hand-edited or damaged index whose rows would answer wrongly without an error:
    duplicate ids (an id then found another item's row), keys not increasing below
    ``next_key`` (a search then read past the vectors), non-finite vectors (read in memory:
    a NaN row was never returned by a flat index and returned first by HNSW; a memory-mapped
    index checks the rows a search reads, :mod:`dmlkit.apps.index_exact`)."""
    keys, ids = index._keys, index.ids
    if keys.size and (keys[0] < 0 or keys[-1] >= next_key or np.any(np.diff(keys) <= 0)):
        raise DataError(f"{path} is corrupt: its row keys are not increasing below {next_key}: rebuild it")
    try:
        index._positions()  # the id table every lookup uses, built here once (it refuses repeats)
    except DataError as exc:
        raise DataError(f"{path}: {exc}") from None
    vectors = index.embeddings
    if not isinstance(vectors, np.memmap):
        for a in range(0, vectors.shape[0], 65536):
            block = vectors[a:a + 65536]
            if not np.isfinite(block).all():
                row = a + int(np.flatnonzero(~np.isfinite(block).all(axis=1))[0])
                raise DataError(f"{path} is corrupt: vector {row} (id {str(ids[row])!r}) is not finite: "
                                "rebuild it")


def item_ids(path: str | os.PathLike, extra: dict[str, np.ndarray], data_root: str | os.PathLike | None = None,
             labels: np.ndarray | None = None) -> tuple[np.ndarray | None, dict[str, Any]]:
    """Identifiers of the rows of an embeddings file, and facts for the index's ``info``.

    For ``RUN_DIR/embeddings/<split>.npz`` written by ``dmlkit train``/``embed`` (dataset rows
    as ``indices``): the items' file paths relative to the data root (stable across machines),
    :func:`_run_item_ids`. Else the file's ``paths`` or ``ids`` array; else the ``indices`` as
    strings; else ``None`` (row numbers).
    """
    run_dir = Path(path).resolve().parent.parent
    if "indices" in extra and (run_dir / "config.yaml").exists():
        return _run_item_ids(path, run_dir, extra, data_root, labels)
    for key in ("paths", "ids"):
        if key in extra:
            return np.asarray(extra[key]).astype(str), {}
    if "indices" not in extra:
        return None, {}
    return np.asarray(extra["indices"], dtype=np.int64).astype(str), {}


def run_identity(run_dir: str | os.PathLike) -> str | None:
    """The digest of a run's ``provenance.json`` (written once when the run starts: its time,
    seed and first folder), ``None`` without one: equal for a copy of the run in another
    folder or on another machine, different for any other run."""
    try:
        return sha256_file(Path(run_dir) / "provenance.json")[:16]
    except OSError:
        return None


def run_facts(run_dir: str | os.PathLike) -> dict[str, Any]:
    """``{"run_dir", "run"}`` of a run directory (one holding ``config.yaml``; ``run``:
    :func:`run_identity`, where the run has one), else ``{}``: which model a file's vectors
    come from, as an index's ``info`` records it."""
    run_dir = Path(run_dir).resolve()
    if not (run_dir / "config.yaml").is_file():
        return {}
    identity = run_identity(run_dir)
    return {"run_dir": str(run_dir), **({"run": identity} if identity else {})}


def check_embedded_files(path: str | os.PathLike, files: list[str], extra: dict[str, np.ndarray]) -> None:
    """Refuse an embeddings file whose rows' ``files`` (as found: :func:`run_item_files`, under
    ``dmlkit verify --images`` or the run's data root) are not the files it embedded, by the
    sizes it records (``file_sizes``): other images under the same names were scored with its
    embeddings. Files not there are left to their reader; a file without sizes (an older run,
    your own ``.npz``) is not checked."""
    found = _size_difference(path, extra, files, skip_missing=True)
    if found is not None:
        i, now, count = found
        raise DataError(f"{path}: {files[i]} holds {now} bytes, and the file it embedded as row {i} held "
                        f"{int(extra[FILE_SIZES][i])} ({count} of its {len(files)} files differ): other images under "
                        "the same names; give the images it was embedded from (--images), or embed these")


def _size_difference(path: str | os.PathLike, extra: dict[str, np.ndarray], files: Any, *,
                     skip_missing: bool = False) -> tuple[int, int, int] | None:
    """``(first row, its size now, rows that differ)`` where the ``files`` of the rows of the
    embeddings file ``path`` are not of the sizes it records (``extra["file_sizes"]``), else
    ``None`` (also without recorded sizes); ``skip_missing``: files not found are not compared."""
    recorded = extra.get(FILE_SIZES)
    if recorded is None:
        return None
    recorded = np.asarray(recorded)
    if recorded.shape != (len(files),):
        raise DataError(f"{path} is damaged: {recorded.size} file sizes for {len(files)} rows; embed it again")
    now = file_sizes(list(files))
    differ = (recorded != now) & ((now >= 0) if skip_missing else True)
    rows = np.flatnonzero(differ)
    return None if not rows.size else (int(rows[0]), int(now[rows[0]]), int(rows.size))


def file_under_root(root: Path, name: str) -> Path | None:
    """``root / name`` for a relative ``name`` without ``..`` parts, else ``None`` (outside).

    Checked on the path as written, not the resolved one: in a data root of symlinked class
    folders (the layout docs/configuration.md shows) every file resolves outside the root, and
    every thumbnail was refused and the model check skipped. Ids are limited to the indexed
    items, so ``..`` and absolute names are the only way out of the root. ``name`` is an id as
    a run stores it (:func:`dmlkit.utils.portable_path`), spelled here as this system spells it."""
    path = Path(local_path(name))
    if path.is_absolute() or ".." in path.parts:
        return None
    return root / path


def run_item_files(path: str | os.PathLike, paths: list[str], images: str | os.PathLike | None = None) -> list[str]:
    """The files named by the ``paths`` of an embeddings file, to open them: those of a run's
    ``embeddings/<split>.npz`` are relative to the run's data root (:func:`item_ids`), joined
    here with ``images`` (``--images``, :func:`_images_base`) where given, else with the folder
    the run's ids are relative to (:func:`_ids_base`); they were opened relative to the current
    directory, from where none was found. Other files' paths stay as written."""
    run_dir = Path(path).resolve().parent.parent
    if not (run_dir / "config.yaml").is_file():
        return paths
    relative = [p for p in paths if not os.path.isabs(p)]
    if images is not None:
        base = _images_base(Path(images), relative)
    else:
        base = _ids_base(*_run_config_root(run_dir))
    return [p if os.path.isabs(p) else os.path.join(base, local_path(p)) for p in paths]


def _run_config_root(run_dir: Path, data_root: str | os.PathLike | None = None) -> tuple[Any, str]:
    """A run's config and data root (``data_root``, else the config's ``data.root``)."""
    config = load_config(run_dir / "config.yaml")
    return config, resolve_root(data_root if data_root is not None else config.data.root)


def _ids_base(config: Any, root: str | os.PathLike, dataset: Any = None) -> str:
    """The folder a run's item ids are relative to under the data root ``root``: the root, or
    for a file root (a ``csv`` list) its image folder (:func:`items_base`), for which the run's
    dataset is loaded unless given (the list's folder when its data is not here, or without
    the run's ``config``)."""
    if dataset is None and config is not None and os.path.isfile(root):
        try:
            dataset = load_dataset(config.data.dataset, root=root, **config.data.options)
        except DataNotFoundError:
            pass
    return items_base(dataset, root)


#: Ids checked per candidate folder by :func:`_images_base` (an existence test each).
_IDS_PROBED = 64


def _images_base(images: Path, ids: list[str]) -> str:
    """The folder under ``images`` (``verify --images``) that a run's relative ``ids`` are
    relative to: docs/verification.md lets ``--images`` be the folder of LFW's person folders
    or its parent holding ``lfw/``, and the run's data root (its ids' base) may be either, so
    ``images``, the person-folder folder in it (:func:`dmlkit.data.pairs.lfw_folder`) and its
    parent are tried; the one under which most of the first ids exist wins (``images`` on a tie,
    and where none holds any: the error then names the files looked for)."""
    candidates = [images]
    if images.is_dir():
        candidates.append(lfw_folder(images))
    candidates.append(images.parent)
    probe = [local_path(p) for p in ids[:_IDS_PROBED]]
    found = [sum(os.path.isfile(os.path.join(c, p)) for p in probe) for c in candidates]
    return os.fspath(candidates[found.index(max(found))])


def _run_item_ids(path: str | os.PathLike, run_dir: Path, extra: dict[str, np.ndarray],
                  data_root: str | os.PathLike | None, labels: np.ndarray | None) -> tuple[np.ndarray, dict[str, Any]]:
    """:func:`item_ids` of a run's embeddings file: the files its rows (``indices``) are in the
    run's dataset today, relative to the data root (``data_root``, else the run's ``data.root``).

    The file's own ``paths`` (the files it embedded, :func:`dmlkit.embeddings.dataset_items`)
    must be those files: a :class:`DataError` says which row changed when the data under the root differs
    (a file added to or renamed in a class folder shifted the rows onto other files, silently);
    without the data they are the ids as they are. A file without ``paths`` (older runs) is
    checked as far as it can be, with a warning that it cannot be checked fully: a row past
    the dataset's end, its ``labels`` (pass them) differing from the dataset's labels of those
    rows, or the run's ``split.json`` naming its classes otherwise are refused; a file renamed
    within a class is not seen. Data held in memory (no paths): the rows as strings.
    """
    rows = np.asarray(extra["indices"], dtype=np.int64)
    stored = None if "paths" not in extra else np.asarray(extra["paths"]).astype(str)
    if stored is not None and stored.shape != rows.shape:
        raise DataError(f"{path} is damaged: {stored.size} paths for {rows.size} rows; re-embed it "
                        f"with `dmlkit embed {run_dir}`")
    config, root = _run_config_root(run_dir, data_root)
    facts: dict[str, Any] = run_facts(run_dir)
    files = {"data_root": str(Path(root).resolve()), "dataset": config.data.dataset}
    try:
        dataset = load_dataset(config.data.dataset, root=root, **config.data.options)
    except DataNotFoundError:  # data not here: the stored files, else the stable row numbers
        return (rows.astype(str), facts) if stored is None else (_under(stored, _ids_base(None, root)), {**facts, **files})
    if dataset.paths is None:
        return rows.astype(str), facts
    storage_rows = np.asarray(getattr(dataset, "_rows", np.arange(len(dataset))))
    where = np.minimum(np.searchsorted(storage_rows, rows), len(storage_rows) - 1)
    base = _ids_base(config, root, dataset)  # a csv list's image folder, not the list itself
    files["data_root"] = str(Path(base).resolve())  # where serve finds the ids' thumbnails
    today = relative_paths(dataset.paths, base)
    if not (storage_rows.size and np.all(storage_rows[where] == rows)):
        _refuse_changed(path, run_dir, dataset, root, f"row {int(rows.max())} of the file is past its "
                                                      f"{len(storage_rows)} items")
    if stored is not None:
        _check_same_files(path, run_dir, dataset, root, _under(stored, base), today[where])
        found = _size_difference(path, extra, np.asarray(dataset.paths)[where])
        if found is not None:
            i, now, count = found
            _refuse_changed(path, run_dir, dataset, root, f"row {i}, {today[where][i]}, held {int(extra[FILE_SIZES][i])} "
                            f"bytes and holds {now}: other images under the same names; {count} of its {where.size} "
                            "rows differ")
    else:
        _check_same_dataset(path, run_dir, dataset, root, where, labels)
        warnings.warn(f"{path} does not record the files it embedded (an older run): its ids are today's files "
                      f"at its rows under {root}, which cannot be checked (a file added or renamed in a class "
                      f"folder goes unnoticed); re-embed it with `dmlkit embed {run_dir}` to record them",
                      stacklevel=3)
    return today[where], {**facts, **files}


def _under(stored: np.ndarray, root: str | os.PathLike) -> np.ndarray:
    """A run's stored ``paths`` relative to ``root``: those stored absolute (files outside the
    run's recorded data root, e.g. a bench run given its data with ``--data-root``, or a
    ``csv`` run embedded before its ids were relative to the list's image folder) made
    relative where ``root`` holds them."""
    absolute = np.asarray([os.path.isabs(p) for p in stored.tolist()], dtype=bool)
    if not absolute.any():
        return stored
    out = stored.astype(object)
    out[absolute] = relative_paths([local_path(p) for p in stored[absolute].tolist()], root)
    return out.astype(str)


def _as_run_ids(ids: np.ndarray, info: Any) -> tuple[np.ndarray, Any]:
    """An index's ``ids`` and ``info`` as :func:`item_ids` spells a run's today. An older
    dmlkit's index of a ``csv`` run (its ``info`` names the run, and as ``data_root`` the list
    file) holds absolute ids, which the run's files now name relative to the list's image
    folder (:func:`_ids_base`): ``index --add`` of the very file the index was built from added
    every item again, ``query --exclude-self`` and ``--id`` found none. Such ids are read
    relative (:func:`_under`), and ``data_root`` as that folder, as a newer index records them."""
    if not isinstance(info, dict) or "run_dir" not in info or not os.path.isfile(str(info.get("data_root", ""))):
        return ids, info
    config = Path(info["run_dir"]) / "config.yaml"
    base = _ids_base(load_config(config) if config.is_file() else None, info["data_root"])
    return _under(ids, base), {**info, "data_root": str(Path(base).resolve())}


def _check_same_files(path: str | os.PathLike, run_dir: Path, dataset: Any, root: str | os.PathLike,
                      stored: np.ndarray, today: np.ndarray) -> None:
    """Refuse data whose files at the run's rows (``today``) are not the files the run embedded
    (``stored``)."""
    differ = np.flatnonzero(stored != today)
    if differ.size:
        i = int(differ[0])
        _refuse_changed(path, run_dir, dataset, root, f"row {i} was {stored[i]} and is {today[i]}; "
                        f"{differ.size} of its {stored.size} rows differ")


def _check_same_dataset(path: str | os.PathLike, run_dir: Path, dataset: Any, root: str | os.PathLike,
                        where: np.ndarray, labels: np.ndarray | None) -> None:
    """Refuse a dataset whose items at the run's rows (``where``) are not the run's: their
    labels (integer ids, or class names) differ from the file's ``labels``, or the run's
    ``split.json`` names a class otherwise."""
    if labels is not None:
        labels = np.asarray(labels)
        now = dataset.labels[where]
        if labels.dtype.kind in "US":  # class names (a file saved with names): compare names
            now = np.asarray([dataset.class_names.get(int(c), str(c)) for c in now.tolist()])
            labels = labels.astype(str)
        if labels.shape == now.shape and labels.dtype.kind in "iuUS":
            differ = np.flatnonzero(labels != now)
            if differ.size:
                i = int(differ[0])
                _refuse_changed(path, run_dir, dataset, root, f"row {i} is class {labels.tolist()[i]!r} in the file and "
                                f"{now.tolist()[i]!r} in the data; {differ.size} of its {labels.size} rows differ")
    if (run_dir / "split.json").is_file():
        try:
            ClassSplit.from_json(run_dir / "split.json").check(dataset)
        except DataError as exc:  # it names the class that moved and what to do
            raise DataError(f"{path}: {exc}") from None


def _refuse_changed(path: str | os.PathLike, run_dir: Path, dataset: Any, root: str | os.PathLike, why: str) -> None:
    """The one error of :func:`item_ids` for data that is not the run's any more."""
    raise DataError(f"{path}: the run's dataset {dataset.name!r} under {root} changed since it was embedded ({why}), "
                    "so its rows would name other files: give the data the run was embedded from (--data-root; "
                    f"verify: --images), or re-embed the run on today's data with `dmlkit embed {run_dir}`")
