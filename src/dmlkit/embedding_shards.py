"""Embeddings beyond RAM: a directory of memory-mappable ``.npy`` shards.

Layout of a shard directory (everything numpy can read without dmlkit)::

    SHARD_DIR/
      manifest.json           {"format": "dmlkit-embedding-shards", "version": 1,
                               "count": N, "dim": D, "dtype": "float16" | "float32",
                               "shards": [{"rows", "embeddings", "labels", "ids",
                                           "sha256": {file: digest}}, ...],
                               "metadata": {...}}
      embeddings-W-00000.npy  (rows, D) float16 / float32 (W: the writer, ``<pid>.<5 hex digits>``)
      labels-W-00000.npy      (rows,) int64 class ids
      ids-W-00000.npy         (rows,) int64 item ids (default: the row number)
      ...                     and shards.lock, held by the writer while it writes

The manifest is written last, atomically: a directory without one is an interrupted write and
is refused by the reader. :class:`ShardWriter` appends batches and holds at most one shard
(``shard_rows x D``) in memory; :class:`ShardedEmbeddings` reads rows back as float32 through
``np.load(mmap_mode="r")``, one shard mapping at a time and released after each read, so
reading a whole gallery block by block keeps the process's resident memory at the size of the
block (the page cache is the kernel's, not the process's).

float16 halves the disk and the I/O; its rounding (relative error ``2^-11``) is far below what
retrieval metrics resolve for L2-normalised embeddings, but values beyond ``+-65504`` do not fit
and are refused (store float32 then). Every metric computed from float16 shards is computed
on the float32 values the shards decode to.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dmlkit.distributed import mark_every_rank
from dmlkit.embedding_files import check_numpy_file
from dmlkit.exceptions import ConfigError, DataError, DataNotFoundError, NonFiniteError, ShapeError
from dmlkit.utils import atomic_write_json, directory_lock, process_alive, sha256_file
from dmlkit.validation import check_integer, check_shard_batch, check_shard_vector

__all__ = [
    "MANIFEST",
    "SHARD_FORMAT",
    "ShardWriter",
    "ShardedEmbeddings",
    "embed_to_shards",
    "is_shard_dir",
    "open_shards",
    "write_manifest",
    "write_shards",
]

MANIFEST = "manifest.json"
SHARD_FORMAT = "dmlkit-embedding-shards"
_VERSION = 1
_DTYPES = {"float32": np.float32, "float16": np.float16}
_F16_MAX = float(np.finfo(np.float16).max)
_F16_TINY = float(np.finfo(np.float16).tiny)  # smallest normal, ~6.1e-5
_F32_MAX = float(np.finfo(np.float32).max)
#: Default rows per shard: 256 MiB of float32 at D = 128 per 512k rows; 64k rows is ~16-32 MiB.
DEFAULT_SHARD_ROWS = 65536
#: The files of one shard, by manifest key (``<key>-<writer>-<part><number>.npy``).
_SHARD_KEYS = ("embeddings", "labels", "ids")
#: The lock file a :class:`ShardWriter` holds in its directory from its start to its close, and
#: the writer tag of a shard file's name (``<pid>.<5 hex digits>-``): the process that wrote it.
SHARD_LOCK = "shards.lock"
_WRITER_TAG = re.compile(r"\.?(?:embeddings|labels|ids)-(\d+)\.[0-9a-f]{5}-")


class RowIndexError(ShapeError, IndexError):
    """A row index or mask outside a :class:`ShardedEmbeddings`' rows (an ``IndexError``, as
    numpy's, and a :class:`ShapeError`)."""


