"""A new user's run through the applications beyond search (verification, few-shot, re-id,
patches, tracking): each test pins a bug found by running the documented workflows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


def _frames(folder: Path, n: int = 3, size: tuple[int, int] = (48, 64)) -> Path:
    """``n`` small RGB frames ``00001.png`` ... of a textured scene."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, size=(*size, 3), dtype=np.uint8)
    for i in range(n):
        Image.fromarray(np.roll(base, i, axis=1)).save(folder / f"{i + 1:05d}.png")
    return folder


# -- tracking: wrong output paths are refused before any frame is tracked ----------------------
def test_track_wrong_out_suffix_fails_before_tracking(tmp_path, run_cli):
    """``--out boxes.txt`` (meant for ``--boxes``) was refused only after tracking the whole
    video, with the ``--boxes`` file already written: exit 2 and a half-done result."""
    frames = _frames(tmp_path / "f")
    boxes = tmp_path / "b.txt"
    code, _, err = run_cli(["track", "--frames", str(frames), "--init-box", "10,10,20,16",
                            "--method", "ncc", "--out", str(tmp_path / "tracked.txt"),
                            "--boxes", str(boxes)])
    assert code == 2
    assert "cannot write" in err and ".gif" in err
    assert "Traceback" not in err
    assert not boxes.exists()  # nothing written: the error came before the tracking


def test_track_out_folder_that_is_a_file_and_boxes_folder_are_refused(tmp_path, run_cli):
    frames = _frames(tmp_path / "f")
    a_file = tmp_path / "frames_out"
    a_file.write_text("x")
    code, _, err = run_cli(["track", "--frames", str(frames), "--init-box", "10,10,20,16",
                            "--method", "ncc", "--out", str(a_file)])
    assert code == 2 and "is a file" in err
    code, _, err = run_cli(["track", "--frames", str(frames), "--init-box", "10,10,20,16",
                            "--method", "ncc", "--boxes", str(tmp_path)])
    assert code == 2 and "is a folder" in err


def test_write_frames_checks_its_output_first(tmp_path):
    from dmlkit.apps.tracking.render import check_output, write_frames
    from dmlkit.exceptions import ConfigError

    def frames():  # a generator that must not be consumed for a refused output
        raise AssertionError("frames were drawn for an output that is refused")
        yield  # pragma: no cover

    with pytest.raises(ConfigError, match="cannot write"):
        write_frames(frames(), tmp_path / "x.txt")
    assert check_output(tmp_path / "v.MP4").suffix == ".MP4"
    assert check_output(tmp_path / "folder") == tmp_path / "folder"


def test_track_evaluate_out_dir_that_is_a_file_fails_before_tracking(tmp_path, run_cli,
                                                                     monkeypatch):
    """``--out-dir`` naming a file failed only after every tracker had run on every sequence."""
    import dmlkit.apps.tracking as tracking

    called = []
    monkeypatch.setattr(tracking, "load_tracking_dataset", lambda *a, **k: called.append(1) or [])
    a_file = tmp_path / "results"
    a_file.write_text("x")
    code, _, err = run_cli(["track", "evaluate", str(tmp_path), "--methods", "ncc",
                            "--out-dir", str(a_file)])
    assert code == 2 and "is a file" in err
    assert not called


# -- re-id CLI: settings of the second (re-ranked) pass and the ranks fail before any work --------
@pytest.fixture
def reid_npz(tmp_path) -> Path:
    from dmlkit.embeddings import save_embeddings

    rng = np.random.default_rng(0)
    ids = np.repeat(np.arange(4), 4)
    path = tmp_path / "all.npz"
    save_embeddings(path, rng.normal(size=(16, 5)).astype(np.float32), ids,
                    cams=np.tile(np.arange(4), 4), groups=np.array(["query", "gallery"] * 8))
    return path


