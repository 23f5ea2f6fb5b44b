"""Audit findings on the whole-set metrics (histograms, clustering) and streaming inputs: each
test failed before its fix."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from dmlkit.distances import CosineSimilarity, DotProductSimilarity, LpDistance
from dmlkit.embedding_shards import open_shards, write_shards
from dmlkit.exceptions import ConfigError, DataError
from dmlkit.metrics import evaluate
from dmlkit.metrics.clustering import cluster_metrics, kmeans_labels
from dmlkit.metrics.histograms import _count_cpu, _count_torch, pos_neg_histograms
from dmlkit.metrics.streaming import evaluate_streaming

pytestmark = pytest.mark.usefixtures("one_thread")


def _binary_codes(n: int, d: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """{-1, +1} codes: every cosine (d - 2h) / d, many of them exactly on a bin edge."""
    rng = np.random.default_rng(seed)
    codes = rng.choice(np.array([-1.0, 1.0], np.float32), size=(n, d))
    return codes, rng.integers(0, 6, n)


def _oracle_counts(values: np.ndarray, labels: np.ndarray, lo: float, hi: float, bins: int):
    """Positive and all-pair counts of the upper triangle of float64 ``values``, each in bin
    ``floor((v - lo) * bins / (hi - lo))`` clamped (the documented rule)."""
    i, j = np.triu_indices(values.shape[0], 1)
    b = np.clip(np.floor((values[i, j] - lo) * (bins / (hi - lo))), 0, bins - 1).astype(np.int64)
    same = labels[i] == labels[j]
    return np.bincount(b[same], minlength=bins), np.bincount(b, minlength=bins)


def test_equal_cosines_share_a_bin_whatever_the_norms():
    """Two pairs with the same exact cosine 3/5 (one of them of rows whose float32-normalised
    product rounds below 0.6) fell in bins 80 and 79: JS 0.5 for identical distributions."""
    q = np.array([[1, 0], [2, 1]], np.float32)
    r = np.array([[3, 4], [2, -1]], np.float32)
    h = pos_neg_histograms(q, [0, 1], r, [0, 0])
    assert h.js == 0.0
    np.testing.assert_array_equal(h.pos_counts, h.neg_counts)
    assert evaluate(q, [0, 1], r, [0, 0], metrics=["pos_neg_js"])["pos_neg_js"] == 0.0
    qt, rt = torch.from_numpy(q), torch.from_numpy(r)
    ql, rl = torch.tensor([0, 1]), torch.tensor([0, 0])
    for count in (_count_cpu, _count_torch):  # the compiled kernel bins alike
        pos, total = count(CosineSimilarity(), qt, ql, rt, rl, False, -1.0, 1.0, 100, 2**20)
        np.testing.assert_array_equal(np.flatnonzero(pos), [80, 94])
        np.testing.assert_array_equal(np.flatnonzero(total - pos), [80, 94])


@pytest.mark.parametrize("count", [_count_cpu, _count_torch])
def test_binary_codes_bin_by_their_float64_cosine_in_any_summation_order(count):
    """Every pair of binary codes lies on an edge: the float32 product's summation order put
    equal cosines in two bins (pos_neg_js 0.000473 for 0.000300 at d = 5; permuting the
    dimensions moved it)."""
    codes, y = _binary_codes(300, 10, seed=1)
    want = _oracle_counts((codes.astype(np.float64) @ codes.T.astype(np.float64)) / 10, y, -1.0, 1.0, 100)
    yt = torch.from_numpy(y)
    for order in (np.arange(10), np.random.default_rng(2).permutation(10)):
        x = torch.from_numpy(np.ascontiguousarray(codes[:, order]))
        pos, total = count(CosineSimilarity(), x, yt, x, yt, True, -1.0, 1.0, 100, 2**16)
        np.testing.assert_array_equal(pos, want[0])
        np.testing.assert_array_equal(total, want[1])


@pytest.mark.parametrize("power", [1, 2])
def test_euclidean_values_on_edges_bin_by_their_float64_distance(power):
    """Integer rows: squared distances are integers, and the distances of a grid lie on the
    edges of bins one unit wide."""
    rng = np.random.default_rng(4)
    x = rng.integers(-2, 3, size=(250, 4)).astype(np.float32)
    y = rng.integers(0, 5, 250)
    sq = ((x[:, None, :].astype(np.float64) - x[None, :, :]) ** 2).sum(-1)
    values = sq if power == 2 else np.sqrt(sq)
    lo, hi, bins = 0.0, 40.0 if power == 2 else 8.0, 40 if power == 2 else 16
    want = _oracle_counts(values, y, lo, hi, bins)
    dist = LpDistance(normalize_embeddings=False, power=power)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for count in (_count_cpu, _count_torch):
        pos, total = count(dist, xt, yt, xt, yt, True, lo, hi, bins, 2**16)
        np.testing.assert_array_equal(pos, want[0])
        np.testing.assert_array_equal(total, want[1])


def test_dot_products_on_edges_bin_by_their_float64_value():
    """Scaled rows whose dot products are exact multiples of the bin width."""
    rng = np.random.default_rng(5)
    x = (rng.integers(-3, 4, size=(200, 6)) * 0.25).astype(np.float32)
    y = rng.integers(0, 4, 200)
    want = _oracle_counts(x.astype(np.float64) @ x.T.astype(np.float64), y, -4.0, 4.0, 32)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for count in (_count_cpu, _count_torch):
        pos, total = count(DotProductSimilarity(normalize_embeddings=False), xt, yt, xt, yt, True,
                           -4.0, 4.0, 32, 2**16)
        np.testing.assert_array_equal(pos, want[0])
        np.testing.assert_array_equal(total, want[1])


def test_one_bin_is_refused_and_every_pair_in_one_bin_is_warned_about():
    """bins=1 gave pos_neg_js 0.0 on perfectly separated classes, as did bins=5 with every
    pair in one bin, without a word."""
    x = np.repeat(np.eye(3, dtype=np.float32), 4, axis=0) + 0.01
    y = np.repeat(np.arange(3), 4)
    with pytest.raises(ConfigError, match="bins must be an integer from 2 to 1000000"):
        pos_neg_histograms(x, y, bins=1)
    with pytest.warns(UserWarning, match="every pair falls in one bin"):
        assert pos_neg_histograms(x, y, bins=2, range=(-10.0, 10.0)).js == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pos_neg_histograms(x, y, bins=5).js > 0.9


def test_a_repeated_clustering_metric_is_scored_once():
    """["nmi", "nmi"] appended each restart's score twice: its std was taken over a, a, b, b, c, c."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 8)).astype(np.float32)
    y = rng.integers(0, 6, 120)
    once = cluster_metrics(x, y, ["nmi"], restarts=3, spread=True)
    assert cluster_metrics(x, y, ["nmi", "nmi"], restarts=3, spread=True) == once
    assert cluster_metrics(x, y, "nmi", restarts=3, spread=True) == once


