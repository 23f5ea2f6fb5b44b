"""Regression tests of the applications audit: index labels, verification pairs and folds,
IVF held-out recall after a reload, kNN votes of negative labels, few-shot class coverage."""

from __future__ import annotations

import numpy as np
import pytest

from dmlkit.apps import EmbeddingIndex
from dmlkit.apps import verification as verification_module
from dmlkit.apps.verification import make_pairs, stratified_folds
from dmlkit.exceptions import ConfigError


def _unordered(i: np.ndarray, j: np.ndarray) -> list[tuple[int, int]]:
    return [(min(a, b), max(a, b)) for a, b in zip(i.tolist(), j.tolist())]


# -- verification pairs ------------------------------------------------------------------------
@pytest.mark.parametrize("enumerate_limit", [None, 0])  # listed outright / drawn with rejection
def test_make_pairs_negatives_are_distinct_unordered_pairs(monkeypatch, enumerate_limit):
    if enumerate_limit is not None:
        monkeypatch.setattr(verification_module, "_ENUMERATE_PAIRS", enumerate_limit)
    y = np.repeat(np.arange(20), 10)  # 20 people x 10: 900 positives, 18,000 negative pairs
    i, j, same = make_pairs(y, 1800, seed=0)
    neg = [p for p, s in zip(_unordered(i, j), same) if not s]
    assert len(neg) == 900 and len(set(neg)) == 900  # no repeat, in either order
    assert all(y[a] != y[b] for a, b in neg) and all(a != b for a, b in neg)
    again = make_pairs(y, 1800, seed=0)
    assert all(np.array_equal(u, v) for u, v in zip((i, j, same), again))  # deterministic by seed


def test_make_pairs_can_take_every_negative_and_no_more():
    """Every negative pair once; asking for more uses them all, as many positives, and says so
    (it was a ConfigError, while scarce positives only warned)."""
    y = np.array([0] * 6 + [1] * 3)  # 15 + 3 positive, 18 negative unordered pairs
    i, j, same = make_pairs(y, 36, seed=0)  # 18 + 18: every negative pair, once each
    neg = [p for p, s in zip(_unordered(i, j), same) if not s]
    assert len(neg) == 18 == len(set(neg))
    y2 = np.array([0] * 30 + [1])  # 435 positive pairs, only 30 negative
    with pytest.warns(UserWarning, match="only 30 different-class pairs: using 60"):
        i, j, same = make_pairs(y2, 200, seed=0)
    neg = [p for p, s in zip(_unordered(i, j), same) if not s]
    assert len(neg) == 30 == len(set(neg)) and same.sum() == 30


def test_stratified_folds_sizes_differ_by_at_most_one():
    for n_pos, n_neg, folds in [(3, 3, 5), (11, 9, 4), (1, 1, 2), (7, 0, 3), (0, 5, 2), (23, 41, 10)]:
        same = np.array([True] * n_pos + [False] * n_neg)
        ids = stratified_folds(same, folds)
        sizes = np.bincount(ids, minlength=folds)
        assert sizes.max() - sizes.min() <= 1, (n_pos, n_neg, folds, sizes)
        for mask in (same, ~same):  # each kind still spread evenly
            per = np.bincount(ids[mask], minlength=folds)
            assert per.max() - per.min() <= 1


# -- kNN classification ------------------------------------------------------------------------
def test_classify_counts_negative_labels():
    x = np.array([[1, 0], [0.99, 0.1], [0.98, 0.2], [0.9, 0.4], [0, 1]], np.float32)
    idx = EmbeddingIndex(x, np.array([-1, -1, 2, 2, 2]))
    q = np.array([[1, 0.05]], np.float32)
    assert idx.search(q, 3).labels.tolist() == [[-1, -1, 2]]
    assert idx.classify(q, k=3).tolist() == [-1]  # the majority of real labels, -1 included
    assert EmbeddingIndex(x, np.array([-2, -2, -3, -3, 5])).classify(q, k=1).tolist() == [-2]


