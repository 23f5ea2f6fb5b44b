"""Execution settings of the metric kernels: threads and float32 product precision.

torch and numba each bring a thread pool; instead of letting them compete for the cores, the
metrics run single-threaded torch calls and compiled kernels (both release the GIL) on a few
plain Python threads. :func:`full_float32_matmuls` keeps float32 products in float32.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

__all__ = ["full_float32_matmuls", "run_threads", "single_threaded_torch", "torch_threads"]


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[int]:
    """Run torch ops on ``n`` threads inside the block (the count restored after it); yields
    the count it replaced."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield max(1, threads)
    finally:
        torch.set_num_threads(threads)


def single_threaded_torch() -> contextlib.AbstractContextManager[int]:
    """Run torch ops on one thread inside the block; yields the thread count to use instead."""
    return torch_threads(1)


def _one_thread_here() -> None:
    """One OpenMP thread for torch/BLAS calls made from the calling thread.

    OpenMP's thread count is a per-thread setting: a new Python thread starts from the default
    (all cores), whatever ``torch.set_num_threads`` set in the main thread, so its BLAS calls
    fork a team whose idle threads spin between the tiles. Measured on a 2-core EPYC, full-ranking
    ``map`` at N = 20k under ``torch.set_num_threads(1)``: 3.65 CPU s before, 2.0-2.2 after.
    torch also keeps one process-wide count, which :func:`run_threads` restores afterwards.
    """
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
    (cheaper than a future per item for ~10^4 small items), each thread in the caller's
    inference and grad modes (:func:`_callers_autograd_modes`); the first error is re-raised."""
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

    outer = torch.get_num_threads()
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
    finally:
        torch.set_num_threads(outer)
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


_F = TypeVar("_F", bound=Callable[..., Any])


def full_float32_matmuls(fn: _F) -> _F:
    """Run ``fn`` with float32 matrix products in full float32
    (``torch.set_float32_matmul_precision("highest")``), restoring the caller's setting after.

    Every exactness bound of the metric paths (near-ties, full-ranking MAP, the bfloat16 tiles'
    check) assumes a float32 product rounds like float32: under ``"high"`` or ``"medium"``,
    which training scripts set for speed, torch may multiply float32 in TF32 or bfloat16
    (errors ~1e-3) and the metrics would silently stop being exact. The setting is per
    process: a product in another thread meanwhile also runs in full float32.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before = torch.get_float32_matmul_precision()
        if before == "highest":
            return fn(*args, **kwargs)
        torch.set_float32_matmul_precision("highest")
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_float32_matmul_precision(before)

    return wrapper  # type: ignore[return-value]
