"""The metric worker threads run torch single-threaded and leave the caller's setting as it was."""

from __future__ import annotations

import pytest
import torch

from dmlkit.metrics._threads import run_threads, single_threaded_torch


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


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
