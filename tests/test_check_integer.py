"""dmlkit.validation.check_integer: the one check of every count and size option.

Before it, eight modules each had their own: ``knn(k=True)`` searched one neighbour,
``ShardWriter(shard_rows=True)`` wrote one-row shards, the samplers took ``2.0`` for a count and
ended a string such as ``"a"`` in a ValueError traceback, verification's ``folds="a"`` and
SoftTriple's ``centers_per_class=None`` in a TypeError / ValueError traceback.
"""

from __future__ import annotations

import numpy as np
import pytest

from dmlkit.apps.verification import stratified_folds
from dmlkit.embedding_shards import ShardWriter
from dmlkit.exceptions import ConfigError
from dmlkit.limits import MAX_BINS, MAX_EPISODES, MAX_RESAMPLES
from dmlkit.losses.proxy_losses import SoftTripleLoss
from dmlkit.metrics import pos_neg_histograms
from dmlkit.metrics.knn import knn
from dmlkit.models import build_embedder
from dmlkit.protocol.stats import paired_bootstrap
from dmlkit.samplers import EpisodeSampler, MPerClassSampler
from dmlkit.validation import check_integer


@pytest.mark.parametrize("value, least, message", [
    (True, 1, "n must be a positive integer, got True"),
    (2.0, 1, "n must be a positive integer, got 2.0"),
    ("3", 1, "n must be a positive integer, got '3'"),
    (None, 1, "n must be a positive integer, got None"),
    (0, 1, "n must be a positive integer, got 0"),
    (-1, 0, "n must be a non-negative integer, got -1"),
    (1, 2, "n must be an integer of at least 2, got 1"),
])
def test_refused_with_one_line_naming_the_option(value, least, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        check_integer(value, "n", least=least)


def test_accepts_python_and_numpy_integers_as_int():
    for value in (3, np.int64(3), np.uint8(3)):
        out = check_integer(value, "n")
        assert out == 3 and type(out) is int
    assert check_integer(0, "n", least=0) == 0
    assert "(rows)" in _message(lambda: check_integer(0, "n", hint=" (rows)"))


def test_an_upper_bound_is_part_of_the_one_line():
    assert check_integer(4, "n", most=4) == 4
    assert "n must be an integer from 1 to 4, got 5" in _message(lambda: check_integer(5, "n", most=4))
    assert "n must be an integer from 0 to 4 (rows), got -1" in _message(
        lambda: check_integer(-1, "n", least=0, most=4, hint=" (rows)"))


def test_the_bounded_counts_of_the_library_refuse_a_huge_value():
    """dmlkit.limits: 10**10 resamples allocated 75 GiB, 10**23 bins overflowed torch and 10**23
    episodes iterated for ever; each is one ConfigError line naming the count."""
    x = np.eye(4, dtype=np.float32)
    labels = np.array([0, 0, 1, 1])
    scores = np.array([[0.5, 0.25, 1.0]])
    assert f"resamples must be an integer from 1 to {MAX_RESAMPLES}" in _message(
        lambda: paired_bootstrap(scores[0], scores[0], resamples=MAX_RESAMPLES + 1))
    assert f"resamples must be an integer from 1 to {MAX_RESAMPLES}" in _message(
        lambda: paired_bootstrap(scores[0], scores[0], resamples=10**10))
    assert f"bins must be an integer from 2 to {MAX_BINS}" in _message(
        lambda: pos_neg_histograms(x, labels, bins=10**23))
    assert f"episodes must be an integer from 1 to {MAX_EPISODES}" in _message(
        lambda: EpisodeSampler(labels, n_way=2, k_shot=1, n_query=1, episodes=10**23))


def _message(call) -> str:
    with pytest.raises(ConfigError) as info:
        call()
    return str(info.value)


def test_the_library_options_use_it():
    x = np.eye(4, dtype=np.float32)
    labels = np.array([0, 0, 1, 1])
    assert "k must be a positive integer, got True" in _message(lambda: knn(x, k=True))
    assert "shard_rows must be a positive integer, got True" in _message(
        lambda: ShardWriter("unused-dir", shard_rows=True))
    assert "samples_per_class must be a positive integer, got 2.0" in _message(
        lambda: MPerClassSampler(labels, samples_per_class=2.0, classes_per_batch=2))
    assert "n_query must be a non-negative integer, got 'a'" in _message(
        lambda: EpisodeSampler(labels, n_way=2, k_shot=1, n_query="a", episodes=1))
    assert "folds must be an integer of at least 2" in _message(
        lambda: stratified_folds(np.array([True, False] * 4), "a"))
    assert "centers_per_class must be a positive integer, got None" in _message(
        lambda: SoftTripleLoss(num_classes=2, embedding_size=4, centers_per_class=None))


@pytest.mark.parametrize("kwargs, message", [
    ({"embedding_size": 0}, "embedding_size must be a positive integer, got 0"),
    ({"embedding_size": 2.5}, "embedding_size must be a positive integer, got 2.5"),
    ({"feature_dim": -3}, "feature_dim must be a positive integer, got -3"),
    ({"head": "mlp", "hidden": 0}, "hidden must be a positive integer, got 0"),
    ({"head": "mlp", "dropout": 1.5}, r"dropout must be a probability in \[0, 1\), got 1.5"),
])
def test_embedding_heads_refuse_bad_sizes(kwargs, message):
    args = {"feature_dim": 16, "embedding_size": 8, **kwargs}
    with pytest.raises(ConfigError, match=message):
        build_embedder(**args)
