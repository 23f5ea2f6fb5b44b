"""Files of different runs or datasets are not combined silently: a run's embeddings file records
each row's file size, an index the run and data its vectors come from, ``dmlkit verify
--json`` what its threshold was chosen on; ``query``, ``index --add``, ``index``/``verify`` on
another data root and ``serve --verification`` compare them where files meet.

Before, the same ids and the same dimension were all that was checked: another run's (another
model's) queries, items and thresholds were taken as the index's, and other images under the
same names as the embedded ones, each with exit 0 and no warning."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from _reference import (
    FOLDER_CLASSES,
    FOLDER_TEST_FILES,
    four_class_folder,
    one_step_run,
)
from dmlkit.apps.service import ServiceConfig, create_app
from dmlkit.embeddings import save_embeddings
from dmlkit.exceptions import DataError
from dmlkit.training.trainer import embed_run

pytestmark = pytest.mark.usefixtures("one_thread")

CLASSES, TEST_FILES = FOLDER_CLASSES, FOLDER_TEST_FILES


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Runs A and B (seeds 0 and 1) trained on one folder, that folder, and a copy of it whose
    test images were replaced by other images under the same names (other file sizes)."""
    base = tmp_path_factory.mktemp("mixed")
    data = four_class_folder(base / "data")
    other = Path(shutil.copytree(data, base / "other"))
    for name in TEST_FILES:  # flat grey: another image, a much smaller file
        Image.fromarray(np.full((16, 16), 90, np.uint8), mode="L").save(other / name)
    out = {"data": data, "other": other}
    for name, seed in (("A", 0), ("B", 1)):
        out[name] = one_step_run(f"mixed{name}", "image_folder", base / f"run{name}", data, seed)
    return out


def _test(run: Path) -> str:
    return str(run / "embeddings" / "test.npz")


def _index(run_cli, tmp_path: Path, runs: dict[str, Path]) -> str:
    """An index of run A's test embeddings."""
    code, _, err = run_cli(["index", _test(runs["A"]), "-o", str(tmp_path / "idxA")])
    assert code == 0, err
    return str(tmp_path / "idxA")


def _lone_copy(runs: dict[str, Path], tmp_path: Path) -> str:
    """Run B's test embeddings outside any run: ids (paths) and vectors, no run to compare."""
    return str(Path(shutil.copy(_test(runs["B"]), tmp_path / "loneB.npz")))


# -- finding 8: each row's file size, compared where another data root is given ------------------
def test_a_runs_embeddings_record_each_rows_file_size(runs):
    with np.load(_test(runs["A"])) as z:
        assert z["paths"].tolist() == TEST_FILES
        assert z["file_sizes"].tolist() == [(runs["data"] / name).stat().st_size for name in TEST_FILES]


def test_index_and_verify_refuse_other_images_under_the_same_names(runs, tmp_path, run_cli):
    """``index --data-root OTHER`` named run A's vectors by OTHER's images, and ``verify
    --images OTHER`` scored them as OTHER's, because only the file names were compared."""
    code, _, err = run_cli(["index", _test(runs["A"]), "-o", str(tmp_path / "bad"), "--data-root", str(runs["other"])])
    assert code == 2 and "changed since it was embedded (row 0, c_coffee/img0.png, held" in err, err
    assert "other images under the same names; 6 of its 6 rows differ" in err
    assert not (tmp_path / "bad").exists()
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("".join(f"{a},{b},{int(a[:8] == b[:8])}\n" for i, a in enumerate(TEST_FILES)
                             for b in TEST_FILES[i + 1:]))
    code, _, err = run_cli(["verify", _test(runs["A"]), "--pair-list", str(pairs), "--images", str(runs["other"]),
                            "--folds", "2", "--json"])
    assert code == 2 and "c_coffee/img0.png holds" in err and "(6 of its 6 files differ)" in err, err
    copy = shutil.copytree(runs["data"], tmp_path / "copy")  # the same images elsewhere: accepted
    code, out, err = run_cli(["verify", _test(runs["A"]), "--pair-list", str(pairs), "--images", str(copy),
                              "--folds", "2", "--json"])
    assert code == 0, err
    assert json.loads(out)["num_pairs"] == 15
    # rows sliced or reordered (a gallery cut from the file) keep their sizes: still accepted
    with np.load(_test(runs["A"])) as z:
        rows = np.array([5, 0, 3])
        save_embeddings(runs["A"] / "embeddings" / "cut.npz", z["embeddings"][rows], z["labels"][rows],
                        **{k: z[k][rows] for k in ("indices", "paths", "file_sizes")})
    code, _, err = run_cli(["index", str(runs["A"] / "embeddings" / "cut.npz"), "-o", str(tmp_path / "cut")])
    assert code == 0, err


