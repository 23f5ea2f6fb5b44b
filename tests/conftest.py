"""Shared test fixtures: deterministic seeds and the real-data root."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _find_data_root() -> Path | None:
    env = os.environ.get("DMLKIT_DATA")
    candidates = [Path(env)] if env else []
    candidates += [REPO.parent / "shared" / "data", REPO / "shared" / "data"]
    for c in candidates:
        if (c / "README.md").exists():
            return c
    return None


DATA_ROOT = _find_data_root()


@pytest.fixture(scope="session")
def data_root() -> Path:
    """The real-data root (``$DMLKIT_DATA`` or ``../shared/data``); skips when absent."""
    if DATA_ROOT is None:
        pytest.skip("real data not found: set DMLKIT_DATA or put shared/data beside the repo")
    return DATA_ROOT


@pytest.fixture(autouse=True)
def _fixed_seed():
    torch.manual_seed(0)
    np.random.seed(0)
    yield


@pytest.fixture(autouse=True, scope="session")
def _threads():
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield


@pytest.fixture
def two_threads():
    """Two intra-op torch threads for one test (the count restored after it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op torch thread for a whole module (use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``): tiny models run faster on one thread
    than on two on a shared 2-core machine, where torch's thread pool spins and slows ops 10-20x.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def run_cli(capsys):
    """``run_cli(argv) -> (exit code, stdout, stderr)`` of ``dmlkit argv`` in this process (typer's
    ``SystemExit`` caught, 0 when the command returns)."""
    from dmlkit.cli import main

    def run(argv: list[str]) -> tuple[int, str, str]:
        code = 0
        try:
            main(argv)
        except SystemExit as exc:
            code = int(exc.code or 0)
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch intra-op thread for a whole module (use with ``pytestmark =
    pytest.mark.usefixtures("one_torch_thread")``), restored afterwards: on tiny tensors OpenMP
    hand-offs stall for tens of milliseconds an op on a busy shared CPU (two spin-waiting
    threads made the tracking tests 5x slower), with the same results either way."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_faiss_thread():
    """One faiss OpenMP thread for a whole module (use with ``pytestmark =
    pytest.mark.usefixtures("one_faiss_thread")``): tiny indexes only spin-wait on a busy
    machine, with the same results either way."""
    faiss = pytest.importorskip("faiss")
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)
