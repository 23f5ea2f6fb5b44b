"""Execution settings of the metric kernels: threads and float32 product precision.

torch and numba each bring a thread pool; instead of letting them compete for the cores, the
metrics run single-threaded torch calls and compiled kernels (both release the GIL) on a few
plain Python threads. :func:`full_float32_matmuls` keeps float32 products in float32.

Two of the settings involved belong to the whole process, not to a thread: the float32 product
precision, and torch's default thread count (the count a thread takes at its first torch call:
``torch.set_num_threads`` sets it along with the calling thread's own count). Every dmlkit call
that changes one holds it through :class:`_Held`: under one lock, the first holder saves the
process's value and the last one to leave puts it back. Each call saving and restoring on its
own went wrong when calls overlapped in threads: a call saved the 1 thread or the ``"highest"``
another call had set and put it back as the process's own (every thread started later ran
torch on 1 thread), or restored the caller's ``"high"`` while another call still computed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any, TypeVar

import torch

__all__ = [
    "float32_matmuls_in_full", "full_float32_matmuls", "run_threads", "single_threaded_pool",
    "single_threaded_torch", "torch_threads",
]

#: Guards the holder counts and every change of the settings they cover.
_LOCK = threading.Lock()
if hasattr(os, "register_at_fork"):  # a child forked while another thread held it: free it
    os.register_at_fork(after_in_child=_LOCK._at_fork_reinit)  # type: ignore[attr-defined]


class _Held:
    """How many dmlkit calls now hold one process-wide setting, and the value from before the
    first of them, which the last one puts back (read and written with :data:`_LOCK` held)."""

    __slots__ = ("count", "saved")

    def __init__(self) -> None:
        self.count = 0
        self.saved: Any = None


#: torch's default thread count (what :func:`_default_threads` reads).
_THREADS = _Held()
#: ``torch.get_float32_matmul_precision()``.
_PRECISION = _Held()


def _default_threads() -> int:
    """torch's process-wide default thread count: what a new thread's ``torch.get_num_threads()``
    gives (about 0.1 ms). The calling thread's own count may differ: a thread keeps the default
    of its first torch call, which may have fallen while another call held 1."""
    seen: list[int] = []
    probe = threading.Thread(target=lambda: seen.append(torch.get_num_threads()), daemon=True)
    probe.start()
    probe.join()
    return seen[0] if seen else torch.get_num_threads()


class _TorchThreads:
    """:func:`torch_threads`' context."""

    __slots__ = ("_n", "_own")

    def __init__(self, n: int | None) -> None:
        self._n, self._own = n, 0

    def __enter__(self) -> int:
        with _LOCK:
            saved = _default_threads() if _THREADS.count == 0 else _THREADS.saved
            own = torch.get_num_threads()
            if self._n is not None:
                torch.set_num_threads(self._n)
            _THREADS.saved, self._own = saved, own
            _THREADS.count += 1
        return max(1, own)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        with _LOCK:
            _THREADS.count -= 1
            if _THREADS.count == 0:
                torch.set_num_threads(_THREADS.saved)
            elif self._n is not None:
                torch.set_num_threads(self._own)


def torch_threads(n: int | None) -> _TorchThreads:
    """Run torch ops on ``n`` threads inside the block (``None``: leave the calling thread's count,
    hold the process default only); yields the calling thread's count from before, which it has
    again after the block. torch's process default is held (:class:`_Held`): the last
    overlapping call to leave puts it back, and its thread takes that count."""
    return _TorchThreads(n)


def single_threaded_torch() -> _TorchThreads:
    """Run torch ops on one thread inside the block; yields the thread count to use instead."""
    return torch_threads(1)


def _one_thread_here() -> None:
    """One OpenMP thread for torch/BLAS calls made from the calling thread.

    OpenMP's thread count is a per-thread setting: a new Python thread starts from the default
    (all cores), whatever ``torch.set_num_threads`` set in the main thread, so its BLAS calls
    fork a team whose idle threads spin between the tiles. Measured on a 2-core EPYC, full-ranking
    ``map`` at N = 20k under ``torch.set_num_threads(1)``: 3.65 CPU s before, 2.0-2.2 after.
    The ``get`` first: torch sets a thread's count from the process default at its first call
    that reads it, which would replace a 1 set before (by then another call may have put the
    default back). Call it where :func:`torch_threads` is held: it changes the default.
    """
    torch.get_num_threads()
    torch.set_num_threads(1)