def is_shard_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory holding a shard ``manifest.json``."""
    p = Path(path)
    return p.is_dir() and (p / MANIFEST).is_file()


# -- writing ------------------------------------------------------------------------------------
class ShardWriter:
    """Append ``(embeddings, labels[, ids])`` batches to a shard directory.

    Args:
        directory: output directory (created; an existing manifest is refused unless
            ``overwrite``).
        dtype: ``"float32"`` or ``"float16"`` on disk.
        shard_rows: rows per shard file; the writer buffers one shard (``shard_rows x D``).
        overwrite: replace an existing shard directory's files.
        metadata: JSON-serialisable extra information stored in the manifest.
        part: a tag in this writer's file names (``embeddings-<writer>-<part>00000.npy``), so
            that several writers (the ranks of a distributed job) fill one directory side by
            side; each then ends with :meth:`finish` and one of them writes the manifest of all
            their shards (:func:`write_manifest`).
        lock: hold the directory's lock (``shards.lock``, :func:`~dmlkit.utils.directory_lock`)
            until :meth:`close`, so that a second writer is refused; ``False`` for the ranks of a
            distributed job but the one that writes the manifest (and holds it).

    Use it as a context manager: the manifest is written by :meth:`close` when the block ends
    without an exception, so a crashed write never looks complete. Every writer names its files
    after its process (``<writer>`` = ``<pid>.<5 hex digits>``).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        dtype: str = "float32",
        shard_rows: int = DEFAULT_SHARD_ROWS,
        overwrite: bool = False,
        metadata: Mapping[str, Any] | None = None,
        part: str = "",
        lock: bool = True,
    ) -> None:
        if dtype not in _DTYPES:
            raise ConfigError(f"shard dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        shard_rows = check_integer(shard_rows, "shard_rows")
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise DataError(f"{self.directory} exists and is not a directory: choose another output")
        with contextlib.ExitStack() as held:  # a refusal releases the lock (and removes its file)
            if lock:
                held.enter_context(directory_lock(
                    self.directory, SHARD_LOCK, f"another shard writer (`dmlkit embed --format shards`) "
                    f"is writing {self.directory}: wait for it to end, or choose another directory"))
            existing = (self.directory / MANIFEST).exists()
            if existing and not overwrite:  # every rank of a torchrun job sees it: one line, from rank 0
                raise mark_every_rank(DataError(f"{self.directory} already holds embedding shards: pass "
                                                "overwrite=True (--overwrite) or choose another directory"))
            # an overwrite's old shards stay readable until its manifest replaces theirs, at close
            self._replaced = self._old_files() if existing else None
            self._lock = held.pop_all()  # held until close
        self._prefix = f"{os.getpid()}.{time.time_ns() % 2**20:05x}-{part}"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.dtype = dtype
        self.shard_rows = shard_rows
        self.metadata = dict(metadata or {})
        self.dim: int | None = None
        self.count = 0
        self.shards: list[dict[str, Any]] = []
        self._buf: np.ndarray | None = None
        self._buf_labels = np.empty(self.shard_rows, np.int64)
        self._buf_ids = np.empty(self.shard_rows, np.int64)
        self._fill = 0
        self._written: set[str] = set()  # this writer's shard (and .tmp) file names
        self._closed = False
        self._f16_small = 0  # values below float16's smallest normal, over every batch

    def _old_files(self) -> set[str]:
        """The files an overwrite replaces, removed once the new manifest is in place: those the
        manifest lists and the leftovers of writers no longer running (a killed overwrite's,
        kept for good): shard-named files (``embeddings-*.npy``, ``labels-*.npy``, ``ids-*.npy``,
        ``.<shard>.tmp``) whose writer tag names no other running process of this machine."""
        pids = {p.name: int(m.group(1)) if (m := _WRITER_TAG.match(p.name)) else 0 for key in _SHARD_KEYS
                for pattern in (f"{key}-*.npy", f".{key}-*.npy.tmp") for p in self.directory.glob(pattern)}
        return _manifest_files(self.directory) | {  # this process's: writers that ended (the lock is ours)
            name for name, pid in pids.items() if pid in (0, os.getpid()) or not process_alive(pid)}

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        self._closed = True  # no manifest (visibly incomplete), and no own file a manifest does not list
        with self._lock:  # released once they are gone
            for name in self._written - _manifest_files(self.directory):
                (self.directory / name).unlink(missing_ok=True)

    def append(self, embeddings: Any, labels: Any, ids: Any | None = None) -> None:
        """Add a batch: ``(B, D)`` embeddings, ``(B,)`` integer labels, optional ``(B,)`` int ids
        (default: the running row number)."""
        if self._closed:
            raise DataError("this ShardWriter is closed: open a new one to write more")
        emb = check_shard_batch(embeddings)
        n = emb.shape[0]
        lab = check_shard_vector(labels, n, "labels")
        idv = (np.arange(self.count, self.count + n, dtype=np.int64) if ids is None
               else check_shard_vector(ids, n, "ids"))
        if self.dim is None:
            self.dim = int(emb.shape[1])
            self._buf = np.empty((self.shard_rows, self.dim), _DTYPES[self.dtype])
        elif emb.shape[1] != self.dim:
            raise ShapeError(f"batch has {emb.shape[1]} dimensions but the shards have {self.dim}")
        if n and not np.isfinite(emb).all():
            raise NonFiniteError("embeddings contain NaN or infinity: fix the model output before writing")
        if self.dtype == "float16" and n and float(np.abs(emb).max()) > _F16_MAX:
            raise NonFiniteError(f"embeddings exceed float16's range (|x| > {_F16_MAX:g}): "
                                 "write float32 shards (--dtype float32) or normalise them")
        if emb.dtype.itemsize > 4 and n and float(np.abs(emb).max()) > _F32_MAX:  # else stored as inf
            raise NonFiniteError(f"embeddings exceed float32's range (|x| > {_F32_MAX:.4g}): rescale "
                                 "or normalise them")
        if self.dtype == "float16" and n:
            mag = np.abs(emb)
            self._f16_small += int(np.count_nonzero((mag > 0) & (mag < _F16_TINY)))  # warned once, by finish
        start = 0
        while start < n:
            take = min(n - start, self.shard_rows - self._fill)
            sl = slice(self._fill, self._fill + take)
            self._buf[sl] = emb[start:start + take]
            self._buf_labels[sl] = lab[start:start + take]
            self._buf_ids[sl] = idv[start:start + take]
            self._fill += take
            start += take
            if self._fill == self.shard_rows:
                self._flush()
        self.count += n

    def _flush(self) -> None:
        if self._fill == 0:
            return
        i = len(self.shards)
        names = {key: f"{key}-{self._prefix}{i:05d}.npy" for key in _SHARD_KEYS}
        arrays = {"embeddings": self._buf, "labels": self._buf_labels, "ids": self._buf_ids}
        digests = {}
        for key, name in names.items():
            path = self.directory / name
            tmp = path.with_name(f".{name}.tmp")
            self._written.update((name, tmp.name))  # before they exist: a failure removes them
            tmp.unlink(missing_ok=True)  # a leftover, or a planted link: removed, never written through
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as fh:  # O_EXCL: no link
                np.save(fh, arrays[key][: self._fill], allow_pickle=False)
            os.replace(tmp, path)
            digests[name] = sha256_file(path)
        self.shards.append({"rows": self._fill, **names, "sha256": digests})
        self._fill = 0

    def finish(self) -> list[dict[str, Any]]:
        """Write the last shard and return this writer's shard records, without a manifest.
        Values that fell below float16's smallest normal, in any batch, give one warning here."""
        if not self._closed:
            self._flush()
            self._closed = True
            self._buf = None
            if self._f16_small:
                warnings.warn(f"{self._f16_small} of {self.count * (self.dim or 0)} embedding values are below "
                              f"float16's smallest normal ({_F16_TINY:.2g}) and lose precision (or become 0) "
                              "in float16 shards: write float32 shards (--dtype float32) or rescale them",
                              stacklevel=2)
        return self.shards

    def close(self) -> Path:
        """Write the last shard and the manifest (unless :meth:`finish` ended this writer);
        returns the directory. The directory's lock is released here."""
        with self._lock:
            if self._closed:
                return self.directory
            self.finish()
            if self.dim is None:
                raise DataError("no embeddings were written: append at least one batch before closing")
            write_manifest(self.directory, self.shards, dim=self.dim, dtype=self.dtype,
                           shard_rows=self.shard_rows, metadata=self.metadata, replaced=self._replaced)
        return self.directory


def _manifest_files(directory: Path) -> set[str]:
    """The shard file names ``directory``'s manifest lists (plain names; none if unreadable)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
        return {name for shard in manifest["shards"] for key in _SHARD_KEYS
                if isinstance(name := shard.get(key), str) and name and Path(name).name == name}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return set()


def write_manifest(directory: str | os.PathLike, shards: list[dict[str, Any]], *, dim: int, dtype: str,
                   shard_rows: int, metadata: Mapping[str, Any] | None = None,
                   replaced: set[str] | None = None) -> None:
    """Write the manifest of ``shards`` (records of :meth:`ShardWriter.finish`, in row order)
    atomically, then remove the files of ``replaced`` it no longer lists (the data an overwrite
    replaced): the last step of a write, after which the directory reads as complete."""
    directory = Path(directory)
    manifest = {"format": SHARD_FORMAT, "version": _VERSION,
                "count": sum(int(shard["rows"]) for shard in shards), "dim": int(dim),
                "dtype": dtype, "label_dtype": "int64", "id_dtype": "int64",
                "shard_rows": int(shard_rows), "shards": shards, "metadata": dict(metadata or {})}
    atomic_write_json(directory / MANIFEST, manifest)
    kept = {shard[key] for shard in shards for key in _SHARD_KEYS}
    for name in (replaced or set()) - kept:  # the replaced data, now unreferenced
        (directory / name).unlink(missing_ok=True)


def write_shards(
    directory: str | os.PathLike,
    embeddings: Any,
    labels: Any,
    ids: Any | None = None,
    *,
    dtype: str = "float32",
    shard_rows: int = DEFAULT_SHARD_ROWS,
    overwrite: bool = False,
    metadata: Mapping[str, Any] | None = None,
) -> ShardedEmbeddings:
    """Write in-memory (or memory-mapped) embeddings as shards and open them."""
    n = len(embeddings)
    for name, values in (("labels", labels), ("ids", ids)):
        if values is not None and len(values) != n:  # the batches below cut it at n silently
            raise ShapeError(f"{len(values)} {name} for {n} embeddings: give one per row")
    with ShardWriter(directory, dtype=dtype, shard_rows=shard_rows, overwrite=overwrite,
                     metadata=metadata) as writer:
        for a0 in range(0, max(n, 1), shard_rows):
            a1 = min(n, a0 + shard_rows)
            writer.append(embeddings[a0:a1], np.asarray(labels)[a0:a1],
                          None if ids is None else np.asarray(ids)[a0:a1])
    return ShardedEmbeddings(directory)


# -- reading ------------------------------------------------------------------------------------
class ShardedEmbeddings:
    """Read-only view of a shard directory that behaves like an ``(N, D)`` float32 array.

    ``shards[a:b]`` returns the rows as a new float32 array, ``shards[index_array]`` gathers
    rows, :meth:`blocks` iterates fixed-size blocks; ``labels`` and ``ids`` (``(N,)`` int64)
    are loaded in memory (O(N)), embeddings never are. Each read maps the shards it touches
    with ``np.load(mmap_mode="r")`` and unmaps them when done.

    Args:
        directory: the shard directory.
        verify: also check the embeddings files' SHA-256 against the manifest (reads them all
            once); the labels and ids files, read in full anyway, are always checked.
    """

    def __init__(self, directory: str | os.PathLike, *, verify: bool = False) -> None:
        self.directory = Path(directory)
        self.manifest = _read_manifest(self.directory)
        m = self.manifest
        self.dim = int(m["dim"])
        self.count = int(m["count"])
        self.storage_dtype = np.dtype(_DTYPES[m["dtype"]])
        rows = [int(s["rows"]) for s in m["shards"]]
        self._starts = np.concatenate([[0], np.cumsum(rows, dtype=np.int64)])
        if int(self._starts[-1]) != self.count:
            raise DataError(f"{self.directory / MANIFEST}: shard rows add up to {int(self._starts[-1])}, "
                            f"not count = {self.count}; rewrite the shards")
        for shard in m["shards"]:
            arr = self._map(shard, "embeddings")
            if arr.shape != (int(shard["rows"]), self.dim) or arr.dtype != self.storage_dtype:
                raise DataError(f"{self.directory / shard['embeddings']} holds {arr.dtype} {arr.shape}, "
                                f"the manifest says {self.storage_dtype} ({shard['rows']}, {self.dim}); "
                                "rewrite the shards")
            del arr
        if verify:
            self.verify()
        self.labels = self._concat("labels")
        self.ids = self._concat("ids")

    # array protocol -------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        return (self.count, self.dim)

    @property
    def dtype(self) -> np.dtype:
        """The dtype rows are returned in (float32), whatever the storage dtype."""
        return np.dtype(np.float32)

    @property
    def ndim(self) -> int:
        return 2

    @property
    def nbytes_stored(self) -> int:
        return self.count * self.dim * self.storage_dtype.itemsize

    def __len__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        return (f"ShardedEmbeddings({str(self.directory)!r}, count={self.count}, dim={self.dim}, "
                f"dtype={self.storage_dtype.name}, shards={len(self.manifest['shards'])})")

    def __getitem__(self, key: Any) -> np.ndarray:
        if key is Ellipsis:
            return self.to_numpy()
        if isinstance(key, tuple):  # rows, then columns: shards[:, :8], shards[3, 0]
            rows = self[key[0]] if key else self.to_numpy()
            rest = key[1:]
            return rows[rest] if rows.ndim == 1 or not rest else rows[(slice(None), *rest)]
        if isinstance(key, slice):
            a0, a1, step = key.indices(self.count)
            if step != 1:
                return self.take(np.arange(a0, a1, step))
            return self.read(a0, a1)
        if isinstance(key, int | np.integer):
            i = int(key) + (self.count if key < 0 else 0)
            if not 0 <= i < self.count:  # an IndexError: ends a for loop over the rows
                raise RowIndexError(f"row {int(key)} is outside 0:{self.count}")
            return self.read(i, i + 1)[0]
        if hasattr(key, "detach"):
            key = key.detach().cpu().numpy()
        return self.take(np.asarray(key))

    def __iter__(self) -> Iterator[np.ndarray]:
        """The rows one by one (read a block at a time)."""
        for _, block in self.blocks(4096):
            yield from block

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.to_numpy()
        return out if dtype is None else out.astype(dtype, copy=False)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` as a new float32 ``(stop - start, D)`` array."""
        if not 0 <= start <= stop <= self.count:
            raise ShapeError(f"rows {start}:{stop} are outside 0:{self.count}")
        out = np.empty((stop - start, self.dim), np.float32)
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        pos = start
        for s in range(max(first, 0), len(self.manifest["shards"])):
            s0, s1 = int(self._starts[s]), int(self._starts[s + 1])
            if pos >= stop:
                break
            hi = min(stop, s1)
            arr = self._map(self.manifest["shards"][s], "embeddings")
            out[pos - start:hi - start] = arr[pos - s0:hi - s0]
            del arr
            pos = hi
        return out

    def take(self, rows: np.ndarray) -> np.ndarray:
        """Rows at the given (any order, repeats allowed) integer positions, as float32."""
        rows = np.asarray(rows)
        if rows.dtype == bool:
            if rows.shape != (self.count,):  # as numpy: never a mask of other rows
                raise RowIndexError(f"boolean mask of shape {rows.shape} for {self.count} rows")
            rows = np.flatnonzero(rows)
        if rows.size and rows.dtype.kind not in "iu":  # as numpy: 1.7 was silently row 1
            raise RowIndexError(f"row indices must be integers or a boolean mask, got {rows.dtype}")
        rows = rows.astype(np.int64, copy=False).reshape(-1)
        if rows.size and (rows.min() < -self.count or rows.max() >= self.count):
            raise RowIndexError(f"row index out of range for {self.count} rows")
        rows = np.where(rows < 0, rows + self.count, rows)
        out = np.empty((rows.size, self.dim), np.float32)
        shard_of = np.searchsorted(self._starts, rows, side="right") - 1
        for s in np.unique(shard_of):
            sel = np.flatnonzero(shard_of == s)
            arr = self._map(self.manifest["shards"][int(s)], "embeddings")
            out[sel] = arr[rows[sel] - int(self._starts[s])]
            del arr
        return out

    def blocks(self, rows: int) -> Iterator[tuple[int, np.ndarray]]:
        """``(start, float32 block)`` for consecutive blocks of at most ``rows`` rows."""
        rows = max(1, int(rows))
        for a0 in range(0, self.count, rows):
            yield a0, self.read(a0, min(self.count, a0 + rows))

    def to_numpy(self) -> np.ndarray:
        """Every row as one in-memory float32 array (only for sets that fit in RAM)."""
        return self.read(0, self.count)

    def verify(self) -> None:
        """Check every shard file's SHA-256 against the manifest; :class:`DataError` if one differs."""
        for shard in self.manifest["shards"]:
            for name, digest in shard.get("sha256", {}).items():
                got = sha256_file(self.directory / name)
                if got != digest:
                    raise DataError(f"{self.directory / name} does not match its manifest digest "
                                    "(corrupted or modified): rewrite the shards")

    # helpers --------------------------------------------------------------------------------
    def _map(self, shard: Mapping[str, Any], key: str) -> np.ndarray:
        path = self.directory / shard[key]
        try:
            return np.load(path, mmap_mode="r", allow_pickle=False)
        except FileNotFoundError:
            raise DataNotFoundError(f"shard file missing: {path} (listed in {self.directory / MANIFEST})") from None
        except (OSError, ValueError, EOFError) as exc:
            # an empty file was numpy's EOFError (the CLI read it as Ctrl-C: exit 130), a cut
            # header "pickled data": the one check of .npy/.npz first bytes says what is wrong
            check_numpy_file(path, ".npy", "a shard")
            raise DataError(f"cannot read shard {path}: {' '.join(str(exc).split())[:200]}") from None

    def _concat(self, key: str) -> np.ndarray:
        out = np.empty(self.count, np.int64)
        for s, shard in enumerate(self.manifest["shards"]):
            # labels and ids are read in full anyway: always check their digests (a swapped or
            # edited labels file would change every metric silently); embeddings: verify=True
            name = shard[key]
            digest = shard.get("sha256", {}).get(name)
            if digest is not None and (self.directory / name).is_file() \
                    and sha256_file(self.directory / name) != digest:
                raise DataError(f"{self.directory / name} does not match its manifest digest "
                                "(corrupted or modified): rewrite the shards")
            arr = self._map(shard, key)
            if arr.shape != (int(shard["rows"]),) or arr.dtype.kind not in "iu":
                raise DataError(f"{self.directory / shard[key]} holds {arr.dtype} {arr.shape}, expected "
                                f"({shard['rows']},) integers; rewrite the shards")
            out[int(self._starts[s]):int(self._starts[s + 1])] = arr
            del arr
        return out


