"""The images a dataset loaded with ``skip_corrupt=True`` left out, written where a command's
results go.

The dataset's own warning names one of them (``skipped 6 unreadable image(s), e.g. …``); the
others were in ``ds.skipped`` only, in Python. A command with an output folder (``dmlkit
train``'s run directory, ``dmlkit bench``'s bench directory) writes every one, with its reason,
to ``skipped.txt`` there (:func:`record_skipped`), and its warning names that file instead:
the dataset's warning is held back while the data loads (:func:`holding_skip_warnings`), and
given as it was when the command fails before it has a folder to write to.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Any

from dmlkit.utils import atomic_write_text, holding_warnings

__all__ = ["SKIPPED_FILE", "SkippedImagesWarning", "holding_skip_warnings", "record_skipped"]

#: The list of skipped images in a command's output folder.
SKIPPED_FILE = "skipped.txt"
#: The first line of every ``skipped.txt`` says this (a stale one is recognised by it).
_HEADER = "skipped by skip_corrupt=true"


class SkippedImagesWarning(UserWarning):
    """A dataset loaded with ``skip_corrupt=True`` left out unreadable images (``ds.skipped``)."""


def holding_skip_warnings() -> contextlib.AbstractContextManager[None]:
    """Hold back the :class:`SkippedImagesWarning` of datasets loaded inside (every other warning
    is given as usual): the command says it once it has written the list
    (:func:`record_skipped`). If the block fails, the held warnings are given as they were, so
    that the skipped images are not kept from a user whose command stopped before its folder."""
    return holding_warnings(
        lambda held, failed: [w for w in held if failed or not issubclass(w.category, SkippedImagesWarning)],
        always=(SkippedImagesWarning,))


def record_skipped(dataset: Any, directory: str | os.PathLike, *, stacklevel: int = 2) -> Path | None:
    """Write every image ``dataset`` skipped as unreadable, one ``path<TAB>reason`` per line, to
    ``directory/skipped.txt`` (atomically) and warn once, naming the file; remove a
    ``skipped.txt`` left there by an earlier load that skipped images when none were skipped
    now. Returns the file's path, or ``None`` when nothing was skipped."""
    path = Path(directory) / SKIPPED_FILE
    skipped = list(getattr(dataset, "skipped", None) or [])
    if not skipped:
        if _written_here(path):  # never a file of the user's own
            path.unlink()
        return None
    reasons = getattr(dataset, "skip_reasons", {}) or {}
    lines = [f"# {len(skipped)} unreadable image(s) {_HEADER} in {dataset.name}: path<TAB>reason"]
    lines += [f"{p}\t{' '.join(str(reasons.get(p, 'unreadable')).split())}" for p in skipped]
    atomic_write_text(path, "\n".join(lines) + "\n")
    warnings.warn(f"{dataset.name}: skipped {len(skipped)} unreadable image(s), e.g. {skipped[0]}; "
                  f"all of them, with the reasons, are listed in {path}", SkippedImagesWarning,
                  stacklevel=stacklevel)
    return path


def _written_here(path: Path) -> bool:
    """Whether ``path`` is a ``skipped.txt`` :func:`record_skipped` wrote (its first line)."""
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            first = f.readline(4096)
    except OSError:
        return False
    return first.startswith("# ") and _HEADER in first
