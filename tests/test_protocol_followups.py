"""Follow-ups of an audit of the protocol's numbers: a results mapping passed to ``compare`` is
checked as a results file is, the saved comparison names its confidence level as the terminal
does, the ``halves`` split counts its development classes as it makes them, and the paired
bootstrap refuses non-finite scores."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from _reference import bench_entries
from dmlkit.exceptions import DataError, ShapeError
from dmlkit.protocol import paired_bootstrap
from dmlkit.protocol.compare import compare_results, render_compare_markdown
from dmlkit.protocol.config import bench_config_from_dict
from dmlkit.protocol.results import build_results, load_results, write_results
from dmlkit.protocol.splits import make_bench_split

LABELS = np.repeat(np.arange(6), 4)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    bench_dir = tmp_path_factory.mktemp("bench")
    cfg = bench_config_from_dict({
        "name": "b", "fixed": {"data": {"dataset": "omniglot"}, "model": {"embedding_size": 8}},
        "protocol": {"seeds": [0, 1, 2], "trials": 1},
        "methods": [{"name": "contrastive", "loss": {"name": "contrastive"}},
                    {"name": "ms", "loss": {"name": "multi_similarity"}}]})
    entries = bench_entries(bench_dir, cfg, LABELS, 6)
    data = build_results(cfg, make_bench_split(range(12), "halves", folds=2), entries, bench_dir=bench_dir)
    write_results(data, bench_dir)
    return data


def _without_seed1_fold1(data):
    out = copy.deepcopy(data)
    runs = out["methods"]["ms"]["runs"]
    out["methods"]["ms"]["runs"] = [r for r in runs if not (r["seed"] == 1 and r["fold"] == 1)]
    return out


def _with_a_run_twice(data):
    out = copy.deepcopy(data)
    out["methods"]["ms"]["runs"].append(copy.deepcopy(out["methods"]["ms"]["runs"][0]))
    return out


@pytest.mark.parametrize("damage", [_without_seed1_fold1, _with_a_run_twice])
def test_compare_refuses_an_incomplete_results_mapping_as_it_refuses_the_file(results, damage):
    """Was: a mapping went through unchecked: a seed missing a fold scored "concatenated" from
    one model, a fold listed twice counted twice in "separated" (the same file was refused)."""
    with pytest.raises(DataError, match="seed [0-9]+: 'runs' list(s)? folds"):
        compare_results([damage(results)], metrics=["map_at_r"], modes=["separated"])


def test_compare_of_a_complete_mapping_equals_that_of_its_file(results):
    kwargs = dict(metrics=["map_at_r"], modes=["separated"])
    from_map = compare_results([results], **kwargs)
    from_file = compare_results([load_results(results["bench_dir"])], **kwargs)
    assert from_map["comparisons"] == from_file["comparisons"]


@pytest.mark.parametrize("confidence, shown", [(0.995, "99.5 % CI"), (0.925, "92.5 % CI"), (0.95, "95 % CI")])
def test_saved_comparison_names_its_confidence_level(results, confidence, shown):
    """Was: int(round(100 c)): 0.995 printed "100 % CI", 0.925 "92 % CI"."""
    report = compare_results([results], metrics=["map_at_r"], modes=["separated"],
                             confidence=confidence)
    assert shown in render_compare_markdown(report)


@pytest.mark.parametrize("n, dev", [(15, 8), (17, 9), (16, 8)])
def test_halves_split_takes_the_larger_half_as_development_classes(n, dev):
    """Was: 15 classes refused for 4 folds ("7 cross-validation classes") although the split
    gives the development half 8."""
    split = make_bench_split(range(n), "halves", folds=4)
    assert sum(len(f.val) for f in split.folds) == dev


def test_halves_split_too_small_names_the_real_count():
    with pytest.raises(DataError, match="13 classes give 7 cross-validation classes: too few for 4 folds"):
        make_bench_split(range(13), "halves", folds=4)


@pytest.mark.parametrize("a, b", [([1, 2, np.nan], [1, 2, 3]), ([1, 2, 3], [np.inf, 2, 3])])
def test_paired_bootstrap_refuses_non_finite_scores(a, b):
    """Was: a NaN difference and CI, without a word (the hierarchical bootstrap refused them)."""
    with pytest.raises(ShapeError, match="per-query scores must be finite"):
        paired_bootstrap(a, b)
