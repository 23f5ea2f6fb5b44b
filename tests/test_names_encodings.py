"""Audit s39 (names, encodings, id round trips): class names that read as numbers, whitespace
and NUL characters in labels, file names that are not UTF-8, a dataset CSV that is not UTF-8,
the ids a CSV dataset's run stores, pair lists of a run's paths and report links. Each test
pins a silent wrong number or a traceback with a tiny real-format fixture."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from urllib.parse import unquote, urljoin, urlparse

import numpy as np
import pytest
import torch
from PIL import Image

from _reference import run_cli, tiny_sections
from dmlkit.apps.index import item_ids
from dmlkit.config import config_from_dict
from dmlkit.data import load_dataset
from dmlkit.data.pairs import load_pair_list
from dmlkit.embedding_files import read_labels_file
from dmlkit.embeddings import dataset_items
from dmlkit.exceptions import DataError
from dmlkit.report.html import Figure, Section, render_page
from dmlkit.training import train
from dmlkit.training.preflight import PreflightError, preflight
from dmlkit.utils import local_path
from dmlkit.validation import check_labels


def _main(capsys, *args: str) -> tuple[int, str, str]:
    """``dmlkit ARGS``: (exit code, stdout, stderr)."""
    return run_cli(capsys, *args)


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


# -- F1: file names that are not UTF-8, and the C locale ------------------------------------------
def _latin1_folder(root: Path) -> Path:
    """Two classes: ``café`` in UTF-8 (``c3 a9``) and ``c1``, whose files' names hold Latin-1's
    ``é`` (the byte ``e9``, not UTF-8: what an old zip unpacks)."""
    for cls in (b"caf\xc3\xa9", b"c1"):
        folder = os.path.join(os.fsencode(root), cls)
        os.makedirs(folder)
        for i in range(2):
            name = os.path.join(folder, b"x\xe9%d.png" % i if cls == b"c1" else b"%d.png" % i)
            Image.new("L", (4, 4)).save(os.fsdecode(name))
    return root


def test_file_names_that_are_not_utf8_are_fingerprinted(tmp_path):
    """str.encode() of 'x\\udce90.png' raised UnicodeEncodeError: `dmlkit train` ended in a
    traceback for one such file."""
    ds = load_dataset("image_folder", root=_latin1_folder(tmp_path / "data"))
    assert len(ds.fingerprint()) == 32 and len(ds.portable_fingerprint()) == 32
    ids = dataset_items(ds, tmp_path / "data")["paths"].tolist()
    assert sorted(ids) == ["c1/x\udce90.png", "c1/x\udce91.png", "caf\u00e9/0.png", "caf\u00e9/1.png"]
    assert {local_path(i) for i in ids} == {os.path.relpath(p, tmp_path / "data") for p in ds.paths}


C_LOCALE = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
IDS_PROBE = """
import json, sys
from dmlkit.data import load_dataset
from dmlkit.embeddings import dataset_items
ds = load_dataset("image_folder", root=sys.argv[1])
print(json.dumps([sys.getfilesystemencoding(), ds.portable_fingerprint(),
                  dataset_items(ds, sys.argv[1])["paths"].tolist()]))
"""


def test_run_ids_are_the_same_under_the_c_locale(tmp_path):
    """Under LC_ALL=C (file-system encoding ASCII) Python spells 'café' 'caf\\udcc3\\udca9': a run
    embedded in one locale was refused as "changed since it was embedded" in the other."""
    root = _latin1_folder(tmp_path / "data")
    out = subprocess.run([sys.executable, "-c", IDS_PROBE, str(root)], env=C_LOCALE, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    encoding, portable, ids = json.loads(out.stdout)
    ds = load_dataset("image_folder", root=root)
    assert encoding == "ascii"  # the probe really ran with another spelling of 'café'
    assert ids == dataset_items(ds, root)["paths"].tolist() and portable == ds.portable_fingerprint()


# -- F2: a dataset CSV that is not UTF-8 ---------------------------------------------------------
def test_dataset_csv_in_windows_1252_is_one_error_naming_the_byte(tmp_path):
    """Excel's plain "CSV" on Windows (cp1252 'café') ended in a UnicodeDecodeError traceback."""
    _pngs(tmp_path, ["0.png", "1.png"])
    (tmp_path / "list.csv").write_bytes("path,label\n0.png,caf\u00e9\n1.png,b\n".encode("cp1252"))
    with pytest.raises(DataError, match=r"list.csv is not UTF-8 text: byte 20 \(line 2\) is 0xe9, 'é' in "
                                        r"Windows-1252; save it as \"CSV UTF-8\""):
        load_dataset("csv", root=tmp_path / "list.csv")


def test_non_utf8_byte_offset_is_into_the_file(tmp_path):
    """The offset counts the byte-order mark and is not an offset into a chunk of the file (the
    pair CSV, read in chunks, named byte 9817 of this one as byte 1625)."""
    labels = tmp_path / "labels.txt"
    labels.write_bytes(b"\xef\xbb\xbfcat\n\x81\n")
    with pytest.raises(DataError, match=r"byte 7 \(line 2\) is 0x81; save the labels as UTF-8"):
        read_labels_file(labels)
    pairs = tmp_path / "pairs.csv"
    pairs.write_bytes(b"path1,path2,same\n" + b"a.png,b.png,1\n" * 700 + b"\xe9.png,b.png,0\n")
    with pytest.raises(DataError, match=r"byte 9817 \(line 702\) is 0xe9"):
        load_pair_list(pairs)