# -- few-shot ----------------------------------------------------------------------------------
def _small_and_large_classes() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    # 10 classes of 20 items, 40 classes of 5 (too few for 1 shot + 5 queries)
    y = np.concatenate([np.repeat(np.arange(10), 20), np.repeat(np.arange(10, 50), 5)])
    x = (rng.normal(size=(50, 8))[y] + rng.normal(size=(len(y), 8))).astype(np.float32)
    return x, y


def test_few_shot_reports_and_warns_about_skipped_classes():
    from dmlkit.apps import few_shot_accuracy

    x, y = _small_and_large_classes()
    with pytest.warns(UserWarning, match="40 of 50 classes have fewer than"):
        res = few_shot_accuracy(x, y, n_way=5, k_shot=1, n_query=5, episodes=20)
    assert (res["classes_used"], res["classes_skipped"]) == (10, 40)
    res = few_shot_accuracy(x, y, n_way=5, k_shot=1, n_query=4, episodes=20)  # every class fits
    assert (res["classes_used"], res["classes_skipped"]) == (50, 0)
    with pytest.raises(ConfigError, match="n_way >= 2"):
        few_shot_accuracy(x, y, n_way=1, episodes=20)


def test_cli_fewshot_prints_the_skipped_classes_and_refuses_one_way(tmp_path, capsys):
    import json

    from dmlkit.cli import main

    x, y = _small_and_large_classes()
    np.savez(tmp_path / "fs.npz", embeddings=x, labels=y)

    def run(*args: str) -> tuple[int, str, str]:
        try:
            main(["fewshot", str(tmp_path / "fs.npz"), "--episodes", "20", *args])
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
        out, err = capsys.readouterr()
        return code, out, err

    code, out, err = run("--json")
    assert code == 0 and json.loads(out)["classes_skipped"] == 40
    assert err.count("\n") == 1 and err.startswith("warning: few-shot: 40 of 50 classes")
    code, out, err = run()
    assert "classes_used" in out and "classes_skipped" in out
    code, out, err = run("--way", "1")
    assert code == 2 and err.startswith("error:") and "n_way >= 2" in err and err.count("\n") == 1


# -- IVF recall after a reload -----------------------------------------------------------------
def _strip_array(path, name: str) -> None:
    """Rewrite a saved index as an older dmlkit wrote it: without the array ``name``."""
    if path.is_dir():
        (path / f"{name}.npy").unlink()
        return
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files if k != name}
    np.savez(path, **arrays)


@pytest.mark.parametrize("suffix", ["", ".npz"])
def test_loaded_ivf_index_keeps_its_held_out_recall_sample(tmp_path, suffix):
    pytest.importorskip("faiss")
    from dmlkit.apps.index_tuning import recall_sample

    x = np.random.default_rng(0).normal(size=(1200, 8)).astype(np.float32)
    idx = EmbeddingIndex(x, kind="ivf_flat", nlist=4, recall_queries=50, seed=0)
    assert idx.recall["held_out"] is True
    path = idx.save(tmp_path / f"ivf{suffix}")
    loaded = EmbeddingIndex.load(path)
    assert np.array_equal(loaded._trained_keys, idx._trained_keys)
    rows = recall_sample(loaded, 50, 0)
    assert not np.isin(loaded._keys[rows], idx._trained_keys).any()  # never a training row
    assert loaded.measure_recall(k=5, num_queries=50)["held_out"] is True
    _strip_array(path, "trained_keys")  # an index saved before the keys were: not held out
    old = EmbeddingIndex.load(path)
    assert old.measure_recall(k=5, num_queries=50)["held_out"] is False


# -- class-name labels in an index -------------------------------------------------------------
def _vectors(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 4)).astype(np.float32)


