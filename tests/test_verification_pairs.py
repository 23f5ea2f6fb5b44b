"""Verification on official pair lists: LFW pairs.txt / CSV reading and the 10-fold protocol.

The fixture writes real faces (AT&T, 40 subjects x 10 photos) in LFW's layout
(``lfw/<Name>/<Name>_<nnnn>.jpg``) with a generated ``pairs.txt`` of 10 person-disjoint folds.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from dmlkit.apps.index_files import run_item_files
from dmlkit.apps.verification import (
    _best_threshold,
    stratified_folds,
    verify_pair_list,
    verify_scores,
)
from dmlkit.cli import app
from dmlkit.data import load_dataset
from dmlkit.data.pairs import (
    find_lfw_image,
    lfw_identity,
    load_pair_list,
    parse_lfw_pairs,
    read_pair_csv,
)
from dmlkit.exceptions import ConfigError, DataError, DataNotFoundError, NonFiniteError
from dmlkit.utils import save_embeddings

FOLDS, PER_FOLD = 10, 6  # 6 matched + 6 mismatched pairs per fold, 4 people per fold

pytestmark = pytest.mark.usefixtures("one_thread")


def _name(s: int) -> str:
    return f"Subject-{s:02d}_Face" if s % 3 == 0 else f"Subject_{s:02d}"  # hyphens, underscores


@pytest.fixture(scope="module")
def lfw(tmp_path_factory, request) -> Path:
    """``root/lfw/<Name>/<Name>_<nnnn>.jpg`` from AT&T faces, plus ``root/pairs.txt``."""
    from PIL import Image

    data_root = request.getfixturevalue("data_root")
    root = tmp_path_factory.mktemp("lfw_root")
    for s in range(1, 41):
        d = root / "lfw" / _name(s)
        d.mkdir(parents=True)
        for n in range(1, 11):
            with Image.open(data_root / "att_faces" / f"s{s}" / f"{n}.pgm") as img:
                img.convert("RGB").save(d / f"{_name(s)}_{n:04d}.jpg", quality=95)
    rng = np.random.default_rng(0)
    lines = [f"{FOLDS}\t{PER_FOLD}"]
    for f in range(FOLDS):
        people = list(range(4 * f + 1, 4 * f + 5))  # person-disjoint folds, as in LFW
        for k in range(PER_FOLD):
            n1, n2 = rng.choice(np.arange(1, 11), 2, replace=False)
            lines.append(f"{_name(people[k % 4])}\t{n1}\t{n2}")
        for _ in range(PER_FOLD):
            a, b = rng.choice(people, 2, replace=False)
            lines.append(f"{_name(a)}\t{rng.integers(1, 11)}\t{_name(b)}\t{rng.integers(1, 11)}")
    (root / "pairs.txt").write_text("\n".join(lines) + "\n")
    return root


_PIXELS: dict[str, np.ndarray] = {}


def _pixels(paths: list[str]) -> np.ndarray:
    """Raw pixels (downsampled 4x, centred) as the embedding: no model, fully deterministic."""
    from PIL import Image

    for p in paths:
        if p not in _PIXELS:
            with Image.open(p) as img:
                img.draft("L", (23, 28))
                a = np.asarray(img.convert("L").resize((23, 28)), dtype=np.float32).ravel()
            _PIXELS[p] = a - a.mean()
    return np.stack([_PIXELS[p] for p in paths])


# -- reading ---------------------------------------------------------------------------------
def test_parse_lfw_pairs_folds_and_identity(lfw):
    pairs = parse_lfw_pairs(lfw / "pairs.txt")
    assert len(pairs) == 2 * FOLDS * PER_FOLD
    assert [p.fold for p in pairs] == [k // (2 * PER_FOLD) for k in range(len(pairs))]
    # each fold: PER_FOLD matched lines then PER_FOLD mismatched lines
    same = np.array([p.same for p in pairs]).reshape(FOLDS, 2 * PER_FOLD)
    assert same[:, :PER_FOLD].all() and not same[:, PER_FOLD:].any()
    assert pairs[0].line == 2 and pairs[0].name1 == pairs[0].name2


def test_pair_list_resolves_names_to_files(lfw):
    plist = load_pair_list(lfw / "pairs.txt", lfw)  # the parent of lfw/ is accepted
    raw = parse_lfw_pairs(lfw / "pairs.txt")
    assert len(plist) == len(raw) and plist.num_folds == FOLDS
    for k in (0, 7, len(raw) - 1):
        a, b = plist.paths[plist.left[k]], plist.paths[plist.right[k]]
        assert lfw_identity(a) == (raw[k].name1, raw[k].num1)
        assert lfw_identity(b) == (raw[k].name2, raw[k].num2)
        assert Path(a).parent.name == raw[k].name1
    assert len(set(plist.paths)) == len(plist.paths)
    np.testing.assert_array_equal(plist.same, [p.same for p in raw])


def test_flat_folder_with_lfw_names(tmp_path, lfw):
    src = lfw / "lfw" / _name(3) / f"{_name(3)}_0002.jpg"
    (tmp_path / src.name).write_bytes(src.read_bytes())
    assert find_lfw_image(tmp_path, _name(3), 2) == tmp_path / src.name
    assert find_lfw_image(tmp_path, _name(3), 3) is None
    assert lfw_identity("x/Jean-Pierre_Raffarin_0012.jpg") == ("Jean-Pierre_Raffarin", 12)


def test_pair_list_finds_upper_case_suffixes_as_the_lfw_loader(tmp_path, lfw):
    # load_dataset("lfw") read Name_0001.JPG (suffixes in any case) but the pair list tried the
    # lower-case names only and called every image of the list missing
    for person, k, suffix in ((1, 1, ".JPG"), (1, 2, ".Png"), (2, 1, ".jpeg")):
        stem = f"{_name(person)}_{k:04d}"
        (tmp_path / "lfw" / _name(person)).mkdir(parents=True, exist_ok=True)
        (tmp_path / "lfw" / _name(person) / f"{stem}{suffix}").write_bytes((lfw / "lfw" / _name(person) / f"{stem}.jpg").read_bytes())
    (tmp_path / "pairs.txt").write_text(f"1\n{_name(1)}\t1\t2\n{_name(1)}\t2\t{_name(2)}\t1\n")
    loaded = sorted(load_dataset("lfw", root=tmp_path).paths)
    listed = sorted(set(load_pair_list(tmp_path / "pairs.txt", tmp_path).paths))
    assert listed == [str(p) for p in loaded] and len(listed) == 3
    assert find_lfw_image(tmp_path / "lfw", _name(1), 4) is None


def test_missing_images_are_refused_and_listed(lfw, tmp_path):
    text = (lfw / "pairs.txt").read_text().splitlines()
    text[1] = f"{_name(1)}\t1\t11"  # image 11 does not exist
    text[2] = "Nobody_Here\t1\t2"
    (tmp_path / "pairs.txt").write_text("\n".join(text))
    with pytest.raises(DataNotFoundError) as err:
        load_pair_list(tmp_path / "pairs.txt", lfw / "lfw")
    msg = str(err.value)
    assert "2 of 120 pairs" in msg and f"line 2: {_name(1)}_0011" in msg
    assert "Nobody_Here_0001, Nobody_Here_0002" in msg


@pytest.mark.parametrize("bad, match", [
    ("10\t6\nA\t1\t2\n", "announces 10 fold"),
    ("1\t1\nA\t1\t2\nA\t1\tB\n", r"p\.txt:3: expected"),
    ("1\t1\nA\t1\t2\nA\t1\tA\t2\n", "names one person twice"),
    ("folds pairs\n", "first line"),
])
def test_malformed_lfw_lists(tmp_path, bad, match):
    (tmp_path / "p.txt").write_text(bad)
    with pytest.raises(DataError, match=match):
        parse_lfw_pairs(tmp_path / "p.txt")


def test_csv_pairs_match_the_lfw_list(lfw, tmp_path):
    plist = load_pair_list(lfw / "pairs.txt", lfw)
    rows = ["path1,path2,same,fold"]
    for k in range(len(plist)):
        a = Path(plist.paths[plist.left[k]]).relative_to(lfw)
        b = Path(plist.paths[plist.right[k]]).relative_to(lfw)
        rows.append(f"{a},{b},{'true' if plist.same[k] else 'false'},{plist.folds[k] + 1}")
    (lfw / "pairs.csv").write_text("\n".join(rows))
    from_csv = read_pair_csv(lfw / "pairs.csv")  # relative to the CSV's folder
    np.testing.assert_array_equal(from_csv.same, plist.same)
    np.testing.assert_array_equal(from_csv.folds, plist.folds)  # renumbered from 0
    x = _pixels(plist.paths)
    r1 = verify_pair_list(x, plist)
    r2 = verify_pair_list(_pixels(from_csv.paths), from_csv)
    assert r1.to_dict() == r2.to_dict()
    # headerless, no folds column: stratified folds over the file order
    (tmp_path / "p.csv").write_text("\n".join(r.rsplit(",", 1)[0] for r in rows[1:]))
    plain = read_pair_csv(tmp_path / "p.csv", image_root=lfw)
    assert plain.folds is None
    r3 = verify_pair_list(_pixels(plain.paths), plain, folds=5)
    assert r3.fold_source == "stratified" and r3.folds == 5 and r3.roc_auc == r1.roc_auc
    (tmp_path / "q.csv").write_text("path1,path2,same\nnope.jpg,nope2.jpg,1\n")
    with pytest.raises(DataNotFoundError, match="nope.jpg"):
        read_pair_csv(tmp_path / "q.csv")


# -- the protocol ----------------------------------------------------------------------------
def test_ten_fold_protocol_on_the_lists_folds(lfw):
    from sklearn.metrics import roc_auc_score

    plist = load_pair_list(lfw / "pairs.txt", lfw)
    x = _pixels(plist.paths)
    res = verify_pair_list(x, plist)
    assert res.folds == FOLDS and res.fold_source == "list" and res.num_pairs == 120
    assert res.num_positive == res.num_negative == 60
    # reference: cosine scores by hand, per fold the best threshold of the 9 others
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    s = np.sum(xn[plist.left] * xn[plist.right], axis=1)
    for f in range(FOLDS):
        test = plist.folds == f
        t = res.fold_thresholds[f]
        train_acc = np.mean((s[~test] >= t) == plist.same[~test])
        cuts = np.r_[np.inf, np.sort(s[~test]), -np.inf]  # every distinct decision on the 9 folds
        best = max(np.mean((s[~test] >= c) == plist.same[~test]) for c in cuts)
        assert train_acc == pytest.approx(best)
        assert res.fold_accuracies[f] == pytest.approx(np.mean((s[test] >= t) == plist.same[test]))
    assert res.accuracy == pytest.approx(np.mean(res.fold_accuracies))
    assert res.accuracy_std == pytest.approx(np.std(res.fold_accuracies))
    assert res.accuracy_sem == pytest.approx(np.std(res.fold_accuracies, ddof=1) / np.sqrt(FOLDS))
    assert res.roc_auc == pytest.approx(roc_auc_score(plist.same, s), abs=1e-6)
    # same photo of a person beats different people: raw pixels are far above chance here
    assert res.accuracy > 0.7 and res.roc_auc > 0.8


def test_row_order_does_not_matter_and_unknown_rows_are_named(lfw):
    plist = load_pair_list(lfw / "pairs.txt", lfw)
    x = _pixels(plist.paths)
    perm = np.random.default_rng(1).permutation(len(x))
    shuffled = verify_pair_list(x[perm], plist, [plist.paths[i] for i in perm])
    assert shuffled.to_dict() == verify_pair_list(x, plist).to_dict()
    with pytest.raises(DataError, match="1 image"):
        verify_pair_list(x[1:], plist, plist.paths[1:])


def test_eer_and_tar_at_far_on_a_known_ranking():
    # 4 positives and 4 negatives, one negative above one positive
    scores = np.array([0.9, 0.8, 0.7, 0.4, 0.6, 0.3, 0.2, 0.1])
    same = np.array([1, 1, 1, 1, 0, 0, 0, 0], bool)
    r = verify_scores(scores, same, folds=stratified_folds(same, 2), far_targets=(0.25, 1.0))
    assert r.roc_auc == pytest.approx(15 / 16)
    assert r.eer == pytest.approx(0.25)
    assert r.tar_at_far == {"0.25": 1.0, "1": 1.0}
    r2 = verify_scores(scores, same, folds=2, far_targets=(0.2,))
    assert r2.tar_at_far["0.2"] == pytest.approx(0.75)  # 3 positives above the first negative


def test_fold_thresholds_separate_at_any_scale_and_between_adjacent_doubles():
    """The threshold fitted on the training folds lies strictly between the cut's two scores:
    ``s_max + 1e-6`` equalled ``s_max`` at 1e12 (the held-out top negatives were accepted:
    accuracy 0 instead of 2/3), and the midpoint of two adjacent doubles rounded onto the lower
    one (accuracy 1/3 instead of 1)."""
    folds = np.array([0, 0, 0, 1, 1, 1])
    huge = np.array([1e12, 1e12, 0.0] * 2)
    r = verify_scores(huge, np.array([0, 0, 1] * 2, bool), folds)
    assert r.accuracy == pytest.approx(2 / 3) and all(t > 1e12 for t in r.fold_thresholds)
    assert verify_scores(huge * 1e-3, np.array([0, 0, 1] * 2, bool), folds).accuracy == pytest.approx(2 / 3)
    top = np.nextafter(1.0, 2.0)
    r = verify_scores(np.array([top, 1.0, 1.0] * 2), np.array([1, 0, 0] * 2, bool), folds)
    assert r.accuracy == 1.0 and all(1.0 < t <= top for t in r.fold_thresholds)
    t, _ = _best_threshold(np.array([-1e308, 1e308]), np.array([False, True]))
    assert -1e308 < t <= 1e308  # no overflow in the midpoint
    t, _ = _best_threshold(np.array([5e12, 4e12]), np.array([True, True]))
    assert t < 4e12  # accept everything


def test_stratified_folds_keep_the_ratio():
    same = np.r_[np.ones(30, bool), np.zeros(70, bool)]
    ids = stratified_folds(same, 10)
    for f in range(10):
        assert same[ids == f].sum() == 3 and (~same[ids == f]).sum() == 7
    with pytest.raises(ConfigError):
        stratified_folds(same, 1)
    t, acc = _best_threshold(np.array([0.1, 0.9]), np.array([False, True]))
    assert 0.1 < t < 0.9 and acc == 1.0


def test_nan_embeddings_are_refused(lfw):
    plist = load_pair_list(lfw / "pairs.txt", lfw)
    x = _pixels(plist.paths)
    x[3] = np.nan
    with pytest.raises(NonFiniteError, match="1 row"):
        verify_pair_list(x, plist)


def test_lfw_dataset_loader(lfw):
    ds = load_dataset("lfw", lfw)
    assert len(ds) == 400 and ds.num_classes == 40
    assert ds.class_names[0] == sorted(_name(s) for s in range(1, 41))[0]
    x, label = ds[0]
    assert tuple(x.shape) == (3, 112, 92) and label == 0
    with pytest.raises(DataNotFoundError, match="lfw"):
        load_dataset("lfw", lfw / "lfw" / _name(1), min_images=11)


# -- CLI -------------------------------------------------------------------------------------
def _tiny_checkpoint(path: Path) -> Path:
    """A dmlkit checkpoint of a small CNN (seeded random weights): enough to test the plumbing."""
    import torch

    from dmlkit.training import build_model, config_from_dict
    from dmlkit.training.checkpoint import save_checkpoint

    cfg = config_from_dict({
        "name": "tiny", "seed": 0,
        "data": {"dataset": "lfw", "transform": "grayscale", "image_size": 32},
        "model": {"trunk": "small_cnn", "pretrained": False, "in_channels": 1, "embedding_size": 16,
                  "freeze_batchnorm": False},
        "loss": {"name": "contrastive"},
        "training": {"device": "cpu"},
    })
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    save_checkpoint({"config": cfg.model_dump(mode="json"), "model": model.state_dict()}, path)
    return path


def test_cli_verify_with_checkpoint_and_embeddings(lfw, tmp_path):
    runner = CliRunner()
    ckpt = _tiny_checkpoint(tmp_path / "tiny.pt")
    res = runner.invoke(app, ["verify", "--checkpoint", str(ckpt), "-q", "--pair-list", str(lfw / "pairs.txt"),
                              "--images", str(lfw / "lfw"), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["folds"] == FOLDS and out["num_pairs"] == 120 and out["fold_source"] == "list"
    assert 0 <= out["accuracy"] <= 1 and set(out["tar_at_far"]) == {"0.001", "0.01", "0.1"}
    plist = load_pair_list(lfw / "pairs.txt", lfw)
    x = _pixels(plist.paths)
    save_embeddings(tmp_path / "e.npz", x, np.zeros(len(x)), paths=np.array(plist.paths))
    res = runner.invoke(app, ["verify", str(tmp_path / "e.npz"), "--pair-list", str(lfw / "pairs.txt"),
                              "--images", str(lfw), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["accuracy"] == pytest.approx(verify_pair_list(x, plist).accuracy)


def test_tar_at_a_far_the_pairs_cannot_resolve_is_said_so():
    """With ``n`` mismatched pairs a FAR target below ``1 / n`` admits no false accept: its TAR
    is the TAR at no false accept whatever the target. The value is kept (the highest TPR whose
    FPR does not exceed the target) and a warning names the targets and the pairs they need."""
    import warnings

    from dmlkit.apps.verification import verify_scores

    rng = np.random.default_rng(0)

    def run(n_neg: int):
        scores = np.r_[rng.normal(2.0, 1.0, 500), rng.normal(0.0, 1.0, n_neg)]
        same = np.r_[np.ones(500, bool), np.zeros(n_neg, bool)]
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            result = verify_scores(scores, same, folds=5)
        return result, [str(w.message) for w in record if "TAR at FAR" in str(w.message)]

    result, messages = run(999)
    assert messages == ["TAR at FAR 0.1 %: 999 mismatched pairs resolve false accept rates in steps "
                        "of 0.1 %, so it is the TAR with no false accept; score at least 1000 "
                        "mismatched pairs for it"]
    assert 0 <= result.tar_at_far["0.001"] <= result.tar_at_far["0.01"] <= result.tar_at_far["0.1"] <= 1
    _, messages = run(1000)
    assert messages == []
    _, messages = run(5)
    assert len(messages) == 1 and messages[0].startswith("TAR at FAR 0.1 %, 1 %, 10 %: 5 mismatched")
    assert "steps of 20 %, so these are" in messages[0] and messages[0].endswith("at least 1000 mismatched pairs for them")


@pytest.mark.parametrize("stored_under", ["parent", "lfw"])
@pytest.mark.parametrize("images_at", ["parent", "lfw"])
def test_run_item_files_under_either_documented_images_folder(tmp_path, stored_under, images_at):
    # docs/verification.md: --images is the folder of the person folders or its parent holding
    # lfw/; a run's ids (relative to its data root, either of the two) were pasted onto
    # --images as given, so `--images d/lfw` missed every `lfw/<Name>/...` id of a run on `d`
    people = tmp_path / "d" / "lfw"
    for name in ("Ann_A", "Bob_B"):
        (people / name).mkdir(parents=True)
        (people / name / f"{name}_0001.jpg").write_bytes(b"x")
    run = tmp_path / "run"
    (run / "embeddings").mkdir(parents=True)
    (run / "config.yaml").write_text("name: r\n")  # a run's file: its ids are relative
    ids = [f"{name}/{name}_0001.jpg" for name in ("Ann_A", "Bob_B")]
    if stored_under == "parent":
        ids = [f"lfw/{i}" for i in ids]
    images = people if images_at == "lfw" else people.parent
    files = run_item_files(run / "embeddings" / "test.npz", ids, images)
    assert [Path(f).resolve() for f in files] == [(people / n / f"{n}_0001.jpg").resolve() for n in ("Ann_A", "Bob_B")]
