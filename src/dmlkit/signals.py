"""Stop signals unwind a command as Ctrl-C does, and are never lost.

Python ends a process on SIGTERM or SIGHUP at once, without running ``finally`` blocks: an
atomic write killed that way left its ``.NAME.XXXX.tmp`` (a 25 MB index, a checkpoint), and a
``dmlkit bench`` left its worker processes and torchrun jobs running, orphaned. While
:func:`exit_on_signals` is active, each of :data:`STOP_SIGNALS` raises ``SystemExit(128 + N)``
instead (the shell's exit code: 143 for SIGTERM, a batch scheduler's time limit or ``kill``;
129 for SIGHUP, a closed terminal or SSH session), like Ctrl-C raises ``KeyboardInterrupt``:
clean-up runs, children are stopped and waited for, and the process exits non-zero. The signal
is recorded (:func:`stop_code`): an error raised by the unwind it started is still a stop.

Data-loading workers (``DataLoader(num_workers > 0)``, forked afresh for every epoch and every
embedding pass) meet signals twice:

* **while they are forked.** A signal whose handler ran inside ``os.fork()`` (in an at-fork
  callback, e.g. ``logging``'s) had its ``KeyboardInterrupt``/``SystemExit`` printed as
  "Exception ignored" and dropped: Ctrl-C or SIGTERM was lost and training went on (6 of about
  40 Ctrl-C's in the s42 audit). :func:`signals_deferred` holds :data:`DEFERRED_SIGNALS` back
  while the loader's iterator starts its workers; one that arrives meanwhile is handled as the
  block ends, at an ordinary bytecode.
* **when they run.** A signal to the whole process group (``timeout``, systemd, a closed
  terminal, ``kill -- -PGID``) also reached the workers, which died (or, for SIGHUP, unwound
  with dmlkit's handler) while the main process was unwinding: tracebacks, and exit 1 instead
  of 143. :func:`ignore_stop_signals` (the loaders' ``worker_init_fn``) makes the workers ignore
  :data:`DEFERRED_SIGNALS` and unblocks them: the main process stops its workers as it unwinds,
  and torch's watchdog ends them if the main process dies.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["DEFERRED_SIGNALS", "STOP_CODES", "STOP_SIGNALS", "exit_on_signals", "ignore_stop_signals",
           "signals_deferred", "stop_code"]

#: The signals :func:`exit_on_signals` turns into ``SystemExit(128 + N)``.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
#: Their exit codes (143, 129).
STOP_CODES = frozenset(128 + int(s) for s in STOP_SIGNALS)
#: Ctrl-C and the stop signals: blocked while data-loading workers are forked
#: (:func:`signals_deferred`), ignored by the workers (:func:`ignore_stop_signals`).
DEFERRED_SIGNALS = (signal.SIGINT, *STOP_SIGNALS)
#: Ctrl-C's exit code (128 + SIGINT).
_INTERRUPTED = 128 + int(signal.SIGINT)

#: The stop signal received since the outermost :func:`exit_on_signals` began (None: none).
_received: int | None = None


def _raise_exit(signum: int, frame: Any) -> None:
    global _received
    _received = int(signum)
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def exit_on_signals(signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> Iterator[None]:
    """``signals`` raise ``SystemExit(128 + N)`` while the block runs; the previous handlers
    come back after it. A signal ignored when the block starts (``nohup``) stays ignored. Only
    the main thread can take signals: elsewhere this does nothing. The outermost block forgets
    the signal an earlier one recorded (:func:`stop_code`)."""
    global _received
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in signals}
    if all(handler is not _raise_exit for handler in previous.values()):
        _received = None
    for sig, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, _raise_exit)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)


def stop_code(exc: BaseException) -> int | None:
    """128 + N when ``exc`` belongs to a stop: it is, or was raised while handling (its
    ``__context__``/``__cause__`` chain), Ctrl-C's ``KeyboardInterrupt`` (130) or a stop signal's
    ``SystemExit(128 + N)``; or a stop signal was received under :func:`exit_on_signals` (an
    error raised while unwinding from it, e.g. torch's "DataLoader worker is killed by signal").
    ``None`` otherwise."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, KeyboardInterrupt):
            return _INTERRUPTED
        if isinstance(link, SystemExit) and link.code in STOP_CODES:
            return int(link.code)
        link = link.__cause__ or link.__context__
    return None if _received is None else 128 + _received


@contextlib.contextmanager
def signals_deferred(signals: tuple[signal.Signals, ...] = DEFERRED_SIGNALS) -> Iterator[None]:
    """Hold ``signals`` back while the block runs; one that arrives meanwhile is handled as the
    block ends (a ``KeyboardInterrupt`` or ``SystemExit(128 + N)`` is raised there). Wrap
    ``iter(loader)`` of a ``DataLoader`` with workers: a handler that ran inside the fork lost
    its exception.

    Two layers, since blocking alone does not hold a signal back: another thread (torch's,
    the loader's) that does not block it takes it, and Python runs its handler in the main
    thread at the next bytecode, inside the fork (measured: the test of this function). In the
    main thread the handlers of ``signals`` (not ignored ones) are replaced by one that only
    notes the signal; after the block the previous handlers come back and each noted signal is
    raised again (``signal.raise_signal``). And ``signals`` are blocked in this thread
    (``pthread_sigmask``), so processes forked in the block start with them blocked: a signal
    to the process group stays pending until the worker ignores it
    (:func:`ignore_stop_signals`), also when the loader starts outside the main thread."""
    noted: list[int] = []
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in signals:
            handler = signal.getsignal(sig)
            if handler not in (signal.SIG_IGN, None):  # None: not set from Python, cannot be restored
                previous[sig] = handler
                signal.signal(sig, lambda signum, frame: noted.append(signum))
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signals) if hasattr(signal, "pthread_sigmask") else None
    try:
        yield
    finally:
        if mask is not None:  # one pending is noted now, by the handler above
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in dict.fromkeys(noted):  # its handler runs (and raises) here
            signal.raise_signal(signum)


def ignore_stop_signals(worker_id: int = 0) -> None:
    """A data-loading worker's ``worker_init_fn``: it leaves stopping to the main process.

    :data:`DEFERRED_SIGNALS` are ignored (one pending since the fork is dropped), then
    unblocked: a worker killed by a group's SIGTERM broke the main process's unwind. And a
    connection the main process drops, stopped while it fetched a batch's tensor (its file
    descriptor comes from the worker's ``multiprocessing.resource_sharer`` thread), no longer
    prints that thread's ``ConnectionResetError`` traceback: the worker's ``sys.excepthook``
    passes on every other error."""
    for sig in DEFERRED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, DEFERRED_SIGNALS)
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if not issubclass(kind, ConnectionError | EOFError):  # the main process went away
            previous(kind, value, tb)

    sys.excepthook = excepthook
