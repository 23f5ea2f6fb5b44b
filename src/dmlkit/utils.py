"""Small shared helpers: registries, seeding, the data root, atomic writes.

Embeddings files moved to :mod:`dmlkit.embeddings` (``save_embeddings``/``load_embeddings``
stay importable from here, with a ``DeprecationWarning``).
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import hashlib
import io
import json
import os
import platform
import random
import stat
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from dmlkit.exceptions import DataError, DataNotFoundError, DmlkitError

__all__ = [
    "atomic_write_bytes",
    "atomic_write_figure",
    "atomic_write_json",
    "atomic_write_text",
    "directory_lock",
    "holding_warnings",
    "dotted_items",
    "atomic_torch_save",
    "data_root",
    "json_text",
    "local_path",
    "one_line",
    "open_appending",
    "os_error_message",
    "path_bytes",
    "portable_path",
    "process_alive",
    "read_utf8_text",
    "read_json",
    "read_json_object",
    "registering",
    "seed_everything",
]

_T = TypeVar("_T", bound=type)


def registering(
    registry: MutableMapping[str, type], kind: str, names: tuple[str, ...]
) -> Callable[[_T], _T]:
    """Class decorator storing ``cls`` in ``registry`` under each of ``names``.

    Shared by :func:`dmlkit.losses.base.register_loss` and :func:`dmlkit.miners.register_miner`.
    Registering a *different* class under a taken name raises ``RuntimeError`` (``kind`` names
    the registry in the message); registering the same class again is a no-op.
    """

    def decorator(cls: _T) -> _T:
        for name in names:
            if name in registry and registry[name] is not cls:
                raise RuntimeError(f"{kind} name {name!r} registered twice")
            registry[name] = cls
        return cls

    return decorator


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA); optionally request deterministic kernels."""
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def path_bytes(path: str | os.PathLike) -> bytes:
    """A file name's bytes, for hashing it: :func:`os.fsencode` (a name that is not UTF-8,
    Latin-1's ``é`` from an old zip, comes back as the byte it was, where ``str.encode`` raised
    ``UnicodeEncodeError``), else, for a name the file-system encoding cannot spell (a UTF-8 name
    typed in a CSV, read under the C locale, whose file-system encoding is ASCII), its UTF-8."""
    try:
        return os.fsencode(path)
    except UnicodeEncodeError:
        return os.fspath(path).encode("utf-8", "surrogateescape")


def portable_path(path: str | os.PathLike) -> str:
    """``path`` spelled as a UTF-8 system spells it: its bytes (:func:`path_bytes`) read as
    UTF-8, a byte that is not UTF-8 as Python's surrogate escape. The ids a run stores for its
    files, so that they are the same under every locale (under ``LC_ALL=C`` Python spells
    ``café`` as ``caf\\udcc3\\udca9``, and a run embedded in one locale was "changed" in the
    other); :func:`local_path` turns one back into a name this system opens."""
    return path_bytes(path).decode("utf-8", "surrogateescape")


def local_path(portable: str) -> str:
    """The inverse of :func:`portable_path`: this system's spelling of a stored id's file (the
    id itself on a UTF-8 system)."""
    return os.fsdecode(portable.encode("utf-8", "surrogateescape"))


def read_utf8_text(path: str | os.PathLike, fix: str) -> str:
    """The text of the UTF-8 file ``path``, without the byte-order mark that Notepad and
    Excel's "CSV UTF-8" write. A file in another encoding (Excel's plain "CSV" on Windows is
    Windows-1252) is one :class:`DataError` naming the file, the offset and line of its first
    byte that is not UTF-8 and what it reads as in Windows-1252, and then ``fix`` (what to do):
    a decoding error while a file is read in chunks gave an offset into the chunk, in a
    traceback."""
    data = Path(path).read_bytes()
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[bom:].decode("utf-8")
    except UnicodeDecodeError as exc:
        at = bom + exc.start
        byte, line = data[at:at + 1], data.count(b"\n", 0, at) + 1
        char = byte.decode("cp1252", "replace")
        seen = "" if char == "\ufffd" else f", {char!r} in Windows-1252"
        raise DataError(f"{path} is not UTF-8 text: byte {at} (line {line}) is 0x{byte.hex()}{seen}; {fix}") from None


