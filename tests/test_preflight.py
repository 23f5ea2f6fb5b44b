"""Issue 11 items 6 and 23: a config is checked against its data at once, before anything is
written; every violation comes back in one error with a value that fits (CLI spelling); a
corrected config then trains. Degenerate evaluation splits are refused, NaN never selects a
model, and ``--data-root`` never silently replaces a config's own ``data.root``."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from _reference import run_cli, tiny_sections
from dmlkit.config import config_from_dict
from dmlkit.data import load_dataset
from dmlkit.exceptions import ConfigError
from dmlkit.training.builders import model_setting_problems
from dmlkit.training.data_root import merge_data_root, with_data_root
from dmlkit.training.loop import Trainer, check_class_sets
from dmlkit.training.preflight import (
    PreflightError,
    PreflightWarning,
    TrainStats,
    batch_problems,
    eval_split_problems,
    plan_split,
    preflight,
)
from dmlkit.training.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")

NAMES = ["ant", "bee", "cat", "dog", "eel", "fox", "gnu", "hen", "ibis", "jay"]


def make_folder(root: Path, sizes: dict[str, int] | None = None) -> Path:
    """A new user's image folder: 10 classes of 16 x 16 grayscale PNGs (6 each unless ``sizes``)."""
    rng = np.random.default_rng(0)
    for i, name in enumerate(NAMES):
        d = root / name
        d.mkdir(parents=True)
        centre = rng.integers(40, 215)
        for j in range((sizes or {}).get(name, 6)):
            img = np.clip(centre + rng.normal(0, 25, (16, 16)), 0, 255).astype(np.uint8)
            Image.fromarray(img, mode="L").save(d / f"{i}_{j}.png")
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_folder(tmp_path_factory.mktemp("data") / "animals")


def user_config(root: Path | None, **sections) -> dict:
    """What a new user writes: the defaults of the Reality Check (8 classes x 4 per batch)."""
    config = {"name": "mine", "seed": 0,
              "data": {"dataset": "image_folder", "transform": "grayscale", "image_size": 16,
                       "split": {"val_fraction": 0.2}},
              **tiny_sections(),
              "training": {"epochs": 1, "device": "cpu"}}
    if root is not None:
        config["data"]["root"] = str(root)
    for key, value in sections.items():
        config[key] = value
    return config


def _run(capsys, *args: str) -> tuple[int, str]:
    code, out, err = run_cli(capsys, *args)
    return code, out + err


def _fixes(text: str) -> list[str]:
    """The ``--set key=value`` pairs of an error's "all fixes together" line."""
    line = next(ln for ln in text.splitlines() if ln.startswith("all fixes together"))
    return re.findall(r"--set (\S+)", line)


# -- the whole config at once ------------------------------------------------------------------
def test_every_violation_comes_in_one_error_with_fitting_values(folder):
    cfg = config_from_dict(user_config(folder, loss={"name": "triplet", "cross_batch_memory": 4},
                                       sampler={"classes_per_batch": 8, "samples_per_class": 4}))
    with pytest.raises(PreflightError) as info:
        preflight(cfg)
    err = info.value
    keys = {p.key: p for p in err.problems}
    # 10 classes: 5 train / 5 test by default; val_fraction 0.2 carves 1 validation class
    assert set(keys) == {"data.split.val_fraction", "sampler.classes_per_batch", "loss.cross_batch_memory"}
    assert all(p.has_fit for p in err.problems)
    text = str(err)
    assert str(folder) in text and "10 classes" in text and "ant" in text  # the root and classes found
    assert "--set sampler.classes_per_batch=3" in text  # 2 of the 5 training classes go to validation
    # the fitting values work together: applied at once, the config fits
    fixed = cfg.override(_fixes(text))
    check = preflight(fixed)
    assert not check.errors
    assert len(check.split.val) >= 2 and len(check.split.train) >= fixed.sampler.classes_per_batch
    assert fixed.loss.cross_batch_memory >= fixed.sampler.batch_size


