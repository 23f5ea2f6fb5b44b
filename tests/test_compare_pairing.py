"""``dmlkit compare`` pairs only test queries that are the same items: embedding files with
``indices`` (dataset rows) must hold the same rows, files without them are matched by labels
(with a warning), and results files of different test sets (dataset, class split) are refused.
Small synthetic benches in the real ``results.json`` / ``embeddings/test.npz`` formats."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from _reference import TINY_MODEL, bench_entries
from dmlkit.embeddings import dataset_rows, load_embeddings, save_embeddings
from dmlkit.exceptions import DataError
from dmlkit.protocol.compare import compare_results
from dmlkit.protocol.config import bench_config_from_dict
from dmlkit.protocol.results import build_results, write_results
from dmlkit.protocol.splits import make_bench_split

LABELS = np.repeat(np.arange(6), 4)
ROWS = np.arange(100, 100 + LABELS.size)  # the test rows of the full dataset


def _set_rows(path: Path, rows: np.ndarray) -> None:
    """Rewrite an embeddings file with ``rows`` as its ``indices``, as the trainer writes them."""
    emb, lab, _ = load_embeddings(path)
    save_embeddings(path, emb, lab, indices=rows)


def _bench(tmp_path: Path, name: str, rows: np.ndarray | None = ROWS, *, data: dict | None = None,
           protocol: dict | None = None) -> Path:
    """``tmp_path/name/results.json`` of a bench with methods ``contrastive`` and ``ms`` (3 seeds,
    :func:`_reference.bench_entries`) whose embedding files hold ``rows`` (no ``indices`` when
    ``None``)."""
    bench_dir = tmp_path / name
    cfg = bench_config_from_dict({
        "name": name, "fixed": {"data": {"dataset": "omniglot", **(data or {})}, "model": {"embedding_size": 8}},
        "protocol": {"seeds": [0, 1, 2], "trials": 1, **(protocol or {})},
        "methods": [{"name": "contrastive", "loss": {"name": "contrastive"}},
                    {"name": "ms", "loss": {"name": "multi_similarity"}}]})
    entries = bench_entries(bench_dir, cfg, LABELS, 6)
    if rows is not None:
        for entry in entries.values():
            for run in entry["runs"]:
                _set_rows(run.embeddings, rows)
    write_results(build_results(cfg, make_bench_split(range(12), "halves", folds=2), entries,
                                bench_dir=bench_dir), bench_dir)
    return bench_dir / "results.json"


def _compare(paths, **kwargs):
    return compare_results([str(p) for p in paths], metrics=["map_at_r"], modes=["separated"], **kwargs)


# -- same labels, other test items: refused ---------------------------------------------------
def test_same_labels_on_other_rows_are_refused(tmp_path, run_cli):
    a, b = _bench(tmp_path, "a"), _bench(tmp_path, "b", ROWS + 1000)
    with pytest.raises(DataError, match=r"methods 'ms' .* and 'ms@b' .*different test items .*same labels.*"
                                        "a paired comparison needs the same test set"):
        _compare([a, b], methods=["ms", "ms@b"])
    code, out, err = run_cli(["compare", str(a), str(b), "-m", "ms", "-m", "ms@b"])
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "different test items" in err


def test_a_run_of_a_method_on_other_rows_is_refused(tmp_path):
    a = _bench(tmp_path, "a")
    moved = tmp_path / "a" / "ms" / "seed2" / "fold0" / "embeddings" / "test.npz"
    _set_rows(moved, ROWS + 1)  # same labels, shifted rows
    with pytest.raises(DataError, match=rf"{re.escape(str(moved))}.*\(method 'ms'\) hold different test items"):
        _compare([a], methods=["ms", "contrastive"])


def test_same_rows_of_other_files_are_refused(tmp_path):
    # the data changed between two benches: a file renamed in a class folder puts another image
    # at the same row, with the same label
    paths = np.asarray([f"c{label}/img{k}.png" for k, label in enumerate(LABELS)])
    renamed = paths.astype("U32")
    renamed[5] = "c1/img5-new.png"
    benches = []
    for name, files in (("a", paths), ("b", renamed)):
        results = _bench(tmp_path, name)
        for npz in (tmp_path / name).rglob("test.npz"):
            emb, lab, extra = load_embeddings(npz)
            save_embeddings(npz, emb, lab, indices=extra["indices"], paths=files)
        benches.append(results)
    assert _compare([benches[0], tmp_path / "a" / "results.json"], methods=["ms", "contrastive"])
    with pytest.raises(DataError, match=r"different test items \(the same rows, other files: row 5 is "
                                        r"c1/img5.png in one and c1/img5-new.png in the other\)"):
        _compare(benches, methods=["ms", "ms@b"])


# -- same test items: compared ----------------------------------------------------------------
def test_same_rows_are_compared_by_indices(tmp_path):
    report = _compare([_bench(tmp_path, "a"), _bench(tmp_path, "b")], methods=["ms", "ms@b"])
    assert report["paired_by"] == "indices" and not report["warnings"]
    assert [(c["a"], c["b"]) for c in report["comparisons"]] == [("ms", "ms@b")]


def test_benches_on_other_machines_are_compared(tmp_path):
    """The data root (and how the data is read) differs between machines, not the test items."""
    a = _bench(tmp_path, "a", data={"root": "/data/one"})
    b = _bench(tmp_path, "b", data={"root": "/mnt/other", "options": {"download": True}})
    report = _compare([a, b], methods=["ms", "ms@b"])
    assert report["paired_by"] == "indices" and len(report["comparisons"]) == 1


def test_benches_naming_one_dataset_by_two_aliases_are_compared(tmp_path):
    """``orl`` is ``att_faces`` to the loader, so to compare too."""
    a = _bench(tmp_path, "a", data={"dataset": "orl"})
    b = _bench(tmp_path, "b", data={"dataset": "att_faces"})
    report = _compare([a, b], methods=["ms", "ms@b"])
    assert report["paired_by"] == "indices" and len(report["comparisons"]) == 1


# -- older files without indices: compared by labels, with a warning --------------------------
def test_files_without_indices_are_paired_by_labels_with_a_warning(tmp_path, run_cli):
    a, b = _bench(tmp_path, "a", None), _bench(tmp_path, "b", None)
    report = _compare([a, b], methods=["ms", "ms@b"])
    assert report["paired_by"] == "labels" and len(report["comparisons"]) == 1
    (warning,) = report["warnings"]
    assert "ms, ms@b were matched by their labels only" in warning and "`indices`" in warning
    code, _, err = run_cli(["compare", str(a), str(b), "-m", "ms", "-m", "ms@b"])
    assert code == 0 and "labels only" in err


def test_one_method_without_indices_warns_for_that_method(tmp_path):
    report = _compare([_bench(tmp_path, "a"), _bench(tmp_path, "b", None)], methods=["ms", "ms@b"])
    assert report["paired_by"] == "labels"
    assert any("the test queries of ms@b were matched by their labels only" in w for w in report["warnings"])


# -- different test sets: refused -------------------------------------------------------------
@pytest.mark.parametrize("other, what", [
    ({"data": {"dataset": "att_faces"}}, "dataset 'omniglot' vs 'att_faces'"),
    ({"data": {"options": {"sets": ["background"]}}}, "data options"),
    ({"protocol": {"order": "random", "order_seed": 3}}, "protocol.order 'default' vs 'random'"),
])
def test_benches_of_different_test_sets_are_refused(tmp_path, run_cli, other, what):
    a, b = _bench(tmp_path, "a"), _bench(tmp_path, "b", **other)
    with pytest.raises(DataError, match="different test sets"):
        _compare([a, b], methods=["ms", "ms@b"])
    code, out, err = run_cli(["compare", str(a), str(b), "-m", "ms", "-m", "ms@b"])
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "different test sets" in err and what in err
    assert str(a) in err and str(b) in err
    # the methods of one of the two benches are compared: the other file is not read for them
    assert len(_compare([a, b], methods=["ms", "contrastive"])["comparisons"]) == 1


# -- the bench's pretrained baseline saves its test rows -------------------------------------
def test_pretrained_runs_save_the_test_rows(tmp_path, data_root):
    from dmlkit.protocol import Bench
    from dmlkit.protocol.stages import FinalStage

    cfg = bench_config_from_dict({
        "name": "tiny",
        "fixed": {"data": {"dataset": "omniglot", "root": str(data_root), "transform": "grayscale",
                           "image_size": 28}, "model": TINY_MODEL,
                  "training": {"device": "cpu", "eval_batch_size": 200}},
        "protocol": {"num_classes": 8, "folds": 2, "trials": 1, "seeds": [0]},
        "methods": [{"name": "contrastive", "loss": {"name": "contrastive"}}]})
    bench = Bench(cfg, tmp_path / "b")
    full = bench.full_dataset()
    stage = FinalStage(cfg, bench.split(full), full, bench.dir)
    runs = stage.run_pretrained()
    assert len(runs) == 2
    for run in runs:
        _, labels, extra = load_embeddings(run.embeddings)
        assert np.array_equal(extra["indices"], dataset_rows(stage.test))
        assert np.array_equal(labels, stage.test.labels)


# -- concatenated: each fold model weighs the same -----------------------------------------------
def test_concatenated_embeddings_weigh_each_fold_model_the_same(tmp_path):
    """With ``model.normalize: false`` a fold model of large norm must not drown the others: the
    concatenated rows are those of the unit parts (the seed's models output unit vectors)."""
    from dmlkit.metrics import evaluate
    from dmlkit.protocol.runner import FinalRun, evaluate_runs
    from dmlkit.validation import concatenate_normalized, normalize_rows

    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(6), 5)
    good = (rng.standard_normal((6, 4))[labels] + 0.1 * rng.standard_normal((30, 4))).astype(np.float32)
    noise = (1e3 * rng.standard_normal((30, 4))).astype(np.float32)  # a useless model, huge norm
    cat = concatenate_normalized([good, noise])
    np.testing.assert_array_equal(
        cat, normalize_rows(np.concatenate([normalize_rows(good), normalize_rows(noise)], axis=1)))
    runs = []
    for fold, emb in enumerate((good, noise)):
        save_embeddings(tmp_path / f"f{fold}.npz", emb, labels)
        runs.append(FinalRun("m", 0, fold, tmp_path, tmp_path / f"f{fold}.npz", None))
    res = evaluate_runs(runs, ["precision_at_1"])
    raw = normalize_rows(np.concatenate([good, noise], axis=1))  # the noise's norm wins
    assert evaluate(raw, labels, metrics=["precision_at_1"])["precision_at_1"] <= 0.2  # chance: 4/29
    assert res["concatenated"]["precision_at_1"][0] >= 0.7  # half the signal is the good model's
