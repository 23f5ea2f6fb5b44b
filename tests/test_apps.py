"""Retrieval index, verification and few-shot applications."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from _reference import run_cli
from dmlkit.apps import (
    EmbeddingIndex,
    few_shot_accuracy,
    kfold_threshold_accuracy,
    load_omniglot_one_shot_runs,
    make_pairs,
    omniglot_one_shot_error,
    prototype_predict,
    verify,
)
from dmlkit.cli import app
from dmlkit.exceptions import DataError, DataNotFoundError, NonFiniteError, ShapeError
from dmlkit.utils import save_embeddings


def _clusters(classes=6, per=8, dim=8, noise=0.3, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, dim))
    x = np.concatenate([c + noise * rng.normal(size=(per, dim)) for c in centres]).astype(np.float32)
    return x, np.repeat(np.arange(classes), per)


# -- index -----------------------------------------------------------------------------------
def test_index_search_matches_brute_force_and_round_trips(tmp_path):
    x, y = _clusters()
    ids = [f"img{i}.png" for i in range(len(x))]
    idx = EmbeddingIndex(x[:40], y[:40], ids[:40])
    idx.add(x[40:], y[40:], ids[40:])
    q = x[:5] + 0.01
    res = idx.search(q, k=4)
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    qn = q / np.linalg.norm(q, axis=1, keepdims=True)
    brute = np.argsort(-(qn @ xn.T), axis=1, kind="stable")[:, :4]
    np.testing.assert_array_equal(res.indices, brute)
    assert res.ids[0, 0] == "img0.png" and res.labels[0, 0] == y[0]
    assert np.all(np.diff(res.scores, axis=1) <= 1e-7)
    np.testing.assert_array_equal(idx.classify(q, k=3), y[:5])
    idx.save(tmp_path / "i.npz")
    again = EmbeddingIndex.load(tmp_path / "i.npz")
    np.testing.assert_array_equal(again.search(q, 4).indices, res.indices)
    assert again.distance == "cosine" and len(again) == len(x)


def test_index_errors():
    x, y = _clusters()
    with pytest.raises(ShapeError):
        EmbeddingIndex(x[0])
    idx = EmbeddingIndex(x)
    with pytest.raises(DataError, match="no labels"):
        idx.classify(x[:2])
    with pytest.raises(ShapeError):
        idx.search(np.zeros((2, 3)))
    with pytest.raises(NonFiniteError):
        EmbeddingIndex(np.full((2, 2), np.nan))
    with pytest.raises(ValueError, match="unknown distance"):
        EmbeddingIndex(x, distance="hamming")


# -- verification ----------------------------------------------------------------------------
def test_pairs_are_balanced_and_correctly_labelled():
    _, y = _clusters()
    i, j, same = make_pairs(y, num_pairs=200, seed=1)
    assert same.sum() == (~same).sum() == 100
    np.testing.assert_array_equal(y[i] == y[j], same)
    assert np.all(i != j)
    with pytest.raises(DataError):
        make_pairs(np.arange(5))


def test_kfold_threshold_never_sees_its_fold():
    # perfectly separable except one fold whose scores are shifted: a threshold fitted on the
    # other folds must fail on it, which in-fold fitting would hide
    scores = np.r_[np.linspace(0.6, 1, 50), np.linspace(0, 0.4, 50)]
    same = np.r_[np.ones(50, bool), np.zeros(50, bool)]
    order = np.random.default_rng(0).permutation(100)
    scores, same = scores[order], same[order]
    res = kfold_threshold_accuracy(scores, same, folds=10)
    assert res["accuracy"] == 1.0 and 0.4 < res["threshold"] < 0.6
    shifted = scores.copy()
    shifted[:10] -= 0.5
    res = kfold_threshold_accuracy(shifted, same, folds=10)
    # fitted on fold 0 itself, a threshold would separate it perfectly; fitted elsewhere it cannot
    from dmlkit.apps.verification import _best_threshold

    assert _best_threshold(shifted[:10], same[:10])[1] == 1.0
    assert res["fold_accuracies"][0] < 1.0


def test_verify_separable_vs_random():
    x, y = _clusters(noise=0.05)
    good = verify(x, y, num_pairs=400, seed=0)
    assert good.accuracy > 0.95 and good.roc_auc > 0.99 and good.eer < 0.05
    rng = np.random.default_rng(0)
    bad = verify(rng.normal(size=x.shape), y, num_pairs=400, seed=0)
    assert 0.3 < bad.roc_auc < 0.7


# -- few-shot --------------------------------------------------------------------------------
def test_prototype_predict_against_loops():
    rng = np.random.default_rng(3)
    s, sl, q = rng.normal(size=(9, 4)), np.repeat([5, 7, 9], 3), rng.normal(size=(6, 4))
    protos = {c: s[sl == c].mean(0) for c in (5, 7, 9)}
    expected = [min(protos, key=lambda c: np.sum((qq - protos[c]) ** 2)) for qq in q]
    np.testing.assert_array_equal(prototype_predict(s, sl, q), expected)


def test_few_shot_accuracy_with_ci():
    x, y = _clusters(classes=10, per=10, noise=0.1)
    res = few_shot_accuracy(x, y, n_way=5, k_shot=1, n_query=3, episodes=50)
    assert res["accuracy"] > 0.95 and res["episodes"] == 50 and res["ci95"] >= 0
    rng = np.random.default_rng(0)
    chance = few_shot_accuracy(rng.normal(size=x.shape), y, n_way=5, k_shot=1, n_query=3, episodes=200)
    assert 0.1 < chance["accuracy"] < 0.35


def test_omniglot_one_shot_runs(data_root):
    runs = load_omniglot_one_shot_runs(data_root)
    assert len(runs) == 20 and runs[0].train_images.shape == (20, 105, 105)
    assert sorted(runs[0].answers) == list(range(20))  # each class is the answer once
    # raw pixels as the embedding: the classic baseline is far from chance (95% error)
    res = omniglot_one_shot_error(lambda imgs: (~imgs).reshape(len(imgs), -1).astype(np.float32), runs[:5])
    assert res["error_percent"] < 90 and res["runs"] == 5


def test_one_shot_runs_missing(tmp_path):
    with pytest.raises(DataNotFoundError, match="one_shot_all_runs.zip"):
        load_omniglot_one_shot_runs(tmp_path)


# -- CLI -------------------------------------------------------------------------------------
def test_cli_index_query_verify_fewshot(tmp_path):
    x, y = _clusters(classes=8, per=8, noise=0.1)
    save_embeddings(tmp_path / "ref.npz", x, y, paths=np.array([f"p{i}" for i in range(len(x))]))
    runner = CliRunner()
    res = runner.invoke(app, ["index", str(tmp_path / "ref.npz"), "-o", str(tmp_path / "idx.npz")])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["query", str(tmp_path / "idx.npz"), str(tmp_path / "ref.npz"), "-k", "2", "--json"])
    assert res.exit_code == 0, res.output
    records = json.loads(res.stdout)
    assert records[3]["query"] == "p3" and records[3]["results"][0]["index"] == 3
    assert records[3]["results"][0]["id"] == "p3"
    res = runner.invoke(app, ["verify", str(tmp_path / "ref.npz"), "--pairs", "200", "--folds", "5", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["accuracy"] > 0.9
    res = runner.invoke(app, ["fewshot", str(tmp_path / "ref.npz"), "--episodes", "20", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["accuracy"] > 0.9


# -- user errors: one line, exit 2 (issue 11, points 4 and 9) ----------------------------------
def _main(capsys, *args: str) -> tuple[int, str]:
    code, out, err = run_cli(capsys, *args)
    return code, out + err


def test_nan_embeddings_are_refused_by_verify_and_few_shot(tmp_path, capsys):
    x, y = _clusters(classes=8, per=8)
    bad = x.copy()
    bad[5] = np.nan
    with pytest.raises(NonFiniteError, match="1 row"):
        verify(bad, y, num_pairs=100)
    with pytest.raises(NonFiniteError):
        few_shot_accuracy(np.full_like(x, np.nan), y, episodes=5)
    with pytest.raises(NonFiniteError):
        prototype_predict(x[:4], y[:4], bad[5:6])
    save_embeddings(tmp_path / "nan.npz", bad, y)
    for cmd in (["verify", str(tmp_path / "nan.npz"), "--pairs", "100"],
                ["fewshot", str(tmp_path / "nan.npz"), "--episodes", "5"]):
        code, text = _main(capsys, *cmd)
        assert code == 2 and "NaN" in text and "Traceback" not in text, text
        assert len(text.strip().splitlines()) == 1


@pytest.mark.parametrize("args, match", [
    (["--pairs", "0"], "at least 2"),
    (["--folds", "1"], "folds must be an integer of at least 2"),
    (["--folds", "500", "--pairs", "100"], "exceeds the number of pairs"),
    (["--distance", "bogus"], "unknown distance 'bogus'"),
])
def test_cli_verify_user_errors_are_one_line(tmp_path, capsys, args, match):
    x, y = _clusters(classes=8, per=8)
    save_embeddings(tmp_path / "e.npz", x, y)
    code, text = _main(capsys, "verify", str(tmp_path / "e.npz"), *args)
    assert code == 2 and match in " ".join(text.split()) and "Traceback" not in text, text
    assert len(text.strip().splitlines()) == 1


def test_cli_fewshot_and_verify_argument_errors(tmp_path, capsys):
    x, y = _clusters(classes=8, per=8)
    save_embeddings(tmp_path / "e.npz", x, y)
    code, text = _main(capsys, "fewshot", str(tmp_path / "e.npz"), "--queries", "0")
    assert code == 2 and "at least one query" in text
    code, text = _main(capsys, "fewshot", str(tmp_path / "e.npz"), "--distance", "bogus")
    assert code == 2 and "unknown distance" in text
    code, text = _main(capsys, "verify")
    assert code == 2 and "either EMBEDDINGS" in " ".join(text.split())
    code, text = _main(capsys, "verify", str(tmp_path / "e.npz"), "--pair-list", str(tmp_path / "none.txt"))
    assert code == 2 and "pair list not found" in " ".join(text.split())


def test_few_shot_counts_the_answers_that_a_tie_with_the_true_class_decides():
    """Classes 1 and 2 share one point, class 0 another: every query of 1 or 2 is exactly as
    close to both prototypes, and the class that sorts first (1) is taken: accuracy 2/3 from
    the labels' order. Those queries (2 of 3) are counted in one warning; class 0's queries,
    untied, are not; nor are any with distinct embeddings."""
    import re
    import warnings

    x = np.repeat(np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]], np.float32), 6, axis=0)
    y = np.repeat(np.arange(3), 6)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        res = few_shot_accuracy(x, y, n_way=3, k_shot=1, n_query=5, episodes=4, seed=0)
    messages = [str(w.message) for w in record if "exactly as close" in str(w.message)]
    assert len(messages) == 1 and re.match(r"few-shot: 40 of 60 queries", messages[0])
    assert res["accuracy"] == pytest.approx(2 / 3)
    rng = np.random.default_rng(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        few_shot_accuracy(rng.standard_normal((18, 4)).astype(np.float32), y, n_way=3, k_shot=1,
                          n_query=5, episodes=4, seed=0)


def test_only_a_tie_that_holds_the_true_class_is_decided_by_class_order():
    from dmlkit.apps.fewshot import _tie_ruled_answers

    classes = np.array([3, 5, 7])
    closeness = np.array([[-1.0, -1.0, -4.0],   # truth 3 tied with 5 for the best: counted
                          [-1.0, -1.0, -4.0],   # truth 7 is not among the tied best: wrong anyway
                          [-2.0, -1.0, -1.5],   # a unique best
                          [-1.0, -1.0, -1.0]])  # all tied (collapsed): counted
    assert _tie_ruled_answers(classes, closeness, np.array([3, 7, 5, 7])) == 2
