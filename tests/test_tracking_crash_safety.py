"""Crash safety of the tracking application: ``track train`` started afresh into a folder that
holds a run, ``track build-data`` interrupted part-way, and renders interrupted while written.
Interruptions are simulated by an exception raised at the point a kill would hit."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from PIL import Image

from _reference import siamfc_train_sequence, tiny_siamfc_config
from dmlkit.apps.tracking.datasets import load_got10k, load_otb
from dmlkit.apps.tracking.offline import build_offline_dataset
from dmlkit.apps.tracking.render import write_frames
from dmlkit.apps.tracking.training import train_siamfc
from dmlkit.exceptions import CheckpointError, DataError


class Killed(Exception):
    """Stands for a SIGKILL at the point it is raised."""


def _interrupt_call(monkeypatch, owner, name, at):
    """Make ``owner.name`` raise :class:`Killed` on its ``at``-th call."""
    real, calls = getattr(owner, name), []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            raise Killed
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupted)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------- track train into a used folder


@pytest.fixture(scope="module")
def train_seq():
    return siamfc_train_sequence()


def _cfg(tmp_path, epochs=1, **kw):
    return tiny_siamfc_config(tmp_path, epochs, **kw)


def test_fresh_train_into_a_run_is_refused_and_a_checkpoint_of_another_config_not_resumed(tmp_path, train_seq):
    run_dir, old = tmp_path / "run", _cfg(tmp_path)
    train_siamfc(old, run_dir, sequences=[train_seq], progress=False)
    config_before, log_before = (run_dir / "config.yaml").read_text(), (run_dir / "log.jsonl").read_text()
    new = _cfg(tmp_path, lr=0.001, lr_end=0.001, epochs=2)
    # was: config.yaml rewritten and log.jsonl emptied at once, the old last.pt and metrics.json
    # kept until the first epoch ended; a kill, then --resume, continued the OLD weights
    with pytest.raises(CheckpointError, match="already holds a run .*pass --resume .*another run directory"):
        train_siamfc(new, run_dir, sequences=[train_seq], progress=False)
    assert (run_dir / "config.yaml").read_text() == config_before
    assert (run_dir / "log.jsonl").read_text() == log_before and (run_dir / "metrics.json").is_file()
    # a folder an older version left so (new config.yaml, old checkpoint): resume is refused
    (run_dir / "config.yaml").write_text(yaml.safe_dump(new.model_dump(), sort_keys=False))
    with pytest.raises(CheckpointError, match="last.pt was trained with another config .*differ in epochs, lr"):
        train_siamfc(new, run_dir, sequences=[train_seq], progress=False, resume=True)


# ---------------------------------------------------------------- build-data interrupted part-way


def _build(out):
    return build_offline_dataset(out, num_train=2, num_test=1, train_frames=2, test_frames=2,
                                 frame_size=(96, 96))


def test_an_interrupted_build_is_refused_by_the_loaders_and_cleared_by_a_rerun(tmp_path, monkeypatch):
    out = tmp_path / "d"
    _interrupt_call(monkeypatch, Image.Image, "save", 4)  # the 2nd training sequence's 2nd frame
    with pytest.raises(Killed):
        _build(out)
    monkeypatch.undo()
    assert sorted(p.name for p in (out / "train").iterdir()) == ["GOT-10k_Train_000001", "GOT-10k_Train_000002"]
    # was: the one complete sequence read without a word (the half-written one has no groundtruth.txt)
    for load in (lambda: load_got10k(out / "train"), lambda: load_got10k(out), lambda: load_otb(out / "test")):
        with pytest.raises(DataError, match="unfinished `dmlkit track build-data`.*run the same build-data"):
            load()
    # was: refused, the folder said to hold sequences "an earlier build-data did not write"
    _build(out)
    assert [s.name for s in load_got10k(out)] == ["GOT-10k_Train_000001", "GOT-10k_Train_000002"]
    assert len(load_otb(out / "test")) == 1
    (out / "test" / "Chelsea01").rename(out / "test" / "Mine")
    with pytest.raises(DataError, match="does not match .*meta.json: it lacks 1 of the sequences"):
        load_otb(out / "test")


# ---------------------------------------------------------------- renders interrupted while written


def _moving(n, value=40):
    frames = []
    for i in range(n):
        a = np.full((48, 64, 3), value, np.uint8)
        a[10 + i:20 + i, 10 + i:20 + i] = 230
        frames.append(a)
    return frames


def _first_pixel(path):
    """The first frame's top-left red value and the number of frames of an image file."""
    with Image.open(path) as im:
        return int(np.asarray(im.convert("RGB"))[0, 0, 0]), getattr(im, "n_frames", 1)


def test_an_interrupted_render_leaves_the_earlier_gif_and_frames_whole(tmp_path, monkeypatch):
    from PIL import ImageFile

    gif, folder = tmp_path / "out.gif", tmp_path / "frames"
    write_frames(_moving(6), gif)
    write_frames(_moving(6), folder)
    _interrupt_call(monkeypatch, ImageFile, "_save", 3)  # inside the GIF's third frame
    with pytest.raises(Killed):
        write_frames(_moving(6, value=90), gif)
    # was: the GIF written in place, a shorter one that still opens (2 frames of the new render)
    value, count = _first_pixel(gif)
    assert count == 6 and value < 60
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left
    monkeypatch.undo()
    _interrupt_call(monkeypatch, Image.Image, "save", 3)
    with pytest.raises(Killed):
        write_frames(_moving(4, value=90), folder)
    # was: the earlier frames removed first, then two new ones: a shorter render that reads as whole
    assert sorted(p.name for p in folder.iterdir()) == [f"{i:05d}.jpg" for i in range(1, 7)]
    assert _first_pixel(folder / "00001.jpg")[0] < 60
    monkeypatch.undo()
    write_frames(_moving(4, value=90), folder)
    assert sorted(p.name for p in folder.iterdir()) == [f"{i:05d}.jpg" for i in range(1, 5)]