def test_faiss_k_means_takes_every_accepted_seed():
    """Seeds from 2**31 - 1 overflowed faiss's C int (SWIG OverflowError)."""
    pytest.importorskip("faiss")
    x = np.random.default_rng(0).normal(size=(60, 4)).astype(np.float32)
    labels = kmeans_labels(x, 3, 2**32 - 1, backend="faiss")
    assert labels.shape == (60,) and set(labels.tolist()) <= {0, 1, 2}


def test_an_empty_shard_file_is_a_data_error(tmp_path):
    """A 0-byte shard raised numpy's EOFError, which the CLI reported as Ctrl-C (exit 130)."""
    x = np.random.default_rng(0).normal(size=(40, 4)).astype(np.float32)
    write_shards(tmp_path / "s", x, np.arange(40) % 4, shard_rows=16)
    first = sorted((tmp_path / "s").glob("*.npy"))[0]
    first.write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        evaluate_streaming(open_shards(tmp_path / "s"), metrics=["precision_at_1"])


def test_fractional_query_ranges_and_block_rows_are_refused():
    """(0.7, 10.9) was truncated to rows 0-9 and (2.5, 9) to 2-8 without a word."""
    x = np.random.default_rng(0).normal(size=(30, 4)).astype(np.float32)
    y = np.arange(30) % 3
    with pytest.raises(ConfigError, match="query_range start"):
        evaluate_streaming(x, y, query_range=(0.7, 10))
    with pytest.raises(ConfigError, match="query_range stop"):
        evaluate_streaming(x, y, query_range=(2, 9.5))
    with pytest.raises(ConfigError, match="query_range"):
        evaluate_streaming(x, y, query_range=(1, 2, 3))
    with pytest.raises(ConfigError, match="block_rows"):
        evaluate_streaming(x, y, block_rows=2.7)
