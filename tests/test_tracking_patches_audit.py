"""Audit of `dmlkit track` and `dmlkit patches`: each test pins one bug that ended in a traceback
after the work was done (or after the run directory was written), or gave a silently wrong
result: out-of-range --fps, negative seeds, infinite SiamFC pair settings and patch training
values, and a patch run resumed on other training data."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from _reference import brown_subset, one_error_line

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def offline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One training and one test sequence of a few small frames."""
    from dmlkit.apps.tracking import build_offline_dataset

    root = tmp_path_factory.mktemp("offline")
    build_offline_dataset(root, num_train=1, num_test=1, train_frames=4, test_frames=3, seed=1,
                          frame_size=(128, 96))
    return root


def _frames_dir(offline: Path) -> Path:
    return next((offline / "test").iterdir()) / "img"


def _no_tracking(monkeypatch) -> None:
    """Make tracking fail loudly: a refused option must be refused before any frame is tracked."""
    from dmlkit.apps.tracking import NCCTracker

    def boom(*_a, **_k):
        raise AssertionError("tracked before the options were checked")

    monkeypatch.setattr(NCCTracker, "track", boom)


# -- 1. --fps out of range -------------------------------------------------------------------------
@pytest.mark.parametrize("fps, out", [
    ("inf", "x.mp4"), ("0.001", "x.gif"), ("inf", "y.gif"), ("101", "y.gif"), ("2000", "x.avi"),
    ("nan", "x.mkv"), ("-inf", "frames"),
])
def test_out_of_range_fps_is_one_error_line_before_tracking(offline, tmp_path, run_cli, monkeypatch, fps, out):
    """Was: --fps inf (.mp4) and 0.001 (.gif) ended in an OverflowError traceback after the whole
    video was tracked, and inf wrote a GIF whose frames have no delay (duration 0)."""
    _no_tracking(monkeypatch)
    code, _, err = run_cli(["track", "--frames", str(_frames_dir(offline)), "--init-box", "10,10,40,40",
                            "--method", "ncc", "--fps", fps, "--out", str(tmp_path / out)])
    line = one_error_line(code, err)
    assert "--fps must be between 0.01 and" in line
    assert not (tmp_path / out).exists()


def test_fps_at_the_limits_is_written(offline, tmp_path, run_cli):
    from PIL import Image

    img = str(_frames_dir(offline))
    code, _, err = run_cli(["track", "--frames", img, "--init-box", "10,10,40,40", "--method", "ncc",
                            "--fps", "100", "--out", str(tmp_path / "fast.gif")])
    assert code == 0, err
    with Image.open(tmp_path / "fast.gif") as im:
        assert im.info["duration"] == 10  # one hundredth of a second, GIF's finest delay
    code, _, err = run_cli(["track", "--frames", img, "--init-box", "10,10,40,40", "--method", "ncc",
                            "--fps", "0.01", "--out", str(tmp_path / "slow.gif")])
    assert code == 0, err
    with Image.open(tmp_path / "slow.gif") as im:
        assert im.info["duration"] == 100_000


def test_a_fast_input_video_is_written_as_a_gif_at_gifs_fastest_rate(offline, tmp_path, run_cli):
    """Was: without --fps a 240 fps input became a GIF of 0-delay frames (4 ms, which GIF's
    hundredths of a second cannot hold); the default rate is now kept within the output's."""
    from PIL import Image

    from dmlkit.apps.tracking import read_video, write_frames

    frames = [np.random.default_rng(i).integers(0, 256, (96, 128, 3), dtype=np.uint8) for i in range(3)]
    write_frames(frames, tmp_path / "in.mp4", fps=240)
    assert read_video(tmp_path / "in.mp4")[1] == pytest.approx(240)
    code, _, err = run_cli(["track", "--frames", str(tmp_path / "in.mp4"), "--init-box", "10,10,40,40",
                            "--method", "ncc", "--out", str(tmp_path / "o.gif")])
    assert code == 0, err
    with Image.open(tmp_path / "o.gif") as im:
        assert im.info["duration"] == 10


