"""``dmlkit compare`` over many methods tested every pair at the nominal level: with four equal
methods, six pairs, one was called "significant" up to a quarter of the time. The t-test over
seeds and queries is now Holm-corrected over the pairs of each metric and mode."""

from __future__ import annotations

import json

import numpy as np
import pytest

import dmlkit.protocol.compare as compare_module
from _reference import bench_entries
from dmlkit.protocol.compare import compare_results, render_compare_markdown
from dmlkit.protocol.config import bench_config_from_dict
from dmlkit.protocol.stats import DifferenceTest, holm_adjusted

BASE = {"name": "holm", "fixed": {"data": {"dataset": "omniglot"}, "model": {"embedding_size": 8}}}


def test_holm_adjusted_p_values_by_definition():
    p = np.array([0.04, 0.001, 0.03, 0.012, 0.009, 0.02])
    # sorted 0.001 0.009 0.012 0.02 0.03 0.04 times 6..1: 0.006 0.045 0.048 0.06 0.06 0.04 -> running max
    want_sorted = [0.006, 0.045, 0.048, 0.06, 0.06, 0.06]
    np.testing.assert_allclose(holm_adjusted(p)[np.argsort(p)], want_sorted)
    assert holm_adjusted([0.03]).tolist() == [0.03]  # one test: unchanged
    assert holm_adjusted([0.5, 0.9]).tolist() == [1.0, 1.0]  # capped at 1
    assert holm_adjusted([]).shape == (0,)


def test_compare_calls_significant_only_what_survives_holm(tmp_path, monkeypatch):
    from dmlkit.protocol.results import build_results
    from dmlkit.protocol.splits import make_bench_split

    names = ["contrastive", "triplet", "ms", "arcface"]
    losses = {"contrastive": "contrastive", "triplet": "triplet", "ms": "multi_similarity",
              "arcface": "arcface"}
    cfg = bench_config_from_dict({**BASE, "protocol": {"seeds": [0, 1, 2], "trials": 1}, "methods": [
        {"name": n, "loss": {"name": losses[n]}} for n in names]})
    labels = np.repeat(np.arange(12), 4)
    results = build_results(cfg, make_bench_split(range(24), "halves", folds=2),
                            bench_entries(tmp_path, cfg, labels, 12, [(n, 1.0) for n in names]),
                            bench_dir=tmp_path)
    raw = iter([0.04, 0.001, 0.03, 0.012, 0.009, 0.02])  # the six pairs, in the report's order

    def fake(a, b, **kwargs):  # every CI excludes 0; only the p-values differ
        return DifferenceTest(0.05, 0.01, 0.09, next(raw), 0.02, 10.0, 0.95, (3, 3), 48)

    monkeypatch.setattr(compare_module, "seed_query_t_test", fake)
    report = compare_results([results], methods=names, metrics=["map_at_r"], modes=["separated"])
    got = [(c["p"], c["p_holm"], c["significant"]) for c in report["comparisons"]]
    assert [g[0] for g in got] == [0.04, 0.001, 0.03, 0.012, 0.009, 0.02]
    assert [g[2] for g in got] == [False, True, False, True, True, False]  # raw p < 0.05 everywhere
    assert [g[1] for g in got] == pytest.approx([0.06, 0.006, 0.06, 0.048, 0.045, 0.06])
    assert "Holm" in report["test"] and "Holm's correction" in render_compare_markdown(report)


def test_compare_cli_shows_the_corrected_p_of_each_pair(tmp_path, run_cli):
    from dmlkit.protocol.results import build_results
    from dmlkit.protocol.splits import make_bench_split
    from dmlkit.utils import atomic_write_json

    cfg = bench_config_from_dict({**BASE, "protocol": {"seeds": [0, 1, 2], "trials": 1}, "methods": [
        {"name": "contrastive", "loss": {"name": "contrastive"}}, {"name": "ms", "loss": {"name": "multi_similarity"}}]})
    labels = np.repeat(np.arange(12), 4)
    results = build_results(cfg, make_bench_split(range(24), "halves", folds=2),
                            bench_entries(tmp_path, cfg, labels, 12), bench_dir=tmp_path)
    atomic_write_json(tmp_path / "results.json", results)
    code, out, err = run_cli(["compare", str(tmp_path / "results.json"), "--metric", "map_at_r",
                              "--mode", "separated", "-o", str(tmp_path / "cmp.json")])
    assert code == 0, err
    assert "95 % CI" in out and "p (Holm)" in out
    report = json.loads((tmp_path / "cmp.json").read_text())
    (c,) = report["comparisons"]
    assert c["p_holm"] == pytest.approx(c["p"])  # one pair: nothing to correct
    assert f"{c['p_holm']:.3g}" in out


def test_compare_cli_takes_the_confidence_level(tmp_path, run_cli):
    """``--confidence`` reaches the test: a 90 % CI lies inside the 99 % one, the table and the
    report name the level, and a percentage is refused in one line."""
    from dmlkit.protocol.results import build_results
    from dmlkit.protocol.splits import make_bench_split
    from dmlkit.utils import atomic_write_json

    cfg = bench_config_from_dict({**BASE, "protocol": {"seeds": [0, 1, 2], "trials": 1}, "methods": [
        {"name": "contrastive", "loss": {"name": "contrastive"}}, {"name": "ms", "loss": {"name": "multi_similarity"}}]})
    labels = np.repeat(np.arange(12), 4)
    results = build_results(cfg, make_bench_split(range(24), "halves", folds=2),
                            bench_entries(tmp_path, cfg, labels, 12, [("contrastive", 1.0), ("ms", 0.6)]),
                            bench_dir=tmp_path)
    atomic_write_json(tmp_path / "results.json", results)
    reports = {}
    for level in ("0.9", "0.99"):
        code, out, err = run_cli(["compare", str(tmp_path / "results.json"), "--metric", "map_at_r",
                                  "--mode", "separated", "--confidence", level,
                                  "-o", str(tmp_path / f"cmp{level}.json")])
        assert code == 0, err
        assert f"{100 * float(level):g} % CI" in out
        reports[level] = json.loads((tmp_path / f"cmp{level}.json").read_text())
    assert reports["0.9"]["confidence"] == 0.9 and reports["0.99"]["confidence"] == 0.99
    (narrow,), (wide,) = reports["0.9"]["comparisons"], reports["0.99"]["comparisons"]
    assert narrow["diff"] == wide["diff"]
    assert wide["ci_low"] < narrow["ci_low"] <= narrow["ci_high"] < wide["ci_high"]
    code, out, err = run_cli(["compare", str(tmp_path / "results.json"), "--confidence", "95"])
    assert code != 0 and "strictly between 0 and 1" in err and "Traceback" not in err
