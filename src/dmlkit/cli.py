"""The ``dmlkit`` command line.

Sub-commands live in :mod:`dmlkit.commands`, one module each with a ``register(app)``
function; they are discovered here so that adding a command touches one file. User errors
(:class:`dmlkit.DmlkitError`) are printed without a traceback and exit with code 2.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import warnings

import typer
from rich.console import Console
from rich.text import Text
from typer.exceptions import TyperException

import dmlkit.commands
from dmlkit.exceptions import DmlkitError

app = typer.Typer(
    name="dmlkit",
    help="Deep metric learning done right: train, evaluate and fairly benchmark embeddings.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
_err = Console(stderr=True)
INTERRUPTED = 130  # the shell's exit code for SIGINT


def _version_callback(value: bool) -> None:
    if value:
        from dmlkit import __version__

        typer.echo(f"dmlkit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Print the version."
    ),
) -> None:
    """Deep metric learning done right: train, evaluate and fairly benchmark embeddings."""


for _info in sorted(pkgutil.iter_modules(dmlkit.commands.__path__), key=lambda m: m.name):
    if not _info.name.startswith("_"):
        importlib.import_module(f"dmlkit.commands.{_info.name}").register(app)


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: object = None, line: str | None = None) -> None:
    """Warnings as one readable line (``warning: ...``), not Python's ``path:line: Category``."""
    text = " ".join(str(message).split())
    _err.print(Text.assemble(("warning: ", "bold yellow"), text), soft_wrap=True)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``dmlkit`` console script."""
    warnings.showwarning = _show_warning
    try:
        # Non-standalone typer returns (not raises) the code of a ``typer.Exit`` and turns
        # Ctrl-C into ``Exit(130)``: the code must reach the shell, not be dropped.
        code = app(args=argv, standalone_mode=False, prog_name="dmlkit")
    except DmlkitError as exc:
        _err.print(Text.assemble(("error: ", "bold red"), str(exc)), soft_wrap=True)
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        _err.print("aborted")
        sys.exit(130)
    except TyperException as exc:  # usage errors: bad options, missing arguments
        exc.show()
        sys.exit(getattr(exc, "exit_code", 2))
    except KeyboardInterrupt:
        code = INTERRUPTED
    if code == INTERRUPTED:
        _err.print("interrupted: stopped by Ctrl-C (files already written are complete; "
                    "a training run continues with --resume)", soft_wrap=True)
    if isinstance(code, int) and code != 0:
        sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
