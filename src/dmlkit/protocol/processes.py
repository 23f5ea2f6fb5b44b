"""The processes a bench starts end with it: its worker processes (``--workers N``) and each
training run's torchrun job (``protocol.launcher: torchrun``), whether the bench is stopped
(Ctrl-C, SIGTERM, SIGHUP) or dies at once (SIGKILL: the out-of-memory killer, ``kill -9``, a
crash).

Python ends a process on SIGTERM at once, without running ``finally`` blocks: a ``dmlkit
bench`` sent SIGTERM (``kill``, a batch scheduler's time limit) left its worker processes and
their torchrun jobs running, orphaned. Under :func:`dmlkit.signals.exit_on_signals` SIGTERM
raises ``SystemExit(143)`` instead, like Ctrl-C raises ``KeyboardInterrupt``: the code that
waits for children (:func:`run_worker_processes`,
:meth:`dmlkit.protocol.launch.TorchrunLauncher.run`) stops them, waits for them, and the
process exits non-zero.

A process killed outright runs no code at all: a ``dmlkit bench --workers 2`` SIGKILLed during
its search left both workers running for 110 s, finishing all 48 fold runs of the stage beside
a rerun (the s42 audit). So each worker watches its parent (:func:`watch_parent`: a thread
waiting on ``multiprocessing.parent_process().sentinel``, which the kernel closes when the
parent dies, however) and stops itself as the bench would stop it: SIGTERM (which stops its
torchrun job), then SIGKILL after :data:`STOP_GRACE_S`. A torchrun job is started with
``PR_SET_PDEATHSIG`` (Linux: :func:`die_with_parent`): the kernel sends it SIGTERM when the
process that started it dies, and torchrun then stops its ranks.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import wait
from typing import Any

from dmlkit.signals import exit_on_signals

__all__ = ["TERMINATED", "die_with_parent", "environment", "run_worker_processes", "watch_parent"]

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
    wait for them all and return their exit codes. Each process ends when this one dies, even
    by SIGKILL (:func:`watch_parent`).

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
                    proc = context.Process(target=_watched, args=(target, *worker_args), name=name)
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


def _watched(target: Callable[..., Any], *args: Any) -> None:
    """A worker process: :func:`watch_parent`, then ``target(*args)``."""
    watch_parent()
    target(*args)


def watch_parent(grace_s: float = STOP_GRACE_S) -> threading.Thread | None:
    """In a ``multiprocessing`` child: a daemon thread that waits on the parent's sentinel (a
    pipe the kernel closes when the parent process ends, even by SIGKILL), then sends this
    process SIGTERM (:func:`dmlkit.signals.exit_on_signals` unwinds it, stopping its torchrun
    job; without it SIGTERM ends the process), and SIGKILL ``grace_s`` seconds later if it still
    runs. Returns the thread; ``None`` outside a ``multiprocessing`` child."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return None

    def stop_when_orphaned() -> None:
        wait([parent.sentinel])
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=stop_when_orphaned, name="dmlkit-watch-parent", daemon=True)
    thread.start()
    return thread


def die_with_parent() -> Callable[[], None] | None:
    """A ``subprocess.Popen`` ``preexec_fn`` (Linux) that makes the child receive SIGTERM when
    the thread that starts it ends (``prctl(PR_SET_PDEATHSIG, SIGTERM)``, kept across ``exec``),
    and SIGTERM at once if that process is already gone. ``None`` where ``prctl`` is missing
    (the child then outlives a SIGKILLed parent)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the forked child
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent:  # the parent died before prctl: the kernel will not tell
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


#: ``PR_SET_PDEATHSIG`` of ``<linux/prctl.h>``.
_PR_SET_PDEATHSIG = 1
