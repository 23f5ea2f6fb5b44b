"""Process-wide state that dmlkit changes for a while stays right when threads call dmlkit at once
(audit s42_threads F3, F4, F5, F7).

torch's default thread count and float32 product precision, the warnings' filters and display,
and matplotlib's rcParams belong to the whole process. Each call saved and restored them on its
own, so overlapping calls restored each other's values: after four threads evaluated at once,
every thread started later ran torch on 1 thread; a call computed under the caller's ``"high"``
that another call had put back; figures drawn at once left dmlkit's rcParams in place and the
warnings' display pointing at a finished figure's list (every later warning dropped).

The threads here are staged, not raced: thread ``i + 1`` starts once thread ``i`` is inside the
section under test, and they leave first in, first out (the order that leaked). Where a lock
keeps thread ``i + 1`` out, the stage moves on after a short wait (nothing here depends on how
long things take: the outcome is checked, the wait only keeps a serialised run short).
"""

from __future__ import annotations

import importlib
import threading
import warnings
from collections.abc import Callable

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

from dmlkit.metrics import _threads, knn
from dmlkit.report import figures
from dmlkit.report.style import styled
from dmlkit.utils import holding_warnings

knn_module = importlib.import_module("dmlkit.metrics.knn")

THREADS = 4


def _in_new_thread(fn: Callable[[], object]) -> object:
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def _default_threads() -> int:
    """What a new thread starts with: torch's process-wide default thread count."""
    return int(_in_new_thread(torch.get_num_threads))  # type: ignore[arg-type]


class _Stages:
    """``inside(i)``, called by thread ``i`` from within the section under test, tells the main
    thread it is in and waits there until the main thread lets it leave."""

    def __init__(self, n: int) -> None:
        self.arrived = [threading.Event() for _ in range(n)]
        self.go = [threading.Event() for _ in range(n)]
        self.index: dict[int, int] = {}

    def inside(self, i: int | None = None) -> None:
        i = self.index[threading.get_ident()] if i is None else i
        self.arrived[i].set()
        assert self.go[i].wait(60), "the main thread never let it leave"

    def run(self, body: Callable[[int], object], locked_out_wait: float = 30.0) -> list[object]:
        """``body(i)`` in thread ``i``; returns the results in thread order (an error re-raised).

        ``locked_out_wait``: how long the main thread waits for thread ``i + 1`` to get in
        before it lets thread ``i`` leave (a lock may hold it back until then)."""
        results: list[object] = [None] * len(self.go)
        errors: list[BaseException] = []

        def target(i: int) -> None:
            self.index[threading.get_ident()] = i
            try:
                results[i] = body(i)
            except BaseException as exc:
                errors.append(exc)
                self.arrived[i].set()

        pool = [threading.Thread(target=target, args=(i,)) for i in range(len(self.go))]
        for i, t in enumerate(pool):
            t.start()
            self.arrived[i].wait(30.0 if i == 0 else locked_out_wait)
        for go, t in zip(self.go, pool, strict=True):  # first in, first out
            go.set()
            t.join()
        if errors:
            raise errors[0]
        return results


# -- F4 / F5: torch's default thread count and float32 product precision ------------------------
def test_overlapping_holds_put_the_default_thread_count_back(two_threads):
    """A thread that started while another held 1 thread saved that 1 and put it back as the
    process default: every thread started later ran torch on 1 thread."""
    assert _default_threads() == 2
    stages = _Stages(THREADS)
    seen = []

    def body(i: int) -> None:
        with _threads.single_threaded_torch() as workers:
            stages.inside(i)
            seen.append((workers, torch.get_num_threads()))

    stages.run(body)
    assert _default_threads() == 2
    assert torch.get_num_threads() == 2
    assert all(count == 1 for _, count in seen)  # each call kept its 1 thread to the end


def test_a_worker_keeps_its_one_thread_when_the_default_changes(two_threads):
    """torch sets a thread's count from the process default at its first call that reads it: a
    worker's 1, set before, became whatever the default was by then (another call may have put
    the caller's count back)."""
    ready, changed, seen = threading.Event(), threading.Event(), []

    def worker() -> None:
        _threads._one_thread_here()
        ready.set()
        changed.wait(30)
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=worker)
    t.start()
    ready.wait(30)
    torch.set_num_threads(2)  # the default back to 2, as a call that finished would
    changed.set()
    t.join()
    assert seen == [1]


