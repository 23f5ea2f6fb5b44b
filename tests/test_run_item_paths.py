"""A run's embeddings files record the files they embedded (``paths``, relative to the data
root), so ``dmlkit index``/``query`` name those files, and refuse data changed since: a photo
added to the last class folder, or a file renamed inside a class (same count, same class
order), shifted the run's rows onto other files with exit 0 and no warning."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

from _reference import (
    FOLDER_CLASSES,
    FOLDER_TEST_FILES,
    four_class_folder,
    one_step_run,
)
from dmlkit.apps.index import item_ids
from dmlkit.embeddings import save_embeddings
from dmlkit.exceptions import DataError
from dmlkit.training.trainer import embed_run

pytestmark = pytest.mark.usefixtures("one_thread")

CLASSES, TEST_FILES = FOLDER_CLASSES, FOLDER_TEST_FILES


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, Path]:
    """A one-step run trained on the folder: ``(run_dir, data folder)``."""
    base = tmp_path_factory.mktemp("shift")
    data = four_class_folder(base / "data")
    return one_step_run("shift", "image_folder", base / "run", data), data


def _ids(run_dir: Path, data: Path):
    emb = run_dir / "embeddings" / "test.npz"
    with np.load(emb) as z:
        return item_ids(emb, dict(z), data, z["labels"])


def _copy(run: tuple[Path, Path], tmp_path: Path) -> Path:
    """A copy of the run's data (the tests change it, the run keeps its own)."""
    return Path(shutil.copytree(run[1], tmp_path / "data"))


def test_a_runs_test_embeddings_record_the_files_they_embedded(run, tmp_path):
    with np.load(run[0] / "embeddings" / "test.npz") as z:
        assert z["paths"].tolist() == TEST_FILES
    # another checkpoint embedded with `dmlkit embed` records them too
    embed_run(run[0] / "checkpoints" / "last.pt", output=tmp_path / "last.npz")
    with np.load(tmp_path / "last.npz") as z:
        assert z["paths"].tolist() == TEST_FILES


def test_item_ids_of_unchanged_data_are_the_embedded_files(run, tmp_path):
    data = _copy(run, tmp_path)  # a copy under another root: the relative paths are the ids
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: the ids were checked
        ids, facts = _ids(run[0], data)
    assert ids.tolist() == TEST_FILES
    assert facts["data_root"] == str(data.resolve())


def test_item_ids_refuse_a_photo_added_to_the_last_class(run, tmp_path):
    data = _copy(run, tmp_path)
    shutil.copy(data / "d_rocket" / "img0.png", data / "d_rocket" / "img-new.png")  # sorts first
    with pytest.raises(DataError, match=r"changed since it was embedded \(row 3 was d_rocket/img0\.png and is "
                                        r"d_rocket/img-new\.png; 3 of its 6 rows differ\).*dmlkit embed"):
        _ids(run[0], data)


def test_item_ids_refuse_a_file_renamed_inside_a_class(run, tmp_path):
    data = _copy(run, tmp_path)
    (data / "c_coffee" / "img0.png").rename(data / "c_coffee" / "img9.png")  # same count, same class
    with pytest.raises(DataError, match=r"row 0 was c_coffee/img0\.png and is c_coffee/img1\.png; 3 of its 6 rows"):
        _ids(run[0], data)


def test_item_ids_without_the_data_are_the_embedded_files(run, tmp_path):
    ids, facts = _ids(run[0], tmp_path / "absent")
    assert ids.tolist() == TEST_FILES and "data_root" in facts


def test_item_ids_of_a_file_without_paths_warn_that_they_cannot_be_checked(run, tmp_path):
    data = _copy(run, tmp_path)
    old = tmp_path / "old"
    shutil.copytree(run[0], old)
    with np.load(old / "embeddings" / "test.npz") as z:  # as an older dmlkit wrote it
        save_embeddings(old / "embeddings" / "test.npz", z["embeddings"], z["labels"], indices=z["indices"])
    (data / "c_coffee" / "img0.png").rename(data / "c_coffee" / "img9.png")
    with pytest.warns(UserWarning, match="does not record the files it embedded") as record:
        ids, _ = _ids(old, data)
    assert len(record) == 1 and ids.tolist()[0] == "c_coffee/img1.png"  # today's behaviour, not checked


def test_index_and_query_refuse_a_run_whose_data_changed(run, tmp_path, run_cli):
    data = _copy(run, tmp_path)
    emb = run[0] / "embeddings" / "test.npz"
    code, _, err = run_cli(["index", str(emb), "-o", str(tmp_path / "ok.npz"), "--data-root", str(data)])
    assert code == 0, err
    (data / "d_rocket" / "img0.png").rename(data / "d_rocket" / "img7.png")
    code, _, err = run_cli(["index", str(emb), "-o", str(tmp_path / "bad.npz"), "--data-root", str(data)])
    assert code == 2 and "row 3 was d_rocket/img0.png and is d_rocket/img1.png" in err
    assert not (tmp_path / "bad.npz").exists()
    # the query file's ids (--exclude-self, the ids shown) go through the same check
    code, _, err = run_cli(["query", str(tmp_path / "ok.npz"), str(emb), "--exclude-self", "--data-root", str(data)])
    assert code == 2 and "changed since it was embedded" in err and "Traceback" not in err