# -- F4, F5: a csv run's ids, and verify with a run's paths ---------------------------------------
@pytest.fixture(scope="module")
def csv_run(tmp_path_factory) -> tuple[Path, Path]:
    """A one-step run on a dataset CSV whose images lie in ``imgs/`` beside it:
    ``(run_dir, csv)``."""
    base = tmp_path_factory.mktemp("csvrun")
    _pngs(base / "data" / "imgs", [f"{c}_{i}.png" for c in range(4) for i in range(3)])
    rows = "".join(f"imgs/{c}_{i}.png,class {c}\n" for c in range(4) for i in range(3))
    (base / "data" / "list.csv").write_text("path,label\n" + rows)
    config = {"name": "csvrun", "seed": 0, "data": {"dataset": "csv", "transform": "grayscale", "image_size": 8},
              **tiny_sections(), "sampler": {"classes_per_batch": 2, "samples_per_class": 2, "batches_per_epoch": 1},
              "training": {"epochs": 1, "device": "cpu"}}
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a one-step run may not beat its baseline
        train(config, base / "run", data_root=base / "data" / "list.csv", progress=False)
    return base / "run", base / "data" / "list.csv"


def test_csv_run_ids_are_relative_to_the_lists_image_folder(csv_run, tmp_path):
    """The ids were absolute paths of this machine ('relative to' the CSV file itself): an
    identical copy of the data was refused as "changed since it was embedded"."""
    run_dir, csv_file = csv_run
    emb = run_dir / "embeddings" / "test.npz"
    with np.load(emb) as z:
        extra = dict(z)
    assert extra["paths"].tolist() == [f"imgs/{c}_{i}.png" for c in (2, 3) for i in range(3)]
    copy = Path(shutil.copytree(csv_file.parent, tmp_path / "copy"))
    ids, facts = item_ids(emb, extra, copy / "list.csv", extra["labels"])
    assert ids.tolist() == extra["paths"].tolist() and facts["data_root"] == str(copy.resolve())
    # a csv run embedded before: its absolute ids are the same files
    old = {**extra, "paths": np.asarray([str(csv_file.parent / p) for p in extra["paths"].tolist()])}
    assert item_ids(emb, old, csv_file, extra["labels"])[0].tolist() == extra["paths"].tolist()


def _pair_csv(run_dir: Path, path: Path) -> Path:
    """Every pair of the run's test images, as the run names them."""
    with np.load(run_dir / "embeddings" / "test.npz") as z:
        paths, labels = z["paths"].tolist(), z["labels"]
    pairs = [(paths[i], paths[j], int(labels[i] == labels[j])) for i in range(len(paths))
             for j in range(i + 1, len(paths))]
    path.write_text("path1,path2,same\n" + "".join(f"{a},{b},{s}\n" for a, b, s in pairs))
    return path


def test_verify_finds_a_runs_paths_under_its_data_root_from_any_folder(csv_run, tmp_path, capsys, monkeypatch):
    """`dmlkit verify RUN/embeddings/test.npz --pair-list` resolved the run's paths against the
    current folder: from anywhere but the data root, every image 'had no embedding'."""
    run_dir, csv_file = csv_run
    pairs = _pair_csv(run_dir, csv_file.parent / "pairs.csv")
    monkeypatch.chdir(tmp_path)
    emb = str(run_dir / "embeddings" / "test.npz")
    code, out, err = _main(capsys, "verify", emb, "--pair-list", str(pairs), "--folds", "3", "--json")
    assert code == 0, err
    first = json.loads(out)["accuracy"]
    copy = Path(shutil.copytree(csv_file.parent, tmp_path / "copy"))  # --images: the data elsewhere
    code, out, err = _main(capsys, "verify", emb, "--pair-list", str(copy / "pairs.csv"), "--images", str(copy),
                           "--folds", "3", "--json")
    assert code == 0 and json.loads(out)["accuracy"] == first, err


# -- F6: report figure links -------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["r#1.html", "r%41.html", "r?x.html", "a b.html", "plain.html"])
def test_report_figure_links_reach_their_files(tmp_path, name):
    """The links were the relative paths unencoded: for a page named 'r#1.html' the href
    'r#1_figures/curves.png' is the page itself ('#' begins a fragment; '%41' decodes to 'A',
    '?' begins a query), so every figure link of such a report was dead."""
    page = tmp_path / name
    figures = tmp_path / f"{page.stem}_figures"
    figures.mkdir()
    Image.new("L", (4, 4)).save(figures / "curves.png")
    text = render_page("t", "s", [Section("Curves", figures=[Figure(figures / "curves.png", "c")])], page)
    hrefs = re.findall(r'<a href="([^"#][^"]*)"', text)
    assert len(hrefs) == 1
    target = urlparse(urljoin(page.resolve().as_uri(), html.unescape(hrefs[0])))
    assert not target.fragment and not target.query and Path(unquote(target.path)) == (figures / "curves.png").resolve()


# -- a class name holding a newline in the preflight error -------------------------------------------
def test_preflight_error_shows_a_class_name_with_a_newline_on_one_line(tmp_path):
    """A class folder named 'a\\nb' split the error's first line in two."""
    for cls in ("a\nb", "c", "d"):
        _pngs(tmp_path / cls, ["0.png", "1.png", "2.png"])
    config = config_from_dict({"name": "nl", "data": {"dataset": "image_folder", "transform": "grayscale",
                                                      "split": {"kind": "default", "val_fraction": 0.34}},
                               **tiny_sections(), "training": {"epochs": 1, "device": "cpu"}})
    with pytest.raises(PreflightError) as err:
        preflight(config, data_root=tmp_path, emit_warnings=False)
    first = str(err.value).splitlines()[0]  # the whole summary line, up to its count of problems
    assert "3 classes ('a\\nb', c, d), 9 items" in first and first.endswith("problems:")