@pytest.mark.parametrize("extra, message", [
    (["--rerank", "--metric", "dot"], "re-ranking needs a distance"),
    (["--rerank", "--lambda", "1.5"], "--lambda must be a number in [0, 1]"),
    (["--ranks", "1,0"], "--ranks must be ranks >= 1"),
    (["--out", "{tmp}"], "is a folder"),
])
def test_reid_cli_refuses_bad_settings_before_evaluating(reid_npz, run_cli, monkeypatch, extra, message):
    """``--metric dot --rerank``, ``--lambda 1.5`` or ``--ranks 0`` were refused only after the
    plain evaluation had run (minutes at Market-1501 size), by the second pass or the table."""
    import dmlkit.apps.reid as reid

    def never(*args, **kwargs):
        raise AssertionError("evaluated before the settings were checked")

    monkeypatch.setattr(reid, "evaluate_reid", never)
    extra = [e.replace("{tmp}", str(reid_npz.parent)) for e in extra]
    code, _, err = run_cli(["reid", str(reid_npz), *extra])
    assert code == 2, err
    assert message in err and "Traceback" not in err


def test_reid_cli_rerank_still_runs(reid_npz, run_cli):
    code, out, err = run_cli(["reid", str(reid_npz), "--rerank", "--metric", "cosine", "--json",
                              "--k1", "3", "--k2", "2"])
    assert code == 0, err
    assert '"rerank"' in out


# -- reid --seed with --examples 0 on a query/gallery source: it drew nothing, silently accepted --
def test_reid_seed_without_examples_is_refused_in_one_line(reid_npz, run_cli):
    code, out, err = run_cli(["reid", str(reid_npz), "--examples", "0", "--seed", "3"])
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [err.strip()]
    assert "--seed does not apply here" in err and "--examples 0 stores none" in err


@pytest.mark.parametrize("args", [["--examples", "2", "--seed", "3"], ["--examples", "0"], ["--seed", "3"]])
def test_reid_seed_with_examples_or_examples_alone_still_run(reid_npz, run_cli, args):
    code, out, err = run_cli(["reid", str(reid_npz), "--json", *args])
    assert code == 0, err
    assert '"mAP"' in out or '"map"' in out


# -- verify: --folds with a pair list that has its own folds -------------------------------------
def _lfw_list(tmp_path: Path, folds: int = 2) -> tuple[Path, Path]:
    """A tiny LFW layout (4 people x 3 images) and an LFW ``pairs.txt`` of ``folds`` folds of
    1 matched + 1 mismatched pair, plus an embeddings ``.npz`` with a 'paths' array."""
    from PIL import Image

    from dmlkit.embeddings import save_embeddings

    rng = np.random.default_rng(0)
    paths, labels = [], []
    for p in range(4):
        d = tmp_path / "lfw" / f"P{p}"
        d.mkdir(parents=True)
        for n in range(1, 4):
            f = d / f"P{p}_{n:04d}.png"
            Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8)).save(f)
            paths.append(str(f))
            labels.append(p)
    lines = [f"{folds}\t1"]
    for k in range(folds):
        lines += [f"P{k % 4}\t1\t2", f"P{k % 4}\t1\tP{(k + 1) % 4}\t3"]
    (tmp_path / "pairs.txt").write_text("\n".join(lines) + "\n")
    emb = rng.normal(size=(len(paths), 3)).astype(np.float32)
    save_embeddings(tmp_path / "emb.npz", emb, np.asarray(labels), paths=np.asarray(paths))
    return tmp_path / "pairs.txt", tmp_path / "emb.npz"


def test_verify_refuses_folds_with_a_list_that_has_its_own(tmp_path, run_cli):
    """``--folds 5`` with LFW's 10-fold pairs.txt was silently ignored (the list's folds won):
    every other option the pair source does not use is refused."""
    pairs, emb = _lfw_list(tmp_path, folds=3)
    code, out, err = run_cli(["verify", str(emb), "--pair-list", str(pairs), "--json"])
    assert code == 0, err
    assert '"folds": 3' in out and '"fold_source": "list"' in out
    code, _, err = run_cli(["verify", str(emb), "--pair-list", str(pairs), "--folds", "2"])
    assert code == 2
    assert "--folds does not apply" in err and "3 folds" in err


