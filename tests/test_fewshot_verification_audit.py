"""Audit of the few-shot and verification applications: brute-force recomputations of every
reported number, and bad input that used to give a number (or a traceback) instead of one
error line."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from scipy import stats
from sklearn.metrics import roc_auc_score

from dmlkit.apps.fewshot import few_shot_accuracy
from dmlkit.apps.verification import (
    kfold_threshold_accuracy,
    make_pairs,
    pair_scores,
    verify,
    verify_scores,
)
from dmlkit.embeddings import save_embeddings
from dmlkit.exceptions import ConfigError, NonFiniteError, ShapeError
from dmlkit.samplers import EpisodeSampler


def _brute_kfold(s: np.ndarray, y: np.ndarray, k: int) -> list[float]:
    """Fold accuracies with the threshold that is best on the other folds: every distinct
    training score (and +inf) tried as ``score >= c``, the highest best ``c`` kept, and the
    test fold cut at the midpoint between ``c`` and the highest training score below it (the
    documented rule; above every training score when nothing is accepted, below every one
    when everything is)."""
    ids = np.repeat(np.arange(k), [len(p) for p in np.array_split(np.arange(len(s)), k)])
    out = []
    for f in range(k):
        tr, te = ids != f, ids == f
        cands = np.concatenate([np.unique(s[tr]), [np.inf]])
        acc = np.array([((s[tr] >= c) == y[tr]).mean() for c in cands])
        c = cands[np.flatnonzero(acc == acc.max())[-1]]
        below = s[tr][s[tr] < c]
        if not np.isfinite(c):
            pred = s[te] > s[tr].max()
        elif below.size == 0:
            pred = s[te] > c - 1e-6
        else:
            pred = s[te] >= (c + below.max()) / 2
        out.append(float((pred == y[te]).mean()))
    return out


def test_kfold_accuracy_and_auc_match_brute_force():
    rng = np.random.default_rng(0)
    for trial in range(200):
        n = int(rng.integers(6, 30))
        s = rng.integers(0, 5, n).astype(float) if trial % 2 else rng.normal(size=n)
        y = rng.random(n) < 0.5
        if y.sum() in (0, n):
            continue
        k = int(rng.integers(2, 6))
        res = verify_scores(s, y, k)
        assert np.allclose(res.fold_accuracies, _brute_kfold(s, y, k))
        assert res.roc_auc == pytest.approx(roc_auc_score(y, s))
        assert res.accuracy_sem == pytest.approx(np.std(res.fold_accuracies, ddof=1) / np.sqrt(k))


def test_few_shot_accuracy_and_ci_match_brute_force():
    rng = np.random.default_rng(1)
    labels = np.repeat(np.arange(8) * 5 + 2, 9)
    x = rng.normal(size=(len(labels), 5)).astype(np.float32) + np.eye(5, dtype=np.float32)[labels % 5]
    n, k, q = 4, 2, 3
    res = few_shot_accuracy(x, labels, n, k, q, episodes=40, seed=7)
    accs = []
    for episode in EpisodeSampler(labels, n, k, q, 40, seed=7):
        ep = np.asarray(episode).reshape(n, k + q)
        protos = np.stack([x[row[:k]].astype(np.float64).mean(0) for row in ep])
        query = ep[:, k:].ravel()
        d = ((x[query].astype(np.float64)[:, None] - protos[None]) ** 2).sum(-1)
        accs.append(float((labels[ep[:, 0]][d.argmin(1)] == labels[query]).mean()))
    assert res["accuracy"] == pytest.approx(np.mean(accs))
    t = stats.t.ppf(0.975, len(accs) - 1)  # 2.023 at 40 episodes (1.96 covered 80 % at 3)
    assert res["ci95"] == pytest.approx(t * np.std(accs, ddof=1) / np.sqrt(len(accs)))
    assert few_shot_accuracy(x, labels, n, k, q, episodes=40, seed=7) == res


# -- problems found by the audit -------------------------------------------------------------

def test_a_shared_offset_moves_no_prototype():
    """Squared Euclidean distances do not change when every embedding moves by one offset; in
    float32 the ``|x|^2 + |c|^2 - 2 x.c`` form lost the nearest prototype near 10 + noise (512
    dimensions: query 0 went to class 2, 1e-4 relatively farther than class 4)."""
    from dmlkit.apps.fewshot import prototype_predict

    rng = np.random.default_rng(0)
    wrong = 0
    for _ in range(40):
        support = (10 + rng.normal(0, 0.2, (5, 512))).astype(np.float32)
        query = (10 + rng.normal(0, 0.2, (20, 512))).astype(np.float32)
        d = ((query.astype(np.float64)[:, None] - support.astype(np.float64)[None]) ** 2).sum(-1)
        wrong += int((prototype_predict(support, np.arange(5), query) != d.argmin(1)).sum())
    assert wrong == 0
    x = rng.normal(size=(400, 512)).astype(np.float32)
    y = np.repeat(np.arange(20), 20)
    assert (few_shot_accuracy(x + 10, y, 5, 1, 5, episodes=300, seed=0)
            == few_shot_accuracy(x, y, 5, 1, 5, episodes=300, seed=0))


def test_the_prototypical_rule_is_named_in_any_case():
    """``Euclidean`` went to the distances' normalised Euclidean (the cosine ranking), not the
    squared Euclidean of raw embeddings that ``euclidean`` names."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(120, 6)).astype(np.float32) * rng.uniform(0.2, 5, (120, 1)).astype(np.float32)
    y = np.repeat(np.arange(12), 10)
    want = few_shot_accuracy(x, y, 5, 1, 3, episodes=200, distance="euclidean")
    assert few_shot_accuracy(x, y, 5, 1, 3, episodes=200, distance="Euclidean") == want
    assert few_shot_accuracy(x, y, 5, 1, 3, episodes=200, distance="cosine") != want


