"""Retrieval means that are the same for any embeddings: with one class every ranking puts the
positives first (P@1, R-Precision, MAP@R, MAP and Recall@K all read 100 %); a Recall@K whose K
exceeds every query's negatives always finds a positive; a Precision@K whose K reaches every
reference counts them all. They were printed as numbers; like the clustering metrics on one
class, they are now NaN ("no number") with one warning, on every path that averages them (in
memory, streaming, per class, the command)."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
import torch

from dmlkit.metrics import evaluate, evaluate_streaming, per_class

METRICS = ["precision_at_1", "recall_at_2", "r_precision", "map_at_r"]  # and "map" in memory


def _random(n: int, d: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32))


def _metrics(evaluator) -> list[str]:
    """Full-ranking MAP needs every embedding at once: not streamed."""
    return METRICS + ["map"] if evaluator is evaluate else METRICS


def _one_warning(record) -> str:
    messages = [str(w.message) for w in record if "one class" in str(w.message)]
    assert len(messages) == 1, [str(w.message) for w in record]
    return messages[0]


@pytest.mark.parametrize("evaluator", [evaluate, evaluate_streaming], ids=["evaluate", "streaming"])
def test_one_class_is_no_number_with_a_warning(evaluator):
    x, y = _random(20), torch.zeros(20, dtype=torch.long)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        result = evaluator(x, y, metrics=_metrics(evaluator))
    message = _one_warning(record)
    assert all(m in message for m in _metrics(evaluator)) and "NaN" in message
    assert all(math.isnan(result[m]) for m in _metrics(evaluator))
    assert (result["num_queries"], result["num_queries_without_positive"]) == (20, 0)


@pytest.mark.parametrize("evaluator", [evaluate, evaluate_streaming], ids=["evaluate", "streaming"])
def test_one_reference_class_against_queries_of_several(evaluator):
    """Queries of class 1 have no positive (left out); those of class 0 rank positives only."""
    q, ql = _random(12, seed=1), torch.tensor([0] * 6 + [1] * 6)
    r, rl = _random(9, seed=2), torch.zeros(9, dtype=torch.long)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        result = evaluator(q, ql, r, rl, metrics=_metrics(evaluator))
    _one_warning(record)
    assert all(math.isnan(result[m]) for m in _metrics(evaluator))
    assert result["num_queries_without_positive"] == 6


@pytest.mark.parametrize("evaluator", [evaluate, evaluate_streaming], ids=["evaluate", "streaming"])
def test_a_single_negative_makes_the_ranking_count(evaluator):
    """Five samples of class 0 and one of class 1: class 0's queries rank one negative among
    their positives, so the metrics are numbers again (and no warning); the lone class-1 sample
    has no positive."""
    x = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.0, 1.0], [1.0, -0.01]])
    y = torch.tensor([0, 0, 0, 0, 0, 1])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        result = evaluator(x, y, metrics=["precision_at_1", "map_at_r"])
    assert not [w for w in record if "one class" in str(w.message)]
    # query 0's nearest is the class-1 sample at (1, -0.01): P@1 = 0 for it, 1 for 1, 2, 3, 4
    assert result["precision_at_1"] == pytest.approx(4 / 5)
    assert result["num_queries_without_positive"] == 1
    assert 0 < result["map_at_r"] < 1


def test_per_class_of_one_class_is_no_number():
    x, y = _random(10), torch.full((10,), 3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        table = per_class(x, y)
    _one_warning(record)
    assert list(table) == [3] and all(math.isnan(table[3][m]) for m in ("precision_at_1", "map_at_r"))
    assert table[3]["num_queries"] == 10


def test_the_command_prints_no_number_and_one_warning_line(tmp_path, run_cli):
    path = tmp_path / "one.npz"
    np.savez(path, embeddings=_random(16).numpy(), labels=np.zeros(16, np.int64))
    code, out, err = run_cli(["evaluate", str(path), "-m", "map", "-m", "map_at_r", "--json"])
    assert code == 0, err
    assert json.loads(out) == {"map": None, "map_at_r": None, "num_queries": 16,
                               "num_queries_without_positive": 0}
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("warning: map, map_at_r: every reference shares")


@pytest.mark.parametrize("evaluator", [evaluate, evaluate_streaming], ids=["evaluate", "streaming"])
def test_k_past_every_negative_is_no_number(evaluator):
    """Classes of 3, 5 and 7 samples, each query left out of its own ranking (14 candidates):
    the smallest class's queries have the most negatives, 14 - 2 = 12, so Recall@12 still
    measures something and Recall@13 does not; Precision@13 ranks, Precision@14 counts all."""
    y = torch.tensor([0] * 3 + [1] * 5 + [2] * 7)
    x = _random(15, seed=3)
    names = ["recall_at_12", "recall_at_13", "precision_at_13", "precision_at_14", "map_at_r"]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        result = evaluator(x, y, metrics=names)
    messages = [str(w.message) for w in record if "NaN" in str(w.message)]
    assert len(messages) == 2, messages
    assert messages[0].startswith("recall_at_13: ") and "at most 12" in messages[0]
    assert messages[1].startswith("precision_at_14: ") and "all 14 references" in messages[1]
    assert math.isnan(result["recall_at_13"]) and math.isnan(result["precision_at_14"])
    for name in ("recall_at_12", "precision_at_13", "map_at_r"):
        assert 0 <= result[name] <= 1
    # the values that stay are the same ones as asked alone
    alone = evaluator(x, y, metrics=["recall_at_12", "precision_at_13"])
    assert (result["recall_at_12"], result["precision_at_13"]) == (alone["recall_at_12"],
                                                                    alone["precision_at_13"])


def test_k_within_the_negatives_gives_no_warning():
    y = torch.tensor([0] * 3 + [1] * 5 + [2] * 7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = evaluate(_random(15, seed=3), y, metrics=["recall_at_12", "precision_at_13"])
    assert not any(math.isnan(v) for v in result.values())


@pytest.mark.parametrize(("labels", "missing"), [([0] * 12, "no negative pair"),
                                                 (list(range(12)), "no positive pair")])
def test_pos_neg_js_without_one_kind_of_pair_is_no_number(labels, missing):
    """One class has no negative pair, twelve singletons no positive one: one histogram is
    empty. pos_neg_js is NaN with one warning, as the other metrics that say nothing; it was a
    DataError that lost every other metric of the call (here NMI, which still clusters)."""
    x, y = _random(12, seed=4), torch.tensor(labels)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        result = evaluate(x, y, metrics=["pos_neg_js", "ami"])
    messages = [str(w.message) for w in record if str(w.message).startswith("pos_neg_js")]
    assert len(messages) == 1 and missing in messages[0] and "NaN" in messages[0]
    assert math.isnan(result["pos_neg_js"])
    assert "ami" in result


def test_pos_neg_js_with_both_kinds_of_pair_is_a_number():
    y = torch.tensor([0] * 6 + [1] * 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        js = evaluate(_random(12, seed=5), y, metrics=["pos_neg_js"])["pos_neg_js"]
    assert 0.0 <= js <= 1.0
