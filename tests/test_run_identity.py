"""A run directory's data, checkpoints and outputs stay one run's (dmlkit.training.run_identity).

* ``train --resume`` with ``data.root`` at other data was accepted: ``split.json`` was
  rewritten, the next epochs trained on the other data and ``metrics.json`` mixed the two. It
  now applies the run's own ``split.json`` (its class names checked) and compares the data with
  the fingerprints recorded there; a moved identical copy still resumes.
* ``dmlkit embed RUN --data-root OTHER`` (same class names, other images) silently replaced
  ``RUN/embeddings/test.npz``; embeddings of other data are now refused inside the run (``-o``
  elsewhere is fine), and a moved identical copy is embedded as before.
* ``dmlkit embed``/``report`` of a run whose ``best.pt`` came from another run (or another
  step than ``metrics.json``'s best) used it without a word: ``embed`` refuses it naming the
  differing key, ``report`` draws no model-based figure and says why.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from _reference import grey_image_folder, one_error_line, tiny_image_folder_config
from dmlkit.config import load_config
from dmlkit.exceptions import DataError
from dmlkit.report import ReportOptions, build_report
from dmlkit.training import train

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(root: Path, seed: int = 3) -> dict:
    """The tiny image-folder run (4 train / 2 val / 6 test classes) on ``root``."""
    config = tiny_image_folder_config("identity", 0.25)
    config["seed"] = seed
    config["data"]["root"] = str(root)
    return config


def _snapshot(run: Path) -> dict[str, bytes]:
    """The bytes of the files a refused command must leave as they were."""
    names = ("split.json", "metrics.json", "config.yaml", "embeddings/test.npz", "checkpoints/last.pt")
    return {name: (run / name).read_bytes() for name in names}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Two runs on one folder of 12 classes (seeds 3 and 4), that folder, a moved copy of it,
    and a copy whose test-class images were replaced by others (same names, other sizes)."""
    base = tmp_path_factory.mktemp("identity")
    data = grey_image_folder(base / "data", classes=12)
    moved = Path(shutil.copytree(data, base / "elsewhere" / "data"))
    other = Path(shutil.copytree(data, base / "other"))
    rng = np.random.default_rng(5)
    for c in range(6, 12):  # the test classes: other images under the same names
        for i in range(4):
            Image.fromarray(rng.integers(0, 256, (12, 12), dtype=np.uint8), "L").save(other / f"class{c:02d}" / f"{i}.png")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # two steps may not beat the untrained model
        for name, seed in (("runA", 3), ("runB", 4)):
            train(_config(data, seed), base / name, progress=False)
    return {"A": base / "runA", "B": base / "runB", "data": data, "moved": moved, "other": other,
            "base": base}


def _refused(run_cli, *args: str) -> str:
    """The one error line of a refused ``dmlkit ARGS``."""
    code, _, err = run_cli(list(args))
    return one_error_line(code, err)


def _copy(runs: dict[str, Path], name: str) -> Path:
    run = runs["base"] / name
    shutil.rmtree(run, ignore_errors=True)
    return Path(shutil.copytree(runs["A"], run))


def test_split_json_records_the_fingerprints_of_the_data(runs):
    meta = json.loads((runs["A"] / "split.json").read_text())["meta"]
    assert set(meta["fingerprints"]) == {"train", "val", "test"}
    assert meta["fingerprints"]["test"]["samples"] == 24 and meta["fingerprints"]["test"]["classes"] == 6


def test_a_resume_on_other_images_is_refused_and_leaves_the_run(runs):
    run = _copy(runs, "resume_other")
    before = _snapshot(run)
    config = load_config(run / "config.yaml", ["training.epochs=2", f"data.root={runs['other']}"])
    with pytest.raises(DataError, match=r"cannot resume .*not those the run was trained on \(test split: "
                                        r"24 samples of 6 classes \(fingerprint .*a moved copy is fine"):
        train(config, run, resume=True, progress=False)
    assert _snapshot(run) == before


def test_a_resume_on_data_that_names_the_classes_otherwise_is_refused(runs):
    run = _copy(runs, "resume_renamed")
    renamed = runs["base"] / "renamed"
    shutil.rmtree(renamed, ignore_errors=True)
    for folder in sorted(runs["data"].iterdir()):  # the same images under other class names
        shutil.copytree(folder, renamed / folder.name.replace("class", "animal"))
    before = _snapshot(run)
    config = load_config(run / "config.yaml", ["training.epochs=2", f"data.root={renamed}"])
    with pytest.raises(DataError, match="class id.s. of the split name other classes"):
        train(config, run, resume=True, progress=False)
    assert _snapshot(run) == before