def test_kfold_refuses_nan_scores():
    """NaN scores were sorted last and counted as "different": a made-up accuracy."""
    s = np.array([0.9, np.nan, 0.1, 0.8, 0.2, np.nan])
    y = np.array([1, 1, 0, 1, 0, 0], bool)
    with pytest.raises(NonFiniteError, match="NaN"):
        kfold_threshold_accuracy(s, y, 2)


@pytest.mark.parametrize("same", [[0, 1, 2, 0, 1, 0], [0.0, 1.0, 0.5, 0.0, 1.0, 0.0], [-1, 1, 1, -1, 1, -1]])
def test_same_must_be_booleans_or_zero_one(same):
    """``same = 2`` or ``0.5`` was cast to True and -1/+1 labels read as all matched."""
    s = np.linspace(0, 1, 6)
    with pytest.raises(ShapeError, match="same"):
        verify_scores(s, same, 2)
    with pytest.raises(ShapeError, match="same"):
        kfold_threshold_accuracy(s, same, 2)


def test_fold_ids_must_be_integers():
    """Fold ids 0.2 and 0.7 were truncated into one fold."""
    s, y = np.linspace(0, 1, 4), np.array([0, 1, 1, 0], bool)
    with pytest.raises(ShapeError, match="fold ids"):
        kfold_threshold_accuracy(s, y, [0.2, 0.7, 1.1, 1.9])
    with pytest.raises(ConfigError, match="folds"):
        kfold_threshold_accuracy(s, y, 2.5)


def test_pair_scores_refuse_rows_outside_the_embeddings():
    """A negative row silently read the last embedding; one past the end was an IndexError."""
    x = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
    with pytest.raises(ShapeError, match="rows"):
        pair_scores(x, np.array([-1]), np.array([0]))
    with pytest.raises(ShapeError, match="rows"):
        pair_scores(x, np.array([5]), np.array([0]))
    with pytest.raises(ShapeError):
        pair_scores(x, np.array([0, 1]), np.array([0]))


@pytest.mark.parametrize("labels", [[0.0, 0, 0, 1, 1, 1, np.nan, np.nan], [0.5, 0.5, 0.5, 1, 1, 1, 2, 2]])
def test_verify_refuses_nan_and_fractional_labels(labels):
    """NaN labels paired as "different" with every row, including each other."""
    x = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    with pytest.raises(ShapeError, match="labels"):
        verify(x, np.asarray(labels), num_pairs=6, folds=2)