def _read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    if not directory.is_dir():
        raise DataNotFoundError(f"embedding shard directory not found: {directory}")
    if not path.is_file():
        raise DataError(f"{directory} has no {MANIFEST}: not a shard directory, or its write was "
                        "interrupted (write it again)")
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested ~100,000 deep
        raise DataError(f"cannot read {path}: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(m, dict) or m.get("format") != SHARD_FORMAT:
        raise DataError(f"{path} is not a {SHARD_FORMAT} manifest")
    if m.get("version") != _VERSION:
        raise DataError(f"{path} has format version {m.get('version')!r}; this dmlkit reads version "
                        f"{_VERSION}: upgrade dmlkit or rewrite the shards")
    if m.get("dtype") not in _DTYPES or not isinstance(m.get("shards"), list):
        raise DataError(f"{path} is malformed (dtype {m.get('dtype')!r}): rewrite the shards")
    counts = [m.get("count"), m.get("dim"), *(s.get("rows") if isinstance(s, dict) else None for s in m["shards"])]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in counts):
        raise DataError(f"{path} is malformed (count, dim and each shard's rows must be whole numbers): "
                        "rewrite the shards")
    listed: set[str] = set()
    for shard in m["shards"]:
        for key in ("embeddings", "labels", "ids"):
            name = shard.get(key) if isinstance(shard, dict) else None
            if not isinstance(name, str) or Path(name).name != name or name.startswith("."):
                raise DataError(f"{path} lists a shard file {name!r} outside the directory: refused")
            if name in listed:  # its rows were read twice: more queries, other metrics
                raise DataError(f"{path} lists the shard file {name} twice (a hand-merged manifest?): "
                                "rewrite the shards")
            listed.add(name)
    return m