@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_untrained_tracker_seed_out_of_range_is_one_error_line(offline, tmp_path, run_cli, seed):
    """Was: --seed 2**64 of --method untrained ended in a ValueError traceback (torch's seed
    overflow) and -1 was taken."""
    code, _, err = run_cli(["track", "--frames", str(_frames_dir(offline)), "--init-box", "10,10,40,40",
                            "--method", "untrained", f"--seed={seed}", "--out", str(tmp_path / "o.gif")])
    line = one_error_line(code, err)
    assert "--seed must be a non-negative integer below 2**32" in line
    assert not (tmp_path / "o.gif").exists()


@pytest.mark.parametrize("fps", [15.0, 30.0, 7.0])
def test_a_gif_plays_at_its_frame_rate(tmp_path, fps):
    """Was: one delay of round(1000 / fps) ms for every frame, which GIF stores in whole
    hundredths (Pillow floors it): 15 fps played at 16.7 (6 hundredths for 6.67), 30 at 33.3."""
    from PIL import Image

    from dmlkit.apps.tracking import write_frames

    n = 12
    frames = [np.full((8, 8, 3), 20 * i, np.uint8) for i in range(n)]  # all different: none merged
    write_frames(frames, tmp_path / "o.gif", fps=fps)
    delays = []
    with Image.open(tmp_path / "o.gif") as im:
        for k in range(im.n_frames):
            im.seek(k)
            delays.append(im.info["duration"])
    assert len(delays) == n
    for k in range(1, n + 1):  # every prefix ends within half a hundredth of k / fps
        assert abs(sum(delays[:k]) - 1000 * k / fps) <= 5 + 1e-9
    assert min(delays) >= 10


@pytest.mark.parametrize("fps, out", [
    (math.inf, "o.gif"), (1e-3, "o.gif"), (100.5, "o.gif"), (math.inf, "o.mp4"), (math.nan, "o.mp4"),
    (1e4, "o.avi"), (0.0, "frames"),
])
def test_write_frames_refuses_fps_it_cannot_store(tmp_path, fps, out):
    """The Python API: write_frames(fps=inf) wrote a GIF of 0-delay frames, 1e-3 overflowed
    Pillow's 16-bit delay, inf an OverflowError in PyAV, 1e4 an .avi that claims 600 fps."""
    from dmlkit.apps.tracking import write_frames
    from dmlkit.exceptions import ConfigError

    frames = [np.zeros((32, 32, 3), np.uint8)] * 2
    with pytest.raises(ConfigError, match="fps must be between 0.01 and"):
        write_frames(iter(frames), tmp_path / out, fps=fps)
    assert not (tmp_path / out).exists()


def test_write_frames_writes_webm(tmp_path):
    """Was: every .webm failed ("'webm' format does not support 'mpeg4' codec"); now VP9."""
    from dmlkit.apps.tracking import read_video, write_frames

    frames = [np.random.default_rng(i).integers(0, 256, (32, 48, 3), dtype=np.uint8) for i in range(3)]
    write_frames(iter(frames), tmp_path / "o.webm", fps=12)
    read, fps = read_video(tmp_path / "o.webm")
    assert len(read) == 3 and fps == pytest.approx(12)


# -- 2. negative seeds ------------------------------------------------------------------------------
def test_track_build_data_refuses_a_negative_seed_before_writing(tmp_path, run_cli):
    """Was: numpy's ValueError traceback; now one line, as `dmlkit patches build-data --seed -1`."""
    code, _, err = run_cli(["track", "build-data", str(tmp_path / "e"), "--train", "0", "--test", "1",
                            "--frames", "3", "--seed", "-1"])
    assert "seed must be a non-negative integer below 2**32" in one_error_line(code, err)
    assert not (tmp_path / "e").exists()


