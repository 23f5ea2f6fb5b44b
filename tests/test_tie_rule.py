"""Exact ties that decide a metric. dmlkit ranks references of exactly equal closeness by the
smaller reference index: a fixed rule, so results are deterministic. But where such a tie
holds a reference of the query's class and one of another class at a position the metrics
read, the number comes from the order of the rows, not from the embeddings: all-identical
(collapsed) embeddings scored P@1 25 % and MAP@R 25 % on four classes in class order, with no
word. Those queries are now counted and named in one warning, on every path that settles
the kNN's ties (in memory, streaming, per query, the command) and for full-ranking MAP (which
reads every position: a negative tied with a positive anywhere), on its compiled and its
blockwise paths; the numbers themselves are unchanged (the rule stays)."""

from __future__ import annotations

import json
import re
import warnings

import numpy as np
import pytest
import torch

from dmlkit.metrics import evaluate, evaluate_streaming, per_query

DEFAULT_READ = 8  # recall_at_8 among the default metrics: every query reads 8 positions at least


def _duplicates(n: int, bases: int, d: int = 6, classes: int = 3, seed: int = 0):
    """``n`` rows, each a copy of one of ``bases`` random vectors, with random labels: copies
    of one vector tie exactly with each other (bit-identical rows), distinct vectors never."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((bases, d)).astype(np.float32)
    which = rng.integers(0, bases, n)
    return torch.from_numpy(base[which]), torch.from_numpy(rng.integers(0, classes, n)), which


def _oracle(x: torch.Tensor, labels: torch.Tensor, which: np.ndarray, read: np.ndarray) -> np.ndarray:
    """Per query (each left out of its own ranking): does a group of copies of one vector hold
    references of its class and of others, starting at a position below ``read``? Groups are
    ordered by float64 cosine of the float32-normalised rows (distinct vectors: distinct)."""
    u = torch.nn.functional.normalize(x, dim=1).double().numpy()
    y = labels.numpy()
    out = np.zeros(len(y), dtype=bool)
    for i in range(len(y)):
        others = np.delete(np.arange(len(y)), i)
        order = others[np.lexsort((others, -(u[others] @ u[i])))]
        starts = np.flatnonzero(np.r_[True, which[order][1:] != which[order][:-1]])
        rel = (y[order] == y[i]).astype(np.int64)
        sizes = np.diff(np.r_[starts, len(order)])
        hits = np.add.reduceat(rel, starts)
        mixed = (hits > 0) & (hits < sizes)
        out[i] = bool((mixed & (starts < read[i])).any())
    return out


def _ruled_count(record) -> int | None:
    messages = [str(w.message) for w in record if "exactly as close" in str(w.message)]
    assert len(messages) <= 1, messages
    if not messages:
        return None
    return int(re.search(r"for (\d+) of \d+ queries", messages[0]).group(1))


def _read(labels: torch.Tensor) -> np.ndarray:
    r_q = np.array([(labels == c).sum().item() - 1 for c in labels])
    return np.maximum(r_q, DEFAULT_READ)


@pytest.mark.parametrize("evaluator", [evaluate, evaluate_streaming], ids=["evaluate", "streaming"])
@pytest.mark.parametrize(("n", "bases"), [(40, 12), (120, 30), (300, 6)])
def test_the_warning_counts_the_queries_whose_metrics_the_tie_rule_decides(evaluator, n, bases):
    """Against a brute-force oracle: few large groups (300 rows, 6 vectors: every ranking is
    six groups of ties; the kNN's boundary falls inside one, and those rows are searched
    again) and many small ones."""
    x, y, which = _duplicates(n, bases, seed=n)
    want = int(_oracle(x, y, which, _read(y)).sum())
    assert want > 0
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        evaluator(x, y)
    assert _ruled_count(record) == want


def _per_class(*args, **kwargs):
    from dmlkit.metrics import per_class

    return per_class(*args, **kwargs)


@pytest.mark.parametrize("evaluator", [evaluate, evaluate_streaming, _per_class],
                         ids=["evaluate", "streaming", "per_class"])
def test_a_metric_reported_as_nan_sets_no_tie_flag(evaluator):
    """A Recall@K past every query's negatives is NaN whatever the embeddings; the ties its K
    positions hold decide no reported number, so the warning counts the queries whose P@1 the
    rule decides (the oracle at one position), as :func:`evaluate` did; the streaming means and
    the class means counted every tie within K."""
    x, y, which = _duplicates(120, 30, seed=120)
    k = len(y) - 1  # every candidate: above every query's negatives
    want = int(_oracle(x, y, which, np.ones(len(y), np.int64)).sum())
    deep = int(_oracle(x, y, which, np.full(len(y), k)).sum())
    assert 0 < want < deep
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = evaluator(x, y, metrics=["precision_at_1", f"recall_at_{k}"])
    assert _ruled_count(record) == want
    assert any("K is larger than every query" in str(w.message) for w in record)
    rows = out.values() if evaluator is _per_class else [out]
    assert all(np.isnan(row[f"recall_at_{k}"]) for row in rows)


@pytest.mark.parametrize(("n", "classes", "copies"), [(60, 10, 3), (2100, 100, 12)],
                         ids=["blockwise", "compiled"])
def test_full_ranking_map_flags_a_negative_tied_with_a_positive(n, classes, copies):
    """``map`` reads every position; 2,100 rows reach the compiled kernels (whose exact
    comparisons see every tie), 60 the blockwise float64 path. One warning a group: ``map``'s
    counts the queries with such a tie anywhere, P@1's those with one at its position."""
    rng = np.random.default_rng(n)
    x = torch.from_numpy(rng.standard_normal((n, 6)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, classes, n))
    which = np.arange(n)
    which[-copies:] = np.arange(copies)  # the last rows: copies of the first ones
    x[-copies:] = x[:copies]
    everywhere = _oracle(x, y, which, np.full(n, n))
    assert 0 < everywhere.sum() < n
    first = _oracle(x, y, which, np.ones(n, np.int64))
    for metrics in (["map"], ["precision_at_1", "map"]):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            evaluate(x, y, metrics=metrics)
        assert _ruled_count([w for w in record if str(w.message).startswith("map:")]) == int(everywhere.sum())
        p1 = [w for w in record if str(w.message).startswith("precision_at_1:")]
        assert _ruled_count(p1) == ((int(first.sum()) or None) if "precision_at_1" in metrics else None)


