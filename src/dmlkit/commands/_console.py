"""The rich console every command prints its tables to (not a command: the leading underscore
keeps :mod:`dmlkit.cli` from registering it)."""

from __future__ import annotations

import os

from rich.console import Console

#: Width of the output off a terminal: wide enough that no table cell (a method name, a path)
#: is cut with "…" or folded onto a second line in a pipe, a log file or CI output.
PIPE_WIDTH = 1000


def output_console(*, stderr: bool = False, quiet: bool = False) -> Console:
    """A console for command output: the terminal's width on a terminal; off a terminal (and
    without ``$COLUMNS``) :data:`PIPE_WIDTH` columns, so tables keep whole cells and lines."""
    console = Console(stderr=stderr, quiet=quiet)
    if console.is_terminal or os.environ.get("COLUMNS"):
        return console
    return Console(stderr=stderr, quiet=quiet, width=PIPE_WIDTH)


def echo_json(obj: object) -> None:
    """Print ``obj`` as strict JSON (:func:`dmlkit.utils.json_text`: NaN and infinities as
    ``null``), the one way every ``--json`` option prints."""
    import typer

    from dmlkit.utils import json_text

    typer.echo(json_text(obj))
