"""The ``dmlkit`` command line.

Sub-commands live in :mod:`dmlkit.commands`, one module each with a ``register(app)``
function; they are discovered here so that adding a command touches one file. User errors
(:class:`dmlkit.DmlkitError`) are printed without a traceback and exit with code 2.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import pkgutil
import re
import signal
import sys
import warnings

import typer
from rich.text import Text
from typer.exceptions import TyperException

import dmlkit.commands
from dmlkit.commands._console import DiscardedOutput, output_console, prepare_standard_streams
from dmlkit.commands._ranks import (
    OS_ERROR_EXIT_CODE,
    is_main_rank,
    one_error_line_per_job,
    refuse_under_torchrun,
)
from dmlkit.exceptions import DmlkitError
from dmlkit.signals import STOP_CODES, exit_on_signals, stop_code

app = typer.Typer(
    name="dmlkit",
    help="Deep metric learning done right: train, evaluate and fairly benchmark embeddings.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
_err = output_console(stderr=True)  # a $COLUMNS of 0 is no width of 0: error lines stay
INTERRUPTED = 130  # the shell's exit code for SIGINT
#: The exit code of a command whose printed output was lost to a closed standard output
#: (``>&-``), as for a broken pipe (rich's and click's exit code for it).
LOST_OUTPUT = 1


def _version_callback(value: bool) -> None:
    if value:
        from dmlkit import __version__

        typer.echo(f"dmlkit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Print the version."
    ),
) -> None:
    """Deep metric learning done right: train, evaluate and fairly benchmark embeddings."""
    if ctx.invoked_subcommand is not None:  # once for every command: most run as one process
        with one_error_line_per_job():
            refuse_under_torchrun(ctx.invoked_subcommand)


for _info in sorted(pkgutil.iter_modules(dmlkit.commands.__path__), key=lambda m: m.name):
    if not _info.name.startswith("_"):
        importlib.import_module(f"dmlkit.commands.{_info.name}").register(app)


def reflow_help(text: str) -> str:
    """A docstring as help text: each prose paragraph on one line, so the terminal wraps it
    (typer keeps a docstring's line breaks, which ragged every paragraph at its source width);
    paragraphs with list items or indented lines are kept as written."""
    paragraphs = inspect.cleandoc(text).split("\n\n")
    keep = re.compile(r"^\s*([*-] |\d+\. |\s{2,}\S|\|)")
    return "\n\n".join(p if any(keep.match(line) for line in p.splitlines()) else " ".join(p.split())
                       for p in paragraphs)


def _reflow_commands(typer_app: typer.Typer) -> None:
    """:func:`reflow_help` on the help of every command and command group of ``typer_app``."""
    for info in typer_app.registered_commands:
        doc = info.help if info.help is not None else inspect.getdoc(info.callback)
        if doc:
            info.help = reflow_help(doc)
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _reflow_commands(group.typer_instance)


_reflow_commands(app)


#: Library spellings in the library's messages: (pattern, config key, value, rest of the phrase).
#: :func:`cli_spelling` rewrites them the way the command line is used.
_LIBRARY_SPELLINGS: tuple[tuple[re.Pattern[str], str, str, str], ...] = (
    (re.compile(r"(?:load the dataset )?with skip_corrupt=True"), "data.options.skip_corrupt", "true", ""),
    (re.compile(r"pass download=True"), "data.options.download", "true", ""),
    (re.compile(r"pass root=<(folder|file\.csv)>"), "data.root", r"<\1>", ""),
)
#: Commands whose config takes ``--set KEY=VALUE``, with the prefix of their dataset section.
_SET_PREFIX = {"train": "", "bench": "fixed."}
#: ``skip_corrupt=True`` hints under the other commands, which cannot skip an unreadable image:
#: a run's data options are its checkpoint's (``embed``, ``reid``, ``export``, ... refuse a
#: ``config.yaml`` edited to skip: "not a checkpoint of the run"), ``verify --pair-list``
#: reads no config. (pattern, replacement): the whole clause of :func:`dmlkit.data.load_image`'s
#: "Replace or delete the file, or load the dataset with skip_corrupt=True to skip unreadable
#: images" goes, leaving "Replace or delete the file"; any other mention says it cannot skip.
_NO_SKIP_ROUTE: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r", or load the dataset with skip_corrupt=True to skip unreadable images"), ""),
    (re.compile(r"(?:load the dataset )?with skip_corrupt=True"),
     "not possible under this command: replace or delete the unreadable files"),
)


def cli_spelling(message: str, command: str | None) -> str:
    """``message`` with library spellings (``skip_corrupt=True``, ``download=True``) in the
    command line's: ``--set data.options.skip_corrupt=true`` for ``train`` (``fixed.data...``
    for ``bench``), else the key to set in the config file the command reads; a hint to skip
    unreadable images is dropped under commands that cannot (:data:`_NO_SKIP_ROUTE`): the
    message says to replace or delete the file."""
    if command not in _SET_PREFIX:
        for pattern, replacement in _NO_SKIP_ROUTE:
            message = pattern.sub(replacement, message)
    for pattern, key, value, rest in _LIBRARY_SPELLINGS:
        if command in _SET_PREFIX:
            replacement = f"pass --set {_SET_PREFIX[command]}{key}={value}{rest}"
        else:
            replacement = f"set {key}: {value} in the config{rest}"
        message = pattern.sub(replacement, message)
    return message


def _command(argv: list[str]) -> str | None:
    """The sub-command named in ``argv`` (its first word that is not an option)."""
    return next((a for a in argv if not a.startswith("-")), None)


_COMMAND: str | None = None


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: object = None, line: str | None = None) -> None:
    """Warnings as one readable line (``warning: ...``), not Python's ``path:line: Category``."""
    text = cli_spelling(" ".join(str(message).split()), _COMMAND)
    with contextlib.suppress(OSError):  # stderr gone mid-run (a full disk): the command goes on
        _err.print(Text.assemble(("warning: ", "bold yellow"), text), soft_wrap=True)


