"""The protocol's class splits, folds and the test-class guard."""

from __future__ import annotations

import numpy as np
import pytest

from dmlkit.exceptions import ConfigError, DataError
from dmlkit.protocol.splits import BenchSplit, TestClassGuard, TestSetLeakError, make_bench_split


def test_halves_and_contiguous_12_5_percent_folds():
    classes = list(range(1, 201))  # CUB-200: classes 1..200
    s = make_bench_split(classes, "halves", folds=4)
    assert s.dev == tuple(range(1, 101)) and s.test == tuple(range(101, 201))
    # fold f validates on the f-th 12.5 % block of all classes and trains on the other three
    for f, fold in enumerate(s.folds):
        assert fold.val == tuple(range(1 + 25 * f, 26 + 25 * f))
        assert sorted(fold.train + fold.val) == list(range(1, 101))
        assert not set(fold.val) & set(fold.train)
        assert not set(fold.train + fold.val) & set(s.test)
    # the validation blocks partition the development classes
    assert sorted(c for f in s.folds for c in f.val) == list(s.dev)


def test_random_order_is_seeded_and_class_disjoint():
    classes = list(range(100))
    a = make_bench_split(classes, "halves", order="random", seed=1, folds=4)
    b = make_bench_split(classes, "halves", order="random", seed=1, folds=4)
    c = make_bench_split(classes, "halves", order="random", seed=2, folds=4)
    assert a == b and a.dev != c.dev
    assert a.dev != tuple(range(50))
    assert sorted(a.dev + a.test) == classes and not set(a.dev) & set(a.test)
    # folds follow the random order: block 0 is the first quarter of the permuted dev classes
    perm = [int(i) for i in np.random.default_rng(1).permutation(100)]
    assert a.folds[0].val == tuple(perm[:13])


def test_ratio_4_1_5():
    s = make_bench_split(range(200), "ratio_4_1_5", folds=1)
    assert len(s.folds) == 1
    f = s.folds[0]
    assert (len(f.train), len(f.val), len(s.test)) == (80, 20, 100)
    assert f.train == tuple(range(80)) and f.val == tuple(range(80, 100))
    s196 = make_bench_split(range(196), "ratio_4_1_5", folds=1)
    assert (len(s196.folds[0].train), len(s196.folds[0].val), len(s196.test)) == (78, 20, 98)
    with pytest.raises(ConfigError):
        make_bench_split(range(200), "ratio_4_1_5", folds=4)


def test_num_classes_and_errors():
    s = make_bench_split(range(1000), "halves", folds=4, num_classes=40)
    assert s.dev == tuple(range(20)) and s.test == tuple(range(20, 40))
    with pytest.raises(DataError, match="too few"):
        make_bench_split(range(10), "halves", folds=4)
    with pytest.raises(ConfigError):
        make_bench_split(range(10), "thirds")


def test_split_roundtrip_through_class_split_json(tmp_path):
    from dmlkit.data.splits import ClassSplit

    s = make_bench_split(range(40), "halves", order="random", seed=5, folds=4)
    s.class_split().to_json(tmp_path / "split.json")
    loaded = ClassSplit.from_json(tmp_path / "split.json")
    assert sorted(loaded.train) == sorted(s.dev) and sorted(loaded.test) == sorted(s.test)
    assert BenchSplit.from_dict(loaded.meta) == s


def test_guard_rejects_test_classes():
    guard = TestClassGuard([5, 6])

    class DS:
        labels = np.array([1, 2, 6])

    with pytest.raises(TestSetLeakError, match="test class"):
        guard.check(DS(), "the search")
    DS.labels = np.array([1, 2, 3])
    assert guard.check(DS(), "the search") is not None


def test_default_split_uses_the_published_training_classes():
    s = make_bench_split(range(1, 23), "default", folds=4, default_dev=range(1, 13))
    assert s.dev == tuple(range(1, 13)) and s.test == tuple(range(13, 23))
    assert [f.val for f in s.folds] == [(1, 2, 3), (4, 5, 6), (7, 8, 9), (10, 11, 12)]
    with pytest.raises(ConfigError, match="default_dev"):
        make_bench_split(range(10), "default")
