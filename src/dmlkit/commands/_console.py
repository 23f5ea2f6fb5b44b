"""The rich console every command prints its tables to (not a command: the leading underscore
keeps :mod:`dmlkit.cli` from registering it)."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from typing import Any

from rich.console import Console

#: Width of the output off a terminal: wide enough that no table cell (a method name, a path)
#: is cut with "…" or folded onto a second line in a pipe, a log file or CI output.
PIPE_WIDTH = 1000
#: Width on a terminal whose size cannot be read (rich's own default).
DEFAULT_WIDTH = 80


def columns_from_environment() -> int | None:
    """``$COLUMNS`` when it is a positive whole number, else ``None`` (unset, empty, ``0``,
    ``-5``, ``abc``): rich took ``COLUMNS=0`` (which ``docker exec`` and CI runners without a
    terminal export) as a width of 0 columns and printed nothing at all, not even an error."""
    value = os.environ.get("COLUMNS")
    if value is None or not value.isdigit() or int(value) <= 0:
        return None
    return int(value)


def output_console(*, stderr: bool = False, quiet: bool = False, pipe_width: int = PIPE_WIDTH) -> Console:
    """A console for command output (``stderr=True``: for error, warning and log lines).

    Its width: ``$COLUMNS`` when that is a positive whole number; else the terminal's width on
    a terminal, and ``pipe_width`` columns off one (:data:`PIPE_WIDTH`: tables keep whole cells
    and lines). A ``$COLUMNS`` that is not a positive whole number counts as unset
    (:func:`columns_from_environment`)."""
    console = Console(stderr=stderr, quiet=quiet)
    if columns_from_environment() is not None:
        return console  # rich reads it
    if console.is_terminal:
        if "COLUMNS" not in os.environ:
            return console
        width = _terminal_width(console)
    else:
        width = pipe_width
    return Console(stderr=stderr, quiet=quiet, width=width)


def _terminal_width(console: Console) -> int:
    """The width of the terminal ``console`` writes to (:data:`DEFAULT_WIDTH` if unknown)."""
    try:
        return os.get_terminal_size(console.file.fileno()).columns or DEFAULT_WIDTH
    except (AttributeError, ValueError, OSError):
        return DEFAULT_WIDTH


class DiscardedOutput(io.RawIOBase):
    """Where the text for a closed standard output goes: nowhere; :attr:`size` counts its bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self.size += n
        return n


def _writable(stream: Any) -> bool:
    """Whether ``stream`` takes writes: not ``None`` (Python's stream for a descriptor closed at
    start-up), not closed, and its file descriptor takes a 0-byte write (which fails with EBADF
    for a closed or read-only descriptor and ENOSPC for ``/dev/full``). A stream without a
    descriptor (a test's capture) is taken as writable."""
    if stream is None or getattr(stream, "closed", False):
        return False
    try:
        fd = stream.fileno()
    except (OSError, ValueError, AttributeError):
        return True
    try:
        os.write(fd, b"")
    except OSError:
        return False
    return True


def _devnull_at(fd: int) -> None:
    """Point the file descriptor ``fd`` at ``os.devnull``: a closed 1 or 2 is otherwise taken by
    the next file the command opens, and what a library writes to it at the C level (libgomp,
    torch) would land in that file."""
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_WRONLY)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)


def prepare_standard_streams() -> DiscardedOutput | None:
    """Make ``sys.stderr`` and ``sys.stdout`` safe to write, once, before a command runs.

    * A closed or unwritable stderr (``2>&-``, ``2>/dev/full``) becomes ``os.devnull``: the
      first progress bar or warning raised ``OSError`` and the error handler failed too, so
      ``train`` stopped after its first files with exit 1 and no message.
    * A closed or unwritable stdout (``>&-``) becomes a :class:`DiscardedOutput`, returned so
      that the command line can tell whether output was lost (``None``: stdout is writable).
    * Both write a character their encoding cannot hold as ``\\xNN``/``\\uXXXX``
      (``errors="backslashreplace"``, as Python's stderr already does): under
      ``PYTHONIOENCODING=ascii`` or Windows' ``cp1252`` a file name in a table title raised
      ``UnicodeEncodeError``.
    """
    if not _writable(sys.stderr):
        _devnull_at(2)
        sys.stderr = open(os.devnull, "w", encoding="utf-8")  # the process's stderr from now on
    lost = None
    if not _writable(sys.stdout):
        _devnull_at(1)
        lost = DiscardedOutput()
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(lost), encoding="utf-8", write_through=True)
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
            with contextlib.suppress(ValueError, OSError):
                stream.reconfigure(errors="backslashreplace")
    return lost


def echo_json(obj: object) -> None:
    """Print ``obj`` as strict JSON (:func:`dmlkit.utils.json_text`: NaN and infinities as
    ``null``), the one way every ``--json`` option prints."""
    import typer

    from dmlkit.utils import json_text

    typer.echo(json_text(obj))
