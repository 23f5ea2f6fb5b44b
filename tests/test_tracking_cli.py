"""``dmlkit track``: build-data, train, run on frames / video, evaluate; errors exit 2."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dmlkit.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run(argv, capsys):
    code = 0
    try:
        main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    from dmlkit.apps.tracking import build_offline_dataset

    root = tmp_path_factory.mktemp("offline")
    build_offline_dataset(root, num_train=1, num_test=2, train_frames=8, test_frames=4,
                          seed=1, frame_size=(160, 120))
    return root


def test_build_data_writes_both_layouts(tmp_path, capsys):
    code, out, _ = run(["track", "build-data", tmp_path / "d", "--train", "1", "--test", "1",
                        "--frames", "3", "--size", "128x96"], capsys)
    assert code == 0, out
    from dmlkit.apps.tracking import load_got10k, load_otb

    train, test = load_got10k(tmp_path / "d"), load_otb(tmp_path / "d" / "test")
    assert len(train) == 1 and len(test) == 1 and len(test[0]) == 3
    assert test[0].frame(0).shape == (96, 128, 3)
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta["seed"] == 0 and set(meta["test"]) == {test[0].name}
    code, _, err = run(["track", "build-data", tmp_path / "e", "--size", "big"], capsys)
    assert code == 2 and "WxH" in err


@pytest.mark.parametrize("extra", [["--scales", "3"], ["--weights", "run"], ["--width", "0.5"], ["--seed", "3"]])
def test_ncc_refuses_the_network_options_it_would_ignore(offline, tmp_path, capsys, extra):
    # template matching has no network and no scale search: these ran silently unused
    seq_dir = next((offline / "test").iterdir())
    code, out, err = run(["track", "--frames", seq_dir / "img", "--init-box", "10,10,20,20",
                          "--method", "ncc", "--boxes", tmp_path / "b.txt", *extra], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"{extra[0]} does not apply to --method ncc" in err
    assert not (tmp_path / "b.txt").exists()


def test_track_frames_to_gif_and_boxes(offline, tmp_path, capsys):
    seq_dir = next((offline / "test").iterdir())
    gt = np.loadtxt(seq_dir / "groundtruth_rect.txt", delimiter=",")
    box = ",".join(str(int(v)) for v in gt[0])
    code, out, err = run(["track", "--frames", seq_dir / "img", "--init-box", box,
                          "--method", "ncc", "--out", tmp_path / "t.gif",
                          "--boxes", tmp_path / "b.txt", "--json"], capsys)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["frames"] == 4
    boxes = np.loadtxt(tmp_path / "b.txt", delimiter=",")
    assert boxes.shape == (4, 4)
    np.testing.assert_allclose(boxes[0], gt[0])
    from dmlkit.apps.tracking import read_video

    frames, _ = read_video(tmp_path / "t.gif")
    assert len(frames) == 4


def test_track_video_file_with_an_untrained_network(offline, tmp_path, capsys):
    from dmlkit.apps.tracking import load_otb, write_frames

    seq = load_otb(offline / "test")[0]
    write_frames(iter(seq), tmp_path / "in.mp4", fps=12)
    box = ",".join(str(v) for v in seq.boxes[0])
    code, out, err = run(["track", "--video", tmp_path / "in.mp4", "--init-box", box,
                          "--method", "untrained", "--width", "0.125", "--max-frames", "2",
                          "--out", tmp_path / "out"], capsys)
    assert code == 0, err
    assert "tracked 2 frames" in out
    assert len(list((tmp_path / "out").glob("*.jpg"))) == 2


def test_track_errors_exit_2(offline, tmp_path, capsys):
    img = next((offline / "test").iterdir()) / "img"
    code, _, err = run(["track", "--frames", img], capsys)
    assert code == 2 and "--init-box" in err
    code, _, err = run(["track", "--frames", img, "--init-box", "500,500,10,10",
                        "--method", "ncc"], capsys)
    assert code == 2 and "outside" in err
    code, _, err = run(["track", "--frames", img, "--init-box", "1,1,10,10"], capsys)
    assert code == 2 and "--weights" in err
    code, _, err = run(["track", "--frames", tmp_path / "none", "--init-box", "1,1,10,10",
                        "--method", "ncc"], capsys)
    assert code == 2


def test_train_then_evaluate(offline, tmp_path, capsys):
    code, out, err = run(["track", "train", "configs/siamfc_offline.yaml", "--quiet",
                          "--run-dir", tmp_path / "run", "--data-dir", offline / "train",
                          "--set", "width=0.125", "--set", "epochs=1",
                          "--set", "pairs_per_epoch=4", "--set", "batch_size=2"], capsys)
    assert code == 0, err
    assert "trained 2 steps, 1/1 epochs" in out
    code, out, err = run(["track", "evaluate", offline / "test", "--dataset", "otb",
                          "--weights", tmp_path / "run", "--methods", "siamfc", "--method", "ncc",
                          "--max-sequences", "1", "--out-dir", tmp_path / "eval", "--json"], capsys)
    assert code == 0, err
    table = json.loads(out)
    assert set(table) == {"siamfc", "ncc"}
    for row in table.values():
        assert 0.0 <= row["success_auc"] <= 20 / 21 + 1e-9 and row["num_frames"] == 4
    res = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert len(res["ncc"]["success_curve"]) == 21 and len(res["ncc"]["precision_curve"]) == 51
    assert (tmp_path / "eval" / "ope.png").stat().st_size > 1000
    assert len(list((tmp_path / "eval" / "boxes" / "siamfc").glob("*.txt"))) == 1
    code, _, err = run(["track", "evaluate", offline / "test", "--methods", "kcf"], capsys)
    assert code == 2 and "unknown tracker" in err


def test_evaluate_got10k_layout(offline, capsys):
    # the root's GOT-10k split must be named: without --split, train was scored unasked
    code, _, err = run(["track", "evaluate", offline, "--dataset", "got10k", "--methods", "ncc"], capsys)
    assert code == 2 and "holds the GOT-10k splits train" in err
    code, out, err = run(["track", "evaluate", offline, "--dataset", "got10k", "--split", "train",
                          "--methods", "ncc", "--json"], capsys)
    assert code == 0, err
    row = json.loads(out)["ncc"]
    assert row["num_sequences"] == 1 and row["num_frames"] == 8
    code, _, err = run(["track", "evaluate", offline, "--dataset", "vot"], capsys)
    assert code == 2 and "otb" in err


@pytest.mark.parametrize("override, match", [
    ("device=gpu", "device"), ("tracker.num_scale=3", "unknown tracker setting"),
    ("tracker.num_scales=three", "tracker.num_scales must be a whole number"),
    ("width.x=1", "'width' is a value"), ("lr_end=1", "lr_end"), ("lr=.inf", "lr"),
])
def test_bad_siamfc_settings_are_refused_when_the_config_is_read(override, match):
    """Each ended `dmlkit track train` in a traceback; now one ConfigError before any work."""
    from pathlib import Path

    from dmlkit.apps.tracking.training import SiamFCTrainConfig
    from dmlkit.exceptions import ConfigError

    repo = Path(__file__).resolve().parents[1]
    with pytest.raises(ConfigError, match=match):
        SiamFCTrainConfig.from_yaml(repo / "configs" / "siamfc_offline.yaml", [override])
    assert SiamFCTrainConfig.from_yaml(repo / "configs" / "siamfc_offline.yaml", ["device=auto"]).device == "auto"
