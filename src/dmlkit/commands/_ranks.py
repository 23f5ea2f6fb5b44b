"""One error line per torchrun job (not a command: the leading underscore keeps
:mod:`dmlkit.cli` from registering it).

Under ``torchrun`` every rank runs the command. An error the ranks agreed on
(:func:`dmlkit.distributed.agree`, :func:`dmlkit.distributed.on_main`: marked
:func:`dmlkit.distributed.mark_every_rank`) is printed by rank 0 alone; the others exit with
its code, after rank 0 (they meet at the exit barrier of :func:`dmlkit.distributed.shutdown`).
An error met before the ranks joined cannot be agreed on: a rank other than 0 waits
:data:`UNJOINED_DELAY_S` seconds first (rank 0, failing the same way, prints it and torchrun
stops this rank meanwhile), then prints its own line: its arguments differ from rank 0's.
An error of one rank alone is printed by that rank. The rule covers dmlkit's errors and the
:class:`OSError` of a file a command reads or writes (which :mod:`dmlkit.cli` prints as one line
too): one that rank 0 met inside :func:`dmlkit.distributed.on_main` is re-raised, marked, on
every rank.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import typer

#: The commands that run under torchrun, every rank its share (docs/distributed.md); every other
#: command is one process and refuses ``WORLD_SIZE`` > 1 (:func:`refuse_under_torchrun`).
TORCHRUN_COMMANDS = frozenset({"train", "embed", "evaluate"})
#: What to run instead, for a command with a multi-process mode of its own.
_INSTEAD = {"bench": "to train each trial on several processes, start one `dmlkit bench` (no torchrun) "
                     "with protocol.launcher: torchrun and protocol.nproc_per_trial: N in its config"}
#: Seconds a rank other than 0 waits before printing an error met before the ranks joined.
UNJOINED_DELAY_S = 2.0
#: The exit code of an :class:`OSError` (:mod:`dmlkit.cli` prints it as one line, exit 2).
OS_ERROR_EXIT_CODE = 2


def is_main_rank() -> bool:
    """Rank 0 of a torchrun job, or a process started alone (no ``$RANK``)."""
    return os.environ.get("RANK", "0") in ("", "0")


def refuse_under_torchrun(command: str) -> None:
    """Refuse, in one line, a command outside :data:`TORCHRUN_COMMANDS` started with
    ``WORLD_SIZE`` > 1 (under torchrun): each rank ran it as a separate process, e.g. two
    ``dmlkit bench`` processes racing for one bench directory, the loser saying that "another
    ``dmlkit bench`` is running". Raised before anything is read (every rank meets it; rank 0
    prints it: :func:`one_error_line_per_job`)."""
    if command in TORCHRUN_COMMANDS or os.environ.get("WORLD_SIZE", "1") in ("", "1"):
        return  # (torch is not imported for a plain start)
    from dmlkit.distributed import launched_by_torchrun  # lazy: torch, only under a launcher
    from dmlkit.exceptions import ConfigError

    if launched_by_torchrun():
        instead = _INSTEAD.get(command, "start it as one process, without torchrun")
        raise ConfigError(f"`dmlkit {command}` runs as one process, and this one was started as one of "
                          f"WORLD_SIZE={os.environ['WORLD_SIZE']} (torchrun): {instead}; of the commands, "
                          f"only {', '.join(sorted(TORCHRUN_COMMANDS))} run under torchrun")


@contextlib.contextmanager
def one_error_line_per_job() -> Iterator[None]:
    """Apply the module's rule to a :class:`dmlkit.exceptions.DmlkitError` or an
    :class:`OSError` raised in the block."""
    from dmlkit.exceptions import DmlkitError

    try:
        yield
    except (DmlkitError, OSError) as exc:
        if is_main_rank():
            raise
        from dmlkit.distributed import context, raised_on_every_rank

        if raised_on_every_rank(exc):
            raise typer.Exit(getattr(exc, "exit_code", OS_ERROR_EXIT_CODE)) from None
        if not context().enabled:
            time.sleep(UNJOINED_DELAY_S)
        raise