def test_names_channels_and_metrics_are_checked_before_anything_runs(folder, tmp_path):
    """An unknown loss or miner is reported under its name (it was under `.params`), a model
    whose input channels differ from the transform's images is one line with the fitting value
    (it was a traceback at the first step, after the baseline), and an unknown metric is refused
    when the config is read (a bench ran its whole search before finding it)."""
    from dmlkit.protocol.config import load_bench_config

    cfg = config_from_dict(user_config(folder, loss={"name": "tripplet"}, miner={"name": "bh"}))
    cfg = cfg.override(["model.in_channels=3"])
    with pytest.raises(PreflightError) as info:
        preflight(cfg)
    keys = {p.key: p for p in info.value.problems}
    assert {"loss.name", "miner.name", "model.in_channels"} <= set(keys)
    assert "'tripplet' is unknown" in str(keys["loss.name"]) and "--set model.in_channels=1" in str(info.value)
    # the model's names and files too, before anything is built or written
    bad = cfg.override(["model.trunk=resnet5", "data.transform=grey", "model.weights=/nonexistent.pth"])
    with pytest.raises(PreflightError) as info:
        preflight(bad)
    assert {"model.trunk", "data.transform", "model.weights"} <= {p.key for p in info.value.problems}
    # options the trunk refuses, found by a shapes-only build (nothing allocated or downloaded)
    for trunk in ("small_cnn", "resnet18"):
        bad = cfg.override([f"model.trunk={trunk}", "model.trunk_options={width: 3}"])
        with pytest.raises(PreflightError) as info:
            preflight(bad)
        problem = {p.key: p.message for p in info.value.problems}["model.trunk_options"]
        assert "unexpected keyword argument 'width'" in problem, problem
    good = cfg.override(["model.trunk=resnet18", "model.trunk_options={zero_init_residual: true}"])
    assert model_setting_problems(good) == []
    with pytest.raises(ConfigError, match="training.eval_metrics: unknown metric 'bogus'"):
        config_from_dict(user_config(folder, training={"eval_metrics": ["bogus"]}))
    bench = tmp_path / "bench.yaml"
    bench.write_text(yaml.safe_dump({"name": "b", "fixed": {"data": {"dataset": "image_folder"}},
                                     "protocol": {"metrics": ["bogus_metric"]},
                                     "methods": [{"name": "c", "loss": {"name": "contrastive"}}]}))
    with pytest.raises(ConfigError, match="protocol.metrics: unknown metric 'bogus_metric'"):
        load_bench_config(bench)


def test_cli_reports_everything_then_the_corrected_config_trains(folder, tmp_path, capsys):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(user_config(folder)))
    run = tmp_path / "run"
    code, text = _run(capsys, "train", str(path), "--run-dir", str(run), "--quiet")
    assert code == 2 and "Traceback" not in text
    assert "data.split.val_fraction" in text and "sampler.classes_per_batch" in text
    assert not run.exists(), "a refused run must not create its run directory"
    sets = [a for f in _fixes(text) for a in ("--set", f)]
    code, text = _run(capsys, "train", str(path), "--run-dir", str(run), "--quiet", *sets)
    assert code == 0, text
    metrics = json.loads((run / "metrics.json").read_text())
    assert math.isfinite(metrics["val"]["map_at_r"]) and math.isfinite(metrics["test"]["map_at_r"])
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["root"] == str(folder)
    # the split records its classes' names: a folder added since (ids follow the sorted folder
    # names) is refused, where `embed` used to embed other classes under the run's ids
    import shutil

    moved = tmp_path / "moved"
    shutil.copytree(folder, moved)
    shutil.copytree(moved / "ant", moved / "aardvark")  # sorts first: every id shifts by one
    code, text = _run(capsys, "embed", str(run), "--data-root", str(moved), "-o", str(tmp_path / "e.npz"))
    assert code == 2 and "the data changed since the split was made" in text, text
    assert not (tmp_path / "e.npz").exists()
    code, text = _run(capsys, "embed", str(run), "-o", str(tmp_path / "e.npz"))
    assert code == 0, text


# -- evaluation splits ----------------------------------------------------------------------
def test_eval_split_problems():
    assert [p.severity for p in eval_split_problems([3, 3, 3], "validation", "k")] == ["error"]
    assert "100 %" in eval_split_problems([3, 3, 3], "validation", "k")[0].message
    nan = eval_split_problems([1, 2, 3], "test", "k")
    assert [p.severity for p in nan] == ["error"] and "NaN" in nan[0].message
    some = eval_split_problems([1, 1, 2, 2, 3], "test", "k", names={3: "jay"})
    assert [p.severity for p in some] == ["warning"] and "jay" in some[0].message
    assert eval_split_problems([1, 1, 2, 2], "test", "k") == []


