"""Audit fixes in dmlkit's data handling: class-name labels of two embeddings files, a run's
rows mapped onto a changed dataset, CSV split columns and duplicate rows, empty class folders,
and a dataset whose every image is unreadable."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dmlkit.apps.index import item_ids
from dmlkit.data import ImageFileDataset, default_split, load_dataset
from dmlkit.embeddings import load_embeddings, save_embeddings
from dmlkit.exceptions import DataError, ShapeError
from dmlkit.metrics import evaluate


# -- 1. string labels of a query and a reference file share one class table --------------------
def _named_files(tmp_path):
    """A query file of classes b..e and a reference file of a..e, each item near its class centre:
    P@1 is 1.0 when the two files' labels are matched by name."""
    rng = np.random.default_rng(0)
    centre = {c: rng.normal(size=8) for c in "abcde"}
    ql, rl = np.array(list("bcde") * 5), np.array(list("abcde") * 5)
    q = np.stack([centre[c] + 0.01 * rng.normal(size=8) for c in ql])
    r = np.stack([centre[c] + 0.01 * rng.normal(size=8) for c in rl])
    np.savez(tmp_path / "q.npz", embeddings=q, labels=ql)  # names stored as strings
    save_embeddings(tmp_path / "r.npz", r, rl)  # names stored as codes + class_names
    return tmp_path / "q.npz", tmp_path / "r.npz", ql, rl


def test_load_embeddings_codes_a_second_file_against_the_first_files_class_names(tmp_path, run_cli):
    qpath, rpath, ql, rl = _named_files(tmp_path)
    q, qcodes, qextra = load_embeddings(qpath, codes=True)  # codes, as the reference
    r, rcodes, rextra = load_embeddings(rpath, class_names=qextra["class_names"])
    names = rextra["class_names"]
    assert names.tolist() == ["b", "c", "d", "e", "a"]  # the query's table, then the new name
    assert names[qcodes].tolist() == ql.tolist() and names[rcodes].tolist() == rl.tolist()
    api = evaluate(q, qcodes, r, rcodes, metrics=["precision_at_1"])["precision_at_1"]
    code, out, _ = run_cli(["evaluate", str(qpath), "--reference", str(rpath), "--json", "-m", "precision_at_1"])
    assert code == 0
    assert api == json.loads(out)["precision_at_1"] == 1.0


def test_load_embeddings_refuses_a_class_table_for_integer_labels_or_a_bad_table(tmp_path):
    save_embeddings(tmp_path / "ids.npz", np.eye(3), [0, 1, 2])
    with pytest.raises(ShapeError, match="class names"):
        load_embeddings(tmp_path / "ids.npz", class_names=["a", "b"])
    save_embeddings(tmp_path / "named.npz", np.eye(3), ["a", "b", "c"])
    with pytest.raises(ShapeError, match="twice"):
        load_embeddings(tmp_path / "named.npz", class_names=["a", "b", "a"])
    with pytest.raises(ShapeError, match="1-D"):
        load_embeddings(tmp_path / "named.npz", class_names=[["a", "b"]])


# -- image files for the dataset tests ----------------------------------------------------------
def _png(path: Path, value: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("L", (4, 4), value).save(path)
    return path


def _csv(tmp_path: Path, rows: list[str], header: str = "path,label,split") -> Path:
    for row in filter(None, rows):
        _png(tmp_path / row.split(",")[0])
    path = tmp_path / "items.csv"
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


# -- 3. a CSV split column without test (or train) rows is an error, not the half/half split -----
@pytest.mark.parametrize("values, lacking", [(("train", "val", "train", "val"), "'test'"),
                                             (("train", "train", "train", "train"), "'test'"),
                                             (("query", "gallery", "query", "gallery"), "'train'")])
def test_default_split_refuses_a_csv_split_column_without_test_or_train_rows(tmp_path, values, lacking):
    rows = [f"c{i}/{j}.png,c{i},{values[i]}" for i in range(4) for j in range(2)]
    ds = load_dataset("csv", root=_csv(tmp_path, rows))
    with pytest.raises(DataError, match=lacking) as info:
        default_split(ds)
    for value in set(values):  # the values the column holds are named
        assert repr(value) in str(info.value)


def test_default_split_still_reads_a_complete_csv_split_column(tmp_path):
    rows = [f"c{i}/0.png,c{i},{s}" for i, s in enumerate(("train", "train", "val", "test"))]
    split = default_split(load_dataset("csv", root=_csv(tmp_path, rows)))
    assert (list(split.train), list(split.val), list(split.test)) == ([0, 1], [2], [3])


# -- 4. a CSV listing the same image twice ------------------------------------------------------
def test_csv_refuses_the_same_image_listed_twice(tmp_path):
    rows = ["a/0.png,a", "a/1.png,a", "b/0.png,b", "./a/1.png,b"]  # line 5 names line 3's file
    with pytest.raises(DataError, match=r"line 5 lists '\./a/1\.png', the image of line 3 \('a/1\.png'\)"):
        load_dataset("csv", root=_csv(tmp_path, rows, header="path,label"))


def test_csv_duplicate_line_numbers_count_blank_lines(tmp_path):
    rows = ["a/0.png,a", "", "b/0.png,b", "a/0.png,a"]  # a blank line: the repeat is on line 5
    with pytest.raises(DataError, match=r"line 5.*line 2"):
        load_dataset("csv", root=_csv(tmp_path, rows, header="path,label"))


def test_csv_unlabelled_row_line_numbers_count_blank_lines(tmp_path):
    rows = ["a/0.png,a", "", "b/0.png,"]  # a blank line: the unlabelled row is on line 4
    with pytest.raises(DataError, match=r"1 row\(s\) have no label \(line\(s\) 4\)"):
        load_dataset("csv", root=_csv(tmp_path, rows, header="path,label"))


# -- 5. an empty class folder leaves no gap in the class ids -------------------------------------
def test_image_folder_skips_an_empty_class_folder_with_contiguous_ids(tmp_path):
    for cls in ("a", "c"):
        for j in range(2):
            _png(tmp_path / cls / f"{j}.png")
    (tmp_path / "b").mkdir()  # empty
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("no images here")
    with pytest.warns(UserWarning, match=r"2 class folder\(s\) without images.*'b', 'd'"):
        ds = load_dataset("image_folder", root=tmp_path)
    assert ds.labels.tolist() == [0, 0, 1, 1]
    assert ds.class_names == {0: "a", 1: "c"} and ds.num_classes == 2


def test_image_folder_without_empty_folders_does_not_warn(tmp_path):
    for cls in ("a", "b"):
        _png(tmp_path / cls / "0.png")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = load_dataset("image_folder", root=tmp_path)
    assert ds.class_names == {0: "a", 1: "b"}


# -- 6. skip_corrupt with every image unreadable --------------------------------------------------
def test_skip_corrupt_with_no_readable_image_is_one_error(tmp_path):
    for cls in ("a", "b"):
        (tmp_path / cls).mkdir()
        (tmp_path / cls / "0.png").write_bytes(b"not a png")
    with pytest.raises(DataError, match=r"none of the 2 images.*could be read.*a/0\.png"):
        load_dataset("image_folder", root=tmp_path, skip_corrupt=True)
    with pytest.raises(DataError, match="none of the 2 images"):
        ImageFileDataset([tmp_path / "a" / "0.png", tmp_path / "b" / "0.png"], [0, 1], skip_corrupt=True)


def test_skip_corrupt_keeps_the_readable_images(tmp_path):
    _png(tmp_path / "a" / "0.png")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "0.png").write_bytes(b"not a png")
    with pytest.warns(UserWarning, match="skipped 1 unreadable"):
        ds = load_dataset("image_folder", root=tmp_path, skip_corrupt=True)
    assert len(ds) == 1 and ds.skipped == [str(tmp_path / "b" / "0.png")]