def test_make_pairs_string_labels_still_pair_by_name():
    y = np.array(["a", "b", "a", "c", "b", "c"])
    i, j, same = make_pairs(y, 6, seed=0)
    assert (same == (y[i] == y[j])).all() and same.sum() == 3


@pytest.mark.parametrize("seed", [-1, None, 1.5])
def test_verify_refuses_a_bad_seed(seed):
    """seed=None drew different pairs on every call; -1 ended in numpy's ValueError."""
    x = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    with pytest.raises(ConfigError, match="seed"):
        verify(x, np.repeat(np.arange(4), 2), num_pairs=6, folds=2, seed=seed)


def test_cli_verify_negative_seed_is_one_line(tmp_path, run_cli):
    x = np.random.default_rng(0).normal(size=(12, 3)).astype(np.float32)
    path = save_embeddings(tmp_path / "e.npz", x, np.repeat(np.arange(4), 3))
    code, _, err = run_cli(["verify", str(path), "--pairs", "10", "--folds", "2", "--seed", "-1"])
    assert code == 2
    assert err.strip().count("\n") == 0 and "seed" in err


def test_stratified_folds_refuse_a_fractional_fold_count():
    """2.5 folds dealt fractional ids that the int64 array truncated: folds {0, 1, 2} unequal."""
    from dmlkit.apps.verification import stratified_folds

    with pytest.raises(ConfigError, match="integer"):
        stratified_folds(np.array([1, 0] * 5, bool), 2.5)


def test_asking_for_more_pairs_than_the_labels_hold_warns():
    """Two classes of three give three same-class pairs each: 100 pairs asked, 12 made, and said."""
    labels = np.repeat([0, 1], 3)
    with pytest.warns(UserWarning, match=r"100 pairs asked for, but the labels give only 6 same-class pairs: using 12"):
        i, j, same = make_pairs(labels, num_pairs=100, seed=0)
    assert same.sum() == 6 and (~same).sum() == 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # enough pairs: no warning
        make_pairs(labels, num_pairs=8, seed=0)


def test_scarce_different_class_pairs_cap_the_pairs_as_scarce_same_class_ones_do():
    """A class of 100 and a class of 1: 4,950 same-class pairs but 100 different-class ones.
    6,000 pairs asked: 200 made (100 of each), with a warning naming the scarce kind; it was a
    ConfigError while scarce same-class pairs only warned. One class is refused before any
    warning about pair counts (it said "using 90 (45 same, 45 different)", then failed)."""
    from dmlkit.exceptions import DataError

    labels = np.r_[np.zeros(100, int), 1]
    with pytest.warns(UserWarning, match=r"give only 100 different-class pairs: using 200 \(100 same"):
        i, j, same = make_pairs(labels, num_pairs=6000, seed=0)
    assert same.sum() == 100 and (~same).sum() == 100
    assert (labels[i] == labels[j]).tolist() == same.tolist()
    assert len({(min(a, b), max(a, b)) for a, b in zip(i.tolist(), j.tolist())}) == 200
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(DataError, match="share one class"):
            make_pairs(np.zeros(10, int), num_pairs=6000, seed=0)


def test_an_lfw_list_that_breaks_its_folds_layout_is_refused(tmp_path):
    """Fold ids come from line positions (``F N``: each fold N matched, then N mismatched): a
    matched line among the mismatched ones put 3 + 1 and 1 + 3 pairs in two folds, silently."""
    from dmlkit.data.pairs import parse_lfw_pairs
    from dmlkit.exceptions import DataError

    good = ["2\t2", "A\t1\t2", "A\t3\t4", "A\t1\tB\t1", "A\t2\tB\t2",
            "B\t1\t2", "B\t3\t4", "A\t3\tB\t3", "A\t4\tB\t4"]
    path = tmp_path / "pairs.txt"
    path.write_text("\n".join(good) + "\n")
    pairs = parse_lfw_pairs(path)
    assert [(p.fold, p.same) for p in pairs] == [(0, True)] * 2 + [(0, False)] * 2 + [(1, True)] * 2 + [(1, False)] * 2
    swapped = good[:3] + [good[5], good[4], good[3]] + good[6:]  # a matched line moved up a fold
    path.write_text("\n".join(swapped) + "\n")
    with pytest.raises(DataError, match=r"pairs.txt:4: a matched pair where the header's layout puts a mismatched one"):
        parse_lfw_pairs(path)


