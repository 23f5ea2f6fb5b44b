"""Result files: readable by the group/world as the umask allows, strict JSON, atomic."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from dmlkit.utils import atomic_write_json, atomic_write_text, os_error_message


def test_result_files_respect_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        path = atomic_write_text(tmp_path / "a.txt", "x")
        assert path.stat().st_mode & 0o777 == 0o644
        os.umask(0o077)
        path = atomic_write_json(tmp_path / "b.json", {"x": 1})
        assert path.stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary file left behind


def test_json_is_strict_nan_and_inf_become_null(tmp_path):
    path = atomic_write_json(tmp_path / "m.json", {
        "map_at_r": float("nan"), "p": [1.0, float("inf")], "arr": np.array([0.5, np.nan]),
        "np": np.float32("nan"), "ok": 0.25, "n": 3,
    })
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text

    def refuse(name):  # strict parsing: the constants other JSON readers reject
        raise AssertionError(name)

    data = json.loads(text, parse_constant=refuse)
    assert data == {"map_at_r": None, "p": [1.0, None], "arr": [0.5, None], "np": None, "ok": 0.25, "n": 3}
    assert not any(isinstance(v, float) and math.isnan(v) for v in data["p"])


def test_json_text_is_the_strict_text_every_print_uses():
    from dmlkit.utils import json_text

    text = json_text({"map": float("nan"), "p": np.float32(0.5), "v": np.array([1.0, np.inf])})
    assert json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c))) == {
        "map": None, "p": 0.5, "v": [1.0, None]}


def test_a_text_labels_file_keeps_whole_lines_as_class_names(tmp_path):
    """A class name may hold commas ("Doe, John"): cut at the comma, four people became two
    classes and every metric was computed on the wrong classes."""
    import pytest

    from dmlkit.embedding_files import read_labels_file
    from dmlkit.exceptions import DataError

    people = ["Doe, John", "Doe, Jane", "Roe, Rick", "Roe, Ruth"]
    (tmp_path / "names.txt").write_text("\n".join(people * 2) + "\n\n")  # blank lines at the end: ignored
    assert read_labels_file(tmp_path / "names.txt").tolist() == people * 2
    (tmp_path / "names.csv").write_text("".join(f'"{p}",extra\n' for p in people))  # a CSV: its first field
    assert read_labels_file(tmp_path / "names.csv").tolist() == people
    (tmp_path / "ids.txt").write_text("1.0\n2\n 3 \n1e1\n")  # integer-valued numbers are ids
    labels = read_labels_file(tmp_path / "ids.txt")
    assert labels.dtype == np.int64 and labels.tolist() == [1, 2, 3, 10]
    (tmp_path / "comment.txt").write_text("#7\n3\n")  # no comment syntax: a name like any other
    assert read_labels_file(tmp_path / "comment.txt").tolist() == ["#7", "3"]
    for text, message in (("1\n\n2\n", "line 2 is blank"), ("0\n0.5\n", "'0.5' on line 2"),
                          ("cat\nnan\n", "'nan' on line 2")):
        (tmp_path / "bad.txt").write_text(text)
        with pytest.raises(DataError, match=message):
            read_labels_file(tmp_path / "bad.txt")


def test_atomic_writes_refuse_non_regular_files_and_write_through_links(tmp_path):
    """`-o /dev/full` (as root) used to replace the device node with a JSON file: an existing
    path that is not a regular file is refused; a symbolic link keeps pointing at its target,
    which gets the new content."""
    import pytest

    from dmlkit.exceptions import DataError

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for target in (fifo, tmp_path):
        with pytest.raises(DataError, match="not a regular file"):
            atomic_write_text(target, "x")
    assert fifo.exists() and not fifo.is_file()
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    atomic_write_json(link, {"a": 1})
    assert link.is_symlink() and json.loads(real.read_text()) == {"a": 1}


@pytest.mark.parametrize("make_dir", [lambda p: Path(p).mkdir(parents=True, exist_ok=True),
                                      lambda p: os.makedirs(p, exist_ok=True)],
                         ids=["Path.mkdir", "os.makedirs"])
def test_a_file_where_an_output_folder_goes_is_named_as_in_the_way(tmp_path, make_dir):
    """`evaluate --per-class afile/pc.json`, `export -o afile/m.onnx`, `embed -o afile/e.npz` said
    "cannot access afile: File exists" (the EEXIST of creating the folder afile) where
    train / index / report say "Not a directory (a file is in the way ...)": the same words now.
    An exclusive create of an existing file keeps "File exists"."""
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(FileExistsError) as blocked:
        make_dir(afile)
    message = os_error_message(blocked.value, writing=True)
    assert message == f"cannot write {afile}: Not a directory (a file is in the way where a directory is needed)"
    with pytest.raises(FileExistsError) as exclusive:
        os.close(os.open(afile, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    assert os_error_message(exclusive.value) == f"cannot access {afile}: File exists"