# -- finding 4: query embeddings of another run, or of other images under the indexed ids --------
def test_query_refuses_another_runs_embeddings(runs, tmp_path, run_cli):
    idx = _index(run_cli, tmp_path, runs)
    code, _, err = run_cli(["query", idx, _test(runs["B"]), "-k", "2", "--exclude-self", "--json"])
    assert code == 2 and err.count("\n") == 1, err
    assert f"holds embeddings of the run {runs['B'].resolve()}, not {runs['A'].resolve()}" in err
    assert "--allow-other-source" in err
    code, out, err = run_cli(["query", idx, _test(runs["B"]), "-k", "2", "--json", "--allow-other-source"])
    assert code == 0 and len(json.loads(out)) == 6, err
    # without a run to compare (a copy of the file elsewhere), the indexed ids' vectors are: serve's test
    code, _, err = run_cli(["query", idx, _lone_copy(runs, tmp_path), "-k", "2", "--exclude-self"])
    assert code == 2 and "6 of its 6 items with an indexed id lie more than 1% from the index's vector" in err, err
    code, out, err = run_cli(["query", idx, _test(runs["A"]), "-k", "2", "--exclude-self", "--json"])  # its own
    assert code == 0 and json.loads(out)[0]["query"] == TEST_FILES[0], err


def test_query_takes_the_runs_embeddings_under_a_moved_copy_of_the_data(runs, tmp_path, run_cli):
    """A data root in another folder holding the same files is the same data (sizes checked)."""
    idx = _index(run_cli, tmp_path, runs)
    copy = shutil.copytree(runs["data"], tmp_path / "copy")
    code, out, err = run_cli(["query", idx, _test(runs["A"]), "--data-root", str(copy), "--json"])
    assert code == 0 and len(json.loads(out)) == 6, err


# -- finding 5: index --add of another run's (or another data root's) embeddings -----------------
def test_index_add_refuses_another_runs_embeddings(runs, tmp_path, run_cli):
    idx = _index(run_cli, tmp_path, runs)
    # run B's training items: ids the index does not hold, in run B's embedding space
    added = str(embed_run(runs["B"] / "checkpoints" / "best.pt", "train",
                          output=runs["B"] / "embeddings" / "train-add.npz")[0])
    code, _, err = run_cli(["index", added, "-o", idx, "--add"])
    assert code == 2 and f"the run {runs['B'].resolve()}, not {runs['A'].resolve()}" in err, err
    assert "would be mixed into one index" in err and "--allow-other-source" in err
    assert json.loads((Path(idx) / "index.json").read_text())["count"] == 6  # nothing added
    code, out, err = run_cli(["index", added, "-o", idx, "--add", "--allow-other-source"])
    assert code == 0 and "added 6 item(s)" in out, err
    # ids the index holds, with another model's vectors: said as such, not as mere duplicates
    code, _, err = run_cli(["index", _lone_copy(runs, tmp_path), "-o", idx, "--add"])
    assert code == 2 and "lie more than 1% from the index's vector of that id" in err, err
    code, _, err = run_cli(["index", _test(runs["A"]), "-o", str(tmp_path / "x"), "--allow-other-source"])
    assert code == 2 and "--allow-other-source applies to --add" in err


# -- finding 7: serve --verification of a threshold chosen on another run ------------------------
def test_serve_refuses_a_threshold_chosen_on_another_runs_embeddings(runs, tmp_path, run_cli):
    idx = _index(run_cli, tmp_path, runs)
    files = {}
    for name in ("A", "B"):
        code, out, err = run_cli(["verify", _test(runs[name]), "--pairs", "20", "--folds", "2", "--json"])
        assert code == 0, err
        files[name] = tmp_path / f"verify{name}.json"
        files[name].write_text(out)
    source = json.loads(files["B"].read_text())["source"]
    assert source["run_dir"] == str(runs["B"].resolve()) and len(source["sha256"]) == 64
    with pytest.raises(DataError, match=r"verifyB\.json: its threshold was chosen on embeddings of the run .*runB, "
                                        r"not .*runA \(the index's\).*--threshold"):
        create_app(ServiceConfig(index=idx, verification=files["B"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the index's own run: accepted without a word
        create_app(ServiceConfig(index=idx, verification=files["A"]))
    old = tmp_path / "old.json"  # written before the source was recorded: accepted, with a warning
    old.write_text(json.dumps({k: v for k, v in json.loads(files["B"].read_text()).items() if k != "source"}))
    with pytest.warns(UserWarning, match="does not record which embeddings its threshold was chosen on"):
        create_app(ServiceConfig(index=idx, verification=old))
