"""Arithmetic at scale (audit s42): histogram bins of pairs far outside an explicit range on the
compiled path, verification pairs drawn without listing every pair, the paired bootstrap within
a byte budget, and per-row arrays of an embeddings file that do not hold one value per row."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from dmlkit.distances import get_distance
from dmlkit.metrics.histograms import pos_neg_histograms
from dmlkit.metrics.knn import SMALL_SEARCH_PAIRS

MiB = 2**20


def _peak_bytes(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), peak traced bytes)`` (numpy reports its buffers to tracemalloc)."""
    tracemalloc.start()
    try:
        out = fn(*args, **kwargs)
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# -- histograms: out-of-range pairs on the compiled path -------------------------------------
@pytest.mark.parametrize("value_range", [(-1.0, 1.0), (-1e-30, 1e-30)])
def test_pairs_far_outside_an_explicit_range_take_the_end_bins_on_the_compiled_path(value_range):
    """Raw dot products of +-1e20 binned over ``range``: a bin position ``t`` of 5e20 (beyond
    int64) or +inf (float32 overflow, the second range) was converted to an integer before the
    clamp; x86 gives INT64_MIN, so every positive pair took the FIRST bin and js read 0.0. The
    torch path (and the docstring: out-of-range pairs go to the first or last bin) put them in
    the last. 2 x (2^21 + 2) pairs take the compiled path (more than SMALL_SEARCH_PAIRS)."""
    m = SMALL_SEARCH_PAIRS // 2 + 2
    assert 2 * m > SMALL_SEARCH_PAIRS
    a = 1e10
    query = np.array([[a], [-a]], np.float32)
    reference = np.where(np.arange(m) % 2 == 0, a, -a).astype(np.float32)[:, None]
    h = pos_neg_histograms(query, np.array([0, 1]), reference, np.arange(m) % 2,
                           distance=get_distance("dot", normalize_embeddings=False), bins=10,
                           range=value_range)
    assert h.pos_counts[-1] == h.num_positive_pairs == m  # within-class dot +1e20: last bin
    assert h.neg_counts[0] == h.num_negative_pairs == m  # across classes -1e20: first bin
    assert h.js == pytest.approx(1.0)


def test_the_exact_rebinning_clamps_before_converting_too():
    """``exact_bin`` (the float64 re-binning of pairs near an edge) had the same conversion."""
    from dmlkit.metrics import _kernels

    row = np.array([1e10], np.float32)
    assert _kernels.exact_bin(row, row, _kernels.EDGE_IP, -1.0, 50.0, 99) == 99
    assert _kernels.exact_bin(row, -row, _kernels.EDGE_IP, -1.0, 50.0, 99) == 0
