"""Stop signals unwind a command as Ctrl-C does.

Python ends a process on SIGTERM or SIGHUP at once, without running ``finally`` blocks: an
atomic write killed that way left its ``.NAME.XXXX.tmp`` (a 25 MB index, a checkpoint), and a
``dmlkit bench`` left its worker processes and torchrun jobs running, orphaned. While
:func:`exit_on_signals` is active, each of :data:`STOP_SIGNALS` raises ``SystemExit(128 + N)``
instead (the shell's exit code: 143 for SIGTERM, a batch scheduler's time limit or ``kill``;
129 for SIGHUP, a closed terminal or SSH session), like Ctrl-C raises ``KeyboardInterrupt``:
clean-up runs, children are stopped and waited for, and the process exits non-zero.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["STOP_CODES", "STOP_SIGNALS", "exit_on_signals"]

#: The signals :func:`exit_on_signals` turns into ``SystemExit(128 + N)``.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
#: Their exit codes (143, 129).
STOP_CODES = frozenset(128 + int(s) for s in STOP_SIGNALS)


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def exit_on_signals(signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> Iterator[None]:
    """``signals`` raise ``SystemExit(128 + N)`` while the block runs; the previous handlers
    come back after it. A signal ignored when the block starts (``nohup``) stays ignored. Only
    the main thread can take signals: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in signals}
    for sig, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, _raise_exit)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)
