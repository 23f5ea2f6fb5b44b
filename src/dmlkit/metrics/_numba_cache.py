"""Where numba caches dmlkit's compiled kernels: a writable place, or no cache, never a crash.

The kernels are ``@numba.njit(cache=CACHE)``. numba picks the cache folder of a function when
it is decorated (at import), trying in turn ``$NUMBA_CACHE_DIR``, the ``__pycache__`` folder
beside the source file and the user-wide ``~/.cache/numba`` (``numba.core.caching``'s locator
classes, each kept when the folder can be created and a temporary file made in it). With none
writable (a read-only install in a container, ``HOME=/nonexistent``) the decorator raised
``RuntimeError: cannot cache function 'pack_keys': no locator available`` and ``dmlkit
evaluate`` of 2^22 pairs or more ended in a 70-line traceback.

:func:`cache_location` runs once, before the first kernel is decorated (this module is imported
by every kernel module): when numba would find no folder, it sets ``NUMBA_CACHE_DIR`` to a
private folder of this user under the temporary directory (``tempfile.gettempdir()``), and
reloads numba's configuration if numba is already imported (numba reads the variable into
``numba.core.config.CACHE_DIR``, which the locator reads). When not even that folder can be
used, :data:`CACHE` is ``False``: the kernels are compiled in every process (seconds), with one
warning that says how to keep them.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
import warnings
from collections.abc import MutableMapping
from pathlib import Path

__all__ = ["CACHE", "cache_location"]

_PACKAGE = Path(__file__).resolve().parents[1]
#: The folders of the modules with ``cache=True`` kernels: numba's in-tree cache is their
#: ``__pycache__``.
KERNEL_DIRS = (_PACKAGE / "metrics", _PACKAGE / "apps" / "reid")


def _usable(path: str | os.PathLike) -> bool:
    """numba's test of a cache folder (``_CacheLocator.ensure_cache_path``): it exists or can
    be created, and a temporary file can be made in it."""
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError:
        return False
    return True


def _user_wide_dir() -> str:
    """numba's user-wide cache folder (``~/.cache/numba`` on Linux)."""
    try:
        from numba.misc.appdirs import AppDirs
    except ImportError:  # pragma: no cover (numba moved it)
        return os.path.join(os.path.expanduser("~"), ".cache", "numba")
    return AppDirs(appname="numba", appauthor=False).user_cache_dir


def _private_dir(path: str) -> bool:
    """Whether ``path`` is a folder of this user that no other user can write (not a link): a
    cache under a shared temporary directory holds pickles that numba loads, so a folder another
    user made (or can write to) must not be used."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return False
    try:
        st = os.lstat(path)
    except OSError:
        return False
    owner = getattr(os, "getuid", None)
    return (stat.S_ISDIR(st.st_mode) and not st.st_mode & 0o022
            and (owner is None or st.st_uid == owner()))


def fallback_dir() -> str | None:
    """This user's cache folder under the temporary directory (``/tmp/dmlkit-numba-UID``), or
    ``None`` when no temporary directory is writable (``tempfile.gettempdir`` tries
    ``$TMPDIR``, ``/tmp``, ``/var/tmp``, ``/usr/tmp`` and the current folder)."""
    try:
        base = tempfile.gettempdir()
    except OSError:  # FileNotFoundError: none of them is writable
        return None
    owner = getattr(os, "getuid", None)
    return os.path.join(base, f"dmlkit-numba-{owner()}" if owner else "dmlkit-numba")


def cache_location(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """The folder numba will cache the kernels in, after making sure there is one (module
    docstring); ``None`` when there is none (compile without a cache).

    numba's order: ``$NUMBA_CACHE_DIR``, the kernels' ``__pycache__`` (every folder of
    :data:`KERNEL_DIRS`), the user-wide folder; failing all three, ``$NUMBA_CACHE_DIR`` is set
    to :func:`fallback_dir` in ``environ`` (which worker processes inherit)."""
    configured = environ.get("NUMBA_CACHE_DIR")
    if configured and _usable(configured):
        return configured
    if all(_usable(folder / "__pycache__") for folder in KERNEL_DIRS):
        return str(KERNEL_DIRS[0] / "__pycache__")
    user_wide = _user_wide_dir()
    if _usable(user_wide):
        return user_wide
    fallback = fallback_dir()
    if fallback is None or not _private_dir(fallback) or not _usable(fallback):
        return None
    environ["NUMBA_CACHE_DIR"] = fallback
    if "numba.core.config" in sys.modules and environ is os.environ:  # imported: read the variable again
        sys.modules["numba.core.config"].reload_config()
    return fallback


def _cache() -> bool:
    if cache_location() is not None:
        return True
    warnings.warn("no writable folder for numba's cache of dmlkit's compiled kernels (NUMBA_CACHE_DIR, "
                  f"{KERNEL_DIRS[0] / '__pycache__'}, {_user_wide_dir()}, the temporary directory): they are "
                  "compiled again in every process; set NUMBA_CACHE_DIR to a writable folder", stacklevel=2)
    return False


#: Whether the kernels are cached (``@numba.njit(cache=CACHE)``): ``False`` only when no folder
#: at all can hold the cache (:func:`cache_location`).
CACHE: bool = _cache()
