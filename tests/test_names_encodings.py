"""Audit s39 (names, encodings, id round trips): class names that read as numbers, whitespace
and NUL characters in labels, file names that are not UTF-8, a dataset CSV that is not UTF-8,
the ids a CSV dataset's run stores, pair lists of a run's paths and report links. Each test
pins a silent wrong number or a traceback with a tiny real-format fixture."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dmlkit.data import load_dataset
from dmlkit.embedding_files import read_labels_file
from dmlkit.exceptions import DataError
from dmlkit.validation import check_labels


def _pngs(folder: Path, names: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name in names:
        Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8), "L").save(folder / name)


# -- F3: labels that read as one integer, whitespace, NUL -------------------------------------------
@pytest.mark.parametrize("suffix", [".txt", ".csv"])
def test_labels_file_keeps_names_that_read_as_one_integer_apart(tmp_path, suffix):
    """'1', '01' and '007', '7' were read as ints 1, 1, 7, 7: two classes for four (P@1 0.833
    for 0.0); the dataset CSV kept them apart. Both now follow one rule."""
    path = tmp_path / f"labels{suffix}"
    path.write_text("1\n01\n01\n1\n007\n7\n", encoding="utf-8")
    assert read_labels_file(path).tolist() == ["1", "01", "01", "1", "007", "7"]
    path.write_text("1\n2.0\n+3\n1\n", encoding="utf-8")  # distinct integers stay ids
    assert read_labels_file(path).tolist() == [1, 2, 3, 1]
    _pngs(tmp_path / "d", [f"{i}.png" for i in range(4)])
    (tmp_path / "d" / "l.csv").write_text("path,label\n0.png,1\n1.png,01\n2.png,01\n3.png,1\n")
    ds = load_dataset("csv", root=tmp_path / "d" / "l.csv")
    assert sorted(ds.class_names.values()) == ["01", "1"] and len(set(ds.labels.tolist())) == 2


@pytest.mark.parametrize("suffix", [".txt", ".csv"])
def test_labels_that_differ_only_in_surrounding_whitespace_are_refused(tmp_path, suffix):
    """'cat' and 'cat ' were stripped into one class without a word."""
    path = tmp_path / f"labels{suffix}"
    path.write_text("cat \ncat \ndog\n", encoding="utf-8")  # the same spelling everywhere: stripped
    assert read_labels_file(path).tolist() == ["cat", "cat", "dog"]
    path.write_text("cat\ndog\ncat \n", encoding="utf-8")
    with pytest.raises(DataError, match=r"'cat' \(line 1\) and 'cat ' \(line 3\) differ only in the whitespace"):
        read_labels_file(path)
    _pngs(tmp_path / "d", ["a.png", "b.png"])
    (tmp_path / "d" / "l.csv").write_text("path,label\na.png,cat\nb.png, cat\n")
    with pytest.raises(DataError, match=r"l.csv: the labels 'cat' \(line 2\) and ' cat' \(line 3\)"):
        load_dataset("csv", root=tmp_path / "d" / "l.csv")


def test_labels_with_a_nul_character_are_refused(tmp_path):
    """numpy's str arrays drop trailing NULs: 'a\\x00' and 'a' were one class."""
    with pytest.raises(DataError, match="NUL character"):
        check_labels(["a\x00", "a", "b"])
    with pytest.raises(DataError, match="NUL character"):
        check_labels(np.asarray(["a\x00b", "a"]))
    assert check_labels(["b", "a", "b"])[1] == ["a", "b"]
    (tmp_path / "l.txt").write_text("a\x00\na\n", encoding="utf-8")
    with pytest.raises(DataError, match="line 1: the label 'a\\\\x00' holds a NUL"):
        read_labels_file(tmp_path / "l.txt")
