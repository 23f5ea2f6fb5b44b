"""Issue 11 items 20 and 23: ``dmlkit bench`` checks every method against the folds' class counts
before the first trial, in one error with fitting values, and writes nothing when it refuses;
a corrected config then runs; ``--stage search`` exits 2 when every trial failed, and only
COMPLETE trials count as finished."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import optuna
import pytest
import yaml

from _reference import run_cli
from dmlkit.exceptions import ConfigError, DmlkitError
from dmlkit.protocol import Bench, bench_config_from_dict
from dmlkit.protocol.config import SearchParam
from dmlkit.protocol.preflight import check_bench
from dmlkit.protocol.space import search_samples
from dmlkit.protocol.study import (
    count_completed,
    count_finished,
    make_storage,
    open_study,
    resolve_storage_url,
    run_worker,
    study_summary,
)
from dmlkit.training.preflight import PreflightError
from test_preflight import make_folder

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_folder(tmp_path_factory.mktemp("data") / "animals")


def bench_dict(root: Path) -> dict:
    """A new user's bench on a 10-class folder: the Reality Check's 4 folds and 8 x 4 batches."""
    return {
        "name": "mine",
        "fixed": {
            "data": {"dataset": "image_folder", "root": str(root), "transform": "grayscale", "image_size": 16},
            "model": {"trunk": "small_cnn", "trunk_options": {"widths": [8, 16]}, "pretrained": False,
                      "in_channels": 1, "embedding_size": 8, "freeze_batchnorm": False},
            "classification_sampler": {"classes_per_batch": 32, "samples_per_class": 1},
            "optimizer": {"preset": "cpu_quick"},
            "training": {"epochs": 1, "device": "cpu"},
        },
        "protocol": {"trials": 1, "n_startup_trials": 1, "pretrained": False},
        "methods": [
            {"name": "triplet", "loss": {"name": "triplet"},
             "search": {"loss.margin": {"low": 0.05, "high": 0.5}}},
            {"name": "arcface", "loss": {"name": "arcface"}},
        ],
    }


def _run(capsys, *args: str) -> tuple[int, str]:
    code, out, err = run_cli(capsys, *args)
    return code, out + err


def test_every_violation_in_one_error_then_the_corrected_bench_runs(folder, tmp_path, capsys):
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(bench_dict(folder)))
    out = tmp_path / "out"
    code, text = _run(capsys, "bench", str(path), "-o", str(out), "--stage", "search", "--threads", "1")
    assert code == 2 and "Traceback" not in text
    flat = " ".join(text.split())
    # 10 classes: 5 for cross-validation, too few for 4 folds; with 2 folds the smallest fold
    # trains on 2 classes: both samplers must fit it
    for fix in ("--set protocol.folds=2", "--set fixed.sampler.classes_per_batch=2",
                "--set fixed.classification_sampler.classes_per_batch=2"):
        assert fix in flat, fix
    assert str(folder) in flat and "10 classes" in flat and "ant" in flat
    assert not out.exists(), "a refused bench must leave nothing behind"
    code, text = _run(capsys, "bench", str(path), "-o", str(out), "--stage", "search", "--threads", "1",
                      "--set", "protocol.folds=2", "--set", "fixed.sampler.classes_per_batch=2",
                      "--set", "fixed.classification_sampler.classes_per_batch=2")
    assert code == 0, text
    assert "1/1 trials completed" in text
    study = optuna.load_study(storage=f"sqlite:///{out / 'study.db'}", study_name="mine/triplet")
    assert count_completed(study) == 1


def test_python_api_validates_without_writing(folder, tmp_path):
    cfg = bench_config_from_dict(bench_dict(folder))
    with pytest.raises(PreflightError) as info:
        Bench(cfg, tmp_path / "b").run(stage="search")
    assert {p.key for p in info.value.problems} >= {"protocol.folds", "fixed.sampler.classes_per_batch"}
    assert not (tmp_path / "b").exists()
    data = bench_dict(folder)
    data["protocol"]["folds"] = 2
    data["fixed"]["sampler"] = {"classes_per_batch": 2, "samples_per_class": 4}
    data["fixed"]["classification_sampler"]["classes_per_batch"] = 2
    data["methods"][0]["loss"]["params"] = {"bogus": 1}  # a bad loss parameter is found up front too
    from dmlkit.data import load_dataset

    report = check_bench(bench_config_from_dict(data), load_dataset("image_folder", root=folder))
    assert [p.key for p in report.errors] == ["methods.0.loss.params"]
    assert len(report.split.folds) == 2
    with pytest.raises(ConfigError, match="different folders"):
        Bench(cfg, tmp_path / "b", data_root=tmp_path / "elsewhere")


def _corrected(folder: Path) -> dict:
    data = bench_dict(folder)
    data["protocol"].update(folds=2, trials=2)
    data["fixed"]["sampler"] = {"classes_per_batch": 2, "samples_per_class": 4}
    data["methods"] = data["methods"][:1]
    return data


def test_search_exits_2_when_every_trial_failed(folder, tmp_path, capsys, monkeypatch):
    def broken_train(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr("dmlkit.protocol.stages.train", broken_train)
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(_corrected(folder)))
    out = tmp_path / "out"
    code, text = _run(capsys, "bench", str(path), "-o", str(out), "--stage", "search")
    flat = " ".join(text.split())
    assert code == 2 and "every search trial failed for triplet" in flat and "out of memory" in flat
    assert "0/2 trials completed, 1 failed" in flat and "0/2 trials completed, 2 failed" in flat
    with pytest.raises(DmlkitError, match="every search trial failed"):
        Bench(bench_config_from_dict(_corrected(folder)), out).run(stage="search")


def test_only_complete_trials_count_as_finished(tmp_path):
    storage = make_storage(resolve_storage_url(None, tmp_path))
    study = open_study(storage, "s", 3, seed=0, n_startup_trials=1)

    def objective(trial):
        if trial.number == 1:
            raise ValueError("boom")
        return trial.suggest_float("x", 0, 1)

    run_worker(study, objective)
    assert count_completed(study) == 2 and count_finished(study) == 3  # 3 slots used, 2 results
    summary = study_summary(study)
    assert summary["finished"] == 2 and summary["failed"] == 1


def test_no_fold_fits_says_what_would(tmp_path):
    root = make_folder(tmp_path / "f")
    data = copy.deepcopy(bench_dict(root))
    data["protocol"]["num_classes"] = 20
    from dmlkit.data import load_dataset

    report = check_bench(bench_config_from_dict(data), load_dataset("image_folder", root=root))
    keys = {p.key: p for p in report.errors}
    assert keys["protocol.num_classes"].fit == 10 and keys["protocol.folds"].fit == 2


def test_only_the_selected_methods_are_checked_and_searched_ranges_are_built(folder):
    """``bench -m triplet`` is not refused for what only an unselected method needs; a searched
    parameter the loss does not take (or a range end it refuses) is found before any trial."""
    from dmlkit.data import load_dataset

    data = bench_dict(folder)
    data["protocol"]["folds"] = 2
    data["fixed"]["sampler"] = {"classes_per_batch": 2, "samples_per_class": 4}
    dataset = load_dataset("image_folder", root=folder)
    # the classification sampler's 32 classes per batch only matter to arcface
    everything = check_bench(bench_config_from_dict(data), dataset)
    assert [p.key for p in everything.errors] == ["fixed.classification_sampler.classes_per_batch"]
    assert check_bench(bench_config_from_dict(data), dataset, methods=["triplet"]).errors == []
    data["methods"][0]["search"] = {"loss.nosuch": {"low": 0.1, "high": 0.5},
                                    "loss.margin": {"low": 0.05, "high": 0.5}}
    report = check_bench(bench_config_from_dict(data), dataset, methods=["triplet"])
    assert [p.key for p in report.errors] == ["methods.0.search"]
    assert "nosuch" in report.errors[0].message and "loss.nosuch=0.1" in report.errors[0].message
    data["methods"][0] = {"name": "ms", "loss": {"name": "multi_similarity"},  # a refused range end
                          "search": {"loss.alpha": {"low": 0.5, "high": 4.0}, "loss.beta": {"low": -2.0, "high": 50.0}}}
    report = check_bench(bench_config_from_dict(data), dataset, methods=["ms"])
    assert [p.key for p in report.errors] == ["methods.0.search"]
    assert "loss.beta=-2.0" in report.errors[0].message and "positive" in report.errors[0].message


def test_search_samples_are_fixed_points_optuna_could_sample():
    """Fixed seed (the same points each check), ints on their grid, stepped floats on theirs
    (ending at the last grid point, as Optuna does), log ranges within their ends, choices."""
    space = {"loss.k": SearchParam(type="int", low=1, high=10, step=4),
             "loss.m": SearchParam(type="float", low=0.1, high=1.0, step=0.4),
             "loss.t": SearchParam(type="float", low=1e-4, high=1.0, log=True),
             "loss.n": SearchParam(type="int", low=1, high=1000, log=True),
             "loss.swap": SearchParam(type="categorical", choices=[True, False])}
    points = search_samples(space, 32)
    assert points == search_samples(space, 32) and len(points) == 32
    assert {p["loss.k"] for p in points} == {1, 5, 9} and all(type(p["loss.k"]) is int for p in points)
    assert {round(p["loss.m"], 9) for p in points} == {0.1, 0.5, 0.9}
    assert all(1e-4 <= p["loss.t"] <= 1.0 and 1 <= p["loss.n"] <= 1000 for p in points)
    assert sum(p["loss.t"] < 1e-2 for p in points) >= 8  # log-uniform: half below 1e-2
    assert {p["loss.swap"] for p in points} == {True, False}


def test_a_constraint_coupling_two_searched_ranges_is_found_at_random_points(folder):
    """distance_weighted needs cutoff < nonzero_loss_cutoff: both corners of these overlapping
    ranges build, yet ~16% of the points a trial samples are refused (each one a FAIL trial).
    The preflight builds fixed random points too and reports one with its values."""
    from dmlkit.data import load_dataset

    data = bench_dict(folder)
    data["protocol"]["folds"] = 2
    data["fixed"]["sampler"] = {"classes_per_batch": 2, "samples_per_class": 4}
    data["methods"][0]["miner"] = {"name": "distance_weighted"}
    data["methods"][0]["search"] = {"miner.cutoff": {"low": 0.1, "high": 1.0},
                                    "miner.nonzero_loss_cutoff": {"low": 0.5, "high": 1.4}}
    dataset = load_dataset("image_folder", root=folder)
    report = check_bench(bench_config_from_dict(data), dataset, methods=["triplet"])
    assert [p.key for p in report.errors] == ["methods.0.search"]
    message = report.errors[0].message
    match = re.search(r"with miner\.cutoff=([\d.]+), miner\.nonzero_loss_cutoff=([\d.]+): .*cutoff < "
                      r"nonzero_loss_cutoff.* \((\d+) of 32 random points", message)
    assert match, message
    assert float(match[1]) >= float(match[2]) and int(match[3]) >= 1  # a refused point, shown
    assert "every combination" in report.errors[0].hint
    assert check_bench(bench_config_from_dict(data), dataset, methods=["triplet"]).errors[0].message == message
    data["methods"][0]["search"]["miner.nonzero_loss_cutoff"]["low"] = 1.0  # no overlap: accepted
    assert check_bench(bench_config_from_dict(data), dataset, methods=["triplet"]).errors == []


def test_an_in_memory_study_is_refused_where_other_processes_must_read_it(folder, tmp_path):
    data = _corrected(folder)
    data["protocol"]["storage"] = "sqlite:///:memory:"
    bench = Bench(bench_config_from_dict(data), tmp_path / "b")
    for kwargs in ({"workers": 2}, {"stage": "search"}, {"stage": "final"}):
        with pytest.raises(ConfigError, match="in-memory database"):
            bench.run(**kwargs)
    assert not (tmp_path / "b").exists()