def test_overlapping_matmul_precision_holds_keep_highest_to_the_end():
    """A second call saw the first call's "highest" as its caller's and did not switch; the first
    then put the caller's "high" back while the second still computed."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        stages = _Stages(THREADS)
        seen = []

        @_threads.full_float32_matmuls
        def body(i: int) -> None:
            stages.inside(i)
            seen.append(torch.get_float32_matmul_precision())

        stages.run(body)
        assert seen == ["highest"] * THREADS
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


def test_concurrent_knn_calls_leave_threads_and_precision_as_they_were(two_threads, monkeypatch):
    """Four ``knn`` calls (numba backend: single-threaded torch, worker threads, full float32
    products) staged to overlap: same neighbours as alone, each computed on one torch thread in
    full float32 to its end, and afterwards a new thread starts with the caller's 2 threads and
    the caller has its "high" back."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(300 + 40 * i, 16, generator=g) for i in range(THREADS)]
    alone = [knn(x, k=5, backend="numba") for x in xs]
    stages = _Stages(THREADS)
    real = knn_module.run_threads
    waited: set[int] = set()
    during = []

    def run_threads(fn, items, workers):  # the first of each call's thread runs, in its hold
        if threading.get_ident() not in waited:
            waited.add(threading.get_ident())
            stages.inside()
            during.append((torch.get_num_threads(), torch.get_float32_matmul_precision()))
        return real(fn, items, workers)

    monkeypatch.setattr(knn_module, "run_threads", run_threads)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        got = stages.run(lambda i: knn(xs[i], k=5, backend="numba"))
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)
    assert during == [(1, "highest")] * THREADS
    assert _default_threads() == 2 and torch.get_num_threads() == 2
    for a, b in zip(alone, got, strict=True):
        assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)


def test_faiss_pool_workers_run_on_one_thread(two_threads, monkeypatch):
    """The faiss backend's product workers set their own count (they took the process default,
    which another call may have put back meanwhile); the count is back after."""
    pytest.importorskip("faiss")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(500, 16, generator=g)
    seen = set()
    real = knn_module._Scorer.block

    def block(self, *args, **kwargs):
        seen.add(torch.get_num_threads())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(knn_module._Scorer, "block", block)
    torch.set_num_threads(2)
    got = knn(x, k=4, backend="faiss")
    assert seen == {1}
    assert torch.equal(got.indices, knn(x, k=4, backend="torch").indices)
    assert torch.get_num_threads() == 2 and _default_threads() == 2


# -- F3: warnings and rcParams around figures and held warnings ---------------------------------
def _warnings_state() -> tuple:
    return (list(warnings.filters), warnings.showwarning, warnings._showwarnmsg_impl)  # type: ignore[attr-defined]


def test_figures_drawn_from_threads_leave_warnings_and_rcparams_as_they_were(tmp_path):
    """Each thread builds and saves a figure; with the figures overlapping, the last to leave
    restored the warnings' display to a finished figure's list (every later warning of the
    process dropped) and rcParams to dmlkit's."""
    user_rc = dict(matplotlib.rcParams)
    state = _warnings_state()
    stages = _Stages(THREADS)

    @styled
    def draw(i: int) -> None:
        fig = figures.per_class_bars({c: 0.1 * c for c in range(6)}, class_names={c: f"class {c}" for c in range(6)})
        stages.inside(i)
        figures.save_figure(fig, tmp_path / f"f{i}", formats=("png",))
        plt.close(fig)

    stages.run(draw, locked_out_wait=0.3)
    assert _warnings_state() == state
    assert dict(matplotlib.rcParams) == user_rc
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"f{i}.png" for i in range(THREADS)]
    with pytest.warns(UserWarning, match="still shown"):
        warnings.warn("still shown", UserWarning, stacklevel=1)


