"""Tracking audit: the OPE frame rate, small and absent boxes drawn, tracker settings and
devices refused in one line, unreadable checkpoints and videos, GOT-10k absence flags, and the
CLI's ``--scales`` against the checkpoint's tracker settings."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from dmlkit.apps.tracking import (
    NCCTracker,
    SiamFC,
    SiamFCTracker,
    SiamFCTrainConfig,
    TrackerConfig,
    annotate,
    draw_box,
    evaluate_ope,
    load_got10k,
    load_siamfc,
    read_video,
    save_siamfc,
    train_siamfc,
    write_frames,
)
from dmlkit.apps.tracking.datasets import Sequence
from dmlkit.apps.tracking.tracker import tracker_config
from dmlkit.exceptions import CheckpointError, ConfigError, DataError

pytestmark = pytest.mark.usefixtures("one_thread")


def _frames(n=3, h=48, w=64):
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(n)]


# -- OPEResult.fps: total updates over total time -----------------------------------------------
def test_ope_fps_is_total_updates_over_total_time_with_frames_left_out():
    # A: 11 frames tracked at 10 fps (10 updates, 1 s), frames 1-5 without ground truth;
    # B: 3 frames at 2 fps (2 updates, 1 s). 12 updates in 2 s: 6 fps.
    gt_a = np.tile([10.0, 10.0, 20.0, 20.0], (11, 1))
    gt_a[1:6] = np.nan
    gt_b = np.tile([10.0, 10.0, 20.0, 20.0], (3, 1))
    res = evaluate_ope({"a": gt_a.copy(), "b": gt_b.copy()}, {"a": gt_a, "b": gt_b},
                       fps={"a": 10.0, "b": 2.0})
    assert res.fps == pytest.approx(6.0)


def test_ope_fps_ignores_sequences_without_a_finite_rate():
    gt = np.tile([10.0, 10.0, 20.0, 20.0], (3, 1))
    res = evaluate_ope({"a": gt, "b": gt}, {"a": gt, "b": gt}, fps={"a": 4.0, "b": float("nan")})
    assert res.fps == pytest.approx(4.0)


# -- drawing ------------------------------------------------------------------------------------
def test_draw_box_under_one_pixel_and_absent_boxes():
    frame = np.zeros((20, 20, 3), np.uint8)
    out = draw_box(frame, [5, 6, 0.5, 0.5], width=1)  # was Pillow's ValueError
    drawn = np.argwhere(out.any(axis=2))
    assert out[6, 5].tolist() == [255, 40, 40] and np.abs(drawn - [6, 5]).max() <= 1
    assert (draw_box(frame, [5, 6, 0, 0]) == 0).all()  # absent target: nothing drawn
    gt = np.array([[0.0, 0.0, 0.0, 0.0]])
    assert len(list(annotate(frame[None], np.array([[1.0, 1.0, 4.0, 4.0]]), gt))) == 1


def test_a_sub_pixel_box_is_written_to_a_gif(tmp_path):
    # the CLI's first frame carries the --init-box as given: 0.5 x 0.5 was a traceback
    boxes = np.array([[40.0, 40.0, 0.5, 0.5], [40.0, 40.0, 4.0, 4.0]])
    out = write_frames(annotate(_frames(2, 96, 96), boxes), tmp_path / "o.gif", fps=5)
    assert out.is_file()


# -- trackers -----------------------------------------------------------------------------------
def test_ncc_resolves_its_dependency_before_the_timed_updates(monkeypatch):
    tracker = NCCTracker()
    import dmlkit.apps.tracking.tracker as mod

    def fail(*args, **kwargs):
        raise AssertionError("require() called while tracking: its import time counts as an update")

    monkeypatch.setattr(mod, "require", fail)
    result = tracker.track(_frames(3), [10, 10, 16, 16])
    assert result.boxes.shape == (3, 4)


@pytest.mark.parametrize("settings", [
    {"context": float("nan")}, {"min_size": float("nan")}, {"scale_step": float("inf")},
    {"context": -0.4}, {"min_size": -1.0}, {"instance_size": 100},
])
def test_tracker_settings_that_track_to_nan_or_garbage_are_refused(settings):
    with pytest.raises(ConfigError):
        TrackerConfig(**settings)
    with pytest.raises(ConfigError):
        tracker_config(settings)


@pytest.mark.parametrize("device", ["foo", "cuda"])
def test_siamfc_tracker_refuses_an_unknown_or_absent_device_in_one_error(device):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ConfigError):
        SiamFCTracker(SiamFC(width=0.1), device=device)


# -- checkpoints, videos, GOT-10k ---------------------------------------------------------------
def test_resume_from_an_unreadable_checkpoint_is_one_checkpoint_error(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "last.pt").write_text("junk\n")
    boxes = np.tile([10.0, 10.0, 20.0, 20.0], (2, 1))
    cfg = SiamFCTrainConfig(data_dir=str(tmp_path), width=0.1, pairs_per_epoch=1, batch_size=1)
    with pytest.raises(CheckpointError, match="cannot read") as info:
        train_siamfc(cfg, tmp_path / "run", [Sequence("s", _frames(2), boxes)], progress=False,
                     resume=True)
    assert "\n" not in str(info.value)


def test_foreign_checkpoint_error_is_one_line(tmp_path):
    torch.save({"a": type}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError) as info:
        load_siamfc(tmp_path / "foreign.pt")
    assert "\n" not in str(info.value)


def test_undecodable_video_is_one_line(tmp_path):
    (tmp_path / "bad.mp4").write_bytes(b"\x00" * 4096)
    with pytest.raises(DataError) as info:
        read_video(tmp_path / "bad.mp4")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("flags, match", [("0\n1\n", "2 flags"), ("0\nx\n1\n", "flag")])
def test_got10k_absence_flags_that_do_not_fit_are_an_error(tmp_path, flags, match):
    seq = tmp_path / "GOT-10k_Val_000001"
    seq.mkdir()
    for i, f in enumerate(_frames(3)):
        Image.fromarray(f).save(seq / f"{i + 1:08d}.jpg")
    (seq / "groundtruth.txt").write_text("1,1,10,10\n2,2,10,10\n3,3,10,10\n")
    (seq / "absence.label").write_text(flags)
    with pytest.raises(DataError, match=match):
        load_got10k(tmp_path)
    (seq / "absence.label").write_text("0\n1\n0\n")
    assert np.isnan(load_got10k(tmp_path)[0].boxes[1]).all()


# -- the CLI's --scales -------------------------------------------------------------------------
def test_scales_option_keeps_the_checkpoints_tracker_settings(tmp_path):
    from dmlkit.commands.track import _tracker

    ckpt = save_siamfc(tmp_path / "c.pt", SiamFC(width=0.1),
                       TrackerConfig(num_scales=5, scale_step=1.025, scale_penalty=0.962,
                                     window_influence=0.3))
    default = _tracker("siamfc", ckpt, None, 0, "cpu").config  # the checkpoint's 5 scales
    assert default.num_scales == 5 and default.window_influence == 0.3
    three = _tracker("siamfc", ckpt, 3, 0, "cpu").config
    assert (three.num_scales, three.scale_step, three.scale_penalty) == (3, 1.0375, 0.9745)
    assert three.window_influence == 0.3
    assert _tracker("untrained", None, None, 0, "cpu", 0.1).config == TrackerConfig()


def test_a_split_given_for_otb_is_refused_not_ignored(tmp_path):
    """Was: ``dmlkit track evaluate --dataset otb --split val`` scored every OTB sequence, silently
    ignoring the split asked for."""
    from dmlkit.apps.tracking import load_tracking_dataset

    with pytest.raises(ConfigError, match="OTB has no splits"):
        load_tracking_dataset("otb", tmp_path, "val")


def test_a_video_of_frames_of_two_sizes_is_one_error(tmp_path):
    """Was: write_frames to .mp4 of frames of two sizes (a folder of mixed frames) ended in
    np.stack's ValueError traceback."""
    pytest.importorskip("imageio")
    frames = [np.zeros((20, 30, 3), np.uint8), np.zeros((24, 30, 3), np.uint8)]
    with pytest.raises(DataError, match="differ in size"):
        write_frames(frames, tmp_path / "v.mp4")
    with pytest.raises(ConfigError, match="no frames"):
        write_frames([], tmp_path / "v.mp4")