def test_the_flags_are_per_query_and_the_numbers_keep_the_rule():
    """Per query: the flagged queries are the oracle's; the metrics are those of the index rule
    (a copy in another row order moves them: that is what the warning says)."""
    from dmlkit.metrics.evaluate import _Inputs, _settled
    from dmlkit.metrics.knn import knn

    x, y, which = _duplicates(60, 15, seed=3)
    inp = _Inputs(x, y, None, None, "cosine")
    read = torch.from_numpy(_read(y))
    res = knn(x, None, int(read.max()) + 8, distance=inp.distance)
    settled = _settled(inp, res, 2**26, read)
    assert (settled.tie_ruled.numpy() == _oracle(x, y, which, read.numpy())).all()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scores, _ = per_query(x, y, metrics=["precision_at_1"])
        reversed_scores, _ = per_query(x.flip(0), y.flip(0), metrics=["precision_at_1"])
    assert not np.array_equal(scores["precision_at_1"], reversed_scores["precision_at_1"][::-1])


@pytest.mark.parametrize("evaluator", [evaluate, evaluate_streaming], ids=["evaluate", "streaming"])
def test_collapsed_embeddings_are_flagged_for_every_query(evaluator):
    x, y = torch.ones(20, 4), torch.arange(4).repeat_interleave(5)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        evaluator(x, y)
    assert _ruled_count(record) == 20


@pytest.mark.parametrize("evaluator", [evaluate, evaluate_streaming], ids=["evaluate", "streaming"])
def test_no_warning_without_ties_or_when_ties_keep_one_class(evaluator):
    """Distinct vectors; and copies that all share their class (a tie, but of one relevance)."""
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.standard_normal((50, 8)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 4, 50))
    for emb, lab in ((x, y), (x.repeat(2, 1), y.repeat(2))):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            evaluator(emb, lab)
        assert _ruled_count(record) is None


def test_the_command_says_it_in_one_line(tmp_path, run_cli):
    path = tmp_path / "collapsed.npz"
    np.savez(path, embeddings=np.ones((20, 4), np.float32), labels=np.repeat(np.arange(4), 5))
    code, out, err = run_cli(["evaluate", str(path), "-m", "precision_at_1", "--json"])
    assert code == 0, err
    assert json.loads(out)["precision_at_1"] == 0.25  # the index rule: the first row is class 0
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("warning: precision_at_1: for 20 of 20 queries")
    assert "ranks such ties by reference index" in lines[0]


def _scaled_copies(n: int, bases: int, seed: int = 7):
    """``n`` rows, each one of ``bases`` random vectors times 1, 2, 4 or 0.5 (bit-identical once
    normalised), with labels that mix classes within a vector's copies."""
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(bases, 10)).astype(np.float32)
    which = rng.integers(0, bases, n)
    x = base[which] * rng.choice([1, 2, 4, 0.5], n)[:, None].astype(np.float32)
    return x, (which % 7 + rng.integers(0, 3, n)) % 9, which


def _ranked(x: np.ndarray, which: np.ndarray, i: int) -> np.ndarray:
    """The other rows by float64 cosine (one representative per vector: copies tie exactly),
    ties by index."""
    u = x.astype(np.float64) / np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
    rep = np.array([np.flatnonzero(which == w)[0] for w in range(which.max() + 1)])
    score = (u[rep] @ u[i])[which]
    others = np.delete(np.arange(len(x)), i)
    return others[np.lexsort((others, -score[others]))]


@pytest.mark.parametrize("budget_mb", [1, 256])
def test_full_map_of_copies_keeps_the_index_rule_at_any_budget(budget_mb):
    """The small path's float64 matrix product gave bit-identical rows values an ulp apart by
    column (MKL), so exact ties were broken by that noise: 0.210293 (and 0.210292 at 1 MiB)
    for the rule's 0.209524."""
    x, y, which = _scaled_copies(200, 20)
    aps = []
    for i in range(len(x)):
        rel = y[_ranked(x, which, i)] == y[i]
        if rel.any():
            aps.append(np.mean(np.arange(1, rel.sum() + 1) / (np.flatnonzero(rel) + 1)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = evaluate(x, y, metrics=["map"], memory_budget=budget_mb << 20)["map"]
    assert got == pytest.approx(float(np.mean(aps)), abs=1e-12)


def test_p1_of_copies_keeps_the_index_rule_when_map_at_r_narrows_the_blocks():
    """The re-search of tied rows scored mostly-candidate blocks with one float64 product: at
    a 1 MiB budget (narrow blocks) P@1 read 0.3222 for the rule's 0.3296."""
    x, y, which = _scaled_copies(2300, 60, seed=8)
    want = np.mean([y[_ranked(x, which, i)[0]] == y[i] for i in range(len(x))])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for budget_mb in (1, 256):
            got = evaluate(x, y, metrics=["precision_at_1", "map_at_r"], memory_budget=budget_mb << 20)
            assert got["precision_at_1"] == pytest.approx(want, abs=1e-12)