def test_verify_folds_still_deals_a_one_fold_list(tmp_path, run_cli):
    """A one-fold list (LFW's development lists, a CSV without a fold column) uses --folds."""
    pairs, emb = _lfw_list(tmp_path, folds=2)
    text = pairs.read_text().splitlines()
    body = [ln for ln in text[1:] if len(ln.split()) == 3] + [ln for ln in text[1:] if len(ln.split()) == 4]
    pairs.write_text("\n".join(["2", *body]) + "\n")  # header 'N': one fold of N + N pairs
    code, out, err = run_cli(["verify", str(emb), "--pair-list", str(pairs), "--folds", "2", "--json"])
    assert code == 0, err
    assert '"fold_source": "stratified"' in out and '"folds": 2' in out


# -- patches evaluate --rescore --figure: the figure of the pairs just scored ------------------
def test_patches_rescore_figure_uses_the_rescored_pairs(tmp_path, run_cli, monkeypatch, one_thread):
    """``evaluate --rescore --data-root OTHER --figure f.png`` drew the run's training-time pair
    scores (indices into the patches of the root it was trained on) over OTHER's patches: a
    figure of the wrong pairs, silently, whenever the two roots were built differently."""
    import yaml

    import dmlkit.apps.patches.protocol as protocol
    from dmlkit.apps.patches.brown import load_subset
    from dmlkit.apps.patches.offline import OfflineSpec, build_offline_subset

    roots = {}
    for name, seed in (("first", 1), ("other", 2)):
        spec = OfflineSpec(points_per_subset=24, views=3, train_pairs=96, test_pairs=60, seed=seed)
        root = tmp_path / name
        build_offline_subset(root / "pt" / "photos", "photos", spec, sources=("text",))
        build_offline_subset(root / "pt" / "textures", "textures", spec, sources=("brick",))
        roots[name] = root
    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump({
        "seed": 0, "data": {"root": "pt", "combinations": [["photos", "textures"]]},
        "model": {"architectures": ["siam-l2"], "patch_size": 32, "width": 0.125},
        "training": {"epochs": 1, "batch_size": 32, "threads": 1}}))
    run = tmp_path / "run"
    code, _, err = run_cli(["patches", "train", str(cfg), "-o", str(run), "--data-root", str(roots["first"]),
                            "-q"])
    assert code == 0, err

    drawn = {}
    real = protocol.hardest_pairs_figure

    def spy(patches, left, right, label, scores, **kw):
        drawn.update(left=np.asarray(left), right=np.asarray(right), label=np.asarray(label))
        return real(patches, left, right, label, scores, **kw)

    monkeypatch.setattr(protocol, "hardest_pairs_figure", spy)
    code, _, err = run_cli(["patches", "evaluate", str(run), "--rescore", "--data-root", str(roots["other"]),
                            "--figure", str(tmp_path / "hard.png")])
    assert code == 0, err
    other = load_subset(roots["other"] / "pt", "textures").pairs(largest=False)
    assert np.array_equal(drawn["left"], other.left) and np.array_equal(drawn["right"], other.right)
    assert np.array_equal(drawn["label"], other.label)
    first = load_subset(roots["first"] / "pt", "textures").pairs(largest=False)
    assert not (np.array_equal(first.left, other.left) and np.array_equal(first.right, other.right))


def test_patches_absolute_data_root_with_data_root_option_is_refused(tmp_path, run_cli):
    """With ``data.root`` an absolute folder (``--set data.root=/data/pt``), ``--data-root``
    was silently ignored: ``evaluate --rescore --data-root OTHER`` scored the run's own data."""
    import yaml

    from dmlkit.apps.patches.protocol import load_patch_config, subsets_root
    from dmlkit.exceptions import ConfigError

    cfg_path = tmp_path / "p.yaml"
    cfg_path.write_text(yaml.safe_dump({"seed": 0, "data": {"root": str(tmp_path / "pt"),
                                                            "combinations": [["photos", "textures"]]}}))
    cfg = load_patch_config(cfg_path)
    assert subsets_root(cfg, None) == tmp_path / "pt"
    with pytest.raises(ConfigError, match="does not apply"):
        subsets_root(cfg, tmp_path / "other")
    code, _, err = run_cli(["patches", "train", str(cfg_path), "-o", str(tmp_path / "run"),
                            "--data-root", str(tmp_path / "other")])
    assert code == 2 and "--data-root" in err
    assert not (tmp_path / "run").exists()
    relative = load_patch_config(cfg_path, ["data.root=pt"])
    assert subsets_root(relative, tmp_path / "other") == tmp_path / "other" / "pt"


