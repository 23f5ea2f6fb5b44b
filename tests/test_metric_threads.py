"""The metric worker threads run torch single-threaded and leave the caller's setting as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dmlkit.metrics import evaluate, per_query
from dmlkit.metrics._threads import run_threads, single_threaded_torch


def test_workers_use_one_thread_and_the_caller_keeps_its_count(two_threads):
    seen = []
    run_threads(lambda _: seen.append(torch.get_num_threads()), range(6), 2)
    assert seen == [1] * 6  # a fresh thread would otherwise start from OpenMP's default
    assert torch.get_num_threads() == 2
    with single_threaded_torch() as workers:
        assert workers == 2 and torch.get_num_threads() == 1
        run_threads(lambda _: None, range(3), workers)
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2


def test_the_count_is_restored_when_a_worker_fails(two_threads):
    def boom(item: int) -> None:
        raise ValueError(f"item {item}")

    with pytest.raises(ValueError):
        run_threads(boom, range(3), 2)
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("mode", [torch.inference_mode, torch.no_grad])
def test_threaded_metrics_run_in_the_callers_inference_mode(mode):
    # the workers wrote into buffers allocated under the caller's inference mode from outside it
    # ("Inplace update to inference tensor outside InferenceMode"): threads start outside it
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(300, 8, generator=g), torch.arange(300) % 7
    names = ["precision_at_1", "map_at_r", "map", "pos_neg_js"]
    plain = evaluate(x, y, metrics=names, backend="numba")
    rows, counts = per_query(x, y, backend="numba")
    with mode():
        caller = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        seen = []
        run_threads(lambda _: seen.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled())),
                    range(4), 2)
        assert seen == [caller] * 4
        assert evaluate(x, y, metrics=names, backend="numba") == plain
        got, got_counts = per_query(x, y, backend="numba")
    assert np.array_equal(got_counts, counts) and got.keys() == rows.keys()
    assert all(np.array_equal(got[key], rows[key]) for key in rows)