def test_a_resume_on_a_moved_copy_of_the_data_goes_on(runs):
    run = _copy(runs, "resume_moved")
    split = (run / "split.json").read_bytes()
    config = load_config(run / "config.yaml", ["training.epochs=2", f"data.root={runs['moved']}"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = train(config, run, resume=True, progress=False)
    assert result.epochs_completed == 2
    assert (run / "split.json").read_bytes() == split
    assert load_config(run / "config.yaml").data.root == str(runs["moved"])


def test_embed_of_other_data_into_the_run_is_refused(runs, run_cli):
    run = _copy(runs, "embed_other")
    before = _snapshot(run)
    for extra in ([], ["--format", "shards"]):
        line = _refused(run_cli, "embed", str(run), "--data-root", str(runs["other"]), "--quiet", *extra)
        assert "not the data" in line and "test split: 24 samples of 6 classes" in line and "-o" in line
    assert _snapshot(run) == before and not (run / "embeddings" / "test-shards").exists()
    elsewhere = runs["base"] / "other_test.npz"  # outside the run: these data may be embedded
    code, out, err = run_cli(["embed", str(run), "--data-root", str(runs["other"]), "-o", str(elsewhere), "--quiet"])
    assert code == 0, err
    assert elsewhere.is_file() and _snapshot(run) == before


def test_embed_of_a_moved_copy_of_the_data_writes_the_same_embeddings(runs, run_cli):
    run = _copy(runs, "embed_moved")
    saved = np.load(run / "embeddings" / "test.npz")["embeddings"]
    code, out, err = run_cli(["embed", str(run), "--data-root", str(runs["moved"]), "--quiet"])
    assert code == 0, err
    np.testing.assert_allclose(np.load(run / "embeddings" / "test.npz")["embeddings"], saved, rtol=1e-5, atol=1e-6)


def _with_checkpoints_of_run_b(runs: dict[str, Path], name: str) -> Path:
    run = _copy(runs, name)
    for file in ("best.pt", "last.pt"):
        shutil.copy(runs["B"] / "checkpoints" / file, run / "checkpoints" / file)
    return run


def test_embed_refuses_a_checkpoint_of_another_run(runs, run_cli):
    run = _with_checkpoints_of_run_b(runs, "embed_mixed")
    saved = (run / "embeddings" / "test.npz").read_bytes()
    line = _refused(run_cli, "embed", str(run), "-o", str(runs["base"] / "mixed.npz"), "--quiet")
    assert "is not a checkpoint of the run" in line and "seed (4 -> 3)" in line
    assert (run / "embeddings" / "test.npz").read_bytes() == saved


def test_embed_refuses_a_best_checkpoint_of_another_step_than_metrics_json(runs, run_cli):
    run = _copy(runs, "embed_step")
    metrics = json.loads((run / "metrics.json").read_text())
    metrics["best_step"] += 1  # metrics.json of another attempt than best.pt
    (run / "metrics.json").write_text(json.dumps(metrics))
    line = _refused(run_cli, "embed", str(run), "-o", str(runs["base"] / "step.npz"), "--quiet")
    assert f"describes the best model of step {metrics['best_step']}" in line


def _notes(html: str) -> str:
    """The report's Notes section (before its next section)."""
    start = html.index('<h2 id="notes">')
    return html[start:html.index("<h2", start + 1)]


def test_report_draws_no_model_of_another_run(runs):
    run = _with_checkpoints_of_run_b(runs, "report_mixed")
    with pytest.warns(UserWarning, match="is not a checkpoint of the run"):
        html = build_report(run, options=ReportOptions(maps=(), thumbnails=False)).read_text()
    notes = _notes(html)
    assert "is not a checkpoint of the run" in notes and "saved test embeddings only" in notes


def test_report_draws_no_model_on_other_data(runs):
    run = _copy(runs, "report_other")
    options = ReportOptions(maps=(), thumbnails=False, data_root=runs["other"])
    with pytest.warns(UserWarning, match="not those the run was trained on"):
        html = build_report(run, options=options).read_text()
    assert "not those the run was trained on" in _notes(html)