def open_shards(directory: str | os.PathLike, *, verify: bool = False) -> ShardedEmbeddings:
    """Open a shard directory (:class:`ShardedEmbeddings`)."""
    return ShardedEmbeddings(directory, verify=verify)


# -- from a model -------------------------------------------------------------------------------
def embed_to_shards(
    model: Any,
    dataset: Any,
    directory: str | os.PathLike,
    options: Any | None = None,
    *,
    dtype: str = "float32",
    shard_rows: int = DEFAULT_SHARD_ROWS,
    overwrite: bool = False,
    metadata: Mapping[str, Any] | None = None,
    progress: bool = False,
) -> ShardedEmbeddings:
    """Run the inference loop over ``dataset`` and write its embeddings as shards, batch by
    batch (the ``N x D`` outputs are never held together). ``options`` is an
    :class:`dmlkit.embeddings.InferenceOptions`; ids are the dataset rows
    (:func:`dmlkit.embeddings.dataset_rows`).

    In a distributed job (torchrun) each rank embeds its contiguous share of the rows
    (:func:`dmlkit.embeddings.rank_share`; rank 0 alone all of them when there are fewer rows
    than ranks) and writes its own shard files (``r<rank>-`` in their names) into ``directory``,
    which must be one directory every rank sees (a shared file system across machines); rank 0 then writes the manifest of all of them in dataset order, and every
    rank returns the whole set. A rank that fails leaves no manifest: the directory reads as
    interrupted. Rank 0 holds the directory's lock (:class:`ShardWriter`) for the whole write,
    taken before any rank writes: a refusal ends every rank. Progress is shown by rank 0 alone.
    """
    # lazy: torch and the process group's helpers load only when a model is embedded
    from dmlkit.distributed import all_gather_object, barrier, context, on_main

    # lazy: the same for the inference loop
    from dmlkit.embeddings import dataset_rows, iter_embed_model, rank_share

    rows = dataset_rows(dataset)
    share, start, _, split = rank_share(dataset)
    ctx = context()
    settings = {"dtype": dtype, "shard_rows": shard_rows, "overwrite": overwrite, "metadata": metadata,
                "part": f"r{ctx.rank:03d}-" if split else ""}
    opened: list[ShardWriter] = []
    # rank 0's writer first (it holds the lock), before any rank writes: its refusal ends every rank
    on_main(lambda: opened.append(ShardWriter(directory, **settings)))
    if split and not ctx.is_main:
        opened.append(ShardWriter(directory, **settings, lock=False))
    for writer in opened:  # fewer rows than ranks: rank 0 writes them all, alone
        with writer:
            done = start
            for emb, labels in iter_embed_model(model, share, options, progress=progress and ctx.is_main):
                writer.append(emb, labels, rows[done:done + len(labels)])
                done += len(labels)
            if split:  # every rank has rows (rank_share splits only when there are enough)
                parts = all_gather_object(writer.finish())
                if ctx.is_main:
                    write_manifest(directory, [shard for part in parts for shard in part], dim=writer.dim,
                                   dtype=dtype, shard_rows=shard_rows, metadata=metadata,
                                   replaced=writer._replaced)
    if ctx.enabled:
        barrier()  # the manifest exists before any rank reads it
    return ShardedEmbeddings(directory)
