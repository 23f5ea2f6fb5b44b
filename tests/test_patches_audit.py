"""Audit of the patch-correspondence application: each test pins one bug that gave a silent wrong
number, a traceback instead of one error line, or behaviour against the docs / the Brown protocol;
FPR95 through the patch pipeline is checked against a brute-force numpy reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from _reference import brown_subset, one_error_line, tiny_patch_run
from dmlkit.apps.patches import (
    PatchPairs,
    build_patch_model,
    load_patch_config,
    load_patch_model,
    load_subset,
    match_patches,
    mutual_matches,
    prepare_patches,
    run_patch_protocol,
    score_matrix,
    score_pairs,
    train_patch_model,
    write_brown_subset,
)
from dmlkit.apps.patches.brown import match_files
from dmlkit.apps.patches.offline import OfflineSpec
from dmlkit.apps.patches.training import TrainSettings
from dmlkit.exceptions import CheckpointError, ConfigError, DataError, NonFiniteError, ShapeError
from dmlkit.metrics import fpr95

pytestmark = pytest.mark.usefixtures("one_thread")


# -- helpers -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two small subsets and a trained run (one siam-l2 model, 4 steps)."""
    return tiny_patch_run(tmp_path_factory.mktemp("tiny"))


# -- Brown layout --------------------------------------------------------------------------------
def test_rewriting_a_subset_removes_its_old_match_files(tmp_path: Path) -> None:
    """Was: m50 files of an earlier build stayed beside the new ones, and the protocol (largest
    file for training, smallest for testing) silently read the stale pairs, whose labels no longer
    agree with the new info.txt."""
    brown_subset(tmp_path / "s", 20, (40, 20), seed=0)
    point_ids = brown_subset(tmp_path / "s", 30, (30, 24), seed=5)
    assert sorted(match_files(tmp_path / "s")) == [24, 30]
    sub = load_subset(tmp_path, "s")
    for largest in (True, False):
        p = sub.pairs(largest=largest)
        assert np.array_equal(p.label, (point_ids[p.left] == point_ids[p.right]).astype(np.int64))


def test_rewriting_a_subset_keeps_the_users_other_files(tmp_path: Path) -> None:
    """Was: every .bmp of the folder was removed before the new sheets were written (a user's
    holiday_photo.bmp, Figure.BMP), though only patches<4 digits>.bmp are sheets."""
    folder = tmp_path / "s"
    folder.mkdir()
    user = {"holiday_photo.bmp": b"BM user image", "Figure.BMP": b"BM another",
            "patches0000 (copy).bmp": b"BM not a sheet", "notes.txt": b"mine"}
    for name, data in user.items():
        (folder / name).write_bytes(data)
    brown_subset(folder, 200, (20,), seed=0)  # 400 patches: patches0000.bmp and patches0001.bmp
    brown_subset(folder, 20, (12,), seed=1)  # one sheet: the earlier subset's second one is removed
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name in user} == user
    assert sorted(p.name for p in folder.iterdir() if p.name not in user) == [
        "info.txt", "m50_12_12_0.txt", "patches0000.bmp"]


def test_bad_pairs_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    """Was: a pair index past the patches was an IndexError, a negative one wrapped around, and
    the sheets and info.txt were already replaced when the pairs were found wrong."""
    brown_subset(tmp_path / "s", 10, (12,), seed=0)
    before = {p.name: p.read_bytes() for p in (tmp_path / "s").iterdir()}
    patches = np.zeros((4, 64, 64), np.uint8)
    ids = np.array([0, 0, 1, 1], np.int64)
    for left in ([0, 4], [0, -1]):
        bad = PatchPairs(np.array(left, np.int64), np.array([1, 2], np.int64), np.array([1, 0], np.int64))
        with pytest.raises(DataError, match="patch"):
            write_brown_subset(tmp_path / "s", patches, ids, ids, {2: bad})
        assert {p.name: p.read_bytes() for p in (tmp_path / "s").iterdir()} == before