def test_one_image_classes_in_validation_are_refused_up_front(tmp_path):
    # every validation class (the last 2 of the 5 training classes) has one image
    root = make_folder(tmp_path / "f", {"dog": 1, "eel": 1})
    cfg = config_from_dict(user_config(root, sampler={"classes_per_batch": 3, "samples_per_class": 2},
                                       data={"dataset": "image_folder", "root": str(root),
                                             "transform": "grayscale", "image_size": 16,
                                             "split": {"val_fraction": 0.4}}))
    with pytest.raises(PreflightError, match="NaN") as info:
        preflight(cfg)
    assert "--set data.split.val_fraction=0" in str(info.value)


def test_singleton_test_classes_warn_but_the_run_goes_on(tmp_path):
    root = make_folder(tmp_path / "f", {"jay": 1})
    cfg = config_from_dict(user_config(root, sampler={"classes_per_batch": 3, "samples_per_class": 2},
                                       data={"dataset": "image_folder", "root": str(root),
                                             "transform": "grayscale", "split": {"val_fraction": 0.4}}))
    with pytest.warns(PreflightWarning, match="jay"):
        check = preflight(cfg)
    assert not check.errors


def test_the_trainer_refuses_degenerate_validation_sets(folder):
    ds = load_dataset("image_folder", root=folder)
    train_set = ds.subset_classes([0, 1, 2])
    with pytest.raises(PreflightError, match="one class"):
        check_class_sets(train_set, ds.subset_classes([5]))
    singles = ds.subset([int(np.flatnonzero(ds.labels == c)[0]) for c in (5, 6, 7)])
    with pytest.raises(PreflightError, match="NaN"):
        check_class_sets(train_set, singles)
    classes, val = check_class_sets(train_set, ds.subset_classes([5, 6]))
    assert classes.tolist() == [0, 1, 2] and val is not None


def test_nan_validation_never_selects_a_model(folder, tmp_path, monkeypatch):
    ds = load_dataset("image_folder", root=folder, mode="L")
    from dmlkit.data import get_transforms

    t = get_transforms("grayscale", train=False, image_size=16)
    train_set, val_set = ds.subset_classes([0, 1, 2, 3]).with_transform(t), ds.subset_classes([5, 6]).with_transform(t)
    nan = {"precision_at_1": float("nan"), "r_precision": float("nan"), "map_at_r": float("nan")}
    monkeypatch.setattr(Trainer, "val_metrics", lambda self: dict(nan))
    cfg = user_config(None, sampler={"classes_per_batch": 2, "samples_per_class": 2, "batches_per_epoch": 2},
                      training={"epochs": 2, "device": "cpu"})
    with pytest.warns(UserWarning, match="no model was selected"):
        result = train(cfg, tmp_path / "run", train_set=train_set, val_set=val_set, progress=False)
    assert result.best_step == result.steps == 4  # the last model, said so; never step 0 on NaN
    text = (tmp_path / "run" / "metrics.json").read_text()
    metrics = json.loads(text, parse_constant=lambda c: pytest.fail(f"metrics.json holds {c}"))
    assert metrics["best_step"] == 4 and metrics["val"] == {}


# -- the class split and the batches ------------------------------------------------------------
def test_ratio_split_fit(folder):
    ds = load_dataset("image_folder", root=folder)
    cfg = config_from_dict(user_config(folder, data={"dataset": "image_folder", "root": str(folder),
                                                     "split": {"kind": "ratio", "ratios": [4, 1, 5]}}))
    split, problems, note = plan_split(cfg.data, ds)
    (problem,) = problems
    assert problem.key == "data.split.ratios" and sum(problem.fit) == 10
    assert len(split.train) >= 2 and len(split.val) >= 2 and len(split.test) >= 2
    assert "--set data.split.ratios=[" in problem.fix and " " not in problem.fix.split("=", 1)[1]


