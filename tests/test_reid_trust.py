"""Re-id inputs that were refused when valid, or taken when invalid: large finite scores, scores
as nested lists or a bare (row0, block) pair, uint64 ids past int64, an uncapped k1 sizing the
re-ranking buffer, ``--metric`` checked after the data, non-integer VehicleID ks/repeats and
out-of-range ``ranked_examples`` settings."""

from __future__ import annotations

import numpy as np
import pytest

from _reference import one_error_line
from dmlkit.apps.reid import (
    evaluate_reid_scores,
    k_reciprocal_distances,
    ranked_examples,
    vehicleid_protocol,
)
from dmlkit.exceptions import ConfigError, NonFiniteError, ShapeError

pytestmark = pytest.mark.usefixtures("one_thread")

BIG = np.finfo(np.float64).max


@pytest.fixture(scope="module")
def features() -> tuple[np.ndarray, np.ndarray]:
    """20 items in 4 dimensions, 10 identities of 2 images each."""
    rng = np.random.default_rng(0)
    ids = np.repeat(np.arange(10), 2)
    return rng.normal(size=(ids.size, 4)).astype(np.float32) + ids[:, None], ids


# -- 1: large but finite float64 scores ---------------------------------------------------
def test_large_finite_float64_scores_are_ranked_not_refused() -> None:
    """Was: the finiteness test summed the block, which overflows to inf for scores near the
    float64 maximum, so finite scores raised NonFiniteError."""
    scores = np.array([[0.1, 0.5, BIG], [0.3, 0.2, BIG]])
    assert evaluate_reid_scores(scores, [1, 2], [1, 2, 3]).mAP == 1.0
    with pytest.raises(NonFiniteError):  # still refused: a real NaN / infinity
        evaluate_reid_scores(np.array([[0.1, np.inf, BIG], [0.3, 0.2, BIG]]), [1, 2], [1, 2, 3])


# -- 2: scores as nested lists, a bare (row0, block) pair -------------------------------------
@pytest.mark.parametrize("scores", [[[0.1, 0.5, 0.9], [0.3, 0.2, 0.9]],
                                    ([0.1, 0.5, 0.9], [0.3, 0.2, 0.9]),
                                    [(0, [[0.1, 0.5, 0.9]]), (1, np.array([[0.3, 0.2, 0.9]]))]])
def test_scores_as_nested_lists_are_the_matrix(scores) -> None:
    """Was: a (Q, G) matrix as Python lists was iterated as (row0, block) pairs (ValueError:
    too many values to unpack)."""
    assert evaluate_reid_scores(scores, [1, 2], [1, 2, 3]).mAP == 1.0


@pytest.mark.parametrize("scores", [(0, np.array([[0.1, 0.5, 0.9], [0.3, 0.2, 0.9]])),
                                    [(0.0, np.array([[0.1, 0.5, 0.9], [0.3, 0.2, 0.9]]))],
                                    [(0, np.array([0.1, 0.5, 0.9]))], [[0.1, 0.5], [0.3]], 7])
def test_bad_score_forms_name_the_accepted_forms(scores) -> None:
    """Was: a bare (row0, block) tuple gave a TypeError (cannot unpack int), others a ValueError."""
    with pytest.raises(ShapeError, match=r"\(Q, G\) = \(2, 3\) array or an iterable of \(row0, block\)"):
        evaluate_reid_scores(scores, [1, 2], [1, 2, 3])


# -- 3: uint64 ids past int64 ------------------------------------------------------------------
def test_uint64_ids_past_int64_are_refused_not_wrapped() -> None:
    """Was: 2**64 - 1 became -1 in int64, a junk id, so the query was silently skipped."""
    ids = np.array([2**64 - 1, 2], dtype=np.uint64)
    with pytest.raises(ShapeError, match="18446744073709551615"):
        evaluate_reid_scores(np.array([[0.1, 0.5], [0.3, 0.2]]), ids, ids)
    small = np.array([2**63 - 1, 2], dtype=np.uint64)  # still fits: taken as is
    assert evaluate_reid_scores(np.array([[0.1, 0.5], [0.3, 0.2]]), small, small).num_valid_queries == 2


# -- 4: k1 past the number of items ------------------------------------------------------------
def test_rerank_k1_past_the_items_works_as_all_items(features) -> None:
    """Was: the reciprocal-set buffer was sized from the uncapped k1 (745 GiB for k1=100000 on
    20 items); any k1 >= N - 1 takes every item, as k1 = N - 1 does."""
    x, _ = features
    n = x.shape[0]
    want = k_reciprocal_distances(x[:5], x[5:], k1=n - 1)
    for k1 in (n, 3 * n, 100_000):
        np.testing.assert_array_equal(k_reciprocal_distances(x[:5], x[5:], k1=k1), want)


# -- 5: --metric checked first -----------------------------------------------------------------
def test_cli_bad_metric_is_reported_before_the_data_is_read(tmp_path, run_cli) -> None:
    """Was: the metric was checked after loading/embedding: a missing file was reported
    instead (and a long embedding ran before the typo was)."""
    code, _, err = run_cli(["reid", str(tmp_path / "nothere.npz"), "--metric", "cosin"])
    line = one_error_line(code, err)
    assert "--metric" in line and "'cosin'" in line


# -- 6: VehicleID ks and repeats ---------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [{"ks": (1.7,)}, {"ks": (1, 2.0)}, {"ks": (True,)}, {"ks": 1},
                                    {"ks": ()}, {"repeats": 2.5}, {"repeats": True}, {"repeats": 0}])
def test_vehicleid_needs_integer_ks_and_repeats(features, kwargs) -> None:
    """Was: ks=(1.7,) was reported as recall_at_1, repeats=2.5 a raw TypeError."""
    x, ids = features
    name = next(iter(kwargs))
    with pytest.raises(ConfigError, match=f"^{name} must"):
        vehicleid_protocol(x, ids, **{"repeats": 1, **kwargs})


def test_vehicleid_integer_ks_still_run(features) -> None:
    x, ids = features
    res = vehicleid_protocol(x, ids, repeats=np.int64(2), ks=np.array([1, 5]))
    assert set(res.values) == {1, 5} and len(res.map_values) == 2


# -- 7: ranked_examples top and queries --------------------------------------------------------
@pytest.mark.parametrize("top", [0, -1, 2.5, True])
def test_ranked_examples_top_must_be_positive(features, top) -> None:
    """Was: top=-1 returned G - 1 items (a slice [:-1])."""
    x, ids = features
    with pytest.raises(ConfigError, match="top must be a positive integer"):
        ranked_examples(x[:3], x[3:], ids[:3], ids[3:], queries=[0], top=top)


@pytest.mark.parametrize(("queries", "bad"), [([-1], "-1"), ([0, 7], "7"), ([3], "3"), ([0.5], "float64")])
def test_ranked_examples_queries_must_be_query_rows(features, queries, bad) -> None:
    """Was: -1 indexed the last query, 7 of 3 queries raised a bare IndexError."""
    x, ids = features
    with pytest.raises(ShapeError, match=f"queries must .*{bad}"):
        ranked_examples(x[:3], x[3:], ids[:3], ids[3:], queries=queries)


def test_ranked_examples_valid_settings_still_run(features) -> None:
    x, ids = features
    out = ranked_examples(x[:3], x[3:], ids[:3], ids[3:], queries=np.array([2, 0]), top=4)
    assert [e["query"] for e in out] == [2, 0] and all(len(e["gallery"]) == 4 for e in out)
    assert len(ranked_examples(x[:3], x[3:], ids[:3], ids[3:], queries=[1], top=100)[0]["gallery"]) == 17
