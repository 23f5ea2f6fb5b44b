"""Arithmetic at scale (audit s42): histogram bins of pairs far outside an explicit range on the
compiled path, verification pairs drawn without listing every pair, the paired bootstrap within
a byte budget, and per-row arrays of an embeddings file that do not hold one value per row."""

from __future__ import annotations

import tracemalloc
import warnings

import numpy as np
import pytest

from dmlkit.apps import verification
from dmlkit.apps.verification import make_pairs
from dmlkit.distances import get_distance
from dmlkit.embedding_files import read_embedding_file
from dmlkit.embeddings import save_embeddings
from dmlkit.exceptions import DataError
from dmlkit.metrics.histograms import pos_neg_histograms
from dmlkit.metrics.knn import SMALL_SEARCH_PAIRS
from dmlkit.protocol.stats import paired_bootstrap

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


# -- verification pairs -----------------------------------------------------------------------
def _listed_pairs(y: np.ndarray, num_pairs: int, seed: int) -> tuple[np.ndarray, ...]:
    """The pairs as listing drew them before (every same-class pair, and for the negatives every
    pair, listed then sampled), for label sets small enough to list: the reference."""
    rng = np.random.default_rng(seed)
    pos_i, pos_j = [], []
    for c in np.unique(y):
        members = np.flatnonzero(y == c)
        a, b = np.triu_indices(len(members), k=1)
        pos_i.append(members[a])
        pos_j.append(members[b])
    pi, pj = np.concatenate(pos_i), np.concatenate(pos_j)
    a, b = np.triu_indices(len(y), k=1)
    ok = y[a] != y[b]
    n_pos = min(num_pairs // 2, len(pi), int(ok.sum()))
    pick = rng.choice(len(pi), size=n_pos, replace=False)
    neg = np.sort(rng.choice(int(ok.sum()), size=n_pos, replace=False))
    i = np.concatenate([pi[pick], a[ok][neg]])
    j = np.concatenate([pj[pick], b[ok][neg]])
    same = np.r_[np.ones(n_pos, bool), np.zeros(n_pos, bool)]
    order = rng.permutation(len(i))
    return i[order], j[order], same[order]


def _label_sets() -> list[np.ndarray]:
    rng = np.random.default_rng(42)
    sets = [np.repeat(np.arange(5), 7), np.r_[np.zeros(60, int), 1], np.array([3, 1, 3, 2, 1, 1]),
            np.array(["b", "a", "b", "c", "a", "c", "a"])]
    for _ in range(12):
        y = rng.integers(0, int(rng.integers(2, 9)), int(rng.integers(5, 200)))
        if len(np.unique(y)) > 1 and np.bincount(y).max() > 1:
            sets.append(y)
    return sets


@pytest.mark.parametrize("num_pairs", [2, 40, 6000])
def test_drawn_pairs_are_the_pairs_listing_drew(num_pairs):
    """The same seed draws the same pairs as listing every pair did (the same positions of the
    same lists, decoded instead of looked up), scarce kinds included."""
    for y in _label_sets():
        for seed in (0, 3):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # scarce pairs warn
                got = make_pairs(y, num_pairs, seed)
            want = _listed_pairs(y, num_pairs, seed)
            assert all(np.array_equal(g, w) for g, w in zip(got, want)), (y, seed)


def test_same_class_positions_decode_in_a_large_class():
    """Positions in a class of 70,000 (2.4e9 pairs; the float root needs its integer check)."""
    m = 70_000
    y = np.r_[np.zeros(m, int), np.ones(2, int)]
    count = m * (m - 1) // 2
    picks = np.array([0, 1, m - 2, m - 1, 2 * m - 4, 12_345_678, 2**31, count // 2, count - 2, count - 1])
    i, j = verification._same_class_pairs(y, picks)
    for p, a, b in zip(picks.tolist(), i.tolist(), j.tolist()):
        row = int(((2 * m - 1) - np.sqrt((2 * m - 1) ** 2 - 8 * p)) // 2)
        while row * (2 * m - row - 1) // 2 > p:
            row -= 1
        while (row + 1) * (2 * m - row - 2) // 2 <= p:
            row += 1
        assert (a, b) == (row, row + 1 + p - row * (2 * m - row - 1) // 2), p
    i, j = verification._same_class_pairs(y, [count])  # the other class's one pair
    assert (i.tolist(), j.tolist()) == ([m], [m + 1])


def test_positive_pairs_are_drawn_without_listing_them():
    """4 classes of 4,000 hold 32M same-class pairs: listing them to draw 3,000 took 1.1 GiB."""
    y = np.repeat(np.arange(4), 4000)
    (i, j, same), peak = _peak_bytes(make_pairs, y, 6000, seed=0)
    assert peak < 50 * MiB, f"{peak / MiB:.0f} MiB"
    assert same.sum() == (~same).sum() == 3000
    assert ((y[i] == y[j]) == same).all() and (i < j).all()
    assert len(set(zip(i.tolist(), j.tolist()))) == 6000


def test_negative_pairs_are_drawn_without_listing_every_pair():
    """A class of 8,000 and one other sample: its 8,000 different-class pairs were drawn from a
    list of all 32M pairs (np.triu_indices: over 0.5 GiB)."""
    y = np.r_[np.zeros(8000, int), 1]
    (i, j, same), peak = _peak_bytes(make_pairs, y, 16_000, seed=0)
    assert peak < 50 * MiB, f"{peak / MiB:.0f} MiB"
    assert ((y[i] == y[j]) == same).all() and (i < j).all()
    assert sorted(i[~same].tolist()) == list(range(8000)) and (j[~same] == 8000).all()


class _CountingRng:
    """A generator that fails after ``most`` calls of ``integers`` (rounds of rejection)."""

    def __init__(self, seed: int, most: int) -> None:
        self.rng, self.most, self.rounds = np.random.default_rng(seed), most, 0

    def integers(self, *args, **kwargs):
        self.rounds += 1
        assert self.rounds <= self.most, "rejection sampling crawls"
        return self.rng.integers(*args, **kwargs)

    def choice(self, *args, **kwargs):
        return self.rng.choice(*args, **kwargs)


def test_negatives_beside_one_dominant_class_are_drawn_by_position():
    """A class of 100,000 and one other sample: 1 random pair in 100,000 is a different-class
    one, so rejection took ~0.6 pairs a round (31 s for 3,000 beside a class of 20,000)."""
    y = np.r_[np.zeros(100_000, int), 1]
    i, j = verification._negative_pairs(y, 3000, _CountingRng(0, most=20))
    assert len(set(i.tolist())) == 3000 and (j == 100_000).all() and (np.diff(i) > 0).all()


# -- paired bootstrap -------------------------------------------------------------------------
def _bootstrap_before(a, b, resamples, seed, chunk=100):
    """The bootstrap of fixed 100-resample chunks (the reference: the same draws)."""
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        means[start:stop] = d[rng.integers(0, d.size, size=(stop - start, d.size))].mean(axis=1)
    alpha = (1.0 - 0.95) / 2.0  # as paired_bootstrap computes it (not 0.025 exactly)
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return float(d.mean()), float(low), float(high)


def test_bootstrap_memory_stays_within_its_budget():
    """100 resamples of 100,000 queries drawn at once took 153 MiB (1.6 kB a query: 15 GiB for
    10M); the default 64 MiB budget bounds the index matrix and its gather."""
    rng = np.random.default_rng(0)
    a, b = rng.random(100_000), rng.random(100_000)
    res, peak = _peak_bytes(paired_bootstrap, a, b, resamples=100, seed=1)
    assert peak < 70 * MiB, f"{peak / MiB:.0f} MiB"
    assert (res.diff, res.low, res.high) == _bootstrap_before(a, b, 100, 1)


@pytest.mark.parametrize("n", [1, 7, 1000, 65_536])
def test_bootstrap_slabs_keep_the_draws_and_the_means(n):
    """Whole resamples per slab (N up to budget / 16): bit-identical to drawing 100 at once."""
    rng = np.random.default_rng(n)
    a, b = rng.random(n), rng.random(n)
    for resamples in (1, 99, 250):
        res = paired_bootstrap(a, b, resamples=resamples, seed=5, memory_budget=MiB)
        assert (res.diff, res.low, res.high) == _bootstrap_before(a, b, resamples, 5)


def test_bootstrap_of_more_queries_than_a_slab_sums_the_same_draws():
    """N = 100,000 > 65,536 indices a MiB: each resample in two pieces of the one stream."""
    rng = np.random.default_rng(1)
    a, b = rng.random(100_000), rng.random(100_000)
    res = paired_bootstrap(a, b, resamples=20, seed=2, memory_budget=MiB)
    diff, low, high = _bootstrap_before(a, b, 20, 2)
    assert res.diff == diff
    assert res.low == pytest.approx(low, rel=1e-12, abs=1e-15)
    assert res.high == pytest.approx(high, rel=1e-12, abs=1e-15)


# -- per-row arrays of an embeddings file -----------------------------------------------------
@pytest.mark.parametrize("key, value, says", [
    ("paths", np.array([f"c{k % 2}/{k}.jpg" for k in range(9)]), "'paths' has 9 values for 10 embeddings"),
    ("indices", np.arange(11), "'indices' has 11 values for 10 embeddings"),
    ("file_sizes", np.int64(5), "'file_sizes' is one value for 10 embeddings"),
])
def test_an_embeddings_file_whose_row_arrays_miss_rows_is_refused(tmp_path, run_cli, key, value, says):
    """A hand-edited file whose ``paths`` lost a row was read, its paths zipped with the labels
    (the report named the classes of the rows they still covered)."""
    x = np.random.default_rng(0).normal(size=(10, 3)).astype(np.float32)
    path = save_embeddings(tmp_path / "e.npz", x, np.arange(10) % 2, **{key: value})
    with pytest.raises(DataError, match=says):
        read_embedding_file(path)
    code, _, err = run_cli(["verify", str(path), "--pairs", "4", "--folds", "2"])
    assert code == 2 and says in err and err.strip().count("\n") == 0, err


def test_a_file_with_one_path_per_row_still_reads(tmp_path):
    x = np.zeros((4, 2), np.float32)
    paths = np.array(["a/1.jpg", "a/2.jpg", "b/3.jpg", "b/4.jpg"])
    path = save_embeddings(tmp_path / "e.npz", x, [0, 0, 1, 1], paths=paths, indices=np.arange(4),
                           class_names_note=np.array("not per row"))
    _, _, extra = read_embedding_file(path)
    assert extra["paths"].tolist() == paths.tolist()


def test_folder_names_need_one_path_per_row():
    from dmlkit.report.saved import _folder_names

    labels = np.array([0, 0, 1, 1])
    paths = np.array(["a/1.jpg", "a/2.jpg", "b/3.jpg", "b/4.jpg"])
    assert _folder_names(paths, labels) == {0: "a", 1: "b"}
    assert _folder_names(paths[:2], labels) is None  # named class 0 only