def test_batch_problems_each_fit():
    stats = TrainStats(num_classes=6, num_items=60, min_class_size=3)

    def problems(**kw):
        loss = kw.pop("loss", {"name": "triplet"})
        cfg = config_from_dict(user_config(None, loss=loss, sampler=kw.pop("sampler")))
        return {p.key: p for p in batch_problems(cfg, stats, **kw)}

    p = problems(sampler={"classes_per_batch": 8, "samples_per_class": 1})
    assert p["sampler.classes_per_batch"].fit == 6 and p["sampler.samples_per_class"].fit == 2
    p = problems(sampler={"classes_per_batch": 5, "samples_per_class": 4}, world_size=3)
    fit = p["sampler.classes_per_batch"].fit
    assert (fit * 4) % 3 == 0 and 2 <= fit <= 5
    assert p["sampler.samples_per_class"].severity == "warning"  # smallest class has 3 items
    p = problems(sampler={"classes_per_batch": 2, "samples_per_class": 3},
                 loss={"name": "prototypical", "params": {"k_shot": 3}})
    assert p["loss.params.k_shot"].fit == 2
    p = problems(sampler={"classes_per_batch": 2, "samples_per_class": 2},
                 loss={"name": "margin", "params": {"num_classes": 4}})
    assert p["loss.params.num_classes"].fit == "auto"
    # a classification loss needs neither a positive nor a negative pair in a batch
    assert problems(sampler={"classes_per_batch": 1, "samples_per_class": 1},
                    loss={"name": "normalized_softmax"}) == {}


# -- the data root ----------------------------------------------------------------------------
def test_data_root_conflict_is_refused(folder, tmp_path, capsys):
    assert merge_data_root(None, folder) == str(folder)
    assert merge_data_root(str(folder), None) == str(folder)
    assert merge_data_root(str(folder), folder / "." ) == str(folder)  # the same folder: fine
    cfg = config_from_dict(user_config(folder))
    assert with_data_root(cfg, folder) is cfg
    other = tmp_path / "elsewhere"
    with pytest.raises(ConfigError, match="different folders"):
        train(cfg, tmp_path / "py", data_root=other)
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(user_config(folder)))
    code, text = _run(capsys, "train", str(path), "--run-dir", str(tmp_path / "run"), "--data-root", str(other))
    flat = " ".join(text.split())
    assert code == 2 and str(other) in flat and f"--set data.root={other}" in flat
    assert not (tmp_path / "run").exists() and not (tmp_path / "py").exists()


def test_a_split_without_validation_warns_with_a_val_fraction_that_fits(tmp_path):
    """The warning's fix must be one the preflight then accepts (a fixed 0.1 gave one
    validation class on a small folder, which the next run refused)."""
    root = make_folder(tmp_path / "f", {c: 6 for c in "abcdefghijkl"})  # 12 classes, 6 for training
    data = {"dataset": "image_folder", "root": str(root), "transform": "grayscale", "image_size": 16,
            "split": {"kind": "ratio", "ratios": [1, 0, 1]}}
    cfg = config_from_dict(user_config(root, sampler={"classes_per_batch": 2, "samples_per_class": 2}, data=data))
    with pytest.warns(PreflightWarning, match="no validation classes") as caught:
        check = preflight(cfg)
    assert not check.errors
    (warning,) = [p for p in check.warnings if p.key == "data.split.val_fraction"]
    fixed = config_from_dict(user_config(root, sampler={"classes_per_batch": 2, "samples_per_class": 2},
                                         data={**data, "split": {**data["split"], "val_fraction": warning.fit}}))
    refit = preflight(fixed, emit_warnings=False)
    assert not refit.errors and len(refit.split.val) >= 2
    assert f"--set data.split.val_fraction={warning.fit}" in str(caught[0].message)


def test_query_gallery_groups_in_the_test_split_are_pointed_out(tmp_path):
    """A CSV marking test images query/gallery trained and reported leave-one-out test metrics
    over both without a word (61.4 MAP@R against 58.0 query -> gallery)."""
    from dmlkit.training.preflight import check_experiment

    root = make_folder(tmp_path / "f")
    rows = ["path,label,split"]
    for c, name in enumerate(NAMES):
        for j, image in enumerate(sorted((root / name).iterdir())):
            role = "train" if c < 7 else ("query" if j < 2 else "gallery")
            rows.append(f"{name}/{image.name},{name},{role}")
    (root / "list.csv").write_text("\n".join(rows) + "\n")
    cfg = config_from_dict(user_config(None, data={"dataset": "csv", "root": str(root / "list.csv"),
                                                   "transform": "grayscale", "image_size": 16}))
    ds = load_dataset("csv", root=root / "list.csv")
    report = check_experiment(cfg, ds)
    warned = [p for p in report.problems if p.key == "data.dataset"]
    assert warned and warned[0].severity == "warning" and "dmlkit reid" in warned[0].message
    plain = check_experiment(config_from_dict(user_config(root)), load_dataset("image_folder", root=root))
    assert not [p for p in plain.problems if p.key == "data.dataset"]