#: How torch's ``ExceptionWrapper`` re-raises an error from a ``DataLoader`` worker: the same
#: type, its message preceded by "Caught X in DataLoader worker process N." and the worker's
#: whole traceback, whose last line is ``module.Type: message``.
_WORKER_TRACEBACK = "\nOriginal Traceback (most recent call last):"


def _error_line(message: str) -> str:
    """The one line to show for an error ``message``: a ``DataLoader`` worker's error
    (``data.num_workers > 0``) as the error itself (it was 47 lines with the worker's
    traceback, where ``num_workers = 0`` gave "cannot read image ...")."""
    if _WORKER_TRACEBACK not in message:
        return message
    last = message.rstrip().rsplit("\n", 1)[-1]
    kind, sep, text = last.partition(": ")
    return text if sep and kind.replace(".", "").replace("_", "").isalnum() else last


def _error(message: str) -> None:
    """``error: MESSAGE`` on stderr, never wrapped (a pipe or log file gets whole lines)."""
    with contextlib.suppress(OSError):  # stderr gone mid-run: the exit code still tells
        _err.print(Text.assemble(("error: ", "bold red"), message), soft_wrap=True)


def _lost_peer_line(exc: Exception) -> str | None:
    """The one line for a collective that failed because a peer rank is gone (gloo's
    ``Connection closed by peer``, ``DistBackendError``), naming the rank that failed when it
    left its error (:func:`dmlkit.distributed.lost_peer_error`); ``None`` for any other error."""
    if "torch.distributed" not in sys.modules:  # no distributed job ran
        return None
    from dmlkit.distributed import lost_peer, lost_peer_error  # lazy: torch, only after a failure

    return str(lost_peer_error(exc)) if lost_peer(exc) else None


def _eof_line(exc: EOFError) -> str:
    """The one line for an :class:`EOFError` that reached the command line: typer turns it into
    an abort ("aborted", exit 130, as if the user had stopped the command), but it comes from a
    file or stream that ended early (numpy reading an empty file, ``input()`` on a closed stdin)."""
    reason = " ".join(str(exc).split()) or "EOFError"
    return (f"an input ended unexpectedly ({reason}): a file the command reads is empty or "
            "truncated, or its standard input is closed")


def _command_words(argv: list[str]) -> tuple[str, ...]:
    """The first two words of ``argv`` that are not options (a command and its sub-command)."""
    return tuple(a for a in argv if not a.startswith("-"))[:2]


#: What the ``interrupted:`` line adds for a command that continues where it stopped.
_CONTINUES = {"train": "the run continues with --resume",
              "track train": "the run continues with --resume",
              "patches train": "the same command continues the run",
              "bench": "the same command continues the bench"}


def _interrupted_line(code: int, argv: list[str]) -> str:
    """The one line of a command stopped by Ctrl-C (``code`` 130) or a stop signal
    (:data:`dmlkit.signals.STOP_CODES`: 128 + N): what stopped it and what stands (only a command that can continue says
    how: :data:`_CONTINUES`)."""
    how = "Ctrl-C" if code == INTERRUPTED else signal.Signals(code - 128).name
    words = _command_words(argv)
    if words[:1] == ("serve",):
        return f"interrupted: stopped by {how} (the server is shut down)"
    more = next((_CONTINUES[k] for k in (" ".join(words), words[0] if words else "") if k in _CONTINUES), None)
    return f"interrupted: stopped by {how} (files already written are complete{'; ' + more if more else ''})"


#: Commands whose product is what they print (no file holds it unless ``-o`` names one).
_STDOUT_PRODUCTS = frozenset({"evaluate", "verify", "fewshot", "oneshot", "compare", "query", "reid",
                              "patches evaluate", "track evaluate"})


