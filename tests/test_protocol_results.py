"""Results table (layout, CIs, n/a for one repeat), concatenated vs separated evaluation, and
``compare`` (paired bootstrap over queries, relative improvements) on synthetic embeddings."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dmlkit.embeddings import save_embeddings
from dmlkit.exceptions import DataNotFoundError
from dmlkit.protocol.compare import compare_results, relative_improvements, render_compare_markdown
from dmlkit.protocol.config import bench_config_from_dict
from dmlkit.protocol.results import (
    build_results,
    format_cell,
    load_results,
    render_csv,
    render_markdown,
    rich_table,
)
from dmlkit.protocol.runner import FinalRun, evaluate_runs
from dmlkit.protocol.splits import make_bench_split

CFG = {
    "name": "synthetic",
    "fixed": {"data": {"dataset": "omniglot"}, "model": {"embedding_size": 8}},
    "protocol": {"seeds": [0, 1, 2], "trials": 2},
    "methods": [
        {"name": "contrastive", "loss": {"name": "contrastive"}},
        {"name": "triplet", "loss": {"name": "triplet"}},
        {"name": "good", "loss": {"name": "multi_similarity"}},
    ],
}
LABELS = np.repeat(np.arange(30), 5)


def _emb(noise: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = np.random.default_rng(123).normal(size=(30, 8))
    return (centres[LABELS] + noise * rng.normal(size=(LABELS.size, 8))).astype(np.float32)


def _runs(tmp_path, name: str, noise: float, seeds=(0, 1, 2), folds=4) -> list[FinalRun]:
    runs = []
    for s in seeds:
        for f in range(folds):
            path = tmp_path / name / f"seed{s}" / f"fold{f}" / "embeddings" / "test.npz"
            save_embeddings(path, _emb(noise, 1000 * s + f + sum(map(ord, name))), LABELS,
                            indices=np.arange(LABELS.size))  # the test rows, as the trainer saves them
            runs.append(FinalRun(name, s, f, path.parents[1], path, path.parents[1] / "best.pt"))
    return runs


@pytest.fixture
def results(tmp_path):
    cfg = bench_config_from_dict(CFG)
    split = make_bench_split(range(60), "halves", folds=4)
    metrics = list(cfg.protocol.metrics)
    entries = {}
    for name, noise in [("pretrained", 2.5), ("contrastive", 1.5), ("triplet", 1.6), ("good", 0.9)]:
        runs = _runs(tmp_path, name, noise)
        entries[name] = {"runs": runs, "evaluation": evaluate_runs(runs, metrics), "best_params": {},
                         "loss": {"name": name}}
    return build_results(cfg, split, entries, bench_dir=tmp_path)


def test_concatenated_and_separated(tmp_path):
    from dmlkit.metrics import evaluate
    from dmlkit.validation import normalize_rows

    runs = _runs(tmp_path, "m", 1.5, seeds=(0,), folds=4)
    ev = evaluate_runs(runs, ["map_at_r"])
    embs = [_emb(1.5, f + sum(map(ord, "m"))) for f in range(4)]
    sep = np.mean([evaluate(e, LABELS, metrics=["map_at_r"])["map_at_r"] for e in embs])
    # each fold model's rows L2-normalised, side by side, normalised again (every model weighs the same)
    joined = normalize_rows(np.concatenate([normalize_rows(e) for e in embs], axis=1))
    cat = evaluate(joined, LABELS, metrics=["map_at_r"])["map_at_r"]
    assert ev["separated"]["map_at_r"] == [pytest.approx(sep)]
    assert ev["concatenated"]["map_at_r"] == [pytest.approx(cat)]
    assert cat > sep  # an ensemble of 4 noisy views is better than one


def test_table_layout_and_cis(results):
    assert results["modes"] == {"concatenated": 32, "separated": 8}
    row = results["methods"]["good"]["concatenated"]["map_at_r"]
    assert len(row["values"]) == 3 and row["ci95"] > 0
    md = render_markdown(results)
    lines = md.splitlines()
    assert lines[0].startswith("| Method | Concatenated (32-dim) |") and "Separated (8-dim)" in lines[0]
    assert lines[2] == "| | **P@1** | **RP** | **MAP@R** | **P@1** | **RP** | **MAP@R** |"
    assert lines[3].startswith("| pretrained |")  # the baseline row first
    good = next(line for line in lines if line.startswith("| good |"))
    assert good.count("**") == 12  # best in all six columns
    assert format_cell(row) in good
    csv_lines = render_csv(results).splitlines()
    assert len(csv_lines) == 1 + 4 * 2 * 3
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(rich_table(results))
    text = console.export_text()
    assert "MAP@R" in text and "good" in text and "±" in text


def test_format_cell():
    assert format_cell({"mean": 0.68131, "ci95": 0.00312}) == "68.13 ± 0.31"
    assert format_cell({"mean": 0.5105, "ci95": None}) == "51.05 ± n/a"


def test_compare_paired_t_test(results):
    report = compare_results([results], methods=["good", "contrastive", "triplet"])
    assert report["queries"] == LABELS.size
    by = {(c["a"], c["b"], c["mode"], c["metric"]): c for c in report["comparisons"]}
    c = by[("good", "contrastive", "concatenated", "map_at_r")]
    assert c["diff"] > 0 and c["excludes_zero"] and c["ci_low"] <= c["diff"] <= c["ci_high"]
    assert c["significant"] is True and c["variance"] == "seeds and queries"  # 3 seeds each
    assert report["seeds"] == {"good": 3, "contrastive": 3, "triplet": 3} and not report["warnings"]
    # deterministic
    again = compare_results([results], methods=["good", "contrastive", "triplet"])
    assert again["comparisons"] == report["comparisons"]
    md = render_compare_markdown(report)
    assert "| good | contrastive | concatenated | MAP@R |" in md
    assert "Relative improvement over contrastive" in md and "Relative improvement over triplet" in md
    base = compare_results([results], methods=["good", "triplet"], baseline="triplet")
    assert {(c["a"], c["b"]) for c in base["comparisons"]} == {("good", "triplet")}


def test_compare_same_method_twice_is_not_significant(results, tmp_path):
    other = {**results, "name": "copy", "methods": {"contrastive": results["methods"]["contrastive"]}}
    report = compare_results([results, other], methods=["contrastive", "contrastive@copy"])
    assert all(c["diff"] == 0 and not c["excludes_zero"] for c in report["comparisons"])


def test_compare_with_two_seeds_warns_and_never_says_significant(tmp_path):
    cfg = bench_config_from_dict({**CFG, "protocol": {"seeds": [0, 1], "trials": 2}})
    split = make_bench_split(range(60), "halves", folds=4)
    metrics = list(cfg.protocol.metrics)
    entries = {}
    for name, noise in [("contrastive", 1.5), ("good", 0.9)]:
        runs = _runs(tmp_path, name, noise, seeds=(0, 1))  # every fold of the split: a complete table
        entries[name] = {"runs": runs, "evaluation": evaluate_runs(runs, metrics), "best_params": {},
                         "loss": {"name": name}}
    report = compare_results([build_results(cfg, split, entries, bench_dir=tmp_path)])
    assert len(report["warnings"]) == 2 and "too few" in report["warnings"][0]
    big = [c for c in report["comparisons"] if c["excludes_zero"]]
    assert big and all(c["significant"] is None for c in report["comparisons"])
    md = render_compare_markdown(report)
    assert "too few seeds" in md and "| yes |" not in md


def test_relative_improvement_arithmetic(results):
    rel = relative_improvements(results["methods"], ["map_at_r"])
    g = results["methods"]["good"]["separated"]["map_at_r"]["mean"]
    c = results["methods"]["contrastive"]["separated"]["map_at_r"]["mean"]
    assert rel["contrastive"]["relative_percent"]["good"]["separated"]["map_at_r"] == pytest.approx(100 * (g - c) / c)
    assert "contrastive" not in rel["contrastive"]["relative_percent"]


def test_compare_errors(results):
    from dmlkit.exceptions import ConfigError

    with pytest.raises(ConfigError, match="at least two"):
        compare_results([results], methods=["good"])
    with pytest.raises(ConfigError, match="unknown method"):
        compare_results([results], methods=["good", "nope"])


@pytest.mark.parametrize("content", [
    b"\x89PNG\r\n\x1a\n\x00\x00garbage\xff\xfe",                     # not text at all
    b'{"methods": {"contrastive": {"concatenated": ',               # truncated
    b'{"name": "x"}',                                               # no methods
    b'{"methods": {"a": {"concatenated": {}, "separated": {}, "runs": [{"seed": 0}]}}}',
    b'{"methods": {"a": {"concatenated": {"map_at_r": {"mean": "high"}}, "separated": {}}}}',
])
def test_a_corrupt_results_file_is_one_clear_error(tmp_path, content, capsys):
    from dmlkit.cli import main
    from dmlkit.exceptions import DataError
    from dmlkit.protocol.results import load_results

    bad = tmp_path / "results.json"
    bad.write_bytes(content)
    with pytest.raises(DataError, match="results"):
        load_results(bad)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["compare", str(bad), str(bad)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err, err
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err


def test_an_older_results_file_is_read_from_any_folder(tmp_path, monkeypatch):
    """An older dmlkit stored run paths relative to the folder `dmlkit bench` ran in
    (``sub/bench/final/...``, with ``-o sub/bench``) beside the absolute bench_dir: read from
    another folder they became ``bench/sub/bench/final/...`` (not found, and `report` called
    present files missing). They are found under the results file's folder; a file found
    nowhere is one line that says why."""
    bench = tmp_path / "work" / "sub" / "bench"
    cfg = bench_config_from_dict(CFG)
    entries = {}
    for name, noise in [("contrastive", 1.5), ("good", 0.9)]:
        runs = _runs(bench / "final", name, noise)
        entries[name] = {"runs": runs, "evaluation": evaluate_runs(runs, list(cfg.protocol.metrics)),
                         "best_params": {}}
    results = build_results(cfg, make_bench_split(range(60), "halves", folds=4), entries, bench_dir=bench)
    for row in results["methods"].values():  # as the older dmlkit wrote them, from tmp_path/work
        for run in row["runs"]:
            run.update({k: f"sub/bench/{run[k]}" for k in ("run_dir", "checkpoint", "embeddings")})
    (bench / "results.json").write_text(json.dumps(results))
    monkeypatch.chdir(bench.parent)
    loaded = load_results("bench")
    first = loaded["methods"]["good"]["runs"][0]
    assert Path(first["embeddings"]).resolve() == (bench / "final" / "good" / "seed0" / "fold0" / "embeddings" / "test.npz").resolve()
    assert compare_results([loaded], metrics=["map_at_r"])["methods"]
    (bench / "final" / "good" / "seed0" / "fold0" / "embeddings" / "test.npz").unlink()
    with pytest.raises(DataNotFoundError, match="written by an older dmlkit, with run paths relative to the "
                       "folder `dmlkit bench` ran in") as err:
        compare_results([load_results("bench")], metrics=["map_at_r"])
    assert "bench/sub/bench" not in str(err.value) and "\n" not in str(err.value)