# -- fewshot: the sampler's refusals name the CLI's options ------------------------------------
@pytest.mark.parametrize("extra, python_name, cli_name", [
    (["--way", "9"], "n_way", "--way"),
    (["--shot", "0"], "k_shot", "--shot"),
    (["--episodes", "0"], "episodes", "--episodes"),
    (["--shot", "3", "--queries", "3"], "n_query", "--queries"),
    (["--queries", "0"], "n_query", "--queries"),
])
def test_fewshot_refusals_name_the_cli_options(tmp_path, run_cli, extra, python_name, cli_name):
    """``dmlkit fewshot --way 9`` on 4 classes said "lower n_way, k_shot or n_query": names
    the command does not have (its options are --way, --shot, --queries)."""
    from dmlkit.embeddings import save_embeddings

    path = tmp_path / "e.npz"
    save_embeddings(path, np.random.default_rng(0).normal(size=(20, 3)).astype(np.float32),
                    np.repeat(np.arange(4), 5))
    code, _, err = run_cli(["fewshot", str(path), *extra])
    assert code == 2
    assert python_name in err and cli_name in err and "Traceback" not in err


def test_reid_cli_says_when_the_camera_rule_is_off(tmp_path, run_cli):
    """An .npz without 'cams' was scored with the same-camera rule silently off (same-camera
    images of the query's identity counted as positives, which Market-1501 drops as junk)."""
    from dmlkit.embeddings import save_embeddings

    rng = np.random.default_rng(0)
    path = tmp_path / "nocams.npz"
    save_embeddings(path, rng.normal(size=(16, 5)).astype(np.float32), np.repeat(np.arange(4), 4),
                    groups=np.array(["query", "gallery"] * 8))
    code, out, err = run_cli(["reid", str(path), "--json"])
    assert code == 0, err
    assert "same-camera rule is off" in err and "--no-camera-rule" in err
    assert '"camera_rule": false' in out
    code, out, err = run_cli(["reid", str(path), "--json", "--no-camera-rule"])
    assert code == 0 and "same-camera rule" not in err


def test_reid_cli_camera_rule_on_with_cams(reid_npz, run_cli):
    code, out, err = run_cli(["reid", str(reid_npz), "--json"])
    assert code == 0, err
    assert '"camera_rule": true' in out and "camera rule is off" not in err


def test_track_evaluate_builds_every_tracker_before_running_any(tmp_path, run_cli, monkeypatch):
    """``--methods ncc,siamfc`` without ``--weights`` ran NCC over every sequence and only then
    refused siamfc, with nothing written."""
    import dmlkit.apps.tracking as tracking

    ran = []
    monkeypatch.setattr(tracking, "load_tracking_dataset", lambda *a, **k: [])
    monkeypatch.setattr(tracking, "run_ope", lambda tracker, *a, **k: ran.append(tracker))
    code, _, err = run_cli(["track", "evaluate", str(tmp_path), "--methods", "ncc,siamfc"])
    assert code == 2 and "--weights" in err
    assert not ran


def test_patches_figure_without_suffix_reports_the_file_written(tmp_path):
    """``--figure out/hard`` wrote ``out/hard.png`` (matplotlib's default format) but reported
    ``figure -> out/hard``, a path that does not exist."""
    from dmlkit.commands.patches import _check_figure_format
    from dmlkit.exceptions import ConfigError

    assert _check_figure_format(tmp_path / "hard") == tmp_path / "hard.png"
    assert _check_figure_format(tmp_path / "hard.PDF") == tmp_path / "hard.PDF"
    with pytest.raises(ConfigError, match="cannot write"):
        _check_figure_format(tmp_path / "hard.v2")
    with pytest.raises(ConfigError, match="is a folder"):  # not quietly <folder>.png beside it
        _check_figure_format(tmp_path)