def test_default_test_pairs_are_the_100k_list(tmp_path: Path) -> None:
    """Was: ``test_pairs: null`` took the smallest m50 file, which for the real Brown subsets is
    m50_1000_1000_0.txt (they ship 1k ... 500k files), not the 100k test list of the protocol."""
    brown_subset(tmp_path / "liberty", 10, (12,), seed=0)
    folder = tmp_path / "liberty"
    lines = (folder / "m50_12_12_0.txt").read_text().splitlines(True)
    (folder / "m50_12_12_0.txt").unlink()
    for n in (1000, 100000, 500000):  # n lines each: a file with fewer than its name says is refused
        (folder / f"m50_{n}_{n}_0.txt").write_text("".join(lines) * (n // 12) + "".join(lines[: n % 12]))
    sub = load_subset(tmp_path, "liberty")
    assert sub.pairs(largest=False).source == "m50_100000_100000_0.txt"
    assert sub.pairs(largest=True).source == "m50_500000_500000_0.txt"
    assert sub.pairs(1000).source == "m50_1000_1000_0.txt"
    (folder / "m50_100000_100000_0.txt").unlink()  # no 100k file (the offline data): the smallest
    assert load_subset(tmp_path, "liberty").pairs(largest=False).source == "m50_1000_1000_0.txt"


def test_empty_info_file_is_an_error(tmp_path: Path) -> None:
    """Was: an empty info.txt loaded as a subset of 0 patches (and a numpy warning)."""
    brown_subset(tmp_path / "s", 10, (12,), seed=0)
    (tmp_path / "s" / "info.txt").write_text("")
    with pytest.raises(DataError, match="info.txt"):
        load_subset(tmp_path, "s")


# -- matching ------------------------------------------------------------------------------------
def _brute_mutual(s: np.ndarray) -> set[tuple[int, int]]:
    out = set()
    for i in range(s.shape[0]):
        j = int(np.argmax(s[i]))
        if int(np.argmax(s[:, j])) == i:
            out.add((i, j))
    return out


def test_mutual_matches_against_brute_force_and_nan() -> None:
    """Was: a NaN score (a diverged network) was taken as the best match of its row and column."""
    rng = np.random.default_rng(0)
    s = -rng.integers(0, 6, (7, 9)).astype(np.float64)  # ties included
    m = mutual_matches(s)
    assert set(zip(m.i.tolist(), m.j.tolist())) == _brute_mutual(s)
    assert np.array_equal(m.score, s[m.i, m.j])
    bad = np.array([[np.nan, -1.0], [-1.0, -2.0]])
    with pytest.raises(NonFiniteError):
        mutual_matches(bad)
    with pytest.raises(NonFiniteError):
        mutual_matches(bad, ratio=0.8)


@pytest.mark.parametrize("shape", [(0, 3), (3, 0), (0, 0)])
def test_mutual_matches_of_an_empty_set_is_a_shape_error(shape: tuple[int, int]) -> None:
    """Was: an empty score matrix (no patches on one side) was a raw IndexError from argmax,
    where score_matrix refuses the same empty set with a ShapeError."""
    with pytest.raises(ShapeError, match="both sets need patches"):
        mutual_matches(np.zeros(shape))


def test_ratio_test_refuses_decision_networks() -> None:
    """Was: with a 2-channel network whose logits were all negative, Lowe's ratio test ran on the
    logits as if they were distances (the docs: the ratio test is for descriptor networks)."""
    torch.manual_seed(0)
    net = build_patch_model("2ch", 32, 0.125)
    with torch.no_grad():
        net.head[-1].bias.fill_(-100.0)
    x = prepare_patches(np.random.default_rng(0).integers(0, 255, (6, 64, 64)).astype(np.uint8), 32)
    with pytest.raises(ConfigError, match="descriptor"):
        match_patches(net, x[:3], x[3:], ratio=1.0)
    assert len(match_patches(net, x[:3], x[3:])) >= 1  # without the ratio test: fine
    desc = build_patch_model("siam-l2", 32, 0.125)
    match_patches(desc, x[:3], x[3:], ratio=0.9)


def test_score_matrix_puts_a_patch_at_distance_zero_from_itself() -> None:
    """Was: the descriptor distances came from torch.cdist's matrix-product shortcut, whose
    cancellation put a descriptor about 1e-3 from an exact copy of itself (near-ties in the
    mutual matches and the ratio test reordered); now the direct difference, as score_pairs."""
    torch.manual_seed(0)
    net = build_patch_model("siam-l2", 32, 0.125)
    x = prepare_patches(np.random.default_rng(1).integers(0, 255, (40, 64, 64)).astype(np.uint8), 32)
    s = score_matrix(net, x, x)
    assert torch.all(s.diagonal() == 0)
    d = net.describe(x, 0).double()
    assert torch.allclose(s.double(), -torch.cdist(d, d, compute_mode="donot_use_mm_for_euclid_dist"), atol=1e-5)


@pytest.mark.parametrize("arch", ["siam-l2", "2ch"])
@pytest.mark.parametrize("left, right", [([-1], [0]), ([0], [-2]), ([0], [5]), ([7], [0])])
def test_pair_indices_outside_the_patches_are_refused(arch: str, left: list[int], right: list[int]) -> None:
    """Was: score_pairs and train_patch_model took -1 as the last patch (the score of another
    pair, silently) and an index past the patches was a raw IndexError."""
    x = prepare_patches(np.random.default_rng(0).integers(0, 256, (5, 64, 64), dtype=np.uint8), 32)
    torch.manual_seed(0)
    net = build_patch_model(arch, 32, 0.125)
    bad = PatchPairs(np.array(left * 4), np.array(right * 4), np.ones(4, np.int64))
    with pytest.raises(DataError, match="outside the 5 patches"):
        score_pairs(net, x, bad)
    with pytest.raises(DataError, match="outside the 5 patches"):
        train_patch_model(net, x, bad, np.arange(5), TrainSettings(batch_size=4, epochs=1))


def test_pairs_of_mismatched_sides_are_refused() -> None:
    """Was: a right side of one index was broadcast against every left one by the descriptor
    networks (three scores of pairs nobody asked for); float indices and labels other than 1/0
    were taken as given."""
    one = np.array([1], np.int64)
    three = np.array([0, 1, 2], np.int64)
    with pytest.raises(ShapeError, match="lengths 3, 1 and 3"):
        PatchPairs(three, one, np.array([1, 0, 0]))
    with pytest.raises(ShapeError, match="lengths 3, 3 and 1"):
        PatchPairs(three, three, one)
    with pytest.raises(ShapeError, match="1-D"):
        PatchPairs(three.reshape(3, 1), three.reshape(3, 1), np.ones((3, 1), np.int64))
    with pytest.raises(DataError, match="integers"):
        PatchPairs(three.astype(np.float64), three, np.ones(3, np.int64))
    with pytest.raises(DataError, match="1 .a match. or 0"):
        PatchPairs(three, three, np.array([1, 2, 0]))
    x = prepare_patches(np.zeros((3, 64, 64), np.uint8), 32)
    net = build_patch_model("hardnet", 32, 0.125)
    with pytest.raises(ShapeError, match="point_ids"):
        train_patch_model(net, x, PatchPairs(three, three, np.ones(3, np.int64)), np.arange(5),
                          TrainSettings(batch_size=4))


# -- FPR95 through the pipeline --------------------------------------------------------------------
def _brute_fpr95_distances(d: np.ndarray, y: np.ndarray) -> float:
    """Accept ``d <= t``; the smallest threshold (over every distinct distance) reaching 95 % recall."""
    best = None
    for t in np.unique(d):
        acc = d <= t
        if acc[y == 1].sum() * 100 >= 95 * (y == 1).sum():
            best = acc[y == 0].mean()
            break
    return float(best)


def test_fpr95_of_descriptor_distances_matches_brute_force() -> None:
    """score_pairs gives higher-is-match scores (-L2 distance); FPR95 on them equals the brute
    force on the distances themselves, ties included (distances rounded to make ties)."""
    torch.manual_seed(0)
    net = build_patch_model("siam-l2", 32, 0.125).eval()
    rng = np.random.default_rng(1)
    x = prepare_patches(rng.integers(0, 256, (40, 64, 64)).astype(np.uint8), 32)
    left = rng.integers(0, 40, 300).astype(np.int64)
    right = rng.integers(0, 40, 300).astype(np.int64)
    label = (rng.random(300) < 0.5).astype(np.int64)
    scores = score_pairs(net, x, PatchPairs(left, right, label))
    with torch.no_grad():
        da, db = net.describe(x[left]).double(), net.describe(x[right]).double()
    d = (da - db).norm(dim=1).numpy()
    assert np.allclose(scores, -d, atol=1e-5)
    dq = np.round(d * 20) / 20  # many ties
    assert fpr95(-dq, label) == _brute_fpr95_distances(dq, label)
    assert fpr95(dq, label, higher_is_positive=False) == _brute_fpr95_distances(dq, label)
    with pytest.raises(DataError):
        fpr95(-dq, np.ones_like(label))
    with pytest.raises(DataError):
        fpr95(-dq, np.zeros_like(label))
    with pytest.raises(NonFiniteError):
        fpr95(np.r_[np.nan, -dq[1:]], label)


# -- checkpoints, configs, resume ------------------------------------------------------------------
def test_garbage_checkpoint_is_one_error_line(tiny, tmp_path: Path, run_cli) -> None:
    """Was: a checkpoint that is not a torch file (or holds no dict) was an UnpicklingError /
    TypeError traceback."""
    bad = tmp_path / "bad.pt"
    bad.write_text("garbage\n")
    with pytest.raises(CheckpointError, match="bad.pt"):
        load_patch_model(bad)
    torch.save([1, 2], bad)
    with pytest.raises(CheckpointError, match="bad.pt"):
        load_patch_model(bad)
    import shutil

    _, run = tiny
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "models" / "siam-l2" / "a.pt").write_text("garbage\n")
    code, _, err = run_cli(["patches", "evaluate", str(copy), "--rescore"])
    assert "a.pt" in one_error_line(code, err)


def test_resume_refuses_a_checkpoint_of_other_settings(tiny, tmp_path: Path, run_cli) -> None:
    """Was: resuming into a run directory after changing the width, the epochs, the seed... loaded
    the old checkpoint silently and overwrote config.yaml with the new settings, so the table and
    the stored config described a model that was never trained."""
    import shutil

    cfg, run = tiny
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    stored = (copy / "config.yaml").read_text()
    for override in ("model.width=0.25", "training.epochs=2", "seed=3", "training.lr=0.01"):
        code, _, err = run_cli(["patches", "train", str(cfg), "-o", str(copy), "--set", override, "-q"])
        line = one_error_line(code, err)
        assert "--fresh" in line and override.split("=")[0].split(".")[-1] in line
        assert (copy / "config.yaml").read_text() == stored
    # the same settings still resume; --fresh retrains with the new ones
    code, _, err = run_cli(["patches", "train", str(cfg), "-o", str(copy)])
    assert code == 0 and "loaded" in err
    code, _, err = run_cli(["patches", "train", str(cfg), "-o", str(copy), "--set", "training.epochs=2", "--fresh", "-q"])
    assert code == 0, err


def test_the_same_subset_spelled_twice_is_refused(tiny, tmp_path: Path, run_cli) -> None:
    """Was: ``[[a, a]]`` was refused but ``[[a, a/]]`` (``./a``, an absolute path, a symlink)
    trained and tested on the same subset: the names were compared, not the folders."""
    import shutil

    import yaml

    cfg, run = tiny
    root = cfg.parent
    (tmp_path / "link").symlink_to(root / "a")
    for other in ("a/", "./a", str(root / "a"), str(tmp_path / "link")):
        combos = f"data.combinations=[[a, '{other}']]"
        code, _, err = run_cli(["patches", "train", str(cfg), "-o", str(tmp_path / "r"), "--set", combos, "-q"])
        line = one_error_line(code, err)
        assert "must differ" in line and f"'{other}'" in line and not (tmp_path / "r").exists()
    copy = tmp_path / "run"  # a run of an older dmlkit, which accepted the spelling
    shutil.copytree(run, copy)
    stored = yaml.safe_load((copy / "config.yaml").read_text())
    stored["data"]["combinations"] = [["a", "a/"]]
    (copy / "config.yaml").write_text(yaml.safe_dump(stored))
    code, _, err = run_cli(["patches", "evaluate", str(copy), "--rescore"])
    assert "'a/'" in one_error_line(code, err)


def test_a_killed_rerun_leaves_no_table_of_the_run_before(tiny, tmp_path: Path, run_cli) -> None:
    """Was: config.yaml is rewritten when a run starts and results.json / results.md when it
    ends, so a re-run with other settings killed in between left the previous run's table, which
    `patches evaluate` printed as the table of the new config and models."""
    import json
    import shutil

    cfg, run = tiny
    copy = tmp_path / "run"
    shutil.copytree(run, copy)

    def killed(message: str) -> None:
        if message.startswith("siam-l2 trained on a"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_patch_protocol(load_patch_config(cfg, ["training.lr=0.01"]), copy, resume=False, log=killed)
    assert not (copy / "results.json").exists() and not (copy / "results.md").exists()
    code, out, err = run_cli(["patches", "evaluate", str(copy), "--json"])  # scores the new models
    assert code == 0, err
    code, rescored, err = run_cli(["patches", "evaluate", str(copy), "--rescore", "--json"])
    assert code == 0 and json.loads(out) == json.loads(rescored), err


def test_evaluate_refuses_a_table_of_another_config(tiny, tmp_path: Path, run_cli) -> None:
    """Was: a results.json left by a killed re-run of an older dmlkit was printed as the table of
    the run's config.yaml, which it was not written for; without a table, the checkpoints the
    re-run had not retrained yet were scored as if trained with config.yaml's settings."""
    import json
    import shutil

    import yaml

    _, run = tiny
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    stored = yaml.safe_load((copy / "config.yaml").read_text())
    stored["training"]["lr"] = 0.01
    (copy / "config.yaml").write_text(yaml.safe_dump(stored))
    code, _, err = run_cli(["patches", "evaluate", str(copy)])
    line = one_error_line(code, err)
    assert "training.lr=0.001" in line and "0.01" in line and "--rescore" in line
    results = json.loads((copy / "results.json").read_text())
    del results["config"]
    (copy / "results.json").write_text(json.dumps(results))
    code, _, err = run_cli(["patches", "evaluate", str(copy)])
    assert "no valid config" in one_error_line(code, err)
    # no table (a run of this dmlkit killed before retraining): the checkpoint is not scored
    # under a config it was not trained with
    (copy / "results.json").unlink()
    for argv in (["patches", "evaluate", str(copy)], ["patches", "evaluate", str(copy), "--rescore"]):
        code, _, err = run_cli(argv)
        line = one_error_line(code, err)
        assert "lr=0.001" in line and "--fresh" in line


def test_negative_seeds_are_config_errors(tiny, tmp_path: Path, run_cli) -> None:
    """Was: a negative seed was a numpy ValueError traceback, after the run directory was written
    (train) or before anything was built (build-data)."""
    cfg, _ = tiny
    with pytest.raises(ConfigError, match="seed"):
        load_patch_config(cfg, ["seed=-1"])
    with pytest.raises(ConfigError, match="seed"):
        TrainSettings(seed=-1)
    with pytest.raises(ConfigError, match="seed"):
        OfflineSpec(seed=-1)
    code, _, err = run_cli(["patches", "train", str(cfg), "-o", str(tmp_path / "r"), "--set", "seed=-1"])
    assert "seed" in one_error_line(code, err) and not (tmp_path / "r").exists()
    code, _, err = run_cli(["patches", "build-data", "-o", str(tmp_path / "d"), "--subset", "photos", "--seed", "-1"])
    assert "seed" in one_error_line(code, err)


def test_evaluate_refuses_a_figure_format_up_front(tiny, tmp_path: Path, run_cli) -> None:
    """Was: ``--figure out.xyz`` printed the table, then a matplotlib ValueError traceback."""
    _, run = tiny
    code, out, err = run_cli(["patches", "evaluate", str(run), "--figure", str(tmp_path / "f.xyz")])
    assert "xyz" in one_error_line(code, err) and out == ""
    code, _, err = run_cli(["patches", "evaluate", str(run), "--figure", str(tmp_path / "f.png"), "-k", "2"])
    assert code == 0, err
    assert (tmp_path / "f.png").stat().st_size > 1000


def test_evaluate_options_that_need_another_option(tiny, run_cli) -> None:
    """Was: ``--max-test-pairs`` without ``--rescore`` (and ``--arch`` without ``--figure``)
    were ignored: the stored table came back as if it were scored on the pairs asked for."""
    _, run = tiny
    code, _, err = run_cli(["patches", "evaluate", str(run), "--max-test-pairs", "10"])
    assert "--rescore" in one_error_line(code, err)
    code, _, err = run_cli(["patches", "evaluate", str(run), "--arch", "siam-l2"])
    assert "--figure" in one_error_line(code, err)
    code, out, err = run_cli(["patches", "evaluate", str(run), "--rescore", "--max-test-pairs", "10", "--json"])
    assert code == 0, err


def test_build_data_checks_every_subset_name_first(tmp_path: Path, run_cli) -> None:
    """Was: ``--subset photos --subset nope`` rebuilt photos, then failed without writing the
    manifest, which kept photos' old settings and SHA-256 (no longer those of its files)."""
    out = tmp_path / "o"
    code, _, err = run_cli(["patches", "build-data", "-o", str(out), "--points", "10", "--train-pairs", "20",
                         "--test-pairs", "10", "--subset", "photos", "--subset", "nope"])
    assert "nope" in one_error_line(code, err)
    assert not (out / "photos").exists()  # nothing built


@pytest.mark.parametrize("archs", ["[]", "[siam-l2, siam-l2]"])
def test_architectures_must_be_some_and_distinct(tiny, tmp_path: Path, run_cli, archs: str) -> None:
    """Was: an empty list trained nothing, then printing the table was a ValueError traceback
    (after the run directory was written); a repeated name gave a table with a repeated column."""
    cfg, _ = tiny
    with pytest.raises(ConfigError, match="architectures"):
        load_patch_config(cfg, [f"model.architectures={archs}"])
    code, _, err = run_cli(["patches", "train", str(cfg), "-o", str(tmp_path / "r"), "--set", f"model.architectures={archs}"])
    assert "architectures" in one_error_line(code, err) and not (tmp_path / "r").exists()


def test_hardnet_batch_larger_than_the_points_names_batch_size(tmp_path: Path) -> None:
    """Was: the sampler's message, 'lower classes_per_batch', an option the patch settings lack."""
    point_ids = brown_subset(tmp_path / "s", 12, (40,), seed=0)
    sub = load_subset(tmp_path, "s")
    net = build_patch_model("hardnet", 32, 0.125)
    with pytest.raises(DataError, match="training.batch_size"):
        train_patch_model(net, prepare_patches(sub.patches, 32), sub.pairs(), point_ids, TrainSettings(batch_size=32))


@pytest.mark.parametrize("override", ["data.test_pairs=7", "data.train_pairs=7"])
def test_missing_match_file_is_found_before_training(tiny, tmp_path: Path, run_cli, override: str) -> None:
    """Was: a test_pairs with no m50 file was found after the first subset's models had trained
    (hours on Brown), a train_pairs one after the run directory was written."""
    cfg, _ = tiny
    code, _, err = run_cli(["patches", "train", str(cfg), "-o", str(tmp_path / "r"), "--set", override])
    assert "7 pairs" in one_error_line(code, err) and not (tmp_path / "r").exists()