def one_line(text: str) -> str:
    """``text`` with each character that does not print (a newline in a folder name) written as
    in a Python string literal (``\\n``, ``\\x1b``), so that a message stays one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def data_root(explicit: str | os.PathLike | None = None) -> Path:
    """The data root: ``explicit``, else ``$DMLKIT_DATA``, else ``~/.cache/dmlkit/data``."""
    if explicit is not None:
        return Path(explicit).expanduser()
    env = os.environ.get("DMLKIT_DATA")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "dmlkit" / "data"


# -- atomic writes --------------------------------------------------------------------------
def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temporary file in the same folder, fsync, rename,
    fsync of the folder).

    A symbolic link is written through only to a file in its folder (:func:`link_target_inside`);
    an existing path that is not a regular file (a directory, a device such as ``/dev/full``, a
    pipe, also through a link: ``/dev/stdout`` into a pipe) is refused with
    :class:`~dmlkit.exceptions.DataError` instead of being renamed over. An ``OSError`` once the
    folder exists (a full disk, a read-only file system) names ``path``, not the temporary file
    (a ``write`` error names no file at all), and reads "cannot write PATH" (:func:`os_error_message`)."""
    path = Path(path)
    _refuse_special_file(path)
    path = link_target_inside(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            # mkstemp creates 0600; a result file gets the mode open() would give it (0666
            # less the umask), so teammates and a results web server can read runs
            os.fchmod(fh.fileno(), 0o666 & ~_current_umask())
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):  # the file the user named, as a write
            exc.filename, exc.filename2 = os.fspath(path), None
            exc.dmlkit_writing = True  # type: ignore[attr-defined]
        raise
    with contextlib.suppress(OSError):  # the rename is durable once the folder is flushed (some
        fsync_path(path.parent)  # network file systems cannot flush a folder: the write stands)
    return path


def link_target_inside(path: Path) -> Path:
    """``path``, or the file its symbolic link names in the link's folder (or below); a link elsewhere is a
    :class:`DataError` (``RUN/report.html -> ~/.bashrc`` in a received run: ``report`` overwrote it)."""
    if not path.is_symlink():
        return path
    if not (target := path.resolve()).is_relative_to(path.parent.resolve()):
        raise DataError(one_line(f"{path} is a symbolic link to {target}, outside its folder: dmlkit does not "
                                 "write through it; remove the link or choose another output path"))
    return target


def open_appending(path: Path, mode: str = "a", encoding: str | None = None) -> Any:
    """``open(path, mode)`` for appending (``"a"``, ``"a+"``), created if missing, never through a
    symbolic link out of its folder (:func:`link_target_inside`; ``O_NOFOLLOW`` also refuses a link
    planted after that check): logs and lock files inside run, bench and build folders."""
    flags = (os.O_RDWR if "+" in mode else os.O_WRONLY) | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    return open(os.open(link_target_inside(path), flags, 0o666), mode, encoding=encoding)