def _output_was_the_product(argv: list[str]) -> bool:
    """Whether the command of ``argv`` gives its result on standard output: help, the version,
    and :data:`_STDOUT_PRODUCTS` without an output file (``-o``, ``--out``, ``--output``)."""
    if any(a in ("--help", "--version") for a in argv) or _command(argv) is None:
        return True
    to_file = any(a in ("-o", "--out", "--output", "--out-dir")
                  or a.startswith(("--out=", "--output=", "--out-dir="))
                  or (a.startswith("-o") and not a.startswith("--")) for a in argv)
    named = (_command(argv), " ".join(_command_words(argv)))
    return any(n in _STDOUT_PRODUCTS for n in named) and not to_file


def _refuse_lost_output(lost: DiscardedOutput | None, argv: list[str]) -> None:
    """Exit :data:`LOST_OUTPUT` with one line when the command's product went to a closed
    standard output (``>&-``; it exited 0 with the output lost). A command whose product is
    files (``train``, ``index``, ...) drops its summary without an error."""
    if lost is None:
        return
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
    if lost.size and _output_was_the_product(argv):
        what = _command(argv) or ("--version" if "--version" in argv else "--help")
        _error(f"standard output is closed or cannot be written: the output of `dmlkit {what}` ({lost.size} bytes) was "
               "lost; run it with its standard output open (a file, a pipe, or /dev/null to discard it)")
        sys.exit(LOST_OUTPUT)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``dmlkit`` console script.

    Before the command runs: a closed or unwritable stderr or stdout becomes ``os.devnull``
    (a closed stdout is remembered: :func:`_refuse_lost_output`) and both streams write a
    character their encoding lacks as ``\\uXXXX``
    (:func:`dmlkit.commands._console.prepare_standard_streams`); SIGTERM and SIGHUP stop the
    command as Ctrl-C does (:func:`dmlkit.signals.exit_on_signals`)."""
    global _COMMAND
    lost = prepare_standard_streams()
    args = sys.argv[1:] if argv is None else list(argv)
    _COMMAND = _command(args)
    warnings.showwarning = _show_warning
    try:
        with exit_on_signals():
            _run(argv, args)
    except SystemExit as exc:
        if exc.code in (0, None):
            _refuse_lost_output(lost, args)
        raise
    _refuse_lost_output(lost, args)


def _app_code(argv: list[str] | None) -> int | None:
    """The exit code of ``app``; an error raised while a stop unwinds (after Ctrl-C, SIGTERM or
    SIGHUP: :func:`dmlkit.signals.stop_code`) is that stop's 128 + N. A group's SIGTERM during
    training with loader workers gave torch's "DataLoader worker ... is killed by signal"
    traceback and exit 1, not the one ``interrupted`` line and 143."""
    try:
        # Non-standalone typer returns (not raises) the code of a ``typer.Exit`` and turns
        # Ctrl-C into ``Exit(130)``: the code must reach the shell, not be dropped.
        return app(args=argv, standalone_mode=False, prog_name="dmlkit")
    except (typer.Exit, typer.Abort, TyperException, KeyboardInterrupt):
        raise
    except (Exception, SystemExit) as exc:
        code = stop_code(exc)
        if code is None:
            raise
        return code


def _run(argv: list[str] | None, args: list[str]) -> None:
    """The command of ``argv`` (``args``: the same, from ``sys.argv`` when ``argv`` is None),
    its errors as one line and exit code 2, an interruption as one line and 128 + N."""
    try:
        code = _app_code(argv)
    except DmlkitError as exc:
        _error(cli_spelling(_error_line(str(exc)), _COMMAND))
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort as exc:
        if isinstance(exc.__cause__, EOFError):  # not Ctrl-C (typer's Exit(130)): an input ended early
            _error(_eof_line(exc.__cause__))
            sys.exit(2)
        with contextlib.suppress(OSError):
            _err.print("aborted")
        sys.exit(130)
    except TyperException as exc:  # usage errors: bad options, missing arguments
        ctx = getattr(exc, "ctx", None)
        if ctx is None:
            exc.show()
        else:  # one line, like every other error (no usage block, no box)
            _error(f"{exc.format_message()} (see '{ctx.command_path} --help')")
        sys.exit(getattr(exc, "exit_code", 2))
    except KeyboardInterrupt:
        code = INTERRUPTED
    except SystemExit as exc:  # SIGTERM, SIGHUP (dmlkit.signals.exit_on_signals)
        if exc.code not in STOP_CODES:
            raise
        code = exc.code
    except OSError as exc:  # a file the command reads or writes: disk full, permissions, ...
        from dmlkit.utils import os_error_message  # numpy: not at start-up (`dmlkit --help`)

        _error(os_error_message(exc))
        sys.exit(OS_ERROR_EXIT_CODE)
    except Exception as exc:  # under torchrun: a collective broken by a peer rank, as one line
        line = _lost_peer_line(exc)
        if line is None:
            raise
        _error(line)
        sys.exit(2)
    interrupted = code == INTERRUPTED or code in STOP_CODES
    if interrupted and is_main_rank():  # under torchrun: once, by rank 0
        with contextlib.suppress(OSError):  # SIGHUP: the terminal may be gone
            _err.print(_interrupted_line(code, args), soft_wrap=True)
    if isinstance(code, int) and code != 0:
        sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
