"""The processes a bench starts end with it: its worker processes (``--workers N``) and each
training run's torchrun job (``protocol.launcher: torchrun``).

Python ends a process on SIGTERM at once, without running ``finally`` blocks: a ``dmlkit
bench`` sent SIGTERM (``kill``, a batch scheduler's time limit) left its worker processes and
their torchrun jobs running, orphaned. Under :func:`dmlkit.signals.exit_on_signals` SIGTERM
raises ``SystemExit(143)`` instead, like Ctrl-C raises ``KeyboardInterrupt``: the code that
waits for children (:func:`run_worker_processes`,
:meth:`dmlkit.protocol.launch.TorchrunLauncher.run`) stops them, waits for them, and the
process exits non-zero.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from dmlkit.signals import exit_on_signals

__all__ = ["TERMINATED", "environment", "run_worker_processes"]

#: The exit code of a process stopped by SIGTERM (the shell's 128 + 15).
TERMINATED = 128 + signal.SIGTERM
#: Seconds the worker processes get to stop their own children after SIGTERM, before SIGKILL.
STOP_GRACE_S = 30.0


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """Set environment variables while worker processes start (they inherit them)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_worker_processes(target: Callable[..., Any], args: Sequence[tuple], names: Sequence[str], *,
                         env: dict[str, str] | None = None, stagger_s: float = 0.5,
                         grace_s: float | None = None) -> list[int]:
    """Start one ``multiprocessing`` (spawn) process per ``args`` entry running ``target(*args[i])``,
    wait for them all and return their exit codes.

    When the wait is interrupted (SIGTERM, Ctrl-C or any exception), every worker still alive is
    sent SIGTERM (each stops its own torchrun job), given ``grace_s`` seconds (default
    :data:`STOP_GRACE_S`), then SIGKILL; the interruption is then re-raised.
    """
    # spawn, not fork: a forked copy of a process that already runs torch threads can hang
    context = multiprocessing.get_context("spawn")
    procs: list[Any] = []
    with exit_on_signals():
        try:
            with environment(**(env or {})):
                for worker_args, name in zip(args, names):
                    proc = context.Process(target=target, args=worker_args, name=name)
                    proc.start()
                    procs.append(proc)
                    time.sleep(stagger_s)
            for proc in procs:
                proc.join()
        except BaseException:
            _stop_all(procs, STOP_GRACE_S if grace_s is None else grace_s)
            raise
    return [int(proc.exitcode) for proc in procs]


def _stop_all(procs: Sequence[Any], grace_s: float) -> None:
    """SIGTERM to every live process, then SIGKILL to those still alive after ``grace_s``."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(10.0)