def test_held_warnings_from_threads_are_each_given_and_the_state_restored():
    """``holding_warnings`` blocks in four threads: each block's warning is given once when it
    ends, and the warnings' filters and display are the caller's after."""
    stages = _Stages(THREADS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = _warnings_state()

        def body(i: int) -> None:
            with holding_warnings(lambda held, failed: held):
                warnings.warn(f"held {i}", UserWarning, stacklevel=1)
                stages.inside(i)

        stages.run(body, locked_out_wait=0.3)
        assert _warnings_state() == state
        warnings.warn("after", UserWarning, stacklevel=1)
    assert sorted(str(w.message) for w in caught) == ["after", *(f"held {i}" for i in range(THREADS))]


def test_locked_sections_nest_in_one_thread(tmp_path):
    """Held warnings around a figure function that calls two others (build, save): one thread
    takes the lock again (re-entrant, no deadlock), and the held warnings come out after."""
    user_rc = dict(matplotlib.rcParams)

    @styled
    def outer() -> None:
        fig = figures.cmc_curve({"a": [0.5, 0.75, 1.0]})
        figures.save_figure(fig, tmp_path / "nested", formats=("png",))
        warnings.warn("inside the figure", UserWarning, stacklevel=1)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with holding_warnings(lambda held, failed: held):
            outer()
            assert caught == []  # held until the block ends
    assert [str(w.message) for w in caught] == ["inside the figure"]
    assert dict(matplotlib.rcParams) == user_rc and (tmp_path / "nested.png").exists()


# -- F7: read-only inputs without a warnings filter ---------------------------------------------
def test_read_only_inputs_are_viewed_without_touching_the_warnings_filters(monkeypatch):
    """A read-only array (a memory-mapped index or shard) was wrapped in
    ``warnings.catch_warnings()``, which swaps the process's filter list: a filter another
    thread added meanwhile was lost, or the "ignore" one left installed."""
    from dmlkit import validation

    filters = warnings.filters
    swapped = []
    real = torch.from_numpy

    def from_numpy(arr: np.ndarray) -> torch.Tensor:
        swapped.append(warnings.filters is not filters)
        return real(arr)

    monkeypatch.setattr(validation.torch, "from_numpy", from_numpy)
    x = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    ro = x.copy()
    ro.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "not writable" warning would raise
        filters = warnings.filters
        t_ro = validation.check_embeddings(ro)
        t_rw = validation.check_embeddings(x)
    assert swapped == [False, False]
    assert t_ro.data_ptr() == ro.ctypes.data and t_rw.data_ptr() == x.ctypes.data  # no copy
    assert torch.equal(t_ro, t_rw)
    assert not ro.flags.writeable


def test_faiss_backend_runs_in_the_callers_inference_mode():
    """The faiss backend's product workers wrote into tiles allocated under the caller's
    ``torch.inference_mode()`` from outside it: "Inplace update to inference tensor outside
    InferenceMode" (as ``run_threads``' workers did before they took the caller's modes)."""
    pytest.importorskip("faiss")
    x = torch.randn(400, 16, generator=torch.Generator().manual_seed(2))
    plain = knn(x, k=3, backend="faiss")
    with torch.inference_mode():
        got = knn(x, k=3, backend="faiss")
    assert torch.equal(got.indices, plain.indices) and torch.equal(got.values, plain.values)


# -- F8: warnings point at the caller's line ----------------------------------------------------
def test_evaluate_and_per_class_warnings_point_at_the_callers_line():
    """The full-float32 wrapper added a frame their stacklevels did not count: the warnings were
    attributed to dmlkit/metrics/_threads.py, at any matmul precision."""
    from dmlkit.metrics import evaluate, per_class, per_query

    g = torch.Generator().manual_seed(0)
    x, one, five = torch.randn(50, 8, generator=g), torch.zeros(50, dtype=torch.int64), torch.arange(50) % 5
    before = torch.get_float32_matmul_precision()
    try:
        for precision in ("highest", "high"):
            torch.set_float32_matmul_precision(precision)
            calls = [  # one class: NaN with a warning; the reference set is the query set
                lambda: evaluate(x, one, metrics=["precision_at_1", "pos_neg_js"]),
                lambda: per_class(x, one),
                lambda: evaluate(x, five, x, five),
                lambda: per_class(x, five, x.clone(), five),
                lambda: per_query(x, five, x, five),
            ]
            for call in calls:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    call()
                assert caught, precision
                assert {w.filename for w in caught} == {__file__}, [(w.filename, w.lineno) for w in caught]
    finally:
        torch.set_float32_matmul_precision(before)