def _callers_autograd_modes() -> Callable[[], contextlib.ExitStack]:
    """A factory of contexts that put a worker thread in the calling thread's inference and
    grad modes.

    Both modes are thread-local: a new thread starts outside ``torch.inference_mode()`` and with
    gradients enabled, whatever its caller set. Workers writing (``out=``, in place) into
    buffers their caller allocated under inference mode then raised torch's "Inplace update to
    inference tensor outside InferenceMode" (``evaluate`` inside a user's
    ``torch.inference_mode()`` on the threaded CPU paths).
    """
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def enter() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.inference_mode(inference))
        stack.enter_context(torch.set_grad_enabled(grad))
        return stack

    return enter


def run_threads(fn: Callable[[Any], None], items: Iterable[Any], workers: int) -> None:
    """``fn(item)`` for every item on ``workers`` threads pulling from one shared iterator
    (cheaper than a future per item for ~10^4 small items), each thread on one torch thread
    (:func:`_one_thread_here`) in the caller's inference and grad modes
    (:func:`_callers_autograd_modes`); the first error is re-raised."""
    it = iter(list(items))  # a list iterator, unlike a generator, may be shared by threads
    errors: list[BaseException] = []
    callers_modes = _callers_autograd_modes()

    def loop() -> None:
        try:
            _one_thread_here()
            with callers_modes():
                for item in it:  # next() on a list iterator is atomic under the GIL
                    if errors:
                        return
                    fn(item)
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    with torch_threads(None):  # the workers' counts change torch's default
        pool = [threading.Thread(target=loop, daemon=True) for _ in range(max(1, workers))]
        for t in pool:
            t.start()
        try:
            for t in pool:
                t.join()
        except BaseException as exc:  # Ctrl-C in the caller: let every worker finish its item
            errors.append(exc)  # stops the loops at their next item
            _join_through_interrupts(pool)
            raise
    if errors:
        raise errors[0]


def _join_through_interrupts(pool: list[threading.Thread]) -> None:
    """Join ``pool`` even if more Ctrl-Cs arrive: exiting while a worker is inside a compiled
    kernel aborts the process (``terminate called without an active exception``)."""
    for t in pool:
        while t.is_alive():
            try:
                t.join()
            except KeyboardInterrupt:
                continue


@contextlib.contextmanager
def single_threaded_pool(workers: int, faiss: Any = None) -> Iterator[Callable[..., Future]]:
    """``submit(fn, *args)`` of a pool of ``workers`` threads, each on one torch thread
    (:func:`_one_thread_here`) and running ``fn`` in the caller's inference and grad modes
    (:func:`_callers_autograd_modes`); the calling thread is on one torch thread and, given the
    ``faiss`` module, one faiss OpenMP thread (a per-thread count, put back after) meanwhile."""
    callers_modes = _callers_autograd_modes()

    def in_callers_modes(fn: Callable[..., Any], *args: Any) -> Any:
        with callers_modes():
            return fn(*args)

    with single_threaded_torch():
        before = faiss.omp_get_max_threads() if faiss is not None else 0
        if faiss is not None:
            faiss.omp_set_num_threads(1)
        try:
            with ThreadPoolExecutor(max_workers=workers, initializer=_one_thread_here) as pool:

                def submit(fn: Callable[..., Any], *args: Any) -> Future:
                    return pool.submit(in_callers_modes, fn, *args)

                yield submit
        finally:
            if faiss is not None:
                faiss.omp_set_num_threads(before)


class _Float32InFull:
    """:func:`float32_matmuls_in_full`' context."""

    __slots__ = ()

    def __enter__(self) -> None:
        with _LOCK:
            if _PRECISION.count == 0:
                _PRECISION.saved = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision("highest")
            _PRECISION.count += 1

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        with _LOCK:
            _PRECISION.count -= 1
            if _PRECISION.count == 0:
                torch.set_float32_matmul_precision(_PRECISION.saved)


def float32_matmuls_in_full() -> _Float32InFull:
    """Float32 matrix products in full float32 inside the block
    (``torch.set_float32_matmul_precision("highest")``); the caller's setting is put back when
    the last overlapping block ends (:class:`_Held`), never while one still computes.

    Every exactness bound of the metric paths (near-ties, full-ranking MAP, the bfloat16 tiles'
    check) assumes a float32 product rounds like float32: under ``"high"`` or ``"medium"``,
    which training scripts set for speed, torch may multiply float32 in TF32 or bfloat16
    (errors ~1e-3) and the metrics would silently stop being exact. The setting is per
    process: a product in another thread meanwhile also runs in full float32.

    A ``with`` block adds no frame: warnings raised inside keep the ``stacklevel`` they count
    from the function they are in (:func:`full_float32_matmuls`' wrapper is one more frame).
    """
    return _Float32InFull()


_F = TypeVar("_F", bound=Callable[..., Any])


def full_float32_matmuls(fn: _F) -> _F:
    """``fn`` run inside :func:`float32_matmuls_in_full`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _Float32InFull():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