def _refuse_special_file(path: Path) -> None:
    """:class:`DataError` when ``path`` (a link followed) exists and is not a regular file."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # missing, a dangling link, a file in the way of a folder
        return
    if stat.S_ISREG(mode):
        return
    kind = ("a directory" if stat.S_ISDIR(mode) else "a pipe" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file")
    raise DataError(f"{path} exists and is not a regular file ({kind}): choose another output path")


def atomic_write_figure(fig: Any, path: str | os.PathLike, **savefig: Any) -> Path:
    """Write the matplotlib figure ``fig`` to ``path`` in the format its suffix names (``.png``,
    ``.svg``, ...; none: PNG), with ``fig.savefig``'s options ``savefig``.

    The figure is rendered in memory first and the bytes written by :func:`atomic_write_bytes`:
    ``savefig(path)`` truncated the file before drawing into it, so a kill left a 0-byte figure
    where a complete one stood, and a full disk a truncated one. A failed write (full disk, no
    permission, a file in the way) is one :class:`~dmlkit.exceptions.DataError` line that names
    ``path`` (a ``write`` error carries no file name) and leaves the old file as it was."""
    path = Path(path)
    buffer = io.BytesIO()
    fig.savefig(buffer, format=path.suffix[1:].lower() or "png", **savefig)
    try:
        return atomic_write_bytes(path, buffer.getvalue())
    except OSError as exc:
        raise DataError(os_error_message(exc, path, writing=True)) from None


def fsync_path(path: str | os.PathLike) -> None:
    """Flush ``path`` to disk: a file's data, or a directory's entries (the names created,
    renamed or removed in it: a rename is durable once its directory is flushed). For writes
    made through other handles (``np.save`` to a path); POSIX (a directory cannot be opened
    on Windows, where nothing is done)."""
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def refuse_overwriting_inputs(output: str | os.PathLike, *inputs: str | os.PathLike | None) -> None:
    """Raise :class:`~dmlkit.exceptions.DataError` when ``output`` is one of ``inputs`` (the same
    file or directory, any spelling) or lies inside an input directory: a command's result
    must never replace the data it read (``index emb.npz -o emb.npz`` lost the embeddings)."""
    out = Path(output).expanduser().resolve()
    for source in inputs:
        if source is None:
            continue
        src = Path(source).expanduser().resolve()
        if out == src or (src.is_dir() and src in out.parents):
            raise DataError(f"the output {output} would overwrite the input {source}: choose another output path")


PROCESS_STATE_LOCK = threading.RLock()  #: held by swaps of process-wide state (catch_warnings, rcParams)


@contextlib.contextmanager
def holding_warnings(
    select: Callable[[list[warnings.WarningMessage], bool], list[warnings.WarningMessage]],
    always: tuple[type[Warning], ...] = (),
) -> Iterator[None]:
    """Hold the warnings of the block and give, when it ends (the caller's filters and display
    restored, also when it failed), those ``select(held, failed)`` keeps, in their order;
    ``always``: categories recorded every time they are raised (not once per place); one block
    at a time in the process (:data:`PROCESS_STATE_LOCK`)."""
    held: list[warnings.WarningMessage] = []
    failed = True
    with PROCESS_STATE_LOCK:  # given before another block can hold them
        try:
            with warnings.catch_warnings(record=True) as caught:
                for category in always:
                    warnings.simplefilter("always", category)
                try:
                    yield
                finally:
                    held = list(caught)
            failed = False
        finally:
            for w in select(held, failed):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


@contextlib.contextmanager
def directory_lock(directory: str | os.PathLike, name: str, busy: str) -> Iterator[None]:
    """Hold an exclusive lock on ``directory`` (the file ``directory/name``, ``flock``: released
    by the kernel if the process dies, so a killed holder never blocks the next command) for the
    block; raise :class:`DmlkitError` with the message ``busy`` and the holder (its process id
    and host, which the holder writes into the file) when another process holds it. The
    directory is created if need be.

    When the block raises, the lock file and the folders this call created are removed (folders
    only if still empty; while the lock is held): a refused command (``train --resume`` of a
    missing run, a bench refused at validation) leaves the file system as it found it."""
    import fcntl

    directory = Path(directory)
    created = [] if (directory / name).exists() else [directory / name]
    for folder in (directory, *directory.parents):  # innermost first: the order to remove them
        if folder.exists():
            break
        created.append(folder)
    directory.mkdir(parents=True, exist_ok=True)
    fh = open_appending(directory / name, "a+")  # the lock is the state: it names the holder
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DmlkitError(busy + _lock_holder(fh)) from None
        _name_lock_holder(fh)
        try:
            yield
        except BaseException:
            for path in created:
                with contextlib.suppress(OSError):  # a folder the block filled stays
                    path.rmdir() if path.is_dir() else path.unlink()
            raise
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fh, fcntl.LOCK_UN)
        fh.close()


def _name_lock_holder(fh: io.TextIOBase) -> None:
    """Write ``PID HOST`` of this process into the lock file ``fh`` it holds, for the message of
    a command it refuses (:func:`_lock_holder`); the same holder again leaves the file as it is."""
    fh.seek(0)
    holder = f"{os.getpid()} {platform.node() or '?'}\n"
    if fh.read(200) != holder:
        fh.truncate(0)
        fh.write(holder)
        fh.flush()


def _lock_holder(fh: io.TextIOBase) -> str:
    """`` (held by process PID on HOST)`` from the lock file ``fh`` another process holds; empty
    when it names none (a holder of an older version, or one that has not written it yet)."""
    fh.seek(0)
    holder = fh.readline(200).split()
    return f" (held by process {holder[0]} on {holder[1]})" if len(holder) == 2 and holder[0].isdigit() else ""


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def json_text(obj: Any, indent: int | None = 2) -> str:
    """Strict JSON (RFC 8259) text of ``obj``: a NaN or infinite number becomes ``null``, never
    the bare ``NaN``/``Infinity`` that other JSON readers refuse; numpy scalars and arrays and
    paths are converted. Every result file (:func:`atomic_write_json`) and every ``--json`` print
    goes through it."""
    return json.dumps(_finite_or_none(obj), indent=indent, sort_keys=False, default=_json_default,
                      allow_nan=False)


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int = 2) -> Path:
    """:func:`json_text` of ``obj``, written atomically."""
    return atomic_write_text(path, json_text(obj, indent) + "\n")


def read_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    """The JSON value in ``path``; a missing, unreadable, non-UTF-8 or invalid file is one
    :class:`~dmlkit.exceptions.DataError` line naming ``what`` the file should be."""
    path = Path(path)
    if not path.exists():
        raise DataNotFoundError(f"{what} not found: {path}")
    if path.is_dir():
        raise DataError(f"{path} is a directory: pass the {what} itself")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not a {what}: not UTF-8 text (byte {exc.start})") from None
    except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nested ~100,000 deep
        where = f"{exc.msg} at line {exc.lineno}, column {exc.colno}" if isinstance(exc, ValueError) else "nested too deeply"
        raise DataError(f"{path} is not a valid {what}: {where} (a truncated or hand-edited file?)") from None
    except OSError as exc:
        raise DataError(os_error_message(exc, path)) from None


def read_json_object(path: str | os.PathLike, what: str = "JSON file") -> dict[str, Any]:
    """:func:`read_json` of a file that must hold a JSON object (a result file's top level): any
    other JSON value is one :class:`~dmlkit.exceptions.DataError` naming ``what``."""
    data = read_json(path, what)
    if not isinstance(data, dict):
        raise DataError(f"{path} is not a {what}: it holds a JSON {type(data).__name__}, not an object")
    return data


def _finite_or_none(obj: Any) -> Any:
    if isinstance(obj, float | np.floating):
        return float(obj) if np.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite_or_none(v) for v in obj]
    if isinstance(obj, np.ndarray) and obj.dtype.kind == "f":
        return [_finite_or_none(v) for v in obj.tolist()]
    return obj


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save`` that never leaves a half-written file behind."""
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return atomic_write_bytes(path, buffer.getvalue())


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def os_error_message(exc: OSError, path: str | os.PathLike | None = None, *, writing: bool = False) -> str:
    """One line for an ``OSError`` on ``path`` (default: the error's own file names): what
    failed and what to do (``ENOSPC``: free disk space; ``EACCES``: choose another place).
    "cannot write" when ``writing`` or the error comes from :func:`atomic_write_bytes`."""
    if path is None:
        path = exc.filename2 if exc.filename2 is not None else exc.filename
    writing = writing or getattr(exc, "dmlkit_writing", False)  # set by atomic_write_bytes
    what = f"cannot {'write' if writing else 'access'} {path}" if path is not None else "file error"
    hints = {errno.ENOSPC: "the disk is full: free space or write to another disk",
             errno.EDQUOT: "the disk quota is exhausted: free space or write elsewhere",
             errno.EACCES: "no permission: choose another location or fix the permissions",
             errno.EPERM: "no permission: choose another location or fix the permissions",
             errno.EROFS: "read-only file system: write somewhere else",
             errno.EISDIR: "a directory is in the way: pass a file path",
             errno.ENOTDIR: "a file is in the way where a directory is needed",
             errno.ENOENT: "no such file or directory: check the path"}
    code = errno.ENOTDIR if _mkdir_blocked_by_file(exc) else exc.errno
    reason = os.strerror(code) if code != exc.errno else exc.strerror or str(exc) or type(exc).__name__
    hint = hints.get(code)
    return f"{what}: {reason}" + (f" ({hint})" if hint else "")


def _mkdir_blocked_by_file(exc: OSError) -> bool:
    """Whether ``exc`` is the ``EEXIST`` of creating a directory where a file stands (the
    ``Path.mkdir(parents=True, exist_ok=True)`` or ``os.makedirs`` of ``afile`` for an output
    ``afile/out.json``): a file in the way, as the ``ENOTDIR`` of a path further below a file
    says, not "File exists". The ``EEXIST`` of any other call (an exclusive create) keeps its
    own words."""
    if exc.errno != errno.EEXIST or exc.__traceback__ is None:
        return False
    if not isinstance(exc.filename, str | bytes | os.PathLike):
        return False
    tb = exc.__traceback__
    while tb.tb_next is not None:  # the innermost Python frame: the function that raised it
        tb = tb.tb_next
    if tb.tb_frame.f_code.co_name not in ("mkdir", "makedirs"):
        return False
    path = Path(os.fsdecode(exc.filename))
    return path.exists() and not path.is_dir()


# -- moved names --------------------------------------------------------------------------
#: Names that moved to a module higher up the layers; served here with a DeprecationWarning.
_MOVED = {"save_embeddings": "dmlkit.embeddings", "load_embeddings": "dmlkit.embeddings"}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import warnings

    from dmlkit import embeddings  # lazy: deprecation shim of a name that moved up the layers

    warnings.warn(f"dmlkit.utils.{name} moved to {_MOVED[name]}.{name}; import it from there",
                  DeprecationWarning, stacklevel=2)
    return getattr(embeddings, name)


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks (:func:`hashlib.file_digest`)."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def dotted_items(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level of dotted keys, ``{"a": {"b": 1}} -> {"a.b": 1}`` (an empty
    mapping adds no key): the form in which two configs are compared key by key."""
    if isinstance(data, Mapping):
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(dotted_items(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: data}


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine: it exists and is no zombie (exited, not yet
    reaped by its parent); another user's process counts as running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:  # no /proc (macOS): it exists
        return True