# -- 2. a run's rows are mapped onto its dataset only while it is the same dataset ---------------
def _run(tmp_path: Path, with_split: bool = False) -> tuple[Path, Path]:
    """A run directory whose test embeddings hold rows 0..5 of an image folder a/0-2, b/0-2."""
    data = tmp_path / "data" / "folder"
    for cls in ("a", "b"):
        for j in range(3):
            _png(data / cls / f"{j}.png", 40 * j)
    run = tmp_path / "run"
    (run / "embeddings").mkdir(parents=True)
    (run / "config.yaml").write_text(f"name: r\ndata: {{dataset: image_folder, root: {data}}}\n"
                                     "loss: {name: triplet}\n")
    ds = load_dataset("image_folder", root=data)
    if with_split:
        (run / "split.json").write_text(json.dumps({"train": [0], "test": [1], "meta": {
            "class_names": {"0": "a", "1": "b"}}}))
    save_embeddings(run / "embeddings" / "test.npz", np.eye(6), ds.labels, indices=np.arange(6))
    return run / "embeddings" / "test.npz", data


def _ids(emb: Path, data: Path):
    with np.load(emb) as z:
        return item_ids(emb, {"indices": z["indices"]}, data, z["labels"])[0]


def test_item_ids_of_an_unchanged_run_are_its_files(tmp_path):
    emb, data = _run(tmp_path, with_split=True)
    assert _ids(emb, data).tolist() == [f"{c}/{j}.png" for c in "ab" for j in range(3)]


def test_item_ids_refuse_a_dataset_that_lost_items(tmp_path):
    emb, data = _run(tmp_path)
    (data / "a" / "0.png").unlink()  # rows shift: row 0 would be a/1.png, row 5 past the end
    with pytest.raises(DataError, match=r"changed since it was embedded \(row 5 of the file is past its 5 items\)"):
        _ids(emb, data)


def test_item_ids_refuse_a_dataset_whose_rows_hold_other_classes(tmp_path):
    emb, data = _run(tmp_path)
    (data / "b" / "0.png").rename(data / "a" / "3.png")  # same count, row 3 is now an 'a' image
    with pytest.raises(DataError, match=r"row 3 is class 1 in the file and 0 in the data; 1 of its 6 rows differ"):
        _ids(emb, data)


def test_item_ids_refuse_classes_renumbered_since_the_run(tmp_path):
    emb, data = _run(tmp_path, with_split=True)
    for cls in ("a", "b"):  # the same items under new folder names: labels agree, classes do not
        (data / cls).rename(data / f"z{cls}")
    (data / "za").rename(data / "b")
    (data / "zb").rename(data / "c")
    with pytest.raises(DataError, match="class 0 was 'a' and is 'b'"):
        _ids(emb, data)


def test_dmlkit_index_refuses_a_run_whose_dataset_changed(tmp_path, run_cli):
    emb, data = _run(tmp_path)
    (data / "a" / "0.png").unlink()
    code, _, err = run_cli(["index", str(emb), "-o", str(tmp_path / "index"), "--data-root", str(data)])
    assert code == 2 and "changed since it was embedded" in err and "Traceback" not in err
    assert not (tmp_path / "index").exists()
