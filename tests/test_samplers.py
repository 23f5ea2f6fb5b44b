"""MPerClassSampler and EpisodeSampler: batch structure, balance, determinism, errors."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dmlkit.exceptions import ConfigError, DataError, ShapeError
from dmlkit.samplers import EpisodeSampler, MPerClassSampler, split_episode


def imbalanced_labels(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(4, 12, size=40)
    labels = np.repeat(np.arange(40) * 7 + 3, sizes)  # non-contiguous class ids
    return rng.permutation(labels)


@pytest.mark.parametrize(("c", "m"), [(8, 4), (32, 1)])
def test_m_per_class_structure(c, m):
    labels = imbalanced_labels()
    sampler = MPerClassSampler(labels, samples_per_class=m, classes_per_batch=c, seed=1)
    assert len(sampler) == len(labels) // (c * m) and sampler.batch_size == c * m
    batches = list(sampler)
    assert len(batches) == len(sampler)
    for batch in batches:
        assert len(batch) == c * m
        lab = labels[batch].reshape(c, m)
        assert (lab == lab[:, :1]).all()  # class-major blocks of M
        assert len(set(lab[:, 0])) == c  # C distinct classes
        assert len(set(batch)) == len(batch)  # no duplicate item (every class has >= M items)


def test_m_per_class_balance_over_epoch():
    labels = imbalanced_labels()
    class_counts: Counter[int] = Counter()
    for batch in MPerClassSampler(labels, 4, 8, batches_per_epoch=50, seed=0):
        class_counts.update(int(x) for x in labels[batch[::4]])
    # 50 batches x 8 classes = 400 slots over 40 classes: each class 10 times (shuffled cycles)
    assert len(class_counts) == 40
    assert set(class_counts.values()) == {10}


def test_m_per_class_uses_all_items_of_a_class():
    labels = np.repeat(np.arange(8), 8)
    sampler = MPerClassSampler(labels, samples_per_class=4, classes_per_batch=8, batches_per_epoch=2)
    seen = [i for batch in sampler for i in batch]
    assert sorted(seen) == list(range(64))  # two batches take both halves of each class


def test_m_per_class_items_come_in_whole_cycles_when_the_class_size_is_not_a_multiple_of_m():
    """A class of 7 taken 4 at a time: its draws, cut into runs of 7, are each the whole class
    (the tail of a cycle is carried over, not thrown away), and no block repeats an item."""
    labels = np.repeat(np.arange(10), 7)
    sampler = MPerClassSampler(labels, samples_per_class=4, classes_per_batch=5,
                               batches_per_epoch=30, seed=2)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        draws: dict[int, list[int]] = {}
        for batch in sampler:
            for block in np.asarray(batch).reshape(5, 4):
                assert len(set(block.tolist())) == 4
                draws.setdefault(int(labels[block[0]]), []).extend(block.tolist())
        for k, seq in draws.items():
            assert len(seq) >= 14
            for start in range(0, len(seq) - 6, 7):
                assert sorted(seq[start:start + 7]) == list(range(7 * k, 7 * k + 7))


def test_m_per_class_determinism_and_epochs():
    labels = imbalanced_labels()
    a = MPerClassSampler(labels, 4, 8, seed=3)
    b = MPerClassSampler(labels, 4, 8, seed=3)
    first = list(a)
    assert first == list(b)
    second = list(a)  # the next iteration is the next epoch
    assert second != first
    a.set_epoch(0)
    assert list(a) == first
    c = MPerClassSampler(labels, 4, 8, seed=4)
    assert list(c) != first
    state = a.state_dict()
    d = MPerClassSampler(labels, 4, 8, seed=0)
    d.load_state_dict(state)
    assert list(d) == list(a)


def test_m_per_class_small_classes():
    labels = np.array([0] * 6 + [1] * 2 + [2] * 5 + [3] * 1 + [4] * 4)
    # replace (default): small classes give all their items, then repeats
    sampler = MPerClassSampler(labels, samples_per_class=4, classes_per_batch=5, batches_per_epoch=3)
    for batch in sampler:
        blocks = np.asarray(batch).reshape(5, 4)
        for block in blocks:
            members = np.flatnonzero(labels == labels[block[0]])
            assert set(block) == set(members) if len(members) < 4 else len(set(block)) == 4
    # drop: only classes with >= 4 items
    dropped = MPerClassSampler(labels, 4, 3, small_classes="drop", batches_per_epoch=4)
    assert {int(labels[i]) for batch in dropped for i in batch} == {0, 2, 4}
    with pytest.raises(DataError, match="only 3 classes with at least 4 items"):
        MPerClassSampler(labels, 4, 4, small_classes="drop")
    with pytest.raises(DataError, match="fewer than samples_per_class"):
        MPerClassSampler(labels, 4, 2, small_classes="error")


def test_m_per_class_errors():
    labels = np.repeat(np.arange(10), 3)
    with pytest.raises(DataError, match="only 10 classes but classes_per_batch=32"):
        MPerClassSampler(labels, 1, 32)
    with pytest.raises(ConfigError):
        MPerClassSampler(labels, 0, 2)
    with pytest.raises(ConfigError):
        MPerClassSampler(labels, 2, 2, small_classes="maybe")
    with pytest.raises(DataError):
        MPerClassSampler(np.zeros((3, 2)), 1, 1)
    with pytest.raises(DataError):
        MPerClassSampler([], 1, 1)


def test_m_per_class_with_dataloader_and_tensor_labels():
    labels = torch.arange(64) % 16
    ds = TensorDataset(torch.randn(64, 3), labels)
    sampler = MPerClassSampler(labels, samples_per_class=4, classes_per_batch=4, batches_per_epoch=3)
    batches = list(DataLoader(ds, batch_sampler=sampler))
    assert len(batches) == 3
    for _, y in batches:
        assert y.shape == (16,) and len(torch.unique(y)) == 4
        assert (torch.bincount(y, minlength=16)[torch.unique(y)] == 4).all()


def test_episode_sampler_layout_and_split():
    labels = imbalanced_labels()
    n_way, k, q = 5, 2, 3
    sampler = EpisodeSampler(labels, n_way, k, q, episodes=7, seed=0)
    episodes = list(sampler)
    assert len(episodes) == len(sampler) == 7
    for ep in episodes:
        assert len(ep) == sampler.batch_size == n_way * (k + q) and len(set(ep)) == len(ep)
        lab = labels[ep].reshape(n_way, k + q)
        assert (lab == lab[:, :1]).all() and len(set(lab[:, 0])) == n_way
        support, query = sampler.split(torch.as_tensor(labels[ep]))
        assert support.shape == (n_way * k,) and query.shape == (n_way * q,)
        assert torch.equal(support.reshape(n_way, k)[:, 0], query.reshape(n_way, q)[:, 0])
        s_idx, q_idx = split_episode(ep, n_way, k, q)
        assert set(s_idx.tolist()) | set(q_idx.tolist()) == set(ep)
    x = torch.arange(n_way * (k + q) * 2).reshape(-1, 2)
    s, qq = split_episode(x, n_way, k, q)
    assert s.shape == (n_way * k, 2) and torch.equal(s[0], x[0]) and torch.equal(qq[0], x[k])
    with pytest.raises(DataError):
        split_episode(x[:-1], n_way, k, q)


def test_episode_sampler_determinism_and_errors():
    labels = imbalanced_labels()
    a, b = EpisodeSampler(labels, 5, 1, 2, 4, seed=9), EpisodeSampler(labels, 5, 1, 2, 4, seed=9)
    first = list(a)
    assert first == list(b) and list(a) != first
    a.set_epoch(0)
    assert list(a) == first
    few = np.array([0] * 3 + [1] * 5 + [2] * 5)
    with pytest.raises(DataError, match="only 2 classes"):
        EpisodeSampler(few, n_way=3, k_shot=2, n_query=2, episodes=1)
    assert {int(few[i]) for ep in EpisodeSampler(few, 2, 2, 2, 5) for i in ep} == {1, 2}
    with pytest.raises(ConfigError):
        EpisodeSampler(few, 0, 1, 1, 1)


def test_samplers_refuse_a_list_mixing_int_and_string_labels():
    # np.asarray turned [1, "1", ...] into strings before check_labels saw it, so 1 and "1"
    # were one class; check_labels refuses the list itself
    labels = [1, "1", 2, "2"] * 4
    with pytest.raises(ShapeError, match="all integer class ids or all class-name strings"):
        MPerClassSampler(labels, samples_per_class=4, classes_per_batch=2, batches_per_epoch=1)
    with pytest.raises(ShapeError, match="all integer class ids or all class-name strings"):
        EpisodeSampler(tuple(labels), n_way=2, k_shot=2, n_query=2, episodes=1)
    names = ["1", "2"] * 8  # one kind in a list is still fine
    assert len(list(MPerClassSampler(names, samples_per_class=4, classes_per_batch=2,
                                     batches_per_epoch=1))[0]) == 8