# -- pair CSV: a header with the columns after an id column, and a short row -------------------
def test_pair_csv_short_row_after_an_id_column_is_one_error(tmp_path, run_cli):
    """``id,path1,path2,same`` with a row missing its last field raised IndexError (a traceback
    from ``dmlkit verify --pair-list``): the width check counted the named columns, not their
    positions."""
    from PIL import Image

    from dmlkit.data.pairs import read_pair_csv
    from dmlkit.exceptions import DataError

    for n in "abcd":
        Image.fromarray(np.zeros((8, 8), np.uint8)).save(tmp_path / f"{n}.png")
    good = tmp_path / "good.csv"
    good.write_text("id,path1,path2,same\n1,a.png,b.png,1\n2,c.png,d.png,0\n")
    plist = read_pair_csv(good)
    assert plist.same.tolist() == [True, False] and len(plist.paths) == 4
    bad = tmp_path / "bad.csv"
    bad.write_text("id,path1,path2,same\n1,a.png,b.png,1\n2,c.png,d.png\n")
    with pytest.raises(DataError, match=r"bad.csv:3: expected 4 fields, got 3"):
        read_pair_csv(bad)
    emb = tmp_path / "e.npz"
    from dmlkit.embeddings import save_embeddings

    save_embeddings(emb, np.eye(4, dtype=np.float32), np.arange(4),
                    paths=np.array([str(tmp_path / f"{n}.png") for n in "abcd"]))
    code, _, err = run_cli(["verify", str(emb), "--pair-list", str(bad)])
    assert code == 2 and "expected 4 fields" in err and "Traceback" not in err


@pytest.mark.parametrize("extra, cli_name", [
    (["--test-pairs", "3"], "(--test-pairs) = 3"),
    (["--points", "5"], "--points"),
    (["--views", "1"], "--views"),
])
def test_patches_build_data_refusals_name_the_cli_option(tmp_path, run_cli, extra, cli_name):
    """``build-data --test-pairs 3`` said "points_per_subset, train_pairs and test_pairs must be
    at least 10": which one, and under which option, was left to guess."""
    code, _, err = run_cli(["patches", "build-data", "-o", str(tmp_path / "d"), "--subset", "photos", *extra])
    assert code == 2 and cli_name in err and "Traceback" not in err
    assert not (tmp_path / "d").exists()


def test_patches_train_with_fewer_pairs_than_a_batch_fails_before_writing(tmp_path, run_cli):
    """``training.max_train_pairs=64`` with the default batch of 128 failed after the run's
    config.yaml and provenance.json were written and the data loaded, naming no setting."""
    import yaml

    from dmlkit.apps.patches.brown import PatchPairs, write_brown_subset

    rng = np.random.default_rng(0)
    for name in ("photos", "textures"):
        patches = rng.integers(0, 256, size=(40, 64, 64), dtype=np.uint8)
        points = np.repeat(np.arange(20), 2)
        left = np.arange(0, 40, 2)
        right = np.r_[np.arange(1, 40, 2)[:10], np.roll(np.arange(1, 40, 2), 3)[10:]]
        pairs = PatchPairs(left, right, (points[left] == points[right]).astype(np.int64))
        write_brown_subset(tmp_path / "pt" / name, patches, points, np.zeros(40, np.int64), {20: pairs})
    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump({
        "seed": 0, "data": {"root": str(tmp_path / "pt"), "combinations": [["photos", "textures"]]},
        "model": {"architectures": ["2ch"], "patch_size": 32, "width": 0.125},
        "training": {"epochs": 1, "batch_size": 32}}))
    run = tmp_path / "run"
    code, _, err = run_cli(["patches", "train", str(cfg), "-o", str(run)])
    assert code == 2
    assert "training.batch_size = 32" in err and "20 pairs" in err
    assert not run.exists()


# -- --device cuda without a GPU (or an unknown device) is one line, not torch's traceback ------
def _tiny_checkpoint(path: Path, data_root: Path | None = None) -> Path:
    from dmlkit.config import config_from_dict
    from dmlkit.training import build_model
    from dmlkit.training.checkpoint import save_checkpoint

    root = None if data_root is None else str(data_root)
    config = config_from_dict({"name": "tiny", "data": {"dataset": "omniglot", "image_size": 28, "root": root},
                               "model": {"trunk": "small_cnn", "pretrained": False, "in_channels": 1,
                                         "embedding_size": 8, "freeze_batchnorm": False},
                               "loss": {"name": "contrastive"}})
    save_checkpoint({"config": config.model_dump(mode="json"), "model": build_model(config).state_dict()}, path)
    return path


