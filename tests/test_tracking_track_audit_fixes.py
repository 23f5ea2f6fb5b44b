"""Fixes from the tracking audit: crops at the image border, the exemplar size the network
needs, OTB names, ``track evaluate`` (ground truth first, results written per method, options
that apply), ``track train --resume``, ``build-data`` and ``--out`` folders, the docs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from _reference import siamfc_train_sequence, tiny_siamfc_config
from dmlkit.apps.tracking.datasets import Sequence, load_otb
from dmlkit.apps.tracking.evaluation import run_ope
from dmlkit.apps.tracking.geometry import crop_and_resize
from dmlkit.apps.tracking.model import MIN_IMAGE_SIZE, SiamFC, receptive_field, score_map_size
from dmlkit.apps.tracking.offline import build_offline_dataset
from dmlkit.apps.tracking.render import write_frames
from dmlkit.apps.tracking.tracker import SiamFCTracker, TrackerConfig, tracker_config
from dmlkit.apps.tracking.training import train_siamfc
from dmlkit.cli import main
from dmlkit.exceptions import CheckpointError, ConfigError, DataError


def run_cli(argv, capsys=None):
    """``dmlkit ARGV`` -> (exit code, stdout, stderr) with capsys, else the exit code only."""
    code = 0
    try:
        main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    if capsys is None:
        return code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ---------------------------------------------------------------- crops at the border


def _ramp(height: int = 6, width: int = 8) -> torch.Tensor:
    """A (3, H, W) image whose pixel (y, x) holds x + 1 (every pixel differs from the pad 0)."""
    return (torch.arange(width, dtype=torch.float32) + 1).repeat(3, height, 1)


def test_crop_output_pixel_wholly_outside_the_image_is_pad_not_the_border_pixel():
    # centre x = 2, side 6: the crop covers [-1, 5) (pixel centres -0.5 .. 4.5, i.e. index
    # centre 1.5 -/+ (6 - 1) / 2); its first column [-1, 0) lies outside the image
    img = _ramp()
    left = crop_and_resize(img, np.array([3.0, 2.0]), 6.0, 6, pad_value=torch.zeros(3))[0, 0]
    torch.testing.assert_close(left, torch.tensor([0.0, 1, 2, 3, 4, 5]).repeat(6, 1))
    # centre x = 6: [3, 9); its last column [8, 9) lies outside the 8-pixel-wide image
    right = crop_and_resize(img, np.array([3.0, 6.0]), 6.0, 6, pad_value=torch.zeros(3))[0, 0]
    torch.testing.assert_close(right, torch.tensor([4.0, 5, 6, 7, 8, 0]).repeat(6, 1))


def test_crop_rows_outside_the_image_are_pad_and_inside_is_an_exact_copy():
    g = torch.Generator().manual_seed(0)
    img = torch.rand(3, 10, 12, generator=g) * 255
    pad = torch.tensor([7.0, 8.0, 9.0])
    # rows [-2, 8), columns [1, 11): the two top rows are the pad, the rest copies pixels
    crop = crop_and_resize(img, np.array([3.0, 6.0]), 10.0, 10, pad_value=pad)[0]
    torch.testing.assert_close(crop[:, :2], pad.view(3, 1, 1).expand(3, 2, 10))
    torch.testing.assert_close(crop[:, 2:], img[:, 0:8, 1:11], atol=1e-3, rtol=0)


# ---------------------------------------------------------------- the smallest exemplar


def test_min_image_size_is_the_backbones_receptive_field():
    # conv 11/2, pool 3/2, conv 5, pool 3/2, conv 3 x 3: 1 + 10 + 2*2 + 4*4 + 2*4 + 3 * 2*8 = 87
    assert MIN_IMAGE_SIZE == 87 == receptive_field(SiamFC(width=0.25).backbone)
    torch.manual_seed(0)
    feats = SiamFC(width=0.25).embed(torch.zeros(1, 3, MIN_IMAGE_SIZE, MIN_IMAGE_SIZE))
    assert feats.shape[-2:] == (1, 1)


@pytest.mark.parametrize("size", [1, 40, 86])
def test_exemplar_smaller_than_the_receptive_field_is_refused(size):
    # was accepted, then embed() failed at the first frame (or, for the response size, an empty map)
    with pytest.raises(ConfigError, match=r"exemplar_size must be at least 87.*receptive field"):
        TrackerConfig(exemplar_size=size)
    with pytest.raises(ConfigError, match="at least 87"):
        tracker_config({"exemplar_size": size})


@pytest.mark.parametrize("settings", [{"exemplar_size": 123}, {"instance_size": 251}, {"exemplar_size": 90}])
def test_crop_sizes_off_the_network_stride_are_refused(settings):
    # were accepted: the network drops a crop's last (size - 87) % 8 rows and columns, so the
    # response map's centre is off the crop's (and its size may differ from response_size)
    with pytest.raises(ConfigError, match=r"must be 87 plus a multiple of the network's stride 8"):
        TrackerConfig(**settings)


def test_an_exemplar_off_the_stride_gives_another_response_size():  # why the sizes are refused
    model = SiamFC(width=0.125)
    side = model.score(model.embed(torch.zeros(1, 3, 123, 123)), model.embed(torch.zeros(1, 3, 255, 255))).shape[-1]
    assert side == 18 != score_map_size(123, 255) == 17


@pytest.mark.parametrize("ex, inst", [(127, 255), (95, 191), (87, 87)])
def test_crop_sizes_on_the_network_stride_give_the_response_size(ex, inst):
    model = SiamFC(width=0.125)
    tracker = SiamFCTracker(model, TrackerConfig(exemplar_size=ex, instance_size=inst))
    side = model.score(model.embed(torch.zeros(1, 3, ex, ex)), model.embed(torch.zeros(1, 3, inst, inst))).shape[-1]
    assert side == tracker.response_size == score_map_size(ex, inst)


def test_exemplar_of_the_receptive_field_tracks():
    torch.manual_seed(0)
    tracker = SiamFCTracker(SiamFC(width=0.125), TrackerConfig(exemplar_size=MIN_IMAGE_SIZE))
    frame = np.random.default_rng(0).integers(0, 255, (120, 140, 3), dtype=np.uint8)
    result = tracker.track([frame, frame], [50, 40, 30, 20])
    assert result.boxes.shape == (2, 4) and np.isfinite(result.boxes).all()


# ---------------------------------------------------------------- OTB names


def _otb_sequence(folder, boxes, gt_name="groundtruth_rect.txt", size=(24, 32)):
    """An OTB folder: len(boxes) gray PNG frames in img/ and the boxes in ``gt_name``."""
    from PIL import Image

    (folder / "img").mkdir(parents=True, exist_ok=True)
    for i in range(len(boxes)):
        Image.fromarray(np.full(size, 40 * i % 255, np.uint8)).save(folder / "img" / f"{i + 1:04d}.png")
    (folder / gt_name).write_text("\n".join(",".join(str(v) for v in b) for b in boxes) + "\n")
    return folder


def test_duplicate_otb_sequence_names_are_refused(tmp_path):
    # A/groundtruth_rect.1.txt is sequence "A.1", and so is A.1/groundtruth_rect.txt: one of
    # them was dropped from every result keyed by name (results.json, the boxes)
    _otb_sequence(tmp_path / "A", [[1, 1, 4, 4]] * 2, "groundtruth_rect.1.txt")
    _otb_sequence(tmp_path / "A.1", [[2, 2, 4, 4]] * 2)
    with pytest.raises(DataError, match=r"two OTB sequences are named 'A\.1'.*groundtruth_rect\.1\.txt.*rename"):
        load_otb(tmp_path)
    (tmp_path / "A.1").rename(tmp_path / "B")
    assert [s.name for s in load_otb(tmp_path)] == ["A.1", "B"]


# ---------------------------------------------------------------- frames written to a folder


def _frames(n, value=0):
    return [np.full((16, 20, 3), value + i, np.uint8) for i in range(n)]


def test_writing_fewer_frames_into_a_folder_leaves_no_stale_frame(tmp_path):
    out = tmp_path / "frames"
    write_frames(_frames(5), out)
    (out / "notes.txt").write_text("mine")
    write_frames(_frames(3, value=100), out)
    # was: 00004.jpg and 00005.jpg of the first render stayed after the three new ones
    assert sorted(p.name for p in out.iterdir()) == ["00001.jpg", "00002.jpg", "00003.jpg", "notes.txt"]
    assert int(np.asarray(Image.open(out / "00003.jpg"))[0, 0, 0]) in range(100, 106)


def test_out_folder_that_is_the_frames_folder_is_refused(tmp_path, capsys):
    frames = tmp_path / "f"
    write_frames(_frames(3), frames)
    code, out, err = run_cli(["track", "--frames", frames, "--init-box", "2,2,8,8", "--method", "ncc",
                              "--out", tmp_path / "." / "f"], capsys)
    assert code == 2 and "is the --frames folder" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in frames.iterdir()) == ["00001.jpg", "00002.jpg", "00003.jpg"]


# ---------------------------------------------------------------- build-data into a used folder


def _build(out, test, **kw):
    return build_offline_dataset(out, num_train=0, num_test=test, test_frames=2, frame_size=(96, 96), **kw)


def test_build_data_again_into_its_folder_keeps_no_stale_sequence(tmp_path):
    _build(tmp_path / "d", 2)
    _build(tmp_path / "d", 1, seed=3)
    # was: the first build's second sequence stayed and was evaluated with the new one
    assert [s.name for s in load_otb(tmp_path / "d" / "test")] == ["Chelsea01"]
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["build.lock", "meta.json", "test"]


@pytest.mark.parametrize("foreign", ["notes.txt", "test/MySeq"])
def test_build_data_refuses_a_folder_with_files_it_did_not_write(tmp_path, foreign):
    _build(tmp_path / "d", 2)
    (tmp_path / "d" / foreign).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "d" / foreign).write_text("mine")
    with pytest.raises(ConfigError, match="is not empty.*did not write.*new or empty folder"):
        _build(tmp_path / "d", 1)
    assert len(load_otb(tmp_path / "d" / "test")) == 2  # nothing removed


def test_build_data_refuses_bad_sizes_before_removing_an_earlier_build(tmp_path):
    _build(tmp_path / "d", 1)
    with pytest.raises(ConfigError, match="at least 96"):
        build_offline_dataset(tmp_path / "d", 0, 1, test_frames=2, frame_size=(50, 50))
    assert len(load_otb(tmp_path / "d" / "test")) == 1


# ---------------------------------------------------------------- train --resume


@pytest.fixture(scope="module")
def train_seq():
    return siamfc_train_sequence()


def _cfg(tmp_path, epochs=2, **kw):
    return tiny_siamfc_config(tmp_path, epochs, **kw)


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory, train_seq):
    """A run directory of one finished epoch (of two) and its config."""
    root = tmp_path_factory.mktemp("resume")
    cfg = _cfg(root)
    train_siamfc(cfg, root / "run", sequences=[train_seq], progress=False, max_epochs=1)
    return root / "run", cfg


@pytest.mark.parametrize("layout", ["missing", "empty", "no-checkpoint"])
def test_resume_with_nothing_to_resume_is_refused(tmp_path, train_seq, layout):
    run_dir = tmp_path / "run"
    if layout != "missing":
        run_dir.mkdir()
    if layout == "no-checkpoint":
        (run_dir / "config.yaml").write_text("data_dir: x\n")
    # was: a fresh run from scratch, silently (a misspelt --run-dir)
    with pytest.raises(CheckpointError, match="nothing to resume in .*train without --resume"):
        train_siamfc(_cfg(tmp_path), run_dir, sequences=[train_seq], progress=False, resume=True)
    assert layout != "missing" or not run_dir.exists()


def test_resume_with_another_config_names_the_differing_keys(one_epoch, train_seq):
    run_dir, cfg = one_epoch
    other = cfg.model_copy(update={"lr": 0.02, "seed": 5,
                                   "pairs": cfg.pairs.model_copy(update={"radius": 8.0})})
    with pytest.raises(ConfigError, match=r"differs .* in lr, pairs\.radius, seed; resume with .*config\.yaml"):
        train_siamfc(other, run_dir, sequences=[train_seq], progress=False, resume=True)
    with pytest.raises(ConfigError, match="in width"):
        train_siamfc(cfg.model_copy(update={"width": 0.125}), run_dir, sequences=[train_seq],
                     progress=False, resume=True)


def test_resume_on_other_training_data_is_refused(one_epoch, train_seq):
    run_dir, cfg = one_epoch
    moved = Sequence(train_seq.name, train_seq.frames, train_seq.boxes + 1.0)
    with pytest.raises(ConfigError, match="training sequences differ"):
        train_siamfc(cfg, run_dir, sequences=[moved], progress=False, resume=True)


def test_resume_may_change_how_it_runs_and_then_finishes(tmp_path, train_seq):
    cfg = _cfg(tmp_path)
    train_siamfc(cfg, tmp_path / "run", sequences=[train_seq], progress=False, max_epochs=1)
    done = train_siamfc(cfg.model_copy(update={"threads": 1, "data_dir": str(tmp_path / ".")}), tmp_path / "run",
                        sequences=[train_seq], progress=False, resume=True)
    assert done["epochs"] == 2


# ---------------------------------------------------------------- track evaluate


GOOD = [[4, 4, 10, 8], [5, 4, 10, 8], [6, 5, 10, 8]]
FIRST_ONLY = [[4, 4, 10, 8], ["nan"] * 4, ["nan"] * 4]  # GOT-10k test style: nothing to score


class _Recorder:
    """A tracker that records which sequences it was asked to track."""

    def __init__(self):
        self.tracked = []

    def track(self, frames, init_box, progress=None):
        self.tracked.append(frames.name)
        raise AssertionError("tracked before the ground truth was checked")


def test_run_ope_checks_every_sequence_before_tracking_any(tmp_path):
    _otb_sequence(tmp_path / "Good", GOOD)
    _otb_sequence(tmp_path / "Zlast", FIRST_ONLY)
    _otb_sequence(tmp_path / "Zstart", [["nan"] * 4] + GOOD[1:])
    tracker = _Recorder()
    # was: Good (and Zlast) tracked first, then a ShapeError for Zlast; Zstart never reported
    with pytest.raises(DataError, match=r"'Zlast' has no valid ground-truth box after its first frame; "
                                        r"'Zstart' has no valid ground-truth box in its first frame"):
        run_ope(tracker, load_otb(tmp_path))
    assert tracker.tracked == []


def test_evaluate_refuses_bad_ground_truth_before_tracking(tmp_path, capsys):
    _otb_sequence(tmp_path / "data" / "Good", GOOD)
    _otb_sequence(tmp_path / "data" / "Zlast", FIRST_ONLY)
    code, out, err = run_cli(["track", "evaluate", tmp_path / "data", "--methods", "ncc",
                              "--out-dir", tmp_path / "eval"], capsys)
    assert code == 2 and "'Zlast' has no valid ground-truth box" in err
    assert "tracking" not in err and len(err.strip().splitlines()) == 1  # no progress bar: no tracking
    assert not (tmp_path / "eval").exists()


def test_evaluate_writes_each_method_as_it_finishes(tmp_path, capsys, monkeypatch):
    import dmlkit.apps.tracking as tracking

    _otb_sequence(tmp_path / "data" / "Good", GOOD)
    real, calls = tracking.run_ope, []

    def crash_on_the_second(tracker, *args, **kwargs):
        calls.append(type(tracker).__name__)
        if len(calls) == 2:
            raise DataError("disk gone mid-method")
        return real(tracker, *args, **kwargs)

    monkeypatch.setattr(tracking, "run_ope", crash_on_the_second)
    code, out, err = run_cli(["track", "evaluate", tmp_path / "data", "--methods", "ncc,untrained",
                              "--width", "0.0625", "--json", "--out-dir", tmp_path / "eval"], capsys)
    assert code == 2 and "disk gone" in err and calls == ["NCCTracker", "SiamFCTracker"]
    # was: nothing at all, the finished ncc run lost with the second method's failure
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert list(results) == ["ncc"] and results["ncc"]["num_frames"] == 3
    assert (tmp_path / "eval" / "boxes" / "ncc" / "Good.txt").read_text().count("\n") == 3
    assert (tmp_path / "eval" / "ope.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list((tmp_path / "eval").rglob("*.tmp*"))


def test_evaluate_into_a_used_folder_keeps_no_earlier_boxes(tmp_path, capsys):
    _otb_sequence(tmp_path / "data" / "Good", GOOD)
    out = tmp_path / "eval"
    (out / "boxes" / "untrained").mkdir(parents=True)  # an earlier evaluation's method ...
    (out / "boxes" / "untrained" / "Good.txt").write_text("1,1,1,1\n")
    (out / "boxes" / "ncc").mkdir()
    (out / "boxes" / "ncc" / "Gone.txt").write_text("1,1,1,1\n")  # ... and sequence
    (out / "notes.md").write_text("mine")
    code, _, err = run_cli(["track", "evaluate", tmp_path / "data", "--methods", "ncc", "--json",
                            "--out-dir", out], capsys)
    assert code == 0, err
    assert list(json.loads((out / "results.json").read_text())) == ["ncc"]
    assert sorted(p.relative_to(out / "boxes").as_posix() for p in (out / "boxes").rglob("*")) == ["ncc", "ncc/Good.txt"]
    assert (out / "notes.md").read_text() == "mine"  # not the evaluation's: kept


@pytest.mark.parametrize("argv, option", [
    (["evaluate", "{data}", "--methods", "ncc", "--seed", "3"], "--seed does not apply to --methods ncc"),
    (["evaluate", "{data}", "--methods", "ncc", "--scales", "5"], "--scales does not apply to --methods ncc"),
    (["evaluate", "{data}", "--methods", "ncc", "--device", "cpu"], "--device does not apply"),
    (["evaluate", "{data}", "--methods", "ncc", "--threads", "1"], "--threads does not apply"),
    (["evaluate", "{data}", "--methods", "ncc", "--weights", "{data}"], "--weights does not apply"),
    (["evaluate", "{data}", "--methods", "ncc,siamfc", "--weights", "{data}", "--width", "0.5"],
     "--width does not apply to --methods ncc,siamfc"),
    (["evaluate", "{data}", "--methods", "untrained", "--weights", "{data}", "--width", "0.5"],
     "--weights does not apply with --width"),
    (["--frames", "{data}/Good/img", "--init-box", "4,4,10,8", "--weights", "{data}", "--seed", "3"],
     "--seed does not apply to --method siamfc"),
])
def test_options_no_chosen_tracker_uses_are_refused(tmp_path, capsys, argv, option):
    # were silently ignored (evaluate checked none of them; track only those of --method ncc)
    data = _otb_sequence(tmp_path / "data" / "Good", GOOD).parent
    code, out, err = run_cli(["track", *(a.format(data=data) for a in argv)], capsys)
    assert code == 2 and option in err and len(err.strip().splitlines()) == 1, err