@pytest.mark.parametrize("suffix", ["", ".npz"])
def test_index_class_names_keep_their_codes_across_batches_and_save_load(tmp_path, suffix):
    from dmlkit.exceptions import DataError

    x = _vectors(6)
    idx = EmbeddingIndex(x[:2], np.array(["cat", "dog"]), ["a1", "a2"])
    idx.add(x[2:4], np.array(["dog", "zebra"]), ["b1", "b2"])  # 'dog' keeps its code, 'zebra' is new
    assert idx.class_names.tolist() == ["cat", "dog", "zebra"]
    assert idx.class_names[idx.labels].tolist() == ["cat", "dog", "dog", "zebra"]
    loaded = EmbeddingIndex.load(idx.save(tmp_path / f"named{suffix}"))
    assert loaded.class_names.tolist() == ["cat", "dog", "zebra"]
    loaded.add(x[4:], ["ant", "cat"], ["c1", "c2"])  # a name sorting first is appended, not re-sorted
    assert loaded.class_names[loaded.labels].tolist() == ["cat", "dog", "dog", "zebra", "ant", "cat"]
    records = loaded.search(x[3], k=1).to_records()
    assert records[0][0]["label"] == "zebra" and records[0][0]["id"] == "b2"
    assert loaded.classify(x[4:], k=1).tolist() == ["ant", "cat"]
    with pytest.raises(DataError, match="integer ids but the index's labels are class names"):
        loaded.add(_vectors(1, 2), np.array([3]), ["d1"])
    ints = EmbeddingIndex(x[:2], np.array([5, 7]))
    with pytest.raises(DataError, match="class names .* but the index's labels are integer ids"):
        ints.add(x[2:4], np.array(["dog", "zebra"]))
    reloaded = EmbeddingIndex.load(ints.save(tmp_path / f"ints{suffix}"))  # no names: integer labels
    assert reloaded.class_names is None and reloaded.search(x[0], k=1).to_records()[0][0]["label"] == 5


def test_cli_index_add_and_query_use_the_stored_class_names(tmp_path, capsys):
    from dmlkit.cli import main

    x = _vectors(6)
    np.savez(tmp_path / "s1.npz", embeddings=x[:2], labels=np.array(["cat", "dog"]), paths=np.array(["a1", "a2"]))
    np.savez(tmp_path / "s2.npz", embeddings=x[2:4], labels=np.array(["dog", "zebra"]), paths=np.array(["b1", "b2"]))
    np.savez(tmp_path / "n1.npz", embeddings=x[4:], labels=np.array([5, 7]), paths=np.array(["c1", "c2"]))

    def run(*args: str) -> tuple[int, str, str]:
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
        out, err = capsys.readouterr()
        return code, out, err

    idx = tmp_path / "idx"
    assert run("index", tmp_path / "s1.npz", "-o", idx)[0] == 0
    assert run("index", tmp_path / "s2.npz", "-o", idx, "--add")[0] == 0
    loaded = EmbeddingIndex.load(idx)
    assert dict(zip(loaded.ids.tolist(), loaded.class_names[loaded.labels].tolist())) == {
        "a1": "cat", "a2": "dog", "b1": "dog", "b2": "zebra"}
    code, out, _ = run("query", idx, tmp_path / "s2.npz", "-k", "1")
    assert code == 0 and "b1 [label dog]" in out and "b2 [label zebra]" in out
    code, _, err = run("index", tmp_path / "n1.npz", "-o", idx, "--add")  # numbers on a named index
    assert code == 2 and err.startswith("error:") and err.count("\n") == 1 and "n1.npz" in err
    nidx = tmp_path / "nidx"
    assert run("index", tmp_path / "n1.npz", "-o", nidx)[0] == 0
    code, _, err = run("index", tmp_path / "s2.npz", "-o", nidx, "--add")  # names on a numbered index
    assert code == 2 and "class names" in err and err.count("\n") == 1
    assert EmbeddingIndex.load(nidx).labels.tolist() == [5, 7]  # nothing was added


def test_service_reports_class_names(tmp_path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from dmlkit.apps.service import ServiceConfig, create_app

    x = _vectors(4)
    EmbeddingIndex(x, np.array(["cat", "dog", "dog", "zebra"]), ["a1", "a2", "b1", "b2"]).save(tmp_path / "idx")
    client = TestClient(create_app(ServiceConfig(index=tmp_path / "idx")))
    r = client.post("/api/query/embedding", json={"embedding": x[3].tolist(), "k": 1})
    assert r.status_code == 200 and r.json()["results"][0]["label"] == "zebra"
    assert client.get("/api/items/a2").json()["label"] == "dog"