def test_a_csv_row_wider_than_the_first_line_or_header_is_refused(tmp_path):
    """Without a header the first row sets the columns: a later row's fold was dropped. A
    spreadsheet's trailing empty fields are no extra column."""
    from dmlkit.data.pairs import read_pair_csv
    from dmlkit.exceptions import DataError

    for name in "abcd":
        (tmp_path / f"{name}.png").touch()
    path = tmp_path / "pairs.csv"
    path.write_text("a.png,b.png,1,\nc.png,d.png,1\na.png,c.png,0,,\n")
    assert read_pair_csv(path).folds is None
    path.write_text("a.png,b.png,1\nc.png,d.png,1,1\na.png,c.png,0\n")
    with pytest.raises(DataError, match=r"pairs.csv:2: expected at most 3 fields \(as the first line\), got 4"):
        read_pair_csv(path)
    path.write_text("path1,path2,same,note\na.png,b.png,1\nc.png,d.png,0,x\na.png,c.png,0,x,1\n")
    with pytest.raises(DataError, match=r"pairs.csv:4: expected at most 4 fields \(as the header\), got 5"):
        read_pair_csv(path)


def test_an_image_with_two_different_embeddings_is_refused(tmp_path):
    """The last row of a duplicated path won: the row order decided AUC 0.5 or 1.0. Rows that
    repeat one embedding are one answer and pass."""
    from dmlkit.apps.verification import verify_pair_list
    from dmlkit.data.pairs import read_pair_csv
    from dmlkit.exceptions import DataError

    for name in "abcd":
        (tmp_path / f"{name}.png").touch()
    (tmp_path / "pairs.csv").write_text("path1,path2,same,fold\na.png,b.png,1,0\nc.png,d.png,1,1\n"
                                        "a.png,c.png,0,0\nb.png,d.png,0,1\n")
    pl = read_pair_csv(tmp_path / "pairs.csv")
    emb = np.array([[1, 0], [1, 0.1], [0, 1], [0.1, 1], [-1, 0]], np.float32)
    paths = [str(tmp_path / f"{n}.png") for n in "abcda"]
    with pytest.raises(DataError, match=r"1 image\(s\) of the pair list have two different embeddings.*a.png in rows 0 and 4"):
        verify_pair_list(emb, pl, paths)
    emb[4] = emb[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert verify_pair_list(emb, pl, paths).roc_auc == verify_pair_list(emb[:4], pl, paths[:4]).roc_auc == 1.0


def test_few_shot_ci_is_a_t_interval_and_a_zero_width_one_is_flagged():
    """Was: ``1.96 s / sqrt(E)``, which covered the true accuracy 80 % of the time at 3 episodes,
    and 3 episodes of well-separated classes that all scored 100 % printed "ci95 0.00" without a
    word though the accuracy is 97.4 %. Now ``t_{0.975, E-1} s / sqrt(E)`` (checked against
    brute force above) and a warning."""
    rng = np.random.default_rng(0)
    x = (rng.normal(0, 2.2, (30, 1, 8)) + rng.normal(0, 1, (30, 20, 8))).reshape(-1, 8).astype(np.float32)
    y = np.repeat(np.arange(30), 20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an interval with a spread: no warning
        assert few_shot_accuracy(x, y, 5, 1, 5, episodes=3, seed=0)["ci95"] > 0
    with pytest.warns(UserWarning, match="all 3 episodes scored the same, so the 95 % CI has zero width"):
        flat = few_shot_accuracy(x, y, 5, 1, 5, episodes=3, seed=7)
    assert flat["accuracy"] == 1.0 and flat["ci95"] == 0.0
    with pytest.warns(UserWarning, match="one episode gives no 95 % CI"):
        assert np.isnan(few_shot_accuracy(x, y, 5, 1, 5, episodes=1, seed=0)["ci95"])
