"""Tracking data: GOT-10k / OTB readers on real-format fixtures, videos, the offline builder,
training pairs, one training run and the checkpoint round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from dmlkit.apps.tracking import (
    SiamFC,
    SiamFCPairs,
    SiamFCTrainConfig,
    load_got10k,
    load_otb,
    load_siamfc,
    make_sequence,
    offline_specs,
    read_boxes,
    read_video,
    save_siamfc,
    train_siamfc,
    write_frames,
)
from dmlkit.apps.tracking.datasets import Sequence
from dmlkit.apps.tracking.offline import (
    TEST_BACKGROUNDS,
    TEST_OBJECTS,
    TRAIN_BACKGROUNDS,
    TRAIN_OBJECTS,
)
from dmlkit.exceptions import CheckpointError, ConfigError, DataError, DataNotFoundError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def small_seq():
    spec = offline_specs("train", 1, num_frames=12, seed=3, frame_size=(160, 120))[0]
    return make_sequence(spec)


def _write_frames(folder, frames, digits):
    folder.mkdir(parents=True, exist_ok=True)
    for i, f in enumerate(frames):
        Image.fromarray(f).save(folder / f"{i + 1:0{digits}d}.jpg", quality=95)


def test_otb_layout_reader(tmp_path, small_seq):
    seq_dir = tmp_path / "Walker"
    _write_frames(seq_dir / "img", small_seq.frames[:4], 4)
    one_based = small_seq.boxes[:4] + [1, 1, 0, 0]  # OTB's files are 1-based (MATLAB)
    rows = ["\t".join(str(int(v)) for v in b) for b in one_based]
    (seq_dir / "groundtruth_rect.txt").write_text("\n".join(rows) + "\n")
    (seq_dir / "groundtruth_rect.2.txt").write_text(
        "\n".join(" ".join(str(int(v)) for v in b) for b in one_based))
    (tmp_path / "notes").mkdir()  # folders that are not sequences are ignored
    seqs = load_otb(tmp_path)
    assert [s.name for s in seqs] == ["Walker", "Walker.2"]
    np.testing.assert_array_equal(seqs[0].boxes, small_seq.boxes[:4])
    frame = seqs[0].frame(2)
    assert frame.shape == (120, 160, 3) and frame.dtype == np.uint8
    assert np.abs(frame.astype(int) - small_seq.frames[2]).mean() < 4  # JPEG round trip
    (seq_dir / "groundtruth_rect.2.txt").write_text("1,2,3,4\n")
    with pytest.raises(DataError, match="4 frames"):
        load_otb(tmp_path)
    with pytest.raises(DataNotFoundError):
        load_otb(tmp_path / "missing")


def test_got10k_layout_reader_with_absent_frames(tmp_path, small_seq):
    seq_dir = tmp_path / "train" / "GOT-10k_Train_000001"
    _write_frames(seq_dir, small_seq.frames[:5], 8)
    (seq_dir / "groundtruth.txt").write_text(
        "\n".join(",".join(f"{v:.4f}" for v in b) for b in small_seq.boxes[:5]))
    (seq_dir / "absence.label").write_text("0\n0\n1\n0\n0\n")
    seqs = load_got10k(tmp_path)
    assert len(seqs) == 1 and len(seqs[0]) == 5
    assert np.isnan(seqs[0].boxes[2]).all()
    assert seqs[0].valid.tolist() == [True, True, False, True, True]
    with pytest.raises(DataNotFoundError, match="GOT-10k"):
        load_got10k(tmp_path / "train" / "GOT-10k_Train_000001")
    assert len(load_got10k(tmp_path, "train")) == 1
    # a misspelt split is an error naming the folders (it silently read the root instead)
    with pytest.raises(DataNotFoundError, match=r"split folder .*trian does not exist.*\['train'\]"):
        load_got10k(tmp_path, "trian")
    with pytest.raises(DataNotFoundError, match="has no split folders"):
        load_got10k(tmp_path / "train", "val")


def test_read_boxes_rejects_polygons(tmp_path):
    p = tmp_path / "gt.txt"
    p.write_text("1,2,3,4,5,6,7,8\n")
    with pytest.raises(DataError, match="polygon"):
        read_boxes(p)


def test_gif_and_mp4_round_trip_and_frame_folders(tmp_path, small_seq):
    frames = small_seq.frames[:5]
    gif = write_frames(iter(frames), tmp_path / "out.gif", fps=10)
    read, _ = read_video(gif)
    assert len(read) == 5 and read[0].shape == (120, 160, 3)
    mp4 = write_frames(iter(frames), tmp_path / "out.mp4", fps=10)
    read, fps = read_video(mp4)
    assert len(read) == 5 and fps == pytest.approx(10)
    folder = write_frames(iter(frames), tmp_path / "frames")
    paths, fps = read_video(folder)
    assert len(paths) == 5 and fps is None
    with pytest.raises(ConfigError):
        write_frames(iter(frames), tmp_path / "out.xyz")


def test_offline_builder_is_seeded_exact_and_disjoint(small_seq):
    spec = offline_specs("train", 1, num_frames=12, seed=3, frame_size=(160, 120))[0]
    again = make_sequence(spec)
    assert all(np.array_equal(a, b) for a, b in zip(small_seq.frames, again.frames))
    np.testing.assert_array_equal(small_seq.boxes, again.boxes)
    b = small_seq.boxes
    assert (b[:, 0] >= 0).all() and (b[:, 1] >= 0).all()
    assert (b[:, 0] + b[:, 2] <= 160).all() and (b[:, 1] + b[:, 3] <= 120).all()
    ratio = b[:, 2] * b[:, 3] / (b[0, 2] * b[0, 3])
    assert ratio.min() >= 0.6**2 * 0.8 and ratio.max() <= 1.6**2 * 1.2  # integer rounding
    assert not set(TRAIN_OBJECTS) & set(TEST_OBJECTS)
    assert not set(TRAIN_BACKGROUNDS) & set(TEST_BACKGROUNDS)
    other = make_sequence(offline_specs("train", 1, num_frames=12, seed=4, frame_size=(160, 120))[0])
    assert not np.array_equal(other.boxes, small_seq.boxes)


def test_offline_target_pixels_are_the_photo_crop_inside_the_box(small_seq):
    """Frames differ from their neighbours inside the moving box: the box tracks the object."""
    diffs = []
    for t in range(1, len(small_seq)):
        x, y, w, h = small_seq.boxes[t].astype(int)
        frame = small_seq.frames[t].astype(float)
        inside = frame[y:y + h, x:x + w].std()
        diffs.append(inside)
    assert min(diffs) > 5.0  # a textured real crop, not a flat fill


def test_pairs_are_deterministic_with_shifted_labels(small_seq):
    pairs = SiamFCPairs([small_seq], pairs_per_epoch=4, seed=0)
    z, x, labels, weights = pairs[1]
    assert z.shape == (3, 127, 127) and x.shape == (3, 255, 255)
    assert labels.shape == weights.shape == (1, 17, 17)
    assert weights.sum() == pytest.approx(1.0)
    z2, x2, labels2, _ = pairs[1]
    assert torch.equal(z, z2) and torch.equal(x, x2) and torch.equal(labels, labels2)
    pairs.set_epoch(1)
    assert not torch.equal(pairs[1][1], x)
    with pytest.raises(DataError):
        SiamFCPairs([Sequence("one", small_seq.frames[:1], small_seq.boxes[:1])], 4)


def test_training_lowers_the_loss_and_checkpoint_round_trips(tmp_path, small_seq):
    cfg = SiamFCTrainConfig(data_dir=str(tmp_path), width=0.125, epochs=2, pairs_per_epoch=2,
                            batch_size=2, lr=0.01, lr_end=0.005, seed=0)
    result = train_siamfc(cfg, tmp_path / "run", sequences=[small_seq], progress=False)
    assert result["steps"] == 2
    assert (tmp_path / "run" / "log.jsonl").read_text().count("\n") == 2
    model, tracker_cfg = load_siamfc(tmp_path / "run")
    assert model.width == 0.125 and tracker_cfg.num_scales == 3
    z = torch.rand(1, 3, 127, 127) * 255
    x = torch.rand(1, 3, 255, 255) * 255
    path = save_siamfc(tmp_path / "copy.pt", model)
    again, _ = load_siamfc(path)
    with torch.no_grad():
        torch.testing.assert_close(model(z, x), again(z, x))
    torch.save({"model": {}}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError):
        load_siamfc(tmp_path / "other.pt")


def test_weights_that_diverge_are_neither_saved_nor_tracked_with(tmp_path, small_seq, monkeypatch):
    """lr 1e30 trained NaN weights (the loss is checked before each update, not after the last),
    saved them, and the tracker then scored NaN maps to a confident 0.175 AUC."""
    from dmlkit.apps.tracking import SiamFCTracker
    from dmlkit.exceptions import NonFiniteError

    step = torch.optim.SGD.step

    def diverging_step(self, *args, **kwargs):  # the last update overflows, as lr 1e30 made it
        out = step(self, *args, **kwargs)
        self.param_groups[0]["params"][0].data.fill_(float("inf"))
        return out

    monkeypatch.setattr(torch.optim.SGD, "step", diverging_step)
    cfg = SiamFCTrainConfig(data_dir=str(tmp_path), width=0.125, epochs=1, pairs_per_epoch=2,
                            batch_size=2, lr=0.01, lr_end=0.01, seed=0)
    with pytest.raises(NonFiniteError, match="weights became NaN or infinite"):
        train_siamfc(cfg, tmp_path / "run", sequences=[small_seq], progress=False)
    monkeypatch.undo()
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
    model = SiamFC(width=0.125)
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    frames = [np.full((120, 160, 3), 128, np.uint8)] * 2
    with pytest.raises(NonFiniteError, match="not finite"):
        SiamFCTracker(model).track(frames, np.array([60.0, 40.0, 30.0, 30.0]))


def test_overfitting_one_batch_lowers_the_logistic_loss(small_seq):
    from dmlkit.apps.tracking import logistic_loss

    torch.manual_seed(0)
    pairs = SiamFCPairs([small_seq], pairs_per_epoch=4, seed=1)
    z, x, labels, weights = (torch.stack(t) for t in zip(*[pairs[i] for i in range(4)]))
    model = SiamFC(width=0.125)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    losses = []
    for _ in range(12):
        loss = logistic_loss(model(z, x), labels, weights)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(b < a for a, b in zip(losses, losses[1:]))  # monotone on a fixed batch
    assert losses[-1] < 0.85 * losses[0]


def test_config_yaml_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("data_dir: d\nwidth: 0.5\npairs:\n  radius: 8\n")
    cfg = SiamFCTrainConfig.from_yaml(p, ["epochs=3", "pairs.max_shift=4"])
    assert cfg.epochs == 3 and cfg.pairs.radius == 8 and cfg.pairs.max_shift == 4
    p.write_text("data_dir: d\nwidht: 0.5\n")
    with pytest.raises(ConfigError):
        SiamFCTrainConfig.from_yaml(p)


def test_trackers_accept_image_paths(tmp_path, small_seq):
    from dmlkit.apps.tracking import NCCTracker, annotate

    _write_frames(tmp_path / "f", small_seq.frames[:3], 4)
    paths, _ = read_video(tmp_path / "f")
    result = NCCTracker().track(paths, small_seq.boxes[0])
    assert result.boxes.shape == (3, 4)
    drawn = list(annotate(paths, result.boxes, small_seq.boxes[:3]))
    assert drawn[0].shape == (120, 160, 3)


def test_resume_gives_the_weights_of_an_uninterrupted_run(tmp_path, small_seq):
    cfg = SiamFCTrainConfig(data_dir=str(tmp_path), width=0.125, epochs=2, pairs_per_epoch=4,
                            batch_size=2, lr=0.01, lr_end=0.005, seed=0)
    full = train_siamfc(cfg, tmp_path / "full", sequences=[small_seq], progress=False)
    part = train_siamfc(cfg, tmp_path / "part", sequences=[small_seq], progress=False, max_epochs=1)
    assert part["steps"] == 2 and part["epochs"] == 1
    done = train_siamfc(cfg, tmp_path / "part", sequences=[small_seq], progress=False, resume=True)
    assert done["steps"] == full["steps"] == 4
    assert (tmp_path / "part" / "log.jsonl").read_text().count("\n") == 4
    a, _ = load_siamfc(tmp_path / "full")
    b, _ = load_siamfc(tmp_path / "part")
    for (name, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(va, vb, msg=name)
    with pytest.raises(ConfigError, match="in width"):  # the run's config, checked on resume
        train_siamfc(cfg.model_copy(update={"width": 0.25}), tmp_path / "part",
                     sequences=[small_seq], progress=False, resume=True)
