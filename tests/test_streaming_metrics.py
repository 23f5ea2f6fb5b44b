"""Streaming retrieval metrics (dmlkit.metrics.streaming) give exactly dmlkit.metrics.evaluate's
numbers, exact ties included, whatever the block size, source kind or backend."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dmlkit.distances import get_distance
from dmlkit.embedding_shards import write_shards
from dmlkit.exceptions import ConfigError, ShapeError
from dmlkit.metrics import evaluate, knn, per_query
from dmlkit.metrics.streaming import (
    evaluate_streaming,
    knn_above_floor,
    per_query_streaming,
    plan_blocks,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny blocks: one torch thread is faster

ALL = ["precision_at_1", "recall_at_k", "precision_at_k", "r_precision", "map_at_r"]
KS = (1, 3, 10)


def _clustered(n: int = 600, d: int = 8, classes: int = 20, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Clustered rows with the cases that make ranking hard: exact duplicates with different
    labels, a repeated row, rows on a coarse grid (many exactly equal scores), a singleton class
    (R_q = 0)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((classes, d))
    y = rng.integers(0, classes, n)
    x = (centres[y] + 1.2 * rng.standard_normal((n, d))).astype(np.float32)
    x[50:60] = x[40]  # ten copies of one row ...
    y[50:60] = (y[40] + np.arange(10)) % classes  # ... half of them relevant to it, half not
    x[100:200] = np.round(x[100:200] * 2) / 2  # a coarse grid: exact ties in the scores
    y[-1] = classes + 5  # a class of one: no positive
    return x, y.astype(np.int64)


@pytest.mark.parametrize("distance", ["cosine", "euclidean", "dot"])
@pytest.mark.parametrize("block_rows", [None, 97, 350])
def test_self_search_equals_evaluate(distance, block_rows):
    x, y = _clustered()
    want = evaluate(x, y, metrics=ALL, k_values=KS, distance=distance)
    got = evaluate_streaming(x, y, metrics=ALL, k_values=KS, distance=distance, block_rows=block_rows)
    assert got == want
    assert got["num_queries_without_positive"] == 1


def test_separate_reference_set_and_torch_sources():
    x, y = _clustered(800)
    q, ql, r, rl = x[:200], y[:200], x[200:], y[200:]
    want = evaluate(q, ql, r, rl, metrics=ALL, k_values=KS)
    assert evaluate_streaming(q, ql, r, rl, metrics=ALL, k_values=KS, block_rows=128) == want
    got = evaluate_streaming(torch.from_numpy(q), ql, torch.from_numpy(r), rl, metrics=ALL,
                             k_values=KS, block_rows=77)
    assert got == want


@pytest.mark.parametrize("distance", ["cosine", "dot", "euclidean"])
def test_numba_backend_on_blocks_equals_evaluate(distance):
    """Blocks large enough for the compiled kernel (cross-block and diagonal self-search); from
    the second reference block on, cosine and dot scans start from the running k-th closeness."""
    x, y = _clustered(3000, d=16, classes=60)
    want = per_query(x, y, metrics=ALL, k_values=KS, backend="numba", distance=distance)
    got = per_query_streaming(x, y, metrics=ALL, k_values=KS, backend="numba", block_rows=520,
                              distance=distance)
    for name in want[0]:
        np.testing.assert_array_equal(got[0][name], want[0][name], err_msg=name)


def test_knn_above_floor_keeps_exactly_what_reaches_the_floor():
    x, _ = _clustered(2500, d=16, classes=40)
    q, r = torch.from_numpy(x[:900]), torch.from_numpy(x[900:])
    dist = get_distance("cosine")
    full = knn(q, r, 30, distance=dist, backend="numba")
    floor = full.values[:, 9].numpy().copy()  # the 10th closeness: >= 10 reach it ...
    floor[::7] = np.inf  # ... and none for every 7th row
    got = knn_above_floor(q, r, 30, floor, distance=dist, backend="numba", memory_budget=2**20)
    reached = full.values >= torch.from_numpy(floor)[:, None]
    others = np.ones(len(q), dtype=bool)
    others[::7] = False
    assert reached[::7].sum() == 0 and reached[others].sum(1).min() >= 10
    assert torch.equal(got.values[reached], full.values[reached])
    assert torch.equal(got.indices[reached], full.indices[reached])
    assert torch.all(got.values[~reached] == -np.inf) and torch.all(got.indices[~reached] == -1)


def test_float16_shards_stream_from_disk(tmp_path):
    x, y = _clustered(700)
    shards = write_shards(tmp_path / "s", x, y, dtype="float16", shard_rows=128)
    decoded = x.astype(np.float16).astype(np.float32)
    want = evaluate(decoded, y, metrics=ALL, k_values=KS)
    # labels come from the shards; a tiny budget forces many blocks
    assert evaluate_streaming(shards, metrics=ALL, k_values=KS, memory_budget=2**20) == want
    mm = np.load(tmp_path / "s" / shards.manifest["shards"][0]["embeddings"], mmap_mode="r")
    assert evaluate_streaming(mm, y[:128], block_rows=50) == evaluate(decoded[:128], y[:128])


def test_per_query_matches_including_nan_rows():
    x, y = _clustered(500)
    want, want_r = per_query(x, y, metrics=ALL, k_values=KS)
    got, got_r = per_query_streaming(x, y, metrics=ALL, k_values=KS, block_rows=128)
    np.testing.assert_array_equal(got_r, want_r)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])  # NaN in the same places


def test_string_labels_and_no_valid_query():
    x, y = _clustered(300)
    names = np.array([f"class-{v}" for v in y])
    assert evaluate_streaming(x, names, block_rows=64) == evaluate(x, names)
    lone = evaluate_streaming(x[:5], np.arange(5))
    assert np.isnan(lone["precision_at_1"]) and lone["num_queries_without_positive"] == 5


def test_memory_plan_stays_within_the_budget():
    for budget_mb, n, d, k in [(1, 10**6, 128, 101), (256, 10**6, 128, 101), (64, 5000, 512, 10)]:
        budget = budget_mb * 2**20
        plan = plan_blocks(n, n, d, k, budget, same=True)
        held = plan.query_rows * (d * 4 * 2 + k * 12 * 6) + plan.reference_rows * d * 4 * 2
        assert plan.query_rows >= 1 and held <= budget // 2 or plan.query_rows == 1
        assert plan.knn_budget <= max(budget // 2, 2**20)
    sep = plan_blocks(10**6, 2 * 10**6, 128, 8, 2**28, same=False)
    assert sep.query_rows * (128 * 8 + 8 * 72) + sep.reference_rows * 128 * 8 <= 2**27


def test_refusals_say_what_to_do(tmp_path):
    x, y = _clustered(100)
    with pytest.raises(ConfigError, match="dmlkit.metrics.evaluate"):
        evaluate_streaming(x, y, metrics=["map_at_r", "nmi"])
    with pytest.raises(ConfigError, match="full-ranking"):
        evaluate_streaming(x, y, metrics=["map"])
    with pytest.raises(ShapeError, match="dimensions"):
        evaluate_streaming(x, y, x[:, :4], y)
    with pytest.raises(ShapeError, match="labels"):
        evaluate_streaming(x)  # an array carries no labels
    with pytest.raises(ShapeError, match="reference_labels"):
        evaluate_streaming(x, y, None, y)
    with pytest.raises(ConfigError, match="block_rows"):
        evaluate_streaming(x, y, block_rows=0)


def test_cli_evaluate_streams_a_shard_directory(tmp_path, capsys):
    from dmlkit.cli import main

    x, y = _clustered(400)
    write_shards(tmp_path / "q", x[:150], y[:150], shard_rows=64)
    write_shards(tmp_path / "r", x[150:], y[150:], dtype="float16", shard_rows=64)
    try:
        main(["evaluate", str(tmp_path / "q"), "--reference", str(tmp_path / "r"), "--memory-budget", "1",
              "--k", "1,5", "--json"])
    except SystemExit as exc:
        assert not exc.code
    got = json.loads(capsys.readouterr().out)
    want = evaluate(x[:150], y[:150], x[150:].astype(np.float16).astype(np.float32), y[150:], k_values=(1, 5))
    assert got == want
    with pytest.raises(SystemExit) as exc:
        main(["evaluate", str(tmp_path / "q"), "-m", "nmi"])
    assert exc.value.code == 2
    assert "cannot be streamed" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("start,stop,block_rows", [(0, 500, 97), (130, 371, 97), (250, 251, 100), (0, 100, 100)])
def test_query_ranges_give_the_whole_evaluation_s_per_query_scores(start, stop, block_rows):
    """A range of queries (aligned with the blocks or not) scores each query as the whole
    evaluation does; its means are the means over the range."""
    x, y = _clustered(500)
    want, want_r = per_query(x, y, metrics=ALL, k_values=KS)
    got, got_r = per_query_streaming(x, y, metrics=ALL, k_values=KS, block_rows=block_rows,
                                     query_range=(start, stop))
    np.testing.assert_array_equal(got_r, want_r[start:stop])
    for name in want:
        np.testing.assert_array_equal(got[name], want[name][start:stop])
    means = evaluate_streaming(x, y, metrics=ALL, k_values=KS, block_rows=block_rows,
                               query_range=(start, stop))
    valid = torch.from_numpy(want_r[start:stop] > 0)
    for name in want:
        scores = torch.from_numpy(want[name][start:stop])
        expected = float(scores[valid].mean()) if valid.any() else float("nan")
        assert means[name] == expected or (np.isnan(expected) and np.isnan(means[name]))
    assert means["num_queries"] == stop - start
    with pytest.raises(ConfigError, match="query_range"):
        evaluate_streaming(x, y, query_range=(5, 5))