@pytest.mark.parametrize("device, message", [("bogus", "unknown device 'bogus'"), ("cuda:0", "no CUDA GPU")])
def test_verify_checkpoint_device_is_checked(tmp_path, run_cli, device, message):
    """``dmlkit verify --checkpoint RUN --device cuda`` on a machine without a GPU (or with a
    misspelt device) ended in torch's RuntimeError traceback."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("a GPU is present: cuda is a valid device here")
    from dmlkit.apps.fewshot import checkpoint_image_embedder
    from dmlkit.apps.verification import embed_image_files
    from dmlkit.exceptions import ConfigError

    ckpt = _tiny_checkpoint(tmp_path / "best.pt")
    pairs, _ = _lfw_list(tmp_path, folds=2)
    code, _, err = run_cli(["verify", "--checkpoint", str(ckpt), "--pair-list", str(pairs), "--device", device])
    assert code == 2 and message in err and "Traceback" not in err
    with pytest.raises(ConfigError, match=message):
        embed_image_files(ckpt, [str(tmp_path / "lfw" / "P0" / "P0_0001.png")], device=device)
    with pytest.raises(ConfigError, match=message):
        checkpoint_image_embedder(ckpt, device=device)


def test_oneshot_reads_the_runs_under_the_runs_recorded_data_root(tmp_path, run_cli, monkeypatch):
    """``dmlkit oneshot RUN_DIR`` looked under $DMLKIT_DATA (or ~/.cache) only, where ``embed``
    on the same run finds the data through its recorded data.root; --data-root still wins."""
    recorded, env, explicit = (tmp_path / name for name in ("recorded", "env", "explicit"))
    ckpt = _tiny_checkpoint(tmp_path / "best.pt", data_root=recorded)
    monkeypatch.setenv("DMLKIT_DATA", str(env))
    code, _, err = run_cli(["oneshot", str(ckpt)])
    assert code == 2 and f"not found under {recorded}:" in err
    code, _, err = run_cli(["oneshot", str(ckpt), "--data-root", str(explicit)])
    assert code == 2 and f"not found under {explicit}:" in err


def test_patches_train_on_cuda_without_a_gpu_writes_nothing(tmp_path, run_cli):
    """``--set training.device=cuda`` on a machine without a GPU was refused after the run's
    config.yaml and provenance.json were written."""
    import torch
    import yaml

    from dmlkit.apps.patches.brown import PatchPairs, write_brown_subset

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: cuda is a valid device here")
    rng = np.random.default_rng(0)
    points = np.repeat(np.arange(20), 2)
    left, right = np.arange(0, 40, 2), np.arange(1, 40, 2)
    for name in ("photos", "textures"):
        pairs = PatchPairs(left, right, np.ones(20, np.int64))
        write_brown_subset(tmp_path / "pt" / name, rng.integers(0, 256, size=(40, 64, 64), dtype=np.uint8),
                           points, np.zeros(40, np.int64), {20: pairs})
    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump({
        "seed": 0, "data": {"root": str(tmp_path / "pt"), "combinations": [["photos", "textures"]]},
        "model": {"architectures": ["2ch"], "patch_size": 32, "width": 0.125},
        "training": {"epochs": 1, "batch_size": 8, "device": "cuda"}}))
    run = tmp_path / "run"
    code, _, err = run_cli(["patches", "train", str(cfg), "-o", str(run)])
    assert code == 2 and "training.device" in err
    assert not run.exists()


def test_track_train_refused_run_leaves_no_empty_run_dir(tmp_path, run_cli):
    """A refused ``dmlkit track train`` (a misspelt --data-dir, cuda without a GPU) left an
    empty run directory behind: the folder was made before the data were read."""
    config = Path(__file__).resolve().parents[1] / "configs" / "siamfc_offline.yaml"
    run = tmp_path / "runs" / "siamfc"
    code, _, err = run_cli(["track", "train", str(config), "--data-dir", str(tmp_path / "missing"),
                            "--run-dir", str(run), "-q"])
    assert code == 2 and "does not exist" in err
    assert not run.exists()