def test_offline_tracking_api_refuses_bad_seeds(tmp_path):
    from dmlkit.apps.tracking import build_offline_dataset
    from dmlkit.apps.tracking.offline import offline_specs
    from dmlkit.apps.tracking.training import SiamFCPairs
    from dmlkit.exceptions import ConfigError

    for seed in (-1, 2**32):
        with pytest.raises(ConfigError, match="seed"):
            offline_specs("train", 1, 3, seed=seed)
        with pytest.raises(ConfigError, match="seed"):
            build_offline_dataset(tmp_path / "d", 0, 1, 3, 3, seed=seed)
    assert not (tmp_path / "d").exists()
    from dmlkit.apps.tracking.datasets import Sequence

    seq = Sequence("s", [np.zeros((96, 96, 3), np.uint8)] * 2, np.array([[10, 10, 20, 20]] * 2, float))
    with pytest.raises(ConfigError, match="seed"):
        SiamFCPairs([seq], 2, seed=-1)


@pytest.mark.parametrize("override, key", [
    ("seed=-1", "seed"), ("seed=4294967296", "seed"), ("pairs.max_shift=.inf", "pairs.max_shift"),
    ("pairs.radius=inf", "pairs.radius"), ("pairs.radius=.nan", "pairs.radius"),
    ("pairs.context=.inf", "pairs.context"),
])
def test_track_train_refuses_bad_seed_and_infinite_pairs_before_writing(offline, tmp_path, run_cli,
                                                                       override, key):
    """Was: seed=-1 a numpy traceback after config.yaml, log.jsonl and provenance.json were
    written; pairs.max_shift=inf a traceback mid-run; pairs.radius=inf trained on labels that
    are +1 everywhere and exited 0."""
    run = tmp_path / "run"
    code, _, err = run_cli(["track", "train", str(REPO / "configs" / "siamfc_offline.yaml"), "-q",
                            "--run-dir", str(run), "--data-dir", str(offline / "train"),
                            "--set", "width=0.125", "--set", "epochs=1", "--set", "pairs_per_epoch=2",
                            "--set", "batch_size=2", "--set", override])
    line = one_error_line(code, err)
    assert f"{key}:" in line
    assert not run.exists()


def test_make_labels_refuses_an_infinite_radius_or_shift():
    from dmlkit.apps.tracking.training import make_labels
    from dmlkit.exceptions import ConfigError

    for kwargs in ({"radius": math.inf}, {"radius": math.nan}, {"shift": (math.inf, 0.0)}):
        with pytest.raises(ConfigError, match="finite"):
            make_labels(**kwargs)


# -- 4. patch training settings must be finite -------------------------------------------------------
@pytest.mark.parametrize("override", ["training.weight_decay=.inf", "training.lr=inf",
                                      "training.l2_margin=.inf", "training.triplet_margin=.nan",
                                      "model.width=.inf"])
def test_patch_config_refuses_infinite_values_when_read(override):
    """Was: accepted, then a failure mid-run whose hint (lower the learning rate) was wrong."""
    from dmlkit.apps.patches import load_patch_config
    from dmlkit.exceptions import ConfigError

    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + ": Input should be a finite number"):
        load_patch_config(REPO / "configs" / "patches_offline.yaml", [override])


def test_patch_train_settings_refuse_infinity():
    from dmlkit.apps.patches.training import TrainSettings
    from dmlkit.exceptions import ConfigError

    for field in ("lr", "weight_decay", "l2_margin"):
        with pytest.raises(ConfigError, match=field):
            TrainSettings(**{field: math.inf})


def test_patches_train_refuses_infinity_before_writing(tmp_path, run_cli):
    out = tmp_path / "run"
    code, _, err = run_cli(["patches", "train", str(REPO / "configs" / "patches_offline.yaml"), "-o", str(out),
                            "--data-root", str(tmp_path), "--set", "training.weight_decay=.inf"])
    assert "training.weight_decay" in one_error_line(code, err)
    assert not out.exists()


