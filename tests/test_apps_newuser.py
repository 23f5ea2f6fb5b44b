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
