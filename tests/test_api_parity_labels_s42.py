"""CLI/API parity of class-name labels and of items shared by query and reference files
(audit s42 findings 1 and 2)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dmlkit.embeddings import load_embeddings, save_embeddings
from dmlkit.metrics import evaluate


def _named_files(tmp_path):
    """A query file with classes 0..5 and a reference file with classes 2..5 only, as names:
    each file's sorted codes name different classes (code 0 is 'c0' in one, 'c2' in the other)."""
    rng = np.random.default_rng(0)
    centres = 4 * rng.normal(size=(6, 8))
    y = np.repeat(np.arange(6), 6)
    x = (centres[y] + rng.normal(size=(36, 8))).astype(np.float32)
    names = np.array([f"c{k}" for k in y])
    q, r = np.arange(36) % 2 == 0, (np.arange(36) % 2 == 1) & (y >= 2)
    save_embeddings(tmp_path / "q.npz", x[q], names[q])
    save_embeddings(tmp_path / "r.npz", x[r], names[r])
    return x[q], names[q], x[r], names[r]


def test_two_files_loaded_alone_match_classes_by_name_as_the_cli(tmp_path, run_cli):
    xq, nq, xr, nr = _named_files(tmp_path)
    q, ql, qe = load_embeddings(tmp_path / "q.npz")
    r, rl, _ = load_embeddings(tmp_path / "r.npz")
    assert ql.tolist() == nq.tolist() and "class_names" not in qe  # names, no code table beside them
    save_embeddings(tmp_path / "q2.npz", q, ql, **qe)  # the round trip a user makes
    assert load_embeddings(tmp_path / "q2.npz")[1].tolist() == nq.tolist()
    api = evaluate(q, ql, r, rl, metrics=["precision_at_1"])
    # oracle: cosine 1-NN, compared by name, queries whose class the reference lacks left out
    qn, rn = xq / np.linalg.norm(xq, axis=1, keepdims=True), xr / np.linalg.norm(xr, axis=1, keepdims=True)
    has = np.isin(nq, nr)
    want = (nr[(qn @ rn.T).argmax(1)] == nq)[has].mean()
    assert want > 0.9 and api["precision_at_1"] == pytest.approx(want)
    code, out, _ = run_cli(["evaluate", str(tmp_path / "q.npz"), "-r", str(tmp_path / "r.npz"),
                            "-m", "precision_at_1", "--json"])
    assert code == 0 and json.loads(out)["precision_at_1"] == api["precision_at_1"]


def test_codes_stay_available_and_integer_labels_are_unchanged(tmp_path):
    _named_files(tmp_path)
    _, codes, extra = load_embeddings(tmp_path / "r.npz", codes=True)
    assert codes.dtype == np.int64 and extra["class_names"][codes].tolist() == load_embeddings(tmp_path / "r.npz")[1].tolist()
    q_extra = load_embeddings(tmp_path / "q.npz", codes=True)[2]
    _, shared, _ = load_embeddings(tmp_path / "r.npz", class_names=q_extra["class_names"])
    assert shared.dtype == np.int64 and q_extra["class_names"][shared].tolist() == load_embeddings(tmp_path / "r.npz")[1].tolist()
    save_embeddings(tmp_path / "ints.npz", np.eye(3, dtype=np.float32), [4, 2, 4])
    for kwargs in ({}, {"codes": True}):
        _, lab, extra = load_embeddings(tmp_path / "ints.npz", **kwargs)
        assert lab.dtype == np.int64 and lab.tolist() == [4, 2, 4] and "class_names" not in extra


def _twice(tmp_path, **items):
    """One split embedded twice, 1e-5 apart (two devices), with the item arrays ``items``."""
    rng = np.random.default_rng(1)
    y = np.repeat(np.arange(6), 4)
    x = (3 * rng.normal(size=(6, 8))[y] + rng.normal(size=(24, 8))).astype(np.float32)
    save_embeddings(tmp_path / "a.npz", x, y, **items)
    save_embeddings(tmp_path / "b.npz", x + np.float32(1e-5) * rng.standard_normal(x.shape).astype(np.float32), y, **items)
    return [load_embeddings(tmp_path / f) for f in ("a.npz", "b.npz")]


def test_shared_items_by_paths_one_function_for_python_and_cli(tmp_path, run_cli):
    from dmlkit.embedding_files import without_shared_items
    from dmlkit.exceptions import ConfigError, DataError

    (q, ql, qe), (r, rl, re_) = _twice(tmp_path, paths=[f"c{i % 6}/{i}.png" for i in range(24)])
    with pytest.raises(DataError, match='24 of the 24 query items are also in the reference.*shared_items="drop"'):
        without_shared_items(ql, qe, r, rl, re_)
    with pytest.raises(DataError, match="leaves no reference"):
        without_shared_items(ql, qe, r, rl, re_, "drop")
    with pytest.warns(UserWarning, match="counted as they are"):
        assert without_shared_items(ql, qe, r, rl, re_, "keep")[0] is r
    with pytest.raises(ConfigError, match="choose drop or keep"):
        without_shared_items(ql, qe, r, rl, re_, "Drop")
    half = {k: v[:12] for k, v in qe.items()}  # the first 12 items as queries: 12 left in the reference
    with pytest.warns(UserWarning, match="left the 12 reference items"):
        r2, rl2 = without_shared_items(ql[:12], half, r, rl, re_, "drop")
    assert np.array_equal(r2, r[12:]) and np.array_equal(rl2, rl[12:])
    code, _, err = run_cli(["evaluate", str(tmp_path / "a.npz"), "-r", str(tmp_path / "b.npz")])
    assert code == 2 and "24 of the 24 query items" in err and "--shared-items drop" in err


def test_run_files_of_array_data_are_matched_by_dataset_and_index(tmp_path, run_cli):
    """Omniglot / quickstart runs record ``indices`` (rows of an in-memory data set), no paths:
    two embeddings of one split passed as query and reference read P@1 = 1.0 with exit 0."""
    from dmlkit.data.base import ArrayDataset
    from dmlkit.embedding_files import shared_items, without_shared_items
    from dmlkit.embeddings import dataset_items
    from dmlkit.exceptions import DataError

    data = ArrayDataset(np.random.default_rng(2).normal(size=(40, 8)).astype(np.float32), np.repeat(np.arange(10), 4),
                        kind="features")
    test = data.subset(np.arange(16, 40))
    items = dataset_items(test, tmp_path)
    assert items["indices"].tolist() == list(range(16, 40)) and items["dataset_id"].shape == ()
    (q, ql, qe), (r, rl, re_) = _twice(tmp_path, **items)
    with pytest.raises(DataError, match="24 of the 24 query items .* by the indices"):
        without_shared_items(ql, qe, r, rl, re_)
    code, _, err = run_cli(["evaluate", str(tmp_path / "a.npz"), "-r", str(tmp_path / "b.npz"), "--json"])
    assert code == 2 and "24 of the 24 query items" in err
    other = ArrayDataset(np.ones((40, 8), np.float32), np.repeat(np.arange(10), 4), kind="features").subset(np.arange(16, 40))
    re_other = {**re_, "dataset_id": dataset_items(other, tmp_path)["dataset_id"]}  # same rows, another data set
    assert not shared_items(ql, qe, rl, re_other)[0].any()
    assert without_shared_items(ql, qe, r, rl, re_other)[0] is r
    no_id = {k: v for k, v in re_.items() if k != "dataset_id"}  # which data set is unknown: no match by row
    assert shared_items(ql, qe, rl, no_id) is None