# -- 5. a patch run resumed on other training data --------------------------------------------------
@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two data roots, each with subsets ``pd/a`` and ``pd/b`` of other patches and pairs."""
    base = tmp_path_factory.mktemp("roots")
    for i, root in enumerate(("rootA", "rootB")):
        brown_subset(base / root / "pd" / "a", 24, (64, 32), seed=1 + 10 * i)
        brown_subset(base / root / "pd" / "b", 24, (64, 32), seed=2 + 10 * i)
    return base / "rootA", base / "rootB"


def _patch_config(path: Path) -> Path:
    cfg = {"seed": 0, "data": {"root": "pd", "combinations": [["a", "b"]]},  # relative to --data-root
           "model": {"architectures": ["siam-l2"], "patch_size": 32, "width": 0.125},
           "training": {"epochs": 1, "batch_size": 16, "max_train_pairs": 32, "threads": 1, "augment": False}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(run_cli, cfg: Path, out: Path, root: Path) -> tuple[int, str, str]:
    return run_cli(["patches", "train", str(cfg), "-o", str(out), "--data-root", str(root), "--json"])


def test_resuming_on_other_training_data_is_refused(roots, tmp_path, run_cli):
    """Was: the same run and config with another --data-root (a relative data.root) silently
    scored the models trained on the first root and rewrote the provenance to the second."""
    root_a, root_b = roots
    cfg, out = _patch_config(tmp_path / "cfg.yaml"), tmp_path / "run"
    code, _, err = _train(run_cli, cfg, out, root_a)
    assert code == 0, err
    ck = out / "models" / "siam-l2" / "a.pt"
    settings = torch.load(ck, weights_only=True)["settings"]
    assert len(settings["train_data_sha256"]) == 64
    before = {p: p.read_bytes() for p in (ck, out / "provenance.json", out / "results.json")}
    code, _, err = _train(run_cli, cfg, out, root_b)
    line = one_error_line(code, err)
    assert "was trained on other data than the subset 'a'" in line and "--fresh" in line
    assert all(p.read_bytes() == b for p, b in before.items())  # nothing rewritten
    # the same data moved elsewhere is the same data: the model is reused, not retrained
    root_c = tmp_path / "moved"
    shutil.copytree(root_a, root_c)
    code, _, err = run_cli(["patches", "train", str(cfg), "-o", str(out), "--data-root", str(root_c)])
    assert code == 0, err
    assert "loaded" in err and ck.read_bytes() == before[ck]
    # --fresh retrains on the other data, and records it
    code, _, err = run_cli(["patches", "train", str(cfg), "-o", str(out), "--data-root", str(root_b),
                            "--fresh", "--json"])
    assert code == 0, err
    assert torch.load(ck, weights_only=True)["settings"]["train_data_sha256"] != settings["train_data_sha256"]


def test_a_checkpoint_without_a_data_identity_is_reused_with_a_warning(roots, tmp_path, run_cli):
    """Checkpoints of an older dmlkit record no training-data identity: reused (their settings
    still checked) with one warning line that says how to retrain, not refused."""
    root_a, _ = roots
    cfg, out = _patch_config(tmp_path / "cfg.yaml"), tmp_path / "run"
    code, _, err = _train(run_cli, cfg, out, root_a)
    assert code == 0, err
    ck = out / "models" / "siam-l2" / "a.pt"
    state = torch.load(ck, weights_only=True)
    del state["settings"]["train_data_sha256"]
    torch.save(state, ck)
    code, _, err = _train(run_cli, cfg, out, root_a)
    assert code == 0, err
    lines = [line for line in err.splitlines() if "not record which data" in line]
    assert len(lines) == 1 and lines[0].startswith("warning: ") and "--fresh" in lines[0], err
    assert "train_data_sha256" not in torch.load(ck, weights_only=True)["settings"]  # reused as it was
