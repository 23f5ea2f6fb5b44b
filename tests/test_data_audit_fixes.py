"""Audit fixes in dmlkit's data handling: class-name labels of two embeddings files, a run's
rows mapped onto a changed dataset, CSV split columns and duplicate rows, empty class folders,
and a dataset whose every image is unreadable."""

from __future__ import annotations

import json

import numpy as np
import pytest

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
    q, qcodes, qextra = load_embeddings(qpath)
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
