"""Audit fixes of the samplers: bounded epoch length, checked rank, every label tensor dtype,
and load_state_dict checked as the constructor checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dmlkit.config import SamplerConfig
from dmlkit.exceptions import CheckpointError, ConfigError
from dmlkit.limits import MAX_BATCHES_PER_EPOCH
from dmlkit.samplers import EpisodeSampler, MPerClassSampler

LABELS = np.repeat(np.arange(5), 4)


def test_batches_per_epoch_is_bounded_in_the_sampler_and_the_config():
    """10**19 batches raised OverflowError at len(): one ConfigError line, as the config's."""
    with pytest.raises(ConfigError, match="batches_per_epoch must be an integer from 1 to 1000000000"):
        MPerClassSampler(LABELS, 2, 2, batches_per_epoch=10**19)
    assert len(MPerClassSampler(LABELS, 2, 2, batches_per_epoch=MAX_BATCHES_PER_EPOCH)) == 10**9
    with pytest.raises(ValueError, match="less than or equal to 1000000000"):
        SamplerConfig(batches_per_epoch=10**19)


@pytest.mark.parametrize("rank", ["a", None, True, 1.0, -1, 2])
@pytest.mark.parametrize("sampler", ["m_per_class", "episodes"])
def test_rank_is_checked_like_num_replicas(rank, sampler):
    """'a' and None raised int()'s ValueError/TypeError, True was taken as rank 1."""
    with pytest.raises(ConfigError, match=r"^rank must be an integer from 0 to 1 \(this process"):
        if sampler == "m_per_class":
            MPerClassSampler(LABELS, 2, 2, num_replicas=2, rank=rank)
        else:
            EpisodeSampler(LABELS, 2, 1, 1, episodes=3, num_replicas=2, rank=rank)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int32])
def test_label_tensors_of_every_real_dtype_give_the_same_batches(dtype):
    """A bfloat16 labels tensor raised TypeError (no numpy twin)."""
    expected = list(MPerClassSampler(LABELS, 2, 2, seed=3))
    assert list(MPerClassSampler(torch.tensor(LABELS, dtype=dtype), 2, 2, seed=3)) == expected
    episodes = list(EpisodeSampler(LABELS, 2, 1, 1, episodes=4, seed=3))
    assert list(EpisodeSampler(torch.tensor(LABELS, dtype=dtype), 2, 1, 1, episodes=4, seed=3)) == episodes


@pytest.mark.parametrize(("state", "message"), [
    ({}, r"^a sampler state holds exactly 'seed' and 'epoch' \(from state_dict\(\)\), got \[\]"),
    ({"seed": 0}, "holds exactly 'seed' and 'epoch'"),
    ({"seed": 0, "epoch": 0, "extra": 1}, "holds exactly 'seed' and 'epoch'"),
    ([("seed", 0), ("epoch", 0)], "got list"),
    ({"seed": -5, "epoch": 0}, "^sampler state seed must be a non-negative integer below 2\\*\\*32, got -5$"),
    ({"seed": 2**40, "epoch": 0}, "sampler state seed must be a non-negative integer"),
    ({"seed": 0, "epoch": 1.7}, "^sampler state epoch must be a non-negative integer, got 1.7$"),
    ({"seed": 0, "epoch": -1}, "sampler state epoch must be a non-negative integer"),
], ids=range(8))
def test_load_state_dict_refuses_what_state_dict_never_writes(state, message):
    sampler = MPerClassSampler(LABELS, 2, 2, seed=7)
    sampler.set_epoch(2)
    with pytest.raises(CheckpointError, match=message):
        sampler.load_state_dict(state)
    assert sampler.state_dict() == {"seed": 7, "epoch": 2}  # left as it was


def test_load_state_dict_resumes_the_batches():
    sampler = MPerClassSampler(LABELS, 2, 2, seed=7)
    next(iter(sampler))
    state = sampler.state_dict()
    fresh = MPerClassSampler(LABELS, 2, 2, seed=0)
    fresh.load_state_dict(state)
    assert list(fresh) == list(sampler)
